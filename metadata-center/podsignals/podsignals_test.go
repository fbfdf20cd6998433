package podsignals

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
)

// Expositions in each backend's shape: HELP/TYPE lines, labels (vLLM and
// SGLang label by model; two models on one vLLM pod are summed), histograms
// and counters around the gauges that matter.
const vllmMetrics = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_running{engine="0",model_name="qwen-lora"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.8125
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="4096",num_gpu_blocks_override="None"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="qwen"} 0.0
vllm:time_to_first_token_seconds_sum{model_name="qwen"} 12.5
`

const vllmOldMetrics = `vllm:num_requests_running{model_name="m"} 2.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
`

const sglangMetrics = `# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 482000.0
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
`

const llamaMetrics = `# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.0625
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 4
`

func TestParse(t *testing.T) {
	cases := []struct {
		backend, body string
		want          api.PodSignals
	}{
		{BackendVLLM, vllmMetrics, api.PodSignals{Waiting: 5, Running: 4, KVCacheUtil: 0.8125, KVCapacity: 65536}},
		{BackendVLLM, vllmOldMetrics, api.PodSignals{Running: 2, KVCacheUtil: 0.25}},
		{BackendSGLang, sglangMetrics, api.PodSignals{Waiting: 2, Running: 7, KVCacheUtil: 0.5, KVCapacity: 482000}},
		{BackendLlamaCpp, llamaMetrics, api.PodSignals{Waiting: 4, Running: 1, KVCacheUtil: 0.0625}},
		// A label value holding a brace and spaces does not confuse it.
		{BackendSGLang, `sglang:num_running_reqs{model_name="a} b \"c\""} 3 1700000000000` + "\n", api.PodSignals{Running: 3}},
	}
	for _, c := range cases {
		got, err := Parse(c.backend, strings.NewReader(c.body))
		if err != nil || !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: %+v %v, want %+v", c.backend, got, err, c.want)
		}
	}
	for _, bad := range []struct{ backend, body, msg string }{
		{"triton", vllmMetrics, `backend "triton"`},
		{BackendVLLM, sglangMetrics, "no vllm:num_requests_running"},
		{BackendVLLM, "vllm:num_requests_running{model_name=\"x\" 3\n", "unexpected end of label value"},
		{BackendVLLM, "vllm:num_requests_running three\n", "expected float as value"},
	} {
		if _, err := Parse(bad.backend, strings.NewReader(bad.body)); err == nil || !strings.Contains(err.Error(), bad.msg) {
			t.Errorf("%s %q: err %v, want one containing %q", bad.backend, bad.body, err, bad.msg)
		}
	}
}

// Real HTTP pods of each backend scraped into a real store: the route
// query answers their signals; a pod whose /metrics fails is not reported
// (and its old report goes stale), and an unknown backend is counted, not
// scraped.
func TestScraperFillsTheStore(t *testing.T) {
	var vllmWaiting atomic.Int64
	vllmWaiting.Store(5)
	serve := func(body func() string) *httptest.Server {
		ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/metrics" {
				http.NotFound(w, r)
				return
			}
			b := body()
			if b == "" {
				http.Error(w, "down", http.StatusInternalServerError)
				return
			}
			io.WriteString(w, b)
		}))
		t.Cleanup(ts.Close)
		return ts
	}
	vllm := serve(func() string {
		return strings.Replace(vllmMetrics, `model_name="qwen"} 5.0`, fmt.Sprintf(`model_name="qwen"} %d`, vllmWaiting.Load()), 1)
	})
	sglang := serve(func() string { return sglangMetrics })
	llama := serve(func() string { return llamaMetrics })
	var broken atomic.Bool
	flaky := serve(func() string {
		if broken.Load() {
			return ""
		}
		return llamaMetrics
	})
	host := func(ts *httptest.Server) string { return strings.TrimPrefix(ts.URL, "http://") }
	clock := storetest.NewClock()
	st := memstore.New(memstore.Options{SignalMaxAge: 200 * time.Millisecond, Now: clock.Now})
	reg := prometheus.NewRegistry()
	sc, err := New(Options{Store: st, Registerer: reg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Targets: StaticTargets{
		{Cluster: "a", Host: host(vllm), Backend: BackendVLLM},
		{Cluster: "a", Host: host(sglang), Backend: BackendSGLang},
		{Cluster: "b", Host: host(llama), Backend: BackendLlamaCpp},
		{Cluster: "b", Host: host(flaky), Backend: BackendLlamaCpp},
		{Cluster: "b", Host: "10.0.0.9:1", Backend: "triton"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	sc.Round(ctx, true)
	ans, err := st.Route(ctx, "a", nil)
	if err != nil {
		t.Fatal(err)
	}
	clearAge := func(m map[string]api.PodSignals) map[string]api.PodSignals {
		for k, v := range m {
			v.AgeMS = 0
			m[k] = v
		}
		return m
	}
	if got := clearAge(ans.Signals); !reflect.DeepEqual(got, map[string]api.PodSignals{
		host(vllm):   {Waiting: 5, Running: 4, KVCacheUtil: 0.8125, KVCapacity: 65536},
		host(sglang): {Waiting: 2, Running: 7, KVCacheUtil: 0.5, KVCapacity: 482000},
	}) {
		t.Fatalf("cluster a: %+v", got)
	}
	sigB, _ := st.Signals(ctx, "b")
	if len(sigB) != 2 || sigB[host(llama)].Waiting != 4 || sigB[host(flaky)].Running != 1 {
		t.Fatalf("cluster b: %+v", sigB)
	}
	// The vLLM pod's queue drains; the flaky pod goes down.
	vllmWaiting.Store(0)
	broken.Store(true)
	clock.Advance(250 * time.Millisecond) // every report older than the max age
	sc.Round(ctx, true)
	sigA, _ := st.Signals(ctx, "a")
	sigB, _ = st.Signals(ctx, "b")
	if sigA[host(vllm)].Waiting != 0 || sigA[host(vllm)].Running != 4 {
		t.Fatalf("after the queue drained: %+v", sigA)
	}
	if _, ok := sigB[host(flaky)]; ok || len(sigB) != 1 {
		t.Fatalf("a pod that stopped answering is still answered: %+v", sigB)
	}
	for _, c := range []struct {
		backend, result string
		want            float64
	}{{BackendVLLM, "ok", 2}, {BackendLlamaCpp, "ok", 3}, {BackendLlamaCpp, "error", 1}, {"triton", "unsupported", 2}} {
		var m dto.Metric
		if err := sc.results.WithLabelValues(c.backend, c.result).Write(&m); err != nil {
			t.Fatal(err)
		}
		if got := m.GetCounter().GetValue(); got != c.want {
			t.Errorf("scrapes %s/%s = %v, want %v", c.backend, c.result, got, c.want)
		}
	}
}

// Run keeps scraping at its interval until its context ends.
func TestRunScrapesAtTheInterval(t *testing.T) {
	var hits atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		io.WriteString(w, llamaMetrics)
	}))
	defer ts.Close()
	st := memstore.New(memstore.Options{})
	sc, err := New(Options{Store: st, Interval: 20 * time.Millisecond, Targets: StaticTargets{{Cluster: "c", Host: strings.TrimPrefix(ts.URL, "http://"), Backend: BackendLlamaCpp}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sc.Run(ctx); close(done) }()
	wait.For(t, 5*time.Second, "5 scrapes at a 20 ms interval", func() bool { return hits.Load() >= 5 })
	cancel()
	<-done
	if _, err := New(Options{Store: st}); err == nil {
		t.Fatal("New without targets accepted")
	}
}

// Targets come from the metadata center's own scrape configuration: per
// cluster its backend and pods, clusters sorted, hosts canonical, each pod
// once; a backend without known /metrics, a cluster without pods, a host
// that is not ip:port or an unknown key is refused, naming where.
func TestParseTargets(t *testing.T) {
	doc := `
clusters:
  main:
    backend: vllm
    pods: [10.0.0.1:8000, "[::ffff:10.0.0.2]:8000", 10.0.0.1:08000]
  outbound|30000||canary.llm: {backend: sglang, pods: [10.0.1.1:30000]}
`
	got, err := ParseTargets([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	want := []Target{
		{Cluster: "main", Host: "10.0.0.1:8000", Backend: BackendVLLM},
		{Cluster: "main", Host: "10.0.0.2:8000", Backend: BackendVLLM},
		{Cluster: "outbound|30000||canary.llm", Host: "10.0.1.1:30000", Backend: BackendSGLang},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("targets %+v, want %+v", got, want)
	}
	for doc, msg := range map[string]string{
		"clusters: {tri: {backend: triton, pods: [10.0.2.1:8001]}}":            "clusters.tri.backend",
		"clusters: {main: {backend: vllm}}":                                    "clusters.main.pods",
		"clusters: {main: {backend: vllm, pods: [pod-a:8000]}}":                "clusters.main.pods[0]",
		"clusters: {main: {backend: vllm, pods: [10.0.0.1:8000], cluster: x}}": "unknown field",
		"clusters: {}":                     "at least one cluster",
		"filter: {model_mapping_rule: {}}": "unknown field",
	} {
		if _, err := ParseTargets([]byte(doc)); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%s: error %v, want one naming %q", doc, err, msg)
		}
	}
}
