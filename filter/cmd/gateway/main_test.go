package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

func writeConfig(t testing.TB, body string) string {
	p := filepath.Join(t.TempDir(), "gateway.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestGatewayServesProxiesAndExportsMetrics(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "application/json")
		fmt.Fprintf(w, `{"object":"chat.completion","choices":[{"message":{"content":"hi"}}],"rid":%q}`, r.Header.Get("x-request-id"))
	}))
	defer backend.Close()
	path := writeConfig(t, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: warn
default_cluster: tiny-pool
filter:
  model_mapping_rule:
    qwen:
      - cluster: tiny-pool
        backend: llamacpp
  lb_mapping_rule:
    default: {policy: round_robin}
  endpoints:
    static: {tiny-pool: [%s]}
`, backend.Listener.Addr()))
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan net.Addr, 1)
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"--config", path}, io.Discard, ready) }()
	var addr net.Addr
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("gateway exited: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("gateway not ready")
	}
	base := "http://" + addr.String()

	resp, err := http.Post(base+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"qwen","messages":[{"role":"user","content":"hello"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"rid":"`) || strings.Contains(string(body), `"rid":""`) {
		t.Fatalf("proxied answer %d %s", resp.StatusCode, body)
	}

	resp, err = http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"nope","messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode < 400 || !strings.Contains(string(body), `"error":{"code":`) || !strings.Contains(string(body), `"trace_id":`) {
		t.Fatalf("refused request answered %d %s", resp.StatusCode, body)
	}

	// The gateway lists the models of its rules itself.
	resp, err = http.Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET /v1/models: %d", resp.StatusCode)
	}

	// A request is counted when its handler returns, which can be just
	// after the client has read the whole answer: poll briefly.
	wants := []string{`llm_filter_routed_total 1`, `llm_filter_requests_started_total 3`, `llm_gateway_requests_total{code="200",local="false"} 1`, `llm_gateway_requests_total{code="200",local="true"} 1`,
		`llm_filter_balancer_stage_seconds_count{stage="round_robin"} 1`}
	var missing []string
	wait.Until(5*time.Second, func() bool {
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		metrics, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		missing = missing[:0]
		for _, want := range wants {
			if !strings.Contains(string(metrics), want) {
				missing = append(missing, want)
			}
		}
		return len(missing) == 0
	})
	for _, want := range missing {
		t.Errorf("/metrics lacks %s", want)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
}

func TestGatewayRefusesBadConfig(t *testing.T) {
	for name, body := range map[string]string{
		"unknown top-level key": "listen: 127.0.0.1:0\nfilters: {}\n",
		"no filter":             "listen: 127.0.0.1:0\n",
		"bad filter value":      "filter:\n  model_mapping_rule: {qwen: [{cluster: c}]}\n  lb_mapping_rule: {default: {candidate_percent: 0}}\n",
		"bad static address":    "filter:\n  model_mapping_rule: {qwen: [{cluster: c}]}\n  endpoints: {static: {c: [localhost:80]}}\n",
		"unknown default":       "default_cluster: d\nfilter:\n  model_mapping_rule: {qwen: [{cluster: c}]}\n  endpoints: {static: {c: [127.0.0.1:80]}}\n",
		"negative retries":      "connect_retries: -1\nfilter:\n  model_mapping_rule: {qwen: [{cluster: c}]}\n",
	} {
		t.Run(name, func(t *testing.T) {
			err := run(context.Background(), []string{"--config", writeConfig(t, body)}, io.Discard, nil)
			if err == nil {
				t.Fatal("accepted")
			}
		})
	}
	if err := run(context.Background(), nil, io.Discard, nil); err == nil || !strings.Contains(err.Error(), "--config") {
		t.Fatalf("missing --config: %v", err)
	}
}

// A pod that died: its connection is refused. The request routed there
// was never sent, so the gateway sends it to another pod of the cluster at
// once (connect_retries, default 1) and ejects the dead one; with
// connect_retries: 0 that one request gets the 503 (the Envoy behaviour
// without a retry policy). Either way the later requests avoid the pod.
func TestGatewayEjectsAPodWhoseConnectionFails(t *testing.T) {
	for _, tc := range []struct {
		name    string
		retries string
		fails   int
	}{
		{"retried on another pod", "", 0},
		{"no retries", "connect_retries: 0\n", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var served atomic.Int64
			alive := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				served.Add(1)
				w.Header().Set("content-type", "application/json")
				fmt.Fprint(w, `{"object":"chat.completion","choices":[{"message":{"content":"hi"}}]}`)
			}))
			defer alive.Close()
			// A port nobody listens on: the pod died.
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			dead := l.Addr().String()
			l.Close()
			path := writeConfig(t, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: error
%sfilter:
  model_mapping_rule:
    qwen: [{cluster: pool, backend: llamacpp}]
  lb_mapping_rule:
    default: {policy: round_robin}
  endpoints:
    static: {pool: [%s, %s]}
`, tc.retries, dead, alive.Listener.Addr()))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ready := make(chan net.Addr, 1)
			done := make(chan error, 1)
			go func() { done <- run(ctx, []string{"--config", path}, io.Discard, ready) }()
			var base string
			select {
			case addr := <-ready:
				base = "http://" + addr.String()
			case err := <-done:
				t.Fatalf("gateway exited: %v", err)
			}
			post := func() (int, string, string) {
				resp, err := http.Post(base+"/v1/chat/completions", "application/json",
					strings.NewReader(`{"model":"qwen","messages":[{"role":"user","content":"hello"}]}`))
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, string(b), resp.Header.Get(headers.UpstreamHost)
			}
			failures := 0
			for i := 0; i < 2; i++ { // round robin reaches the dead pod within two requests
				code, body, upstream := post()
				if code == 200 {
					if upstream != alive.Listener.Addr().String() {
						t.Fatalf("answered 200 naming upstream %q, want the live pod", upstream)
					}
					continue
				}
				if code != http.StatusServiceUnavailable || !strings.Contains(body, "upstream_unavailable") {
					t.Fatalf("dead pod answered %d %s", code, body)
				}
				failures++
			}
			if failures != tc.fails {
				t.Fatalf("%d of the first two requests failed, want %d", failures, tc.fails)
			}
			for i := 0; i < 10; i++ {
				if code, body, _ := post(); code != 200 {
					t.Fatalf("request %d after ejection: %d %s", i, code, body)
				}
			}
			if got := served.Load(); got != int64(12-tc.fails) {
				t.Fatalf("the live pod served %d requests, want %d", got, 12-tc.fails)
			}
			cancel()
			<-done
		})
	}
}
