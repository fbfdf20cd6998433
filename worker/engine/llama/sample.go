package llama

/*
#include <stdint.h>

// llama.cpp's logits accessor, which the ollama binding does not wrap.
struct llama_context;
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
*/
import "C"

import (
	"fmt"
	"math"
	"slices"
	"sync"
	"unsafe"

	ll "github.com/ollama/ollama/llama"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

// sampler is llama.cpp's common_sampler (temperature, top_p, penalties and
// an optional grammar) plus, when asked for, the log-probabilities of what
// it sampled.
type sampler struct {
	sc      *ll.SamplingContext
	grammar bool // accept tokens into the grammar too
	lp      bool // record logprobs
	top     int

	mu   sync.Mutex
	recs []engine.Sampled
}

// NewSampler implements engine.Engine. Temperature, top_p, seed, the
// frequency/presence penalties and the grammar are set; top_k, min_p,
// typical_p and the repetition penalty stay neutral, as OpenAI defines its
// API. The penalty window is the whole context: only generated tokens enter
// it (Step accepts each sampled token; prompt tokens are never accepted).
// A JSON schema llama.cpp cannot turn into a grammar is an
// engine.ErrUnsupported.
func (e *Engine) NewSampler(p engine.SamplingParams) (engine.Sampler, error) {
	seed := uint32(0xFFFFFFFF) // LLAMA_DEFAULT_SEED: llama.cpp draws a random one
	if p.SeedSet {
		seed = p.Seed
	}
	topP := p.TopP
	if topP <= 0 || topP > 1 {
		topP = 1
	}
	lastN := 0 // no penalty: llama.cpp skips the sampler's bookkeeping
	if p.FrequencyPenalty != 0 || p.PresencePenalty != 0 {
		lastN = e.info.NCtx
	}
	if p.TopLogprobs < 0 || p.TopLogprobs > engine.MaxTopLogprobs {
		return nil, fmt.Errorf("%w: top logprobs %d outside 0..%d", engine.ErrUnsupported, p.TopLogprobs, engine.MaxTopLogprobs)
	}
	var grammar string
	if p.JSONSchema != nil {
		g := ll.SchemaToGrammar(p.JSONSchema)
		if g == nil {
			return nil, fmt.Errorf("%w: llama.cpp cannot turn the JSON schema into a grammar", engine.ErrUnsupported)
		}
		grammar = string(g)
	}
	sc, err := ll.NewSamplingContext(e.model, ll.SamplingParams{
		TopK:           0,
		TopP:           topP,
		MinP:           0,
		TypicalP:       1,
		Temp:           p.Temperature,
		RepeatLastN:    lastN,
		PenaltyRepeat:  1,
		PenaltyFreq:    p.FrequencyPenalty,
		PenaltyPresent: p.PresencePenalty,
		Seed:           seed,
		Grammar:        grammar,
	})
	if err != nil {
		if grammar != "" {
			return nil, fmt.Errorf("%w: llama.cpp cannot use the JSON schema's grammar: %v", engine.ErrUnsupported, err)
		}
		return nil, err
	}
	return &sampler{sc: sc, grammar: grammar != "", lp: p.Logprobs, top: p.TopLogprobs}, nil
}

// sample picks the token following batch position idx, advances the
// sampler's state (penalties, grammar) with it and records its logprobs.
func (e *Engine) sample(sm *sampler, idx int) int {
	tok := sm.sc.Sample(e.lc, idx)
	sm.sc.Accept(tok, sm.grammar)
	if sm.lp {
		logits := unsafe.Slice((*float32)(unsafe.Pointer(C.llama_get_logits_ith(e.raw, C.int32_t(idx)))), e.vocab)
		rec := logprobs(logits, tok, sm.top)
		sm.mu.Lock()
		sm.recs = append(sm.recs, rec)
		sm.mu.Unlock()
	}
	return tok
}

// TakeLogprobs implements engine.LogprobSource.
func (sm *sampler) TakeLogprobs() []engine.Sampled {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	r := sm.recs
	sm.recs = nil
	return r
}

// logprobs is the log-softmax of logits at tok and at the top most likely
// tokens (ties: lower id first).
func logprobs(logits []float32, tok, top int) engine.Sampled {
	peak := float32(math.Inf(-1))
	for _, l := range logits {
		peak = max(peak, l)
	}
	var sum float64
	for _, l := range logits {
		sum += math.Exp(float64(l - peak))
	}
	norm := float64(peak) + math.Log(sum)
	lp := func(t int) engine.TokenLogprob {
		return engine.TokenLogprob{Token: t, Logprob: min(0, float32(float64(logits[t])-norm))}
	}
	rec := engine.Sampled{TokenLogprob: lp(tok)}
	if top == 0 {
		return rec
	}
	best := make([]int, 0, top+1)
	for t, l := range logits {
		if len(best) == top && l <= logits[best[top-1]] {
			continue
		}
		i, _ := slices.BinarySearchFunc(best, l, func(b int, l float32) int {
			if logits[b] >= l {
				return -1
			}
			return 1
		})
		best = slices.Insert(best, i, t)
		if len(best) > top {
			best = best[:top]
		}
	}
	rec.Top = make([]engine.TokenLogprob, len(best))
	for i, t := range best {
		rec.Top[i] = lp(t)
	}
	return rec
}
