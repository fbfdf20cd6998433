package lifecycle

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// The fixtures below are filter/routing's test fixtures (routing_test.go):
// the lifecycle is reported of that package's decisions.

const cluster = "outbound|8000||qwen.llm.svc.cluster.local"

var pods = []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}

// hdr is a lower-case header map, as Envoy presents them.
type hdr map[string]string

func (h hdr) Get(k string) (string, bool) { v, ok := h[k]; return v, ok }

func chatPath() hdr { return hdr{":path": "/v1/chat/completions"} }

// counts is a concurrency-safe Metrics.
type counts struct {
	mu sync.Mutex
	m  map[string]int64
}

func (c *counts) Count(name string, d int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]int64{}
	}
	c.m[name] += d
}

func (c *counts) get(name string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[name]
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// center starts the real metadata center (in-memory store) on loopback.
func center(t testing.TB) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{Logger: quiet()}).Handler())
	t.Cleanup(ts.Close)
	return ts
}

func configFor(t testing.TB, mcAddr string, extra string) *config.Config {
	t.Helper()
	doc := fmt.Sprintf(`
metadata_center: {address: %q, query_timeout: 2s, update_timeout: 2s}
prompt_hash: {chunk_size: 64}
model_mapping_rule:
  qwen:
    - headers: {x-env: canary}
      cluster: canary
      scene_name: canary
    - cluster: %q
      scene_name: chat
  tiny:
    - cluster: %q
      backend: triton
  lonely:
    - headers: {x-env: prod}
      cluster: %q
  ghost:
    - cluster: empty
%s`, mcAddr, cluster, cluster, cluster, extra)
	if mcAddr == "" {
		doc = strings.Replace(doc, `metadata_center: {address: "", query_timeout: 2s, update_timeout: 2s}`, "", 1)
	}
	cfg, err := config.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func staticSource(t testing.TB) endpoints.Source {
	t.Helper()
	s, err := endpoints.NewStatic(map[string][]string{cluster: pods, "canary": {"10.0.9.9:8000"}})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func chatBody(system, user string) []byte {
	b, _ := json.Marshal(map[string]any{"model": "qwen", "stream": true, "messages": []any{
		map[string]any{"role": "system", "content": system},
		map[string]any{"role": "user", "content": user},
	}})
	return b
}

// eventually waits up to 5 s for cond.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	wait.For(t, 5*time.Second, what, cond)
}

// countingRouter answers from memory and counts queries.
type countingRouter struct {
	mu  sync.Mutex
	n   int
	ans api.RouteAnswer
}

func (r *countingRouter) Route(ctx context.Context, cluster string, hashes []string) (*api.RouteAnswer, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n++
	a := r.ans
	return &a, nil
}

func (r *countingRouter) Pods(context.Context, string) (map[string]api.PodRegistration, error) {
	return nil, nil
}

// gateway is what a host builds: a decider and the reporter of its
// decisions, sharing one count of requests in flight.
type gateway struct {
	*routing.Decider
	*Reporter
}

// Decide decides and starts the decision's lifecycle record.
func (g gateway) Decide(ctx context.Context, h routing.Headers, body []byte) (*Request, error) {
	d, err := g.Decider.Decide(ctx, h, body)
	if err != nil {
		return nil, err
	}
	return NewRequest(d), nil
}

// newGateway builds a gateway over the static pods (unless o says
// otherwise); u, if not nil, replaces the metadata-center client's updates.
func newGateway(t testing.TB, cfg *config.Config, o routing.Options, u Updater) gateway {
	t.Helper()
	if o.Endpoints == nil {
		o.Endpoints = staticSource(t)
	}
	if o.Logger == nil {
		o.Logger = quiet()
	}
	d, err := routing.New(cfg, o)
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(cfg, Options{Tracker: d.Tracker(), Updater: u, Metrics: o.Metrics, Logger: o.Logger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return gateway{d, r}
}
