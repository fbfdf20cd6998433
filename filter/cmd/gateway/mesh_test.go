package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// pod is a backend that names itself in its answers.
type pod struct {
	srv  *httptest.Server
	hits atomic.Int64
}

func newPod(t *testing.T, name string) *pod {
	p := &pod{}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.hits.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("content-type", "application/json")
		w.Header().Set("x-pod", name)
		fmt.Fprintf(w, `{"object":"chat.completion","choices":[{"message":{"content":"from %s"}}],"cluster_header":%q}`, name, r.Header.Get("x-llm-cluster"))
	}))
	t.Cleanup(p.srv.Close)
	return p
}

func (p *pod) addr() string { return p.srv.Listener.Addr().String() }

// startGateway runs the gateway on a config and returns its base URL.
func startGateway(t testing.TB, cfg string) string {
	t.Helper()
	path := writeConfig(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan net.Addr, 1)
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"--config", path}, io.Discard, ready) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("gateway: %v", err)
		}
	})
	select {
	case addr := <-ready:
		return "http://" + addr.String()
	case err := <-done:
		t.Fatalf("gateway exited: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("gateway not ready")
	}
	return ""
}

func do(t *testing.T, method, url, body string, hdr map[string]string) (*http.Response, string) {
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
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b)
}

// twoClusterConfig routes qwen to pool, and to prod when x-env: prod.
func twoClusterConfig(pool, prod string) string {
	return fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: error
default_cluster: pool
filter:
  model_mapping_rule:
    qwen:
      - headers: {x-env: prod}
        cluster: prod
        backend: llamacpp
        scene_name: prod
      - cluster: pool
        backend: llamacpp
    llama: [{cluster: pool, backend: llamacpp}]
  lb_mapping_rule:
    default: {policy: round_robin}
  endpoints:
    static: {pool: [%s], prod: [%s]}
`, pool, prod)
}

const chat = `{"model":"qwen","messages":[{"role":"user","content":"hello"}]}`

// A header-conditioned rule sends the request to its own cluster: the
// filter names it in x-llm-cluster and the gateway's route forwards on it.
func TestRuleClusterIsTheRoutedCluster(t *testing.T) {
	pool, prod := newPod(t, "pool"), newPod(t, "prod")
	base := startGateway(t, twoClusterConfig(pool.addr(), prod.addr()))
	// Every series the rules can produce is exported from the start.
	waitMetrics(t, base, `llm_filter_requests_total{cluster="prod",model_name="qwen",outcome="upstream_error",policy="round_robin",scene="prod"} 0`)

	resp, body := do(t, "POST", base+"/v1/chat/completions", chat, map[string]string{"x-env": "prod"})
	if resp.StatusCode != 200 || resp.Header.Get("x-pod") != "prod" || !strings.Contains(body, `"cluster_header":"prod"`) {
		t.Fatalf("x-env: prod answered %d by %q: %s", resp.StatusCode, resp.Header.Get("x-pod"), body)
	}
	resp, body = do(t, "POST", base+"/v1/chat/completions", chat, nil)
	if resp.StatusCode != 200 || resp.Header.Get("x-pod") != "pool" || !strings.Contains(body, `"cluster_header":"pool"`) {
		t.Fatalf("default rule answered %d by %q: %s", resp.StatusCode, resp.Header.Get("x-pod"), body)
	}
	// A client cannot name the cluster itself: the filter drops its header,
	// so an unrouted request takes the default route.
	resp, body = do(t, "GET", base+"/other", "", map[string]string{"x-llm-cluster": "prod"})
	if resp.StatusCode != 200 || resp.Header.Get("x-pod") != "pool" || !strings.Contains(body, `"cluster_header":""`) {
		t.Fatalf("client-named cluster: %d by %q: %s", resp.StatusCode, resp.Header.Get("x-pod"), body)
	}
	if pool.hits.Load() != 2 || prod.hits.Load() != 1 {
		t.Fatalf("hits pool=%d prod=%d, want 2 and 1", pool.hits.Load(), prod.hits.Load())
	}
	// The same metrics as in Envoy, as Prometheus families with labels.
	waitMetrics(t, base,
		`llm_filter_requests_total{cluster="prod",model_name="qwen",outcome="success",policy="round_robin",scene="prod"} 1`,
		`llm_filter_requests_total{cluster="pool",model_name="qwen",outcome="success",policy="round_robin",scene="none"} 1`,
		`llm_filter_requests_total{cluster="none",model_name="none",outcome="unrouted",policy="none",scene="none"} 1`,
		`llm_filter_ttft_seconds_count{cluster="prod",model_name="qwen"} 1`,
		`llm_filter_ttft_seconds_count{cluster="pool",model_name="qwen"} 1`,
		`llm_filter_request_duration_seconds_count{cluster="pool",model_name="qwen"} 1`,
		`llm_filter_decision_duration_seconds_count{cluster="prod",model_name="qwen"} 1`,
		`llm_filter_ttft_seconds_bucket{cluster="pool",model_name="qwen",le="0.0001"}`,
	)
}

// waitMetrics polls /metrics until every line is in it: a request is
// counted when its handler returns, just after the client has its answer.
func waitMetrics(t *testing.T, base string, wants ...string) string {
	t.Helper()
	var missing []string
	var text string
	if !wait.Until(5*time.Second, func() bool {
		_, text = do(t, "GET", base+"/metrics", "", nil)
		missing = missing[:0]
		for _, w := range wants {
			if !strings.Contains(text, w) {
				missing = append(missing, w)
			}
		}
		return len(missing) == 0
	}) {
		t.Fatalf("/metrics lacks %q", missing)
	}
	return text
}

// The gateway answers GET /v1/models from its rules, in OpenAI's shape,
// and refuses a body-less POST with 400 in the error format.
func TestGatewayModelsAndBodylessPost(t *testing.T) {
	pool, prod := newPod(t, "pool"), newPod(t, "prod")
	base := startGateway(t, twoClusterConfig(pool.addr(), prod.addr()))
	checkModelsAndBodyless(t, base)
	if n := pool.hits.Load() + prod.hits.Load(); n != 0 {
		t.Fatalf("%d requests reached a pod; the gateway answers these itself", n)
	}
}

func checkModelsAndBodyless(t *testing.T, base string) {
	resp, body := do(t, "GET", base+"/v1/models", "", nil)
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID, Object string
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(body), &list); err != nil || resp.StatusCode != 200 || list.Object != "list" ||
		len(list.Data) != 2 || list.Data[0].ID != "llama" || list.Data[1].ID != "qwen" || list.Data[1].Object != "model" {
		t.Fatalf("GET /v1/models: %d %s (%v)", resp.StatusCode, body, err)
	}
	if ct := resp.Header.Get("content-type"); ct != "application/json" {
		t.Fatalf("GET /v1/models content-type %q", ct)
	}
	resp, body = do(t, "GET", base+"/v1/models/qwen", "", nil)
	if resp.StatusCode != 200 || !strings.Contains(body, `"id":"qwen"`) {
		t.Fatalf("GET /v1/models/qwen: %d %s", resp.StatusCode, body)
	}
	resp, body = do(t, "GET", base+"/v1/models/nope", "", map[string]string{"x-request-id": "trace-404"})
	if resp.StatusCode != 404 || !strings.Contains(body, `"type":"not_found"`) || !strings.Contains(body, `"trace_id":"trace-404"`) {
		t.Fatalf("GET /v1/models/nope: %d %s", resp.StatusCode, body)
	}
	resp, body = do(t, "POST", base+"/v1/chat/completions", "", map[string]string{"x-request-id": "trace-400"})
	if resp.StatusCode != 400 || !strings.Contains(body, `"error":{"code":400,"type":"bad_request"`) || !strings.Contains(body, `"trace_id":"trace-400"`) {
		t.Fatalf("body-less POST: %d %s", resp.StatusCode, body)
	}
}

// With a metadata center configured the model list also asks it for the
// registered adapters (on a goroutine); when it does not answer, the list
// still comes, with the configured models, within the query timeout.
func TestGatewayModelsWithTheMetadataCenterDown(t *testing.T) {
	pool, prod := newPod(t, "pool"), newPod(t, "prod")
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	cfg := strings.Replace(twoClusterConfig(pool.addr(), prod.addr()), "filter:\n",
		fmt.Sprintf("filter:\n  metadata_center: {address: %q, query_timeout: 200ms}\n", dead.URL), 1)
	base := startGateway(t, cfg)
	checkModelsAndBodyless(t, base)
	if n := pool.hits.Load() + prod.hits.Load(); n != 0 {
		t.Fatalf("%d requests reached a pod; the gateway answers these itself", n)
	}
}
