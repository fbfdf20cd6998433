package scheduler

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
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

// filler is n prompt tokens of the sim engine's vocabulary, a different
// sequence for each salt.
func filler(n, salt int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = 3 + 'a' + (i*salt+i/26+salt)%26
	}
	return p
}

// A long prompt does not go aside when, landing beside the running request
// and what it may still write, it would not fit: it waits for room in the
// KV cache as it would without room aside, and nothing is preempted.
func TestNoAsideWhereItCouldNotLand(t *testing.T) {
	// 1024 cells: the finishing request holds 400 + up to 300, the long
	// prompt needs 700.
	short, long := filler(400, 1), filler(700, 7)
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
	if n := counterValue(m.asideTokens); n != 0 {
		t.Fatalf("%v tokens prefilled aside; they could not have landed beside the finishing request", n)
	}
	if n := counterValue(m.preemptions); n != 0 {
		t.Fatalf("%v preemptions", n)
	}
}

// When a request admitted after a prompt went aside takes the room it was
// to land in, the prompt waits with its cells aside until a request
// releases its seq id, instead of being preempted (its prefill thrown away)
// or preempting the newcomer.
func TestPrefilledAsideWaitsForRoomInsteadOfBeingPreempted(t *testing.T) {
	// 1600 cells. A: 100 + up to 300, finishing from its first token.
	// B: 1100, fits beside A (1600 − 100 − 300 ≥ 1100), so it goes aside
	// in chunks of 512, 512, 75. C: 500 + 100, submitted while the first
	// chunk runs, prefilled in the cache beside A. When B would land, A and
	// C hold over 600 cells: no room until C (or A) ends.
	short, long, mid := filler(100, 1), filler(1100, 7), filler(500, 11)
	reqs := []*Request{
		{ID: "a", Prompt: short, MaxTokens: 300, IgnoreEOS: true},
		{ID: "b", Prompt: long, MaxTokens: 8, IgnoreEOS: true},
		{ID: "c", Prompt: mid, MaxTokens: 100, IgnoreEOS: true},
	}
	solo := newRig(t, sim.Config{NCtx: 1600}, Config{}, true)
	var soloOut [3][]int
	for i, q := range reqs {
		soloOut[i], _ = run(t, solo, context.Background(), q)
	}

	// The sim engine sleeps its modelled cost; only an aside chunk of 512
	// tokens costs 5 ms or more here. The first one waits for C.
	asideStarted, cSubmitted := make(chan struct{}), make(chan struct{})
	var once sync.Once
	sleep := func(d time.Duration) {
		if d >= 5*time.Millisecond {
			once.Do(func() {
				close(asideStarted)
				<-cSubmitted
			})
		}
		time.Sleep(d)
	}
	m := NewMetrics(nil)
	r := newRig(t, sim.Config{NCtx: 1600, AsideCells: 2048, Sleep: sleep,
		Cost: sim.Cost{StepOverhead: time.Millisecond, PerToken: 10 * time.Microsecond}},
		Config{FinishFirst: 512, Metrics: m}, true)
	var h [3]*Handle
	submit := func(i int) {
		var err error
		if h[i], err = r.s.Submit(context.Background(), reqs[i]); err != nil {
			t.Fatal(err)
		}
	}
	var out [3][]int
	var res [3]*Result
	take := func(i int) {
		select {
		case <-h[i].Ready():
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: no progress in 30s", reqs[i].ID)
		}
		toks, r := h[i].Take()
		out[i], res[i] = append(out[i], toks...), r
	}
	submit(0)
	for len(out[0]) == 0 && res[0] == nil {
		take(0)
	}
	submit(1)
	select {
	case <-asideStarted:
	case <-time.After(30 * time.Second):
		t.Fatal("the long prompt did not go aside in 30s")
	}
	submit(2)
	close(cSubmitted)
	for i := range h {
		for res[i] == nil {
			take(i)
		}
		if res[i].State != Completed || !slices.Equal(out[i], soloOut[i]) {
			t.Fatalf("%s: %+v, the output of running alone: %v", reqs[i].ID, res[i], slices.Equal(out[i], soloOut[i]))
		}
	}
	if n := counterValue(m.asideTokens); n != float64(len(long)-1) {
		t.Fatalf("%v tokens prefilled aside, want %d", n, len(long)-1)
	}
	if n := counterValue(m.preemptions); n != 0 {
		t.Fatalf("%v preemptions; the long request should have waited for room", n)
	}
}

// While a request waits in the queue for a running slot, no prompt starts
// aside: the queue drains as fast as the running requests end, and a
// prompt aside would slow them. A (finishing) and B (long, cold) take both
// slots and C queues behind them until A ends; only then does B go aside.
func TestNoAsideWhileRequestsQueue(t *testing.T) {
	var mu sync.Mutex
	var s *Scheduler
	hold, held := make(chan struct{}), false
	asideWhileQueued := 0
	sleep := func(d time.Duration) {
		mu.Lock()
		if d >= 20*time.Millisecond && s.Stats().Queued > 0 {
			asideWhileQueued++
		}
		if held {
			held = false
			mu.Unlock()
			<-hold // the loop waits inside a step of A's while B and C come
		} else {
			mu.Unlock()
		}
		time.Sleep(d)
	}
	m := NewMetrics(nil)
	r := newRig(t, sim.Config{NCtx: 4096, AsideCells: 2048, Sleep: sleep,
		Cost: sim.Cost{StepOverhead: 2 * time.Millisecond, PerToken: 80 * time.Microsecond}},
		Config{FinishFirst: 512, MaxRunning: 2, Metrics: m}, false)
	s = r.s
	r.start()
	ha, err := s.Submit(context.Background(), &Request{ID: "a", Prompt: filler(100, 1), MaxTokens: 200, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	<-ha.Ready()
	mu.Lock()
	held = true
	mu.Unlock()
	time.Sleep(50 * time.Millisecond) // the loop is in the next step of A's, held
	long := filler(1500, 7)
	var hb, hc *Handle
	if hb, err = s.Submit(context.Background(), &Request{ID: "b", Prompt: long, MaxTokens: 8, IgnoreEOS: true}); err != nil {
		t.Fatal(err)
	}
	if hc, err = s.Submit(context.Background(), &Request{ID: "c", Prompt: filler(100, 11), MaxTokens: 8, IgnoreEOS: true}); err != nil {
		t.Fatal(err)
	}
	close(hold)
	for _, h := range []*Handle{ha, hb, hc} {
		for {
			<-h.Ready()
			if _, res := h.Take(); res != nil {
				if res.State != Completed {
					t.Fatalf("%+v", res)
				}
				break
			}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if asideWhileQueued > 0 {
		t.Fatalf("%d chunks aside while a request queued", asideWhileQueued)
	}
	// Once A ends and C runs, B prefills in the cache beside C's prompt
	// and goes aside, for what is left, when C decodes.
	if n := counterValue(m.asideTokens); n == 0 {
		t.Fatal("nothing prefilled aside once the queue emptied")
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

// noLanding is the sim engine whose cells computed aside never fit back
// into the cache: llama.cpp restores a sequence's cells only into one run
// of free cells (llama-kv-cache.cpp, state_read_meta calling find_slot),
// and answers no room otherwise.
type noLanding struct {
	*sim.Engine
	refused atomic.Int64
}

func (e *noLanding) Step(spans []engine.Span) ([]int, error) {
	for _, s := range spans {
		if s.Pos > e.SeqLen(s.Seq) { // the step would bring cells computed aside in
			e.refused.Add(1)
			return nil, engine.ErrKVFull
		}
	}
	return e.Engine.Step(spans)
}

// A request whose cells computed aside cannot come back even once it is
// alone drops them and prefills in the cache instead of failing, with the
// output it would have had.
func TestAsideCellsThatCannotComeBackStartOverInTheCache(t *testing.T) {
	short, long := filler(100, 1), filler(1500, 7)
	solo := newRig(t, sim.Config{}, Config{}, true)
	want, _ := run(t, solo, context.Background(), &Request{ID: "b", Prompt: long, MaxTokens: 8, IgnoreEOS: true})

	s, err := sim.New(sim.Config{NSeqMax: 4, NCtx: 4096, AsideCells: 2048,
		Cost: sim.Cost{StepOverhead: 2 * time.Millisecond, PerToken: 10 * time.Microsecond}})
	if err != nil {
		t.Fatal(err)
	}
	eng := &noLanding{Engine: s}
	m := NewMetrics(nil)
	sc := startSched(t, eng, Config{FinishFirst: 512, Metrics: m})

	ha, err := sc.Submit(context.Background(), &Request{ID: "a", Prompt: short, MaxTokens: 200, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	<-ha.Ready() // a's first token: it finishes from here on, so b goes aside
	got, res := collect(t, sc, &Request{ID: "b", Prompt: long, MaxTokens: 8, IgnoreEOS: true})
	if res.State != Completed || !slices.Equal(got, want) {
		t.Fatalf("b: %+v, output %v; want completed with %v", res, got, want)
	}
	if counterValue(m.asideTokens) == 0 || eng.refused.Load() == 0 {
		t.Fatalf("%v tokens aside, %d landings refused; the test wants b aside and its landing refused",
			counterValue(m.asideTokens), eng.refused.Load())
	}
}

// chunkLog is the sim engine recording the length of every chunk
// prefilled aside.
type chunkLog struct {
	*sim.Engine
	mu     sync.Mutex
	chunks []int
}

func (e *chunkLog) PrefillAside(seq, pos int, tokens []int) error {
	e.mu.Lock()
	e.chunks = append(e.chunks, len(tokens))
	e.mu.Unlock()
	return e.Engine.PrefillAside(seq, pos, tokens)
}

// With AsideChunk, a prompt aside takes chunks of that size while another
// request steps, and whole n_batch chunks once nothing else does; its
// output is the same.
func TestAsideChunkWhileOthersStep(t *testing.T) {
	short, long := filler(100, 1), filler(1500, 7)
	solo := newRig(t, sim.Config{}, Config{}, true)
	want, _ := run(t, solo, context.Background(), &Request{ID: "b", Prompt: long, MaxTokens: 8, IgnoreEOS: true})

	hold := make(chan struct{})
	var held atomic.Bool
	s, err := sim.New(sim.Config{NSeqMax: 4, NCtx: 4096, AsideCells: 2048, Sleep: func(d time.Duration) {
		if held.CompareAndSwap(true, false) {
			<-hold // the loop waits inside a step of a's while b comes
		}
		time.Sleep(d)
	}, Cost: sim.Cost{StepOverhead: time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	eng := &chunkLog{Engine: s}
	sc := startSched(t, eng, Config{FinishFirst: 512, AsideChunk: 128})

	ha, err := sc.Submit(context.Background(), &Request{ID: "a", Prompt: short, MaxTokens: 6, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	<-ha.Ready()
	held.Store(true)
	time.Sleep(50 * time.Millisecond) // the loop is held in a's next step
	hb, err := sc.Submit(context.Background(), &Request{ID: "b", Prompt: long, MaxTokens: 8, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	close(hold)
	var got []int
	for {
		<-hb.Ready()
		toks, res := hb.Take()
		got = append(got, toks...)
		if res != nil {
			if res.State != Completed || !slices.Equal(got, want) {
				t.Fatalf("b: %+v, output %v; want completed with %v", res, got, want)
			}
			break
		}
	}
	eng.mu.Lock()
	defer eng.mu.Unlock()
	if len(eng.chunks) < 2 || eng.chunks[0] != 128 || !slices.Contains(eng.chunks, 512) || slices.Max(eng.chunks) > 512 {
		t.Fatalf("chunks aside %v; want 128 while a steps, then 512 once it has ended", eng.chunks)
	}
}
