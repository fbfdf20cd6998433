package scheduler

// Tests and benchmarks on real llama.cpp compute with the generated models.
// Tests use one llama.cpp thread: go test runs packages side by side, and
// ggml's thread barriers collapse when cores are oversubscribed.

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/llama"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// TestMain quiets llama.cpp's model-loading chatter (it logs through
// slog.Default's level) so benchmark output stays readable.
func TestMain(m *testing.M) {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	os.Exit(m.Run())
}

func startSched(tb testing.TB, eng engine.Engine, cfg Config) *Scheduler {
	tb.Helper()
	s, err := New(eng, cfg.WithDefaults())
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	tb.Cleanup(func() { cancel(); <-done })
	return s
}

func openLlama(tb testing.TB, path string, nCtx, nSeq int) *llama.Engine {
	return openLlamaParking(tb, path, nCtx, nSeq, 0)
}

// openLlamaParking opens with a park bound (0: the default, the KV cache's
// size). Tests of what parking keeps, not of the bound, pass a bound that
// holds all their entries: parked entries do not share a common prefix's
// bytes, so a few long conversations exceed the KV cache's size.
func openLlamaParking(tb testing.TB, path string, nCtx, nSeq int, parkMax int64) *llama.Engine {
	tb.Helper()
	e, err := llama.Open(llama.Config{ModelPath: path, NCtx: nCtx, NSeqMax: nSeq, Threads: 1, ParkMaxBytes: parkMax})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { e.Close() })
	return e
}

func collect(tb testing.TB, s *Scheduler, req *Request) ([]int, *Result) {
	tb.Helper()
	h, err := s.Submit(context.Background(), req)
	if err != nil {
		tb.Fatalf("submit %s: %v", req.ID, err)
	}
	var out []int
	for {
		toks, res := h.Take()
		out = append(out, toks...)
		if res != nil {
			return out, res
		}
		<-h.Ready()
	}
}

func tokenize(tb testing.TB, e engine.Engine, text string) []int {
	tb.Helper()
	toks, err := e.Tokenize(text, true)
	if err != nil {
		tb.Fatal(err)
	}
	return toks
}

// history is a multi-turn ChatML conversation of about n tokens on the
// byte-level vocabularies.
func history(n int, salt string) string {
	var sb strings.Builder
	sb.WriteString("<|im_start|>system\n" + salt + ": you are a careful assistant.<|im_end|>\n")
	for i := 0; sb.Len() < n; i++ {
		fmt.Fprintf(&sb, "<|im_start|>user\nQuestion %d: tell me about topic %d in detail.<|im_end|>\n", i, i*7)
		fmt.Fprintf(&sb, "<|im_start|>assistant\nTopic %d is about many things, such as item %d and item %d.<|im_end|>\n", i*7, i, i+1)
	}
	return sb.String()
}

func TestLlamaGreedyIdenticalWithAndWithoutCacheReuse(t *testing.T) {
	path := testmodel.Path(t)
	eng := openLlama(t, path, 4096, 4)
	s := startSched(t, eng, Config{})
	turn1 := tokenize(t, eng, history(600, "A")+"<|im_start|>assistant\n")
	out1, res1 := collect(t, s, &Request{ID: "t1", Prompt: turn1, MaxTokens: 24, IgnoreEOS: true})
	if res1.State != Completed || res1.CachedTokens != 0 || len(out1) != 24 {
		t.Fatalf("turn 1: %+v (%d tokens)", res1, len(out1))
	}
	// Turn 2 continues turn 1 with its answer and a new question.
	turn2 := append(append(slices.Clone(turn1), out1...), tokenize(t, eng, "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n")[1:]...)
	warm, res2 := collect(t, s, &Request{ID: "t2", Prompt: turn2, MaxTokens: 24, IgnoreEOS: true})
	if res2.CachedTokens != len(turn1)+23 {
		t.Fatalf("turn 2 cached %d tokens, want turn 1's %d cells", res2.CachedTokens, len(turn1)+23)
	}
	// The same prompt again: everything but the last token is cached.
	again, res3 := collect(t, s, &Request{ID: "t3", Prompt: turn2, MaxTokens: 24, IgnoreEOS: true})
	if res3.CachedTokens != len(turn2)-1 {
		t.Fatalf("repeat cached %d, want %d", res3.CachedTokens, len(turn2)-1)
	}

	coldEng := openLlama(t, path, 4096, 4)
	cold := startSched(t, coldEng, Config{})
	ref, resCold := collect(t, cold, &Request{ID: "c", Prompt: turn2, MaxTokens: 24, IgnoreEOS: true})
	if resCold.CachedTokens != 0 {
		t.Fatalf("cold worker reported %d cached tokens", resCold.CachedTokens)
	}
	if !slices.Equal(warm, ref) || !slices.Equal(again, ref) {
		t.Fatalf("greedy output differs with cache reuse:\ncold %v\nwarm %v\nrepeat %v", ref, warm, again)
	}
}

func TestLlamaConcurrentBatchesMatchSoloRuns(t *testing.T) {
	path := testmodel.Path(t)
	prompts := []string{history(300, "x"), history(500, "y"), history(200, "z"), "short prompt"}
	solo := make([][]int, len(prompts))
	{
		eng := openLlama(t, path, 4096, 2)
		s := startSched(t, eng, Config{MaxRunning: 1})
		for i, p := range prompts {
			solo[i], _ = collect(t, s, &Request{ID: fmt.Sprint("solo", i), Prompt: tokenize(t, eng, p), MaxTokens: 16, IgnoreEOS: true})
			_ = i
		}
	}
	eng := openLlama(t, path, 4096, 8)
	s := startSched(t, eng, Config{MaxRunning: 4})
	var wg sync.WaitGroup
	for i, p := range prompts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, res := collect(t, s, &Request{ID: fmt.Sprint("b", i), Prompt: tokenize(t, eng, p), MaxTokens: 16, IgnoreEOS: true})
			if res.State != Completed || !slices.Equal(out, solo[i]) {
				t.Errorf("prompt %d batched with others: %+v\n got %v\nwant %v", i, res, out, solo[i])
			}
		}()
	}
	wg.Wait()
}

func TestLlamaKVFullEvictsInsteadOfCrashing(t *testing.T) {
	path := testmodel.Path(t)
	// 1024 cells: each request needs ~600, so every new one must evict the
	// previous entry, found through llama_decode's KV-full answer — when
	// idle entries stay in the KV cache.
	eng, err := llama.Open(llama.Config{ModelPath: path, NCtx: 1024, NSeqMax: 4, Threads: 1, NoPark: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	m := NewMetrics(nil)
	s := startSched(t, eng, Config{Metrics: m})
	for i := range 4 {
		p := tokenize(t, eng, history(580, fmt.Sprint("salt", i)))
		out, res := collect(t, s, &Request{ID: fmt.Sprint("k", i), Prompt: p, MaxTokens: 8, IgnoreEOS: true})
		if res.State != Completed || len(out) != 8 {
			t.Fatalf("request %d: %+v", i, res)
		}
	}
	if n := counterValue(m.evictions.WithLabelValues("kv_full")); n < 3 {
		t.Fatalf("%v evictions on KV full, want one per request after the first", n)
	}
}

// With idle entries parked in host memory (the default), the same four
// requests never fill the 1024 cells, and all four stay cached: a repeat
// of the first is served from its parked cells with the cold run's output.
func TestLlamaParkedEntriesLeaveTheKVCacheFree(t *testing.T) {
	path := testmodel.Path(t)
	eng := openLlamaParking(t, path, 1024, 5, 1<<30) // four entries of ~580 tokens: twice n_ctx
	m := NewMetrics(nil)
	s := startSched(t, eng, Config{Metrics: m})
	var first []int
	var prompt0 []int
	for i := range 4 {
		p := tokenize(t, eng, history(580, fmt.Sprint("salt", i)))
		out, res := collect(t, s, &Request{ID: fmt.Sprint("k", i), Prompt: p, MaxTokens: 8, IgnoreEOS: true})
		if res.State != Completed || len(out) != 8 {
			t.Fatalf("request %d: %+v", i, res)
		}
		if i == 0 {
			first, prompt0 = out, p
		}
	}
	if n := counterValue(m.evictions.WithLabelValues("kv_full")); n != 0 {
		t.Fatalf("%v evictions on KV full with idle entries parked, want 0", n)
	}
	if eng.ParkedBytes() == 0 {
		t.Fatal("nothing parked after four completed requests")
	}
	// The router hears of the cells really in use: none, all are parked.
	// Stats are published by the loop after each step, so the last
	// request's answer can reach us before the step that parked it is
	// published (TestStatsReportPrefillAndKVCells waits the same way).
	var used int
	if !wait.Until(5*time.Second, func() bool { used = s.Stats().KVCellsUsed; return used == 0 }) {
		t.Fatalf("KV cells in use with only parked entries: %d, want 0", used)
	}
	out, res := collect(t, s, &Request{ID: "again", Prompt: prompt0, MaxTokens: 8, IgnoreEOS: true})
	if res.State != Completed || res.CachedTokens != len(prompt0)-1 || !slices.Equal(out, first) {
		t.Fatalf("repeat of the first prompt: %+v (cached %d of %d)\n got %v\nwant %v", res, res.CachedTokens, len(prompt0), out, first)
	}
}

// With --kv-park-max-bytes at two and a half entries, finishing requests
// keeps the parked bytes within it: each new entry evicts the least
// recently used one (reported to the router like any eviction, counted as
// park_bytes), and a repeat of a still-parked conversation gets the output
// of a cold run.
func TestLlamaParkBoundEvictsLRUAndKeepsOutput(t *testing.T) {
	path := testmodel.Path(t)
	probe := openLlama(t, path, 2048, 6)
	prompts := make([][]int, 4)
	for i := range prompts {
		prompts[i] = tokenize(t, probe, history(400, fmt.Sprint("salt", i)))
	}
	// The cold output of the last prompt, and what its entry takes parked.
	ps := startSched(t, probe, Config{})
	cold, res := collect(t, ps, &Request{ID: "cold", Prompt: prompts[3], MaxTokens: 8, IgnoreEOS: true})
	if res.State != Completed || probe.ParkedBytes() == 0 {
		t.Fatalf("cold run: %+v, %d bytes parked", res, probe.ParkedBytes())
	}
	limit := probe.ParkedBytes() * 5 / 2

	eng, err := llama.Open(llama.Config{ModelPath: path, NCtx: 2048, NSeqMax: 6, Threads: 1, ParkMaxBytes: limit})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	var mu sync.Mutex
	var evicted []prefix.Hash
	m := NewMetrics(nil)
	s := startSched(t, eng, Config{Metrics: m, OnEvict: func(hs []prefix.Hash) {
		mu.Lock()
		evicted = append(evicted, hs...)
		mu.Unlock()
	}})
	for i, p := range prompts {
		_, res := collect(t, s, &Request{ID: fmt.Sprint("p", i), Prompt: p, MaxTokens: 8, IgnoreEOS: true,
			Hashes: []prefix.Hash{prefix.Hash(100 + i)}})
		if res.State != Completed {
			t.Fatalf("request %d: %+v", i, res)
		}
		if got := eng.ParkedBytes(); got > limit || got == 0 {
			t.Fatalf("after request %d: %d bytes parked, bound %d", i, got, limit)
		}
	}
	// Reports are sent after the loop's step; wait for the second.
	var got []prefix.Hash
	wait.Until(10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		got = slices.Clone(evicted)
		return len(got) >= 2
	})
	if !slices.Equal(got, []prefix.Hash{100, 101}) {
		t.Fatalf("evictions reported %v, want the two least recently used [100 101]", got)
	}
	if n := counterValue(m.evictions.WithLabelValues("park_bytes")); n != 2 {
		t.Fatalf("%v park_bytes evictions, want 2", n)
	}
	out, res := collect(t, s, &Request{ID: "again", Prompt: prompts[3], MaxTokens: 8, IgnoreEOS: true})
	if res.State != Completed || res.CachedTokens != len(prompts[3])-1 || !slices.Equal(out, cold) {
		t.Fatalf("repeat of a parked conversation: %+v (cached %d of %d)\n got %v\nwant %v", res, res.CachedTokens, len(prompts[3]), out, cold)
	}
	if got := eng.ParkedBytes(); got > limit {
		t.Fatalf("%d bytes parked, bound %d", got, limit)
	}
}

// benchModel is the bench preset (8 layers, 512 wide): $LLMF_BENCH_MODEL,
// or generated once into the user cache directory.
func benchModel(b *testing.B) string {
	if p := os.Getenv("LLMF_BENCH_MODEL"); p != "" {
		return p
	}
	dir, err := os.UserCacheDir()
	if err != nil {
		dir = os.TempDir()
	}
	p := ggufgen.Bench()
	path := filepath.Join(dir, "istio-llm-filter", p.ID(ggufgen.DefaultSeed)+".gguf")
	if _, err := os.Stat(path); err == nil {
		return path
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		b.Fatal(err)
	}
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: p, Seed: ggufgen.DefaultSeed}); err != nil {
		b.Fatal(err)
	}
	return path
}

type engineMaker func(b *testing.B, nSeq int) engine.Engine

// benchEngines: llama is the worker's default (plain attention kernel, idle
// entries parked); llama-flash the default before parking (flash
// attention, idle entries in the KV cache).
func benchEngines() map[string]engineMaker {
	llamaMaker := func(fa, noPark bool) engineMaker {
		return func(b *testing.B, nSeq int) engine.Engine {
			threads, _ := strconv.Atoi(os.Getenv("LLMF_THREADS"))
			e, err := llama.Open(llama.Config{ModelPath: benchModel(b), NCtx: 8192, NSeqMax: nSeq, Threads: threads,
				FlashAttention: fa, NoPark: noPark})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { e.Close() })
			return e
		}
	}
	return map[string]engineMaker{
		"llama":       llamaMaker(false, false),
		"llama-flash": llamaMaker(true, true),
		"sim": func(b *testing.B, nSeq int) engine.Engine {
			e, err := sim.New(sim.Config{NCtx: 8192, NSeqMax: nSeq, Cost: sim.BenchCost()})
			if err != nil {
				b.Fatal(err)
			}
			return e
		},
	}
}

// BenchmarkTTFT measures time to first token for a new question after a
// ~2k-token conversation: cold (no cache: the history is prefilled) and warm
// (the history's cells are reused and only the question is prefilled).
//
// shared-prefix-concurrent: four users send one ~2k-token system prompt
// plus their own question 50 ms apart, on an empty cache; the mean TTFT
// of the four, with following a prefill in flight on and off.
//
// distinct-concurrent: the same, each user with a different ~2k-token
// system prompt (nothing to share: the prefill policy and the kernel's
// cost over the others' cells decide).
func BenchmarkTTFT(b *testing.B) {
	for _, name := range []string{"llama", "llama-flash", "sim"} {
		mk := benchEngines()[name]
		for _, warm := range []bool{false, true} {
			b.Run(name+"/"+ttftMode(warm), func(b *testing.B) {
				eng := mk(b, 8)
				benchTTFT(b, eng, startSched(b, eng, Config{}), warm)
			})
		}
		b.Run(name+"/shared-prefix-concurrent", func(b *testing.B) {
			eng := mk(b, 8)
			benchConcurrent(b, eng, startSched(b, eng, Config{}), false)
		})
		b.Run(name+"/distinct-concurrent", func(b *testing.B) {
			eng := mk(b, 8)
			benchConcurrent(b, eng, startSched(b, eng, Config{}), true)
		})
	}
}

// benchConcurrent: every iteration four users share a new ~2k-token system
// prompt (so nothing is cached from the last one), or each has its own
// (distinct), and arrive 50 ms apart.
func benchConcurrent(b *testing.B, eng engine.Engine, s *Scheduler, distinct bool) {
	const users = 4
	var ttft time.Duration
	var cached int
	b.ResetTimer()
	for i := range b.N {
		sys := tokenize(b, eng, history(2000, fmt.Sprint("system prompt ", i)))
		var wg sync.WaitGroup
		res := make([]*Result, users)
		arrive := time.NewTicker(50 * time.Millisecond)
		for u := range users {
			if u > 0 {
				<-arrive.C
			}
			if distinct {
				sys = tokenize(b, eng, history(2000, fmt.Sprint("system prompt ", i, " of user ", u)))
			}
			q := tokenize(b, eng, fmt.Sprintf("<|im_start|>user\nuser %d question %d?<|im_end|>\n<|im_start|>assistant\n", u, i))
			p := append(slices.Clone(sys), q[1:]...)
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, res[u] = collect(b, s, &Request{ID: fmt.Sprint("s", i, "-", u), Prompt: p, MaxTokens: 1})
			}()
		}
		arrive.Stop()
		wg.Wait()
		for _, r := range res {
			ttft += r.TTFT
			cached += r.CachedTokens
		}
	}
	b.ReportMetric(float64(ttft.Microseconds())/1000/float64(users*b.N), "ms/ttft")
	b.ReportMetric(float64(cached)/float64(users*b.N), "cached-tokens")
}

// BenchmarkTTFTCrowded is BenchmarkTTFT on a KV cache that already holds
// other conversations (idle entries, as on a busy pod). llama.cpp's unified
// cache attends over every used cell up to the highest one and masks out
// other sequences' cells, so with the plain kernel a token's attention
// cost grows with everything the pod keeps in the cache, not with its own
// context; the CPU flash-attention kernel skips masked cells but is slower
// per real cell. Variants: park (the default: plain kernel, idle entries
// parked in host memory), flash (flash attention, idle entries in the
// cache: the earlier default), plain (plain kernel, idle entries in the
// cache).
func BenchmarkTTFTCrowded(b *testing.B) {
	variants := []struct {
		name       string
		fa, noPark bool
	}{{"park", false, false}, {"flash", true, true}, {"plain", false, true}}
	for _, v := range variants {
		for _, warm := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/%s", v.name, ttftMode(warm)), func(b *testing.B) {
				threads, _ := strconv.Atoi(os.Getenv("LLMF_THREADS"))
				eng, err := llama.Open(llama.Config{ModelPath: benchModel(b), NCtx: 16384, NSeqMax: 8, Threads: threads,
					FlashAttention: v.fa, NoPark: v.noPark})
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { eng.Close() })
				s := startSched(b, eng, Config{})
				// Four other conversations: ~10k of the 16k cells, or
				// host memory when parked.
				for i := range 4 {
					collect(b, s, &Request{ID: fmt.Sprint("other", i), Prompt: tokenize(b, eng, history(2600, fmt.Sprint("other", i))), MaxTokens: 1})
				}
				benchTTFT(b, eng, s, warm)
			})
		}
	}
}

func ttftMode(warm bool) string { return map[bool]string{false: "cold", true: "warm"}[warm] }

// benchTTFT asks b.N new questions after a ~2.6k-token history, served once
// first when warm, and reports the mean time to first token.
func benchTTFT(b *testing.B, eng engine.Engine, s *Scheduler, warm bool) {
	hist := tokenize(b, eng, history(2600, "bench"))
	if warm {
		collect(b, s, &Request{ID: "history", Prompt: hist, MaxTokens: 1})
	}
	var ttft time.Duration
	var cached int
	b.ResetTimer()
	for i := range b.N {
		p := hist
		if !warm {
			// A different first message: nothing to reuse.
			p = tokenize(b, eng, history(2600, fmt.Sprint("cold", i)))
		}
		p = append(slices.Clone(p), tokenize(b, eng, fmt.Sprintf("<|im_start|>user\nnew question %d?<|im_end|>\n<|im_start|>assistant\n", i))[1:]...)
		_, res := collect(b, s, &Request{ID: fmt.Sprint("q", i), Prompt: p, MaxTokens: 1})
		ttft += res.TTFT
		cached += res.CachedTokens
	}
	b.ReportMetric(float64(ttft.Microseconds())/1000/float64(b.N), "ms/ttft")
	b.ReportMetric(float64(cached)/float64(b.N), "cached-tokens")
	b.ReportMetric(float64(len(hist)), "history-tokens")
}

// BenchmarkDecode measures generated tokens per second with 1, 4 and 8
// sequences decoding together (short prompts, 64 tokens each).
func BenchmarkDecode(b *testing.B) {
	for _, name := range []string{"llama", "sim"} {
		mk := benchEngines()[name]
		for _, n := range []int{1, 4, 8} {
			b.Run(fmt.Sprintf("%s/seqs=%d", name, n), func(b *testing.B) {
				eng := mk(b, 16)
				s := startSched(b, eng, Config{MaxRunning: n})
				const gen = 64
				total := 0
				var elapsed time.Duration
				b.ResetTimer()
				for i := range b.N {
					start := time.Now()
					var wg sync.WaitGroup
					for j := range n {
						wg.Add(1)
						go func() {
							defer wg.Done()
							p := tokenize(b, eng, fmt.Sprintf("sequence %d of round %d: write a story", j, i))
							out, _ := collect(b, s, &Request{ID: fmt.Sprint(i, "-", j), Prompt: p, MaxTokens: gen, IgnoreEOS: true})
							if len(out) != gen {
								b.Errorf("got %d tokens", len(out))
							}
						}()
					}
					wg.Wait()
					elapsed += time.Since(start)
					total += n * gen
				}
				b.ReportMetric(float64(total)/elapsed.Seconds(), "tokens/s")
			})
		}
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

// coldRuns computes each prompt's greedy output alone on a fresh engine:
// nothing cached, nothing shared.
func coldRuns(t *testing.T, path string, prompts [][]int, maxTokens int) [][]int {
	t.Helper()
	out := make([][]int, len(prompts))
	for i, p := range prompts {
		eng := openLlama(t, path, 8192, 8)
		s := startSched(t, eng, Config{})
		out[i], _ = collect(t, s, &Request{ID: fmt.Sprint("cold", i), Prompt: p, MaxTokens: maxTokens, IgnoreEOS: true})
	}
	return out
}

// drain waits for every handle's tokens and result.
func drain(hs []*Handle) ([][]int, []*Result) {
	outs := make([][]int, len(hs))
	results := make([]*Result, len(hs))
	for i, h := range hs {
		for results[i] == nil {
			toks, res := h.Take()
			outs[i] = append(outs[i], toks...)
			if results[i] = res; res == nil {
				<-h.Ready()
			}
		}
	}
	return outs, results
}

// sharedPrompts are n users' questions after one system prompt of about
// sysLen tokens.
func sharedPrompts(tb testing.TB, eng engine.Engine, n, sysLen int) (sys []int, prompts [][]int) {
	sys = tokenize(tb, eng, history(sysLen, "shared system prompt"))
	for i := range n {
		q := tokenize(tb, eng, fmt.Sprintf("<|im_start|>user\nuser %d asks question %d?<|im_end|>\n<|im_start|>assistant\n", i, i*13))
		prompts = append(prompts, append(slices.Clone(sys), q[1:]...))
	}
	return sys, prompts
}

func TestLlamaConcurrentSharedPrefixIsComputedOnce(t *testing.T) {
	path := testmodel.Path(t)
	eng := openLlama(t, path, 8192, 8)
	sys, prompts := sharedPrompts(t, eng, 4, 1800) // four 512-token chunks
	m := NewMetrics(nil)
	s := startSched(t, eng, Config{Metrics: m})
	hs := make([]*Handle, len(prompts))
	for i, p := range prompts {
		h, err := s.Submit(context.Background(), &Request{ID: fmt.Sprint("u", i), Prompt: p, MaxTokens: 12, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		hs[i] = h
	}
	outs, results := drain(hs)
	// After the run: two llama.cpp contexts decoding at once in one
	// process disturb each other's results.
	ref := coldRuns(t, path, prompts, 12)
	computed := 0
	for i, res := range results {
		if res.State != Completed || !slices.Equal(outs[i], ref[i]) {
			t.Fatalf("user %d: %+v\n got %v\nwant %v (cold)", i, res, outs[i], ref[i])
		}
		if i > 0 && res.CachedTokens < len(sys)-1 {
			t.Errorf("user %d reused %d tokens; the %d-token system prompt was being written by user 0", i, res.CachedTokens, len(sys))
		}
		computed += res.PromptTokens - res.CachedTokens
	}
	// The system prompt once, plus each user's own question.
	if max := len(prompts[0]) + 3*(len(prompts[0])-len(sys)+1); computed > max {
		t.Fatalf("%d prompt tokens computed, at most %d when the shared part is computed once", computed, max)
	}
	if err := s.Inspect(context.Background(), func(v View) {
		if err := v.Owner.Check(); err != nil {
			t.Error(err)
		}
	}); err != nil {
		t.Fatal(err)
	}
}

func TestLlamaCancelledLeaderKeepsTheFollowersWork(t *testing.T) {
	path := testmodel.Path(t)
	eng := openLlamaParking(t, path, 8192, 8, 1<<30) // three idle ~3,600-token entries parked
	sys, prompts := sharedPrompts(t, eng, 4, 3500)   // seven chunks: time to cancel mid-way
	s := startSched(t, eng, Config{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	leader, err := s.Submit(ctx, &Request{ID: "leader", Prompt: prompts[0], MaxTokens: 12, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	hs := []*Handle{}
	for i, p := range prompts[1:] {
		h, err := s.Submit(context.Background(), &Request{ID: fmt.Sprint("f", i+1), Prompt: p, MaxTokens: 12, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	// Cancel the leader once it has written its first chunk and the
	// followers hold seq ids (follow it), between steps.
	written := 0
	for ready := false; !ready; {
		if err := s.Inspect(context.Background(), func(v View) {
			if e, ok := v.KV.Get("leader"); ok {
				written = len(e.Tokens)
			}
			ready = written >= 512
			for i := range hs {
				ready = ready && v.States[fmt.Sprint("f", i+1)] == Processing
			}
		}); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	if written >= len(sys)-1 {
		t.Fatalf("the leader wrote %d of %d shared tokens before it could be cancelled: nothing left to test", written, len(sys))
	}
	if res, _ := leader.Wait(context.Background()); res.State != Cancelled {
		t.Fatalf("leader: %+v", res)
	}
	outs, results := drain(hs)
	ref := coldRuns(t, path, prompts[1:], 12)
	computed := 0
	for i, res := range results {
		if res.State != Completed || !slices.Equal(outs[i], ref[i]) {
			t.Fatalf("follower %d: %+v\n got %v\nwant %v (cold)", i+1, res, outs[i], ref[i])
		}
		if res.CachedTokens < written {
			t.Errorf("follower %d reused %d tokens; the leader had written %d before it went", i+1, res.CachedTokens, written)
		}
		computed += res.PromptTokens - res.CachedTokens
	}
	// What the leader had not written yet is computed once, by one of them.
	q := len(prompts[1]) - len(sys) + 1
	if max := len(sys) - written + 3*q; computed > max {
		t.Fatalf("followers computed %d prompt tokens, at most %d when the rest of the shared part is computed once", computed, max)
	}
	if err := s.Inspect(context.Background(), func(v View) {
		if err := v.Owner.Check(); err != nil {
			t.Error(err)
		}
		// The leader's cells stay too, beside the three followers'.
		if v.Pool.InUse() != v.KV.Len() || v.KV.Idle() != 4 {
			t.Errorf("%d ids, %d entries, %d idle after the run", v.Pool.InUse(), v.KV.Len(), v.KV.Idle())
		}
	}); err != nil {
		t.Fatal(err)
	}
}
