package llama

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

func open(t *testing.T, nCtx, nSeq int) *Engine {
	t.Helper()
	return openWith(t, Config{NCtx: nCtx, NSeqMax: nSeq})
}

// openWith opens the test model on one thread with cfg's other settings.
func openWith(t *testing.T, cfg Config) *Engine {
	t.Helper()
	cfg.ModelPath, cfg.Threads = testmodel.Path(t), 1
	e, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// greedy evaluates prompt into seq from position from (cells before it must
// already be there) and then decodes n tokens greedily.
func greedy(t *testing.T, e *Engine, seq int, prompt []int, from, n int) []int {
	t.Helper()
	return sample(t, e, seq, prompt, from, n, engine.SamplingParams{Temperature: 0})
}

// sample is greedy with other sampling parameters.
func sample(t *testing.T, e *Engine, seq int, prompt []int, from, n int, p engine.SamplingParams) []int {
	t.Helper()
	s, err := e.NewSampler(p)
	if err != nil {
		t.Fatal(err)
	}
	pos := from
	rest := prompt[from:]
	var out []int
	for len(rest) > 0 {
		k := min(len(rest), e.Info().NBatch)
		span := engine.Span{Seq: seq, Pos: pos, Tokens: rest[:k]}
		if k == len(rest) {
			span.Sampler = s
		}
		toks, err := e.Step([]engine.Span{span})
		if err != nil {
			t.Fatal(err)
		}
		pos += k
		rest = rest[k:]
		if span.Sampler != nil {
			out = append(out, toks[0])
		}
	}
	for len(out) < n {
		toks, err := e.Step([]engine.Span{{Seq: seq, Pos: pos, Tokens: out[len(out)-1:], Sampler: s}})
		if err != nil {
			t.Fatal(err)
		}
		pos++
		out = append(out, toks[0])
	}
	return out
}

func TestInfoFromTheGGUF(t *testing.T) {
	e := open(t, 0, 2)
	in := e.Info()
	if in.NCtx != in.NCtxTrain || in.NCtxTrain < 8192 {
		t.Fatalf("context %d should default to the training context %d (>= 8192 for the tiny model)", in.NCtx, in.NCtxTrain)
	}
	if in.BytesPerToken <= 0 || in.NVocab <= 0 || in.NBatch != 512 || in.NSeqMax != 2 {
		t.Fatalf("info %+v", in)
	}
	toks, err := e.Tokenize("hello world", true)
	if err != nil || len(toks) < 3 {
		t.Fatalf("Tokenize = %v, %v", toks, err)
	}
	var sb strings.Builder
	for _, tk := range toks {
		sb.WriteString(e.Piece(tk))
	}
	if !strings.Contains(sb.String(), "hello world") {
		t.Fatalf("pieces %q do not spell the prompt", sb.String())
	}
}

func TestSharedPrefixGivesTheSameGreedyOutput(t *testing.T) {
	e := open(t, 4096, 3)
	prompt, _ := e.Tokenize(strings.Repeat("the quick brown fox jumps over the lazy dog. ", 30), true)
	full := greedy(t, e, 0, prompt, 0, 16)

	// seq 1 shares all but the last prompt token of seq 0's cells and
	// evaluates only that token.
	e.Remove(0, len(prompt)) // keep exactly the prompt's cells
	e.Copy(0, 1, 0, len(prompt)-1)
	reused := greedy(t, e, 1, prompt, len(prompt)-1, 16)
	if !slices.Equal(full, reused) {
		t.Fatalf("greedy output differs with a shared prefix:\nfull   %v\nreused %v", full, reused)
	}
	// Removing seq 0 entirely must not disturb seq 1's shared cells.
	e.Remove(0, 0)
	e.Remove(1, len(prompt))
	// In two ranges, as a follower takes a prefill still being written.
	e.Copy(1, 2, 0, 7)
	e.Copy(1, 2, 7, len(prompt)-1)
	again := greedy(t, e, 2, prompt, len(prompt)-1, 16)
	if !slices.Equal(full, again) {
		t.Fatalf("output changed after the source sequence was removed: %v vs %v", full, again)
	}
}

func TestKVFullIsAnErrorNotACrash(t *testing.T) {
	e := open(t, 256, 2)
	toks := make([]int, 200)
	for i := range toks {
		toks[i] = 3 + 'a' + i%26
	}
	if _, err := e.Step([]engine.Span{{Seq: 0, Pos: 0, Tokens: toks}}); err != nil {
		t.Fatal(err)
	}
	_, err := e.Step([]engine.Span{{Seq: 1, Pos: 0, Tokens: toks}})
	if !errors.Is(err, engine.ErrKVFull) {
		t.Fatalf("second 200-token sequence in 256 cells: err %v, want ErrKVFull", err)
	}
	// The failed batch left nothing behind: freeing seq 0 makes room.
	e.Remove(0, 0)
	if _, err := e.Step([]engine.Span{{Seq: 1, Pos: 0, Tokens: toks}}); err != nil {
		t.Fatalf("after freeing seq 0: %v", err)
	}
	if _, err := e.Step([]engine.Span{{Seq: 1, Pos: 200, Tokens: []int{1 << 30}}}); err == nil {
		t.Fatal("out-of-vocabulary token accepted")
	}
}

// BenchmarkStep measures single decode steps, the numbers the sim engine's
// cost model is fitted to (docs/worker.md). Point LLMF_BENCH_MODEL at the
// bench preset (go run ./worker/cmd/mkmodel --preset bench --out ...) for the
// calibration; without it the tiny model is used. LLMF_THREADS and
// LLMF_FLASH_ATTN=1 vary the context.
func BenchmarkStep(b *testing.B) {
	path := os.Getenv("LLMF_BENCH_MODEL")
	if path == "" {
		path = testmodel.Path(b)
	}
	threads, _ := strconv.Atoi(os.Getenv("LLMF_THREADS"))
	e, err := Open(Config{ModelPath: path, NCtx: 4096, NSeqMax: 8, Threads: threads, FlashAttention: os.Getenv("LLMF_FLASH_ATTN") == "1"})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	toks := func(n, salt int) []int {
		out := make([]int, n)
		for i := range out {
			out[i] = 3 + 'a' + (i*7+salt)%26
		}
		return out
	}
	for _, ctx := range []int{0, 1536} {
		b.Run(fmt.Sprintf("prefill512/ctx=%d", ctx), func(b *testing.B) {
			e.Remove(0, 0)
			if ctx > 0 {
				for p := 0; p < ctx; p += 512 {
					if _, err := e.Step([]engine.Span{{Seq: 0, Pos: p, Tokens: toks(512, p)}}); err != nil {
						b.Fatal(err)
					}
				}
			}
			s, _ := e.NewSampler(engine.SamplingParams{})
			b.ResetTimer()
			for range b.N {
				if _, err := e.Step([]engine.Span{{Seq: 0, Pos: ctx, Tokens: toks(512, 1), Sampler: s}}); err != nil {
					b.Fatal(err)
				}
				e.Remove(0, ctx)
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/step")
		})
	}
	for _, n := range []int{1, 4, 8} {
		b.Run(fmt.Sprintf("decode/seqs=%d", n), func(b *testing.B) {
			var spans []engine.Span
			for s := range n {
				e.Remove(s, 0)
				if _, err := e.Step([]engine.Span{{Seq: s, Pos: 0, Tokens: toks(64, s)}}); err != nil {
					b.Fatal(err)
				}
				sm, _ := e.NewSampler(engine.SamplingParams{})
				spans = append(spans, engine.Span{Seq: s, Pos: 64, Tokens: []int{3 + 'x'}, Sampler: sm})
			}
			b.ResetTimer()
			for range b.N {
				if _, err := e.Step(spans); err != nil {
					b.Fatal(err)
				}
				for s := range n {
					e.Remove(s, 64)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/step")
		})
	}
}

// The penalties work through llama.cpp's penalty sampler on the generated
// tokens: the random-weights model repeats itself greedily, and a presence
// penalty makes it use more distinct tokens, a frequency penalty makes its
// most repeated token rarer.
func TestPenaltiesChangeGreedyOutput(t *testing.T) {
	e := open(t, 4096, 1)
	prompt, _ := e.Tokenize("once upon a time", true)
	const n = 48
	run := func(p engine.SamplingParams) []int {
		e.Remove(0, 0)
		return sample(t, e, 0, prompt, 0, n, p)
	}
	plain := run(engine.SamplingParams{})
	if again := run(engine.SamplingParams{}); !slices.Equal(plain, again) {
		t.Fatalf("greedy is not reproducible: %v vs %v", plain, again)
	}
	presence := run(engine.SamplingParams{PresencePenalty: 2})
	frequency := run(engine.SamplingParams{FrequencyPenalty: 2})
	if distinct(presence) <= distinct(plain) {
		t.Fatalf("presence penalty 2: %d distinct tokens, without %d\n%v\n%v", distinct(presence), distinct(plain), presence, plain)
	}
	if mostRepeated(frequency) >= mostRepeated(plain) {
		t.Fatalf("frequency penalty 2: a token repeats %d times, without %d\n%v\n%v", mostRepeated(frequency), mostRepeated(plain), frequency, plain)
	}
	// The prompt is not penalised: the first token comes from the prompt's
	// logits alone.
	if presence[0] != plain[0] || frequency[0] != plain[0] {
		t.Fatalf("first tokens %d %d %d: the penalties must only count generated tokens", plain[0], presence[0], frequency[0])
	}
}

func distinct(toks []int) int {
	seen := map[int]bool{}
	for _, t := range toks {
		seen[t] = true
	}
	return len(seen)
}

func mostRepeated(toks []int) int {
	n := map[int]int{}
	m := 0
	for _, t := range toks {
		n[t]++
		m = max(m, n[t])
	}
	return m
}
