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
