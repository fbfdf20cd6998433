// Package routingtest holds the fixtures the tests of filter/routing and
// filter/lifecycle share: a configuration routing over three static pods,
// chat bodies, a counting Metrics and the real metadata center (in-memory
// store) on loopback.
package routingtest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// Cluster is the cluster model qwen's default rule routes to.
const Cluster = "outbound|8000||qwen.llm.svc.cluster.local"

// Pods are Cluster's static endpoints.
var Pods = []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}

// Headers is a lower-case header map, as Envoy presents them.
type Headers map[string]string

// Get is routing.Headers'.
func (h Headers) Get(k string) (string, bool) { v, ok := h[k]; return v, ok }

// ChatPath is the headers of a chat completion.
func ChatPath() Headers { return Headers{":path": "/v1/chat/completions"} }

// Counts is a concurrency-safe routing.Metrics.
type Counts struct {
	mu sync.Mutex
	m  map[string]int64
}

// Count adds delta to name.
func (c *Counts) Count(name string, delta int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]int64{}
	}
	c.m[name] += delta
}

// Get is name's count.
func (c *Counts) Get(name string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[name]
}

// String lists every count.
func (c *Counts) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprint(maps.Clone(c.m))
}

// Querier answers the route query from memory (Answer) and counts the
// queries; it knows no pods.
type Querier struct {
	Answer api.RouteAnswer

	mu sync.Mutex
	n  int
}

// Route returns a copy of Answer.
func (q *Querier) Route(context.Context, string, []string) (*api.RouteAnswer, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.n++
	a := q.Answer
	return &a, nil
}

// Pods lists no pods.
func (q *Querier) Pods(context.Context, string) (map[string]api.PodRegistration, error) {
	return nil, nil
}

// Queries is how many route queries were asked.
func (q *Querier) Queries() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n
}

// Quiet is a logger that writes nothing.
func Quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// Center starts the real metadata center (in-memory store) on loopback.
func Center(t testing.TB) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{Logger: Quiet()}).Handler())
	t.Cleanup(ts.Close)
	return ts
}

// Config routes qwen to Cluster (and to "canary" with x-env: canary),
// tiny to Cluster's Triton backend, lonely only with x-env: prod and
// ghost to a cluster without endpoints, with the metadata center at
// mcAddr ("" = none); extra is appended to the document.
func Config(t testing.TB, mcAddr string, extra string) *config.Config {
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
%s`, mcAddr, Cluster, Cluster, Cluster, extra)
	if mcAddr == "" {
		doc = strings.Replace(doc, `metadata_center: {address: "", query_timeout: 2s, update_timeout: 2s}`, "", 1)
	}
	cfg, err := config.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// StaticSource is Cluster's Pods and canary's one pod.
func StaticSource(t testing.TB) endpoints.Source {
	t.Helper()
	s, err := endpoints.NewStatic(map[string][]string{Cluster: Pods, "canary": {"10.0.9.9:8000"}})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// ChatBody is a streamed chat of model qwen: a system and a user message.
func ChatBody(system, user string) []byte {
	b, _ := json.Marshal(map[string]any{"model": "qwen", "stream": true, "messages": []any{
		map[string]any{"role": "system", "content": system},
		map[string]any{"role": "user", "content": user},
	}})
	return b
}
