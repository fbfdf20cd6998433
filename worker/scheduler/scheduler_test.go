package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/kvcache"
)

type rig struct {
	s      *Scheduler
	eng    *sim.Engine
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	evicts [][]prefix.Hash
}

func newRig(t *testing.T, sc sim.Config, cfg Config, start bool) *rig {
	t.Helper()
	if sc.NSeqMax == 0 {
		sc.NSeqMax = 4
	}
	if sc.NCtx == 0 {
		sc.NCtx = 4096
	}
	eng, err := sim.New(sc)
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{eng: eng, done: make(chan struct{})}
	cfg.OnEvict = func(h []prefix.Hash) {
		r.mu.Lock()
		r.evicts = append(r.evicts, slices.Clone(h))
		r.mu.Unlock()
	}
	r.s, err = New(eng, cfg.WithDefaults())
	if err != nil {
		t.Fatal(err)
	}
	if start {
		r.start()
	}
	t.Cleanup(func() { r.stop() })
	return r
}

func (r *rig) start() {
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { r.s.Run(ctx); close(r.done) }()
}

func (r *rig) stop() {
	if r.cancel != nil {
		r.cancel()
		<-r.done
		r.cancel = nil
	}
}

func (r *rig) inspect(t *testing.T, fn func(View)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.s.Inspect(ctx, fn); err != nil {
		t.Fatal(err)
	}
}

func prompt(eng *sim.Engine, text string) []int {
	toks, _ := eng.Tokenize(text, true)
	return toks
}

func run(t *testing.T, r *rig, ctx context.Context, req *Request) ([]int, *Result) {
	t.Helper()
	h, err := r.s.Submit(ctx, req)
	if err != nil {
		t.Fatalf("submit %s: %v", req.ID, err)
	}
	var out []int
	for {
		toks, res := h.Take()
		out = append(out, toks...)
		if res != nil {
			return out, res
		}
		select {
		case <-h.Ready():
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: no progress in 30s", req.ID)
		}
	}
}

func TestCompletesAndKeepsTheCellsAsACacheEntry(t *testing.T) {
	r := newRig(t, sim.Config{}, Config{}, true)
	p := prompt(r.eng, "hello there, how are you?")
	out, res := run(t, r, context.Background(), &Request{ID: "a", Prompt: p, MaxTokens: 7})
	if res.State != Completed || res.Finish != FinishLength || res.Err != nil {
		t.Fatalf("result %+v", res)
	}
	if len(out) != 7 || res.CompletionTokens != 7 || res.PromptTokens != len(p) || res.CachedTokens != 0 || res.TTFT <= 0 {
		t.Fatalf("out %d tokens, result %+v", len(out), res)
	}
	r.inspect(t, func(v View) {
		e, ok := v.KV.Get("a")
		if !ok || e.InUse || v.Pool.Owner(e.Seq) != "a" {
			t.Fatalf("entry %+v ok %v owner %q", e, ok, v.Pool.Owner(e.Seq))
		}
		// The last sampled token was never decoded, so it has no cell.
		want := append(slices.Clone(p), out[:6]...)
		if !slices.Equal(e.Tokens, want) || r.eng.SeqLen(e.Seq) != len(want) {
			t.Fatalf("entry holds %d tokens (engine %d), want %d", len(e.Tokens), r.eng.SeqLen(e.Seq), len(want))
		}
		if len(v.States) != 0 {
			t.Fatalf("running set not empty: %v", v.States)
		}
	})
}

func TestNextTurnReusesThePrefixAndOutputIsIdentical(t *testing.T) {
	r := newRig(t, sim.Config{}, Config{}, true)
	turn1 := prompt(r.eng, "<|im_start|>user\nwrite a poem<|im_end|>\n<|im_start|>assistant\n")
	out1, _ := run(t, r, context.Background(), &Request{ID: "t1", Prompt: turn1, MaxTokens: 20})

	turn2 := append(append(slices.Clone(turn1), out1...), prompt(r.eng, "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n")[1:]...)
	out2, res := run(t, r, context.Background(), &Request{ID: "t2", Prompt: turn2, MaxTokens: 20})
	if want := len(turn1) + 19; res.CachedTokens != want {
		t.Fatalf("cached %d, want %d (turn 1's cells)", res.CachedTokens, want)
	}
	r.inspect(t, func(v View) {
		if v.KV.Len() != 1 {
			t.Fatalf("%d entries: turn 2 should have taken turn 1's entry over", v.KV.Len())
		}
		if _, ok := v.KV.Get("t2"); !ok || v.Pool.InUse() != 1 {
			t.Fatal("turn 2's entry missing or ids leaked")
		}
	})

	// The same prompt on a fresh worker, without any cache.
	cold := newRig(t, sim.Config{}, Config{}, true)
	outCold, resCold := run(t, cold, context.Background(), &Request{ID: "c", Prompt: turn2, MaxTokens: 20})
	if resCold.CachedTokens != 0 || !slices.Equal(out2, outCold) {
		t.Fatalf("greedy output differs with cache reuse:\nwarm %v\ncold %v", out2, outCold)
	}
}

func TestSharedPrefixIsCopiedAndTheEntryStays(t *testing.T) {
	r := newRig(t, sim.Config{NSeqMax: 4}, Config{}, true)
	sys := prompt(r.eng, "<|im_start|>system\nyou are a helpful assistant with a long system prompt<|im_end|>\n")
	a := append(slices.Clone(sys), prompt(r.eng, "question A")[1:]...)
	b := append(slices.Clone(sys), prompt(r.eng, "question B")[1:]...)
	run(t, r, context.Background(), &Request{ID: "a", Prompt: a, MaxTokens: 3})
	_, res := run(t, r, context.Background(), &Request{ID: "b", Prompt: b, MaxTokens: 3})
	if res.CachedTokens != len(sys)+len("question ") {
		t.Fatalf("cached %d, want the common prefix %d", res.CachedTokens, len(sys)+len("question "))
	}
	r.inspect(t, func(v View) {
		if v.KV.Len() != 2 || v.Pool.InUse() != 2 {
			t.Fatalf("entries %d ids %d: a's entry should stay", v.KV.Len(), v.Pool.InUse())
		}
		// b's cells share a's prefix: fewer cells than the two lengths.
		ea, _ := v.KV.Get("a")
		eb, _ := v.KV.Get("b")
		if used := r.eng.UsedCells(); used != len(ea.Tokens)+len(eb.Tokens)-res.CachedTokens {
			t.Fatalf("used cells %d: prefix not shared", used)
		}
	})
}

func TestScarceSeqIDsEvictCopiesBeforeTheLastHolderOfAPrefix(t *testing.T) {
	// Four seq ids. Document A has one cached question (the oldest entry),
	// document B two. When a stranger needs a seq id, plain LRU would drop A's
	// only holder; one of B's copies goes instead and A stays reusable.
	r := newRig(t, sim.Config{NSeqMax: 4}, Config{}, true)
	doc := func(name string) []int {
		return prompt(r.eng, "<|im_start|>system\n"+strings.Repeat("a long shared document "+name+". ", 20)+"<|im_end|>\n")
	}
	docA, docB := doc("A"), doc("B")
	ask := func(id string, d []int, q string) *Result {
		p := append(slices.Clone(d), prompt(r.eng, q)[1:]...)
		_, res := run(t, r, context.Background(), &Request{ID: id, Prompt: p, MaxTokens: 2})
		return res
	}
	ask("a1", docA, "first question")
	ask("b1", docB, "first question")
	ask("b2", docB, "second question")
	ask("lone1", prompt(r.eng, "an unrelated conversation"), "hello")
	ask("lone2", prompt(r.eng, "another unrelated one"), "hello") // needs an id: evicts
	r.inspect(t, func(v View) {
		_, hasA1 := v.KV.Get("a1")
		_, hasB1 := v.KV.Get("b1")
		if !hasA1 || hasB1 {
			t.Errorf("after the eviction a1 present %v (want true), b1 present %v (want false)", hasA1, hasB1)
		}
	})
	if res := ask("a2", docA, "second question"); res.CachedTokens < len(docA) {
		t.Fatalf("document A reused %d tokens, want its %d", res.CachedTokens, len(docA))
	}
}

func TestQueueFullIs429(t *testing.T) {
	r := newRig(t, sim.Config{}, Config{MaxQueue: 2, MaxRunning: 1}, false)
	p := prompt(r.eng, "x")
	var hs []*Handle
	for i := range 2 {
		h, err := r.s.Submit(context.Background(), &Request{ID: fmt.Sprint(i), Prompt: p, MaxTokens: 1})
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	if _, err := r.s.Submit(context.Background(), &Request{ID: "over", Prompt: p, MaxTokens: 1}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("third submit into a queue of 2: %v", err)
	}
	r.start()
	for _, h := range hs {
		if res, _ := h.Wait(context.Background()); res.State != Completed {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
	if _, res := run(t, r, context.Background(), &Request{ID: "later", Prompt: p, MaxTokens: 1}); res.State != Completed {
		t.Fatalf("after draining: %+v", res)
	}
}

func TestBadRequestsAreRefusedAtSubmit(t *testing.T) {
	r := newRig(t, sim.Config{NCtx: 64}, Config{}, false)
	long := make([]int, 65)
	for i := range long {
		long[i] = 3 + 'a'
	}
	cases := map[string]struct {
		req  *Request
		want error
	}{
		"too long":       {&Request{ID: "l", Prompt: long}, ErrTooLong},
		"empty":          {&Request{ID: "e"}, ErrBadInput},
		"no id":          {&Request{Prompt: long[:3]}, ErrBadInput},
		"negative":       {&Request{ID: "n", Prompt: long[:3], MaxTokens: -1}, ErrBadInput},
		"bad token":      {&Request{ID: "b", Prompt: []int{1, 99999}}, ErrBadInput},
		"bad stop token": {&Request{ID: "s", Prompt: long[:3], StopTokenIDs: []int{99999}}, ErrBadInput},
		// 60 prompt tokens + 10 in a 64-token context: refused, not cut short.
		"context cannot hold max_tokens": {&Request{ID: "c", Prompt: long[:60], MaxTokens: 10}, ErrMaxTokens},
		"more than --max-output-tokens":  {&Request{ID: "m", Prompt: long[:3], MaxTokens: 2049}, ErrMaxTokens},
	}
	for name, c := range cases {
		if _, err := r.s.Submit(context.Background(), c.req); !errors.Is(err, c.want) {
			t.Errorf("%s: err %v, want %v", name, err, c.want)
		}
	}
}

// slow makes every step take real time so that requests stay running.
func slow() sim.Config {
	return sim.Config{Cost: sim.Cost{StepOverhead: 2 * time.Millisecond}}
}

func TestTimeoutKeepsTheCells(t *testing.T) {
	var logs syncBuffer
	r := newRig(t, slow(), Config{RequestTimeout: 100 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))}, true)
	p := prompt(r.eng, "go on forever")
	out, res := run(t, r, context.Background(), &Request{ID: "slow", Prompt: p})
	if res.State != Timeout || !errors.Is(res.Err, ErrTimeout) || len(out) == 0 {
		t.Fatalf("result %+v after %d tokens", res, len(out))
	}
	// The operator learns where the time went.
	if l := logs.String(); !strings.Contains(l, "request timed out in the running set") || !strings.Contains(l, "request=slow") ||
		!strings.Contains(l, fmt.Sprintf("generated=%d", len(out))) {
		t.Fatalf("log: %s", l)
	}
	// Its seq id passed to an idle entry holding prompt and output.
	r.expectKept(t, "slow", len(p)+len(out)-1)
}

// expectKept checks that request id left exactly one idle entry holding
// at least cells cells, and nothing else holds a seq id.
func (r *rig) expectKept(t *testing.T, id string, cells int) {
	t.Helper()
	var msg string
	r.inspect(t, func(v View) {
		e, ok := v.KV.Get(id)
		switch {
		case !ok || e.InUse:
			msg = fmt.Sprintf("%s left no idle entry (%v)", id, ok)
		case v.Pool.InUse() != 1 || v.KV.Len() != 1 || len(e.Tokens) < cells || r.eng.UsedCells() != len(e.Tokens):
			msg = fmt.Sprintf("ids %d entries %d, entry of %d tokens (want %d), cells %d", v.Pool.InUse(), v.KV.Len(), len(e.Tokens), cells, r.eng.UsedCells())
		}
	})
	if msg != "" {
		t.Fatal(msg)
	}
}

func TestVanishedClientKeepsTheCells(t *testing.T) {
	r := newRig(t, slow(), Config{}, true)
	ctx, cancel := context.WithCancel(context.Background())
	p := prompt(r.eng, "talk to me")
	h, err := r.s.Submit(ctx, &Request{ID: "gone", Prompt: p})
	if err != nil {
		t.Fatal(err)
	}
	for n := 0; n < 3; {
		<-h.Ready()
		toks, _ := h.Take()
		n += len(toks)
	}
	cancel()
	res, err := h.Wait(context.Background())
	if err != nil || res.State != Cancelled {
		t.Fatalf("result %+v err %v", res, err)
	}
	r.expectKept(t, "gone", len(p)+2)
	// A client that leaves while its request is still queued never runs.
	r2 := newRig(t, sim.Config{}, Config{}, false)
	ctx2, cancel2 := context.WithCancel(context.Background())
	h2, _ := r2.s.Submit(ctx2, &Request{ID: "q", Prompt: prompt(r2.eng, "x"), MaxTokens: 5})
	cancel2()
	r2.start()
	if res, _ := h2.Wait(context.Background()); res.State != Cancelled || res.CompletionTokens != 0 {
		t.Fatalf("queued cancel: %+v", res)
	}
}

func TestExhaustedSeqIDsWaitPending(t *testing.T) {
	r2 := newRig(t, sim.Config{NSeqMax: 2, Cost: slow().Cost}, Config{MaxRunning: 4}, true)
	var hs []*Handle
	for i := range 4 {
		h, err := r2.s.Submit(context.Background(), &Request{ID: fmt.Sprint("r", i), Prompt: prompt(r2.eng, fmt.Sprint("distinct prompt ", i)), MaxTokens: 30})
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	<-hs[0].Ready()
	seenPending := false
	wait.Until(10*time.Second, func() bool {
		r2.inspect(t, func(v View) {
			var pending, processing int
			for _, st := range v.States {
				switch st {
				case Pending:
					pending++
				case Processing:
					processing++
				}
			}
			if processing > 2 {
				t.Fatalf("%d PROCESSING with 2 seq ids", processing)
			}
			if pending == 2 && processing == 2 {
				seenPending = true
			}
		})
		return seenPending
	})
	if !seenPending {
		t.Fatal("never saw two requests PENDING behind two PROCESSING")
	}
	for _, h := range hs {
		if res, _ := h.Wait(context.Background()); res.State != Completed || res.CompletionTokens != 30 {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
}

func TestStopKeepsTheEntry(t *testing.T) {
	r := newRig(t, slow(), Config{}, true)
	h, _ := r.s.Submit(context.Background(), &Request{ID: "s", Prompt: prompt(r.eng, "abc")})
	<-h.Ready()
	h.Stop()
	res, _ := h.Wait(context.Background())
	if res.State != Completed || res.Finish != FinishStop {
		t.Fatalf("%+v", res)
	}
	r.inspect(t, func(v View) {
		if e, ok := v.KV.Get("s"); !ok || e.InUse {
			t.Fatal("a stopped request's entry is gone or still in use")
		}
	})
}

func TestEvictionUnderASmallLimitSparesRunningRequests(t *testing.T) {
	// 1 byte per token, 600 bytes: past 480 tokens idle entries go.
	r := newRig(t, sim.Config{NSeqMax: 8, BytesPerToken: 1, Cost: sim.Cost{StepOverhead: 200 * time.Microsecond}},
		Config{MaxRunning: 3, KV: kvcache.Limits{MaxBytes: 600, Threshold: 0.8}, CleanupInterval: 5 * time.Millisecond}, true)
	stopWatch := make(chan struct{})
	watchDone := make(chan struct{})
	// Each inspection waits for the loop between two steps, so the watcher
	// checks the books once a step without sleeping.
	go func() {
		defer close(watchDone)
		for {
			select {
			case <-stopWatch:
				return
			default:
			}
			r.inspect(t, func(v View) {
				for id, st := range v.States {
					if st != Processing {
						continue
					}
					if e, ok := v.KV.Get(id); !ok || !e.InUse || v.Pool.Owner(e.Seq) != id {
						t.Errorf("PROCESSING %s lost its entry or seq id", id)
					}
				}
			})
		}
	}()
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := prompt(r.eng, fmt.Sprintf("request number %d with its own words %s", i, string(rune('a'+i))))
			out, res := run(t, r, context.Background(), &Request{ID: fmt.Sprint("e", i), Prompt: p, MaxTokens: 150, Hashes: []prefix.Hash{prefix.Hash(i), 1000}})
			if res.State != Completed || len(out) != 150 {
				t.Errorf("e%d: %+v", i, res)
			}
		}()
	}
	wg.Wait()
	close(stopWatch)
	<-watchDone
	r.inspect(t, func(v View) {
		if v.KV.OverThreshold() {
			t.Fatalf("idle entries left over the threshold: %d items", v.KV.Items())
		}
		if v.KV.Len() != v.Pool.InUse() {
			t.Fatalf("%d entries but %d seq ids held", v.KV.Len(), v.Pool.InUse())
		}
	})
	r.mu.Lock()
	defer r.mu.Unlock()
	reported := map[prefix.Hash]bool{}
	for _, hs := range r.evicts {
		for _, h := range hs {
			if reported[h] {
				t.Fatalf("hash %d reported twice", h)
			}
			reported[h] = true
		}
	}
	if len(reported) == 0 || reported[1000] {
		// 1000 is shared by all; it may only go once no entry holds it,
		// and at least one entry remains.
		t.Fatalf("reports %v", r.evicts)
	}
}

func TestKVFullPreemptsAndRecomputesWithoutChangingOutput(t *testing.T) {
	// Two requests of 120 prompt + 100 output tokens in 300 cells: both
	// cannot hold their cells at once, so one is preempted and recomputed.
	mk := func(i int) []int {
		toks := []int{1}
		for j := range 119 {
			toks = append(toks, 3+'a'+(i*7+j)%26)
		}
		return toks
	}
	solo := map[int][]int{}
	for i := range 2 {
		r := newRig(t, sim.Config{NCtx: 300}, Config{}, true)
		solo[i], _ = run(t, r, context.Background(), &Request{ID: "solo", Prompt: mk(i), MaxTokens: 100})
	}
	r := newRig(t, sim.Config{NCtx: 300, NSeqMax: 4}, Config{}, true)
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, res := run(t, r, context.Background(), &Request{ID: fmt.Sprint("p", i), Prompt: mk(i), MaxTokens: 100})
			if res.State != Completed || !slices.Equal(out, solo[i]) {
				t.Errorf("p%d: %+v, output equal to solo run: %v", i, res, slices.Equal(out, solo[i]))
			}
		}()
	}
	wg.Wait()
}

func TestAPromptFillingTheContextGetsOneToken(t *testing.T) {
	r := newRig(t, sim.Config{NCtx: 100, NSeqMax: 2}, Config{}, true)
	p := make([]int, 100)
	for i := range p {
		p[i] = 3 + 'a'
	}
	// 100 prompt tokens fill the context: the first token comes from the
	// prompt's logits and then the context is exhausted. (Asking for
	// max_tokens the context cannot hold is refused; without max_tokens
	// the output cap yields to the context.)
	out, res := run(t, r, context.Background(), &Request{ID: "full", Prompt: p})
	if res.State != Completed || res.Finish != FinishLength || len(out) != 1 {
		t.Fatalf("%+v", res)
	}
}

func TestShutdownFailsWhatIsLeft(t *testing.T) {
	r := newRig(t, slow(), Config{MaxRunning: 1}, true)
	h1, _ := r.s.Submit(context.Background(), &Request{ID: "run", Prompt: prompt(r.eng, "a")})
	h2, _ := r.s.Submit(context.Background(), &Request{ID: "wait", Prompt: prompt(r.eng, "b")})
	<-h1.Ready()
	r.stop()
	for _, h := range []*Handle{h1, h2} {
		if res, _ := h.Wait(context.Background()); res.State != Failed || !errors.Is(res.Err, ErrShutdown) {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
	if _, err := r.s.Submit(context.Background(), &Request{ID: "late", Prompt: prompt(r.eng, "c")}); !errors.Is(err, ErrShutdown) {
		t.Fatalf("submit after shutdown: %v", err)
	}
}

func TestConcurrentChurnLeaksNothing(t *testing.T) {
	r := newRig(t, sim.Config{NSeqMax: 6, NCtx: 2048, Cost: sim.Cost{StepOverhead: 100 * time.Microsecond}},
		Config{MaxRunning: 4, MaxQueue: 64, RequestTimeout: 200 * time.Millisecond}, true)
	base := prompt(r.eng, "a shared system prompt that many requests start with. ")
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for i := range 15 {
				p := append(slices.Clone(base), prompt(r.eng, fmt.Sprint(g, "-", i%3))[1:]...)
				ctx, cancel := context.WithCancel(context.Background())
				h, err := r.s.Submit(ctx, &Request{ID: fmt.Sprint(g, "/", i), Prompt: p, MaxTokens: 1 + rng.IntN(40), Sampling: engine.SamplingParams{Temperature: 0.8}})
				if errors.Is(err, ErrQueueFull) {
					cancel()
					continue
				}
				if err != nil {
					t.Error(err)
					cancel()
					return
				}
				if rng.IntN(4) == 0 {
					// The client leaves at a random moment of its request.
					time.AfterFunc(time.Duration(rng.IntN(2000))*time.Microsecond, cancel)
				}
				res, _ := h.Wait(context.Background())
				cancel()
				if !res.State.Terminal() {
					t.Errorf("non-terminal result %v", res.State)
				}
			}
		}()
	}
	wg.Wait()
	r.inspect(t, func(v View) {
		if len(v.States) != 0 || v.KV.Len() != v.Pool.InUse() || v.KV.Idle() != v.KV.Len() {
			t.Fatalf("running %d entries %d idle %d ids %d", len(v.States), v.KV.Len(), v.KV.Idle(), v.Pool.InUse())
		}
		cells := 0
		for _, e := range v.KV.Entries() {
			if r.eng.SeqLen(e.Seq) != len(e.Tokens) {
				t.Fatalf("entry %s: books say %d tokens, engine holds %d", e.ID, len(e.Tokens), r.eng.SeqLen(e.Seq))
			}
			cells += len(e.Tokens)
		}
		if r.eng.UsedCells() > cells {
			t.Fatalf("engine holds %d cells, entries account for at most %d: leaked cells", r.eng.UsedCells(), cells)
		}
	})
}

func TestRunningEntriesShareTheirWrittenPrefix(t *testing.T) {
	r := newRig(t, slow(), Config{MaxRunning: 4}, true)
	sys := prompt(r.eng, strings.Repeat("a long shared system prompt. ", 10))
	h1, _ := r.s.Submit(context.Background(), &Request{ID: "first", Prompt: sys, MaxTokens: 200})
	<-h1.Ready() // first has prefilled the system prompt and is decoding
	p2 := append(slices.Clone(sys), prompt(r.eng, "user question")[1:]...)
	_, res := run(t, r, context.Background(), &Request{ID: "second", Prompt: p2, MaxTokens: 3})
	if res.CachedTokens != len(sys) {
		t.Fatalf("cached %d, want the running request's %d prompt cells", res.CachedTokens, len(sys))
	}
	h1.Stop()
	if res, _ := h1.Wait(context.Background()); res.State != Completed {
		t.Fatalf("first: %+v", res)
	}
}

func TestDuplicateIDFails(t *testing.T) {
	r := newRig(t, slow(), Config{}, true)
	h1, _ := r.s.Submit(context.Background(), &Request{ID: "same", Prompt: prompt(r.eng, "a"), MaxTokens: 50})
	<-h1.Ready()
	_, res := run(t, r, context.Background(), &Request{ID: "same", Prompt: prompt(r.eng, "b"), MaxTokens: 1})
	if res.State != Failed || !errors.Is(res.Err, ErrBadInput) {
		t.Fatalf("duplicate id: %+v", res)
	}
	if res, _ := h1.Wait(context.Background()); res.State != Completed || res.CompletionTokens != 50 {
		t.Fatalf("the original was disturbed: %+v", res)
	}
}

func TestMaxOutputTokensCapsARequestWithoutMaxTokens(t *testing.T) {
	r := newRig(t, sim.Config{}, Config{MaxOutputTokens: 7}, true)
	out, res := run(t, r, context.Background(), &Request{ID: "a", Prompt: prompt(r.eng, "tell me a long story"), IgnoreEOS: true})
	if res.State != Completed || res.Finish != FinishLength || len(out) != 7 {
		t.Fatalf("%+v after %d tokens; want finish length at the 7-token cap", res, len(out))
	}
	if _, err := r.s.Submit(context.Background(), &Request{ID: "b", Prompt: prompt(r.eng, "x"), MaxTokens: 8}); !errors.Is(err, ErrMaxTokens) {
		t.Fatalf("max_tokens 8 over a cap of 7: %v", err)
	}
}

func TestStopTokenIDsEndGeneration(t *testing.T) {
	r := newRig(t, sim.Config{}, Config{}, true)
	p := prompt(r.eng, "count for me")
	free, _ := run(t, r, context.Background(), &Request{ID: "free", Prompt: p, MaxTokens: 12, IgnoreEOS: true})
	stopAt := 5
	stop := free[stopAt]
	first := slices.Index(free, stop)
	out, res := run(t, r, context.Background(), &Request{ID: "stopped", Prompt: p, MaxTokens: 12, IgnoreEOS: true, StopTokenIDs: []int{stop}})
	if res.State != Completed || res.Finish != FinishStop || !slices.Equal(out, free[:first]) {
		t.Fatalf("stop token %d: %+v, %v; want the %d tokens before it (of %v)", stop, res, out, first, free)
	}
	// min_tokens holds it back like end-of-generation.
	out, _ = run(t, r, context.Background(), &Request{ID: "min", Prompt: p, MaxTokens: 12, IgnoreEOS: true, MinTokens: 12, StopTokenIDs: []int{stop}})
	if !slices.Equal(out, free) {
		t.Fatalf("with min_tokens 12: %v, want %v", out, free)
	}
}

func TestBatchSizeMustFitTheRunningSet(t *testing.T) {
	eng, err := sim.New(sim.Config{NSeqMax: 4})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(eng, Config{MaxRunning: 2, MaxBatch: 3}); err == nil {
		t.Fatal("a batch of 3 sequences over a running set of 2 was accepted")
	}
}

func TestQueueWaitTimesOutAndLeaksNothing(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := newRig(t, slow(), Config{MaxRunning: 1, MaxQueue: 2, QueueTimeout: 150 * time.Millisecond, MaxOutputTokens: 4000,
		Metrics: NewMetrics(reg)}, true)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	long, err := r.s.Submit(ctx, &Request{ID: "long", Prompt: prompt(r.eng, "keep going"), MaxTokens: 4000, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the long request to run", func() bool { return r.s.Stats().Running == 1 })
	var queued []*Handle
	for i := range 2 {
		h, err := r.s.Submit(context.Background(), &Request{ID: fmt.Sprint("q", i), Prompt: prompt(r.eng, "wait"), MaxTokens: 1})
		if err != nil {
			t.Fatal(err)
		}
		queued = append(queued, h)
	}
	for _, h := range queued {
		res, err := h.Wait(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if res.State != Timeout || !errors.Is(res.Err, ErrQueueTimeout) || !errors.Is(res.Err, ErrTimeout) ||
			res.CompletionTokens != 0 || res.QueueWait < 150*time.Millisecond {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
	// The slots are free again: two more fit in the queue of two.
	if st := r.s.Stats(); st.Queued != 0 || st.Running != 1 {
		t.Fatalf("after the queue timeouts: %+v", st)
	}
	for i := range 2 {
		h, err := r.s.Submit(context.Background(), &Request{ID: fmt.Sprint("again", i), Prompt: prompt(r.eng, "wait"), MaxTokens: 1})
		if err != nil {
			t.Fatalf("the timed-out requests still hold their queue slots: %v", err)
		}
		if res, _ := h.Wait(context.Background()); res.State != Timeout {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
	r.inspect(t, func(v View) {
		// Only the long request holds an id; the timed-out ones never took one.
		if v.Pool.InUse() != 1 || len(v.States) != 1 || v.States["long"] != Processing {
			t.Fatalf("ids %d states %v", v.Pool.InUse(), v.States)
		}
		if err := v.Owner.Check(); err != nil {
			t.Fatal(err)
		}
	})
	if got := metricValue(r.s.m.queueDepth); got != 0 {
		t.Fatalf("queue depth gauge %v after every queued request timed out", got)
	}
	if got := metricValue(r.s.m.requests.WithLabelValues("TIMEOUT")); got != 4 {
		t.Fatalf("TIMEOUT count %v, want 4", got)
	}
	cancel()
	if res, _ := long.Wait(context.Background()); res.State != Cancelled {
		t.Fatalf("long: %+v", res)
	}
	// Only the long request's cells stay, as an idle entry.
	r.expectKept(t, "long", 1)
}

func TestQueueWaitUnboundedWhenNegative(t *testing.T) {
	r := newRig(t, slow(), Config{MaxRunning: 1, QueueTimeout: -1}, true)
	first, err := r.s.Submit(context.Background(), &Request{ID: "first", Prompt: prompt(r.eng, "a"), MaxTokens: 60, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	_, res := run(t, r, context.Background(), &Request{ID: "second", Prompt: prompt(r.eng, "b"), MaxTokens: 1})
	if res.State != Completed || res.QueueWait < 50*time.Millisecond {
		t.Fatalf("second: %+v", res)
	}
	if res, _ := first.Wait(context.Background()); res.State != Completed {
		t.Fatalf("first: %+v", res)
	}
}

// metricValue reads a gauge or counter.
func metricValue(c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	if m.Gauge != nil {
		return m.Gauge.GetValue()
	}
	return m.Counter.GetValue()
}

// A request that leaves without ever having run (its client gone while it
// was queued) reports the hashes it carried that no entry holds and no
// other waiting request carries: the router saved them on this pod when it
// routed the request here, and a gateway that died with the request in
// flight never withdraws that save (the chaos run's one wrong entry left
// by its gateway kill).
func TestARequestThatNeverRanReportsItsUnheldHashes(t *testing.T) {
	r := newRig(t, slow(), Config{MaxRunning: 1, MaxQueue: 4, MaxOutputTokens: 4000}, true)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	long, err := r.s.Submit(ctx, &Request{ID: "long", Prompt: prompt(r.eng, "keep going"), MaxTokens: 4000, IgnoreEOS: true,
		Hashes: []prefix.Hash{1, 2}})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the long request to run", func() bool { return r.s.Stats().Running == 1 })
	r.inspect(t, func(View) {}) // "long" is bound: its entry holds 1 and 2
	gctx, leave := context.WithCancel(context.Background())
	gone, err := r.s.Submit(gctx, &Request{ID: "gone", Prompt: prompt(r.eng, "wait"), MaxTokens: 1, Hashes: []prefix.Hash{1, 3, 4}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.s.Submit(context.Background(), &Request{ID: "stays", Prompt: prompt(r.eng, "wait too"), MaxTokens: 1,
		Hashes: []prefix.Hash{3, 5}}); err != nil {
		t.Fatal(err)
	}
	leave()
	if res, _ := gone.Wait(context.Background()); res.State != Cancelled {
		t.Fatalf("gone: %+v", res)
	}
	var got []prefix.Hash
	wait.Until(5*time.Second, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		got = slices.Concat(r.evicts...)
		return len(got) > 0
	})
	// 1 is held by the running request's entry, 3 carried by the one still
	// queued: only 4 is nobody's.
	if !slices.Equal(got, []prefix.Hash{4}) {
		t.Fatalf("reported %v, want [4]", got)
	}
	cancel()
	if res, _ := long.Wait(context.Background()); res.State != Cancelled {
		t.Fatalf("long: %+v", res)
	}
}

// A queue that cannot start its requests within the queue timeout at the
// rate it empties refuses the ones it would time out (429 at once, their
// clients free to go elsewhere) instead of holding them until 408.
func TestQueueRefusesWhatItWouldTimeOut(t *testing.T) {
	// One running request at a time, each ≈ 40 steps of ≥ 2 ms: 40 queued
	// requests need ≥ 3 s, twice the queue timeout.
	r := newRig(t, slow(), Config{MaxRunning: 1, MaxQueue: 64, QueueTimeout: 1500 * time.Millisecond}, true)
	p := prompt(r.eng, "x")
	var hs []*Handle
	refusedAtSubmit := 0
	arrivals := time.NewTicker(5 * time.Millisecond)
	defer arrivals.Stop()
	for i := range 40 {
		h, err := r.s.Submit(context.Background(), &Request{ID: fmt.Sprint(i), Prompt: p, MaxTokens: 40, MinTokens: 40})
		switch {
		case errors.Is(err, ErrQueueFull):
			refusedAtSubmit++
		case err != nil:
			t.Fatal(err)
		default:
			hs = append(hs, h)
		}
		<-arrivals.C // arrivals, not one burst
	}
	completed, shed, timedOut := 0, refusedAtSubmit, 0
	for _, h := range hs {
		res, _ := h.Wait(context.Background())
		switch {
		case res.State == Completed:
			completed++
		case res.State == Failed && errors.Is(res.Err, ErrQueueFull):
			shed++
		case errors.Is(res.Err, ErrQueueTimeout):
			timedOut++
		default:
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
	t.Logf("completed %d, refused %d (%d at submit), timed out in the queue %d", completed, shed, refusedAtSubmit, timedOut)
	// Without the estimate about half would time out and none be refused;
	// an estimate can be wrong by a request or two when steps slow down.
	if shed < 10 || timedOut > 2 || completed < 10 {
		t.Fatalf("completed %d, refused %d, timed out %d: want most of what cannot start in time refused, not timed out", completed, shed, timedOut)
	}
	if _, res := run(t, r, context.Background(), &Request{ID: "later", Prompt: p, MaxTokens: 1}); res.State != Completed {
		t.Fatalf("after draining: %+v", res)
	}
}

func TestDrainRateMeasuresOnlyWhileRequestsWait(t *testing.T) {
	var d drainRate
	t0 := time.Unix(0, 0)
	d.admitted(t0) // an idle pod admits at once: no interval
	d.backlog(t0, false)
	if _, ok := d.every(); ok {
		t.Fatal("measured with nothing waiting")
	}
	d.backlog(t0.Add(10*time.Second), true) // a request waits from 10 s
	d.admitted(t0.Add(10*time.Second + 200*time.Millisecond))
	d.backlog(t0.Add(10*time.Second+200*time.Millisecond), true)
	if every, ok := d.every(); !ok || every != 200*time.Millisecond {
		t.Fatalf("every = %v, %v; want 200ms (not the 10 s idle before)", every, ok)
	}
	d.admitted(t0.Add(10*time.Second + 200*time.Millisecond)) // two at once
	d.backlog(t0.Add(10*time.Second+200*time.Millisecond), false)
	if _, ok := d.every(); ok {
		t.Fatal("still measured once nothing waits")
	}
}

// syncBuffer is a log sink the loop goroutine writes while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
