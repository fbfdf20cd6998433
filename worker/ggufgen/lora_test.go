package ggufgen_test

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ollama/ollama/llama"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

// decodeGreedy prefills prompt and samples n tokens greedily; check, if
// set, sees every step before the next decode overwrites its outputs.
func decodeGreedy(t *testing.T, m *llama.Model, lc *llama.Context, prompt []int, n int, check func(step, idx, tok int)) []int {
	t.Helper()
	lc.KvCacheClear()
	sc, err := llama.NewSamplingContext(m, llama.SamplingParams{Temp: 0, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := llama.NewBatch(len(prompt), 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer batch.Free()
	for i, tok := range prompt {
		batch.Add(tok, nil, i, i == len(prompt)-1, 0)
	}
	if err := lc.Decode(batch); err != nil {
		t.Fatal(err)
	}
	idx := len(prompt) - 1
	var out []int
	for step := range n {
		tok := sc.Sample(lc, idx)
		sc.Accept(tok, false)
		if check != nil {
			check(step, idx, tok)
		}
		out = append(out, tok)
		batch.Clear()
		batch.Add(tok, nil, len(prompt)+step, true, 0)
		if err := lc.Decode(batch); err != nil {
			t.Fatal(err)
		}
		idx = 0
	}
	return out
}

// The generated adapter is one llama.cpp accepts for the tiny model and
// changes what the model says; an adapter made for another shape is refused.
func TestLoRAAdapterChangesOutput(t *testing.T) {
	p := ggufgen.Tiny()
	m := loadModel(t, generate(t, p))
	dir := t.TempDir()
	adapter := filepath.Join(dir, "tiny-lora.gguf")
	if err := ggufgen.WriteLoRAFile(adapter, ggufgen.LoRAOptions{Preset: p, Seed: 7}); err != nil {
		t.Fatal(err)
	}
	prompt, err := m.Tokenize("<|im_start|>user\nTell me about KV caches.<|im_end|>\n<|im_start|>assistant\n", false, true)
	if err != nil {
		t.Fatal(err)
	}
	base := decodeGreedy(t, m, newContext(t, m, 512, 512), prompt, 24, nil)

	withLoRA := newContext(t, m, 512, 512)
	if err := m.ApplyLoraFromFile(withLoRA, adapter, 1, 1); err != nil {
		t.Fatalf("llama.cpp refused the generated adapter: %v", err)
	}
	adapted := decodeGreedy(t, m, withLoRA, prompt, 24, nil)
	if slices.Equal(base, adapted) {
		t.Fatalf("the adapter did not change the greedy output: %q", detokenize(m, base))
	}
	// Deterministic: the same adapter gives the same output again.
	if again := decodeGreedy(t, m, withLoRA, prompt, 24, nil); !slices.Equal(again, adapted) {
		t.Fatalf("adapted output not reproducible: %v vs %v", again, adapted)
	}

	wrong := filepath.Join(dir, "bench-lora.gguf")
	if err := ggufgen.WriteLoRAFile(wrong, ggufgen.LoRAOptions{Preset: ggufgen.Bench(), Seed: 7}); err != nil {
		t.Fatal(err)
	}
	if err := m.ApplyLoraFromFile(newContext(t, m, 512, 512), wrong, 1, 1); err == nil {
		t.Fatal("an adapter for the bench shape was accepted by the tiny model")
	}
	if err := ggufgen.WriteLoRAFile(filepath.Join(dir, "x.gguf"), ggufgen.LoRAOptions{Preset: p, Rank: 100000}); err == nil || !strings.Contains(err.Error(), "rank") {
		t.Fatalf("absurd rank: %v", err)
	}
}
