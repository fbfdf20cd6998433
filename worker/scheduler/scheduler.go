// Package scheduler is the worker's request pipeline (docs/worker.md): a
// bounded RequestQueue in front of a running set, the KV owner (seq ids
// bound to request ids, cells, cache entries: worker/kvcache), and one
// goroutine that owns the engine and runs continuous batching.
//
// Every step the loop puts one decode token of each generating sequence and
// prefill chunks of the others into a single batch of at most n_batch
// tokens, like llama-server and Ollama's runner. A request that gets a seq id
// first adopts the KV entry sharing the longest token prefix with its
// prompt, or follows a running request still writing a longer one, so only
// the rest is prefilled; a finished request leaves its cells behind as such
// an entry. Every exit path (COMPLETED, TIMEOUT, FAILED,
// CANCELLED) ends the work at once and releases the seq id, either back to
// the pool or, on completion, to the cache entry that now holds the cells.
package scheduler

import (
	"cmp"
	"context"
	"errors"
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

// Config are the scheduler's knobs; zero values take the seed's defaults.
type Config struct {
	MaxQueue   int // RequestQueue length; default 256
	MaxRunning int // running set size (maxConcurrentRequests); default 8
	// MaxBatch is the most sequences one step evaluates (maxBatchSize);
	// default 4, at most MaxRunning.
	MaxBatch int
	// MaxOutputTokens caps a request without max_tokens and refuses one
	// asking for more (maxOutContextLength); default 2048.
	MaxOutputTokens int
	RequestTimeout  time.Duration // from entering the running set; default 60 s
	// QueueTimeout bounds the wait in the RequestQueue: a request still
	// queued after it ends TIMEOUT (408) without ever running, so a client
	// behind a stalled pod hears so while it can still go elsewhere.
	// Default DefaultQueueTimeout; negative: no bound.
	QueueTimeout    time.Duration
	CleanupInterval time.Duration // KV threshold check period; default 1 s
	KV              kvcache.Limits
	// OnEvict receives prompt hashes no KV entry holds any more. It is
	// called from the loop and must not block (worker/mcreport queues).
	OnEvict func([]prefix.Hash)
	// OnEvictAt, when set, replaces OnEvict and also gets the time the
	// entries were evicted (worker/mcreport sends it along). Same rules.
	OnEvictAt func([]prefix.Hash, time.Time)
	// OnCached receives the hashes of every request that binds a KV entry:
	// a pending eviction report of any of them is stale. Same rules.
	OnCached func([]prefix.Hash)
	// NoFollow: a request shares only prefix cells already written, never
	// waits for a running request's prefill (benchmarks compare the two).
	NoFollow bool
	// FinishFirst > 0: while a generating request has at most this many
	// tokens left before its max_tokens, no prompt with a full step
	// (n_batch tokens) or more still to prefill is given prefill work: the
	// finishing request's cells would crowd that prefill's attention in
	// llama.cpp's unified cache (and a finished one is parked), while its
	// last decode-only steps are short. Shorter prefills (cache hits,
	// followers' tails) still run beside it. An engine with room aside
	// (engine.Aside) prefills the first such prompt there meanwhile. 0: off.
	FinishFirst int
	// AsideChunk > 0: a prompt prefilled aside takes at most this many
	// tokens per loop iteration while other requests step (each of their
	// steps waits for the chunk); n_batch when nothing else steps. 0:
	// n_batch always.
	AsideChunk int
	// PrefillChunk > 0: while more than one request steps, a step carries
	// at most this many prompt tokens (decodes beside them); a request
	// stepping alone takes a whole n_batch. A step lasts as long as its
	// tokens times the cells they attend over, and every request in it
	// waits for its end: on a crowded cache a full n_batch of one long
	// prompt held a cache hit's first token and every decoding request for
	// seconds (docs/benchmarks.md, session 31). 0: n_batch.
	PrefillChunk int
	Metrics      *Metrics
	Logger       *slog.Logger
}

func (c *Config) defaults() {
	if c.MaxQueue <= 0 {
		c.MaxQueue = 256
	}
	if c.MaxRunning <= 0 {
		c.MaxRunning = 8
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = min(4, c.MaxRunning)
	}
	if c.MaxOutputTokens <= 0 {
		c.MaxOutputTokens = 2048
	}
	if c.RequestTimeout <= 0 {
		c.RequestTimeout = 60 * time.Second
	}
	if c.CleanupInterval <= 0 {
		c.CleanupInterval = time.Second
	}
	if c.QueueTimeout == 0 {
		c.QueueTimeout = DefaultQueueTimeout
	}
	if c.KV.Threshold == 0 {
		c.KV.Threshold = 0.8
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(nil)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// DefaultQueueTimeout is half the default request timeout: a request
// queued that long behind a full running set would most likely time out
// anyway, and the gateway can still retry it on another pod.
const DefaultQueueTimeout = 30 * time.Second

// Scheduler owns the engine once Run starts.
type Scheduler struct {
	cfg   Config
	eng   engine.Engine
	info  engine.Info
	aside engine.Aside   // nil: the engine has no room aside
	kv    *kvcache.Owner // seq ids, cells, entries and reports, kept together
	m     *Metrics
	vllm  *vllmSeries // ExportVLLM's histograms; nil: not exported
	log   *slog.Logger
	wake  chan struct{}
	ctl   chan func()

	mu      sync.Mutex
	queue   []*task
	closed  bool
	drain   drainRate // how fast the queue empties into the running set
	running int       // published for Stats
	// published for Stats (the pod's signals to the router): prompt tokens
	// of the running set still to prefill, KV cells in use, and those
	// running requests hold.
	setPrefill, kvUsed, kvRunning int

	// loop-owned
	set      []*task // the running set, in admission order
	releases uint64  // terminal transitions so far; preempted tasks wait for one
	prefill  []*task // scratch: prefill candidates of one step
	ready    []*task // scratch: sequences with work in one step
	steps    uint64  // batches built so far
	// finishing: the last batch held long prompts back (Config.FinishFirst).
	finishing bool
	asideOf   *task // the task being prefilled aside
	backlog   bool  // requests wait in the queue for a running slot
	// unbound are the requests that ended without ever being bound, whose
	// hashes reportUnbound still has to look at.
	unbound []*task
}

type task struct {
	req         *Request
	h           *Handle
	ctx         context.Context
	stopCtx     func() bool
	sampler     engine.Sampler
	state       State
	seq         int
	toks        []int // prompt + generated; cells hold toks[:past]
	past        int
	nGen        int
	cached      int
	submitted   time.Time
	admitted    time.Time
	firstAt     time.Time
	lastTokAt   time.Time // the last token sampled (vLLM's time per output token)
	waitRel     uint64    // preempted: do not take a seq id before releases passes this
	preemptions int
	following   bool   // waits for a running request to write the prefix it shares
	shareTo     int    // following: how far the leader's cells will be shared
	bound       bool   // took a seq id once (its hashes are then the Owner's to report)
	maxTokens   int    // the request's max_tokens, or Config.MaxOutputTokens
	lastStep    uint64 // the step that last evaluated a span of it
	spanLen     int    // tokens of this task in the current batch
	// asideFrom, aside: toks[asideFrom:aside] were prefilled aside (the
	// KV books hold toks[:asideFrom]) and join the books with the step that
	// brings them into the cache. startedOver: prefilling it aside failed,
	// or its cells out of the cache could not come back (startOver); it
	// prefills in the cache.
	asideFrom, aside int
	startedOver      bool
	// waitRoom: its cells did not fit back into the KV cache; it steps
	// again once releases passes this.
	waitRoom uint64
	// uncached: the prompt tokens it is expected to compute, estimated
	// once while it waits to bind (0 until then); see publish.
	uncached int
	// detached: its client left during the prefill; it goes on writing
	// its prompt's cells for a retry to find, unless requests queue
	// (expire), and then ends CANCELLED keeping them.
	detached bool
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
		Reports:  reports{evicted: cfg.OnEvict, evictedAt: cfg.OnEvictAt, cached: cfg.OnCached},
		OnEvict:  func(cause string) { m.evictions.WithLabelValues(cause).Inc() },
		NoFollow: cfg.NoFollow,
	})
	if err != nil {
		return nil, err
	}
	s := &Scheduler{
		cfg: cfg, eng: eng, info: info, kv: kv, m: m, log: cfg.Logger,
		wake: make(chan struct{}, 1), ctl: make(chan func()),
	}
	if a, ok := eng.(engine.Aside); ok && a.AsideCells() > 0 && cfg.FinishFirst > 0 {
		s.aside = a
	}
	return s, nil
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

// Stats is a snapshot for health answers and the pod's signals.
type Stats struct {
	Queued, Running int
	// PrefillTokens are prompt tokens not yet evaluated, queued or in the
	// running set. A prefix is counted once: a follower counts only what
	// it does not share with its leader, and a request still waiting to
	// run only what neither the KV cache, a running request nor one ahead
	// of it holds or will write (a request queued since the last step
	// counts in full).
	PrefillTokens int
	// KVCellsUsed are the context's cells in use (engines that count them;
	// otherwise the KV-cache manager's tokens, which count a shared prefix
	// once per entry), of KVCells.
	KVCellsUsed, KVCells int
	// KVCellsRunning are the cells running requests hold in the KV cache
	// (a shared prefix once): KVCellsUsed without the idle cache entries'.
	KVCellsRunning int
}

// Stats returns queue and running-set sizes, as of the last step for the
// running set.
func (s *Scheduler) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{Queued: len(s.queue), Running: s.running, PrefillTokens: s.setPrefill, KVCellsUsed: s.kvUsed, KVCells: s.info.NCtx,
		KVCellsRunning: s.kvRunning}
	for _, t := range s.queue {
		if t.uncached > 0 {
			st.PrefillTokens += t.uncached
		} else {
			st.PrefillTokens += len(t.toks)
		}
	}
	return st
}

// cellCounter is implemented by engines that know their used KV cells
// (shared cells once, parked ones not at all).
type cellCounter interface{ UsedCells() int }

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
		s.assign()
		s.follow()
		if !now.Before(nextCleanup) {
			s.kv.EvictOverThreshold("threshold")
			nextCleanup = now.Add(s.cfg.CleanupInterval)
		}
		s.publish()
		spans, tasks := s.batch()
		aside := s.asideTask()
		if len(spans) == 0 && aside == nil {
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
		if len(spans) > 0 {
			s.step(spans, tasks)
		}
		if aside != nil {
			s.prefillAside(aside, len(spans) > 0)
		}
	}
}

// admit moves queued requests into the running set as PENDING.
func (s *Scheduler) admit(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	kept := s.queue[:0]
	for _, t := range s.queue {
		if t.ctx.Err() != nil {
			s.end(t, Result{State: Cancelled, Err: ErrCancelled})
			continue
		}
		if len(s.set) < s.cfg.MaxRunning {
			t.state = Pending
			t.admitted = now
			s.set = append(s.set, t)
			s.drain.admitted(now)
			continue
		}
		// Never ran: it holds no seq id and no cells, only its slot.
		if s.cfg.QueueTimeout > 0 && now.Sub(t.submitted) > s.cfg.QueueTimeout {
			s.end(t, Result{State: Timeout, Err: fmt.Errorf("%w after %v in the queue", ErrQueueTimeout, s.cfg.QueueTimeout)})
			continue
		}
		if s.overdue(len(kept), now.Sub(t.submitted)) {
			s.end(t, Result{State: Failed, Err: s.overdueErr()})
			continue
		}
		kept = append(kept, t)
	}
	clear(s.queue[len(kept):])
	s.queue = kept
	s.backlog = len(kept) > 0
	s.drain.backlog(now, s.backlog)
	s.running = len(s.set)
	s.m.queueDepth.Set(float64(len(s.queue)))
}

// reportUnbound reports the hashes of the requests that ended without
// ever being bound (Owner.Unbound), except those that a request still
// waiting here (queued, or admitted and not bound yet) carries.
func (s *Scheduler) reportUnbound() {
	if len(s.unbound) == 0 {
		return
	}
	carried := map[prefix.Hash]bool{}
	s.mu.Lock()
	for _, t := range s.queue {
		for _, h := range t.req.Hashes {
			carried[h] = true
		}
	}
	s.mu.Unlock()
	for _, t := range s.set {
		if !t.bound {
			for _, h := range t.req.Hashes {
				carried[h] = true
			}
		}
	}
	var hs []prefix.Hash
	for _, t := range s.unbound {
		for _, h := range t.req.Hashes {
			if !carried[h] {
				carried[h] = true // once
				hs = append(hs, h)
			}
		}
	}
	clear(s.unbound)
	s.unbound = s.unbound[:0]
	s.kv.Unbound(hs)
}

// overdue tells whether a request with ahead requests before it in the
// queue, which has already waited waited, would still be queued when its
// QueueTimeout runs out at the rate the queue has lately emptied. Such a
// request is refused (429) now rather than timed out (408) later: its
// client can go elsewhere at once. Caller holds mu.
func (s *Scheduler) overdue(ahead int, waited time.Duration) bool {
	every, ok := s.drain.every()
	return ok && s.cfg.QueueTimeout > 0 && waited+time.Duration(ahead+1)*every > s.cfg.QueueTimeout
}

// overdueErr is what a request overdue gets: ErrQueueFull, a 429.
func (s *Scheduler) overdueErr() error {
	return fmt.Errorf("%w: at the rate it empties, the queue would hold this request past its %v timeout", ErrQueueFull, s.cfg.QueueTimeout)
}

// drainRate measures the mean time between admissions from the queue
// while requests wait in it (so the running set is full and an admission
// follows a request leaving it): the rate a new request's wait is
// estimated from. Guarded by the Scheduler's mu.
type drainRate struct {
	waiting bool          // requests stayed queued after the last admit
	since   time.Time     // the last admission, or when the wait began
	mean    time.Duration // moving mean of the interval; 0: not measured
}

// admitted counts an admission at now.
func (d *drainRate) admitted(now time.Time) {
	if d.waiting {
		gap := now.Sub(d.since)
		if d.mean == 0 {
			d.mean = gap
		} else {
			d.mean += (gap - d.mean) / 8
		}
	}
	d.since = now
}

// backlog records whether requests stay queued after an admit at now.
func (d *drainRate) backlog(now time.Time, waiting bool) {
	if waiting && !d.waiting {
		d.since = now // the interval starts when waiting does
	}
	d.waiting = waiting
}

// every is the measured interval, while requests wait.
func (d *drainRate) every() (time.Duration, bool) {
	return d.mean, d.waiting && d.mean > 0
}

// queueDeadline is when the oldest queued request's wait runs out.
func (s *Scheduler) queueDeadline() (time.Time, bool) {
	if s.cfg.QueueTimeout <= 0 {
		return time.Time{}, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var first time.Time
	for _, t := range s.queue {
		if first.IsZero() || t.submitted.Before(first) {
			first = t.submitted
		}
	}
	return first.Add(s.cfg.QueueTimeout), !first.IsZero()
}

// expire ends running requests whose client left, whose time is up, or whose
// reader asked to stop.
func (s *Scheduler) expire(now time.Time) {
	for _, t := range slices.Clone(s.set) {
		switch {
		case t.detached:
			if s.backlog || now.Sub(t.admitted) > s.cfg.RequestTimeout {
				s.finish(t, Result{State: Cancelled, Err: ErrCancelled})
			}
		case t.ctx.Err() != nil && s.fillsCache(t):
			t.detached = true
		case t.ctx.Err() != nil:
			s.finish(t, Result{State: Cancelled, Err: ErrCancelled})
		case now.Sub(t.admitted) > s.cfg.RequestTimeout:
			// Rare and worth an operator's look: say where the time went.
			s.log.Warn("request timed out in the running set", "request", t.req.ID, "state", t.state,
				"queued", t.admitted.Sub(t.submitted), "prompt_tokens", len(t.req.Prompt), "cached_tokens", t.cached,
				"evaluated", t.past, "generated", t.nGen, "following", t.following, "preemptions", t.preemptions,
				"running", len(s.set))
			s.finish(t, Result{State: Timeout, Err: fmt.Errorf("%w after %v in the running set", ErrTimeout, s.cfg.RequestTimeout)})
		case t.state == Processing && t.nGen > 0 && t.h.stopRequested():
			s.finish(t, Result{State: Completed, Finish: FinishStop})
		}
	}
}

// fillsCache tells whether t, whose client just left, should go on
// prefilling its prompt: the client that left during a long prefill (its
// own timeout, a user pressing stop) often sends the same prompt again at
// once, and finds it cached instead of paying for it twice. Not while
// requests queue for a running slot: they come first.
func (s *Scheduler) fillsCache(t *task) bool {
	return t.state == Processing && t.nGen == 0 && t.past < len(t.toks) && !s.backlog &&
		t != s.asideOf && t.aside == 0
}

// assign gives PENDING requests seq ids in admission order; the first that
// cannot get one waits, and so do those behind it, so nobody starves.
func (s *Scheduler) assign() {
	for _, t := range slices.Clone(s.set) {
		if t.state != Pending {
			continue
		}
		if t.waitRel > 0 && s.releases < t.waitRel {
			return
		}
		if !s.bind(t) {
			return
		}
	}
}

// bind takes a seq id for t through the KV owner, which adopts the longest
// cached prefix (docs/worker.md, "Seq ids and the KV cache") and may make t
// follow a running request that is still writing a longer shared prefix.
// It returns false when every id is held by running requests.
func (s *Scheduler) bind(t *task) bool {
	b, err := s.kv.Bind(t.req.ID, t.toks, t.req.Hashes)
	switch {
	case errors.Is(err, kvcache.ErrNoSeq):
		return false
	case errors.Is(err, kvcache.ErrInUse):
		s.finish(t, Result{State: Failed, Err: fmt.Errorf("%w: request id %q is already in use", ErrBadInput, t.req.ID)})
		return true
	case err != nil:
		s.finish(t, Result{State: Failed, Err: err})
		return true
	}
	t.seq = b.Seq
	t.bound = true
	t.past = b.Reused
	t.following, t.shareTo = b.Leader != "", b.ShareTo
	t.state = Processing
	s.setCached(t)
	return true
}

// setCached records how much of t's prompt it did not compute: what it
// adopted, plus, for a follower, what it took from its leader.
func (s *Scheduler) setCached(t *task) {
	if t.waitRel == 0 { // a recomputed request keeps the count of its first admission
		t.cached = min(t.past, len(t.req.Prompt))
		t.h.setCached(t.cached)
	}
}

// follow catches followers up with their leaders' prefill; one whose
// leader finished its part (or left) goes on by itself.
func (s *Scheduler) follow() {
	for _, t := range s.set {
		if t.state != Processing || !t.following {
			continue
		}
		t.past, t.following = s.kv.Follow(t.req.ID)
		s.setCached(t)
	}
}

// batch builds one step: every generating sequence's next token first (so
// decode latency never waits behind a long prefill), then prefill chunks,
// shortest remaining prefill first, until n_batch tokens. Shortest first is
// what makes a cache hit fast: its few uncached tokens finish in the next
// step instead of waiting for a cold prompt's 512-token chunks to go first.
// Long prompts still take whatever budget is left in every step, so they are
// not starved unless short prefills alone fill every step.
//
// At most MaxBatch sequences take part. When more are ready, those that
// waited longest since their last step go first (then decode before
// prefill, shorter prefill first): every sequence gets a turn within
// ceil(ready/MaxBatch) steps, and decoders cannot lock new prompts out.
func (s *Scheduler) batch() ([]engine.Span, []*task) {
	var spans []engine.Span
	var tasks []*task
	budget := s.info.NBatch
	s.steps++
	s.ready = s.ready[:0]
	for _, t := range s.set {
		t.spanLen = 0
		if s.stepsReady(t) {
			s.ready = append(s.ready, t)
		}
	}
	if len(s.ready) > s.cfg.MaxBatch {
		slices.SortStableFunc(s.ready, func(a, b *task) int {
			if a.lastStep != b.lastStep {
				return cmp.Compare(a.lastStep, b.lastStep)
			}
			return cmp.Compare(len(a.toks)-a.past, len(b.toks)-b.past)
		})
		for _, t := range s.ready[s.cfg.MaxBatch:] {
			t.spanLen = -1 // not in this step
		}
		// Back to admission order for the rules below.
		s.ready = s.ready[:0]
		for _, t := range s.set {
			if t.spanLen == 0 && s.stepsReady(t) {
				s.ready = append(s.ready, t)
			}
		}
	}
	s.prefill = s.prefill[:0]
	finishing := false
	for _, t := range s.ready {
		if s.cfg.FinishFirst > 0 && len(t.toks)-t.past == 1 && t.nGen > 0 && t.maxTokens-t.nGen <= s.cfg.FinishFirst {
			finishing = true
		}
	}
	s.finishing = finishing
	for _, t := range s.ready {
		switch left := len(t.toks) - t.past; {
		case left == 1 && budget > 0:
			spans = append(spans, engine.Span{Seq: t.seq, Pos: t.past, Tokens: t.toks[t.past:], Sampler: t.samplerOf()})
			tasks = append(tasks, t)
			t.spanLen = 1
			budget--
		case left >= 2 && !(finishing && left >= s.info.NBatch):
			s.prefill = append(s.prefill, t)
		}
	}
	// Stable: equal remainders keep admission order (first come, first served).
	slices.SortStableFunc(s.prefill, func(a, b *task) int {
		return (len(a.toks) - a.past) - (len(b.toks) - b.past)
	})
	if c := s.cfg.PrefillChunk; c > 0 && len(spans)+len(s.prefill) > 1 {
		budget = min(budget, c)
	}
	for _, t := range s.prefill {
		if budget == 0 {
			break
		}
		k := min(len(t.toks)-t.past, budget)
		sp := engine.Span{Seq: t.seq, Pos: t.past, Tokens: t.toks[t.past : t.past+k]}
		if t.past+k == len(t.toks) {
			sp.Sampler = t.samplerOf()
		}
		spans = append(spans, sp)
		tasks = append(tasks, t)
		t.spanLen = k
		budget -= k
	}
	clear(s.prefill) // do not pin finished tasks
	clear(s.ready)
	for _, t := range s.set {
		t.spanLen = max(t.spanLen, 0)
	}
	for _, t := range tasks {
		t.lastStep = s.steps
	}
	return spans, tasks
}

// stepsReady tells whether t has tokens for the next step: not while it
// follows a leader, is being prefilled aside, or waits for room.
func (s *Scheduler) stepsReady(t *task) bool {
	return t.state == Processing && !t.following && len(t.toks) > t.past &&
		!(t == s.asideOf && t.aside == 0) && s.releases >= t.waitRoom
}

// asideTask is the task to prefill aside this iteration: the one already
// aside, else, while the batch holds long prompts back for finishing
// requests and no request queues, the first of them (in admission order)
// that fits aside with the prefix it adopted, and in the cache beside the
// others (roomBeside).
// Its last prompt token is left for the step that brings its cells into
// the cache and samples; until then no other task goes aside.
func (s *Scheduler) asideTask() *task {
	if s.aside == nil {
		return nil
	}
	if t := s.asideOf; t != nil {
		if t.state == Processing && t.seq >= 0 {
			if t.aside > 0 {
				return nil // done, waiting for room in the cache
			}
			return t
		}
		s.asideOf = nil
	}
	// While requests queue for a running slot no prompt starts aside: a
	// chunk aside after every step slows the running requests, and the
	// queue drains only as fast as they end (docs/benchmarks.md, session 29).
	if !s.finishing || s.backlog {
		return nil
	}
	for _, t := range s.set {
		if t.state == Processing && !t.following && !t.startedOver && len(t.toks)-t.past >= s.info.NBatch &&
			len(t.toks)-1 <= s.aside.AsideCells() && s.roomBeside(t) >= len(t.toks)-t.past {
			s.asideOf = t
			t.asideFrom = t.past
			return t
		}
	}
	return nil
}

// roomBeside is how many KV cells stay free once the requests running
// beside t have written all they still may: their prompts, their parked
// cells and their outputs up to max_tokens. A prompt prefilled aside lands
// while they run (what it adopted stays in the cache meanwhile); if it
// landed without this room, it or they would wait for room or be
// preempted, which costs more than it saves.
func (s *Scheduler) roomBeside(t *task) int {
	p, _ := s.eng.(kvcache.Parker)
	room := s.info.NCtx - s.usedCells()
	for _, u := range s.set {
		if u == t || u.state != Processing || u.seq < 0 {
			continue
		}
		room -= len(u.toks) - u.past + u.maxTokens - u.nGen
		if p != nil && p.Parked(u.seq) {
			room -= u.past
		}
	}
	return room
}

// prefillAside evaluates t's next chunk aside. On a failure t starts over
// (PENDING, without its cells) and prefills in the cache, as it would
// have without room aside.
func (s *Scheduler) prefillAside(t *task, beside bool) {
	if t != s.asideOf || t.state != Processing || t.seq < 0 {
		return // preempted or ended by this iteration's step
	}
	chunk := s.info.NBatch
	if beside && s.cfg.AsideChunk > 0 {
		chunk = min(chunk, s.cfg.AsideChunk)
	}
	k := min(chunk, len(t.toks)-1-t.past)
	if err := s.aside.PrefillAside(t.seq, t.past, t.toks[t.past:t.past+k]); err != nil {
		s.log.Error("prefill aside failed; prefilling in the KV cache instead", "request", t.req.ID, "err", err)
		s.startOver(t)
		return
	}
	s.m.asideTokens.Add(float64(k))
	t.past += k
	if t.past == len(t.toks)-1 {
		t.aside = t.past
	}
}

// startOver sends t back to PENDING without its cells, to prefill in the
// KV cache as if there were no room aside.
func (s *Scheduler) startOver(t *task) {
	s.release(t)
	t.state = Pending
	t.past, t.aside = 0, 0
	t.startedOver = true
	if s.asideOf == t {
		s.asideOf = nil
	}
}

// step runs the batch, making room when the KV cache is full: first by
// evicting idle entries that hold cells in it (parked ones hold none); then
// requests bringing cells back into the cache wait for room, the newest
// first; then the newest request holding cells in the cache gives them up,
// to host memory if it can (swapOut), else preempted (it returns to PENDING
// and recomputes later). A request alone in a batch that still does not fit
// starts over in the cache, once, if its cells were out of it (llama.cpp
// brings them back only into one run of free cells), else fails.
func (s *Scheduler) step(spans []engine.Span, tasks []*task) {
	for {
		start := time.Now()
		out, err := s.eng.Step(spans)
		if err == nil {
			s.m.stepDuration.Observe(time.Since(start).Seconds())
			s.m.stepBatchToks.Observe(float64(tokens(spans)))
			s.apply(spans, tasks, out)
			return
		}
		if !errors.Is(err, engine.ErrKVFull) {
			s.log.Error("decode failed", "err", err, "sequences", len(spans))
			for _, t := range tasks {
				s.finish(t, Result{State: Failed, Err: fmt.Errorf("decode: %w", err)})
			}
			return
		}
		if s.kv.EvictForRoom("kv_full") {
			continue
		}
		// Requests whose cells are out of the cache (parked, or computed
		// aside) wait for room with their cells kept, while the rest step;
		// of several such requests alone in the step, the newest waits.
		kept := s.withoutReturning(tasks)
		if len(kept) > 0 && len(kept) < len(tasks) {
			for i := len(tasks) - 1; i >= 0; i-- {
				if !slices.Contains(kept, tasks[i]) {
					s.waitForRoom(tasks[i])
					spans, tasks = slices.Delete(spans, i, i+1), slices.Delete(tasks, i, i+1)
				}
			}
			continue
		}
		if len(kept) == 0 && len(tasks) > 1 {
			i := newest(tasks)
			s.waitForRoom(tasks[i])
			spans, tasks = slices.Delete(spans, i, i+1), slices.Delete(tasks, i, i+1)
			continue
		}
		victim := s.newestHolding(true)
		if len(kept) == 0 && victim != nil && victim.admitted.Before(tasks[0].admitted) && s.othersStep(tasks[0]) {
			// Returning alone: it waits for the older requests holding the cells.
			s.waitForRoom(tasks[0])
			return
		}
		if victim == nil {
			victim = s.newestHolding(false) // nothing in the cache holds cells: as before parking
		}
		if victim == nil || (len(tasks) == 1 && victim == tasks[0] && s.holders() == 1) {
			t := tasks[0]
			if len(kept) == 0 && !t.startedOver {
				s.log.Warn("KV cache full: the cells of a request alone cannot come back; it starts over in the cache",
					"request", t.req.ID, "cells", t.past, "used_cells", s.usedCells(), "cells_total", s.info.NCtx)
				s.startOver(t)
				return
			}
			s.finish(t, Result{State: Failed, Err: fmt.Errorf("%w: it needs %d cells and the context has %d",
				ErrNoFit, len(t.toks), s.info.NCtx)})
			return
		}
		// The newest request holding cells in the cache makes room: its
		// cells go to host memory if they can, else it is preempted.
		if !s.swapOut(victim) {
			s.preempt(victim)
		}
		if i := slices.Index(tasks, victim); i >= 0 {
			spans, tasks = slices.Delete(spans, i, i+1), slices.Delete(tasks, i, i+1)
		}
		if len(spans) == 0 {
			return
		}
	}
}

// waitForRoom keeps t out of the steps, its cells kept, until another
// request releases its seq id.
func (s *Scheduler) waitForRoom(t *task) { t.waitRoom = s.releases + 1 }

// othersStep tells whether a request other than t will evaluate tokens
// without waiting for a release: one that waits for room does not.
func (s *Scheduler) othersStep(t *task) bool {
	for _, u := range s.set {
		if u != t && u.state == Processing && (s.stepsReady(u) || u.following || (u == s.asideOf && u.aside == 0)) {
			return true
		}
	}
	return false
}

// newest is the index of the most recently admitted of tasks.
func newest(tasks []*task) int {
	n := 0
	for i, t := range tasks {
		if !t.admitted.Before(tasks[n].admitted) {
			n = i
		}
	}
	return n
}

// newestHolding is the most recently admitted request holding a seq id
// and, with inCache, cells in the KV cache: making room takes cells from
// it first. Parked requests and the one prefilled aside hold none there.
func (s *Scheduler) newestHolding(inCache bool) *task {
	p, _ := s.eng.(kvcache.Parker)
	var v *task
	for _, t := range s.set {
		if t.seq < 0 || inCache && (t == s.asideOf || p != nil && p.Parked(t.seq)) {
			continue
		}
		if v == nil || !t.admitted.Before(v.admitted) {
			v = t
		}
	}
	return v
}

// swapOut moves t's cells to host memory (Owner.Swap) and has it wait for
// room, keeping all it computed: the step that next evaluates it brings
// them back. False when they cannot go (no parking, a leader or follower,
// the park bound).
func (s *Scheduler) swapOut(t *task) bool {
	if t.aside > 0 || !s.kv.Swap(t.req.ID) {
		return false
	}
	s.waitForRoom(t)
	s.m.swaps.Inc()
	s.log.Warn("KV cache full: moved a request's cells to host memory", "request", t.req.ID, "cells", t.past,
		"used_cells", s.usedCells(), "cells_total", s.info.NCtx, "running", len(s.set))
	return true
}

// withoutReturning is tasks but those whose cells the step would first
// bring back into the KV cache: prefilled aside, or parked.
func (s *Scheduler) withoutReturning(tasks []*task) []*task {
	p, _ := s.eng.(kvcache.Parker)
	var kept []*task
	for _, t := range tasks {
		if t.aside == 0 && (p == nil || !p.Parked(t.seq)) {
			kept = append(kept, t)
		}
	}
	return kept
}

// usedCells is how many KV cells some sequence holds: the engine's count
// when it keeps one (shared cells once, parked ones not at all), else the
// cache entries' tokens.
func (s *Scheduler) usedCells() int {
	if cc, ok := s.eng.(cellCounter); ok {
		return cc.UsedCells()
	}
	return int(s.kv.Books().Items())
}

func (s *Scheduler) holders() int {
	n := 0
	for _, t := range s.set {
		if t.seq >= 0 {
			n++
		}
	}
	return n
}

func tokens(spans []engine.Span) int {
	n := 0
	for _, s := range spans {
		n += len(s.Tokens)
	}
	return n
}

// preempt sends t back to PENDING without its cells; it keeps its generated
// tokens and re-prefills prompt and output later (vLLM's recompute).
func (s *Scheduler) preempt(t *task) {
	s.release(t)
	t.state = Pending
	t.past, t.aside = 0, 0
	t.waitRel = s.releases + 1
	t.preemptions++
	s.m.preemptions.Inc()
	s.log.Warn("KV cache full: preempted a request", "request", t.req.ID, "tokens", len(t.toks),
		"used_cells", s.usedCells(), "cells", s.info.NCtx, "running", len(s.set))
}

func (s *Scheduler) apply(spans []engine.Span, tasks []*task, out []int) {
	for i, t := range tasks {
		sp := spans[i]
		if t.aside > 0 {
			// The step brought the cells computed aside into the cache.
			s.kv.Append(t.req.ID, t.toks[t.asideFrom:t.aside]...)
			t.aside = 0
			s.asideOf = nil
		}
		t.past += len(sp.Tokens)
		s.kv.Append(t.req.ID, sp.Tokens...)
		if t.detached && t.past == len(t.toks) {
			s.finish(t, Result{State: Cancelled, Err: ErrCancelled})
			continue
		}
		tok := out[i]
		if tok < 0 {
			continue
		}
		now := time.Now()
		if s.vllm != nil {
			if t.nGen == 0 {
				s.vllm.ttft.Observe(now.Sub(t.submitted).Seconds())
			} else {
				s.vllm.tpot.Observe(now.Sub(t.lastTokAt).Seconds())
			}
		}
		t.lastTokAt = now
		if t.nGen == 0 {
			t.firstAt = now
			s.m.ttft.Observe(t.firstAt.Sub(t.submitted).Seconds())
			s.m.promptTokens.WithLabelValues("cached").Add(float64(t.cached))
			s.m.promptTokens.WithLabelValues("computed").Add(float64(len(t.req.Prompt) - t.cached))
		}
		eog := s.eng.IsEOG(tok) && !t.req.IgnoreEOS
		if (eog || slices.Contains(t.req.StopTokenIDs, tok)) && t.nGen >= t.req.MinTokens {
			s.finish(t, Result{State: Completed, Finish: FinishStop})
			continue
		}
		t.nGen++
		t.toks = append(t.toks, tok)
		s.m.generated.Inc()
		t.h.emit(tok)
		switch {
		case t.nGen >= t.maxTokens:
			s.finish(t, Result{State: Completed, Finish: FinishLength})
		case len(t.toks) >= s.info.NCtx:
			s.finish(t, Result{State: Completed, Finish: FinishLength})
		}
	}
	s.kv.EvictOverThreshold("threshold")
}

// finish ends a running request. COMPLETED keeps its cells as an idle cache
// entry (the seq id passes to the entry), and so do CANCELLED and TIMEOUT
// (Owner.Keep: what it computed stays for a retry); a failure removes the
// cells and returns the id to the pool.
func (s *Scheduler) finish(t *task, r Result) {
	held := t.state == Processing && t.seq >= 0
	switch {
	case held && r.State == Completed:
		s.kv.Finish(t.req.ID)
		t.seq = -1
	case held && (r.State == Cancelled || r.State == Timeout) && t != s.asideOf && t.aside == 0:
		s.kv.Keep(t.req.ID, len(t.req.Prompt))
		t.seq, t.following = -1, false
	default:
		s.release(t)
	}
	s.set = slices.DeleteFunc(s.set, func(x *task) bool { return x == t })
	s.releases++
	s.end(t, r)
	s.kv.EvictOverThreshold("threshold")
}

// samplerOf is the sampler of t's next token, nil while it only writes
// its prompt for the cache (detached).
func (t *task) samplerOf() engine.Sampler {
	if t.detached {
		return nil
	}
	return t.sampler
}

// release drops t's cells and seq id.
func (s *Scheduler) release(t *task) {
	if t.seq < 0 {
		return
	}
	s.kv.Release(t.req.ID)
	t.seq = -1
	t.following = false
}

// end publishes the result; callable for queued and running tasks.
func (s *Scheduler) end(t *task, r Result) {
	if !t.bound && len(t.req.Hashes) > 0 {
		s.unbound = append(s.unbound, t)
	}
	t.state = r.State
	r.PromptTokens = len(t.req.Prompt)
	r.CachedTokens = t.cached
	r.CompletionTokens = t.nGen
	if !t.firstAt.IsZero() {
		r.TTFT = t.firstAt.Sub(t.submitted)
	}
	if t.admitted.IsZero() {
		r.QueueWait = time.Since(t.submitted)
	} else {
		r.QueueWait = t.admitted.Sub(t.submitted)
	}
	if t.stopCtx != nil {
		t.stopCtx()
	}
	s.m.requests.WithLabelValues(r.State.String()).Inc()
	t.h.finish(r)
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
	s.publish()
}

func (s *Scheduler) publish() {
	pending, processing, prefill := 0, 0, 0
	var ahead [][]int // prompts waiting to bind, in the order they will bind
	for _, t := range s.set {
		if t.state == Pending {
			pending++
		} else {
			processing++
		}
		if t.state == Pending && t.nGen == 0 {
			prefill += s.estimate(t, &ahead)
			continue
		}
		if t.nGen == 0 {
			done := t.past
			if t.following {
				// Its leader computes the shared part, and counts it.
				done = max(done, t.shareTo)
			}
			prefill += max(0, len(t.toks)-done)
		}
	}
	used, running := s.usedCells(), s.kv.RunningCells()
	s.mu.Lock()
	for _, t := range s.queue {
		s.estimate(t, &ahead)
	}
	s.running = len(s.set)
	s.setPrefill, s.kvUsed, s.kvRunning = prefill, used, running
	s.mu.Unlock()
	s.m.running.WithLabelValues("PENDING").Set(float64(pending))
	s.m.running.WithLabelValues("PROCESSING").Set(float64(processing))
	books := s.kv.Books()
	idle := books.Idle()
	s.m.seqInUse.WithLabelValues("request").Set(float64(s.kv.Pool().InUse() - idle))
	s.m.seqInUse.WithLabelValues("cache").Set(float64(idle))
	s.m.kvItems.Set(float64(books.Items()))
	s.m.kvBytes.Set(float64(books.Bytes()))
	s.m.kvEntries.WithLabelValues("in_use").Set(float64(books.Len() - idle))
	s.m.kvEntries.WithLabelValues("idle").Set(float64(idle))
}

// View is a read-only look at the loop's books, valid only inside the
// function given to Inspect.
type View struct {
	KV     *kvcache.Manager
	Pool   *seqpool.Pool
	States map[string]State // running set: request id -> PENDING / PROCESSING
	Owner  *kvcache.Owner   // Check() verifies the seq-id/entry invariant
}

// estimate returns the prompt tokens t is expected to compute once bound:
// its prompt minus the longest prefix that the KV cache holds, a running
// request will write, or a request ahead of it (ahead, to which t's prompt
// is appended) will write first. Without it the pod reports each queued
// question about a cached document as a whole prefill, and looks busier
// than a pod that holds nothing. It is estimated once: the cache may
// evict that prefix before t binds, which is rare next to the cost of
// matching every queued prompt at every step.
func (s *Scheduler) estimate(t *task, ahead *[][]int) int {
	if t.uncached == 0 {
		t.uncached = len(t.toks) - s.kv.Shared(t.toks, *ahead)
	}
	*ahead = append(*ahead, t.toks)
	return t.uncached
}

// Inspect runs fn on the loop goroutine between two steps, so that what it
// sees is consistent. It waits for the loop, or for ctx.
func (s *Scheduler) Inspect(ctx context.Context, fn func(View)) error {
	done := make(chan struct{})
	f := func() {
		st := make(map[string]State, len(s.set))
		for _, t := range s.set {
			st[t.req.ID] = t.state
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
