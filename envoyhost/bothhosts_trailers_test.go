package envoyhost

import (
	"bufio"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
	"github.com/istio-llm-filter/istio-llm-filter/filter/standalone"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// startStandalone runs the standalone host of the filter on doc, as the
// gateway does: its static lists are its clusters, routed on x-llm-cluster.
func startStandalone(t *testing.T, doc string) string {
	t.Helper()
	cfg, err := config.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	pm, err := gatewaymetrics.NewProm(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	conf, err := llmfilter.NewParser(llmfilter.ParserOptions{Logger: quietLogger()}).Build(cfg, pm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conf.Close)
	host, err := standalone.New(standalone.Options{
		ClusterHeader: headers.Cluster,
		Member: func(cluster, h string) bool {
			return slices.Contains(cfg.Endpoints.Static[cluster], h)
		},
		Factory: llmfilter.Factory, Config: conf, MaxRequestBody: int64(cfg.MaxBodyBytes), Logger: quietLogger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(host)
	t.Cleanup(srv.Close)
	return srv.URL
}

// trailerOutcome is what a client and a pod see of one exchange, in a form
// both hosts must agree on.
type trailerOutcome struct {
	Status          int
	Routed          bool   // the filter's chosen pod served
	PodPath         string // what the pod was asked
	PodGotTrailers  string
	Content         string // the answer's text (JSON message, or the stream's deltas)
	Done            bool   // a stream ended with [DONE]
	ClientTrailers  string
	PodGotTranscode bool
}

func contentOf(body []byte, stream bool) (string, bool) {
	if !stream {
		var out struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		if json.Unmarshal(body, &out) != nil || len(out.Choices) != 1 {
			return "unparsable: " + string(body), false
		}
		return out.Choices[0].Message.Content, false
	}
	var text strings.Builder
	done := false
	sc := bufio.NewScanner(strings.NewReader(string(body)))
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(line), &ev); err == nil && len(ev.Choices) > 0 {
			text.WriteString(ev.Choices[0].Delta.Content)
		}
	}
	return text.String(), done
}

// The same trailer scenarios through the Envoy-faithful host and the
// standalone host give the same outcome: a request ending with trailers is
// routed and its trailers reach the pod; a transcoded (Triton) answer with
// trailers is transcoded and keeps them; a transcoded stream that ends with
// trailers gets its tail ([DONE]) before them.
func TestTrailerScenariosAgreeAcrossHosts(t *testing.T) {
	_, mc := newMetadataCenter(t)
	tb := newTritonBackend(t)
	tb.respTrailers = map[string]string{"X-Backend-Stats": "ok"}
	doc := tritonDoc(mc, tb.addr)
	eh := startHost(t, Options{Clusters: map[string][]string{"pool": {tb.addr}}})
	if _, err := eh.PushConfig([]byte(doc)); err != nil {
		t.Fatal(err)
	}
	hosts := map[string]string{"envoy": eh.URL(), "standalone": startStandalone(t, doc)}

	scenarios := []struct {
		name     string
		stream   bool
		trailers bool // the request ends with trailers
		want     trailerOutcome
	}{
		{"request and response trailers", false, true, trailerOutcome{Status: 200, Routed: true, PodPath: "/v2/models/qwen/generate",
			PodGotTrailers: "abc123", Content: "hello", ClientTrailers: "ok", PodGotTranscode: true}},
		{"stream with response trailers", true, false, trailerOutcome{Status: 200, Routed: true, PodPath: "/v2/models/qwen/generate_stream",
			Content: "hello", Done: true, ClientTrailers: "ok", PodGotTranscode: true}},
		{"stream with trailers both ways", true, true, trailerOutcome{Status: 200, Routed: true, PodPath: "/v2/models/qwen/generate_stream",
			PodGotTrailers: "abc123", Content: "hello", Done: true, ClientTrailers: "ok", PodGotTranscode: true}},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			got := map[string]trailerOutcome{}
			for _, name := range []string{"envoy", "standalone"} {
				body := chatBody("trailers "+sc.name, sc.stream)
				var resp *http.Response
				var out []byte
				if sc.trailers {
					resp, out = postWithTrailers(t, hosts[name], body)
				} else {
					resp, out = post(t, hosts[name], body)
				}
				tb.mu.Lock()
				o := trailerOutcome{Status: resp.StatusCode, PodPath: tb.path, PodGotTrailers: tb.trailers.Get("X-Body-Digest"),
					PodGotTranscode: strings.Contains(string(tb.body), `"text_input"`)}
				tb.mu.Unlock()
				o.Routed = resp.Header.Get(headers.UpstreamHost) == tb.addr
				o.Content, o.Done = contentOf(out, sc.stream)
				o.ClientTrailers = resp.Trailer.Get("X-Backend-Stats")
				got[name] = o
			}
			if got["envoy"] != sc.want || got["standalone"] != sc.want {
				t.Fatalf("outcomes differ from what Envoy does:\n envoy      %+v\n standalone %+v\n want       %+v",
					got["envoy"], got["standalone"], sc.want)
			}
		})
	}
}
