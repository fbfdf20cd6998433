// Package ggufgen writes deterministic random-weights llama GGUF models with a
// byte-level vocabulary, so tests, benchmarks and the local stack run real
// llama.cpp compute without downloading a model.
//
// The file is produced by ollama's pure-Go GGUF writer (fs/ggml.WriteGGUF).
// Every tensor draws from its own PCG stream keyed by (seed, tensor name),
// so the bytes do not depend on the order in which the writer's goroutines
// run: the same preset and seed always give a byte-identical file.
package ggufgen

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"

	"github.com/ollama/ollama/fs/ggml"
	"github.com/x448/float16"
)

// FormatVersion changes whenever the generator would write different bytes
// for the same preset and seed; caches keyed by ID are invalidated with it.
const FormatVersion = 1

// DefaultSeed is the seed mkmodel and testmodel use unless told otherwise.
const DefaultSeed uint64 = 42

// WeightType is the storage type of the weight matrices (norms are always F32,
// as llama.cpp expects).
type WeightType int

const (
	F32 WeightType = iota
	F16
)

func (w WeightType) String() string {
	switch w {
	case F32:
		return "F32"
	case F16:
		return "F16"
	}
	return fmt.Sprintf("WeightType(%d)", int(w))
}

// Preset is the shape of a generated model.
type Preset struct {
	Name          string
	Layers        int
	Embed         int // n_embd
	FFN           int // feed_forward_length
	Heads         int
	KVHeads       int // < Heads gives grouped-query attention, as most current models use
	ContextLength int // llama.context_length, the n_ctx_train llama.cpp reports
	Weights       WeightType
	RopeBase      float32
	NormEps       float32
	// LogitScale is the standard deviation of the logits for a normalised
	// hidden state. Large enough that the top two logits are rarely within
	// float noise of each other, so greedy decoding is stable across batch
	// shapes and KV-cache reuse.
	LogitScale float64
}

// Tiny is the CI model: two layers, 128 wide, a context of 8192.
func Tiny() Preset {
	return Preset{
		Name: "tiny", Layers: 2, Embed: 128, FFN: 384, Heads: 4, KVHeads: 2,
		ContextLength: 8192, Weights: F32, RopeBase: 10000, NormEps: 1e-5, LogitScale: 3,
	}
}

// Bench is the benchmark model (8 layers, 512 wide): big enough
// that prefill dominates and cache reuse shows, small enough for 2 cores.
func Bench() Preset {
	return Preset{
		Name: "bench", Layers: 8, Embed: 512, FFN: 1536, Heads: 8, KVHeads: 4,
		ContextLength: 16384, Weights: F16, RopeBase: 10000, NormEps: 1e-5, LogitScale: 3,
	}
}

// PresetNames lists the names PresetByName accepts.
func PresetNames() []string { return []string{"tiny", "bench"} }

// PresetByName returns a named preset.
func PresetByName(name string) (Preset, error) {
	switch name {
	case "tiny":
		return Tiny(), nil
	case "bench":
		return Bench(), nil
	}
	return Preset{}, fmt.Errorf("ggufgen: unknown preset %q (want one of %v)", name, PresetNames())
}

// Validate reports shapes llama.cpp would reject or that make no sense.
func (p Preset) Validate() error {
	switch {
	case p.Layers < 1:
		return fmt.Errorf("ggufgen: preset %q: layers %d < 1", p.Name, p.Layers)
	case p.Embed < 1 || p.FFN < 1:
		return fmt.Errorf("ggufgen: preset %q: embed %d and ffn %d must be positive", p.Name, p.Embed, p.FFN)
	case p.Heads < 1 || p.KVHeads < 1 || p.Embed%p.Heads != 0 || p.Heads%p.KVHeads != 0:
		return fmt.Errorf("ggufgen: preset %q: embed %d, heads %d, kv heads %d must divide evenly", p.Name, p.Embed, p.Heads, p.KVHeads)
	case (p.Embed/p.Heads)%2 != 0:
		return fmt.Errorf("ggufgen: preset %q: head size %d must be even for RoPE", p.Name, p.Embed/p.Heads)
	case p.ContextLength < 1:
		return fmt.Errorf("ggufgen: preset %q: context length %d < 1", p.Name, p.ContextLength)
	case p.Weights != F32 && p.Weights != F16:
		return fmt.Errorf("ggufgen: preset %q: unsupported weight type %v", p.Name, p.Weights)
	case !(p.RopeBase > 0) || !(p.NormEps > 0) || !(p.LogitScale > 0):
		return fmt.Errorf("ggufgen: preset %q: rope base, norm eps and logit scale must be positive", p.Name)
	}
	return nil
}

// ID names the file a preset and seed produce, e.g. "tiny-v1-s42-1a2b3c4d":
// any change to the shape, the seed or the generator changes it, so it can
// key an on-disk cache.
func (p Preset) ID(seed uint64) string {
	h := fnv.New32a()
	fmt.Fprintf(h, "%d|%+v|%d", FormatVersion, p, seed)
	return fmt.Sprintf("%s-v%d-s%d-%08x", p.Name, FormatVersion, seed, h.Sum32())
}

// Progress reports how many bytes of tensor data have been written.
type Progress struct {
	Done, Total int64
}

// Options configure one generation.
type Options struct {
	Preset Preset
	Seed   uint64
	// ChatTemplate is the Jinja text stored as tokenizer.chat_template;
	// "" stores ChatMLTemplate. The tokens a template writes must be in
	// the byte-level vocabulary (<|im_start|> and <|im_end|> are).
	ChatTemplate string
	// Progress, if set, is called after each chunk of tensor data, never
	// concurrently, with Done increasing up to Total.
	Progress func(Progress)
}

// tensorSpec describes one tensor and how to fill it.
type tensorSpec struct {
	name  string
	shape []uint64 // ggml order: shape[0] is the row length
	kind  WeightType
	std   float64 // normal(0, std) entries; 0 means every entry is one (RMS norm weights)
}

func (s tensorSpec) elements() uint64 {
	n := uint64(1)
	for _, d := range s.shape {
		n *= d
	}
	return n
}

func (s tensorSpec) bytesPerElement() int64 {
	if s.kind == F16 {
		return 2
	}
	return 4
}

// tensors lists the llama architecture's tensors in llama.cpp's naming and
// shapes (llama-model.cpp, LLM_ARCH_LLAMA). Matrices are initialised with
// std 1/sqrt(fan_in) so every projection keeps activations near unit scale;
// the output head is scaled for LogitScale.
func (p Preset) tensors() []tensorSpec {
	headDim := p.Embed / p.Heads
	kvDim := headDim * p.KVHeads
	e, f, v := uint64(p.Embed), uint64(p.FFN), uint64(VocabSize)
	inv := func(fanIn int) float64 { return 1 / math.Sqrt(float64(fanIn)) }
	ts := []tensorSpec{
		{name: "token_embd.weight", shape: []uint64{e, v}, kind: p.Weights, std: 1},
		{name: "output_norm.weight", shape: []uint64{e}, kind: F32},
		{name: "output.weight", shape: []uint64{e, v}, kind: p.Weights, std: p.LogitScale * inv(p.Embed)},
	}
	for i := range p.Layers {
		blk := func(n string) string { return fmt.Sprintf("blk.%d.%s.weight", i, n) }
		ts = append(ts,
			tensorSpec{name: blk("attn_norm"), shape: []uint64{e}, kind: F32},
			tensorSpec{name: blk("attn_q"), shape: []uint64{e, e}, kind: p.Weights, std: inv(p.Embed)},
			tensorSpec{name: blk("attn_k"), shape: []uint64{e, uint64(kvDim)}, kind: p.Weights, std: inv(p.Embed)},
			tensorSpec{name: blk("attn_v"), shape: []uint64{e, uint64(kvDim)}, kind: p.Weights, std: inv(p.Embed)},
			tensorSpec{name: blk("attn_output"), shape: []uint64{e, e}, kind: p.Weights, std: inv(p.Embed)},
			tensorSpec{name: blk("ffn_norm"), shape: []uint64{e}, kind: F32},
			tensorSpec{name: blk("ffn_gate"), shape: []uint64{e, f}, kind: p.Weights, std: inv(p.Embed)},
			tensorSpec{name: blk("ffn_up"), shape: []uint64{e, f}, kind: p.Weights, std: inv(p.Embed)},
			tensorSpec{name: blk("ffn_down"), shape: []uint64{f, e}, kind: p.Weights, std: inv(p.FFN)},
		)
	}
	return ts
}

// values is the deterministic element stream of one tensor.
type values struct {
	spec tensorSpec
	rng  *rand.Rand
}

func newValues(spec tensorSpec, seed uint64) *values {
	h := fnv.New64a()
	h.Write([]byte(spec.name))
	return &values{spec: spec, rng: rand.New(rand.NewPCG(seed, h.Sum64()))}
}

// next returns the next element exactly as stored (F16 entries rounded).
func (v *values) next() float32 {
	x := float32(1)
	if v.spec.std > 0 {
		x = float32(v.rng.NormFloat64() * v.spec.std)
	}
	if v.spec.kind == F16 {
		x = float16.Fromfloat32(x).Float32()
	}
	return x
}

// TensorValues returns the elements of one tensor of the model a preset and
// seed produce, as stored in the file, with its ggml shape. Tests use it to
// compute reference results independently of llama.cpp.
func TensorValues(p Preset, seed uint64, name string) ([]float32, []uint64, error) {
	for _, s := range p.tensors() {
		if s.name == name {
			v := newValues(s, seed)
			out := make([]float32, s.elements())
			for i := range out {
				out[i] = v.next()
			}
			return out, s.shape, nil
		}
	}
	return nil, nil, fmt.Errorf("ggufgen: preset %q has no tensor %q", p.Name, name)
}

// progress serialises callbacks from the writer's concurrent tensor writers.
type progress struct {
	mu    sync.Mutex
	done  int64
	total int64
	fn    func(Progress)
}

func (p *progress) add(n int64) {
	if p.fn == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done += n
	p.fn(Progress{Done: p.done, Total: p.total})
}

// tensorWriter streams one tensor's bytes in chunks so the bench preset never
// holds a whole matrix twice in memory.
type tensorWriter struct {
	spec     tensorSpec
	seed     uint64
	progress *progress
}

const chunkElements = 1 << 16

func (w tensorWriter) WriteTo(dst io.Writer) (int64, error) {
	v := newValues(w.spec, w.seed)
	size := w.spec.bytesPerElement()
	buf := make([]byte, 0, chunkElements*size)
	var written int64
	for remaining := w.spec.elements(); remaining > 0; {
		n := min(remaining, chunkElements)
		buf = buf[:0]
		for range n {
			x := v.next()
			if w.spec.kind == F16 {
				buf = binary.LittleEndian.AppendUint16(buf, float16.Fromfloat32(x).Bits())
			} else {
				buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(x))
			}
		}
		m, err := dst.Write(buf)
		written += int64(m)
		if err != nil {
			return written, err
		}
		w.progress.add(int64(m))
		remaining -= n
	}
	return written, nil
}

// kv is the GGUF metadata: llama hyper-parameters under "llama.", the
// byte-level SentencePiece vocabulary and the ChatML template.
func (p Preset) kv() ggml.KV {
	tokens, types := Vocab()
	scores := make([]float32, VocabSize)
	fileType := ggml.FileTypeF32
	if p.Weights == F16 {
		fileType = ggml.FileTypeF16
	}
	return ggml.KV{
		"general.architecture": "llama",
		"general.name":         "istio-llm-filter " + p.Name,
		"general.file_type":    fileType,
		"general.alignment":    uint32(32),

		"llama.context_length":                   uint32(p.ContextLength),
		"llama.embedding_length":                 uint32(p.Embed),
		"llama.block_count":                      uint32(p.Layers),
		"llama.feed_forward_length":              uint32(p.FFN),
		"llama.attention.head_count":             uint32(p.Heads),
		"llama.attention.head_count_kv":          uint32(p.KVHeads),
		"llama.attention.layer_norm_rms_epsilon": p.NormEps,
		"llama.rope.dimension_count":             uint32(p.Embed / p.Heads),
		"llama.rope.freq_base":                   p.RopeBase,
		"llama.vocab_size":                       uint32(VocabSize),

		"tokenizer.ggml.model":            "llama",
		"tokenizer.ggml.tokens":           tokens,
		"tokenizer.ggml.scores":           scores,
		"tokenizer.ggml.token_type":       types,
		"tokenizer.ggml.bos_token_id":     uint32(TokenBOS),
		"tokenizer.ggml.eos_token_id":     uint32(TokenIMEnd),
		"tokenizer.ggml.eot_token_id":     uint32(TokenIMEnd),
		"tokenizer.ggml.unknown_token_id": uint32(TokenUnk),
		"tokenizer.ggml.padding_token_id": uint32(TokenUnk),
		// ChatML prompts carry no BOS, and an exact text round trip needs
		// no SentencePiece leading space.
		"tokenizer.ggml.add_bos_token":    false,
		"tokenizer.ggml.add_eos_token":    false,
		"tokenizer.ggml.add_space_prefix": false,
		"tokenizer.chat_template":         ChatMLTemplate,
	}
}

// Write writes the model to f, which must be empty and positioned at 0.
func Write(f *os.File, o Options) error {
	if err := o.Preset.Validate(); err != nil {
		return err
	}
	kv := o.Preset.kv()
	if o.ChatTemplate != "" {
		kv["tokenizer.chat_template"] = o.ChatTemplate
	}
	return writeGGUF(f, kv, o.Preset.tensors(), o.Seed, o.Progress)
}

func writeGGUF(f *os.File, kv ggml.KV, specs []tensorSpec, seed uint64, fn func(Progress)) error {
	prog := &progress{fn: fn}
	ts := make([]*ggml.Tensor, len(specs))
	for i, s := range specs {
		prog.total += int64(s.elements()) * s.bytesPerElement()
		kind := uint32(ggml.TensorTypeF32)
		if s.kind == F16 {
			kind = uint32(ggml.TensorTypeF16)
		}
		ts[i] = &ggml.Tensor{Name: s.name, Kind: kind, Shape: s.shape,
			WriterTo: tensorWriter{spec: s, seed: seed, progress: prog}}
	}
	if err := ggml.WriteGGUF(f, kv, ts); err != nil {
		return fmt.Errorf("ggufgen: write %s: %w", f.Name(), err)
	}
	return nil
}

// WriteFile writes the model to path atomically: readers see either no file
// or the complete one, even when several processes generate it at once.
func WriteFile(path string, o Options) error {
	if err := o.Preset.Validate(); err != nil {
		return err
	}
	return writeAtomic(path, func(f *os.File) error { return Write(f, o) })
}

func writeAtomic(path string, write func(*os.File) error) (err error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("ggufgen: %w", err)
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if err := write(tmp); err != nil {
		return err
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("ggufgen: %w", err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		return fmt.Errorf("ggufgen: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("ggufgen: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("ggufgen: %w", err)
	}
	return nil
}
