package routing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/balancer"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"
)

func newDecider(t testing.TB, cfg *config.Config, o Options) *Decider {
	t.Helper()
	if o.Endpoints == nil {
		o.Endpoints = staticSource(t)
	}
	if o.Logger == nil {
		o.Logger = quiet()
	}
	e, err := New(cfg, o)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestTraceID(t *testing.T) {
	e := newDecider(t, configFor(t, "", ""), Options{})
	body := chatBody("s", "u")
	for _, c := range []struct {
		h    hdr
		want string
	}{
		{hdr{"x-request-id": "a", "x-trace-id": "b", "x-amzn-trace-id": "c"}, "a"},
		{hdr{"x-trace-id": "b", "x-amzn-trace-id": "c"}, "b"},
		{hdr{"x-amzn-trace-id": "Root=1-5759e988"}, "Root=1-5759e988"},
		{hdr{"x-request-id": ""}, ""},
	} {
		d, err := e.Decide(context.Background(), c.h, body)
		if err != nil {
			t.Fatal(err)
		}
		if c.want != "" && d.TraceID != c.want {
			t.Fatalf("%v: trace %q", c.h, d.TraceID)
		}
		if c.want == "" && len(d.TraceID) != 36 {
			t.Fatalf("generated trace id %q is not a UUID", d.TraceID)
		}
	}
	// Errors carry the trace id too.
	_, err := e.Decide(context.Background(), hdr{"x-request-id": "t-err"}, []byte(`{`))
	var ee *Error
	if !errors.As(err, &ee) || ee.TraceID != "t-err" {
		t.Fatalf("err %v", err)
	}
}

func TestRefusals(t *testing.T) {
	m := &counts{}
	e := newDecider(t, configFor(t, "", "max_body_bytes: 4096"), Options{Metrics: m})
	cases := []struct {
		h      hdr
		body   string
		status int
		typ    string
		msg    string
	}{
		{chatPath(), `{"model":"qwen","messages":[`, 400, "bad_request", "invalid JSON"},
		{chatPath(), `{"messages":[{"role":"user","content":"x"}]}`, 400, "bad_request", `missing required field "model"`},
		{chatPath(), `{"model":"llama","messages":[{"role":"user","content":"x"}]}`, 404, "not_found", `model not found: "llama"`},
		{chatPath(), `{"model":"lonely","messages":[{"role":"user","content":"x"}]}`, 404, "not_found", "no rule of model \"lonely\" matches"},
		{chatPath(), `{"model":"ghost","messages":[{"role":"user","content":"x"}]}`, 404, "not_found", `no available endpoint in cluster "empty"`},
		{chatPath(), `{"model":"qwen","lora":"sql","messages":[{"role":"user","content":"x"}]}`, 404, "not_found", `matching label selector {"lora":"sql"}`},
		{chatPath(), `{"model":"qwen","messages":[{"role":"user","content":"` + strings.Repeat("x", 5000) + `"}]}`, 413, "payload_too_large", "exceeds max_body_bytes (4096)"},
		{hdr{":path": "/v1/files"}, `{"purpose":"batch"}`, 404, "not_found", "unsupported path"},
		{hdr{":path": "/v1/embeddings"}, `{"model":"llama","input":"x"}`, 404, "not_found", `model not found: "llama"`},
		{hdr{":path": "/v1/responses"}, `{"model":"qwen","input":`, 400, "bad_request", "invalid JSON"},
	}
	for _, c := range cases {
		d, err := e.Decide(context.Background(), c.h, []byte(c.body))
		var ee *Error
		if d != nil || !errors.As(err, &ee) {
			t.Fatalf("%.60s: decision %v err %v", c.body, d, err)
		}
		if ee.Status != c.status || ee.Type != c.typ || !strings.Contains(ee.Message, c.msg) {
			t.Errorf("%.60s: got %d %s %q", c.body, ee.Status, ee.Type, ee.Message)
		}
		var wire struct {
			Error struct {
				Code          int
				Type, Message string
			} `json:"error"`
			TraceID string `json:"trace_id"`
		}
		if err := json.Unmarshal(ee.JSON(), &wire); err != nil || wire.Error.Code != c.status || wire.Error.Type != c.typ ||
			wire.Error.Message != ee.Message || wire.TraceID != ee.TraceID || wire.TraceID == "" {
			t.Errorf("JSON %s", ee.JSON())
		}
	}
	if m.Get("rejected") != int64(len(cases)) || m.Get("routed") != 0 {
		t.Fatalf("metrics %v", m)
	}

	// An unregistered protocol fails every request with 400 (seed step 2).
	cfg := configFor(t, "", "")
	cfg.Protocol = "grpc"
	e2 := newDecider(t, cfg, Options{})
	_, err := e2.Decide(context.Background(), chatPath(), chatBody("s", "u"))
	var ee *Error
	if !errors.As(err, &ee) || ee.Status != 400 || !strings.Contains(ee.Message, `unsupported protocol "grpc"`) {
		t.Fatalf("err %v", err)
	}
	if _, err := New(cfg, Options{}); err == nil {
		t.Fatal("decider without endpoints accepted")
	}
}

func TestHeaderRuleAndSelectors(t *testing.T) {
	e := newDecider(t, configFor(t, "", ""), Options{})
	d, err := e.Decide(context.Background(), hdr{":path": "/v1/chat/completions", "x-env": "canary"}, chatBody("s", "u"))
	if err != nil || d.Cluster != "canary" || d.Host != "10.0.9.9:8000" || d.SceneName != "canary" {
		t.Fatalf("%+v %v", d, err)
	}
	// Labelled endpoints: the request's lora selects among them.
	src := labelled{cluster: {
		{Address: "10.1.0.1:8000", Labels: map[string]string{"lora": "sql"}},
		{Address: "10.1.0.2:8000", Labels: map[string]string{"lora": "chat"}},
	}}
	e2 := newDecider(t, configFor(t, "", ""), Options{Endpoints: src})
	for range 20 {
		d, err := e2.Decide(context.Background(), chatPath(), []byte(`{"model":"qwen","lora":"sql","messages":[{"role":"user","content":"x"}]}`))
		if err != nil || d.Host != "10.1.0.1:8000" || d.Candidates != 1 {
			t.Fatalf("%+v %v", d, err)
		}
	}
}

type labelled map[string][]endpoints.Endpoint

func (l labelled) Endpoints(c string) []endpoints.Endpoint {
	return append([]endpoints.Endpoint(nil), l[c]...)
}

func TestDegradesWhenMetadataCenterIsDown(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	addr := dead.URL
	dead.Close()
	m := &counts{}
	e := newDecider(t, configFor(t, addr, ""), Options{Metrics: m})
	seen := map[string]bool{}
	for range 60 {
		d, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u"))
		if err != nil {
			t.Fatal(err)
		}
		if !d.Degraded || d.CacheRatio != 0 {
			t.Fatalf("%+v", d)
		}
		seen[d.Host] = true
	}
	if len(seen) != len(pods) {
		t.Fatalf("degraded routing reached only %v", seen)
	}
	if m.Get("fallbacks") != 60 || m.Get("metadata_center_errors") != 60 || m.Get("routed") != 60 {
		t.Fatalf("metrics %v", m)
	}
}

func TestQueryTimeoutBoundsDecide(t *testing.T) {
	release := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(slow.Close)
	t.Cleanup(func() { close(release) })
	cfg := configFor(t, slow.URL, "")
	cfg.MetadataCenter.QueryTimeout = 50 * time.Millisecond
	e := newDecider(t, cfg, Options{})
	start := time.Now()
	d, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u"))
	if err != nil || !d.Degraded {
		t.Fatalf("%+v %v", d, err)
	}
	if took := time.Since(start); took > 2*time.Second { // generous: it must not wait for the server
		t.Fatalf("Decide took %v with a 50ms query timeout", took)
	}
}

func TestPoliciesThatNeedNoMetadataSkipTheQuery(t *testing.T) {
	r := &routingtest.Querier{}
	cfg := configFor(t, "", fmt.Sprintf("lb_mapping_rule: {%q: {policy: round_robin}}", cluster))
	e := newDecider(t, cfg, Options{Querier: r})
	var hosts []string
	for range 6 {
		d, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u"))
		if err != nil {
			t.Fatal(err)
		}
		if d.Policy != "round_robin" || d.Degraded {
			t.Fatalf("%+v", d)
		}
		hosts = append(hosts, d.Host)
	}
	if r.Queries() != 0 {
		t.Fatalf("round_robin queried the metadata center %d times", r.Queries())
	}
	if fmt.Sprint(hosts[:3]) != fmt.Sprint(hosts[3:]) || hosts[0] == hosts[1] || hosts[1] == hosts[2] {
		t.Fatalf("round robin order %v", hosts)
	}
	// The default rule of another cluster still uses cache_aware and queries.
	d, err := e.Decide(context.Background(), hdr{":path": "/v1/chat/completions", "x-env": "canary"}, chatBody("s", "u"))
	if err != nil || d.Policy != "cache_aware" || r.Queries() != 1 {
		t.Fatalf("%+v %v (queries %d)", d, err, r.Queries())
	}
}

func TestTritonBackendRewritesRequest(t *testing.T) {
	e := newDecider(t, configFor(t, "", ""), Options{})
	d, err := e.Decide(context.Background(), chatPath(), []byte(`{"model":"tiny","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if d.Backend != "triton" || d.Path != "/v2/models/tiny/generate_stream" || d.Response == nil || !strings.Contains(string(d.Body), `"text_input":"user: hi\nassistant:"`) {
		t.Fatalf("%+v body %s", d, d.Body)
	}
	out, err := d.Response.Chunk([]byte("data: {\"text_output\":\"yo\"}\n\n"))
	if err != nil || !strings.Contains(string(out), `"content":"yo"`) {
		t.Fatalf("chunk %q %v", out, err)
	}
	// protocol: triton translates whatever the rule's backend.
	cfg := configFor(t, "", "")
	cfg.Protocol = "triton"
	e2 := newDecider(t, cfg, Options{})
	d, err = e2.Decide(context.Background(), chatPath(), chatBody("s", "u"))
	if err != nil || d.Path != "/v2/models/qwen/generate_stream" {
		t.Fatalf("%+v %v", d, err)
	}
}

// blockingUpdater holds every update until released.

func TestNilHeadersAndRateLimitedWarnings(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	addr := dead.URL
	dead.Close()
	var buf strings.Builder
	var mu sync.Mutex
	log := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return buf.Write(p)
	}), nil))
	e := newDecider(t, configFor(t, addr, ""), Options{Logger: log})
	for range 20 {
		if _, err := e.Decide(context.Background(), nil, chatBody("s", "u")); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if n := strings.Count(buf.String(), "route query failed"); n != 1 {
		t.Fatalf("%d warnings for 20 failures in well under a second:\n%s", n, buf.String())
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// lastPod scores the last candidate best: a scorer registered from Go.
type lastPod struct{}

func (lastPod) Name() string { return "last_pod" }
func (lastPod) Score(s *balancer.State, out []float64) {
	for i := range out {
		out[i] = float64(i) / float64(len(out))
	}
}

// An lb rule may name scorers registered from Go; names nobody registered
// fail New, not every request.
func TestLBRuleNamesAreCheckedAtStart(t *testing.T) {
	for _, extra := range []string{
		"lb_mapping_rule: {default: {policy: nope}}",
		"lb_mapping_rule: {default: {policy: epp, scorers: {last_pod: 1}}}",
		"lb_mapping_rule: {" + cluster + ": {picker: best_guess}}",
	} {
		_, err := New(configFor(t, "", extra), Options{Endpoints: staticSource(t), Logger: quiet()})
		if err == nil || !strings.Contains(err.Error(), "lb_mapping_rule") {
			t.Fatalf("%s: New = %v, want an lb_mapping_rule error", extra, err)
		}
	}
	e := newDecider(t, configFor(t, "", "lb_mapping_rule: {default: {policy: epp, scorers: {last_pod: 1}}}"),
		Options{Scorers: map[string]balancer.Scorer{"last_pod": lastPod{}}})
	eps := e.src.Endpoints(cluster)
	for range 5 {
		d, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u"))
		if err != nil {
			t.Fatal(err)
		}
		if d.Host != eps[len(eps)-1].Address {
			t.Fatalf("chose %s, want the last pod %s", d.Host, eps[len(eps)-1].Address)
		}
	}
}

// Every OpenAI-compatible path goes to the model's cluster; a body with a
// prompt is hashed, one without is routed by load (no hashes).
func TestEveryOpenAIPathRoutesByModel(t *testing.T) {
	e := newDecider(t, configFor(t, "", ""), Options{})
	want, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u"))
	if err != nil {
		t.Fatal(err)
	}
	audio := "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF....\r\n" +
		"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nqwen\r\n--XyZ--\r\n"
	for _, c := range []struct {
		h      hdr
		body   string
		hashed bool
	}{
		{hdr{":path": "/v1/responses"}, `{"model":"qwen","instructions":"s","input":"u"}`, true},
		{hdr{":path": "/v1/messages"}, `{"model":"qwen","max_tokens":8,"system":"s","messages":[{"role":"user","content":"u"}]}`, true},
		{hdr{":path": "/v1/embeddings"}, `{"model":"qwen","input":["a","b"]}`, true},
		{hdr{":path": "/rerank"}, `{"model":"qwen","query":"q","documents":["a"]}`, true},
		{hdr{":path": "/v1/score"}, `{"model":"qwen","text_1":"q","text_2":"a"}`, true},
		{hdr{":path": "/v1/audio/transcriptions", "content-type": "multipart/form-data; boundary=XyZ"}, audio, false},
		{hdr{":path": "/v1/messages/count_tokens"}, `{"model":"qwen","messages":[]}`, false},
	} {
		d, err := e.Decide(context.Background(), c.h, []byte(c.body))
		if err != nil {
			t.Fatalf("%s: %v", c.h[":path"], err)
		}
		if d.Cluster != want.Cluster || d.Model != "qwen" || d.Host == "" || d.Body != nil || d.Path != "" {
			t.Fatalf("%s: decision %+v", c.h[":path"], d)
		}
		if (len(d.Hashes) > 0) != c.hashed || (d.PromptLength > 0) != c.hashed {
			t.Fatalf("%s: hashes %v, want hashed=%v", c.h[":path"], d.Hashes, c.hashed)
		}
	}
	// The same prompt through the Responses API hashes as the chat request.
	d, err := e.Decide(context.Background(), hdr{":path": "/v1/responses"}, []byte(`{"model":"qwen","instructions":"s","input":"u"}`))
	if err != nil || fmt.Sprint(d.Hashes) != fmt.Sprint(want.Hashes) {
		t.Fatalf("responses hashes %v, chat %v (%v)", d.Hashes, want.Hashes, err)
	}
}
