package vllmsim

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/podsignals"
)

// testConfig is a small, fast pod.
func testConfig() Config {
	c := DefaultConfig()
	c.NumBlocks, c.MaxModelLen, c.MaxNumSeqs, c.MaxNumBatchedTokens = 256, 2048, 4, 512
	c.StepTime, c.PrefillPerToken, c.DecodePerSeq = time.Millisecond, time.Microsecond, 0
	return c
}

// startPods serves n pods on loopback until the test ends.
func startPods(t *testing.T, c Config, n int) []string {
	t.Helper()
	var ls []net.Listener
	var addrs []string
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls, addrs = append(ls, l), append(addrs, "http://"+l.Addr().String())
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, c, ls, slog.New(slog.NewTextHandler(io.Discard, nil))) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return addrs
}

type answer struct {
	status                   int
	text                     string
	prompt, cached, complete int
	err                      string
}

// chat sends one streamed chat completion with the benchmarks' client and
// reads it to the end; a request whose context ends before the answer comes
// back with status 0.
func chat(t *testing.T, ctx context.Context, base, model, system, user string, maxTokens int) answer {
	t.Helper()
	res := (&client.Client{}).Do(ctx, base, client.Request{Model: model, Stream: true, Usage: true,
		MaxTokens: maxTokens, FixedLength: true,
		Messages: []client.Message{{Role: "system", Content: system}, {Role: "user", Content: user}}})
	if res.Outcome == client.Cut && ctx.Err() == nil {
		t.Errorf("answer cut: %s", res.Err) // not Fatal: chat runs in goroutines too
	}
	return answer{status: res.Status, text: res.Text, prompt: res.PromptTokens, cached: res.CachedTokens,
		complete: len(Tokenize(res.Text)), err: res.Err}
}

// metrics reads a pod's /metrics into name{labels} → value.
func metrics(t *testing.T, base string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("metrics line %q", line)
		}
		out[line[:i]] = v
	}
	return out
}

func gauge(m map[string]float64, name string) float64 { return m[name+`{model_name="tiny"}`] }

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	wait.For(t, 10*time.Second, what, cond)
}

func words(seed uint64, n int) string { return workload.Text(rand.New(rand.NewPCG(seed, 9)), n) }

// A repeated prompt is served from the prefix cache in whole blocks short of
// its last token, the answer streams max_tokens BPE-like tokens with usage,
// and the counters say the same.
func TestPrefixCacheHitsInWholeBlocksOverHTTP(t *testing.T) {
	base := startPods(t, testConfig(), 1)[0]
	ctx := context.Background()
	sys, q := words(1, 1500), words(2, 200)
	first := chat(t, ctx, base, "tiny", sys, q, 24)
	if first.status != http.StatusOK || first.cached != 0 || first.complete != 24 {
		t.Fatalf("first request: %+v, want 200, nothing cached, 24 tokens", first)
	}
	if first.prompt >= len(sys)+len(q) || first.prompt < (len(sys)+len(q))/6 {
		t.Fatalf("prompt_tokens %d for %d bytes: not BPE-like", first.prompt, len(sys)+len(q))
	}
	again := chat(t, ctx, base, "tiny", sys, q, 24)
	if want := (first.prompt - 1) / 16 * 16; again.cached != want {
		t.Fatalf("same prompt again: cached %d, want %d (whole blocks short of the last token)", again.cached, want)
	}
	other := chat(t, ctx, base, "tiny", sys, words(3, 200), 24)
	if other.cached == 0 || other.cached%16 != 0 || other.cached >= again.cached {
		t.Fatalf("same system prompt, another question: cached %d, want whole blocks of the shared part", other.cached)
	}
	m := metrics(t, base)
	if got, want := gauge(m, "vllm:prefix_cache_queries_total"), float64(first.prompt+again.prompt+other.prompt); got != want {
		t.Fatalf("prefix_cache_queries_total = %v, want %v", got, want)
	}
	if got, want := gauge(m, "vllm:prefix_cache_hits_total"), float64(again.cached+other.cached); got != want {
		t.Fatalf("prefix_cache_hits_total = %v, want %v", got, want)
	}
	if got := gauge(m, "vllm:kv_cache_usage_perc"); got != 0 {
		t.Fatalf("idle pod with cached blocks: kv_cache_usage_perc = %v, want 0 (idle cached blocks are free)", got)
	}
	// The metadata center's scraper reads the pod as it reads vLLM,
	// the KV cache's size from vllm:cache_config_info's labels.
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	sig, err := podsignals.Parse(podsignals.BackendVLLM, resp.Body)
	resp.Body.Close()
	if err != nil || sig.KVCapacity != 256*16 || sig.KVCacheUtil != 0 || sig.Running != 0 {
		t.Fatalf("scraped %+v (%v), want an idle pod of %d KV tokens", sig, err, 256*16)
	}
	if got := m[`vllm:time_to_first_token_seconds_count{model_name="tiny"}`]; got != 3 {
		t.Fatalf("TTFT histogram count = %v, want 3", got)
	}
	if got := gauge(m, "vllm:generation_tokens_total"); got != 72 {
		t.Fatalf("generation_tokens_total = %v, want 72", got)
	}
}

// Running and waiting gauges follow the engine: max_num_seqs run, the rest
// wait, a client that leaves frees its slot and its blocks.
func TestGaugesFollowRunningWaitingAndAborts(t *testing.T) {
	c := testConfig()
	c.MaxNumSeqs, c.StepTime = 1, 5*time.Millisecond
	base := startPods(t, c, 1)[0]
	ctx1, cancel1 := context.WithCancel(context.Background())
	ctx2, cancel2 := context.WithCancel(context.Background())
	done := make(chan answer, 2)
	go func() { done <- chat(t, ctx1, base, "tiny", words(4, 800), "a", 1500) }()
	waitFor(t, "one running", func() bool { return gauge(metrics(t, base), "vllm:num_requests_running") == 1 })
	go func() { done <- chat(t, ctx2, base, "tiny", words(5, 800), "b", 1500) }()
	waitFor(t, "one waiting", func() bool { return gauge(metrics(t, base), "vllm:num_requests_waiting") == 1 })
	if u := gauge(metrics(t, base), "vllm:kv_cache_usage_perc"); u <= 0 || u >= 1 {
		t.Fatalf("kv_cache_usage_perc with one request running = %v", u)
	}
	cancel1()
	waitFor(t, "the second to run", func() bool {
		m := metrics(t, base)
		return gauge(m, "vllm:num_requests_running") == 1 && gauge(m, "vllm:num_requests_waiting") == 0
	})
	cancel2()
	waitFor(t, "an idle pod", func() bool {
		m := metrics(t, base)
		return gauge(m, "vllm:num_requests_running") == 0 && gauge(m, "vllm:kv_cache_usage_perc") == 0
	})
	<-done
	<-done
}

// When running sequences outgrow the KV cache, the last one is preempted,
// recomputed later, and every request still completes.
func TestPreemptionByRecomputeCompletesEveryRequest(t *testing.T) {
	c := testConfig()
	c.NumBlocks, c.MaxModelLen, c.MaxNumSeqs = 24, 384, 4
	base := startPods(t, c, 1)[0]
	out := make(chan answer, 3)
	for i := range 3 {
		go func() { out <- chat(t, context.Background(), base, "tiny", words(uint64(10+i), 200), "q", 120) }()
	}
	for range 3 {
		if a := <-out; a.status != http.StatusOK || a.complete != 120 {
			t.Fatalf("answer %+v, want 200 with 120 tokens", a)
		}
	}
	if n := gauge(metrics(t, base), "vllm:num_preemptions_total"); n == 0 {
		t.Fatal("three sequences of 24 blocks each ran in 24 blocks without a preemption")
	}
	if u := gauge(metrics(t, base), "vllm:kv_cache_usage_perc"); u != 0 {
		t.Fatalf("usage after all finished = %v", u)
	}
}

// Bad requests get the JSON error format and do not reach the engine.
func TestBadRequestsGetJSONErrors(t *testing.T) {
	base := startPods(t, testConfig(), 1)[0]
	post := func(body string) (int, string) {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, tc := range []struct {
		body   string
		status int
		says   string
	}{
		{`{`, 400, `"error"`},
		{`{"model":"tiny","messages":[]}`, 400, "messages"},
		{`{"model":"other","messages":[{"role":"user","content":"hi"}]}`, 404, "other"},
		{fmt.Sprintf(`{"model":"tiny","max_tokens":2000,"messages":[{"role":"user","content":%q}]}`, words(6, 1000)), 400, "maximum context length"},
	} {
		status, body := post(tc.body)
		if status != tc.status || !strings.Contains(body, tc.says) || !strings.Contains(body, `"code":`) {
			t.Errorf("%.40s: %d %s, want %d naming %q", tc.body, status, body, tc.status, tc.says)
		}
	}
	if got := gauge(metrics(t, base), "vllm:prefix_cache_queries_total"); got != 0 {
		t.Fatalf("bad requests reached the engine: %v tokens queried", got)
	}
	// A text completion, whole: the same engine, no chat template ("one",
	// " two", " thre", "e", " four": five tokens).
	resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(`{"model":"tiny","prompt":"one two three four","max_tokens":5}`))
	if err != nil {
		t.Fatal(err)
	}
	var c struct {
		Choices []struct{ Text string } `json:"choices"`
		Usage   struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil || resp.StatusCode != 200 || len(c.Choices) != 1 ||
		len(Tokenize(c.Choices[0].Text)) != 5 || c.Usage.PromptTokens != 5 || c.Usage.CompletionTokens != 5 {
		t.Fatalf("completion: %d %+v %v", resp.StatusCode, c, err)
	}
	resp.Body.Close()
	resp, err = http.Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"id":"tiny"`) {
		t.Fatalf("/v1/models: %s", b)
	}
}

// Many pods in one process stay independent: each has its own cache.
func TestPodsKeepTheirOwnCaches(t *testing.T) {
	pods := startPods(t, testConfig(), 3)
	sys := words(7, 1000)
	chat(t, context.Background(), pods[0], "tiny", sys, "x", 4)
	if a := chat(t, context.Background(), pods[1], "tiny", sys, "x", 4); a.cached != 0 {
		t.Fatalf("pod 1 hit pod 0's prefix: cached %d", a.cached)
	}
	if a := chat(t, context.Background(), pods[0], "tiny", sys, "x", 4); a.cached == 0 {
		t.Fatal("pod 0 lost its prefix")
	}
}
