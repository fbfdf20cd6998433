// Package llama is the engine over llama.cpp, through the cgo bindings of
// github.com/ollama/ollama/llama (v0.11.4: one unified KV stream in which
// KvCacheSeqCp shares cells between seq ids).
//
// Build with the host's vector instructions (the CGO_CFLAGS/CGO_CXXFLAGS the
// Makefile exports and scripts/cgo-env.sh sets): the package's own flags are
// plain -O3 and prefill is ~20x slower without.
package llama

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"

	"github.com/ollama/ollama/fs/ggml"
	ll "github.com/ollama/ollama/llama"

	"github.com/istio-llm-filter/istio-llm-filter/worker/cpus"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

// Config opens a model.
type Config struct {
	ModelPath string
	Name      string // reported model name; default: file name without extension
	NCtx      int    // KV cells; 0 = the model's training context
	NBatch    int    // most tokens per Step; 0 = 512
	NSeqMax   int    // seq ids; 1..256
	Threads   int    // 0 = the CPUs this process may use (worker/cpus)
	// KVCacheType is "f16" (default), "q8_0" or "q4_0".
	KVCacheType string
	// FlashAttention selects llama.cpp's fused attention kernel: slower
	// than the plain one on an uncrowded cache, faster on a crowded one.
	FlashAttention bool
	// NoPark keeps idle sequences' cells in the KV cache instead of
	// parking them in host memory (park.go).
	NoPark bool
	// ParkMaxBytes bounds the host memory of parked sequences (park.go);
	// 0 = the KV cache's own size, n_ctx × bytes per token. The Owner
	// evicts idle parked entries to stay under it (kvcache.ParkBudget).
	ParkMaxBytes int64
	// NoCompact leaves the holes that removed cells (a parked, finished or
	// cut sequence) leave below other sequences' cells (park.go, compact).
	// Only with parking.
	NoCompact bool
	// LoRA adapters applied to the whole context: every sequence this
	// engine computes runs with them (an adapter pod serves one adapter set).
	LoRA []LoRA
}

// LoRA is one adapter file and the scale llama.cpp applies it with.
type LoRA struct {
	Name  string
	Path  string
	Scale float32 // 0 = 1
}

// Engine owns one llama.cpp model and context.
type Engine struct {
	info  engine.Info
	model *ll.Model
	lc    *ll.Context
	batch *ll.Batch
	vocab int

	raw rawCtx // lc's llama_context, for the calls the binding does not wrap
	// Parking (park.go); parked is nil when it is off.
	parked      map[int]*parked
	restored    map[int]restoredFrom
	kin         map[int]map[int]int // seq → seqs sharing its first n cells, copied in the cache
	lost        map[int]bool
	scratch     int // a seq id the pool never gives out (park.go)
	parkedBytes atomic.Int64
	parkLimit   int64
	compact     bool // compact after removals (Config.NoCompact off)
	holes       bool // cells were removed since the last compaction
}

// Meta is what the GGUF header says about a model, read in pure Go before
// llama.cpp is involved.
type Meta struct {
	Arch          string
	NCtxTrain     int
	BytesPerToken int64 // f16 K and V over all layers
	ChatTemplate  string
}

// ReadMeta decodes the GGUF header of path.
func ReadMeta(path string) (Meta, error) {
	f, err := os.Open(path)
	if err != nil {
		return Meta{}, err
	}
	defer f.Close()
	g, err := ggml.Decode(f, 0)
	if err != nil {
		return Meta{}, fmt.Errorf("%s: not a GGUF model: %w", path, err)
	}
	kv := g.KV()
	layers := int64(kv.BlockCount())
	kvHeads := int64(kv.HeadCountKVMax())
	perTok := layers * kvHeads * int64(kv.EmbeddingHeadCountK()+kv.EmbeddingHeadCountV()) * 2
	return Meta{
		Arch:          kv.Architecture(),
		NCtxTrain:     int(kv.ContextLength()),
		BytesPerToken: perTok,
		ChatTemplate:  kv.ChatTemplate(),
	}, nil
}

// Open loads the model and builds the context.
func Open(cfg Config) (*Engine, error) {
	if cfg.ModelPath == "" {
		return nil, errors.New("llama: no model path")
	}
	meta, err := ReadMeta(cfg.ModelPath)
	if err != nil {
		return nil, err
	}
	if cfg.NSeqMax < 1 || cfg.NSeqMax > 256 {
		return nil, fmt.Errorf("llama: n_seq_max must be within 1..256, got %d", cfg.NSeqMax)
	}
	if cfg.NCtx <= 0 {
		cfg.NCtx = meta.NCtxTrain
	}
	if cfg.NCtx <= 0 {
		return nil, fmt.Errorf("llama: %s has no context_length; pass --n-ctx", cfg.ModelPath)
	}
	if cfg.NBatch <= 0 {
		cfg.NBatch = 512
	}
	if cfg.Threads <= 0 {
		// The CPUs the affinity and the cgroup quota really give this
		// process, not the node's: ggml's threads meet at a barrier after
		// every op, and a thread the kernel throttles or deschedules stalls
		// them all.
		cfg.Threads = cpus.Threads()
	}
	if cfg.Name == "" {
		cfg.Name = strings.TrimSuffix(filepath.Base(cfg.ModelPath), filepath.Ext(cfg.ModelPath))
	}
	bytesPerTok := meta.BytesPerToken
	switch strings.ToLower(cfg.KVCacheType) {
	case "", "f16":
	case "q8_0":
		bytesPerTok = bytesPerTok * 34 / 64 // 34 bytes per block of 32 vs 64 in f16
	case "q4_0":
		bytesPerTok = bytesPerTok * 18 / 64
	default:
		return nil, fmt.Errorf("llama: kv cache type %q: want f16, q8_0 or q4_0", cfg.KVCacheType)
	}

	ll.BackendInit()
	model, err := ll.LoadModelFromFile(cfg.ModelPath, ll.ModelParams{UseMmap: true})
	if err != nil {
		return nil, err
	}
	// n_ubatch defaults to n_batch here, so a batch is one ubatch and a
	// failed KV slot search leaves the cache untouched (llama_decode's
	// kv guard restores it).
	nSeq := cfg.NSeqMax
	if !cfg.NoPark {
		nSeq++ // the scratch sequence parking uses (park.go)
	}
	lc, err := ll.NewContextWithModel(model, ll.NewContextParams(cfg.NCtx, cfg.NBatch, nSeq, cfg.Threads, cfg.FlashAttention, cfg.KVCacheType))
	if err != nil {
		ll.FreeModel(model)
		return nil, err
	}
	for _, a := range cfg.LoRA {
		scale := a.Scale
		if scale == 0 {
			scale = 1
		}
		// llama.cpp checks the adapter's architecture and tensor shapes
		// against the model, so a wrong base model fails here, at start.
		if err := model.ApplyLoraFromFile(lc, a.Path, scale, cfg.Threads); err != nil {
			ll.FreeModel(model)
			return nil, fmt.Errorf("llama: lora %q (%s): %w", a.Name, a.Path, err)
		}
	}
	batch, err := ll.NewBatch(cfg.NBatch, 1, 0)
	if err != nil {
		ll.FreeModel(model)
		return nil, err
	}
	e := &Engine{model: model, lc: lc, batch: batch, vocab: model.NumVocab()}
	if e.raw, err = checkedContext(lc, cfg.NCtx, nSeq); err != nil {
		e.Close()
		return nil, err
	}
	if !cfg.NoPark {
		e.initPark(cfg.NSeqMax)
		e.compact = !cfg.NoCompact
		e.parkLimit = cfg.ParkMaxBytes
		if e.parkLimit <= 0 {
			e.parkLimit = int64(cfg.NCtx) * bytesPerTok
		}
	}
	e.info = engine.Info{
		Name:          cfg.Name,
		NCtx:          cfg.NCtx,
		NCtxTrain:     meta.NCtxTrain,
		NBatch:        cfg.NBatch,
		NSeqMax:       cfg.NSeqMax,
		NVocab:        e.vocab,
		BytesPerToken: bytesPerTok,
		ChatTemplate:  meta.ChatTemplate,
	}
	return e, nil
}

// Info implements engine.Engine.
func (e *Engine) Info() engine.Info { return e.info }

// Tokenize implements engine.Engine.
func (e *Engine) Tokenize(text string, addSpecial bool) ([]int, error) {
	if text == "" {
		// The binding indexes the token buffer, which an empty text with
		// no BOS would leave empty.
		return nil, nil
	}
	return e.model.Tokenize(text, addSpecial, true)
}

// Piece implements engine.Engine.
func (e *Engine) Piece(tok int) string { return e.model.TokenToPiece(tok) }

// IsEOG implements engine.Engine.
func (e *Engine) IsEOG(tok int) bool { return e.model.TokenIsEog(tok) }

// Step implements engine.Engine.
func (e *Engine) Step(spans []engine.Span) ([]int, error) {
	n := 0
	for _, s := range spans {
		n += len(s.Tokens)
	}
	if n == 0 {
		return nil, errors.New("llama: empty batch")
	}
	if n > e.info.NBatch {
		return nil, fmt.Errorf("llama: batch of %d tokens exceeds n_batch %d", n, e.info.NBatch)
	}
	for _, s := range spans {
		if s.Seq < 0 || s.Seq >= e.info.NSeqMax {
			return nil, fmt.Errorf("llama: seq id %d outside 0..%d", s.Seq, e.info.NSeqMax-1)
		}
		if err := e.restore(s.Seq); err != nil {
			return nil, err
		}
	}
	e.compactCells()
	e.batch.Clear()
	last := make([]int, len(spans))
	for i, s := range spans {
		for j, t := range s.Tokens {
			// llama_decode throws (and aborts the process through cgo)
			// on an out-of-vocabulary token.
			if t < 0 || t >= e.vocab {
				return nil, fmt.Errorf("llama: token %d outside the vocabulary of %d", t, e.vocab)
			}
			e.batch.Add(t, nil, s.Pos+j, s.Sampler != nil && j == len(s.Tokens)-1, s.Seq)
		}
		last[i] = e.batch.NumTokens() - 1
	}
	if err := e.lc.Decode(e.batch); err != nil {
		if errors.Is(err, ll.ErrKvCacheFull) {
			return nil, engine.ErrKVFull
		}
		return nil, err
	}
	out := make([]int, len(spans))
	for i, s := range spans {
		out[i] = -1
		if s.Sampler == nil {
			continue
		}
		sm, ok := s.Sampler.(*sampler)
		if !ok {
			return nil, fmt.Errorf("llama: sampler %T is not this engine's", s.Sampler)
		}
		out[i] = e.sample(sm, last[i])
	}
	return out, nil
}

// Copy implements engine.Engine.
func (e *Engine) Copy(src, dst, from, to int) {
	if to <= from || src == dst {
		return
	}
	if e.parked[src] != nil || e.parked[dst] != nil || e.lost[dst] {
		e.copyParked(src, dst, from, to)
		return
	}
	if r, ok := e.restored[src]; ok && from == 0 {
		// dst's first cells are src's, and so the root's.
		e.restored[dst] = restoredFrom{root: r.root, n: min(r.n, to)}
	}
	e.lc.KvCacheSeqCp(src, dst, from, to)
	if e.parked != nil && (from == 0 || e.kin[src][dst] == from) {
		// A prefix copied, or the shared one extended (a follower taking
		// its leader's next cells).
		e.link(src, dst, to)
	}
}

// Remove implements engine.Engine.
func (e *Engine) Remove(seq, from int) {
	if e.removeParked(seq, from) {
		return
	}
	e.cutRecords(seq, from)
	e.lc.KvCacheSeqRm(seq, from, -1)
	e.holes = true
}

// Close frees the batch and the model. The context itself has no free
// function in the bindings; it goes with the process.
func (e *Engine) Close() error {
	if e.batch != nil {
		e.batch.Free()
		e.batch = nil
	}
	if e.model != nil {
		ll.FreeModel(e.model)
		e.model = nil
	}
	return nil
}
