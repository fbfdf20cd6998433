package scheduler

import (
	"fmt"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

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
			t.phase = pending
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
