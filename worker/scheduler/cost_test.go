package scheduler

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
)

// The fit recovers a step cost of the engine's form from steps that mix
// prefill chunks at various positions with decode steps, each timed 10%
// off at random (a busy machine's jitter).
func TestStepCostRecoversThePlane(t *testing.T) {
	truth := sim.BenchCost()
	rng := rand.New(rand.NewPCG(1, 2))
	var f stepCost
	for i := range 600 {
		var spans []engine.Span
		for s := range 1 + rng.IntN(4) { // decoding sequences
			spans = append(spans, engine.Span{Seq: s, Pos: 50 + rng.IntN(2000), Tokens: []int{0}, Sampler: aSampler})
		}
		if i%3 == 0 { // a prefill chunk, sampled when it ends its prompt
			sp := engine.Span{Seq: 9, Pos: rng.IntN(3000), Tokens: make([]int, 16+rng.IntN(496))}
			if rng.IntN(2) == 0 {
				sp.Sampler = aSampler
			}
			spans = append(spans, sp)
		}
		x := features(spans)
		d := truth.Step(int(x[costToken]), int(x[costSample]), int64(x[costKPair]*1000))
		f.observe(spans, time.Duration(float64(d)*(0.9+0.2*rng.Float64())))
	}
	got := f.cost()
	for _, c := range []struct {
		name      string
		got, want float64
	}{
		{"per token", got.PerToken, truth.PerToken.Seconds()},
		{"per pair", got.PerPair, truth.PerKCtxToken.Seconds() / 1000},
	} {
		if math.Abs(c.got/c.want-1) > 0.2 {
			t.Errorf("%s = %.3g, want %.3g within 20%%", c.name, c.got, c.want)
		}
	}
	// The step's base and a sample's cost hide in the prefill steps'
	// jitter; together they still price a decode step.
	for n := 1; n <= 4; n++ {
		x := [costTerms]float64{costBase: 1, costToken: float64(n), costKPair: float64(n), costSample: float64(n)}
		fitted := got.Base + got.PerToken*x[costToken] + got.PerPair*x[costKPair]*1000 + got.PerSample*x[costSample]
		if want := truth.Step(n, n, int64(x[costKPair]*1000)).Seconds(); math.Abs(fitted/want-1) > 0.2 {
			t.Errorf("a decode step of %d sequences at 1,000 cells: %.3gs, want %.3gs within 20%%", n, fitted, want)
		}
	}
	// A 1,000-token prompt after 2,000 cached cells: its tokens and their
	// attention, as the engine charges them.
	want := 1000*truth.PerToken.Seconds() + truth.PerKCtxToken.Seconds()/1000*pairs(1000, 2000)
	if p := got.Prefill(1000, 2000); math.Abs(p/want-1) > 0.1 {
		t.Errorf("Prefill(1000, 2000) = %.3gs, want %.3gs within 10%%", p, want)
	}
}

// Decode steps alone cannot tell a token's cost from a sample's (they move
// together): the fit keeps no negative coefficient and still prices those
// steps right, and says nothing before it has seen enough steps.
func TestStepCostOfDecodeStepsOnly(t *testing.T) {
	var f stepCost
	step := func(n int) []engine.Span {
		var spans []engine.Span
		for s := range n {
			spans = append(spans, engine.Span{Seq: s, Pos: 100 * (s + 1), Tokens: []int{0}, Sampler: aSampler})
		}
		return spans
	}
	for i := range minCostSteps - 1 {
		f.observe(step(1+i%4), time.Duration(2+1*(1+i%4))*time.Millisecond)
	}
	if c := f.cost(); c.Known() {
		t.Fatalf("after %d steps: %+v, want nothing yet", minCostSteps-1, c)
	}
	for i := range 200 {
		f.observe(step(1+i%4), time.Duration(2+1*(1+i%4))*time.Millisecond)
	}
	c := f.cost()
	if c.Base < 0 || c.PerToken < 0 || c.PerPair < 0 || c.PerSample < 0 {
		t.Fatalf("negative coefficient: %+v", c)
	}
	for n := 1; n <= 4; n++ {
		x := features(step(n))
		got := c.Base + c.PerToken*x[costToken] + c.PerPair*x[costKPair]*1000 + c.PerSample*x[costSample]
		if want := float64(2+n) / 1000; math.Abs(got/want-1) > 0.05 {
			t.Errorf("a step of %d: %.4gs, want %.4gs", n, got, want)
		}
	}
}

// A worker on the simulated engine learns its cost from the steps it runs
// and reports a queued prompt's prefill in seconds at that cost: a pod
// tells the router what its queue will take, long prompts' attention
// included.
func TestStatsReportTheStepsCost(t *testing.T) {
	truth := sim.Cost{StepOverhead: 2 * time.Millisecond, PerToken: 40 * time.Microsecond, PerSample: 300 * time.Microsecond,
		PerKCtxToken: 100 * time.Microsecond}
	r := newRig(t, sim.Config{NCtx: 8192, Cost: truth}, Config{MaxRunning: 2}, true)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 24 {
		text := strings.Repeat(string(rune('a'+i%26))+" words of a prompt. ", 5+rng.IntN(60))
		if _, res := run(t, r, context.Background(), &Request{ID: "warm" + string(rune('a'+i)), Prompt: prompt(r.eng, text), MaxTokens: 4}); res.State != Completed {
			t.Fatalf("request %d: %+v", i, res)
		}
	}
	// One snapshot, once the loop has published the running set empty
	// (the last answer reaches its caller before the loop drops its
	// request): the fit may take one more step's time after it.
	var st Stats
	waitFor(t, "the pod idle", func() bool { st = r.s.Stats(); return st.Running == 0 })
	c := st.Cost
	if !c.Known() || math.Abs(c.PerToken/truth.PerToken.Seconds()-1) > 0.3 || math.Abs(c.PerPair/(truth.PerKCtxToken.Seconds()/1000)-1) > 0.3 {
		t.Fatalf("learnt %+v, want per token %v and per pair %.3g within 30%%", c, truth.PerToken, truth.PerKCtxToken.Seconds()/1000)
	}
	// A decode step of a pod running nothing: a lone first token.
	if math.Abs(st.StepSeconds-(c.Base+c.PerSample)) > 1e-9 {
		t.Fatalf("step of an idle pod %.4gs, want %.4gs", st.StepSeconds, c.Base+c.PerSample)
	}
	// Three long prompts on a pod that runs two: the third waits in the
	// queue, listed at what its tokens and their attention cost, the
	// list shortest first.
	var third []int
	for i, ch := range []string{"x", "y", "z"} {
		third = prompt(r.eng, strings.Repeat(ch+" is a long prompt. ", 60))
		if _, err := r.s.Submit(context.Background(), &Request{ID: "long" + ch, Prompt: third, MaxTokens: 2}); err != nil {
			t.Fatalf("long prompt %d: %v", i, err)
		}
	}
	waitFor(t, "the third long prompt queued", func() bool {
		st := r.s.Stats()
		if st.Queued != 1 {
			return false
		}
		// It shares the start token with the prompts ahead, a few at most.
		i := slices.IndexFunc(st.Prefills, func(p Prefill) bool { return p.Tokens <= len(third) && p.Tokens >= len(third)-2 })
		return i >= 0 && math.Abs(st.Prefills[i].Seconds/st.Cost.Prefill(st.Prefills[i].Tokens, len(third)-st.Prefills[i].Tokens)-1) < 1e-9 &&
			slices.IsSortedFunc(st.Prefills, func(a, b Prefill) int { return a.Tokens - b.Tokens })
	})
}

// aSampler marks a span as sampled (the fit only asks whether it is).
var aSampler engine.Sampler = struct{}{}

// While a long prompt's chunk is in its step, the pod reports what is left
// of that step and the prompt's prefill as it will stand once it ends: a
// request arriving then waits for the one, then the other.
func TestStatsReportTheStepInProgress(t *testing.T) {
	r := newRig(t, sim.Config{NCtx: 8192, NBatch: 512, Cost: sim.Cost{StepOverhead: time.Millisecond, PerToken: 300 * time.Microsecond}},
		Config{MaxRunning: 2}, true)
	learnCost(t, r)
	toks := prompt(r.eng, strings.Repeat("a long prompt of many words. ", 60))
	if _, err := r.s.Submit(context.Background(), &Request{ID: "long", Prompt: toks, MaxTokens: 2}); err != nil {
		t.Fatal(err)
	}
	var st Stats
	waitFor(t, "a chunk of the prompt in its step", func() bool {
		st = r.s.Stats()
		return st.StepLeft > 0 && len(st.Prefills) == 1 && st.Prefills[0].Tokens <= len(toks)-512 // a chunk counted done while in its step
	})
	// One snapshot's cost throughout: the fit moves with every step.
	left, c := st.Prefills[0].Tokens, st.Cost
	// At most a whole step of n_batch tokens as deep as the prompt goes.
	step := c.Step([]engine.Span{{Pos: len(toks) - 512, Tokens: make([]int, 512)}})
	if st.StepLeft > step+1e-9 || st.PrefillTokens != left {
		t.Fatalf("step left %.4gs (a step is at most %.4gs), prefill tokens %d, want %d", st.StepLeft, step, st.PrefillTokens, left)
	}
	if want := c.Prefill(left, len(toks)-left); math.Abs(st.Prefills[0].Seconds-want) > 1e-9 {
		t.Fatalf("what is left costs %.4gs, want %.4gs after the step", st.Prefills[0].Seconds, want)
	}
}

// A prompt submitted while a step runs is listed at the tokens it will
// compute at once, not at its whole length until the next step: a cache
// hit queued then is, in the router's reading (fewest tokens first), ahead
// of a longer request, as it is in the worker's order.
func TestStatsListAPromptSubmittedMidStepAtItsUncachedTokens(t *testing.T) {
	r := newRig(t, sim.Config{NCtx: 8192, NBatch: 512, Cost: sim.Cost{StepOverhead: time.Millisecond, PerToken: 300 * time.Microsecond}},
		Config{MaxRunning: 2}, true)
	learnCost(t, r)
	doc := prompt(r.eng, strings.Repeat("a document everyone asks about. ", 40))
	h, err := r.s.Submit(context.Background(), &Request{ID: "doc", Prompt: doc, MaxTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := h.Wait(context.Background()); err != nil || res.State != Completed {
		t.Fatalf("the document: %+v %v", res, err)
	}
	cold := prompt(r.eng, strings.Repeat("another prompt nobody has sent. ", 60))
	if _, err := r.s.Submit(context.Background(), &Request{ID: "cold", Prompt: cold, MaxTokens: 2}); err != nil {
		t.Fatal(err)
	}
	// 512 tokens a step at 0.3 ms each: over 0.1 s left leaves time to
	// submit and read before the next step.
	waitFor(t, "a chunk of the cold prompt in its step", func() bool { return r.s.Stats().StepLeft > 0.1 })
	hit := append(slices.Clone(doc), prompt(r.eng, " and a question")...)
	if _, err := r.s.Submit(context.Background(), &Request{ID: "hit", Prompt: hit, MaxTokens: 2}); err != nil {
		t.Fatal(err)
	}
	st := r.s.Stats()
	if st.StepLeft == 0 {
		t.Skip("the step ended before the read; nothing to check")
	}
	want := len(hit) - len(doc)
	if !slices.ContainsFunc(st.Prefills, func(p Prefill) bool { return p.Tokens <= want+1 }) ||
		slices.ContainsFunc(st.Prefills, func(p Prefill) bool { return p.Tokens == len(hit) }) {
		t.Fatalf("queue %+v: want the hit at its %d uncached tokens, not its %d", st.Prefills, want, len(hit))
	}
}

// A prompt of a whole n_batch or more that finish first holds back while
// the only other request's answer ends is reported with the step it will
// take alone once released and how long until then; once the answer has
// ended, that step is the step in progress and the hold is gone.
func TestStatsReportAPromptHeldByFinishFirst(t *testing.T) {
	r := newRig(t, sim.Config{NCtx: 8192, NBatch: 512, Cost: sim.Cost{StepOverhead: 10 * time.Millisecond, PerToken: 300 * time.Microsecond}},
		Config{MaxRunning: 2}, true)
	learnCost(t, r)
	answer, err := r.s.Submit(context.Background(), &Request{ID: "answer", Prompt: prompt(r.eng, "a short question"), MaxTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	toks := prompt(r.eng, strings.Repeat("a long prompt of many words. ", 60))
	if _, err := r.s.Submit(context.Background(), &Request{ID: "long", Prompt: toks, MaxTokens: 2}); err != nil {
		t.Fatal(err)
	}
	var st Stats
	waitFor(t, "the long prompt held while the answer ends", func() bool { st = r.s.Stats(); return st.Held.Tokens > 0 })
	c, left := st.Cost, st.Held.Tokens
	if left < 512 || !slices.ContainsFunc(st.Prefills, func(p Prefill) bool { return p.Tokens == left }) {
		t.Fatalf("held %d tokens, want a whole n_batch or more, listed in the queue %+v", left, st.Prefills)
	}
	if want := c.Step([]engine.Span{{Pos: len(toks) - left, Tokens: make([]int, 512)}}); math.Abs(st.Held.Step-want) > 1e-9 {
		t.Fatalf("the released step %.4gs, want %.4gs (512 tokens alone)", st.Held.Step, want)
	}
	// The answer has at most 15 tokens to go, a decode step each.
	if st.Held.Left <= 0 || st.Held.Left > 16*st.StepSeconds {
		t.Fatalf("released in %.4gs, want within 16 decode steps of %.4gs", st.Held.Left, st.StepSeconds)
	}
	if res, err := answer.Wait(context.Background()); err != nil || res.State != Completed {
		t.Fatalf("the answer: %+v %v", res, err)
	}
	waitFor(t, "the released prompt stepping alone", func() bool {
		st = r.s.Stats()
		return st.Held == Held{} && st.StepLeft > 0 && len(st.Prefills) == 1 && st.Prefills[0].Tokens <= left-512
	})
}

// learnCost runs prompts of a few sizes until the fit knows the pod's cost.
func learnCost(t *testing.T, r *rig) {
	t.Helper()
	for i := 0; !r.s.Stats().Cost.Known(); i++ {
		if i == 64 {
			t.Fatalf("no cost after %d requests: %+v", i, r.s.Stats().Cost)
		}
		text := strings.Repeat(string(rune('a'+i%26))+" words of a prompt. ", 1+i%7*8)
		if _, res := run(t, r, context.Background(), &Request{ID: fmt.Sprint("warm", i), Prompt: prompt(r.eng, text), MaxTokens: 2}); res.State != Completed {
			t.Fatalf("request %d: %+v", i, res)
		}
	}
}
