package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/envoyhost"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// vllmExposition is a vLLM pod's /metrics in the shape vLLM's
// PrometheusStatLogger writes (vllm/v1/metrics/loggers.py): HELP and TYPE
// lines, gauges labelled by engine and model, a histogram around them.
const vllmExposition = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} %d.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} %d.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.8125
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="qwen"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="qwen"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="qwen"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="qwen"} 0.25
`

// vllmPod serves a vLLM pod's /metrics (the only path the metadata center
// reads of it) with the given queue.
func vllmPod(t *testing.T, running, waiting int) string {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		fmt.Fprintf(w, vllmExposition, running, waiting)
	}))
	t.Cleanup(ts.Close)
	return strings.TrimPrefix(ts.URL, "http://")
}

// envoyAdmin serves Envoy's admin /clusters?format=json listing the given
// clusters' hosts as healthy (the shape filter/endpoints/admin.go reads).
func envoyAdmin(t *testing.T, clusters map[string][]string) string {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/clusters" || r.URL.Query().Get("format") != "json" {
			http.NotFound(w, r)
			return
		}
		type sock struct {
			Address   string `json:"address"`
			PortValue int    `json:"port_value"`
		}
		type hs struct {
			Address      map[string]sock   `json:"address"`
			HealthStatus map[string]string `json:"health_status"`
		}
		var statuses []any
		for name, hosts := range clusters {
			var list []hs
			for _, a := range hosts {
				ip, port, _ := net.SplitHostPort(a)
				p, _ := strconv.Atoi(port)
				list = append(list, hs{Address: map[string]sock{"socket_address": {ip, p}}, HealthStatus: map[string]string{"eds_health_status": "HEALTHY"}})
			}
			statuses = append(statuses, map[string]any{"name": name, "host_statuses": list})
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"cluster_statuses": statuses})
	}))
	t.Cleanup(ts.Close)
	return ts.URL
}

// routeSignals asks the metadata center's route query for a cluster's
// pod signals.
func routeSignals(t *testing.T, mc, cluster string) map[string]api.PodSignals {
	body, _ := json.Marshal(api.RouteQuery{Cluster: cluster, Hashes: []string{}})
	resp, err := http.Post("http://"+mc+api.PathRouteQuery, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var ans api.RouteAnswer
	if resp.StatusCode != 200 || json.Unmarshal(raw, &ans) != nil {
		t.Fatalf("route query: %d %s", resp.StatusCode, raw)
	}
	return ans.Signals
}

// A vLLM pod that nobody lists for the metadata center — the gateway finds
// it through Envoy's admin API — gets its signals scraped: the gateway
// (standalone, and the .so inside Envoy) announces the pods it routes to,
// the metadata center scrapes their /metrics, and its route answer carries
// the pod's queue.
func TestPodsFoundThroughEnvoysAdminGetSignals(t *testing.T) {
	bin := binaries(t)
	dir := t.TempDir()
	mc := startCmd(t, dir, "metadata-center", filepath.Join(bin, "metadata-center"), "--listen", "127.0.0.1:0", "--store", "memory")
	const standaloneCluster, envoyCluster = "outbound|8000||vllm-a.llm.svc.cluster.local", "outbound|8000||vllm-b.llm.svc.cluster.local"
	podA, podB := vllmPod(t, 3, 5), vllmPod(t, 1, 2)
	admin := envoyAdmin(t, map[string][]string{standaloneCluster: {podA}, envoyCluster: {podB}})
	docFor := func(cluster string) string {
		return fmt.Sprintf(`metadata_center: {address: "http://%s"}
model_mapping_rule:
  qwen:
    - {cluster: %q, backend: vllm}
lb_mapping_rule:
  default: {policy: cache_aware}
endpoints:
  envoy_admin: {address: %q, refresh: 100ms}
`, mc, cluster, admin)
	}
	if got := routeSignals(t, mc, standaloneCluster); len(got) != 0 {
		t.Fatalf("signals before any gateway announced: %+v", got)
	}

	cfg := filepath.Join(dir, "gateway.yaml")
	if err := os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nfilter:\n"+indent(docFor(standaloneCluster))), 0o600); err != nil {
		t.Fatal(err)
	}
	startCmd(t, dir, "gateway", filepath.Join(bin, "gateway"), "--config", cfg)
	wait.For(t, 30*time.Second, "the standalone gateway's admin-found pod in the route answer", func() bool {
		return !reflect.DeepEqual(routeSignals(t, mc, standaloneCluster)[podA], api.PodSignals{})
	})
	got := routeSignals(t, mc, standaloneCluster)[podA]
	if got.Running != 3 || got.Waiting != 5 || got.KVCacheUtil != 0.8125 {
		t.Fatalf("pod %s signals %+v, want running 3, waiting 5, kv 0.8125", podA, got)
	}

	exe, so := envoyArtifacts(t)
	h, err := envoyhost.Start(envoyhost.Options{HostBin: exe, SO: so, Clusters: map[string][]string{envoyCluster: {podB}}, DefaultCluster: envoyCluster})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	if _, err := h.PushConfig([]byte(docFor(envoyCluster))); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 30*time.Second, "the .so's admin-found pod in the route answer", func() bool {
		return !reflect.DeepEqual(routeSignals(t, mc, envoyCluster)[podB], api.PodSignals{})
	})
	if got := routeSignals(t, mc, envoyCluster)[podB]; got.Running != 1 || got.Waiting != 2 {
		t.Fatalf("pod %s signals %+v, want running 1, waiting 2", podB, got)
	}
}
