package llmfilter

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/standalone"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// countMetrics records what the filter, routing and lifecycle count; of
// histograms and the labelled request counter, how many values each got.
type countMetrics struct {
	mu sync.Mutex
	m  map[string]int64
}

func (c *countMetrics) Count(name string, delta int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]int64{}
	}
	c.m[name] += delta
}

func (c *countMetrics) Observe(histogram string, _ gatewaymetrics.HistLabels, _ time.Duration) {
	c.Count("observed "+histogram, 1)
}

func (c *countMetrics) Request(l gatewaymetrics.RequestLabels) { c.Count("request "+l.Outcome, 1) }

func (c *countMetrics) get(name string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[name]
}

// baseConfig routes model "qwen" (vllm) and "tri" (triton) to a static pool
// of two pods, round robin: no metadata center needed for the unit tests.
func baseConfig(extra string) string {
	return `
protocol: openai
model_mapping_rule:
  qwen:
    - cluster: pool
      backend: vllm
  tri:
    - cluster: pool
      backend: triton
  empty:
    - cluster: nowhere
lb_mapping_rule:
  default: {policy: round_robin}
endpoints:
  static: {pool: [127.0.0.1:9001, 127.0.0.1:9002], nowhere: []}
max_body_bytes: 4096
` + extra
}

func newTestConfig(t *testing.T, doc string) (*Config, *countMetrics) {
	t.Helper()
	cfg, err := config.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	m := &countMetrics{}
	p := NewParser(ParserOptions{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	conf, err := p.Build(cfg, m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conf.Destroy)
	return conf, m
}

// stream drives one filter the way Envoy does.
type stream struct {
	t *testing.T
	e *fakeEnvoy
	f *filter
}

func newStream(t *testing.T, conf *Config) *stream {
	e := newFakeEnvoy(t)
	f, ok := Factory(conf, e).(*filter)
	if !ok {
		t.Fatal("factory did not return the llm filter")
	}
	t.Cleanup(e.check)
	return &stream{t: t, e: e, f: f}
}

func (s *stream) phase(encoding bool, fn func() api.StatusType) api.StatusType {
	s.e.enter(encoding)
	st := fn()
	s.e.leave(st)
	return st
}

func reqHeaders(kv ...string) *standalone.RequestHeaders {
	r := httptest.NewRequest("POST", "/v1/chat/completions", nil)
	r.Header.Del("content-length")
	for i := 0; i+1 < len(kv); i += 2 {
		r.Header.Set(kv[i], kv[i+1])
	}
	return standalone.NewRequestHeaders(r)
}

func chat(model string, stream bool, content string) string {
	b, _ := json.Marshal(map[string]any{"model": model, "stream": stream,
		"messages": []any{map[string]any{"role": "user", "content": content}}})
	return string(b)
}

// decode runs DecodeHeaders + DecodeData and waits for the async end of the
// decision.
func (s *stream) decode(h *standalone.RequestHeaders, body string) fakeEvent {
	s.t.Helper()
	if st := s.phase(false, func() api.StatusType { return s.f.DecodeHeaders(h, false) }); st != api.StopAndBuffer {
		s.t.Fatalf("DecodeHeaders = %v, want StopAndBuffer (seed: WaitAllData)", st)
	}
	buf := standalone.NewBuffer([]byte(body))
	st := s.phase(false, func() api.StatusType { return s.f.DecodeData(buf, true) })
	if st != api.Running {
		s.t.Fatalf("DecodeData = %v, want Running", st)
	}
	ev := s.e.wait()
	ev.body2 = buf.String()
	return ev
}

func (s *stream) end(resp api.ResponseHeaderMap) {
	s.f.OnStreamComplete()
	s.f.OnLog(nil, nil, resp, nil)
	s.e.destroy()
	s.f.OnDestroy(api.Normal)
	s.e.goDestroyed()
}

type seedError struct {
	Error struct {
		Code    int    `json:"code"`
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
	TraceID string `json:"trace_id"`
}

func parseSeedError(t *testing.T, ev fakeEvent) seedError {
	t.Helper()
	if !ev.reply {
		t.Fatalf("expected a local reply, got Continue(%v)", ev.status)
	}
	var e seedError
	if err := json.Unmarshal([]byte(ev.body), &e); err != nil {
		t.Fatalf("local reply %q is not the error JSON: %v", ev.body, err)
	}
	if ct := ev.headers["content-type"]; len(ct) != 1 || ct[0] != "application/json" {
		t.Fatalf("local reply content-type = %v", ev.headers)
	}
	if e.Error.Code != ev.code || e.Error.Type == "" || e.Error.Message == "" {
		t.Fatalf("incomplete error %+v for status %d", e, ev.code)
	}
	return e
}

func TestNoBodyPassesThrough(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	h := reqHeaders()
	h.SetMethod("GET") // a POST without a body is refused (models_test.go)
	h.SetPath("/health")
	if st := s.phase(false, func() api.StatusType { return s.f.DecodeHeaders(h, true) }); st != api.Continue {
		t.Fatalf("DecodeHeaders(endStream) = %v, want Continue", st)
	}
	resp := standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"application/json"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.Continue {
		t.Fatalf("EncodeHeaders = %v", st)
	}
	s.end(resp)
	if s.e.override != "" || m.get("routed") != 0 || m.get("requests_started") != 1 {
		t.Fatalf("a body-less request must not be routed (override %q, metrics %v)", s.e.override, m.m)
	}
}

func TestRoutedRequestNonStreamed(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	body := chat("qwen", false, "hello")
	ev := s.decode(reqHeaders("x-request-id", "trace-1"), body)
	if ev.reply || ev.status != api.Continue {
		t.Fatalf("decision ended with %+v", ev)
	}
	if s.e.override != "127.0.0.1:9001" && s.e.override != "127.0.0.1:9002" {
		t.Fatalf("override host %q not in the pool", s.e.override)
	}
	if s.e.strict {
		t.Fatal("an override from the decision goroutine is applied non-strict by Envoy; asking for strict is a lie")
	}
	if ev.body2 != body {
		t.Fatalf("an OpenAI backend must get the body unchanged, got %q", ev.body2)
	}
	if got := m.get(gatewaymetrics.InFlight); got != 1 {
		t.Fatalf("in_flight = %d after Started", got)
	}
	resp := standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"application/json"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.Continue {
		t.Fatalf("EncodeHeaders = %v", st)
	}
	out := `{"choices":[{"message":{"content":"hi"}}]}`
	buf := standalone.NewBuffer([]byte(out))
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, true) }); st != api.Continue || buf.String() != out {
		t.Fatalf("EncodeData = %v %q", st, buf.String())
	}
	if s.f.firstData.IsZero() {
		t.Fatal("first data must record the first token time")
	}
	s.end(resp)
	if m.get(gatewaymetrics.InFlight) != 0 || m.get("routed") != 1 {
		t.Fatalf("metrics after the stream: %v", m.m)
	}
	if s.f.trace() != "trace-1" {
		t.Fatalf("trace id %q, want the client's x-request-id", s.f.trace())
	}
}

func TestDecisionErrorsAreSeedJSON(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	cases := []struct {
		name, body string
		code       int
	}{
		{"bad json", `{"model": "qwen", "messages": [`, 400},
		{"no model", `{"messages": [{"role":"user","content":"x"}]}`, 400},
		{"unknown model", chat("nope", false, "x"), 404},
		{"no endpoint", chat("empty", false, "x"), 404},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := newStream(t, conf)
			ev := s.decode(reqHeaders("x-request-id", "tr-"+c.name), c.body)
			e := parseSeedError(t, ev)
			if ev.code != c.code || e.TraceID != "tr-"+c.name {
				t.Fatalf("got %d %+v", ev.code, e)
			}
			if s.e.override != "" {
				t.Fatal("no host may be set on a refused request")
			}
			resp := standalone.NewResponseHeaders(ev.code, http.Header{"Content-Type": {"application/json"}})
			// Envoy runs the local reply through the encode phases too.
			if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.Continue {
				t.Fatalf("EncodeHeaders on our own reply = %v", st)
			}
			s.end(resp)
		})
	}
	if m.get(gatewaymetrics.InFlight) != 0 || m.get("local_replies") != int64(len(cases)) {
		t.Fatalf("metrics %v", m.m)
	}
}

func TestOversizedBodyRefusedAtHeaders(t *testing.T) {
	conf, _ := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	h := reqHeaders("content-length", "5000", "x-request-id", "big")
	st := s.phase(false, func() api.StatusType { return s.f.DecodeHeaders(h, false) })
	if st != api.LocalReply {
		t.Fatalf("DecodeHeaders = %v, want LocalReply", st)
	}
	ev := s.e.wait()
	if e := parseSeedError(t, ev); ev.code != 413 || e.TraceID != "big" {
		t.Fatalf("got %d %+v", ev.code, e)
	}
	s.end(nil)
}

func TestStreamedResponseFirstTokenOnce(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	s.decode(reqHeaders(), chat("qwen", true, "stream please"))
	resp := standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"text/event-stream; charset=utf-8"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.Continue {
		t.Fatalf("EncodeHeaders(SSE) = %v, want Continue (WaitData)", st)
	}
	var first time.Time
	for i, chunk := range []string{"data: {\"a\":1}\n\n", "data: {\"a\":2}\n\n", "data: [DONE]\n\n"} {
		buf := standalone.NewBuffer([]byte(chunk))
		if st := s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, i == 2) }); st != api.Continue || buf.String() != chunk {
			t.Fatalf("chunk %d: %v %q", i, st, buf.String())
		}
		if i == 0 {
			first = s.f.firstData
		}
	}
	if first.IsZero() || !s.f.firstData.Equal(first) {
		t.Fatal("TTFT must be taken at the first chunk and only there")
	}
	if !s.f.streaming {
		t.Fatal("SSE not detected")
	}
	s.end(resp)
	if m.get(gatewaymetrics.InFlight) != 0 {
		t.Fatalf("in_flight %d", m.get(gatewaymetrics.InFlight))
	}
}

func TestTritonRequestAndResponsesAreTranscoded(t *testing.T) {
	conf, _ := newTestConfig(t, baseConfig(""))

	// Whole body.
	s := newStream(t, conf)
	body := chat("tri", false, "hello triton")
	h := reqHeaders("content-length", fmt.Sprint(len(body)))
	ev := s.decode(h, body)
	if ev.reply {
		t.Fatalf("decision refused: %s", ev.body)
	}
	if !strings.HasPrefix(h.Path(), "/v2/models/") || !strings.HasSuffix(h.Path(), "/generate") {
		t.Fatalf(":path = %q, want Triton's generate", h.Path())
	}
	if !strings.Contains(ev.body2, "text_input") {
		t.Fatalf("upstream body %q is not a Triton request", ev.body2)
	}
	if cl, _ := h.Get("content-length"); cl != fmt.Sprint(len(ev.body2)) {
		t.Fatalf("content-length %q for a %d-byte body", cl, len(ev.body2))
	}
	answer := `{"model_name":"tri","text_output":"bonjour"}`
	resp := standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"application/json"}, "Content-Length": {fmt.Sprint(len(answer))}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.StopAndBuffer {
		t.Fatalf("EncodeHeaders = %v, want StopAndBuffer (WaitAllData)", st)
	}
	buf := standalone.NewBuffer([]byte(answer))
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, true) }); st != api.Continue {
		t.Fatalf("EncodeData = %v", st)
	}
	var out struct {
		Object  string `json:"object"`
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(buf.Bytes(), &out); err != nil || out.Object != "chat.completion" || out.Choices[0].Message.Content != "bonjour" {
		t.Fatalf("transcoded body %q (%v)", buf.String(), err)
	}
	if cl, _ := resp.Get("content-length"); cl != fmt.Sprint(buf.Len()) {
		t.Fatalf("response content-length %q for %d bytes", cl, buf.Len())
	}
	s.end(resp)

	// Untranslatable whole body: 503 in the error format.
	s = newStream(t, conf)
	s.decode(reqHeaders("x-request-id", "bad-triton"), chat("tri", false, "x"))
	resp = standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"application/json"}})
	s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) })
	buf = standalone.NewBuffer([]byte(`<html>oops</html>`))
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, true) }); st != api.LocalReply {
		t.Fatalf("EncodeData = %v, want LocalReply", st)
	}
	ev = s.e.wait()
	if e := parseSeedError(t, ev); ev.code != 503 || e.TraceID != "bad-triton" {
		t.Fatalf("got %d %+v", ev.code, e)
	}
	// If Envoy runs our reply through the encoder again, it passes untouched.
	reply := standalone.NewResponseHeaders(503, http.Header{"Content-Type": {"application/json"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(reply, false) }); st != api.Continue {
		t.Fatalf("EncodeHeaders on our own 503 = %v", st)
	}
	rbuf := standalone.NewBuffer([]byte(ev.body))
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeData(rbuf, true) }); st != api.Continue || rbuf.String() != ev.body {
		t.Fatalf("EncodeData on our own 503 = %v %q", st, rbuf.String())
	}
	s.end(reply)

	// Streamed: split events are reassembled, and the end adds [DONE].
	s = newStream(t, conf)
	h = reqHeaders()
	s.decode(h, chat("tri", true, "stream"))
	if !strings.HasSuffix(h.Path(), "/generate_stream") {
		t.Fatalf(":path %q", h.Path())
	}
	resp = standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"text/event-stream"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.Continue {
		t.Fatalf("EncodeHeaders = %v", st)
	}
	var got strings.Builder
	for i, c := range []string{`data: {"text_output":"he`, "llo\"}\n\ndata: {\"text_output\":\" world\"}\n\n", ""} {
		buf := standalone.NewBuffer([]byte(c))
		if st := s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, i == 2) }); st != api.Continue {
			t.Fatalf("EncodeData = %v", st)
		}
		got.WriteString(buf.String())
	}
	text := got.String()
	if !strings.Contains(text, `"content":"hello"`) || !strings.Contains(text, `"content":" world"`) || !strings.HasSuffix(text, "data: [DONE]\n\n") {
		t.Fatalf("transcoded stream %q", text)
	}
	s.end(resp)
}

func TestTritonBackendErrorBecomes503(t *testing.T) {
	conf, _ := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	s.decode(reqHeaders(), chat("tri", false, "x"))
	resp := standalone.NewResponseHeaders(400, http.Header{"Content-Type": {"application/json"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.StopAndBuffer {
		t.Fatalf("EncodeHeaders(400) = %v", st)
	}
	buf := standalone.NewBuffer([]byte(`{"error":"bad input"}`))
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, true) }); st != api.LocalReply {
		t.Fatalf("EncodeData = %v", st)
	}
	ev := s.e.wait()
	if e := parseSeedError(t, ev); ev.code != 503 || !strings.Contains(e.Error.Message, "bad input") {
		t.Fatalf("got %d %+v", ev.code, e)
	}
	s.end(resp)
}

func TestOpenAIBackendErrorPassesThrough(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	s.decode(reqHeaders(), chat("qwen", false, "x"))
	resp := standalone.NewResponseHeaders(429, http.Header{"Content-Type": {"application/json"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.Continue {
		t.Fatalf("EncodeHeaders(429) = %v", st)
	}
	buf := standalone.NewBuffer([]byte(`{"error":{"message":"queue full"}}`))
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, true) }); st != api.Continue {
		t.Fatalf("EncodeData = %v", st)
	}
	if !s.f.firstData.IsZero() {
		t.Fatal("an error answer is not a first token")
	}
	if m.get("upstream_errors") != 1 {
		t.Fatalf("upstream_errors = %d", m.get("upstream_errors"))
	}
	s.end(resp)
}

// slowMC is a metadata center that answers route queries after delay.
func slowMC(t *testing.T, delay time.Duration) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(delay):
		case <-r.Context().Done():
			return
		}
		w.Header().Set("content-type", "application/json")
		_, _ = io.WriteString(w, `{"load":{},"cache":[]}`)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestClientGoneDuringDecision(t *testing.T) {
	mc := slowMC(t, 300*time.Millisecond)
	conf, m := newTestConfig(t, strings.Replace(baseConfig(`
metadata_center: {address: `+mc+`, query_timeout: 2s}
`), "policy: round_robin", "policy: cache_aware", 1))
	s := newStream(t, conf)
	h := reqHeaders()
	s.phase(false, func() api.StatusType { return s.f.DecodeHeaders(h, false) })
	buf := standalone.NewBuffer([]byte(chat("qwen", false, "slow")))
	if st := s.phase(false, func() api.StatusType { return s.f.DecodeData(buf, true) }); st != api.Running {
		t.Fatalf("DecodeData = %v", st)
	}
	// The client resets: Envoy logs and destroys while the goroutine waits.
	s.f.OnLog(h, nil, nil, nil)
	s.e.destroy()
	s.f.OnDestroy(api.Terminate)
	s.e.goDestroyed()
	// OnDestroy cancelled the route query: the decision ends (degraded)
	// and finds the stream gone.
	wait.For(t, 5*time.Second, "the abandoned decision to end", func() bool { return m.get("routed") == 1 })
	s.f.mu.Lock() // the decision checks for the stream under this lock
	s.f.mu.Unlock()
	select {
	case ev := <-s.e.events:
		t.Fatalf("callback after OnDestroy: %+v", ev)
	default:
	}
	if m.get(gatewaymetrics.InFlight) != 0 {
		t.Fatalf("a request that never started must not stay in flight: %d", m.get(gatewaymetrics.InFlight))
	}
}

func TestClientGoneMidStreamStillFinishes(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	s.decode(reqHeaders(), chat("qwen", true, "x"))
	resp := standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"text/event-stream"}})
	s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) })
	buf := standalone.NewBuffer([]byte("data: {}\n\n"))
	s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, false) })
	// Reset mid-stream and no access log: OnDestroy alone must finish the
	// request exactly once.
	s.e.destroy()
	s.f.OnDestroy(api.Terminate)
	s.e.goDestroyed()
	s.f.OnDestroy(api.Terminate)
	s.f.OnLog(nil, nil, resp, nil)
	if m.get(gatewaymetrics.InFlight) != 0 {
		t.Fatalf("in_flight %d", m.get(gatewaymetrics.InFlight))
	}
}

// panicBuffer blows up when read, like a buffer used after its phase.
type panicBuffer struct{ *standalone.Buffer }

func (panicBuffer) Bytes() []byte { panic("buffer read after its phase") }

func TestPanicInPhaseIs500(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	h := reqHeaders("x-request-id", "boom")
	s.phase(false, func() api.StatusType { return s.f.DecodeHeaders(h, false) })
	st := s.phase(false, func() api.StatusType { return s.f.DecodeData(panicBuffer{standalone.NewBuffer(nil)}, true) })
	if st != api.LocalReply {
		t.Fatalf("DecodeData = %v, want LocalReply", st)
	}
	ev := s.e.wait()
	if e := parseSeedError(t, ev); ev.code != 500 || e.TraceID != "boom" {
		t.Fatalf("got %d %+v", ev.code, e)
	}
	if m.get("panics") != 1 {
		t.Fatal("panic not counted")
	}
	s.end(nil)
}

// Envoy may destroy a config more than once. The first Destroy drains the
// config's updates and releases what it holds (here its Envoy admin
// poller) off Envoy's thread; the second, and a later Close, find nothing
// left to do and return.
func TestConfigDestroyIsIdempotent(t *testing.T) {
	admin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, `{"cluster_statuses":[]}`)
	}))
	defer admin.Close()
	cfg, err := config.Parse([]byte(strings.Replace(baseConfig(""), "endpoints:\n",
		"endpoints:\n  envoy_admin: {address: \""+admin.URL+"\", refresh: 50ms}\n", 1)))
	if err != nil {
		t.Fatal(err)
	}
	reg := endpoints.NewRegistry(nil)
	conf, err := NewParser(ParserOptions{Registry: reg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Build(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if reg.Len() != 1 {
		t.Fatalf("%d admin pollers for one config", reg.Len())
	}
	conf.Destroy()
	conf.Destroy()
	wait.For(t, 10*time.Second, "Destroy to release the admin poller", func() bool { return reg.Len() == 0 })
	done := make(chan struct{})
	go func() { conf.Close(); conf.Destroy(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close after Destroy blocked")
	}
	if reg.Len() != 0 {
		t.Fatalf("%d admin pollers after the config was destroyed twice and closed", reg.Len())
	}
}

func TestMergePrefersChildAndLendsMetrics(t *testing.T) {
	parent, pm := newTestConfig(t, baseConfig(""))
	admin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, `{"cluster_statuses":[]}`)
	}))
	defer admin.Close()
	cfg, err := config.Parse([]byte(strings.Replace(baseConfig(""), "endpoints:\n",
		"endpoints:\n  envoy_admin: {address: \""+admin.URL+"\", refresh: 50ms}\n", 1)))
	if err != nil {
		t.Fatal(err)
	}
	reg := endpoints.NewRegistry(nil)
	p := NewParser(ParserOptions{Registry: reg})
	child, err := p.Build(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	merged, ok := p.Merge(parent, child).(*Config)
	if !ok || merged.router != child.router || merged.life != child.life {
		t.Fatal("route-level config must win")
	}
	child.metrics.Count("requests_started", 2)
	if pm.get("requests_started") != 2 {
		t.Fatal("route-level config must report into the listener's metrics")
	}
	// Envoy destroys the merged config on its own schedule: the child's
	// decider and reporter must survive it and keep deciding.
	merged.Destroy()
	if reg.Len() != 1 {
		t.Fatal("destroying the merged view released the child's admin poller")
	}
	s := newStream(t, child)
	if ev := s.decode(reqHeaders(), chat("qwen", false, "after merge destroy")); ev.reply {
		t.Fatalf("child config broken by the merged view's Destroy: %s", ev.body)
	}
	s.end(nil)
	if p.Merge(parent, nil) != parent {
		t.Fatal("no route config: the listener's applies")
	}
	child.Destroy()
	// Destroy drains off Envoy's thread: the release follows shortly.
	wait.For(t, 10*time.Second, "the child's Destroy to release its admin poller", func() bool { return reg.Len() == 0 })
}

func TestEnvoyMetricsBridge(t *testing.T) {
	cb := &fakeConfigCallbacks{counters: map[string]*fakeMetric{}, gauges: map[string]*fakeMetric{}}
	cfg, err := config.Parse([]byte(baseConfig("")))
	if err != nil {
		t.Fatal(err)
	}
	hists := map[string][]uint64{}
	define := func(_ api.ConfigCallbackHandler, name string) (func(uint64), bool) {
		return func(v uint64) { hists[name] = append(hists[name], v) }, true
	}
	m := newEnvoyMetrics(cb, cfg, define)
	m.Count("routed", 3)
	m.Count(gatewaymetrics.InFlight, 1)
	m.Count(gatewaymetrics.InFlight, -1)
	m.Count("no_such_metric", 1)
	if cb.counters["llm_filter_routed_total"].v != 3 || cb.gauges["llm_filter_in_flight_requests"].v != 0 {
		t.Fatalf("counters %v gauges %v", cb.counters["llm_filter_routed_total"], cb.gauges["llm_filter_in_flight_requests"])
	}
	names := []string{}
	for n := range cb.counters {
		names = append(names, n)
	}
	for _, want := range []string{"llm_filter_cache_hit_routes_total", "llm_filter_fallbacks_total", "llm_filter_metadata_center_errors_total"} {
		if !slices.Contains(names, want) {
			t.Fatalf("%s not defined; have %v", want, names)
		}
	}
	// The labelled request counter exists for each rule's labels.
	m.Request(gatewaymetrics.RequestLabels{Model: "qwen", Cluster: "pool", Policy: "round_robin", Outcome: gatewaymetrics.OutcomeSuccess})
	name := "llm_filter_requests_total;model_name=qwen;cluster=pool;scene=none;policy=round_robin;outcome=success"
	if c := cb.counters[name]; c == nil || c.v != 1 {
		t.Fatalf("%s not counted; have %v", name, names)
	}
	// Histograms are Envoy integers in the unit their name carries, one
	// stat per rule's model and cluster.
	m.Observe(gatewaymetrics.TTFT, gatewaymetrics.HistLabels{Model: "qwen", Cluster: "pool"}, 1500*time.Millisecond)
	m.Observe(gatewaymetrics.Decision, gatewaymetrics.HistLabels{}, 250*time.Microsecond)
	m.Observe(gatewaymetrics.TTFT, gatewaymetrics.HistLabels{Model: "unknown", Cluster: "pool"}, time.Second)
	if got := hists["llm_filter_ttft_milliseconds;model_name=qwen;cluster=pool"]; !slices.Equal(got, []uint64{1500}) {
		t.Fatalf("ttft recorded %v, want [1500] (all: %v)", got, hists)
	}
	if got := hists["llm_filter_decision_duration_microseconds;model_name=none;cluster=none"]; !slices.Equal(got, []uint64{250}) {
		t.Fatalf("decision recorded %v, want [250] (all: %v)", got, hists)
	}
	if newEnvoyMetrics(nil, cfg, nil) != nil {
		t.Fatal("route-level parse has no callbacks")
	}
}

type fakeMetric struct{ v int64 }

func (m *fakeMetric) Increment(d int64) { m.v += d }
func (m *fakeMetric) Get() uint64       { return uint64(m.v) }
func (m *fakeMetric) Record(v uint64)   { m.v = int64(v) }

type fakeConfigCallbacks struct{ counters, gauges map[string]*fakeMetric }

func (c *fakeConfigCallbacks) DefineCounterMetric(n string) api.CounterMetric {
	m := &fakeMetric{}
	c.counters[n] = m
	return m
}

func (c *fakeConfigCallbacks) DefineGaugeMetric(n string) api.GaugeMetric {
	m := &fakeMetric{}
	c.gauges[n] = m
	return m
}

// TestResetRacingTheDecision lets Envoy end the stream at every point of a
// fast decision: the filter may meet Envoy's "destroyed" panic in the window
// before its OnDestroy, but never calls back after OnDestroy returned, never
// leaks a started request, and (under -race) shares no field unguarded.
func TestResetRacingTheDecision(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	for i := 0; i < 200; i++ {
		s := newStream(t, conf)
		h := reqHeaders()
		s.phase(false, func() api.StatusType { return s.f.DecodeHeaders(h, false) })
		buf := standalone.NewBuffer([]byte(chat("qwen", false, fmt.Sprint("race ", i))))
		s.phase(false, func() api.StatusType { return s.f.DecodeData(buf, true) })
		if i%3 == 0 {
			for range i % 7 { // let the decision get further before the reset
				runtime.Gosched()
			}
		}
		s.e.destroy()
		s.f.OnLog(h, nil, nil, nil)
		s.f.OnDestroy(api.Terminate)
		s.e.goDestroyed()
	}
	waitFor(t, func() bool { return m.get(gatewaymetrics.InFlight) == 0 })
	if m.get("panics") != 0 {
		t.Fatalf("Envoy's destroyed panic must not count as a filter panic: %d", m.get("panics"))
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	wait.For(t, 5*time.Second, "the condition", cond)
}
