// Package sim is an engine without compute: it keeps the KV-cell books of a
// unified llama.cpp cache exactly (shared prefixes, KV-full) and replaces the
// forward pass with a calibrated sleep, so fleets of 8+ workers with the real
// scheduler, seq-id pool and KV-cache manager fit on 2 cores.
//
// The cost of one Step is
//
//	StepOverhead + PerToken·(tokens in the batch) + PerSample·(sequences sampled)
//	             + PerKCtxToken·Σ(token · its context length)/1000
//
// The last term is attention: each evaluated token attends to every earlier
// cell of its sequence. docs/worker.md has the calibration against the
// llama.cpp engine on the bench model.
//
// The vocabulary mirrors worker/ggufgen's byte-level one (same ids), so
// token counts, cached_tokens and prompt hashes agree with a real worker on
// the generated models. Greedy output is a pure function of the previous
// token and its position, so it is identical with and without cache reuse,
// as it is on llama.cpp. The sampler never produces end-of-generation:
// outputs end by max_tokens, stop strings or the context.
package sim

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

// Token ids, as worker/ggufgen lays them out.
const (
	tokUnk     = 0
	tokBOS     = 1
	tokEOSText = 2
	tokByte0   = 3
	tokSpace   = 259
	tokIMStart = 260
	tokIMEnd   = 261
	vocabSize  = 262
)

var specials = []struct {
	text string
	id   int
}{{"<|im_start|>", tokIMStart}, {"<|im_end|>", tokIMEnd}, {"<s>", tokBOS}, {"</s>", tokEOSText}}

// Cost is the cost model of one Step.
type Cost struct {
	StepOverhead time.Duration
	PerToken     time.Duration
	PerSample    time.Duration
	PerKCtxToken time.Duration // per token per 1000 cells of context it attends to
}

// Step is the time of one step of tokens evaluated, sampled sequences
// sampled and attn = Σ(token · its context length) (the package comment's
// formula).
func (c Cost) Step(tokens, sampled int, attn int64) time.Duration {
	return c.StepOverhead + time.Duration(tokens)*c.PerToken + time.Duration(sampled)*c.PerSample +
		time.Duration(attn*int64(c.PerKCtxToken)/1000)
}

// BenchCost is the calibration against the llama.cpp engine with the bench
// preset (8 layers, 512 wide, f16, no flash attention, 1 thread) on this
// project's 2-core machine, fitted to BenchmarkStep of worker/engine/llama;
// docs/worker.md has the method and the raw numbers.
func BenchCost() Cost {
	return Cost{
		StepOverhead: 1600 * time.Microsecond,
		PerToken:     580 * time.Microsecond,
		PerSample:    600 * time.Microsecond,
		PerKCtxToken: 1100 * time.Microsecond,
	}
}

// Config shapes the simulated context.
type Config struct {
	Name    string
	NCtx    int // default 16384 (the bench preset's training context)
	NBatch  int // default 512
	NSeqMax int
	Cost    Cost
	// BytesPerToken is reported for memory accounting; default 8192, the
	// bench preset's f16 K+V per token.
	BytesPerToken int64
	// Sleep replaces time.Sleep (tests count the modelled time instead).
	Sleep func(time.Duration)
}

// Engine is the simulated engine.
type Engine struct {
	info  engine.Info
	cost  Cost
	sleep func(time.Duration)

	refs []int32 // per cell: how many sequences hold it
	free []int32
	seqs [][]int32 // seq -> cell per position
}

type sampler struct {
	temp float32
	rng  *rand.Rand
}

// New returns a simulated engine.
func New(cfg Config) (*Engine, error) {
	if cfg.NSeqMax < 1 || cfg.NSeqMax > 256 {
		return nil, fmt.Errorf("sim: n_seq_max must be within 1..256, got %d", cfg.NSeqMax)
	}
	if cfg.NCtx <= 0 {
		cfg.NCtx = 16384
	}
	if cfg.NBatch <= 0 {
		cfg.NBatch = 512
	}
	if cfg.BytesPerToken <= 0 {
		cfg.BytesPerToken = 8192
	}
	if cfg.Name == "" {
		cfg.Name = "sim"
	}
	if cfg.Sleep == nil {
		cfg.Sleep = time.Sleep
	}
	e := &Engine{
		info: engine.Info{
			Name: cfg.Name, NCtx: cfg.NCtx, NCtxTrain: cfg.NCtx, NBatch: cfg.NBatch,
			NSeqMax: cfg.NSeqMax, NVocab: vocabSize, BytesPerToken: cfg.BytesPerToken,
		},
		cost:  cfg.Cost,
		sleep: cfg.Sleep,
		refs:  make([]int32, cfg.NCtx),
		free:  make([]int32, 0, cfg.NCtx),
		seqs:  make([][]int32, cfg.NSeqMax),
	}
	for c := cfg.NCtx - 1; c >= 0; c-- {
		e.free = append(e.free, int32(c))
	}
	return e, nil
}

// Info implements engine.Engine.
func (e *Engine) Info() engine.Info { return e.info }

// Tokenize implements engine.Engine: BOS (with addSpecial), then special
// tokens by name, the SentencePiece space, and one token per other byte.
func (e *Engine) Tokenize(text string, addSpecial bool) ([]int, error) {
	out := make([]int, 0, len(text)+1)
	if addSpecial {
		out = append(out, tokBOS)
	}
outer:
	for i := 0; i < len(text); {
		if text[i] == '<' {
			for _, s := range specials {
				if strings.HasPrefix(text[i:], s.text) {
					out = append(out, s.id)
					i += len(s.text)
					continue outer
				}
			}
		}
		if text[i] == ' ' {
			out = append(out, tokSpace)
		} else {
			out = append(out, tokByte0+int(text[i]))
		}
		i++
	}
	return out, nil
}

// Piece implements engine.Engine.
func (e *Engine) Piece(tok int) string {
	switch {
	case tok >= tokByte0 && tok < tokByte0+256:
		return string([]byte{byte(tok - tokByte0)})
	case tok == tokSpace:
		return " "
	}
	for _, s := range specials {
		if s.id == tok {
			return s.text
		}
	}
	return ""
}

// IsEOG implements engine.Engine.
func (e *Engine) IsEOG(tok int) bool { return tok == tokIMEnd }

// NewSampler implements engine.Engine.
// The cost model has no logits: a JSON schema or logprobs are refused.
func (e *Engine) NewSampler(p engine.SamplingParams) (engine.Sampler, error) {
	if p.JSONSchema != nil {
		return nil, fmt.Errorf("%w: the simulated engine has no logits to constrain to a JSON schema", engine.ErrUnsupported)
	}
	if p.Logprobs {
		return nil, fmt.Errorf("%w: the simulated engine has no logits to report logprobs from", engine.ErrUnsupported)
	}
	seed := uint64(p.Seed)
	if !p.SeedSet {
		seed = rand.Uint64()
	}
	return &sampler{temp: p.Temperature, rng: rand.New(rand.NewPCG(seed, 0x5eed))}, nil
}

// next picks a printable ASCII byte token. Greedy depends only on the
// previous token and position, like a deterministic model would.
func (s *sampler) next(prev, pos int) int {
	var x uint64
	if s.temp <= 0 {
		x = uint64(prev)*0x9E3779B97F4A7C15 ^ uint64(pos)*0xBF58476D1CE4E5B9
		x ^= x >> 31
		x *= 0x94D049BB133111EB
		x ^= x >> 29
	} else {
		x = s.rng.Uint64()
	}
	const alphabet = "abcdefghijklmnopqrstuvwxyz      .,"
	c := alphabet[x%uint64(len(alphabet))]
	if c == ' ' {
		return tokSpace
	}
	return tokByte0 + int(c)
}

// Step implements engine.Engine.
func (e *Engine) Step(spans []engine.Span) ([]int, error) {
	n, sampled := 0, 0
	var attn int64
	for _, s := range spans {
		if s.Seq < 0 || s.Seq >= len(e.seqs) {
			return nil, fmt.Errorf("sim: seq id %d outside 0..%d", s.Seq, len(e.seqs)-1)
		}
		held := len(e.seqs[s.Seq])
		if s.Pos != held {
			return nil, fmt.Errorf("sim: seq %d: span at position %d but the sequence holds %d cells", s.Seq, s.Pos, held)
		}
		for _, t := range s.Tokens {
			if t < 0 || t >= vocabSize {
				return nil, fmt.Errorf("sim: token %d outside the vocabulary of %d", t, vocabSize)
			}
		}
		n += len(s.Tokens)
		k := int64(len(s.Tokens))
		attn += k*int64(s.Pos) + k*(k+1)/2
		if s.Sampler != nil {
			sampled++
		}
	}
	if n == 0 {
		return nil, errors.New("sim: empty batch")
	}
	if n > e.info.NBatch {
		return nil, fmt.Errorf("sim: batch of %d tokens exceeds n_batch %d", n, e.info.NBatch)
	}
	if n > len(e.free) {
		return nil, engine.ErrKVFull
	}
	for _, s := range spans {
		for range s.Tokens {
			c := e.free[len(e.free)-1]
			e.free = e.free[:len(e.free)-1]
			e.refs[c] = 1
			e.seqs[s.Seq] = append(e.seqs[s.Seq], c)
		}
	}
	if d := e.cost.Step(n, sampled, attn); d > 0 {
		e.sleep(d)
	}
	out := make([]int, len(spans))
	for i, s := range spans {
		out[i] = -1
		if s.Sampler == nil {
			continue
		}
		sm, ok := s.Sampler.(*sampler)
		if !ok {
			return nil, fmt.Errorf("sim: sampler %T is not this engine's", s.Sampler)
		}
		out[i] = sm.next(s.Tokens[len(s.Tokens)-1], s.Pos+len(s.Tokens)-1)
	}
	return out, nil
}

// Copy implements engine.Engine.
func (e *Engine) Copy(src, dst, from, to int) {
	if src == dst || to <= from {
		return
	}
	from = max(from, 0)
	e.Remove(dst, from)
	to = min(to, len(e.seqs[src]))
	if from >= to {
		return
	}
	for _, c := range e.seqs[src][from:to] {
		e.refs[c]++
		e.seqs[dst] = append(e.seqs[dst], c)
	}
}

// Remove implements engine.Engine.
func (e *Engine) Remove(seq, from int) {
	cells := e.seqs[seq]
	if from < 0 {
		from = 0
	}
	if from >= len(cells) {
		return
	}
	for _, c := range cells[from:] {
		if e.refs[c]--; e.refs[c] == 0 {
			e.free = append(e.free, c)
		}
	}
	e.seqs[seq] = cells[:from:from]
}

// UsedCells counts cells some sequence holds (shared cells once).
func (e *Engine) UsedCells() int { return len(e.refs) - len(e.free) }

// SeqLen is how many cells seq holds.
func (e *Engine) SeqLen(seq int) int { return len(e.seqs[seq]) }

// Close implements engine.Engine.
func (e *Engine) Close() error { return nil }
