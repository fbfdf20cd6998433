package kvcache

import (
	"slices"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/llama"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// The park bound's tests drive real llama.cpp on the generated model: the
// parked bytes are llama.cpp's own state sizes.

type parkRig struct {
	t   *testing.T
	eng *llama.Engine
	o   *Owner
	rep *recorder
	why []string
}

func openParkEngine(t *testing.T, limit int64) *llama.Engine {
	t.Helper()
	eng, err := llama.Open(llama.Config{ModelPath: testmodel.Path(t), NCtx: 2048, NSeqMax: 6, Threads: 1, ParkMaxBytes: limit})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	return eng
}

func newParkRig(t *testing.T, limit int64) *parkRig {
	t.Helper()
	r := &parkRig{t: t, eng: openParkEngine(t, limit), rep: &recorder{}}
	var err error
	r.o, err = NewOwner(OwnerConfig{Limits: Limits{Threshold: 0.8}, NSeqMax: 6, Cells: r.eng, Reports: r.rep,
		OnEvict: func(c string) { r.why = append(r.why, c) }})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// run serves one request as the scheduler does: bind, prefill what it does
// not hold, decode n greedy tokens, finish (which parks its entry).
func (r *parkRig) run(id string, prompt []int, n int, hs ...prefix.Hash) (out []int, reused int) {
	r.t.Helper()
	b, err := r.o.Bind(id, prompt, hs)
	if err != nil {
		r.t.Fatalf("bind %s: %v", id, err)
	}
	s, err := r.eng.NewSampler(engine.SamplingParams{Temperature: 0})
	if err != nil {
		r.t.Fatal(err)
	}
	toks := prompt[b.Reused:]
	pos := b.Reused
	for len(out) < n {
		k := min(len(toks), r.eng.Info().NBatch)
		span := engine.Span{Seq: b.Seq, Pos: pos, Tokens: toks[:k]}
		if k == len(toks) {
			span.Sampler = s
		}
		got, err := r.eng.Step([]engine.Span{span})
		if err != nil {
			r.t.Fatalf("%s: step: %v", id, err)
		}
		r.o.Append(id, toks[:k]...)
		pos += k
		toks = toks[k:]
		if span.Sampler != nil {
			out = append(out, got[0])
			toks = []int{got[0]}
		}
	}
	r.o.Finish(id)
	if err := r.o.Check(); err != nil {
		r.t.Fatal(err)
	}
	return out, b.Reused
}

func parkPrompt(t *testing.T, e *llama.Engine, salt string) []int {
	t.Helper()
	toks, err := e.Tokenize(salt+": "+strings.Repeat("the quick brown fox jumps over the lazy dog. ", 6), true)
	if err != nil {
		t.Fatal(err)
	}
	return toks
}

// parkSize is the host memory one finished request of prompt and n output
// tokens takes parked, measured on an unbounded engine.
func parkSize(t *testing.T, prompt []int, n int) (int64, []int) {
	t.Helper()
	r := newParkRig(t, 1<<40)
	out, _ := r.run("probe", prompt, n)
	if e, _ := r.o.Books().Get("probe"); e == nil || !r.eng.Parked(e.Seq) {
		t.Fatal("the probe's entry was not parked without a bound")
	}
	return r.eng.ParkedBytes(), out
}

// With a bound of 2.05 entries, parking a third evicts the least
// recently used parked entry (not the oldest: a later request touched it)
// through the Owner's eviction path, its hashes reported; parked bytes stay
// within the bound, the third entry keeps in new bytes only what the entry
// it copied from does not hold, and a request taking over a still-parked
// entry gets the cold run's greedy output.
func TestParkBoundEvictsTheLRUParkedEntry(t *testing.T) {
	const n = 8
	probe := openParkEngine(t, 0)
	pa, pb := parkPrompt(t, probe, "alpha"), parkPrompt(t, probe, "bravo")
	size, coldA := parkSize(t, pa, n)
	limit := size * 41 / 20
	r := newParkRig(t, limit)
	if r.eng.ParkLimit() != limit {
		t.Fatalf("park limit %d, configured %d", r.eng.ParkLimit(), limit)
	}

	r.run("a", pa, n, 1, 2)
	r.run("b", pb, n, 3, 4)
	if got := r.eng.ParkedBytes(); got > limit || len(r.why) != 0 {
		t.Fatalf("two entries: %d bytes parked (bound %d), evictions %v", got, limit, r.why)
	}
	// x shares a's first half: it copies from a (touching it), so b is now
	// the least recently used entry although a is older.
	tail, err := probe.Tokenize("XRAY ZULU QUEBEC 42!", false)
	if err != nil {
		t.Fatal(err)
	}
	px := append(slices.Clone(pa[:len(pa)/2]), tail...)
	if _, reused := r.run("x", px, n, 5); reused != len(pa)/2 {
		t.Fatalf("x reused %d tokens of a, want %d", reused, len(pa)/2)
	}
	if got := r.eng.ParkedBytes(); got > size+size/4 {
		t.Fatalf("a and x parked in %d bytes, a alone takes %d: x should keep only its own tail", got, size)
	}
	if !slices.Equal(r.why, []string{"park_bytes"}) || !slices.Equal(r.rep.evicted, []prefix.Hash{3, 4}) {
		t.Fatalf("evictions %v, reported %v: want b's hashes [3 4] once, cause park_bytes", r.why, r.rep.evicted)
	}
	if r.o.Holds("b") || !r.o.Holds("a") || !r.o.Holds("x") {
		t.Fatal("b should be the one evicted, a and x cached")
	}
	for _, id := range []string{"a", "x"} {
		if e, _ := r.o.Books().Get(id); !r.eng.Parked(e.Seq) {
			t.Fatalf("%s not parked", id)
		}
	}

	// a, still parked, taken over by its conversation's repeat.
	out, reused := r.run("a2", pa, n, 1, 2)
	if reused != len(pa)-1 || !slices.Equal(out, coldA) {
		t.Fatalf("repeat of a from its parked cells (reused %d of %d):\n got %v\nwant %v", reused, len(pa), out, coldA)
	}
	if got := r.eng.ParkedBytes(); got > limit {
		t.Fatalf("%d bytes parked, bound %d", got, limit)
	}
	if slices.Contains(r.rep.evicted, 1) {
		t.Fatalf("a's hashes reported evicted though a2 holds them: %v", r.rep.evicted)
	}
}

// An entry larger than the bound alone stays in the KV cache, still cached
// (evicting it would lose a conversation the cache holds; KV-full eviction
// takes it first when room is needed), and nothing parked is evicted for
// it. Making room for a later entry evicts parked entries only: the
// oversized one, although least recently used, frees no parked bytes.
func TestParkBoundKeepsAnOversizedEntryInCells(t *testing.T) {
	const n = 4
	probe := openParkEngine(t, 0)
	pa, pc := parkPrompt(t, probe, "alpha"), parkPrompt(t, probe, "charlie")
	size, _ := parkSize(t, pa, n)
	r := newParkRig(t, size+size/2)
	long := append(parkPrompt(t, probe, "bravo"), parkPrompt(t, probe, "delta")...)
	r.run("b", long, n, 2)
	if e, _ := r.o.Books().Get("b"); r.eng.Parked(e.Seq) || r.eng.ParkedBytes() != 0 {
		t.Fatalf("oversized b parked (%d bytes)", r.eng.ParkedBytes())
	}
	r.run("a", pa, n, 1)
	if got := r.eng.ParkedBytes(); got != size || len(r.why) != 0 || len(r.rep.evicted) != 0 {
		t.Fatalf("%d bytes parked, want a's %d; evictions %v %v", got, size, r.why, r.rep.evicted)
	}
	r.run("c", pc, n, 3)
	if !r.o.Holds("b") || r.o.Holds("a") || !slices.Equal(r.rep.evicted, []prefix.Hash{1}) || !slices.Equal(r.why, []string{"park_bytes"}) {
		t.Fatalf("parking c: b cached %v, a cached %v, evictions %v %v; want a evicted alone", r.o.Holds("b"), r.o.Holds("a"), r.why, r.rep.evicted)
	}
	if got := r.eng.ParkedBytes(); got > size+size/2 {
		t.Fatalf("%d bytes parked, bound %d", got, size+size/2)
	}

	// A bound below any entry: nothing is ever parked.
	short := probe.Info().BytesPerToken
	r2 := newParkRig(t, short)
	r2.run("a", pa, n, 1)
	if e, _ := r2.o.Books().Get("a"); r2.eng.Parked(e.Seq) || r2.eng.ParkedBytes() != 0 || !r2.o.Holds("a") {
		t.Fatalf("entry parked (or dropped) under a %d-byte bound", short)
	}
}

// Questions about one document, parked after each answer: a new question
// copies the document from the question still running, whose cells hold
// it, not from the last one finished (the most recent match, parked in
// its own bytes). A 2,048-cell cache holds the ~1,100-token document once
// beside the running questions but not twice: restoring the parked match
// would not fit. The output is the cold run's.
func TestACopyTakesThePrefixARunningRequestHolds(t *testing.T) {
	const n = 4
	probe := openParkEngine(t, 0)
	doc, err := probe.Tokenize("doc: "+strings.Repeat("the quick brown fox jumps over the lazy dog. ", 24), true)
	if err != nil {
		t.Fatal(err)
	}
	question := func(q string) []int {
		tail, err := probe.Tokenize(" "+q+"?", false)
		if err != nil {
			t.Fatal(err)
		}
		return append(slices.Clone(doc), tail...)
	}
	_, cold := parkSize(t, question("echo"), n)

	r := newParkRig(t, 1<<40)
	r.run("q1", question("alpha"), n)
	r.run("q2", question("bravo"), n)
	// q3 runs on: bound and its question prefilled, not finished.
	q3 := question("charlie")
	b, err := r.o.Bind("q3", q3, nil)
	if err != nil || b.Reused < len(doc) {
		t.Fatalf("bind q3: reused %d tokens, the document is %d, %v", b.Reused, len(doc), err)
	}
	if _, err := r.eng.Step([]engine.Span{{Seq: b.Seq, Pos: b.Reused, Tokens: q3[b.Reused:]}}); err != nil {
		t.Fatal(err)
	}
	r.o.Append("q3", q3[b.Reused:]...)
	r.run("q4", question("delta"), n) // finishes last: the most recent match
	b5, err := r.o.Bind("q5", question("echo"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if b5.From != "q3" {
		t.Fatalf("q5 copied the document from %q, want the running q3", b5.From)
	}
	r.o.Release("q5")
	if out, _ := r.run("q5", question("echo"), n); !slices.Equal(out, cold) {
		t.Fatalf("q5 beside running q3:\n got %v\nwant %v", out, cold)
	}
}
