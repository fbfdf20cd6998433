// Package scheduler is the worker's request pipeline (docs/worker.md): a
// bounded RequestQueue in front of a running set, the KV owner (seq ids
// bound to request ids, cells, cache entries, making room: worker/kvcache),
// and one goroutine that owns the engine and runs continuous batching.
//
// Each request has one phase (phase.go). Every step the loop plans one
// batch of at most n_batch tokens (plan.go, a pure function): one decode
// token of each generating sequence and prefill chunks of the others, like
// llama-server and Ollama's runner. A request that gets a seq id first
// adopts the KV entry sharing the longest token prefix with its prompt, or
// follows a running request still writing a longer one, so only the rest
// is prefilled. Every end (COMPLETED, TIMEOUT, FAILED, CANCELLED) ends the
// work at once and releases the seq id: to the cache entry that now holds
// the cells (completed, cancelled, timed out), or back to the pool.
package scheduler

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/kvcache"
	"github.com/istio-llm-filter/istio-llm-filter/worker/seqpool"
)

// Config are the scheduler's knobs. DefaultConfig is what the worker
// ships (its flags default to it); in a Config given to New, a field whose
// zero means nothing (a size, a timeout) takes DefaultConfig's value, and
// a zero policy knob (FinishFirst, PrefillChunk, QueueTimeout) is off, as
// the flag's 0 is.
type Config struct {
	MaxQueue int // RequestQueue length
	// MaxRunning is the running set: requests admitted from the queue,
	// each holding (or waiting for) a seq id. It bounds the memory of
	// requests in flight; past it requests queue.
	MaxRunning int
	// MaxBatch is the most sequences one step evaluates, at most
	// MaxRunning: a step's time grows with its sequences, and every
	// sequence in it waits for its end; with more ready, they take turns.
	// The engine's seq ids (n_seq_max) are a third count: MaxRunning of
	// them for running requests, the rest for idle cached conversations.
	MaxBatch int
	// MaxOutputTokens caps a request without max_tokens and refuses one
	// asking for more (maxOutContextLength).
	MaxOutputTokens int
	RequestTimeout  time.Duration // from entering the running set
	// QueueTimeout bounds the wait in the RequestQueue: a request still
	// queued after it ends TIMEOUT (408) without ever running, so a client
	// behind a stalled pod hears so while it can still go elsewhere. 0: no
	// bound.
	QueueTimeout    time.Duration
	CleanupInterval time.Duration // KV threshold check period
	KV              kvcache.Limits
	// FinishFirst > 0: while a generating request has at most this many
	// tokens left before its max_tokens, no prompt with a full step still
	// to prefill is given prefill work (plan). 0: off.
	FinishFirst int
	// PrefillChunk > 0: while more than one request steps, a step carries
	// at most this many prompt tokens (plan). 0: n_batch.
	PrefillChunk int
	// OnEvict receives prompt hashes no KV entry holds any more. It is
	// called from the loop and must not block (worker/mcreport queues).
	OnEvict func([]prefix.Hash)
	// OnEvictAt, when set, replaces OnEvict and also gets the time the
	// entries were evicted (worker/mcreport sends it along). Same rules.
	OnEvictAt func([]prefix.Hash, time.Time)
	// OnCached receives the hashes of every request that binds a KV entry:
	// a pending eviction report of any of them is stale. Same rules.
	OnCached func([]prefix.Hash)
	Metrics  *Metrics
	Logger   *slog.Logger
}

// DefaultConfig is the configuration the worker ships: the defaults of its
// flags, and of every test that does not say otherwise.
func DefaultConfig() Config {
	return Config{
		MaxQueue: 256, MaxRunning: 8, MaxBatch: 4, MaxOutputTokens: 2048,
		RequestTimeout: 60 * time.Second, QueueTimeout: DefaultQueueTimeout, CleanupInterval: time.Second,
		KV:          kvcache.Limits{MaxItems: 4 << 20, MaxBytes: 1 << 30, Threshold: 0.8},
		FinishFirst: 16, PrefillChunk: 128,
	}
}

// WithDefaults is c with every zero field taken from DefaultConfig, the
// policy knobs too (a negative FinishFirst, PrefillChunk or QueueTimeout
// is off, as their 0 is in New). Tests build their Config this way, so that
// they run the policy the worker ships.
func (c Config) WithDefaults() Config {
	d := DefaultConfig()
	if c.FinishFirst == 0 {
		c.FinishFirst = d.FinishFirst
	}
	if c.PrefillChunk == 0 {
		c.PrefillChunk = d.PrefillChunk
	}
	if c.QueueTimeout == 0 {
		c.QueueTimeout = d.QueueTimeout
	}
	if c.KV.MaxItems == 0 && c.KV.MaxBytes == 0 {
		c.KV.MaxItems, c.KV.MaxBytes = d.KV.MaxItems, d.KV.MaxBytes
	}
	c.defaultCounts(d)
	return c
}

// DefaultQueueTimeout is half the default request timeout: a request
// queued that long behind a full running set would most likely time out
// anyway, and the gateway can still retry it on another pod.
const DefaultQueueTimeout = 30 * time.Second

// defaults fills the fields whose zero means nothing from DefaultConfig.
func (c *Config) defaults() {
	c.defaultCounts(DefaultConfig())
	if c.Metrics == nil {
		c.Metrics = NewMetrics(nil)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

func (c *Config) defaultCounts(d Config) {
	if c.MaxQueue <= 0 {
		c.MaxQueue = d.MaxQueue
	}
	if c.MaxRunning <= 0 {
		c.MaxRunning = d.MaxRunning
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = min(d.MaxBatch, c.MaxRunning)
	}
	if c.MaxOutputTokens <= 0 {
		c.MaxOutputTokens = d.MaxOutputTokens
	}
	if c.RequestTimeout <= 0 {
		c.RequestTimeout = d.RequestTimeout
	}
	if c.CleanupInterval <= 0 {
		c.CleanupInterval = d.CleanupInterval
	}
	if c.KV.Threshold == 0 {
		c.KV.Threshold = d.KV.Threshold
	}
}

// Scheduler owns the engine once Run starts.
type Scheduler struct {
	cfg  Config
	eng  engine.Engine
	info engine.Info
	kv   *kvcache.Owner // seq ids, cells, entries, room and reports, kept together
	m    *Metrics
	vllm *vllmSeries // ExportVLLM's histograms; nil: not exported
	log  *slog.Logger
	wake chan struct{}
	ctl  chan func()

	mu      sync.Mutex
	queue   []*task
	closed  bool
	drain   drainRate // how fast the queue empties into the running set
	running int       // published for Stats
	// published for Stats (the pod's signals to the router): prompt tokens
	// of the running set still to prefill once the step in progress ends,
	// KV cells in use, and those running requests hold; what the steps
	// cost (the fit's), the running set's prefills at that cost, a decode
	// step of the running set and when the step in progress ends.
	setPrefill, kvUsed, kvRunning int
	cost                          Cost
	setPrefills                   []Prefill
	stepSec                       float64
	stepEnd                       time.Time // when the step in progress ends, at its cost
	held                          Held      // a prompt finish first holds (Stats.Held, Left unset)
	heldEnd                       time.Time // when its hold ends, at the step's cost
	// prefixes are what a prompt submitted during the step in progress
	// shares with (kvcache.Owner.Prefixes and the prompts waiting to
	// bind): Stats estimates its uncached tokens against them at once.
	prefixes [][]int

	// loop-owned
	set      []*task  // the running set, in admission order
	releases uint64   // requests that left the running set so far; waiting phases wait for one
	steps    uint64   // batches built so far
	backlog  bool     // requests wait in the queue for a running slot
	fit      stepCost // what a step costs (Stats)
	// unbound are the requests that ended without ever being bound, whose
	// hashes reportUnbound still has to look at.
	unbound []*task
}

// task is one request and what the loop knows of it.
type task struct {
	req     *Request
	h       *Handle
	ctx     context.Context
	stopCtx func() bool
	sampler engine.Sampler
	phase   phase
	final   State // its end, once phase is ended
	seq     int
	toks    []int // prompt + generated; cells hold toks[:past]
	past    int
	nGen    int
	cached  int
	// shareTo: while following, how far the leader's cells will be shared.
	shareTo   int
	submitted time.Time
	admitted  time.Time
	firstAt   time.Time
	lastTokAt time.Time // the last token sampled (vLLM's time per output token)
	// after: a waiting phase (pending after a preemption, swappedOut,
	// waitingRoom) goes on once releases passes it.
	after       uint64
	preemptions int
	bound       bool   // took a seq id once (its hashes are then the Owner's to report)
	startedOver bool   // its cells could not come back into the cache once (step)
	maxTokens   int    // the request's max_tokens, or Config.MaxOutputTokens
	lastStep    uint64 // the step that last evaluated a span of it
	// uncached: the prompt tokens it is expected to compute, estimated
	// once while it waits to bind (0 until then); see publish. early:
	// the same, estimated by Stats against the prefixes of the step in
	// progress for a request submitted during it (0 until then; s.mu).
	uncached, early int
}

// state is t's public State.
func (t *task) state() State {
	if t.phase == ended {
		return t.final
	}
	return t.phase.state()
}

// New builds a scheduler over eng. The pool size is the engine's n_seq_max.
func New(eng engine.Engine, cfg Config) (*Scheduler, error) {
	cfg.defaults()
	if cfg.MaxBatch > cfg.MaxRunning {
		return nil, fmt.Errorf("scheduler: the batch size (%d sequences) must not exceed the running set (%d requests)", cfg.MaxBatch, cfg.MaxRunning)
	}
	info := eng.Info()
	if cfg.KV.BytesPerToken == 0 {
		cfg.KV.BytesPerToken = info.BytesPerToken
	}
	m := cfg.Metrics
	kv, err := kvcache.NewOwner(kvcache.OwnerConfig{
		Limits: cfg.KV, NSeqMax: info.NSeqMax, Cells: eng,
		Reports: reports{evicted: cfg.OnEvict, evictedAt: cfg.OnEvictAt, cached: cfg.OnCached},
		OnEvict: func(cause string) { m.evictions.WithLabelValues(cause).Inc() },
	})
	if err != nil {
		return nil, err
	}
	return &Scheduler{
		cfg: cfg, eng: eng, info: info, kv: kv, m: m, log: cfg.Logger,
		wake: make(chan struct{}, 1), ctl: make(chan func()),
	}, nil
}

// reports adapts the Config callbacks to kvcache.Reports.
type reports struct {
	evicted, cached func([]prefix.Hash)
	evictedAt       func([]prefix.Hash, time.Time)
}

func (r reports) Evicted(hs []prefix.Hash) { r.EvictedAt(hs, time.Now()) }

func (r reports) EvictedAt(hs []prefix.Hash, at time.Time) {
	switch {
	case r.evictedAt != nil:
		r.evictedAt(hs, at)
	case r.evicted != nil:
		r.evicted(hs)
	}
}

func (r reports) Cached(hs []prefix.Hash) {
	if r.cached != nil {
		r.cached(hs)
	}
}

// Info is the engine's description.
func (s *Scheduler) Info() engine.Info { return s.info }

// Pool exposes the seq-id pool (read-only use: metrics, tests).
func (s *Scheduler) Pool() *seqpool.Pool { return s.kv.Pool() }

func (s *Scheduler) signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Submit queues r. It fails at once with ErrQueueFull when the RequestQueue
// is full, ErrTooLong when the prompt cannot fit the context, ErrShutdown
// after Run returned. ctx is the client's: when it ends the request is
// CANCELLED and its seq id released.
func (s *Scheduler) Submit(ctx context.Context, r *Request) (*Handle, error) {
	switch {
	case r.ID == "":
		return nil, fmt.Errorf("%w: request without id", ErrBadInput)
	case len(r.Prompt) == 0:
		return nil, fmt.Errorf("%w: empty prompt", ErrBadInput)
	case len(r.Prompt) > s.info.NCtx:
		return nil, fmt.Errorf("%w: %d prompt tokens, context holds %d", ErrTooLong, len(r.Prompt), s.info.NCtx)
	case r.MaxTokens < 0 || r.MinTokens < 0:
		return nil, fmt.Errorf("%w: negative max_tokens or min_tokens", ErrBadInput)
	case r.MaxTokens > s.cfg.MaxOutputTokens:
		return nil, fmt.Errorf("%w: max_tokens is %d; this worker generates at most %d tokens per request",
			ErrMaxTokens, r.MaxTokens, s.cfg.MaxOutputTokens)
	case r.MaxTokens > 0 && len(r.Prompt)+r.MaxTokens > s.info.NCtx:
		// As OpenAI answers: refuse what cannot be given, rather than run
		// until the context is full and cut the answer short.
		return nil, fmt.Errorf("%w: this worker's context holds %d tokens, and the request asks for %d (%d in the prompt, %d in the completion)",
			ErrMaxTokens, s.info.NCtx, len(r.Prompt)+r.MaxTokens, len(r.Prompt), r.MaxTokens)
	case r.MinTokens > max(r.MaxTokens, s.cfg.MaxOutputTokens):
		return nil, fmt.Errorf("%w: min_tokens %d exceeds the output cap", ErrBadInput, r.MinTokens)
	}
	for _, t := range r.Prompt {
		if t < 0 || t >= s.info.NVocab {
			return nil, fmt.Errorf("%w: token %d outside the vocabulary", ErrBadInput, t)
		}
	}
	for _, t := range r.StopTokenIDs {
		if t < 0 || t >= s.info.NVocab {
			return nil, fmt.Errorf("%w: token id %d is outside the vocabulary of %d", ErrStopTokenID, t, s.info.NVocab)
		}
	}
	maxTokens := r.MaxTokens
	if maxTokens == 0 {
		maxTokens = s.cfg.MaxOutputTokens
	}
	sm := r.Sampler
	if sm == nil {
		var err error
		if sm, err = s.eng.NewSampler(r.Sampling); err != nil {
			return nil, err
		}
	}
	t := &task{
		req: r, h: newHandle(r.ID, s.signal), ctx: ctx, sampler: sm, seq: -1, maxTokens: maxTokens,
		toks: slices.Clip(slices.Clone(r.Prompt)), submitted: time.Now(),
	}
	// Registered before the task is visible to the loop, which calls it.
	t.stopCtx = context.AfterFunc(ctx, s.signal)
	s.mu.Lock()
	var err error
	switch {
	case s.closed:
		err = ErrShutdown
	case len(s.queue) >= s.cfg.MaxQueue:
		err = ErrQueueFull
	case s.overdue(len(s.queue), 0):
		err = s.overdueErr()
	default:
		s.queue = append(s.queue, t)
		s.m.queueDepth.Set(float64(len(s.queue)))
	}
	s.mu.Unlock()
	if err != nil {
		t.stopCtx()
		return nil, err
	}
	s.signal()
	return t.h, nil
}

// Run is the loop; it owns the engine until ctx ends, then fails whatever is
// left with ErrShutdown and returns.
func (s *Scheduler) Run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	nextCleanup := time.Now().Add(s.cfg.CleanupInterval)
	for {
		if ctx.Err() != nil {
			s.shutdown()
			return
		}
		s.runControl()
		now := time.Now()
		s.admit(now)
		s.expire(now)
		s.reportUnbound()
		s.wakeWaiting()
		s.assign()
		s.follow()
		if !now.Before(nextCleanup) {
			s.kv.EvictOverThreshold("threshold")
			nextCleanup = now.Add(s.cfg.CleanupInterval)
		}
		spans, tasks := s.batch()
		s.publish(spans)
		if len(spans) == 0 {
			wait := time.Until(nextCleanup)
			for _, t := range s.set {
				wait = min(wait, time.Until(t.admitted.Add(s.cfg.RequestTimeout)))
			}
			if d, ok := s.queueDeadline(); ok {
				wait = min(wait, time.Until(d))
			}
			timer.Reset(max(wait, time.Millisecond))
			select {
			case <-s.wake:
			case f := <-s.ctl:
				f()
			case <-timer.C:
			case <-ctx.Done():
			}
			if !timer.Stop() {
				select {
				case <-timer.C:
				default:
				}
			}
			continue
		}
		s.step(spans, tasks)
	}
}

func (s *Scheduler) shutdown() {
	s.mu.Lock()
	s.closed = true
	q := s.queue
	s.queue = nil
	s.mu.Unlock()
	for _, t := range q {
		s.end(t, Result{State: Failed, Err: ErrShutdown})
	}
	for _, t := range slices.Clone(s.set) {
		s.finish(t, Result{State: Failed, Err: ErrShutdown})
	}
	s.publish(nil)
}

// Inspect runs fn on the loop goroutine between two steps, so that what it
// sees is consistent. It waits for the loop, or for ctx.
func (s *Scheduler) Inspect(ctx context.Context, fn func(View)) error {
	done := make(chan struct{})
	f := func() {
		st := make(map[string]State, len(s.set))
		for _, t := range s.set {
			st[t.req.ID] = t.state()
		}
		fn(View{KV: s.kv.Books(), Pool: s.kv.Pool(), States: st, Owner: s.kv})
		close(done)
	}
	select {
	case s.ctl <- f:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *Scheduler) runControl() {
	for {
		select {
		case f := <-s.ctl:
			f()
		default:
			return
		}
	}
}
