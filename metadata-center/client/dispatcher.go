package client

import (
	"context"
	"hash/maphash"
	"log/slog"
	"sync"
	"time"
)

// Task is one asynchronous update.
type Task struct {
	// Name labels logs and metrics ("add_request", "first_token", ...).
	Name string
	// Key orders tasks: tasks with the same key run one after another in
	// Dispatch order. Use the request id, so that a request's
	// add → first token → done never overtake each other (a done that
	// overtook its add would leave a lease behind until it expires).
	Key string
	// Run does the work within ctx (bounded by the per-task timeout).
	Run func(ctx context.Context) error
	// Done, if set, learns the outcome (nil on success) after Run.
	Done func(err error)
}

// DispatcherOptions configure NewDispatcher. Zero values take defaults.
type DispatcherOptions struct {
	Workers   int           // default 4
	QueueSize int           // total queued tasks, split evenly over workers; default 4096
	Timeout   time.Duration // per task; default 500ms
	// OnDrop is called (never blocking the caller for long) for a task
	// refused because its queue is full or the dispatcher is closed.
	OnDrop func(Task)
	// OnResult is called after each task ran.
	OnResult func(t Task, err error, took time.Duration)
}

// Dispatcher runs tasks on a fixed set of workers, each with its own bounded
// queue; a task's key picks the worker, which keeps one request's updates in
// order. Dispatch never blocks. Safe for concurrent use.
type Dispatcher struct {
	opts   DispatcherOptions
	seed   maphash.Seed
	queues []chan Task
	ctx    context.Context // cancelled when Close gives up draining
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.RWMutex // guards closed against sends on closed channels
	closed bool
}

// NewDispatcher starts the workers.
func NewDispatcher(o DispatcherOptions) *Dispatcher {
	if o.Workers <= 0 {
		o.Workers = 4
	}
	if o.QueueSize <= 0 {
		o.QueueSize = 4096
	}
	if o.Timeout <= 0 {
		o.Timeout = 500 * time.Millisecond
	}
	per := max(1, o.QueueSize/o.Workers)
	d := &Dispatcher{opts: o, seed: maphash.MakeSeed(), queues: make([]chan Task, o.Workers)}
	d.ctx, d.cancel = context.WithCancel(context.Background())
	for i := range d.queues {
		d.queues[i] = make(chan Task, per)
		d.wg.Add(1)
		go d.work(d.queues[i])
	}
	return d
}

// Dispatch queues t without blocking; false means it was dropped (queue
// full or dispatcher closed) and OnDrop was called.
func (d *Dispatcher) Dispatch(t Task) bool {
	q := d.queues[maphash.String(d.seed, t.Key)%uint64(len(d.queues))]
	d.mu.RLock()
	ok := false
	if !d.closed {
		select {
		case q <- t:
			ok = true
		default:
		}
	}
	d.mu.RUnlock()
	if !ok && d.opts.OnDrop != nil {
		d.opts.OnDrop(t)
	}
	return ok
}

// Pending returns the number of queued tasks.
func (d *Dispatcher) Pending() int {
	n := 0
	for _, q := range d.queues {
		n += len(q)
	}
	return n
}

func (d *Dispatcher) work(q chan Task) {
	defer d.wg.Done()
	for t := range q {
		d.run(t)
	}
}

// run executes one task. Inside Envoy a panic on this goroutine aborts the
// whole proxy, so it is recovered here and the task counts as failed.
func (d *Dispatcher) run(t Task) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(d.ctx, d.opts.Timeout)
	defer cancel()
	defer func() {
		if e := recover(); e != nil {
			slog.Error("mcclient: panic in an asynchronous task", "key", t.Key, "panic", e)
		}
	}()
	err := d.ctx.Err()
	if err == nil {
		err = t.Run(ctx)
	}
	cancel()
	if t.Done != nil {
		t.Done(err)
	}
	if d.opts.OnResult != nil {
		d.opts.OnResult(t, err, time.Since(start))
	}
}

// Close stops accepting tasks and lets the workers drain their queues for at
// most bound; past it, running tasks are cancelled and the rest fail at once
// with context.Canceled. It returns when every worker has exited.
func (d *Dispatcher) Close(bound time.Duration) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return
	}
	d.closed = true
	for _, q := range d.queues {
		close(q)
	}
	d.mu.Unlock()

	done := make(chan struct{})
	go func() {
		d.wg.Wait()
		close(done)
	}()
	t := time.NewTimer(bound)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		d.cancel()
		<-done
	}
	d.cancel()
}
