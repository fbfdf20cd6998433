package llama

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

// generate prefills prompt into seq 0 and samples with s until an
// end-of-generation token or n tokens, returning the tokens before it.
func generate(t *testing.T, e *Engine, prompt []int, s engine.Sampler, n int) (out []int, eog bool) {
	t.Helper()
	e.Remove(0, 0)
	toks, err := e.Step([]engine.Span{{Seq: 0, Pos: 0, Tokens: prompt, Sampler: s}})
	if err != nil {
		t.Fatal(err)
	}
	pos := len(prompt)
	for tok := toks[0]; ; pos++ {
		if e.IsEOG(tok) {
			return out, true
		}
		out = append(out, tok)
		if len(out) == n {
			return out, false
		}
		if toks, err = e.Step([]engine.Span{{Seq: 0, Pos: pos, Tokens: []int{tok}, Sampler: s}}); err != nil {
			t.Fatal(err)
		}
		tok = toks[0]
	}
}

func TestSeedMakesSamplingReproducible(t *testing.T) {
	e := open(t, 4096, 1)
	prompt, _ := e.Tokenize("once upon a time", true)
	run := func(seed uint32) []int {
		s, err := e.NewSampler(engine.SamplingParams{Temperature: 1, TopP: 1, Seed: seed, SeedSet: true})
		if err != nil {
			t.Fatal(err)
		}
		out, _ := generate(t, e, prompt, s, 32)
		return out
	}
	a, b, c := run(7), run(7), run(8)
	if !slices.Equal(a, b) {
		t.Fatalf("seed 7 twice gave different tokens:\n%v\n%v", a, b)
	}
	if slices.Equal(a, c) {
		t.Fatalf("seeds 7 and 8 gave the same %d tokens: the seed does not reach the sampler", len(a))
	}
}

func TestLogprobsOfSampledTokens(t *testing.T) {
	e := open(t, 4096, 1)
	prompt, _ := e.Tokenize("once upon a time", true)
	s, err := e.NewSampler(engine.SamplingParams{Temperature: 0, Logprobs: true, TopLogprobs: 5})
	if err != nil {
		t.Fatal(err)
	}
	out, eog := generate(t, e, prompt, s, 16)
	recs := s.(engine.LogprobSource).TakeLogprobs()
	want := len(out)
	if eog {
		want++ // the end-of-generation token was sampled too
	}
	if len(recs) != want {
		t.Fatalf("%d records for %d sampled tokens", len(recs), want)
	}
	for i, r := range recs {
		if i < len(out) && r.Token != out[i] {
			t.Fatalf("record %d is of token %d, sampled %d", i, r.Token, out[i])
		}
		if r.Logprob > 0 || len(r.Top) != 5 {
			t.Fatalf("record %d: logprob %v, %d alternatives", i, r.Logprob, len(r.Top))
		}
		// Greedy picks the most likely token: the first alternative.
		if r.Top[0] != r.TokenLogprob {
			t.Fatalf("record %d: greedy token %+v is not the most likely %+v", i, r.TokenLogprob, r.Top[0])
		}
		if !slices.IsSortedFunc(r.Top, func(a, b engine.TokenLogprob) int { return -cmpF(a.Logprob, b.Logprob) }) {
			t.Fatalf("record %d: alternatives not most likely first: %+v", i, r.Top)
		}
	}
	if more := s.(engine.LogprobSource).TakeLogprobs(); len(more) != 0 {
		t.Fatalf("TakeLogprobs returned %d records twice", len(more))
	}
}

func cmpF(a, b float32) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// The random-weights model writes bytes at random; the grammar built from
// the schema is what makes its output valid JSON of the schema's shape.
func TestJSONSchemaConstrainsOutput(t *testing.T) {
	e := open(t, 4096, 1)
	prompt, _ := e.Tokenize("once upon a time", true)
	schema := []byte(`{"type":"object","properties":{"ok":{"type":"boolean"},"n":{"type":"integer"}},"required":["ok","n"],"additionalProperties":false}`)
	for seed := range uint32(3) {
		s, err := e.NewSampler(engine.SamplingParams{Temperature: 1, TopP: 1, Seed: seed, SeedSet: true, JSONSchema: schema})
		if err != nil {
			t.Fatal(err)
		}
		out, eog := generate(t, e, prompt, s, 200)
		text := ""
		for _, tok := range out {
			text += e.Piece(tok)
		}
		if !eog {
			t.Fatalf("seed %d: no end of generation after %d tokens: %q", seed, len(out), text)
		}
		var v struct {
			OK *bool  `json:"ok"`
			N  *int64 `json:"n"`
		}
		dec := json.NewDecoder(strings.NewReader(text))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&v); err != nil || v.OK == nil || v.N == nil {
			t.Fatalf("seed %d: output %q does not match the schema: %v", seed, text, err)
		}
	}
	if _, err := e.NewSampler(engine.SamplingParams{JSONSchema: []byte(`{"type":`)}); !errors.Is(err, engine.ErrUnsupported) {
		t.Fatalf("a broken schema: %v, want ErrUnsupported", err)
	}
}
