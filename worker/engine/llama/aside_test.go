package llama

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// prefillAside evaluates prompt[from:to] of seq aside, NBatch at a time.
func prefillAside(t *testing.T, e *Engine, seq int, prompt []int, from, to int) {
	t.Helper()
	for pos := from; pos < to; {
		k := min(to-pos, e.Info().NBatch)
		if err := e.PrefillAside(seq, pos, prompt[pos:pos+k]); err != nil {
			t.Fatalf("aside at %d: %v", pos, err)
		}
		pos += k
	}
}

// A prompt prefilled aside, in chunks, while another sequence decodes in
// the main context, gives the greedy output of a prefill in the main
// context; so does one that starts from an adopted prefix, whose cells are
// copied aside and stay shared in the cache. Landing writes only the cells
// computed aside into the cache, and a sequence aside that is removed
// leaves nothing behind.
func TestPrefillAsideGivesTheSameGreedyOutput(t *testing.T) {
	e := openWith(t, Config{NCtx: 2048, NSeqMax: 4, AsideCells: 1000})
	if got := e.AsideCells(); got != 1024 {
		t.Fatalf("AsideCells %d, want 1000 rounded up to 1024", got)
	}
	prompt := document(700)
	other := document(90)[10:]
	cold := greedy(t, e, 0, prompt, 0, 8)
	coldOther := greedy(t, e, 1, other, 0, 8)
	e.Remove(0, 0)
	e.Remove(1, 0)

	// Cold, beside a decoding sequence: one chunk aside, one step of the
	// other sequence, the second chunk aside, then the last token in the
	// main context.
	s, _ := e.NewSampler(engine.SamplingParams{})
	first, err := e.Step([]engine.Span{{Seq: 1, Pos: 0, Tokens: other, Sampler: s}})
	if err != nil {
		t.Fatal(err)
	}
	prefillAside(t, e, 0, prompt, 0, 512)
	used := e.UsedCells()
	if _, err := e.Step([]engine.Span{{Seq: 1, Pos: len(other), Tokens: first, Sampler: s}}); err != nil {
		t.Fatal(err)
	}
	if e.UsedCells() != used+1 {
		t.Fatalf("the cache grew from %d to %d cells while a prompt was prefilled aside; want only the other sequence's new one", used, e.UsedCells())
	}
	prefillAside(t, e, 0, prompt, 512, len(prompt)-1)
	if got := greedy(t, e, 0, prompt, len(prompt)-1, 8); !slices.Equal(got, cold) {
		t.Fatalf("prefilled aside:\ncold %v\ngot  %v", cold, got)
	}
	if e.Parked(0) || e.side.seq != -1 {
		t.Fatalf("after landing: parked %v, seq aside %d; want neither", e.Parked(0), e.side.seq)
	}
	got := slices.Clone(first)
	for len(got) < len(coldOther) {
		toks, err := e.Step([]engine.Span{{Seq: 1, Pos: len(other) + len(got) - 1, Tokens: got[len(got)-1:], Sampler: s}})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, toks[0])
	}
	if !slices.Equal(got, coldOther) {
		t.Fatalf("the sequence decoding beside it:\ncold %v\ngot  %v", coldOther, got)
	}
	e.Remove(0, 0)
	e.Remove(1, 0)

	// From an adopted prefix: seq 2 copies 300 cells of seq 1, and the
	// prompt's rest is prefilled aside with them.
	greedy(t, e, 1, prompt[:300], 0, 1)
	e.Remove(1, 300)
	e.Copy(1, 2, 0, 300)
	prefillAside(t, e, 2, prompt, 300, len(prompt)-1)
	if got := greedy(t, e, 2, prompt, len(prompt)-1, 8); !slices.Equal(got, cold) {
		t.Fatalf("prefilled aside from an adopted prefix:\ncold %v\ngot  %v", cold, got)
	}
	if got, _ := e.cellExtent(); got > len(prompt)+8 {
		t.Fatalf("%d cells in use; want at most the prompt and its 8 tokens, the 300 adopted held once", got)
	}

	// Removed while aside, and replaced by another sequence: nothing lands.
	e.Remove(2, 0)
	prefillAside(t, e, 3, prompt, 0, 200)
	e.Remove(3, 0)
	prefillAside(t, e, 3, prompt, 0, 100)
	prefillAside(t, e, 0, prompt, 0, 100)
	if _, err := e.Step([]engine.Span{{Seq: 3, Pos: 0, Tokens: prompt[:1]}}); err != nil {
		t.Fatalf("seq 3 after another sequence took the room aside: %v", err)
	}
	if e.Parked(3) {
		t.Fatal("seq 3's cells aside landed after another sequence replaced them")
	}
}

// Landing needs room: into a full cache it is ErrKVFull and the cells
// stay aside; once there is room the sequence goes on with the cold
// output.
func TestPrefillAsideLandsOnlyWhereThereIsRoom(t *testing.T) {
	e := openWith(t, Config{NCtx: 512, NSeqMax: 2, AsideCells: 512})
	prompt := document(300)
	cold := greedy(t, e, 0, prompt, 0, 4)
	e.Remove(0, 0)

	if _, err := e.Step([]engine.Span{{Seq: 1, Pos: 0, Tokens: document(400)}}); err != nil {
		t.Fatal(err)
	}
	prefillAside(t, e, 0, prompt, 0, len(prompt)-1)
	s, _ := e.NewSampler(engine.SamplingParams{})
	_, err := e.Step([]engine.Span{{Seq: 0, Pos: len(prompt) - 1, Tokens: prompt[len(prompt)-1:], Sampler: s}})
	if !errors.Is(err, engine.ErrKVFull) || e.side.seq != 0 {
		t.Fatalf("landing 299 cells beside 400 of 512: err %v, seq aside %d; want ErrKVFull and seq 0 still aside", err, e.side.seq)
	}
	e.Remove(1, 0)
	if got := greedy(t, e, 0, prompt, len(prompt)-1, 4); !slices.Equal(got, cold) {
		t.Fatalf("after making room:\ncold %v\ngot  %v", cold, got)
	}
}

// A prompt that adopted a prefix lands beside it: it needs room for the
// cells computed aside only, not for a second copy of the prefix, which
// would not fit here (600 held by the source, 600 + 300 more, 100 of
// another sequence, in 1024 cells).
func TestPrefillAsideLandsBesideTheAdoptedPrefix(t *testing.T) {
	e := openWith(t, Config{NCtx: 1024, NSeqMax: 3, AsideCells: 1024})
	prompt := document(900)
	cold := greedy(t, e, 0, prompt, 0, 4)
	e.Remove(0, 0)

	greedy(t, e, 0, prompt[:600], 0, 1)
	e.Remove(0, 600)
	if _, err := e.Step([]engine.Span{{Seq: 2, Pos: 0, Tokens: document(100)}}); err != nil {
		t.Fatal(err)
	}
	e.Copy(0, 1, 0, 600)
	prefillAside(t, e, 1, prompt, 600, len(prompt)-1)
	if got := greedy(t, e, 1, prompt, len(prompt)-1, 4); !slices.Equal(got, cold) {
		t.Fatalf("landed beside the adopted prefix:\ncold %v\ngot  %v", cold, got)
	}
	if used := e.UsedCells(); used > 900+4+100 {
		t.Fatalf("%d cells in use; want the prompt once, its tokens and the other sequence's 100", used)
	}
	// The source's cells are still its own: it goes on from them.
	if got := greedy(t, e, 0, prompt[:601], 600, 1); len(got) != 1 {
		t.Fatalf("the source after the landing: %v", got)
	}
}

// Bad calls are errors, not crashes or silent loss.
func TestPrefillAsideRejectsBadCalls(t *testing.T) {
	_, err := Open(Config{ModelPath: testmodel.Path(t), NoPark: true, AsideCells: 256, NSeqMax: 1})
	if err == nil || !strings.Contains(err.Error(), "parking") {
		t.Fatalf("AsideCells without parking: %v, want an error naming parking", err)
	}
	e := openWith(t, Config{NCtx: 512, NSeqMax: 2, AsideCells: 256})
	doc := document(300)
	for _, c := range []struct {
		name     string
		seq, pos int
		toks     []int
	}{
		{"seq outside", 2, 0, doc[:10]},
		{"no tokens", 0, 0, nil},
		{"past the room aside", 0, 0, doc[:257]},
		{"token outside the vocabulary", 0, 0, []int{1 << 20}},
	} {
		if err := e.PrefillAside(c.seq, c.pos, c.toks); err == nil {
			t.Errorf("%s: no error", c.name)
		}
	}
	if err := e.PrefillAside(1, 0, doc[:10]); err != nil {
		t.Fatal(err)
	}
	if err := e.PrefillAside(1, 20, doc[20:30]); err == nil {
		t.Error("a gap aside (10 positions held, 20 asked): no error")
	}
	greedy(t, e, 0, doc[:50], 0, 1)
	if err := e.PrefillAside(0, 10, doc[10:20]); err == nil {
		t.Error("seq 0 holds 50 cells, asked to start aside at 10: no error")
	}
	if err := e.PrefillAside(1, 1, doc[1:2]); err == nil {
		t.Error("seq 1 holds no cells, asked to start aside at 1: no error")
	}
}

func TestNoAsideWithoutItsCells(t *testing.T) {
	e := open(t, 256, 1)
	if e.AsideCells() != 0 {
		t.Fatalf("AsideCells %d without Config.AsideCells", e.AsideCells())
	}
	if err := e.PrefillAside(0, 0, []int{5}); err == nil {
		t.Fatal("PrefillAside without a context aside: no error")
	}
}
