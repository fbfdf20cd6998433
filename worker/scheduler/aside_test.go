package scheduler

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/llama"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// besideAFinishingRequest runs a request with a short prompt that decodes
// maxA tokens (within FinishFirst from its first one) and, once its first
// token is out, a request with a long cold prompt; it returns both outputs
// and results.
func besideAFinishingRequest(t *testing.T, s *Scheduler, short, long []int, maxA int) (outA, outB []int, resA, resB *Result) {
	t.Helper()
	ha, err := s.Submit(context.Background(), &Request{ID: "finishing", Prompt: short, MaxTokens: maxA, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	for len(outA) == 0 {
		select {
		case <-ha.Ready():
		case <-time.After(30 * time.Second):
			t.Fatal("no first token in 30s")
		}
		toks, res := ha.Take()
		outA = append(outA, toks...)
		if res != nil {
			t.Fatalf("the finishing request ended before the long one came: %+v", res)
		}
	}
	outB, resB = collect(t, s, &Request{ID: "long", Prompt: long, MaxTokens: 8, IgnoreEOS: true})
	for resA == nil {
		<-ha.Ready()
		var toks []int
		toks, resA = ha.Take()
		outA = append(outA, toks...)
	}
	return outA, outB, resA, resB
}

// On llama.cpp: a long cold prompt that arrives while a request finishes
// is prefilled in the context aside, and both get the greedy output of
// running alone; the cells computed aside are the long prompt's cache
// entry, which its next turn reuses.
func TestLlamaLongPromptIsPrefilledAsideBesideAFinishingRequest(t *testing.T) {
	path := testmodel.Path(t)
	ref := openLlama(t, path, 4096, 4)
	short := tokenize(t, ref, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
	long := tokenize(t, ref, history(1400, "aside")+"<|im_start|>assistant\n")
	cold := coldRuns(t, path, [][]int{long}, 8)[0]
	refS := startSched(t, ref, Config{})
	soloA, _ := collect(t, refS, &Request{ID: "a", Prompt: short, MaxTokens: 200, IgnoreEOS: true})

	eng, err := llama.Open(llama.Config{ModelPath: path, NCtx: 4096, NSeqMax: 4, Threads: 1, AsideCells: 2048})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	m := NewMetrics(nil)
	s := startSched(t, eng, Config{FinishFirst: 256, Metrics: m})
	outA, outB, resA, resB := besideAFinishingRequest(t, s, short, long, 200)
	if resA.State != Completed || resB.State != Completed {
		t.Fatalf("finishing %+v, long %+v", resA, resB)
	}
	if !slices.Equal(outB, cold) || !slices.Equal(outA, soloA) {
		t.Fatalf("beside each other, one prefilled aside:\nlong  %v\ncold  %v\nshort %v\nsolo  %v", outB, cold, outA, soloA)
	}
	if n := counterValue(m.asideTokens); n < float64(len(long)-1-eng.Info().NBatch) {
		t.Fatalf("%v prompt tokens prefilled aside; want all but the last %d of %d at least", n, eng.Info().NBatch+1, len(long))
	}
	next := append(append(slices.Clone(long), outB...), tokenize(t, eng, "<|im_end|>\n")[1:]...)
	_, res := collect(t, s, &Request{ID: "long2", Prompt: next, MaxTokens: 1})
	if res.CachedTokens != len(long)+len(outB)-1 {
		t.Fatalf("the next turn reused %d tokens, want the first turn's %d cells", res.CachedTokens, len(long)+len(outB)-1)
	}
}

// When the cells computed aside do not fit into the KV cache beside the
// running request, the long request waits with them for room instead of
// being preempted (its prefill thrown away), and goes on once the other
// ends.
func TestPrefilledAsideWaitsForRoomInsteadOfBeingPreempted(t *testing.T) {
	// 1024 cells: the finishing request holds 400 + up to 300, the long
	// prompt needs 700.
	short, long := make([]int, 400), make([]int, 700)
	for i := range short {
		short[i] = 3 + 'a' + i%26
	}
	for i := range long {
		long[i] = 3 + 'a' + (i*7+i/26+1)%26
	}
	solo := newRig(t, sim.Config{NCtx: 1024}, Config{}, true)
	soloA, _ := run(t, solo, context.Background(), &Request{ID: "a", Prompt: short, MaxTokens: 300, IgnoreEOS: true})
	soloB, _ := run(t, solo, context.Background(), &Request{ID: "b", Prompt: long, MaxTokens: 8, IgnoreEOS: true})

	m := NewMetrics(nil)
	r := newRig(t, sim.Config{NCtx: 1024, AsideCells: 1024, Cost: sim.Cost{StepOverhead: time.Millisecond}},
		Config{FinishFirst: 512, Metrics: m}, true)
	outA, outB, resA, resB := besideAFinishingRequest(t, r.s, short, long, 300)
	if resA.State != Completed || resB.State != Completed || !slices.Equal(outA, soloA) || !slices.Equal(outB, soloB) {
		t.Fatalf("finishing %+v (solo output: %v), long %+v (solo output: %v)", resA, slices.Equal(outA, soloA), resB, slices.Equal(outB, soloB))
	}
	if n := counterValue(m.asideTokens); n != float64(len(long)-1) {
		t.Fatalf("%v tokens prefilled aside, want %d", n, len(long)-1)
	}
	if n := counterValue(m.preemptions); n != 0 {
		t.Fatalf("%v preemptions; the long request should have waited for room", n)
	}
	if resB.CachedTokens != 0 {
		t.Fatalf("the long prompt reports %d cached tokens; computed aside is not cached", resB.CachedTokens)
	}
}

// Without FinishFirst nothing is held back, so nothing goes aside.
func TestNoAsideWithoutFinishFirst(t *testing.T) {
	eng, err := sim.New(sim.Config{NSeqMax: 2, NCtx: 1024, AsideCells: 1024})
	if err != nil {
		t.Fatal(err)
	}
	var _ engine.Aside = eng
	s, err := New(eng, Config{})
	if err != nil {
		t.Fatal(err)
	}
	if s.aside != nil {
		t.Fatal("room aside used without Config.FinishFirst")
	}
}
