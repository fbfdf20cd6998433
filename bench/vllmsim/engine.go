package vllmsim

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// request is one sequence in the engine.
type request struct {
	tokens    []uint32 // prompt, then the generated tokens
	promptLen int
	maxTokens int
	arrival   time.Time

	hashes   []uint64 // chained hashes of tokens' full blocks, extended as they fill
	blocks   []int32  // KV blocks held, in sequence order
	computed int      // tokens whose KV is in blocks
	hashed   int      // leading blocks recorded in the prefix cache

	admitted bool // scheduled at least once (cached counts its first hit)
	cached   int  // prompt tokens served from the prefix cache, at admission
	output   []string
	done     bool
	aborted  bool
	notify   chan struct{} // capacity 1: something new to stream
}

func (r *request) signal() {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// hashesUpTo extends r.hashes over the first n full blocks of r.tokens.
func (r *request) hashesUpTo(n, bs int) []uint64 {
	for len(r.hashes) < n {
		i := len(r.hashes)
		var parent uint64
		if i > 0 {
			parent = r.hashes[i-1]
		}
		r.hashes = append(r.hashes, blockHash(parent, r.tokens[i*bs:(i+1)*bs]))
	}
	return r.hashes[:n]
}

// scheduled is one request's share of a step.
type scheduled struct {
	r      *request
	tokens int
}

// Pod is one simulated vLLM server's engine.
type Pod struct {
	cfg  Config
	wake chan struct{}

	mu      sync.Mutex
	kv      *blockPool
	waiting []*request // FCFS; preempted requests go back to the front
	running []*request
	stats   stats
	ttft    prometheus.Histogram // vllm:time_to_first_token_seconds
}

// stats are the counters /metrics exposes (guarded by Pod.mu).
type stats struct {
	queries, hits, preemptions, promptTokens, generationTokens, finished int64
}

// NewPod returns a pod's engine; Run drives it.
func NewPod(cfg Config) (*Pod, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Pod{cfg: cfg, wake: make(chan struct{}, 1), kv: newBlockPool(cfg.NumBlocks, cfg.BlockSize),
		ttft: newTTFT(cfg.ModelName)}, nil
}

// Run steps the engine until ctx ends: it sleeps on a channel while idle and
// on a timer through each step.
func (p *Pod) Run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		p.mu.Lock()
		batch, cost := p.schedule()
		p.mu.Unlock()
		if len(batch) == 0 {
			select {
			case <-p.wake:
				continue
			case <-ctx.Done():
				return
			}
		}
		timer.Reset(cost)
		select {
		case <-timer.C:
		case <-ctx.Done():
			return
		}
		p.mu.Lock()
		p.finishStep(batch)
		p.mu.Unlock()
	}
}

// submit queues a request.
func (p *Pod) submit(r *request) {
	p.mu.Lock()
	p.waiting = append(p.waiting, r)
	p.mu.Unlock()
	p.poke()
}

// abort drops a request whose client went away.
func (p *Pod) abort(r *request) {
	p.mu.Lock()
	r.aborted = true
	p.mu.Unlock()
	p.poke()
}

func (p *Pod) poke() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// schedule plans one step (vLLM V1's Scheduler.schedule, see the package
// comment) and returns it with its time.
func (p *Pod) schedule() ([]scheduled, time.Duration) {
	p.dropAborted()
	budget := p.cfg.MaxNumBatchedTokens
	var batch []scheduled
	preempted := false
	for i := 0; i < len(p.running) && budget > 0; i++ {
		r := p.running[i]
		n := min(len(r.tokens)-r.computed, budget)
		if n <= 0 {
			continue
		}
		for !p.grow(r, n) {
			victim := p.running[len(p.running)-1]
			p.preempt(victim)
			preempted = true
			if victim == r {
				break
			}
		}
		if i >= len(p.running) || p.running[i] != r {
			break // r itself was preempted: nothing after it runs
		}
		batch = append(batch, scheduled{r, n})
		budget -= n
	}
	// A step that preempted admits nothing: the room is not there.
	for !preempted && len(p.waiting) > 0 && len(p.running) < p.cfg.MaxNumSeqs && budget > 0 {
		r := p.waiting[0]
		bs := p.cfg.BlockSize
		// The last prompt token is always computed: it gives the logits
		// the first output token is sampled from.
		limit := (len(r.tokens) - 1) / bs
		hit := p.kv.longestHit(r.hashesUpTo(len(r.tokens)/bs, bs), limit)
		start := len(hit) * bs
		n := min(len(r.tokens)-start, budget)
		need := blocksFor(start+n, bs) - len(hit)
		if need+p.kv.evictableAmong(hit) > p.kv.free {
			break // FCFS: nobody overtakes the head of the queue
		}
		for _, id := range hit {
			p.kv.touch(id)
		}
		r.blocks = append(r.blocks[:0], hit...)
		for range need {
			r.blocks = append(r.blocks, p.kv.allocate())
		}
		r.computed, r.hashed = start, len(hit)
		if !r.admitted {
			r.admitted, r.cached = true, start
			p.stats.queries += int64(r.promptLen)
			p.stats.hits += int64(start)
		}
		p.waiting = p.waiting[1:]
		p.running = append(p.running, r)
		batch = append(batch, scheduled{r, n})
		budget -= n
	}
	var prefill, decodes int
	for _, s := range batch {
		if s.tokens == 1 && s.r.computed >= s.r.promptLen {
			decodes++
		} else {
			prefill += s.tokens
		}
	}
	return batch, p.cfg.StepCost(prefill, decodes)
}

// grow gives r the blocks for n more tokens, if the pool has them.
func (p *Pod) grow(r *request, n int) bool {
	need := blocksFor(r.computed+n, p.cfg.BlockSize) - len(r.blocks)
	if need > p.kv.free {
		return false
	}
	for range need {
		r.blocks = append(r.blocks, p.kv.allocate())
	}
	return true
}

// preempt frees a running request's blocks and queues it first, to be
// recomputed (its cached blocks may still hit when it comes back).
func (p *Pod) preempt(r *request) {
	p.release(r)
	for i, q := range p.running {
		if q == r {
			p.running = append(p.running[:i], p.running[i+1:]...)
			break
		}
	}
	p.waiting = append([]*request{r}, p.waiting...)
	p.stats.preemptions++
}

func (p *Pod) release(r *request) {
	p.kv.release(r.blocks)
	r.blocks, r.computed, r.hashed = r.blocks[:0], 0, 0
}

func (p *Pod) dropAborted() {
	keep := func(list []*request) []*request {
		out := list[:0]
		for _, r := range list {
			if r.aborted {
				p.release(r)
				continue
			}
			out = append(out, r)
		}
		return out
	}
	p.running = keep(p.running)
	p.waiting = keep(p.waiting)
}

// finishStep applies a step's computation: blocks that filled join the
// prefix cache, a sequence whose tokens are all computed samples its next
// token, and a sequence at its length finishes and frees its blocks.
func (p *Pod) finishStep(batch []scheduled) {
	now := time.Now()
	bs := p.cfg.BlockSize
	finished := false
	for _, s := range batch {
		r := s.r
		if r.aborted || r.done {
			continue
		}
		r.computed += s.tokens
		full := r.computed / bs
		for i, h := range r.hashesUpTo(full, bs)[r.hashed:] {
			p.kv.cache(r.blocks[r.hashed+i], h)
		}
		r.hashed = full
		if r.computed < len(r.tokens) {
			continue // a prefill chunk: no token yet
		}
		piece := outputPieces[int(r.tokens[len(r.tokens)-1]^uint32(len(r.tokens)))%len(outputPieces)]
		r.tokens = append(r.tokens, pieceID(piece))
		r.output = append(r.output, piece)
		p.stats.generationTokens++
		if len(r.output) == 1 {
			p.stats.promptTokens += int64(r.promptLen)
			p.ttft.Observe(now.Sub(r.arrival).Seconds())
		}
		if len(r.output) >= r.maxTokens {
			r.done = true
			p.release(r)
			p.stats.finished++
			finished = true
		}
		r.signal()
	}
	if finished {
		out := p.running[:0]
		for _, r := range p.running {
			if !r.done {
				out = append(out, r)
			}
		}
		p.running = out
	}
}

func blocksFor(tokens, bs int) int { return (tokens + bs - 1) / bs }
