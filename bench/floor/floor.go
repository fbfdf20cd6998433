// Package floor computes, for every request of a benchmark's workload, the
// time to first token no router can beat: the request alone on an idle pod
// that holds the longest prefix it shares with any earlier request of the
// workload, so that its TTFT is the engine's own cost of prefilling the
// rest of its prompt and sampling the first token.
//
// It is a lower bound for every policy of the same workload: each request's
// TTFT under any router is at least its floor (a router can only add
// queueing, a shorter cached prefix or evictions), so the k-th fastest TTFT
// of a run is at least the k-th smallest floor, and so is every percentile.
// Network and HTTP time are left out: the floor is the engine's alone.
//
// An Engine says how its pods tokenize a request, how much of a shared
// prefix they serve from their cache (vLLM: whole 16-token blocks; our
// worker: every token) and what a prefill costs (each engine's own cost
// model: vllmsim.Config.StepCost, sim.Cost.Step).
package floor

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/vllmsim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// Message is one chat message of a request.
type Message struct{ Role, Content string }

// Request is one request as the benchmark sent it: its messages and the
// answer it got (the next turn of a conversation carries that answer, and
// the pod that served it holds the answer's KV).
type Request struct {
	Messages []Message
	Answer   string
}

// Engine is what the floor needs of an engine.
type Engine interface {
	// Tokens are the request's prompt tokens and the tokens whose KV a pod
	// holds after serving it: the prompt and every generated token but the
	// last (sampled, never evaluated).
	Tokens(r Request) (prompt, held []int, err error)
	// Reuse is how many leading tokens of a prompt of n tokens a pod serves
	// from its cache when it holds the first shared tokens of it.
	Reuse(shared, n int) int
	// TTFT is the time to first token of a prompt of n tokens, the first
	// cached of them in the cache, alone on an idle pod.
	TTFT(n, cached int) time.Duration
}

// TTFTs returns each request's floor, in the order given, which must be
// the order the requests were sent: a request may reuse what any request
// before it left.
func TTFTs(e Engine, reqs []Request) ([]time.Duration, error) {
	b, err := Bounds(e, reqs, 0)
	return b.TTFTs, err
}

// Busy is an engine that can bound the time a pod spends on a request,
// whatever else it runs beside it.
type Busy interface {
	// Busy is the least time a pod spends on a prompt of n tokens, the
	// first cached of them in its cache, that generates out tokens: its
	// part of the steps that run it, in the fullest batch the pod runs.
	Busy(n, cached, out int) time.Duration
}

// Bound is what no router can beat on a run's requests.
type Bound struct {
	// TTFTs are the requests' floors (TTFTs).
	TTFTs []time.Duration
	// Capacity bounds the throughput (requests/s) of the fleet's pods on
	// the requests: the pods' time divided by the least time the requests
	// need of them, each reusing the longest prefix it shares with any
	// earlier request and decoding in the fullest batch. No router serves
	// them faster for long: a router can only add computation (a shorter
	// cached prefix, an eviction) or leave a pod idle or its batch short.
	// 0 when the engine cannot bound a request's busy time (Busy) or no
	// pods are given.
	Capacity float64
}

// Bounds returns the floors of reqs, sent in this order, and the capacity
// bound of a fleet of pods of e on them, in one pass over the requests.
func Bounds(e Engine, reqs []Request, pods int) (Bound, error) {
	out := Bound{TTFTs: make([]time.Duration, len(reqs))}
	busy, _ := e.(Busy)
	if pods <= 0 {
		busy = nil // no fleet to bound
	}
	var total time.Duration
	err := each(e, reqs, func(i, n, cached, o int) {
		out.TTFTs[i] = e.TTFT(n, cached)
		if busy != nil {
			total += busy.Busy(n, cached, o)
		}
	})
	if err != nil {
		return Bound{}, err
	}
	if pods > 0 && total > 0 {
		out.Capacity = float64(pods) * float64(len(reqs)) / total.Seconds()
	}
	return out, nil
}

// each calls f with every request's index, prompt tokens, tokens reused
// from the longest prefix it shares with any earlier request, and output
// tokens.
func each(e Engine, reqs []Request, f func(i, n, cached, out int)) error {
	var held [][]int
	for i, r := range reqs {
		prompt, h, err := e.Tokens(r)
		if err != nil {
			return fmt.Errorf("request %d: %w", i, err)
		}
		shared := 0
		for _, prev := range held {
			shared = max(shared, commonPrefix(prompt, prev))
		}
		// held is the prompt and every answer token but the last.
		f(i, len(prompt), e.Reuse(shared, len(prompt)), len(h)-len(prompt)+1)
		held = append(held, h)
	}
	return nil
}

func commonPrefix(a, b []int) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

func chat(msgs []Message) []openai.Message {
	ms := make([]openai.Message, len(msgs))
	for i, m := range msgs {
		ms[i] = openai.Message{Role: m.Role, Content: openai.Content{Text: m.Content, Set: true}}
	}
	return ms
}

// heldAfter is the prompt followed by the answer's tokens but the last.
func heldAfter(prompt, answer []int) []int {
	if len(answer) == 0 {
		return prompt
	}
	return append(append(make([]int, 0, len(prompt)+len(answer)-1), prompt...), answer[:len(answer)-1]...)
}

// VLLM is a vLLM-like pod of bench/vllmsim: prompts rendered and tokenized
// as the pod does, whole KV blocks reused (never the prompt's last token:
// it must be computed to sample), and the prefill run in steps of at most
// MaxNumBatchedTokens, each costing Config.StepCost.
type VLLM struct{ Config vllmsim.Config }

// Tokens implements Engine.
func (v VLLM) Tokens(r Request) (prompt, held []int, err error) {
	text, err := vllmsim.ChatPrompt(chat(r.Messages))
	if err != nil {
		return nil, nil, err
	}
	prompt = ints(vllmsim.Tokenize(text))
	return prompt, heldAfter(prompt, ints(vllmsim.Tokenize(r.Answer))), nil
}

// Reuse implements Engine: whole blocks, at most those before the last
// prompt token's.
func (v VLLM) Reuse(shared, n int) int {
	bs := v.Config.BlockSize
	return min(shared/bs, (n-1)/bs) * bs
}

// TTFT implements Engine.
func (v VLLM) TTFT(n, cached int) time.Duration {
	var d time.Duration
	for left := n - cached; left > 0; {
		k := min(left, v.Config.MaxNumBatchedTokens)
		d += v.Config.StepCost(k, 0)
		left -= k
	}
	return d
}

// Busy implements Busy: the request's uncached tokens at the prefill
// cost per token, and each decode step but the first token's (which the
// last prefill step samples) at the cost per sequence plus its share of the
// step's fixed time with MaxNumSeqs sequences decoding.
func (v VLLM) Busy(n, cached, out int) time.Duration {
	c := v.Config
	step := c.StepTime/time.Duration(max(c.MaxNumSeqs, 1)) + c.DecodePerSeq
	return time.Duration(n-cached)*c.PrefillPerToken + time.Duration(max(out-1, 0))*step
}

func ints(u []uint32) []int {
	out := make([]int, len(u))
	for i, v := range u {
		out[i] = int(v)
	}
	return out
}

// Sim is our worker on its simulated engine (worker/engine/sim): prompts
// rendered with the worker's chat template and tokenized by the engine,
// every cached token reused but the prompt's last (worker/kvcache Bind),
// and the prefill of a request stepping alone run in chunks of NBatch, each
// costing Cost.Step with the attention over the cells before it; the last
// chunk samples.
type Sim struct {
	Template openai.Template
	NBatch   int
	Cost     sim.Cost
	eng      *sim.Engine
}

// NewSim returns the floor's model of a worker with template, n_batch and
// cost model.
func NewSim(t openai.Template, nBatch int, c sim.Cost) (*Sim, error) {
	eng, err := sim.New(sim.Config{NSeqMax: 1, NCtx: 1})
	if err != nil {
		return nil, err
	}
	if nBatch < 1 {
		return nil, fmt.Errorf("floor: n_batch %d", nBatch)
	}
	return &Sim{Template: t, NBatch: nBatch, Cost: c, eng: eng}, nil
}

// Tokens implements Engine.
func (s *Sim) Tokens(r Request) (prompt, held []int, err error) {
	text, err := s.Template.Render(chat(r.Messages), true)
	if err != nil {
		return nil, nil, err
	}
	if prompt, err = s.eng.Tokenize(text, false); err != nil {
		return nil, nil, err
	}
	answer, err := s.eng.Tokenize(r.Answer, false)
	if err != nil {
		return nil, nil, err
	}
	return prompt, heldAfter(prompt, answer), nil
}

// Reuse implements Engine.
func (s *Sim) Reuse(shared, n int) int { return min(shared, n-1) }

// TTFT implements Engine.
func (s *Sim) TTFT(n, cached int) time.Duration {
	var d time.Duration
	for pos := cached; pos < n; {
		k := min(n-pos, s.NBatch)
		sampled := 0
		if pos+k == n {
			sampled = 1
		}
		kk := int64(k)
		d += s.Cost.Step(k, sampled, kk*int64(pos)+kk*(kk+1)/2)
		pos += k
	}
	return d
}

// For returns the floor's model of the bench's pods: engine and the extra
// flags the bench passes them (--worker-args), read as the pods read them,
// and the GGUF model whose chat template a worker renders (empty: ChatML).
// It returns nil, with the reason, for engines with no cost model to bound
// them: real llama.cpp compute.
func For(engine string, workerArgs []string, model string) (Engine, string, error) {
	switch engine {
	case "vllm":
		c := vllmsim.DefaultConfig()
		fs := flag.NewFlagSet("vllmsim", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		c.RegisterFlags(fs)
		if err := fs.Parse(workerArgs); err != nil {
			return nil, "", fmt.Errorf("floor: vllmsim flags %q: %w", workerArgs, err)
		}
		return VLLM{Config: c}, "", nil
	case "sim":
		t := openai.ChatML()
		if model != "" {
			var err error
			if t, _, err = openai.LoadTemplate(model); err != nil {
				return nil, "", err
			}
		}
		// The worker's own defaults (worker/cmd/worker): n_batch 512, the
		// bench calibration of the cost model; its flags override them.
		nBatch, c := 512, sim.BenchCost()
		var errs []error
		if v, ok := argValue(workerArgs, "n-batch"); ok {
			n, err := strconv.Atoi(v)
			errs, nBatch = append(errs, err), n
		}
		for name, d := range map[string]*time.Duration{"sim-step-overhead": &c.StepOverhead, "sim-per-token": &c.PerToken,
			"sim-per-sample": &c.PerSample, "sim-per-kctx-token": &c.PerKCtxToken} {
			if v, ok := argValue(workerArgs, name); ok {
				var err error
				*d, err = time.ParseDuration(v)
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			return nil, "", fmt.Errorf("floor: worker flags %q: %w", workerArgs, err)
		}
		s, err := NewSim(t, nBatch, c)
		return s, "", err
	}
	return nil, "no floor on " + engine + " pods: their compute has no cost model to bound it", nil
}

// argValue is the value of the last --name (or -name) in args, as
// "--name value" or "--name=value".
func argValue(args []string, name string) (string, bool) {
	val, found := "", false
	for i := 0; i < len(args); i++ {
		a := strings.TrimLeft(args[i], "-")
		if len(a) == len(args[i]) {
			continue // not a flag
		}
		if k, v, ok := strings.Cut(a, "="); ok && k == name {
			val, found = v, true
		} else if a == name && i+1 < len(args) {
			val, found = args[i+1], true
			i++
		}
	}
	return val, found
}
