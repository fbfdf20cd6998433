package epp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp"
	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/envoyrun"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewayfile"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"
)

// envoyBinary is the upstream Envoy (scripts/test.sh installs it). Outside
// CI a machine without it skips; under CI=true its absence fails.
func envoyBinary(t testing.TB) string {
	t.Helper()
	bin, err := envoyrun.Binary()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI needs the real Envoy: %v", err)
		}
		t.Skipf("no Envoy binary: %v", err)
	}
	return bin
}

// pod is an OpenAI-compatible backend that answers with its own address,
// so a test sees where Envoy sent each request. The workers' real
// llama.cpp answers are e2e's (e2e/); here the picker's protocol is
// under test.
type pod struct {
	addr string
	mu   sync.Mutex
	seen []http.Header // the headers of every request it got
}

func (p *pod) requests() []http.Header {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]http.Header(nil), p.seen...)
}

func startPods(t testing.TB, n int) []*pod {
	t.Helper()
	var pods []*pod
	for range n {
		p := &pod{}
		ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			p.mu.Lock()
			p.seen = append(p.seen, r.Header.Clone())
			p.mu.Unlock()
			if r.Method == http.MethodGet {
				w.Header().Set("content-type", "application/json")
				fmt.Fprintf(w, `{"object":"list","data":[{"id":"qwen","object":"model","owned_by":%q}]}`, p.addr)
				return
			}
			var req struct {
				Stream bool `json:"stream"`
			}
			body, _ := io.ReadAll(r.Body)
			_ = json.Unmarshal(body, &req)
			if req.Stream {
				w.Header().Set("content-type", "text/event-stream")
				for i := range 3 {
					fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"%s/%d \"}}]}\n\n", p.addr, i)
					w.(http.Flusher).Flush()
				}
				io.WriteString(w, "data: [DONE]\n\n")
				return
			}
			w.Header().Set("content-type", "application/json")
			fmt.Fprintf(w, `{"id":"c","object":"chat.completion","model":"qwen","choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`, p.addr)
		}))
		t.Cleanup(ts.Close)
		p.addr = strings.TrimPrefix(ts.URL, "http://")
		pods = append(pods, p)
	}
	return pods
}

func addrs(pods []*pod) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.addr)
	}
	return out
}

// fleetFile is the standalone gateway's file for pods: qwen on cluster
// "pool", cache-aware, with the metadata center at mc ("" = none).
func fleetFile(mc string, pods []string) string {
	doc := fmt.Sprintf(`listen: 127.0.0.1:0
log_level: error
connect_retries: 1
filter:
  protocol: openai
  prompt_hash: {chunk_size: 64}
  model_mapping_rule:
    qwen:
      - {cluster: pool}
  lb_mapping_rule:
    default: {policy: cache_aware}
  endpoints:
    static:
      pool: [%s]
`, strings.Join(pods, ", "))
	if mc != "" {
		doc += fmt.Sprintf("  metadata_center: {address: %q, query_timeout: 2s, update_timeout: 2s}\n", mc)
	}
	return doc
}

// startEPP serves the picker of doc over real gRPC on loopback.
func startEPP(t testing.TB, doc string, hooks bool) string {
	t.Helper()
	return startEPPWith(t, doc, epp.BuildOptions{ConformanceHooks: hooks})
}

// startEPPWith is startEPP with o (quiet unless o.Logger is set).
func startEPPWith(t testing.TB, doc string, o epp.BuildOptions) string {
	t.Helper()
	fc, cfg, err := gatewayfile.Parse("fleet.yaml", []byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	if o.Logger == nil {
		o.Logger = routingtest.Quiet()
	}
	s, closeReports, err := epp.Build(fc, cfg, o)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := epp.NewGRPCServer()
	s.Register(g)
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(func() { g.Stop(); closeReports() })
	return ln.Addr().String()
}

// startEnvoy runs the real Envoy in front of the picker at eppAddr.
func startEnvoy(t *testing.T, eppAddr string) string {
	t.Helper()
	return startEnvoyMode(t, eppAddr, false)
}

// startEnvoyMode is startEnvoy with both bodies FULL_DUPLEX_STREAMED when
// duplex is set.
func startEnvoyMode(t *testing.T, eppAddr string, duplex bool) string {
	t.Helper()
	var log strings.Builder
	var mu sync.Mutex
	e, err := envoyrun.Start(context.Background(), envoyrun.Options{Binary: envoyBinary(t), EPP: eppAddr, Retries: 2, Duplex: duplex,
		Stderr: writerFunc(func(b []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return log.Write(b) })})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = e.Close()
		if t.Failed() {
			mu.Lock()
			t.Logf("envoy log:\n%s", log.String())
			mu.Unlock()
		}
	})
	return e.URL()
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }
