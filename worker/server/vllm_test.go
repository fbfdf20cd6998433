package server

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/podsignals"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
)

// signalsStore records what the metadata center's scraper reports.
type signalsStore struct {
	mu  sync.Mutex
	got []api.PodSignals
}

func (s *signalsStore) ReportSignals(_ context.Context, _, _ string, sig api.PodSignals) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, sig)
	return nil
}

// scrapeAsVLLM runs one round of the metadata center's own scraper
// (metadata-center/podsignals) over w as a vLLM pod.
func scrapeAsVLLM(t *testing.T, w *worker) api.PodSignals {
	t.Helper()
	u, _ := url.Parse(w.url)
	store := &signalsStore{}
	sc, err := podsignals.New(podsignals.Options{Store: store, Timeout: 5 * time.Second,
		Targets: podsignals.StaticTargets{{Cluster: "c", Host: u.Host, Backend: podsignals.BackendVLLM}}})
	if err != nil {
		t.Fatal(err)
	}
	sc.Round(context.Background(), true)
	store.mu.Lock()
	defer store.mu.Unlock()
	if len(store.got) != 1 {
		t.Fatalf("the vLLM scraper read %d reports off the worker's /metrics", len(store.got))
	}
	return store.got[0]
}

func TestAVLLMScraperReadsTheWorker(t *testing.T) {
	w := startWorker(t, opts{nCtx: 8192, vllm: true, sched: scheduler.Config{MaxRunning: 1, MaxOutputTokens: 4000}})
	// A finished conversation leaves idle cached cells: vLLM counts them free.
	chat(t, w, history("cached"), map[string]any{"max_tokens": 8})
	// The answer's last chunk reaches the client just before the scheduler
	// lets the request go and publishes its stats (what /metrics reads).
	wait.For(t, 20*time.Second, "the conversation to leave the published running set", func() bool {
		st := w.sched.Stats()
		return st.Running == 0 && st.KVUsage() == 0
	})
	if sig := scrapeAsVLLM(t, w); sig.Running != 0 || sig.Waiting != 0 || sig.KVCacheUtil != 0 {
		t.Fatalf("idle worker with a cached conversation scraped as %+v; want nothing running and the KV cache free", sig)
	}
	// One long request running, one queued behind it.
	m := history("running")
	resp, cancel := openStream(t, w, m, 3000)
	defer resp.Body.Close()
	firstChunk(t, resp)
	queued := make(chan struct{})
	go func() {
		defer close(queued)
		b := mustJSON(t, map[string]any{"model": "tiny", "messages": msgs("user", "queued"), "max_tokens": 2})
		if r, err := http.Post(w.url+"/v1/chat/completions", "application/json", bytes.NewReader(b)); err == nil {
			io.Copy(io.Discard, r.Body)
			r.Body.Close()
		}
	}()
	waitFor(t, w, "the second request to queue", func(scheduler.View) bool { return w.sched.Stats().Queued == 1 })
	sig := scrapeAsVLLM(t, w)
	held := 0
	w.inspect(t, func(v scheduler.View) {
		for _, e := range v.KV.Entries() {
			if e.InUse {
				held += len(e.Tokens)
			}
		}
	})
	// The running request holds its ~2,100 prompt cells and its output so far.
	if sig.Running != 1 || sig.Waiting != 1 || sig.KVCacheUtil < 2000.0/8192 || sig.KVCacheUtil > float64(held+500)/8192 {
		t.Fatalf("scraped %+v with %d cells held by the running request of 8192", sig, held)
	}
	cancel()
	<-queued

	text := scrape(t, w)
	for _, want := range []string{
		`vllm:num_requests_waiting{model_name="tiny"}`, `vllm:num_requests_running{model_name="tiny"}`,
		`vllm:kv_cache_usage_perc{model_name="tiny"}`,
		`vllm:time_to_first_token_seconds_bucket{model_name="tiny",le="0.001"}`,
		`vllm:time_to_first_token_seconds_count{model_name="tiny"} 3`,
		`vllm:time_per_output_token_seconds_bucket{model_name="tiny",le="0.01"}`,
		`vllm:time_per_output_token_seconds_count{model_name="tiny"}`,
		"llmf_worker_ttft_seconds_count 3", // ours stay beside them
	} {
		if !strings.Contains(text, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(text, "vllm:lora_requests_info") {
		t.Error("vllm:lora_requests_info without adapters")
	}
}
