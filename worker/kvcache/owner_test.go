package kvcache

import (
	"slices"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
)

// The owner's tests drive the simulated engine, which keeps the same books
// of a unified KV cache as llama.cpp (cells tagged with seq ids, shared by
// Copy) without compute, so cell counts can be checked exactly.

type recorder struct{ evicted, cached []prefix.Hash }

func (r *recorder) Evicted(hs []prefix.Hash) { r.evicted = append(r.evicted, hs...) }
func (r *recorder) Cached(hs []prefix.Hash)  { r.cached = append(r.cached, hs...) }

type fixture struct {
	t     *testing.T
	o     *Owner
	eng   *sim.Engine
	rep   *recorder
	cause []string
}

func newFixture(t *testing.T, nSeq int) *fixture {
	t.Helper()
	return newFixtureOn(t, nSeq, func(eng *sim.Engine) Cells { return eng })
}

// newFixtureOn is newFixture with the Owner's cells made from the engine by
// cells (a wrapper that parks, say).
func newFixtureOn(t *testing.T, nSeq int, cells func(*sim.Engine) Cells) *fixture {
	t.Helper()
	eng, err := sim.New(sim.Config{NSeqMax: nSeq, NCtx: 8192, Sleep: func(time.Duration) {}})
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, eng: eng, rep: &recorder{}}
	f.o, err = NewOwner(OwnerConfig{Limits: Limits{Threshold: 0.8}, NSeqMax: nSeq, Cells: cells(eng), Reports: f.rep,
		OnEvict: func(c string) { f.cause = append(f.cause, c) }})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// write evaluates toks[from:to] of id's sequence on the engine and records
// them, as the scheduler's step does.
func (f *fixture) write(id string, toks []int, from, to int) {
	f.t.Helper()
	e, ok := f.o.Books().Get(id)
	if !ok || len(e.Tokens) != from {
		f.t.Fatalf("%s holds %v tokens, writing from %d", id, e, from)
	}
	if _, err := f.eng.Step([]engine.Span{{Seq: e.Seq, Pos: from, Tokens: toks[from:to]}}); err != nil {
		f.t.Fatal(err)
	}
	f.o.Append(id, toks[from:to]...)
	f.check()
}

func (f *fixture) bind(id string, toks []int, hs ...prefix.Hash) Bound {
	f.t.Helper()
	b, err := f.o.Bind(id, toks, hs)
	if err != nil {
		f.t.Fatalf("bind %s: %v", id, err)
	}
	f.check()
	return b
}

func (f *fixture) check() {
	f.t.Helper()
	if err := f.o.Check(); err != nil {
		f.t.Fatal(err)
	}
	for _, e := range f.o.Books().Entries() {
		if n := f.eng.SeqLen(e.Seq); n != len(e.Tokens) {
			f.t.Fatalf("entry %s books %d tokens, its seq %d holds %d cells", e.ID, len(e.Tokens), e.Seq, n)
		}
	}
}

// vt is n tokens of the simulated engine's 262-token vocabulary; different
// bases give different sequences.
func vt(n, base int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = (base+i)%250 + 5
	}
	return out
}

// prompt is a shared part of n tokens followed by a distinct tail.
func prompt(shared, tail, salt int) []int {
	return append(vt(shared, 100), vt(tail, 37*salt+1)...)
}

func TestOwnerTakesOverCopiesOrStartsFresh(t *testing.T) {
	f := newFixture(t, 4)
	a := prompt(100, 20, 1)
	f.bind("a", a)
	f.write("a", a, 0, len(a))
	f.o.Finish("a")
	f.check()

	// The next turn of a: takes a's entry over (same seq, no new cells).
	next := append(slices.Clone(a), vt(10, 50000)...)
	b := f.bind("next", next)
	if b.From != "a" || b.Reused != len(a) || f.o.Books().Len() != 1 {
		t.Fatalf("next turn: %+v, %d entries; want a taken over", b, f.o.Books().Len())
	}
	f.write("next", next, len(a), len(next))
	f.o.Finish("next")

	// Another question on the same 100 tokens: copies them into a fresh id.
	other := prompt(100, 5, 2)
	b = f.bind("other", other)
	if b.From != "next" || b.Reused != 100 || b.Seq == f.mustSeq("next") || f.eng.UsedCells() != len(next) {
		t.Fatalf("sibling: %+v, %d cells used; want 100 shared cells in a new id", b, f.eng.UsedCells())
	}
	// Nothing in common: fresh.
	if b := f.bind("cold", vt(30, 70000)); b.Reused != 0 || b.From != "" || b.Leader != "" {
		t.Fatalf("cold: %+v", b)
	}
	if _, err := f.o.Bind("cold", vt(3, 1), nil); err == nil {
		t.Fatal("a second binding of one id was accepted")
	}
}

func (f *fixture) mustSeq(id string) int {
	e, ok := f.o.Books().Get(id)
	if !ok {
		f.t.Fatalf("no entry %s", id)
	}
	return e.Seq
}

func TestFollowerWaitsForThePrefillInFlight(t *testing.T) {
	f := newFixture(t, 4)
	lead := prompt(1500, 10, 1)
	f.bind("lead", lead)
	f.write("lead", lead, 0, 512)

	fol := prompt(1500, 7, 2)
	b := f.bind("fol", fol)
	if b.Leader != "lead" || b.ShareTo != 1500 || b.Reused != 512 {
		t.Fatalf("follower bound as %+v; want to follow lead to 1500 holding its 512 written cells", b)
	}
	if _, waiting := f.o.Follow("fol"); !waiting {
		t.Fatal("the follower stopped waiting before the leader wrote the shared part")
	}
	f.write("lead", lead, 512, 1024)
	if held, waiting := f.o.Follow("fol"); held != 1024 || !waiting {
		t.Fatalf("after the leader's second chunk the follower holds %d (waiting %v), want 1024", held, waiting)
	}
	f.check()
	f.write("lead", lead, 1024, len(lead))
	if held, waiting := f.o.Follow("fol"); held != 1500 || waiting {
		t.Fatalf("after the leader's prefill the follower holds %d (waiting %v), want 1500 and done", held, waiting)
	}
	f.check()
	// The shared prefix exists once: the leader's cells plus nothing new.
	if f.eng.UsedCells() != len(lead) {
		t.Fatalf("%d cells used; the follower's 1500 must be the leader's", f.eng.UsedCells())
	}
	f.write("fol", fol, 1500, len(fol))
	if f.eng.UsedCells() != len(lead)+7 {
		t.Fatalf("%d cells used after the follower's own tail", f.eng.UsedCells())
	}
}

func TestReleasedLeaderHandsItsWorkToTheFollowers(t *testing.T) {
	f := newFixture(t, 4)
	lead := prompt(2000, 10, 1)
	f.bind("lead", lead)
	f.write("lead", lead, 0, 512)
	f1 := prompt(2000, 40, 2) // the longer prompt leads next
	f2 := prompt(2000, 5, 3)
	f.bind("f1", f1)
	f.bind("f2", f2)
	f.write("lead", lead, 512, 900)

	f.o.Release("lead") // cancelled mid-prefill
	f.check()
	if f.o.Holds("lead") {
		t.Fatal("the released leader still has an entry")
	}
	h1, w1 := f.o.Follow("f1")
	h2, w2 := f.o.Follow("f2")
	if h1 != 900 || h2 != 900 {
		t.Fatalf("followers hold %d and %d cells; the leader had written 900 they share", h1, h2)
	}
	if w1 || !w2 {
		t.Fatalf("f1 waiting %v, f2 waiting %v; want f1 to compute the rest and f2 to follow it", w1, w2)
	}
	if f.eng.UsedCells() != 900 {
		t.Fatalf("%d cells used; the 900 written cells must survive once", f.eng.UsedCells())
	}
	f.write("f1", f1, 900, 1400)
	f.write("f1", f1, 1400, 1600)
	if h, w := f.o.Follow("f2"); h != 1600 || !w {
		t.Fatalf("f2 holds %d (waiting %v) after f1 computed to 1600", h, w)
	}
	// Preempting the new leader hands on again; f2 goes on alone.
	f.o.Release("f1")
	if h, w := f.o.Follow("f2"); h != 1600 || w {
		t.Fatalf("f2 holds %d (waiting %v) after f1 went", h, w)
	}
	f.check()
}

func TestFinishedLeaderLetsFollowersCatchUp(t *testing.T) {
	f := newFixture(t, 4)
	lead := prompt(600, 3, 1)
	f.bind("lead", lead)
	fol := prompt(600, 9, 2)
	if b := f.bind("fol", fol); b.Leader != "lead" || b.Reused != 0 {
		t.Fatalf("%+v", b)
	}
	f.write("lead", lead, 0, 512)
	f.write("lead", lead, 512, len(lead))
	f.o.Finish("lead") // before the follower looked again
	if h, w := f.o.Follow("fol"); h != 600 || w {
		t.Fatalf("follower holds %d (waiting %v) after its leader finished", h, w)
	}
	f.check()
}

func TestEvictionReportsAreSupersededWhenAPrefixIsCachedAgain(t *testing.T) {
	f := newFixture(t, 1)
	h1, h2 := prefix.Hash(11), prefix.Hash(22)
	a := prompt(50, 5, 1)
	f.bind("a", a, h1, h2)
	f.write("a", a, 0, len(a))
	f.o.Finish("a")
	if !slices.Equal(f.rep.cached, []prefix.Hash{h1, h2}) {
		t.Fatalf("cached reports %v", f.rep.cached)
	}
	// One seq id: an unrelated request evicts a's entry for it.
	f.bind("b", vt(10, 90000))
	if !slices.Equal(f.rep.evicted, []prefix.Hash{h1, h2}) || !slices.Equal(f.cause, []string{"seq_ids"}) {
		t.Fatalf("evicted %v for %v", f.rep.evicted, f.cause)
	}
	f.o.Release("b")
	// The prefix comes back: the owner says so, so a pending eviction of
	// h1 is withdrawn (worker/mcreport drops it).
	f.rep.cached = nil
	f.bind("a2", a, h1)
	if !slices.Equal(f.rep.cached, []prefix.Hash{h1}) {
		t.Fatalf("cached reports %v after the prefix came back", f.rep.cached)
	}
}

func TestNoSeqWhenEveryIDRuns(t *testing.T) {
	f := newFixture(t, 1)
	f.bind("a", vt(5, 1))
	if _, err := f.o.Bind("b", vt(5, 2), nil); err != ErrNoSeq {
		t.Fatalf("err = %v, want ErrNoSeq", err)
	}
	f.check()
}

// parking is the simulated engine plus a record of what the owner parked,
// as the llama engine parks a finished entry's cells in host memory.
type parking struct {
	*sim.Engine
	parked map[int]bool
}

// newParkingFixture is a fixture of four seq ids on cells that park.
func newParkingFixture(t *testing.T) (*fixture, *parking) {
	t.Helper()
	var cells *parking
	f := newFixtureOn(t, 4, func(eng *sim.Engine) Cells {
		cells = &parking{Engine: eng, parked: map[int]bool{}}
		return cells
	})
	return f, cells
}

func (p *parking) Park(seq int)        { p.parked[seq] = true }
func (p *parking) Parked(seq int) bool { return p.parked[seq] }
func (p *parking) Remove(seq, from int) {
	if from == 0 {
		delete(p.parked, seq)
	}
	p.Engine.Remove(seq, from)
}

// A finished entry is parked once its followers took what they share, and
// making room in a full KV cache evicts only entries whose cells are in it.
func TestFinishParksAndRoomIsMadeFromUnparkedEntries(t *testing.T) {
	f, cells := newParkingFixture(t)
	a, b := prompt(600, 10, 1), prompt(600, 10, 2)
	f.bind("a", a)
	f.write("a", a, 0, 512)
	if got := f.bind("b", b); got.Leader != "a" {
		t.Fatalf("b should follow a: %+v", got)
	}
	f.write("a", a, 512, len(a))
	f.o.Finish("a")
	f.check()
	if !cells.Parked(f.mustSeq("a")) || cells.Parked(f.mustSeq("b")) {
		t.Fatalf("parked %v: want a's seq %d only", cells.parked, f.mustSeq("a"))
	}
	if e, _ := f.o.Books().Get("b"); len(e.Tokens) != 600 {
		t.Fatalf("follower b holds %d tokens after its leader finished, want the 600 shared", len(e.Tokens))
	}
	// An idle entry whose cells are in the cache goes first; a parked one
	// would free nothing.
	c := vt(50, 9000)
	f.bind("c", c)
	f.write("c", c, 0, len(c))
	f.o.Finish("c")
	delete(cells.parked, f.mustSeq("c"))
	if !f.o.EvictForRoom("kv_full") || f.o.Holds("c") || !f.o.Holds("a") {
		t.Fatalf("EvictForRoom: a held %v, c held %v; want c evicted, a kept", f.o.Holds("a"), f.o.Holds("c"))
	}
	if f.o.EvictForRoom("kv_full") || !f.o.Holds("a") {
		t.Fatal("EvictForRoom evicted a parked entry")
	}
	f.check()
}

// Swap parks a running request's cells, but not those of a leader or a
// follower (followers copy from their leader's cells), nor twice.
func TestSwapParksARunningRequestButNotALeaderOrFollower(t *testing.T) {
	f, cells := newParkingFixture(t)
	a, b, c := prompt(600, 10, 1), prompt(600, 10, 2), vt(300, 9000)
	f.bind("a", a)
	f.write("a", a, 0, 512)
	f.bind("b", b) // follows a
	f.bind("c", c)
	f.write("c", c, 0, 200)
	if f.o.Swap("a") || f.o.Swap("b") || f.o.Swap("nobody") {
		t.Fatalf("swapped a leader or a follower (parked %v)", cells.parked)
	}
	if !f.o.Swap("c") || !cells.Parked(f.mustSeq("c")) {
		t.Fatal("a running request's cells were not parked")
	}
	if f.o.Swap("c") {
		t.Fatal("swapped a parked request again")
	}
	if e, _ := f.o.Books().Get("c"); !e.InUse || len(e.Tokens) != 200 {
		t.Fatalf("after the swap c is %+v; want in use with its 200 tokens", e)
	}
	f.check()
}

// timedRecorder also wants the time of each eviction.
type timedRecorder struct {
	recorder
	at []time.Time
}

func (r *timedRecorder) EvictedAt(hs []prefix.Hash, at time.Time) {
	r.evicted = append(r.evicted, hs...)
	r.at = append(r.at, at)
}

// Reports that implement TimedReports learn when the cells went, stamped at
// the eviction itself: a report sent later still names the moment the pod
// stopped holding the prefix.
func TestEvictionsAreStampedWhenTheyHappen(t *testing.T) {
	eng, err := sim.New(sim.Config{NSeqMax: 1, NCtx: 8192, Sleep: func(time.Duration) {}})
	if err != nil {
		t.Fatal(err)
	}
	rep := &timedRecorder{}
	o, err := NewOwner(OwnerConfig{Limits: Limits{Threshold: 0.8}, NSeqMax: 1, Cells: eng, Reports: rep})
	if err != nil {
		t.Fatal(err)
	}
	a := prompt(50, 5, 1)
	if _, err := o.Bind("a", a, []prefix.Hash{11}); err != nil {
		t.Fatal(err)
	}
	e, _ := o.Books().Get("a")
	if _, err := eng.Step([]engine.Span{{Seq: e.Seq, Pos: 0, Tokens: a}}); err != nil {
		t.Fatal(err)
	}
	o.Append("a", a...)
	o.Finish("a")
	before := time.Now()
	if _, err := o.Bind("b", vt(10, 90000), nil); err != nil { // takes a's only seq id
		t.Fatal(err)
	}
	after := time.Now()
	if !slices.Equal(rep.evicted, []prefix.Hash{11}) || len(rep.at) != 1 || rep.at[0].Before(before) || rep.at[0].After(after) {
		t.Fatalf("evicted %v at %v, want [11] between %v and %v", rep.evicted, rep.at, before, after)
	}
}

func TestKeepLeavesAnEndedRequestsCellsCached(t *testing.T) {
	f := newFixture(t, 4)
	hs := []prefix.Hash{1, 2}
	// Ended after its first token: the whole prompt stays, hashes and all.
	a := prompt(400, 20, 1)
	f.bind("a", a, hs...)
	f.write("a", a, 0, len(a))
	f.o.Keep("a", len(a))
	f.check()
	if e, ok := f.o.Books().Get("a"); !ok || e.InUse || len(e.Tokens) != len(a) || len(e.Hashes) != 2 {
		t.Fatalf("kept entry %+v (%v)", e, ok)
	}
	if len(f.rep.evicted) != 0 {
		t.Fatalf("evicted %v", f.rep.evicted)
	}
	if b := f.bind("retry", a, hs...); b.Reused != len(a)-1 {
		t.Fatalf("the retry reused %d of %d", b.Reused, len(a))
	}
	f.write("retry", a, len(a)-1, len(a))
	f.o.Finish("retry")

	// Ended mid-prefill: the cells stay, the whole prompt's hashes go.
	hb := []prefix.Hash{3, 4}
	b := vt(900, 7)
	f.bind("b", b, hb...)
	f.write("b", b, 0, 512)
	f.o.Keep("b", len(b))
	f.check()
	if e, ok := f.o.Books().Get("b"); !ok || e.InUse || len(e.Tokens) != 512 || len(e.Hashes) != 0 {
		t.Fatalf("kept partial entry %+v (%v)", e, ok)
	}
	if !slices.Equal(f.rep.evicted, hb) {
		t.Fatalf("evicted %v, want the partial prompt's %v", f.rep.evicted, hb)
	}

	// A follower ended while waiting keeps what its leader wrote so far.
	lead := append(vt(1500, 20), vt(10, 1)...)
	f.bind("lead", lead)
	f.write("lead", lead, 0, 512)
	fol := append(vt(1500, 20), vt(7, 2)...)
	if bd := f.bind("fol", fol); bd.Leader != "lead" {
		t.Fatalf("%+v", bd)
	}
	f.write("lead", lead, 512, 1024)
	f.o.Keep("fol", len(fol))
	f.check()
	if e, ok := f.o.Books().Get("fol"); !ok || e.InUse || len(e.Tokens) != 1024 || f.o.Followers("lead") != 0 {
		t.Fatalf("kept follower %+v (%v)", e, ok)
	}

	// Nothing written: nothing kept.
	f.bind("empty", vt(40, 60000))
	f.o.Keep("empty", 40)
	f.check()
	if f.o.Holds("empty") {
		t.Fatal("an entry without cells was kept")
	}
}

func TestRunningCellsCountSharedPrefixesOnceAndIdleEntriesNot(t *testing.T) {
	f := newFixture(t, 4)
	a := prompt(300, 20, 1)
	f.bind("a", a)
	f.write("a", a, 0, len(a))
	b := prompt(300, 30, 2)
	f.bind("b", b) // copies a's 300 shared cells
	f.write("b", b, 300, len(b))
	if got, want := f.o.RunningCells(), 300+20+30; got != want || f.eng.UsedCells() != want {
		t.Fatalf("running cells %d (engine %d), want %d", got, f.eng.UsedCells(), want)
	}
	f.o.Finish("a")
	if got := f.o.RunningCells(); got != len(b) {
		t.Fatalf("running cells %d after a finished, want b's %d: idle cells count free", got, len(b))
	}
	f.o.Finish("b")
	if got := f.o.RunningCells(); got != 0 || f.eng.UsedCells() == 0 {
		t.Fatalf("running cells %d with nothing running (%d cells cached)", got, f.eng.UsedCells())
	}
}
