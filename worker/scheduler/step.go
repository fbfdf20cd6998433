package scheduler

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/kvcache"
)

// steps tells whether a request in phase p has tokens for a step.
func (p phase) steps() bool { return p == prefilling || p == decoding || p == filling }

// batch builds the next step from the running set through plan.
func (s *Scheduler) batch() ([]engine.Span, []*task) {
	s.steps++
	var ready []*task
	var cs []candidate
	for _, t := range s.set {
		if t.phase.steps() && len(t.toks) > t.past {
			ready = append(ready, t)
			cs = append(cs, candidate{left: len(t.toks) - t.past, generating: t.nGen > 0, toGo: t.maxTokens - t.nGen, lastStep: t.lastStep})
		}
	}
	slots := plan(cs, planConfig{NBatch: s.info.NBatch, MaxBatch: s.cfg.MaxBatch, FinishFirst: s.cfg.FinishFirst, PrefillChunk: s.cfg.PrefillChunk})
	spans := make([]engine.Span, 0, len(slots))
	tasks := make([]*task, 0, len(slots))
	for _, sl := range slots {
		t := ready[sl.i]
		sp := engine.Span{Seq: t.seq, Pos: t.past, Tokens: t.toks[t.past : t.past+sl.k]}
		if t.past+sl.k == len(t.toks) && t.phase != filling {
			sp.Sampler = t.sampler // the span reaches the end: sample the next token
		}
		spans = append(spans, sp)
		tasks = append(tasks, t)
		t.lastStep = s.steps
	}
	return spans, tasks
}

// step runs the batch; when the KV cache is full, the KV owner decides how
// to make room (Owner.MakeRoom) and step carries it out, until the batch
// fits or is empty. A request whose client left (filling) gives its place
// up first, keeping what it wrote.
func (s *Scheduler) step(spans []engine.Span, tasks []*task) {
	for len(spans) > 0 {
		start := time.Now()
		out, err := s.eng.Step(spans)
		if err == nil {
			took := time.Since(start)
			s.fit.observe(spans, took)
			s.m.stepDuration.Observe(took.Seconds())
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
		if i := slices.IndexFunc(s.set, func(t *task) bool { return t.phase == filling }); i >= 0 {
			t := s.set[i]
			s.finish(t, Result{State: Cancelled, Err: ErrCancelled})
			spans, tasks = without(spans, tasks, t)
			continue
		}
		room := s.kv.MakeRoom(ids(tasks), s.holders())
		t := s.byID(room.ID)
		switch room.Action {
		case kvcache.RoomEvicted:
			continue
		case kvcache.RoomWait:
			s.waitForRoom(t, waitingRoom)
		case kvcache.RoomSwapped:
			s.waitForRoom(t, swappedOut)
			s.m.swaps.Inc()
			s.log.Warn("KV cache full: moved a request's cells to host memory", "request", t.req.ID, "cells", t.past,
				"used_cells", s.kv.UsedCells(), "cells_total", s.info.NCtx, "running", len(s.set))
		case kvcache.RoomPreempt:
			s.preempt(t)
		case kvcache.RoomNone:
			if room.Returning && !t.startedOver {
				s.log.Warn("KV cache full: the cells of a request alone cannot come back; it starts over in the cache",
					"request", t.req.ID, "cells", t.past, "used_cells", s.kv.UsedCells(), "cells_total", s.info.NCtx)
				s.startOver(t)
			} else {
				s.finish(t, Result{State: Failed, Err: fmt.Errorf("%w: it needs %d cells and the context has %d",
					ErrNoFit, len(t.toks), s.info.NCtx)})
			}
		}
		spans, tasks = without(spans, tasks, t)
	}
}

// holders are the running requests holding seq ids, for MakeRoom.
func (s *Scheduler) holders() []kvcache.Holder {
	var hs []kvcache.Holder
	for _, t := range s.set {
		if t.seq >= 0 {
			hs = append(hs, kvcache.Holder{ID: t.req.ID, Admitted: t.admitted, Steps: t.phase.steps() || t.phase == following})
		}
	}
	return hs
}

func (s *Scheduler) byID(id string) *task {
	for _, t := range s.set {
		if t.req.ID == id {
			return t
		}
	}
	return nil
}

func ids(tasks []*task) []string {
	out := make([]string, len(tasks))
	for i, t := range tasks {
		out[i] = t.req.ID
	}
	return out
}

// without drops t's span from the batch, if it has one.
func without(spans []engine.Span, tasks []*task, t *task) ([]engine.Span, []*task) {
	if i := slices.Index(tasks, t); i >= 0 {
		return slices.Delete(spans, i, i+1), slices.Delete(tasks, i, i+1)
	}
	return spans, tasks
}

func tokens(spans []engine.Span) int {
	n := 0
	for _, s := range spans {
		n += len(s.Tokens)
	}
	return n
}

// apply records a step's result: the cells written, the tokens sampled,
// and the ends they bring.
func (s *Scheduler) apply(spans []engine.Span, tasks []*task, out []int) {
	for i, t := range tasks {
		sp := spans[i]
		t.past += len(sp.Tokens)
		s.kv.Append(t.req.ID, sp.Tokens...)
		if t.phase == filling && t.past == len(t.toks) {
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
		t.phase = decoding
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
