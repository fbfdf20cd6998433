// Package engine is the seam between the scheduler and whatever computes
// tokens: llama.cpp through cgo (engine/llama) or a cost model that only
// sleeps (engine/sim).
//
// The interface is the handful of operations a continuous-batching loop
// needs, in llama.cpp's terms: sequences are small integers (seq ids), a
// sequence's cells sit at positions 0..n-1 of one unified KV cache, a prefix
// of one sequence's cells can be shared into another without recompute, and
// one Step evaluates tokens of several sequences together and samples the
// next token for those that asked.
//
// Engines are not safe for concurrent use except where a method says so:
// one goroutine (the scheduler loop) owns the compute state.
package engine

import "errors"

// ErrKVFull means the KV cache has no free cells for the batch (llama_decode
// returned 1). Nothing was evaluated; the caller frees cells and retries.
var ErrKVFull = errors.New("engine: KV cache has no room for the batch")

// ErrUnsupported wraps what an engine cannot do for a request (NewSampler:
// a JSON schema or logprobs on an engine without logits, a schema
// llama.cpp cannot turn into a grammar); the HTTP layer answers it with 400.
var ErrUnsupported = errors.New("engine: not supported")

// Info describes the loaded model and context.
type Info struct {
	Name          string // model name the API reports (file name without extension)
	NCtx          int    // KV cells of the context: the most tokens all sequences together hold
	NCtxTrain     int    // the model's training context (llama.context_length)
	NBatch        int    // most tokens one Step may evaluate
	NSeqMax       int    // seq ids are 0..NSeqMax-1
	NVocab        int
	BytesPerToken int64  // KV bytes one token's cells take over all layers (K and V)
	ChatTemplate  string // tokenizer.chat_template from the GGUF, "" if none
}

// SamplingParams are the OpenAI sampling knobs the engines honour.
type SamplingParams struct {
	Temperature float32 // 0 = greedy
	TopP        float32 // 1 = off
	Seed        uint32
	SeedSet     bool // false: a random seed
	// FrequencyPenalty and PresencePenalty are OpenAI's ([-2, 2], 0 off),
	// applied by llama.cpp's penalty sampler over the tokens generated so
	// far (not the prompt's, as vLLM does).
	FrequencyPenalty float32
	PresencePenalty  float32
	// JSONSchema, if set, constrains the output to JSON valid against
	// this JSON schema (llama.cpp's json-schema-to-grammar and grammar
	// sampler): every sampled token keeps the output a prefix of such JSON.
	JSONSchema []byte
	// Logprobs makes the sampler record, for every token it samples, the
	// token's log-probability under the model and the TopLogprobs most
	// likely tokens (0..MaxTopLogprobs); the sampler is then a
	// LogprobSource.
	Logprobs    bool
	TopLogprobs int
}

// MaxTopLogprobs is the most alternatives a sampler records per token
// (OpenAI's limit for top_logprobs).
const MaxTopLogprobs = 20

// Sampler picks next tokens for one sequence; it carries the RNG state.
type Sampler interface{}

// TokenLogprob is a token and its log-probability under the model (the
// log-softmax of the raw logits, before temperature, top_p and grammar).
type TokenLogprob struct {
	Token   int
	Logprob float32
}

// Sampled is what a sampler made with Logprobs records for one sampled
// token: the token's own log-probability and the most likely tokens at
// that position, most likely first.
type Sampled struct {
	TokenLogprob
	Top []TokenLogprob
}

// LogprobSource is implemented by samplers made with Logprobs. The loop
// records one entry per sampled token, in order; TakeLogprobs returns those
// recorded since the last call. Safe for concurrent use with Step.
type LogprobSource interface {
	TakeLogprobs() []Sampled
}

// Span is a run of tokens of one sequence to evaluate in a Step: Tokens[i]
// goes to position Pos+i of seq Seq, which must be exactly the sequence's
// current length (cells are contiguous from 0).
type Span struct {
	Seq     int
	Pos     int
	Tokens  []int
	Sampler Sampler // non-nil: sample the token following the span's last one
}

// Engine is what the scheduler drives.
type Engine interface {
	Info() Info

	// Tokenize renders text to tokens, parsing special tokens (chat
	// templates contain them); with addSpecial it adds BOS when the model
	// wants one (completion prompts; rendered chat templates write their
	// own). Safe for concurrent use: it reads only the vocabulary.
	Tokenize(text string, addSpecial bool) ([]int, error)
	// Piece is the text of one token; byte tokens may be partial UTF-8.
	// Safe for concurrent use.
	Piece(tok int) string
	// IsEOG reports end-of-generation tokens. Safe for concurrent use.
	IsEOG(tok int) bool

	// NewSampler makes a sampler; it may be called from any goroutine, but
	// the sampler is then used only by the loop.
	NewSampler(SamplingParams) (Sampler, error)

	// Step evaluates spans in one batch (at most NBatch tokens in all) and
	// returns, for each span with a Sampler, the sampled token (-1 for the
	// others). ErrKVFull leaves the KV cache as it was.
	Step(spans []Span) ([]int, error)

	// Copy shares src's cells at positions [from, to) into dst, which must
	// hold exactly positions [0, from) of the same tokens (from = 0: no
	// cells). llama.cpp's unified cache tags the same cells with both seq
	// ids: no compute, no copy. A request following another's prefill
	// takes its cells chunk by chunk this way.
	Copy(src, dst, from, to int)
	// Remove drops seq's cells at positions >= from.
	Remove(seq, from int)

	Close() error
}
