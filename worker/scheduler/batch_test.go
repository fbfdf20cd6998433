package scheduler

import (
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
)

// batchRig is a scheduler on a simulated engine (n_batch 512) whose batch
// the tests call directly, and mk makes a running task with seq, total
// tokens and past of them already in the cache.
func batchRig(t *testing.T, cfg Config) (*Scheduler, func(seq, total, past int) *task) {
	t.Helper()
	eng, err := sim.New(sim.Config{NSeqMax: 8, NCtx: 8192, NBatch: 512})
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(eng, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, func(seq, total, past int) *task {
		sm, err := eng.NewSampler(engine.SamplingParams{})
		if err != nil {
			t.Fatal(err)
		}
		return &task{state: Processing, seq: seq, toks: make([]int, total), past: past, sampler: sm}
	}
}

// servedBy builds s's next batch and returns the tokens each task got.
func servedBy(s *Scheduler) map[*task]int {
	spans, tasks := s.batch()
	got := map[*task]int{}
	for i, tk := range tasks {
		got[tk] = len(spans[i].Tokens)
	}
	return got
}

// A step serves every decoding sequence first, then prefill shortest
// remaining first: a cache hit with a short uncached tail completes its
// prefill in this step although cold prompts were admitted before it.
func TestBatchDecodesFirstThenShortestPrefill(t *testing.T) {
	s, mk := batchRig(t, Config{})
	coldA := mk(0, 3000, 0)     // admitted first, 3000 to prefill
	coldB := mk(1, 2000, 512)   // 1488 left
	decoding := mk(2, 900, 899) // one token: decoding
	hit := mk(3, 1400, 1310)    // 90 left: its prefix came from the cache
	waiting := &task{state: Pending, seq: -1, toks: make([]int, 50)}
	s.set = []*task{coldA, coldB, decoding, hit, waiting}

	spans, tasks := s.batch()
	got := map[*task]int{}
	total := 0
	for i, tk := range tasks {
		got[tk] = len(spans[i].Tokens)
		total += len(spans[i].Tokens)
	}
	if tasks[0] != decoding || got[decoding] != 1 {
		t.Fatalf("the decoding sequence must come first with one token, got %d", got[decoding])
	}
	if tasks[1] != hit || got[hit] != 90 || spans[1].Sampler != hit.sampler {
		t.Fatalf("the cache hit must prefill all its 90 tokens next, got %d", got[hit])
	}
	if spans[2].Sampler != nil {
		t.Fatal("a prefill chunk that does not reach the prompt's end must not sample")
	}
	if got[coldB] != 512-1-90 || got[coldA] != 0 || got[waiting] != 0 {
		t.Fatalf("the rest of the budget goes to the shorter cold prompt: A %d B %d pending %d", got[coldA], got[coldB], got[waiting])
	}
	if total != 512 {
		t.Fatalf("batch has %d tokens, want the full n_batch 512", total)
	}
}

// With more sequences ready than --max-batch-size, a step takes at most
// that many, those that waited longest first, so every sequence gets a turn
// and decoders cannot shut a new prompt out.
func TestBatchSizeLimitsSequencesPerStepAndRotates(t *testing.T) {
	s, mk := batchRig(t, Config{MaxBatch: 2})
	d1, d2, d3 := mk(0, 100, 99), mk(1, 100, 99), mk(2, 100, 99)
	p := mk(3, 300, 0)
	s.set = []*task{d1, d2, d3, p}
	served := map[*task]int{}
	for step := range 2 {
		spans, tasks := s.batch()
		if len(spans) > 2 {
			t.Fatalf("step %d has %d sequences, the limit is 2", step, len(spans))
		}
		for _, tk := range tasks {
			served[tk]++
		}
	}
	for i, tk := range []*task{d1, d2, d3, p} {
		if served[tk] != 1 {
			t.Fatalf("sequence %d served %d times in two steps of two; want every one once", i, served[tk])
		}
	}
}

// With FinishFirst, a request within its last tokens decodes without a
// long prefill beside it (whose attention its cells would crowd), while a
// short prefill still runs; once it ends, or with more tokens left, the
// long prefill goes on.
func TestFinishFirstHoldsLongPrefillsNextToAFinishingRequest(t *testing.T) {
	s, mk := batchRig(t, Config{FinishFirst: 16})
	finishing := mk(0, 2010, 2009)
	finishing.nGen, finishing.maxTokens = 3, 8 // 5 tokens left
	long := mk(1, 2000, 0)                     // a cold 2k prompt
	short := mk(2, 1400, 1380)                 // a cache hit: 20 left
	long.maxTokens, short.maxTokens = 8, 8
	s.set = []*task{finishing, long, short}
	if got := servedBy(s); got[finishing] != 1 || got[short] != 20 || got[long] != 0 {
		t.Fatalf("next to a finishing request: finishing %d, short %d, long %d; want 1, 20, 0", got[finishing], got[short], got[long])
	}
	finishing.maxTokens = 2048 // far from its end: no reason to hold
	if got := servedBy(s); got[long] == 0 {
		t.Fatal("a long prefill was held next to a request with 2045 tokens left")
	}
	finishing.maxTokens = 8
	s.set = []*task{long}
	if got := servedBy(s); got[long] != 512 {
		t.Fatalf("alone, the long prompt gets %d tokens, want the full step", got[long])
	}
}

// With PrefillChunk, a step that carries more than one request holds at
// most that many prompt tokens, shortest first as ever: the decoding
// request and a cache hit's 20-token tail are not kept waiting for a whole
// n_batch of a cold prompt. A prompt stepping alone takes the whole
// n_batch.
func TestPrefillChunkBoundsAStepOfSeveralRequests(t *testing.T) {
	s, mk := batchRig(t, Config{PrefillChunk: 128})
	decoding := mk(0, 900, 899)
	cold := mk(1, 3000, 0)
	hit := mk(2, 1400, 1380)
	s.set = []*task{decoding, cold, hit}
	if got := servedBy(s); got[decoding] != 1 || got[hit] != 20 || got[cold] != 108 || got[hit]+got[cold] != 128 {
		t.Fatalf("decoding %d, hit %d, cold %d (%d prompt tokens); want 1, 20, 108 (128)", got[decoding], got[hit], got[cold], got[hit]+got[cold])
	}
	other := mk(3, 2000, 0)
	s.set = []*task{cold, other}
	if got := servedBy(s); got[cold]+got[other] != 128 {
		t.Fatalf("two cold prompts took %d tokens in one step, want 128", got[cold]+got[other])
	}
	s.set = []*task{cold}
	if got := servedBy(s); got[cold] != 512 {
		t.Fatalf("alone, a cold prompt takes %d tokens, want the whole n_batch 512", got[cold])
	}
}
