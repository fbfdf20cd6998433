// Package vllmsim simulates pods that behave and report like vLLM (V1
// engine) serving one model, so that routing can be measured with the
// signals a vLLM deployment gives and nothing more: the OpenAI chat API
// with streamed answers and usage.prompt_tokens_details.cached_tokens, and
// vLLM's Prometheus gauges on /metrics. It pushes nothing anywhere: a
// metadata center scrapes it as it scrapes real vLLM pods.
//
// It is written from vLLM's documented semantics, not from its code or any
// other simulator's:
//
//   - prefix caching in blocks of 16 tokens found by chained block hashes;
//     idle cached blocks count as free and are reused least recently freed
//     first (kvcache.go; docs.vllm.ai/en/latest/design/prefix_caching/);
//   - the scheduler (vllm/v1/core/sched/scheduler.py, the V1 design in
//     docs.vllm.ai/en/latest/design/): every step has a budget of
//     max_num_batched_tokens; running requests go first (a decode takes one
//     token, an unfinished prefill the rest of its prompt, chunked to the
//     budget); when the KV cache cannot give a running request its next
//     block, the last running request is preempted by recompute (its blocks
//     freed, back to the front of the waiting queue); then waiting requests
//     are admitted first come first served while fewer than max_num_seqs
//     run and the budget lasts, each starting after its longest cached
//     prefix (never the prompt's last token: it must be computed to sample);
//   - a step's time: a fixed cost plus a cost per prefill token and per
//     decoding sequence in the batch, so prefill and decode compete as on
//     a GPU;
//   - /metrics with vLLM's names and model_name label
//     (docs.vllm.ai/en/latest/design/metrics/): vllm:num_requests_running,
//     vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:cache_config_info
//     (its block_size and num_gpu_blocks labels),
//     vllm:prefix_cache_queries / vllm:prefix_cache_hits (tokens),
//     vllm:num_preemptions, vllm:prompt_tokens, vllm:generation_tokens and
//     the vllm:time_to_first_token_seconds histogram.
//
// Tokens are BPE-like (Tokenize: about BytesPerToken bytes a token). The
// simulated model never ends early: it writes max_tokens tokens (as vLLM
// with ignore_eos), or up to max_model_len without max_tokens.
//
// One process serves many pods, one listener each (Serve): every pod is an
// event-driven loop that sleeps through each step on a timer, so 64 pods fit
// on two cores.
package vllmsim

import (
	"errors"
	"flag"
	"fmt"
	"time"
)

// Config is one pod's engine. DefaultConfig is the bench's.
type Config struct {
	ModelName string
	// BlockSize is tokens per KV block (vLLM's --block-size, 16 on GPUs).
	BlockSize int
	// NumBlocks is the KV cache's size in blocks (vLLM sizes it from
	// --gpu-memory-utilization; --num-gpu-blocks-override sets it).
	NumBlocks int
	// MaxNumSeqs bounds running requests (--max-num-seqs).
	MaxNumSeqs int
	// MaxNumBatchedTokens is the token budget of one step
	// (--max-num-batched-tokens), the prefill chunk size.
	MaxNumBatchedTokens int
	// MaxModelLen bounds prompt plus output (--max-model-len).
	MaxModelLen int
	// A step takes StepTime + PrefillPerToken × its prefill tokens +
	// DecodePerSeq × its decoding sequences.
	StepTime, PrefillPerToken, DecodePerSeq time.Duration
	// StreamInterval is the number of tokens sent per SSE chunk after the
	// first (vLLM's --stream-interval); the first token goes alone.
	StreamInterval int
}

// DefaultConfig is a mid-sized GPU pod scaled to the bench: 4,096 blocks
// (65,536 tokens) of KV cache, 16 running sequences, 2,048 tokens a step
// (vLLM's online-serving default), a 10k tokens/s prefill (0.1 ms a token),
// and a 12 ms decode step plus 0.25 ms per sequence: with the bench's
// workloads several requests queue and caches evict, as on a busy pod.
func DefaultConfig() Config {
	return Config{
		ModelName:           "tiny",
		BlockSize:           16,
		NumBlocks:           4096,
		MaxNumSeqs:          16,
		MaxNumBatchedTokens: 2048,
		MaxModelLen:         32768,
		StepTime:            12 * time.Millisecond,
		PrefillPerToken:     100 * time.Microsecond,
		DecodePerSeq:        250 * time.Microsecond,
		StreamInterval:      1,
	}
}

// RegisterFlags declares the flags that set c (vllmsim's and the bench's
// --worker-args under --engine vllm), c's values their defaults.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.ModelName, "model-name", c.ModelName, "the model name the pods serve")
	fs.IntVar(&c.BlockSize, "block-size", c.BlockSize, "tokens per KV block")
	fs.IntVar(&c.NumBlocks, "num-gpu-blocks", c.NumBlocks, "KV cache size in blocks")
	fs.IntVar(&c.MaxNumSeqs, "max-num-seqs", c.MaxNumSeqs, "running requests at most")
	fs.IntVar(&c.MaxNumBatchedTokens, "max-num-batched-tokens", c.MaxNumBatchedTokens, "token budget of one step (the prefill chunk)")
	fs.IntVar(&c.MaxModelLen, "max-model-len", c.MaxModelLen, "prompt plus output tokens at most")
	fs.DurationVar(&c.StepTime, "step-time", c.StepTime, "fixed time of one engine step")
	fs.DurationVar(&c.PrefillPerToken, "prefill-per-token", c.PrefillPerToken, "step time per prefill token")
	fs.DurationVar(&c.DecodePerSeq, "decode-per-seq", c.DecodePerSeq, "step time per decoding sequence")
	fs.IntVar(&c.StreamInterval, "stream-interval", c.StreamInterval, "tokens per streamed chunk after the first")
}

// StepCost is the time of one step with prefill prompt tokens and decodes
// decoding sequences in its batch.
func (c Config) StepCost(prefill, decodes int) time.Duration {
	return c.StepTime + time.Duration(prefill)*c.PrefillPerToken + time.Duration(decodes)*c.DecodePerSeq
}

// Validate refuses a configuration vLLM would refuse to start with.
func (c Config) Validate() error {
	var errs []error
	if c.ModelName == "" {
		errs = append(errs, errors.New("model name is empty"))
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"block size", c.BlockSize}, {"num blocks", c.NumBlocks}, {"max num seqs", c.MaxNumSeqs},
		{"max num batched tokens", c.MaxNumBatchedTokens}, {"max model len", c.MaxModelLen}, {"stream interval", c.StreamInterval}} {
		if f.v < 1 {
			errs = append(errs, fmt.Errorf("%s must be at least 1, got %d", f.name, f.v))
		}
	}
	if c.MaxModelLen > c.NumBlocks*c.BlockSize && c.NumBlocks > 0 && c.BlockSize > 0 {
		errs = append(errs, fmt.Errorf("max model len %d exceeds the KV cache (%d blocks of %d tokens): one request could never run",
			c.MaxModelLen, c.NumBlocks, c.BlockSize))
	}
	if c.StepTime < 0 || c.PrefillPerToken < 0 || c.DecodePerSeq < 0 {
		errs = append(errs, errors.New("step costs must not be negative"))
	}
	return errors.Join(errs...)
}
