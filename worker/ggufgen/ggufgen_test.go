package ggufgen_test

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ollama/ollama/fs/ggml"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

func TestSameSeedSameBytes(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, seed uint64) []byte {
		t.Helper()
		path := filepath.Join(dir, name)
		if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: ggufgen.Tiny(), Seed: seed}); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	a, b, c := write("a.gguf", 7), write("b.gguf", 7), write("c.gguf", 8)
	if !bytes.Equal(a, b) {
		t.Fatal("same preset and seed gave different files")
	}
	if len(a) != len(c) || bytes.Equal(a, c) {
		t.Fatalf("a different seed must change the weights only: sizes %d and %d, equal=%v", len(a), len(c), bytes.Equal(a, c))
	}
	if !bytes.HasPrefix(a, []byte("GGUF")) {
		t.Fatalf("no GGUF magic: %q", a[:4])
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 3 {
		t.Errorf("temporary files left behind: %v", entries)
	}
}

func TestMetadataAndTensors(t *testing.T) {
	p := ggufgen.Tiny()
	path := filepath.Join(t.TempDir(), "m.gguf")
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: p, Seed: 3}); err != nil {
		t.Fatal(err)
	}
	checkMetadata(t, p, path)
}

func checkMetadata(t *testing.T, p ggufgen.Preset, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g, err := ggml.Decode(f, -1)
	if err != nil {
		t.Fatal(err)
	}
	kv := g.KV()
	if kv.Architecture() != "llama" {
		t.Errorf("architecture %q", kv.Architecture())
	}
	if got := kv.ContextLength(); got != uint64(p.ContextLength) || got < 8192 {
		t.Errorf("context_length %d, want %d (>= 8192)", got, p.ContextLength)
	}
	if kv.ChatTemplate() != ggufgen.ChatMLTemplate {
		t.Errorf("chat template %q", kv.ChatTemplate())
	}
	if got := kv.Uint("tokenizer.ggml.eos_token_id"); got != ggufgen.TokenIMEnd {
		t.Errorf("eos %d, want <|im_end|> %d", got, ggufgen.TokenIMEnd)
	}
	tokens := kv.Strings("tokenizer.ggml.tokens")
	if len(tokens) != ggufgen.VocabSize || tokens[ggufgen.TokenByte0+0x41] != "<0x41>" || tokens[ggufgen.TokenIMStart] != "<|im_start|>" {
		t.Errorf("vocab: %d tokens, byte 0x41 = %q, im_start = %q", len(tokens), tokens[ggufgen.TokenByte0+0x41], tokens[ggufgen.TokenIMStart])
	}
	ts := g.Tensors().Items()
	if want := 3 + 9*p.Layers; len(ts) != want {
		t.Fatalf("%d tensors, want %d", len(ts), want)
	}
	var params uint64
	for _, tn := range ts {
		params += tn.Elements()
	}
	headDim := p.Embed / p.Heads
	want := uint64(2*p.Embed*ggufgen.VocabSize + p.Embed +
		p.Layers*(2*p.Embed+2*p.Embed*p.Embed+2*p.Embed*headDim*p.KVHeads+3*p.Embed*p.FFN))
	if params != want {
		t.Errorf("%d parameters, want %d", params, want)
	}
}

func TestTensorValuesMatchFile(t *testing.T) {
	p := ggufgen.Tiny()
	path := filepath.Join(t.TempDir(), "m.gguf")
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: p, Seed: 11}); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"output.weight", "blk.1.ffn_down.weight", "output_norm.weight"} {
		vals, _, err := ggufgen.TensorValues(p, 11, name)
		if err != nil {
			t.Fatal(err)
		}
		var enc bytes.Buffer
		for _, v := range vals {
			u := math.Float32bits(v)
			enc.Write([]byte{byte(u), byte(u >> 8), byte(u >> 16), byte(u >> 24)})
		}
		if !bytes.Contains(raw, enc.Bytes()) {
			t.Errorf("%s: the file does not hold the values TensorValues returns", name)
		}
		var sum, sq float64
		for _, v := range vals {
			sum += float64(v)
			sq += float64(v) * float64(v)
		}
		t.Logf("%s: %d values, mean %.4f rms %.4f", name, len(vals), sum/float64(len(vals)), math.Sqrt(sq/float64(len(vals))))
	}
	if _, _, err := ggufgen.TensorValues(p, 11, "blk.9.attn_q.weight"); err == nil {
		t.Error("no error for a tensor the tiny preset does not have")
	}
}

func TestProgress(t *testing.T) {
	var calls []ggufgen.Progress
	path := filepath.Join(t.TempDir(), "m.gguf")
	err := ggufgen.WriteFile(path, ggufgen.Options{Preset: ggufgen.Tiny(), Seed: 1, Progress: func(p ggufgen.Progress) {
		calls = append(calls, p) // never called concurrently: -race checks it
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) < 2 {
		t.Fatalf("%d progress calls", len(calls))
	}
	for i := 1; i < len(calls); i++ {
		if calls[i].Done <= calls[i-1].Done || calls[i].Total != calls[0].Total {
			t.Fatalf("progress not increasing at %d: %+v then %+v", i, calls[i-1], calls[i])
		}
	}
	last := calls[len(calls)-1]
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if last.Done != last.Total || last.Total >= st.Size() || last.Total < st.Size()*9/10 {
		t.Errorf("final progress %+v for a %d-byte file", last, st.Size())
	}
}

func TestPresetValidation(t *testing.T) {
	for _, name := range ggufgen.PresetNames() {
		p, err := ggufgen.PresetByName(name)
		if err != nil || p.Validate() != nil {
			t.Errorf("preset %q: %v %v", name, err, p.Validate())
		}
	}
	if _, err := ggufgen.PresetByName("huge"); err == nil || !strings.Contains(err.Error(), "huge") {
		t.Errorf("unknown preset: %v", err)
	}
	bad := []func(*ggufgen.Preset){
		func(p *ggufgen.Preset) { p.Layers = 0 },
		func(p *ggufgen.Preset) { p.Heads = 3 },
		func(p *ggufgen.Preset) { p.KVHeads = 3 },
		func(p *ggufgen.Preset) { p.ContextLength = 0 },
		func(p *ggufgen.Preset) { p.Weights = 9 },
		func(p *ggufgen.Preset) { p.NormEps = 0 },
		func(p *ggufgen.Preset) { p.Embed, p.Heads, p.KVHeads = 12, 4, 4 }, // odd head size
	}
	for i, mutate := range bad {
		p := ggufgen.Tiny()
		mutate(&p)
		if err := p.Validate(); err == nil {
			t.Errorf("case %d: %+v accepted", i, p)
		}
		if err := ggufgen.WriteFile(filepath.Join(t.TempDir(), "x.gguf"), ggufgen.Options{Preset: p}); err == nil {
			t.Errorf("case %d: WriteFile accepted an invalid preset", i)
		}
	}
	a, b := ggufgen.Tiny(), ggufgen.Tiny()
	b.FFN++
	if a.ID(1) == b.ID(1) || a.ID(1) == a.ID(2) || a.ID(1) != ggufgen.Tiny().ID(1) {
		t.Errorf("IDs must follow shape and seed: %s %s %s", a.ID(1), b.ID(1), a.ID(2))
	}
}
