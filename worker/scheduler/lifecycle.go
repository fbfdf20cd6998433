package scheduler

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/kvcache"
)

// expire ends running requests whose client left, whose time is up, or
// whose reader asked to stop; a request whose client left during its
// prefill goes on filling the cache (fillsCache) unless requests queue.
func (s *Scheduler) expire(now time.Time) {
	for _, t := range slices.Clone(s.set) {
		switch {
		case t.phase == filling:
			if s.backlog || now.Sub(t.admitted) > s.cfg.RequestTimeout {
				s.finish(t, Result{State: Cancelled, Err: ErrCancelled})
			}
		case t.ctx.Err() != nil && s.fillsCache(t):
			t.phase = filling
		case t.ctx.Err() != nil:
			s.finish(t, Result{State: Cancelled, Err: ErrCancelled})
		case now.Sub(t.admitted) > s.cfg.RequestTimeout:
			// Rare and worth an operator's look: say where the time went.
			s.log.Warn("request timed out in the running set", "request", t.req.ID, "phase", t.phase.String(),
				"queued", t.admitted.Sub(t.submitted), "prompt_tokens", len(t.req.Prompt), "cached_tokens", t.cached,
				"evaluated", t.past, "generated", t.nGen, "preemptions", t.preemptions, "running", len(s.set))
			s.finish(t, Result{State: Timeout, Err: fmt.Errorf("%w after %v in the running set", ErrTimeout, s.cfg.RequestTimeout)})
		case t.phase.holdsSeq() && t.nGen > 0 && t.h.stopRequested():
			s.finish(t, Result{State: Completed, Finish: FinishStop})
		}
	}
}

// fillsCache tells whether t, whose client just left, should go on
// prefilling its prompt: the client that left during a long prefill (its
// own timeout, a user pressing stop) often sends the same prompt again at
// once, and finds it cached instead of paying for it twice. Not while
// requests queue for a running slot: they come first. A follower ends at
// once, keeping what it took: its leader writes the rest.
func (s *Scheduler) fillsCache(t *task) bool {
	return t.phase == prefilling && t.nGen == 0 && t.past < len(t.toks) && !s.backlog
}

// assign gives pending requests seq ids in admission order; the first that
// cannot get one waits, and so do those behind it, so nobody starves.
func (s *Scheduler) assign() {
	for _, t := range slices.Clone(s.set) {
		if t.phase != pending {
			continue
		}
		if s.releases < t.after {
			return // preempted: waits for a request to leave first
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
	t.shareTo = b.ShareTo
	if b.Leader != "" {
		t.phase = following
	} else {
		t.resume()
	}
	s.setCached(t)
	return true
}

// setCached records how much of t's prompt it did not compute: what it
// adopted, plus, for a follower, what it took from its leader.
func (s *Scheduler) setCached(t *task) {
	if t.preemptions == 0 { // a recomputed request keeps the count of its first admission
		t.cached = min(t.past, len(t.req.Prompt))
		t.h.setCached(t.cached)
	}
}

// follow catches followers up with their leaders' prefill; one whose
// leader finished its part (or left) goes on by itself.
func (s *Scheduler) follow() {
	for _, t := range s.set {
		if t.phase != following {
			continue
		}
		held, waiting := s.kv.Follow(t.req.ID)
		t.past = held
		if !waiting {
			t.resume()
		}
		s.setCached(t)
	}
}

// waitForRoom keeps t out of the steps, its cells kept, until a request
// leaves the running set.
func (s *Scheduler) waitForRoom(t *task, p phase) {
	t.phase = p
	t.after = s.releases + 1
}

// wake moves the requests waiting for room whose wait is over back to
// their work.
func (s *Scheduler) wakeWaiting() {
	for _, t := range s.set {
		if t.phase.waits() && s.releases >= t.after {
			t.resume()
		}
	}
}

// preempt sends t back to pending without its cells; it keeps its
// generated tokens and re-prefills prompt and output later (vLLM's
// recompute), once a request has left.
func (s *Scheduler) preempt(t *task) {
	s.release(t)
	t.phase = pending
	t.past = 0
	t.after = s.releases + 1
	t.preemptions++
	s.m.preemptions.Inc()
	s.log.Warn("KV cache full: preempted a request", "request", t.req.ID, "tokens", len(t.toks),
		"used_cells", s.kv.UsedCells(), "cells", s.info.NCtx, "running", len(s.set))
}

// startOver sends t back to pending without its cells, to compute them
// again in the KV cache: they were out of it and could not come back.
func (s *Scheduler) startOver(t *task) {
	s.release(t)
	t.phase = pending
	t.past = 0
	t.startedOver = true
}

// finish ends a running request. COMPLETED keeps its cells as an idle cache
// entry (the seq id passes to the entry), and so do CANCELLED and TIMEOUT
// (Owner.Keep: what it computed stays for a retry); a failure removes the
// cells and returns the id to the pool.
func (s *Scheduler) finish(t *task, r Result) {
	held := t.phase.holdsSeq() && t.seq >= 0
	switch {
	case held && r.State == Completed:
		s.kv.Finish(t.req.ID)
		t.seq = -1
	case held && (r.State == Cancelled || r.State == Timeout):
		s.kv.Keep(t.req.ID, len(t.req.Prompt))
		t.seq = -1
	default:
		s.release(t)
	}
	s.set = slices.DeleteFunc(s.set, func(x *task) bool { return x == t })
	s.releases++
	s.end(t, r)
	s.kv.EvictOverThreshold("threshold")
}

// release drops t's cells and seq id.
func (s *Scheduler) release(t *task) {
	if t.seq < 0 {
		return
	}
	s.kv.Release(t.req.ID)
	t.seq = -1
}

// end publishes the result; callable for queued and running tasks.
func (s *Scheduler) end(t *task, r Result) {
	if !t.bound && len(t.req.Hashes) > 0 {
		s.unbound = append(s.unbound, t)
	}
	t.phase, t.final = ended, r.State
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
