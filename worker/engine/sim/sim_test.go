package sim

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

func TestTokenizeRoundTrip(t *testing.T) {
	e, _ := New(Config{NSeqMax: 1})
	text := "<|im_start|>user\nhéllo wörld<|im_end|>\n"
	toks, _ := e.Tokenize(text, true)
	if toks[0] != tokBOS || toks[1] != tokIMStart || !slices.Contains(toks, tokIMEnd) || !slices.Contains(toks, tokSpace) {
		t.Fatalf("tokens %v", toks)
	}
	var sb strings.Builder
	for _, tk := range toks[1:] {
		sb.WriteString(e.Piece(tk))
	}
	if sb.String() != text {
		t.Fatalf("round trip %q != %q", sb.String(), text)
	}
	if !e.IsEOG(tokIMEnd) || e.IsEOG(tokEOSText) {
		t.Fatal("EOG is <|im_end|> only, as in the generated models")
	}
}

func TestCellsAreSharedAndFreedLikeAUnifiedCache(t *testing.T) {
	e, _ := New(Config{NSeqMax: 3, NCtx: 100})
	prompt := make([]int, 60)
	for i := range prompt {
		prompt[i] = tokByte0 + 'a'
	}
	if _, err := e.Step([]engine.Span{{Seq: 0, Pos: 0, Tokens: prompt}}); err != nil {
		t.Fatal(err)
	}
	e.Copy(0, 1, 0, 30)
	e.Copy(0, 1, 30, 50) // a follower taking a prefill in two pieces
	if e.UsedCells() != 60 || e.SeqLen(1) != 50 {
		t.Fatalf("used %d seq1 %d: a shared prefix must not take new cells", e.UsedCells(), e.SeqLen(1))
	}
	if _, err := e.Step([]engine.Span{{Seq: 2, Pos: 0, Tokens: prompt}}); !errors.Is(err, engine.ErrKVFull) {
		t.Fatalf("60 more cells in 40 free: %v", err)
	}
	if e.UsedCells() != 60 {
		t.Fatal("a failed step took cells")
	}
	e.Remove(0, 0)
	if e.UsedCells() != 50 {
		t.Fatalf("after removing seq 0, %d cells in use; seq 1 still holds 50", e.UsedCells())
	}
	if _, err := e.Step([]engine.Span{{Seq: 1, Pos: 49, Tokens: prompt[:1]}}); err == nil {
		t.Fatal("a span not at the sequence's end was accepted")
	}
	e.Remove(1, 0)
	if e.UsedCells() != 0 {
		t.Fatalf("%d cells leaked", e.UsedCells())
	}
}

func TestGreedyIsAFunctionOfContextAndCostIsModelled(t *testing.T) {
	var slept time.Duration
	cost := Cost{StepOverhead: time.Millisecond, PerToken: 10 * time.Microsecond, PerSample: 100 * time.Microsecond}
	e, _ := New(Config{NSeqMax: 2, Cost: cost, Sleep: func(d time.Duration) { slept += d }})
	s0, _ := e.NewSampler(engine.SamplingParams{})
	s1, _ := e.NewSampler(engine.SamplingParams{})
	p := []int{tokBOS, tokByte0 + 'x', tokByte0 + 'y'}
	out, err := e.Step([]engine.Span{{Seq: 0, Pos: 0, Tokens: p, Sampler: s0}, {Seq: 1, Pos: 0, Tokens: p[:2]}})
	if err != nil {
		t.Fatal(err)
	}
	want := cost.StepOverhead + 5*cost.PerToken + cost.PerSample
	if slept != want {
		t.Fatalf("modelled %v, want %v", slept, want)
	}
	out2, _ := e.Step([]engine.Span{{Seq: 1, Pos: 2, Tokens: p[2:], Sampler: s1}})
	if out[0] != out2[0] || out[1] != -1 || e.IsEOG(out[0]) {
		t.Fatalf("greedy after the same context differs: %v vs %v", out, out2)
	}
}

// A prompt prefilled aside costs its own attention only, takes no cells
// until its sequence steps, then takes them all or (no room) none; an
// adopted prefix stays in the cache, and Remove drops what is aside.
func TestPrefillAsideTakesCellsWhenItsSequenceSteps(t *testing.T) {
	var slept time.Duration
	cost := Cost{StepOverhead: time.Millisecond, PerToken: 10 * time.Microsecond, PerKCtxToken: time.Millisecond}
	e, _ := New(Config{NSeqMax: 3, NCtx: 100, AsideCells: 80, Cost: cost, Sleep: func(d time.Duration) { slept += d }})
	p := make([]int, 70)
	for i := range p {
		p[i] = tokByte0 + 'a' + i%26
	}
	if _, err := e.Step([]engine.Span{{Seq: 1, Pos: 0, Tokens: p[:20]}}); err != nil {
		t.Fatal(err)
	}
	e.Copy(1, 0, 0, 20) // seq 0 adopts 20 cells
	slept = 0
	if err := e.PrefillAside(0, 20, p[20:50]); err != nil {
		t.Fatal(err)
	}
	// 30 tokens at positions 20..49 attend over 21..50 cells: 1065 cell-tokens.
	if want := cost.StepOverhead + 30*cost.PerToken + 1065*cost.PerKCtxToken/1000; slept != want {
		t.Fatalf("modelled %v aside, want %v", slept, want)
	}
	if e.UsedCells() != 20 || e.SeqLen(0) != 20 {
		t.Fatalf("aside: %d cells used, seq 0 holds %d; want the shared 20 only", e.UsedCells(), e.SeqLen(0))
	}
	if err := e.PrefillAside(0, 60, p[60:69]); err == nil {
		t.Fatal("a gap aside was accepted")
	}
	if err := e.PrefillAside(0, 50, p[50:69]); err != nil {
		t.Fatal(err)
	}
	e.Copy(0, 2, 0, 20) // from the sequence aside: its prefix in the cache
	if _, err := e.Step([]engine.Span{{Seq: 2, Pos: 20, Tokens: p[20:60]}}); err != nil {
		t.Fatal(err)
	}
	// 49 positions aside + 1 new into 40 free: no room, nothing taken.
	if _, err := e.Step([]engine.Span{{Seq: 0, Pos: 69, Tokens: p[69:]}}); !errors.Is(err, engine.ErrKVFull) || e.UsedCells() != 60 {
		t.Fatalf("landing 50 cells in 40 free: %v, %d used", err, e.UsedCells())
	}
	e.Remove(2, 0)
	if _, err := e.Step([]engine.Span{{Seq: 0, Pos: 69, Tokens: p[69:]}}); err != nil || e.SeqLen(0) != 70 || e.UsedCells() != 70 {
		t.Fatalf("landing with room: %v, seq 0 holds %d, %d used; want 70 and 70", err, e.SeqLen(0), e.UsedCells())
	}
	if err := e.PrefillAside(2, 0, p[:10]); err != nil {
		t.Fatal(err)
	}
	e.Remove(2, 0)
	if _, err := e.Step([]engine.Span{{Seq: 2, Pos: 10, Tokens: p[10:11]}}); err == nil {
		t.Fatal("seq 2 stepped past positions that were removed aside")
	}
}

// The cost model has no logits: what needs them is refused, not faked.
func TestSamplersNeedingLogitsAreRefused(t *testing.T) {
	e, _ := New(Config{NSeqMax: 1})
	for _, p := range []engine.SamplingParams{{JSONSchema: []byte(`{"type":"object"}`)}, {Logprobs: true}} {
		if _, err := e.NewSampler(p); !errors.Is(err, engine.ErrUnsupported) {
			t.Errorf("%+v: %v, want ErrUnsupported", p, err)
		}
	}
	if _, err := e.NewSampler(engine.SamplingParams{Temperature: 1}); err != nil {
		t.Fatal(err)
	}
}
