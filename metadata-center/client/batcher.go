package client

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Batch sends ops in one call (POST /v1/batch), within the update timeout
// unless ctx ends sooner. A metadata center that predates /v1/batch
// (404/405) gets the ops as single calls, in order, from then on.
func (c *Client) Batch(ctx context.Context, ops []api.BatchOp) error {
	if len(ops) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, c.updateTimeout)
	defer cancel()
	if !c.noBatch.Load() {
		var ans api.BatchAnswer
		err := c.do(ctx, "batch", http.MethodPost, api.PathBatch, api.Batch{Ops: ops}, &ans)
		var se *StatusError
		if !errors.As(err, &se) || (se.Status != http.StatusNotFound && se.Status != http.StatusMethodNotAllowed) {
			return err
		}
		c.noBatch.Store(true)
	}
	for _, op := range ops {
		if err := c.single(ctx, op); err != nil {
			return err
		}
	}
	return nil
}

func (c *Client) single(ctx context.Context, op api.BatchOp) error {
	ref := api.RequestRef{Cluster: op.Cluster, Host: op.Host, RequestID: op.RequestID}
	switch op.Op {
	case api.OpAddRequest:
		return c.AddRequest(ctx, api.AddRequest{Cluster: op.Cluster, Host: op.Host, RequestID: op.RequestID, PromptLength: op.PromptLength})
	case api.OpFirstToken:
		return c.FirstToken(ctx, ref)
	case api.OpDone:
		return c.DeleteRequest(ctx, ref)
	case api.OpCacheSave:
		return c.SaveCache(ctx, api.CacheSave{Cluster: op.Cluster, Host: op.Host, Hashes: op.Hashes, ChunkSize: op.ChunkSize, SaveID: op.SaveID,
			RefreshOnly: op.RefreshOnly, AgeMS: op.AgeMS, MaxEntries: op.MaxEntries})
	case api.OpCacheRetract:
		return c.RetractCache(ctx, api.CacheRetract{Cluster: op.Cluster, Host: op.Host, Hashes: op.Hashes, SaveID: op.SaveID})
	}
	return errors.New("metadata center batch: unknown op " + op.Op)
}

// BatcherOptions configure NewBatcher. Zero values take defaults.
type BatcherOptions struct {
	// Window is how long the first update of a batch may wait for others;
	// default 5ms.
	Window time.Duration
	// MaxOps sends a batch as soon as it holds this many updates; default
	// 256, at most api.MaxBatchOps.
	MaxOps int
	// MaxBytes sends a batch once its hashes reach about this size, so it
	// stays well inside the metadata center's body limit; default 256 KiB.
	MaxBytes int
	// QueueSize bounds the updates waiting to be sent; past it new ones
	// are dropped (OnDrop). Default 4096.
	QueueSize int
	// Timeout bounds one batch call; default 500ms.
	Timeout time.Duration
	// OnDrop learns each update refused because the queue is full or the
	// batcher closed.
	OnDrop func(api.BatchOp)
	// OnResult learns each batch's outcome.
	OnResult func(ops []api.BatchOp, err error, took time.Duration)
}

// BatchSender sends one batch; *Client is the real one.
type BatchSender interface {
	Batch(ctx context.Context, ops []api.BatchOp) error
}

type pending struct {
	op     api.BatchOp
	done   func(error)
	urgent bool
	queued time.Time
}

// Batcher coalesces asynchronous updates into batches: one call per window
// or per MaxOps updates, whichever comes first. One goroutine sends the
// batches one after another, so updates leave in the order they were added
// (one request's add, first token and done never overtake each other)
// without any per-request bookkeeping. Add never blocks. Safe for
// concurrent use.
//
// AddUrgent is for updates other gateways must see before they route
// again (a cold request's lease and routing-time save): the batch leaves as
// soon as a window has passed since the previous batch left, which on an
// idle batcher is at once. Under load batches already leave once per
// window, so urgency costs no extra calls there; it only skips the wait
// while the batcher is idle.
type Batcher struct {
	send BatchSender
	o    BatcherOptions

	mu     sync.Mutex
	queue  []pending
	first  time.Time // when the oldest queued update arrived
	last   time.Time // when the previous batch left
	urgent int       // queued urgent updates
	bytes  int
	closed bool
	wake   chan struct{} // 1-buffered: something was queued or Close was called

	n      atomic.Int64 // queued, for Pending
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
}

// NewBatcher starts the sender goroutine.
func NewBatcher(send BatchSender, o BatcherOptions) *Batcher {
	if o.Window <= 0 {
		o.Window = 5 * time.Millisecond
	}
	if o.MaxOps <= 0 {
		o.MaxOps = 256
	}
	o.MaxOps = min(o.MaxOps, api.MaxBatchOps)
	if o.MaxBytes <= 0 {
		o.MaxBytes = 256 << 10
	}
	if o.QueueSize <= 0 {
		o.QueueSize = 4096
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultUpdateTimeout
	}
	b := &Batcher{send: send, o: o, wake: make(chan struct{}, 1), done: make(chan struct{})}
	b.ctx, b.cancel = context.WithCancel(context.Background())
	go b.run()
	return b
}

// opSize estimates an op's share of the request body.
func opSize(op api.BatchOp) int { return 128 + len(op.Cluster) + 19*len(op.Hashes) }

// Add queues op; done, if set, learns its batch's outcome. false means it
// was dropped (queue full or batcher closed) and OnDrop was called.
func (b *Batcher) Add(op api.BatchOp, done func(error)) bool {
	b.mu.Lock()
	if b.closed || len(b.queue) >= b.o.QueueSize {
		b.mu.Unlock()
		if b.o.OnDrop != nil {
			b.o.OnDrop(op)
		}
		return false
	}
	b.push(op, done, false)
	b.mu.Unlock()
	b.poke()
	return true
}

// Update is one update for AddUrgent and who learns its batch's outcome
// (Done may be nil).
type Update struct {
	Op   api.BatchOp
	Done func(error)
}

// AddUrgent queues updates whose batch should not wait out the window
// (see Batcher): they leave one window after the previous batch, at once
// if that is past. They are queued together, so they leave in one batch
// (unless it fills): queued one by one, the first could leave alone and
// hold the rest back for a window. It reports whether every one was
// queued; each one refused was passed to OnDrop.
func (b *Batcher) AddUrgent(us ...Update) bool {
	b.mu.Lock()
	if b.closed || len(b.queue)+len(us) > b.o.QueueSize {
		b.mu.Unlock()
		if b.o.OnDrop != nil {
			for _, u := range us {
				b.o.OnDrop(u.Op)
			}
		}
		return false
	}
	for _, u := range us {
		b.push(u.Op, u.Done, true)
	}
	b.mu.Unlock()
	b.poke()
	return true
}

// push queues one update; b.mu is held.
func (b *Batcher) push(op api.BatchOp, done func(error), urgent bool) {
	now := time.Now()
	if len(b.queue) == 0 {
		b.first = now
	}
	b.queue = append(b.queue, pending{op: op, done: done, urgent: urgent, queued: now})
	if urgent {
		b.urgent++
	}
	b.bytes += opSize(op)
	b.n.Add(1)
}

// poke wakes the sender.
func (b *Batcher) poke() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// Pending returns the number of updates not yet sent.
func (b *Batcher) Pending() int { return int(b.n.Load()) }

// take waits until a batch is due and removes it from the queue; nil once
// closed and drained.
func (b *Batcher) take() []pending {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		b.mu.Lock()
		n, closed := len(b.queue), b.closed
		var wait time.Duration
		if n > 0 {
			wait = b.o.Window - time.Since(b.first)
			if b.urgent > 0 {
				wait = min(wait, b.o.Window-time.Since(b.last))
			}
		}
		if n > 0 && (closed || n >= b.o.MaxOps || b.bytes >= b.o.MaxBytes || wait <= 0) {
			k, size := 0, 0
			for k < n && k < b.o.MaxOps && (k == 0 || size < b.o.MaxBytes) {
				size += opSize(b.queue[k].op)
				if b.queue[k].urgent {
					b.urgent--
				}
				k++
			}
			b.last = time.Now()
			batch := make([]pending, k)
			copy(batch, b.queue)
			rest := copy(b.queue, b.queue[k:])
			clear(b.queue[rest:])
			b.queue = b.queue[:rest]
			b.bytes -= size
			// Leftovers (the batch was full) keep the old window start,
			// so they go right after this batch.
			b.mu.Unlock()
			return batch
		}
		b.mu.Unlock()
		if n == 0 && closed {
			return nil
		}
		if n == 0 {
			<-b.wake
			continue
		}
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		// A wake re-checks the size limits and urgency; the window is unchanged.
		// (Since Go 1.23 Reset never delivers a stale tick.)
		select {
		case <-timer.C:
		case <-b.wake:
		}
	}
}

func (b *Batcher) run() {
	defer close(b.done)
	ops := make([]api.BatchOp, 0, b.o.MaxOps)
	for {
		batch := b.take()
		if batch == nil {
			return
		}
		ops = ops[:0]
		start := time.Now()
		for _, p := range batch {
			op := p.op
			if op.Op == api.OpCacheSave && !op.RefreshOnly {
				// Dated back to when it was made: under load a batch can
				// leave late, after the pod's report of a later eviction
				// (docs/metadata-center.md, "Versions").
				op.AgeMS = start.Sub(p.queued).Milliseconds()
			}
			ops = append(ops, op)
		}
		err := b.ctx.Err()
		if err == nil {
			ctx, cancel := context.WithTimeout(b.ctx, b.o.Timeout)
			err = b.send.Batch(ctx, ops)
			cancel()
		}
		b.n.Add(-int64(len(batch)))
		for _, p := range batch {
			if p.done != nil {
				p.done(err)
			}
		}
		if b.o.OnResult != nil {
			b.o.OnResult(ops, err, time.Since(start))
		}
	}
}

// Close stops accepting updates and sends what is queued for at most
// bound; past it the batch in flight is cancelled and the rest fail at
// once with context.Canceled. It returns when the sender has exited.
func (b *Batcher) Close(bound time.Duration) {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		<-b.done
		return
	}
	b.closed = true
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default:
	}
	t := time.NewTimer(bound)
	defer t.Stop()
	select {
	case <-b.done:
	case <-t.C:
		b.cancel()
		<-b.done
	}
	b.cancel()
}
