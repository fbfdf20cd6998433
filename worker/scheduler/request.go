package scheduler

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

// State is where a request is in its life (the state machine of docs/worker.md, with
// QUEUED for the RequestQueue in front of the running set and CANCELLED for
// a client that went away).
type State int

const (
	Queued     State = iota // in the RequestQueue
	Pending                 // in the running set, waiting for a seq id
	Processing              // holds a seq id; prefill or decode in progress
	Completed
	Timeout
	Failed
	Cancelled
)

func (s State) String() string {
	switch s {
	case Queued:
		return "QUEUED"
	case Pending:
		return "PENDING"
	case Processing:
		return "PROCESSING"
	case Completed:
		return "COMPLETED"
	case Timeout:
		return "TIMEOUT"
	case Failed:
		return "FAILED"
	case Cancelled:
		return "CANCELLED"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Terminal reports whether s is an end state.
func (s State) Terminal() bool { return s >= Completed }

// Errors of Submit and of Result.Err; the HTTP layer maps them to codes.
var (
	ErrQueueFull = errors.New("request queue is full") // 429
	ErrTimeout   = errors.New("request timed out")     // 408
	// ErrQueueTimeout is an ErrTimeout of a request that never left the
	// queue.
	ErrQueueTimeout = fmt.Errorf("%w waiting for the running set", ErrTimeout)
	ErrCancelled    = errors.New("request cancelled: the client went away")      // no answer
	ErrShutdown     = errors.New("worker is shutting down")                      // 503
	ErrTooLong      = errors.New("prompt is longer than the context")            // 400
	ErrNoFit        = errors.New("request does not fit in the KV cache")         // 500
	ErrBadInput     = errors.New("invalid request")                              // 400
	ErrMaxTokens    = errors.New("max_tokens is more than this worker can give") // 400
	// ErrStopTokenID is an ErrBadInput naming stop_token_ids.
	ErrStopTokenID = fmt.Errorf("%w: stop_token_ids", ErrBadInput)
	errPreempted   = errors.New("preempted: KV cache full, will be recomputed") // internal
)

// Request is what the HTTP layer submits: an already tokenized prompt.
type Request struct {
	ID        string        // unique; names the seq-id binding and the KV entry it leaves
	Prompt    []int         // tokens
	Hashes    []prefix.Hash // the router's prefix hashes of this prompt (eviction reports)
	Sampling  engine.SamplingParams
	Sampler   engine.Sampler // optional; made from Sampling when nil
	MaxTokens int            // 0: Config.MaxOutputTokens (and never past the context)
	MinTokens int            // end-of-generation does not stop before this many tokens
	IgnoreEOS bool           // end-of-generation never stops (vLLM's ignore_eos)
	// StopTokenIDs end generation like end-of-generation does (vLLM's
	// stop_token_ids): the token is not emitted; min_tokens applies,
	// ignore_eos does not.
	StopTokenIDs []int
}

// Finish reasons of a completed request, as OpenAI names them.
const (
	FinishStop   = "stop"
	FinishLength = "length"
)

// Result is the outcome of a request.
type Result struct {
	State            State
	Finish           string // FinishStop / FinishLength when Completed
	Err              error  // nil when Completed
	PromptTokens     int
	CachedTokens     int // prompt tokens served from the KV cache
	CompletionTokens int
	TTFT             time.Duration // submit to first token (0 if none)
	QueueWait        time.Duration // submit to admission into the running set (or to the end, if never admitted)
}

// Handle is the submitter's view of a running request. The loop appends
// tokens without ever blocking on the reader; Ready signals new data.
type Handle struct {
	id     string
	ready  chan struct{}
	wake   func()
	mu     sync.Mutex
	toks   []int
	taken  int
	res    *Result
	stop   bool
	cached int
	hasC   bool
}

func newHandle(id string, wake func()) *Handle {
	return &Handle{id: id, ready: make(chan struct{}, 1), wake: wake}
}

// ID is the request id.
func (h *Handle) ID() string { return h.id }

// Ready receives a value whenever tokens or the result arrived since the
// last Take.
func (h *Handle) Ready() <-chan struct{} { return h.ready }

// Take returns the tokens generated since the last Take and, once the
// request has ended, its result (nil before).
func (h *Handle) Take() ([]int, *Result) {
	h.mu.Lock()
	defer h.mu.Unlock()
	t := h.toks[h.taken:]
	h.taken = len(h.toks)
	return t, h.res
}

// Wait blocks until the request ends or ctx is done, discarding tokens.
func (h *Handle) Wait(ctx context.Context) (*Result, error) {
	for {
		if _, r := h.Take(); r != nil {
			return r, nil
		}
		select {
		case <-h.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Stop asks the loop to end generation normally (a stop string matched):
// the request completes with finish reason "stop" and keeps its KV entry.
func (h *Handle) Stop() {
	h.mu.Lock()
	h.stop = true
	h.mu.Unlock()
	h.wake()
}

// CachedTokens is the number of prompt tokens reused from the KV cache,
// known once the request holds a seq id.
func (h *Handle) CachedTokens() (int, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.cached, h.hasC
}

func (h *Handle) stopRequested() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.stop
}

func (h *Handle) setCached(n int) {
	h.mu.Lock()
	h.cached, h.hasC = n, true
	h.mu.Unlock()
}

func (h *Handle) emit(tok int) {
	h.mu.Lock()
	h.toks = append(h.toks, tok)
	h.mu.Unlock()
	h.signal()
}

func (h *Handle) finish(r Result) {
	h.mu.Lock()
	if h.res == nil {
		h.res = &r
	}
	h.mu.Unlock()
	h.signal()
}

func (h *Handle) signal() {
	select {
	case h.ready <- struct{}{}:
	default:
	}
}
