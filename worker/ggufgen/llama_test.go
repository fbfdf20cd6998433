package ggufgen_test

import (
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ollama/ollama/llama"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

func TestMain(m *testing.M) {
	// ollama's llama package copies llama.cpp's log to stderr at the default
	// slog level; INFO is a page per model load.
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	os.Exit(m.Run())
}

// generate writes a preset into a temporary directory.
func generate(t *testing.T, p ggufgen.Preset) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), p.Name+".gguf")
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: p, Seed: ggufgen.DefaultSeed}); err != nil {
		t.Fatal(err)
	}
	return path
}

func loadModel(t testing.TB, path string) *llama.Model {
	t.Helper()
	llama.BackendInit()
	m, err := llama.LoadModelFromFile(path, llama.ModelParams{UseMmap: true})
	if err != nil {
		t.Fatalf("llama.cpp refused the generated model: %v", err)
	}
	t.Cleanup(func() { llama.FreeModel(m) })
	return m
}

func newContext(t testing.TB, m *llama.Model, nCtx, nBatch int) *llama.Context {
	t.Helper()
	// One thread: the machine is shared, and ggml's worker threads spin
	// while waiting, which makes them crawl when cores are contended.
	lc, err := llama.NewContextWithModel(m, llama.NewContextParams(nCtx, nBatch, 1, 1, false, ""))
	if err != nil {
		t.Fatal(err)
	}
	// ollama's llama package has no context free; the model outlives the test only.
	return lc
}

func detokenize(m *llama.Model, tokens []int) string {
	var b strings.Builder
	for _, tok := range tokens {
		b.WriteString(m.TokenToPiece(tok))
	}
	return b.String()
}

func TestLlamaTokenizerRoundTrip(t *testing.T) {
	m := loadModel(t, generate(t, ggufgen.Tiny()))
	if got := m.NumVocab(); got != ggufgen.VocabSize {
		t.Fatalf("llama.cpp sees %d tokens, want %d", got, ggufgen.VocabSize)
	}
	if m.AddBOSToken() {
		t.Error("model asks llama.cpp to add BOS; ChatML prompts must not get one")
	}
	texts := map[string]string{
		"ascii":   "Hello, world!  The quick brown fox\tjumps over\nthe lazy dog. ~`{}[]<>|\\",
		"leading": "  two leading spaces and a trailing one ",
		"cjk":     "你好，世界。KV 缓存复用：多轮对话的前缀。日本語のテキスト、한국어",
		"emoji":   "👍🏽 family 👨‍👩‍👧 rocket 🚀 flags 🇨🇳🇺🇸",
		// Not NUL: ollama's TokenToPiece trims NUL bytes from every piece.
		"controls": "\x01\x1b[0m\x7f end",
	}
	for name, text := range texts {
		t.Run(name, func(t *testing.T) {
			for _, addSpecial := range []bool{false, true} {
				tokens, err := m.Tokenize(text, addSpecial, true)
				if err != nil {
					t.Fatal(err)
				}
				// Byte-level: one token per byte, a space being the "▁" token.
				if len(tokens) != len(text) {
					t.Errorf("addSpecial=%v: %d tokens for %d bytes: %v", addSpecial, len(tokens), len(text), tokens)
				}
				if got := detokenize(m, tokens); got != text {
					t.Errorf("addSpecial=%v: round trip\n got %q\nwant %q", addSpecial, got, text)
				}
			}
		})
	}
}

func TestLlamaChatMLMarkersAreSingleTokens(t *testing.T) {
	m := loadModel(t, generate(t, ggufgen.Tiny()))
	prompt := "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
	tokens, err := m.Tokenize(prompt, true, true)
	if err != nil {
		t.Fatal(err)
	}
	var starts, ends int
	for _, tok := range tokens {
		switch tok {
		case ggufgen.TokenIMStart:
			starts++
		case ggufgen.TokenIMEnd:
			ends++
		}
	}
	if starts != 3 || ends != 2 {
		t.Errorf("got %d <|im_start|> and %d <|im_end|> tokens, want 3 and 2: %v", starts, ends, tokens)
	}
	if tokens[0] != ggufgen.TokenIMStart {
		t.Errorf("first token %d, want <|im_start|> (%d) with no BOS before it", tokens[0], ggufgen.TokenIMStart)
	}
	if got := detokenize(m, tokens); got != prompt {
		t.Errorf("round trip\n got %q\nwant %q", got, prompt)
	}
	// Without parse_special the markers are user text: bytes, never control tokens.
	plain, err := m.Tokenize(prompt, false, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(plain) != len(prompt) {
		t.Errorf("parse_special=false: %d tokens for %d bytes", len(plain), len(prompt))
	}
	for _, tok := range plain {
		if tok == ggufgen.TokenIMStart || tok == ggufgen.TokenIMEnd {
			t.Fatalf("parse_special=false produced control token %d", tok)
		}
	}
	if !m.TokenIsEog(ggufgen.TokenIMEnd) {
		t.Error("<|im_end|> is not end-of-generation")
	}
	for _, tok := range []int{ggufgen.TokenIMStart, ggufgen.TokenBOS, ggufgen.TokenSpace, ggufgen.TokenByte0 + 'a'} {
		if m.TokenIsEog(tok) {
			t.Errorf("token %d (%q) is end-of-generation", tok, m.TokenToPiece(tok))
		}
	}
}

// TestLlamaContextFromModel fills a context sized by the model's own
// n_ctx_train (n_ctx 0) with 8192 tokens: it fails with ErrKvCacheFull if
// llama.cpp read a smaller training context from the file.
func TestLlamaContextFromModel(t *testing.T) {
	if testing.Short() {
		t.Skip("prefills 8192 tokens")
	}
	m := loadModel(t, generate(t, ggufgen.Tiny()))
	const nBatch = 512
	lc := newContext(t, m, 0, nBatch)
	batch, err := llama.NewBatch(nBatch, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer batch.Free()
	const want = 8192
	for pos := 0; pos < want; pos += nBatch {
		batch.Clear()
		for i := range nBatch {
			batch.Add(ggufgen.TokenByte0+(pos+i)%256, nil, pos+i, pos+i == want-1, 0)
		}
		if err := lc.Decode(batch); err != nil {
			t.Fatalf("decoding positions %d..%d with the model's own context size: %v", pos, pos+nBatch-1, err)
		}
	}
	assertFinite(t, "hidden state at position 8191", lc.GetEmbeddingsIth(nBatch-1))
}

func assertFinite(t *testing.T, what string, xs []float32) {
	t.Helper()
	if len(xs) == 0 {
		t.Fatalf("%s: no values", what)
	}
	for i, x := range xs {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			t.Fatalf("%s: element %d is %v", what, i, x)
		}
	}
}

// greedy prefills prompt and decodes n tokens with llama.cpp's greedy
// sampler (temperature 0). For every step it recomputes the logits in Go from
// the final hidden state and the output matrix, checks they are finite, and
// that llama.cpp's pick is their argmax.
func greedy(t *testing.T, m *llama.Model, lc *llama.Context, outW []float32, prompt []int, n int, minGap *float64) []int {
	t.Helper()
	embed := m.NEmbd()
	return decodeGreedy(t, m, lc, prompt, n, func(step, idx, tok int) {
		hidden := lc.GetEmbeddingsIth(idx)
		assertFinite(t, "hidden state", hidden)
		logits := make([]float64, ggufgen.VocabSize)
		for v := range logits {
			row := outW[v*embed : (v+1)*embed]
			for j, h := range hidden {
				logits[v] += float64(h) * float64(row[j])
			}
		}
		assertFinite(t, "logits", toF32(logits))
		best, second := topTwo(logits)
		*minGap = min(*minGap, logits[best]-logits[second])
		// Only a near tie may legitimately differ between float32 in C and float64 here.
		if tok != best && logits[best]-logits[second] > 1e-3 {
			t.Fatalf("step %d: llama.cpp picked %d (logit %.4f), argmax is %d (logit %.4f)", step, tok, logits[tok], best, logits[best])
		}
	})
}

func toF32(xs []float64) []float32 {
	out := make([]float32, len(xs))
	for i, x := range xs {
		out[i] = float32(x)
	}
	return out
}

func topTwo(xs []float64) (best, second int) {
	best, second = 0, 1
	if xs[1] > xs[0] {
		best, second = 1, 0
	}
	for i := 2; i < len(xs); i++ {
		switch {
		case xs[i] > xs[best]:
			best, second = i, best
		case xs[i] > xs[second]:
			second = i
		}
	}
	return best, second
}

func TestLlamaGreedyDecode(t *testing.T) {
	p := ggufgen.Tiny()
	checkGreedy(t, p, generate(t, p))
}

// TestBenchPreset generates the 48 MiB bench model once and checks that
// llama.cpp runs it like the tiny one.
func TestBenchPreset(t *testing.T) {
	if testing.Short() {
		t.Skip("bench preset is 48 MiB")
	}
	p := ggufgen.Bench()
	path := generate(t, p)
	checkMetadata(t, p, path)
	checkGreedy(t, p, path)
}

func checkGreedy(t *testing.T, p ggufgen.Preset, path string) {
	m := loadModel(t, path)
	lc := newContext(t, m, 1024, 512)
	outW, shape, err := ggufgen.TensorValues(p, ggufgen.DefaultSeed, "output.weight")
	if err != nil {
		t.Fatal(err)
	}
	if int(shape[0]) != m.NEmbd() || int(shape[1]) != ggufgen.VocabSize {
		t.Fatalf("output.weight shape %v, model n_embd %d", shape, m.NEmbd())
	}
	prompt, err := m.Tokenize("<|im_start|>user\nWrite a haiku about caches.<|im_end|>\n<|im_start|>assistant\n", false, true)
	if err != nil {
		t.Fatal(err)
	}
	const n = 24
	minGap := math.Inf(1)
	first := greedy(t, m, lc, outW, prompt, n, &minGap)
	second := greedy(t, m, lc, outW, prompt, n, &minGap)
	if len(first) != n || !slices.Equal(first, second) {
		t.Fatalf("greedy decode is not reproducible:\n%v\n%v", first, second)
	}
	distinct := map[int]bool{}
	for _, tok := range first {
		distinct[tok] = true
	}
	// The smallest top-1/top-2 logit gap shows how far greedy decoding is
	// from a float-noise tie (LogitScale is chosen to keep it large).
	t.Logf("%s greedy tokens: %v (%d distinct, smallest top-2 logit gap %.3f) text %q",
		p.Name, first, len(distinct), minGap, detokenize(m, first))
}
