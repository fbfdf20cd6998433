package envoyhost

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// meshDoc routes qwen to cluster pool, to prod with x-env: prod, and to
// ghost (a cluster Envoy does not know) with x-env: ghost.
func meshDoc(pool, prod string) string {
	return fmt.Sprintf(`model_mapping_rule:
  qwen:
    - headers: {x-env: prod}
      cluster: prod
      backend: llamacpp
      scene_name: prod
    - headers: {x-env: ghost}
      cluster: ghost
      backend: llamacpp
    - cluster: pool
      backend: llamacpp
  llama:
    - cluster: pool
      backend: llamacpp
lb_mapping_rule:
  default: {policy: round_robin}
endpoints:
  static: {pool: [%s], prod: [%s], ghost: [%s]}
`, pool, prod, prod)
}

func send(t *testing.T, method, url, body string, hdr map[string]string) (*http.Response, string) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b)
}

// The rule's cluster is Envoy's cluster: the filter writes it into
// x-llm-cluster and clears the route cache, and the route (cluster_header)
// sends the request there; a header rule reaches another cluster for real.
func TestRuleClusterIsEnvoysCluster(t *testing.T) {
	pool, prod := newBackend(t), newBackend(t)
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {pool.addr}, "prod": {prod.addr}}})
	if _, err := h.PushConfig([]byte(meshDoc(pool.addr, prod.addr))); err != nil {
		t.Fatal(err)
	}
	resp, body := send(t, "POST", h.URL()+"/v1/chat/completions", chatBody("to prod", false), map[string]string{"x-env": "prod"})
	if resp.StatusCode != 200 || resp.Header.Get("x-served-by") != prod.addr || resp.Header.Get(headers.UpstreamHost) != prod.addr {
		t.Fatalf("x-env: prod: %d served by %q: %s", resp.StatusCode, resp.Header.Get("x-served-by"), body)
	}
	if _, _, hdr := prod.last(); hdr.Get(headers.Cluster) != "prod" {
		t.Fatalf("prod pod saw %s = %q", headers.Cluster, hdr.Get(headers.Cluster))
	}
	resp, body = send(t, "POST", h.URL()+"/v1/chat/completions", chatBody("to pool", false), nil)
	if resp.StatusCode != 200 || resp.Header.Get("x-served-by") != pool.addr {
		t.Fatalf("default rule: %d served by %q: %s", resp.StatusCode, resp.Header.Get("x-served-by"), body)
	}
	// A client's own x-llm-cluster is dropped: the unrouted request takes
	// the default route.
	resp, _ = send(t, "GET", h.URL()+"/other", "", map[string]string{headers.Cluster: "prod"})
	if resp.StatusCode != 200 || resp.Header.Get("x-served-by") != pool.addr {
		t.Fatalf("client-named cluster: %d served by %q", resp.StatusCode, resp.Header.Get("x-served-by"))
	}
	if _, _, hdr := pool.last(); hdr.Get(headers.Cluster) != "" {
		t.Fatalf("the client's %s reached the pod: %q", headers.Cluster, hdr.Get(headers.Cluster))
	}
	// A rule naming a cluster Envoy does not know: Envoy's 503.
	resp, _ = send(t, "POST", h.URL()+"/v1/chat/completions", chatBody("to ghost", false), map[string]string{"x-env": "ghost"})
	if resp.StatusCode != 503 {
		t.Fatalf("unknown cluster answered %d, want 503", resp.StatusCode)
	}
	if pool.hits.Load() != 2 || prod.hits.Load() != 1 {
		t.Fatalf("hits pool=%d prod=%d, want 2 and 1", pool.hits.Load(), prod.hits.Load())
	}
}

// The filter answers GET /v1/models from its rules and refuses a body-less
// POST with 400, inside Envoy as in the standalone gateway.
func TestModelsAndBodylessPostInEnvoy(t *testing.T) {
	pool := newBackend(t)
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {pool.addr}}})
	if _, err := h.PushConfig([]byte(meshDoc(pool.addr, pool.addr))); err != nil {
		t.Fatal(err)
	}
	resp, body := send(t, "GET", h.URL()+"/v1/models", "", nil)
	var list struct {
		Object string `json:"object"`
		Data   []struct{ ID, Object string }
	}
	if err := json.Unmarshal([]byte(body), &list); err != nil || resp.StatusCode != 200 || list.Object != "list" ||
		len(list.Data) != 2 || list.Data[0].ID != "llama" || list.Data[1].ID != "qwen" || list.Data[0].Object != "model" {
		t.Fatalf("GET /v1/models: %d %s (%v)", resp.StatusCode, body, err)
	}
	resp, body = send(t, "GET", h.URL()+"/v1/models/nope", "", map[string]string{"x-request-id": "t-404"})
	if resp.StatusCode != 404 || !strings.Contains(body, `"type":"not_found"`) || !strings.Contains(body, `"trace_id":"t-404"`) {
		t.Fatalf("GET /v1/models/nope: %d %s", resp.StatusCode, body)
	}
	resp, body = send(t, "POST", h.URL()+"/v1/chat/completions", "", map[string]string{"x-request-id": "t-400"})
	if resp.StatusCode != 400 || !strings.Contains(body, `"error":{"code":400,"type":"bad_request"`) || !strings.Contains(body, `"trace_id":"t-400"`) {
		t.Fatalf("body-less POST: %d %s", resp.StatusCode, body)
	}
	if pool.hits.Load() != 0 {
		t.Fatalf("%d requests reached the pod", pool.hits.Load())
	}
}
