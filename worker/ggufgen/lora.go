package ggufgen

import (
	"fmt"
	"math"
	"os"

	"github.com/ollama/ollama/fs/ggml"
)

// LoRAOptions describe a generated LoRA adapter for a preset's model.
type LoRAOptions struct {
	Preset Preset
	// Seed draws the adapter's weights (independent of the base model's).
	Seed uint64
	Rank int // default 8
	// Alpha scales the update by Alpha/Rank, as llama.cpp applies it;
	// default 2*Rank.
	Alpha float32
}

func (o *LoRAOptions) defaults() error {
	if err := o.Preset.Validate(); err != nil {
		return err
	}
	if o.Rank == 0 {
		o.Rank = 8
	}
	if o.Alpha == 0 {
		o.Alpha = float32(2 * o.Rank)
	}
	if o.Rank < 1 || o.Rank > o.Preset.Embed {
		return fmt.Errorf("ggufgen: lora rank %d not in 1..%d", o.Rank, o.Preset.Embed)
	}
	return nil
}

// loraTensors adapts each layer's query and value projections and the
// output head, in llama.cpp's adapter layout (llama-adapter.cpp): for a
// model tensor of ggml shape [in, out], "<name>.lora_a" is [in, rank] and
// "<name>.lora_b" is [rank, out]. B is random rather than zero (as a freshly
// initialised adapter would be) so the adapter visibly changes the output.
func (o LoRAOptions) tensors() []tensorSpec {
	r := uint64(o.Rank)
	inv := func(n int) float64 { return 1 / math.Sqrt(float64(n)) }
	var out []tensorSpec
	for _, t := range o.Preset.tensors() {
		if len(t.shape) != 2 || t.name == "token_embd.weight" {
			continue
		}
		switch {
		case t.name == "output.weight", hasSuffix(t.name, ".attn_q.weight"), hasSuffix(t.name, ".attn_v.weight"):
		default:
			continue
		}
		in, outDim := t.shape[0], t.shape[1]
		// A x has unit-scale entries; B is scaled so that (Alpha/Rank)·B·A·x
		// is as large as the base projection W·x (std t.std·sqrt(in)).
		stdB := t.std * math.Sqrt(float64(in)) * math.Sqrt(float64(o.Rank)) / float64(o.Alpha)
		out = append(out,
			tensorSpec{name: t.name + ".lora_a", shape: []uint64{in, r}, kind: F32, std: inv(int(in))},
			tensorSpec{name: t.name + ".lora_b", shape: []uint64{r, outDim}, kind: F32, std: stdB},
		)
	}
	return out
}

func hasSuffix(s, suf string) bool { return len(s) >= len(suf) && s[len(s)-len(suf):] == suf }

func (o LoRAOptions) kv() ggml.KV {
	return ggml.KV{
		"general.architecture": "llama",
		"general.type":         "adapter",
		"general.name":         "istio-llm-filter " + o.Preset.Name + " lora",
		"general.alignment":    uint32(32),
		"adapter.type":         "lora",
		"adapter.lora.alpha":   o.Alpha,
	}
}

// WriteLoRAFile writes a deterministic LoRA adapter for the preset's model
// to path, atomically. llama.cpp checks its architecture and tensor shapes
// against the base model when it loads it.
func WriteLoRAFile(path string, o LoRAOptions) error {
	if err := o.defaults(); err != nil {
		return err
	}
	return writeAtomic(path, func(f *os.File) error {
		return writeGGUF(f, o.kv(), o.tensors(), o.Seed, nil)
	})
}
