package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/llama"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

func TestFlagValidation(t *testing.T) {
	bad := [][]string{
		{"--engine", "gpu"},
		{"--engine", "llama"}, // no model
		{"--engine", "sim", "--n-seq-max", "0"},
		{"--engine", "sim", "--n-seq-max", "257"},
		{"--engine", "sim", "--max-queue", "0"},
		{"--engine", "sim", "--request-timeout", "-1s"},
		{"--engine", "sim", "--kv-eviction-threshold", "1.5"},
		{"--engine", "sim", "--metadata-center", "http://mc:8080"}, // no cluster
		{"--engine", "sim", "--metadata-center", "http://mc:8080", "--cluster", "c", "--listen", ":9001"}, // no advertise
		{"--engine", "sim", "--metadata-center", "http://mc:8080", "--cluster", "c", "--advertise-host", "nohost"},
		{"--engine", "sim", "extra"},
		{"--engine", "sim", "--max-batch-size", "9"}, // more than the 8 running
		{"--engine", "sim", "--max-batch-size", "0"},
		{"--engine", "sim", "--max-output-tokens", "0"},
		{"--engine", "sim", "--kv-cache-type", "q8_0", "--flash-attention=false"}, // llama.cpp needs FA for a quantized V
		{"--engine", "sim", "--finish-first-tokens", "-1"},
		{"--engine", "sim", "--kv-park-max-bytes", "-2"},
		{"--engine", "sim", "--drain-timeout", "-1s"},
	}
	for _, args := range bad {
		if _, err := parse(args, io.Discard); err == nil {
			t.Errorf("parse(%q) accepted", args)
		}
	}
	o, err := parse([]string{"--engine", "sim", "--metadata-center", "http://mc:8080", "--cluster", "c", "--listen", "10.1.2.3:9001"}, io.Discard)
	if err != nil || o.advertise != "10.1.2.3:9001" || o.nSeqMax != 16 || o.maxRunning != 8 || o.maxQueue != 256 || o.timeout != 60*time.Second ||
		o.maxBatch != 4 || o.maxOutput != 2048 || o.threads != 0 || o.flashAttn || !o.parkIdle || o.finishFirst != 16 || o.parkMaxBytes != -1 {
		t.Fatalf("defaults: %+v %v", o, err)
	}
	// The flags' defaults are the scheduler's DefaultConfig, which tests run.
	def := scheduler.DefaultConfig()
	if o.maxRunning != def.MaxRunning || o.maxBatch != def.MaxBatch || o.finishFirst != def.FinishFirst || o.prefillChunk != def.PrefillChunk ||
		o.queueTimeout != def.QueueTimeout || o.kvMaxItems != def.KV.MaxItems || o.kvMaxMB<<20 != def.KV.MaxBytes || o.drainTimeout != 100*time.Second {
		t.Fatalf("flag defaults %+v differ from scheduler.DefaultConfig %+v", o, def)
	}
	if o.parkBound() != 0 {
		t.Fatalf("default park bound %d, want the engine's default 0", o.parkBound())
	}
	if o, err := parse([]string{"--engine", "sim", "--kv-park-max-bytes", "1048576"}, io.Discard); err != nil || o.parkBound() != 1<<20 {
		t.Fatalf("--kv-park-max-bytes 1048576: %v", err)
	}
	// A quantized KV cache turns flash attention on unless told otherwise.
	if o, err := parse([]string{"--engine", "sim", "--kv-cache-type", "q4_0"}, io.Discard); err != nil || !o.flashAttn {
		t.Fatalf("--kv-cache-type q4_0: flash attention %v, %v", o.flashAttn, err)
	}
	// An unset batch size follows a smaller running set.
	if o, err := parse([]string{"--engine", "sim", "--max-concurrent-requests", "2"}, io.Discard); err != nil || o.maxBatch != 2 {
		t.Fatalf("--max-concurrent-requests 2: batch %d, %v", o.maxBatch, err)
	}
}

type center struct {
	mu   sync.Mutex
	body []api.CacheEvict
}

// ServeHTTP keeps only the eviction reports; the worker also pushes its
// pod signals to the same center.
func (c *center) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != api.PathCacheEvict {
		return
	}
	var b api.CacheEvict
	json.NewDecoder(r.Body).Decode(&b)
	c.mu.Lock()
	c.body = append(c.body, b)
	c.mu.Unlock()
}

func start(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addr := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append(args, "--listen", "127.0.0.1:0", "--log-level", "warn"), io.Discard, func(a string) { addr <- a })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	select {
	case a := <-addr:
		return "http://" + a
	case err := <-done:
		t.Fatalf("worker exited: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("worker did not start")
	}
	return ""
}

func chat(t *testing.T, url string) map[string]any {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json",
		bytes.NewReader([]byte(`{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":5,"ignore_eos":true,"temperature":0}`)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	json.NewDecoder(resp.Body).Decode(&out)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %v", resp.StatusCode, out)
	}
	return out
}

func TestRunsTheLlamaEngineOnTheGeneratedModel(t *testing.T) {
	url := start(t, "--model", testmodel.Path(t), "--n-ctx", "2048", "--n-seq-max", "4", "--threads", "1")
	out := chat(t, url)
	usage := out["usage"].(map[string]any)
	if usage["completion_tokens"].(float64) != 5 {
		t.Fatalf("%v", out)
	}
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"object":"list"`) {
		t.Fatalf("models: %s", b)
	}
	// The finished conversation is parked in host memory (--kv-park-idle).
	var parked float64
	if !wait.Until(10*time.Second, func() bool {
		resp, err := http.Get(url + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var limit float64
		parked = 0
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "llmf_worker_kv_parked_bytes "); ok {
				parked, _ = strconv.ParseFloat(v, 64)
			}
			if v, ok := strings.CutPrefix(l, "llmf_worker_kv_park_limit_bytes "); ok {
				limit, _ = strconv.ParseFloat(v, 64)
			}
		}
		// --kv-park-max-bytes defaults to the KV cache's size.
		if meta, err := llama.ReadMeta(testmodel.Path(t)); err != nil || limit != float64(2048*meta.BytesPerToken) {
			t.Fatalf("llmf_worker_kv_park_limit_bytes %v, want n_ctx 2048 × the model's KV bytes per token (%v)", limit, err)
		}
		return parked > 0 && parked <= limit
	}) {
		t.Fatalf("llmf_worker_kv_parked_bytes %v after a completed request, want > 0", parked)
	}
}

func TestSimEngineReportsEvictAllAtStartup(t *testing.T) {
	c := &center{}
	mc := httptest.NewServer(c)
	defer mc.Close()
	url := start(t, "--engine", "sim", "--sim-step-overhead", "1ms", "--metadata-center", mc.URL, "--cluster", "pool", "--advertise-host", "10.0.0.9:9001")
	out := chat(t, url)
	if out["object"] != "chat.completion" {
		t.Fatalf("%v", out)
	}
	var first api.CacheEvict
	if !wait.Until(10*time.Second, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		if len(c.body) == 0 {
			return false
		}
		first = c.body[0]
		return true
	}) {
		t.Fatal("no evict-all at start-up")
	}
	if !first.All || first.Host != "10.0.0.9:9001" || first.Cluster != "pool" {
		t.Fatalf("first report %+v", first)
	}
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	// The served model labels the worker's series, as vLLM's (sim's name).
	if !strings.Contains(string(b), `llmf_worker_generated_tokens_total{model_name="sim"} 5`) {
		t.Fatalf("metrics missing generated tokens labelled with the model:\n%s", b)
	}
}

// --kv-park-max-bytes 0 never parks: the finished conversation stays cached
// in the KV cache, no host memory holds it.
func TestParkMaxBytesZeroNeverParks(t *testing.T) {
	url := start(t, "--model", testmodel.Path(t), "--n-ctx", "2048", "--n-seq-max", "4", "--threads", "1", "--kv-park-max-bytes", "0")
	chat(t, url)
	// name is the series up to its value; labels of the scheduler's
	// series start with the served model's.
	metric := func(b []byte, name string) (float64, bool) {
		for _, l := range strings.Split(string(b), "\n") {
			l = regexp.MustCompile(`\{model_name="[^"]*",?`).ReplaceAllString(l, "{")
			l = strings.Replace(l, "{} ", " ", 1)
			if v, ok := strings.CutPrefix(l, name+" "); ok {
				f, err := strconv.ParseFloat(v, 64)
				return f, err == nil
			}
		}
		return 0, false
	}
	var b []byte
	if !wait.Until(10*time.Second, func() bool {
		resp, err := http.Get(url + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		idle, _ := metric(b, `llmf_worker_kv_cache_entries{state="idle"}`)
		return idle == 1
	}) {
		t.Fatal("the finished conversation is not an idle entry")
	}
	parked, ok1 := metric(b, "llmf_worker_kv_parked_bytes")
	limit, ok2 := metric(b, "llmf_worker_kv_park_limit_bytes")
	if !ok1 || !ok2 || parked != 0 || limit != 0 {
		t.Fatalf("with --kv-park-max-bytes 0: parked %v (%v), limit %v (%v), want 0 and 0", parked, ok1, limit, ok2)
	}
}
