package scheduler

import (
	"cmp"
	"slices"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/kvcache"
	"github.com/istio-llm-filter/istio-llm-filter/worker/seqpool"
)

// Stats is a snapshot for health answers and the pod's signals.
type Stats struct {
	Queued, Running int
	// Blocked are the queued requests the running set has no place for:
	// the others join it at the next step, so they wait for a step, not
	// for a running request to end.
	Blocked int
	// PrefillTokens are prompt tokens not yet evaluated, queued or in the
	// running set, as of the end of the step in progress (StepLeft). A
	// prefix is counted once: a follower counts only what it does not
	// share with its leader, and a request still waiting to
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
	// MaxRunning is the running set's size (Config.MaxRunning).
	MaxRunning int
	// Cost is what the pod's steps cost (stepCost; zero until known);
	// Prefills are the requests' PrefillTokens one by one with their
	// compute at that cost (each after the cells it follows), shortest
	// first, as plan serves them; StepSeconds a decode step of the
	// running set with one more sequence sampling (a new request's first
	// token).
	Cost        Cost
	Prefills    []Prefill
	StepSeconds float64
	// StepLeft is how long the step in progress has still to run, at its
	// cost (0 when none runs or the cost is not known): a request that
	// arrives now waits for it, then for the Prefills ahead of it, which
	// count what is left once it ends.
	StepLeft float64
	// Held is the prompt finish first holds back while the answers about
	// to end decode (Config.FinishFirst), where nothing else runs: once
	// they have ended it steps alone, a whole n_batch, and a request
	// arriving then waits for that step. Zero when none is held so.
	Held Held
}

// Held is a prompt held by finish first (Stats.Held): Tokens it has left to
// prefill, the Step it takes once released, in seconds at the pod's cost,
// and how long until then (Left: the answers' last tokens, from now).
type Held struct {
	Tokens     int
	Step, Left float64
}

// Prefill is one request's prompt tokens still to compute and their cost.
type Prefill struct {
	Tokens  int
	Seconds float64
}

// maxPrefills bounds the requests Stats lists one by one: past it the
// longest are summed into the last entry (a request waits only for those
// shorter than itself, and these are the longest).
const maxPrefills = 32

// sortedPrefills sorts ps shortest first and sums those past maxPrefills
// into the last kept entry.
func sortedPrefills(ps []Prefill) []Prefill {
	slices.SortStableFunc(ps, func(a, b Prefill) int { return cmp.Compare(a.Tokens, b.Tokens) })
	if len(ps) > maxPrefills {
		last := &ps[maxPrefills-1]
		for _, p := range ps[maxPrefills:] {
			last.Tokens, last.Seconds = p.Tokens, last.Seconds+p.Seconds
		}
		ps = ps[:maxPrefills]
	}
	return ps
}

// KVUsage is the fraction of the KV cells running requests hold: idle
// cached cells count as free, as in vLLM's kv_cache_usage_perc (they are
// evicted as soon as room is needed). 0 without a context.
func (st Stats) KVUsage() float64 {
	if st.KVCells == 0 {
		return 0
	}
	return min(1, float64(st.KVCellsRunning)/float64(st.KVCells))
}

// Stats returns queue and running-set sizes, as of the last step for the
// running set.
func (s *Scheduler) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{Queued: len(s.queue), Running: s.running, PrefillTokens: s.setPrefill, KVCellsUsed: s.kvUsed, KVCells: s.info.NCtx,
		KVCellsRunning: s.kvRunning, MaxRunning: s.cfg.MaxRunning, Cost: s.cost, StepSeconds: s.stepSec,
		Prefills: slices.Clone(s.setPrefills), StepLeft: max(0, time.Until(s.stepEnd).Seconds())}
	st.Blocked = max(0, st.Queued-max(0, s.cfg.MaxRunning-st.Running))
	if s.held.Tokens > 0 && len(s.queue) == 0 { // a queued request joins the set: the release step is shared
		st.Held = s.held
		st.Held.Left = max(0, time.Until(s.heldEnd).Seconds())
	}
	// A prompt submitted during the step in progress is estimated at once,
	// not listed whole until the next step's publish: a cache hit queued
	// there is then ahead of a longer request in the router's reading
	// (fewest tokens first), as it is in the worker's order.
	var ahead [][]int
	for _, t := range s.queue {
		n := t.uncached
		if n == 0 {
			if t.early == 0 {
				t.early = len(t.toks) - kvcache.SharedWith(s.prefixes, t.toks, ahead)
			}
			n = t.early
		}
		ahead = append(ahead, t.toks)
		st.PrefillTokens += n
		st.Prefills = append(st.Prefills, Prefill{n, s.cost.Prefill(n, len(t.toks)-n)})
	}
	st.Prefills = sortedPrefills(st.Prefills)
	return st
}

// publish sets what Stats reports, for the step about to run (spans, nil
// when none): the running set's prefills as they will stand once it ends,
// and when it will end.
func (s *Scheduler) publish(spans []engine.Span) {
	nPending, nProcessing, prefill := 0, 0, 0
	cost := s.fit.cost()
	inStep := make(map[int]int, len(spans)) // seq id -> tokens it evaluates in the step
	for _, sp := range spans {
		inStep[sp.Seq] += len(sp.Tokens)
	}
	var prefills []Prefill
	nDecoding, attended := 0, 0.0
	var ahead [][]int         // prompts waiting to bind, in the order they will bind
	cached := s.kv.Prefixes() // what the cache holds or running requests write
	for _, t := range s.set {
		if t.phase == pending {
			nPending++
		} else {
			nProcessing++
		}
		if t.phase == pending && t.nGen == 0 {
			n := estimate(t, cached, &ahead)
			prefill += n
			prefills = append(prefills, Prefill{n, cost.Prefill(n, len(t.toks)-n)})
			continue
		}
		if t.nGen == 0 {
			done := t.past
			if t.phase.steps() {
				done += inStep[t.seq]
			}
			if t.phase == following {
				// Its leader computes the shared part, and counts it.
				done = max(done, t.shareTo)
			}
			n := max(0, len(t.toks)-done)
			if n > 0 {
				prefill += n
				prefills = append(prefills, Prefill{n, cost.Prefill(n, done)})
			}
		} else if t.phase == decoding {
			nDecoding++
			attended += pairs(1, t.past)
		}
	}
	step, end := 0.0, time.Time{}
	var held Held
	var heldEnd time.Time
	if cost.Known() {
		step = cost.Base + cost.PerToken*float64(nDecoding) + cost.PerPair*attended + cost.PerSample*float64(nDecoding+1)
		if len(spans) > 0 {
			end = time.Now().Add(time.Duration(cost.Step(spans) * float64(time.Second)))
			held, heldEnd = s.heldBack(inStep, cost, step, end)
		}
	}
	used, running := s.kv.UsedCells(), s.kv.RunningCells()
	prefixes := append(cached, ahead...)
	s.mu.Lock()
	s.prefixes = prefixes
	for _, t := range s.queue {
		estimate(t, cached, &ahead)
	}
	s.running = len(s.set)
	s.setPrefill, s.kvUsed, s.kvRunning = prefill, used, running
	s.cost, s.setPrefills, s.stepSec, s.stepEnd, s.held, s.heldEnd = cost, prefills, step, end, held, heldEnd
	s.mu.Unlock()
	s.m.running.WithLabelValues("PENDING").Set(float64(nPending))
	s.m.running.WithLabelValues("PROCESSING").Set(float64(nProcessing))
	books := s.kv.Books()
	idle := books.Idle()
	s.m.seqInUse.WithLabelValues("request").Set(float64(s.kv.Pool().InUse() - idle))
	s.m.seqInUse.WithLabelValues("cache").Set(float64(idle))
	s.m.kvItems.Set(float64(books.Items()))
	s.m.kvBytes.Set(float64(books.Bytes()))
	s.m.kvEntries.WithLabelValues("in_use").Set(float64(books.Len() - idle))
	s.m.kvEntries.WithLabelValues("idle").Set(float64(idle))
}

// heldBack returns the prompt finish first holds in the step about to run
// (inStep: tokens per seq id in it) where every other request of the
// running set is an answer about to end: they end after the step in
// progress (ending at end) and as many more decode steps (step) as the
// longest of them has tokens to go, and the prompt then steps alone with a
// whole n_batch (plan). It returns the prompt (Left unset) and when it is
// released; zero where none is held so, or other work shares the steps
// after the release.
func (s *Scheduler) heldBack(inStep map[int]int, cost Cost, step float64, end time.Time) (Held, time.Time) {
	if s.cfg.FinishFirst <= 0 {
		return Held{}, time.Time{}
	}
	var prompt *task
	toGo := 0
	for _, t := range s.set {
		switch {
		case t.phase == decoding && t.maxTokens-t.nGen <= s.cfg.FinishFirst:
			toGo = max(toGo, t.maxTokens-t.nGen)
		case t.phase == prefilling && t.nGen == 0 && inStep[t.seq] == 0 && len(t.toks)-t.past >= s.info.NBatch && prompt == nil:
			prompt = t
		default:
			return Held{}, time.Time{}
		}
	}
	if prompt == nil || toGo == 0 {
		return Held{}, time.Time{}
	}
	n := min(len(prompt.toks)-prompt.past, s.info.NBatch)
	sp := engine.Span{Seq: prompt.seq, Pos: prompt.past, Tokens: prompt.toks[prompt.past : prompt.past+n]}
	if prompt.past+n == len(prompt.toks) {
		sp.Sampler = prompt.sampler
	}
	release := end.Add(time.Duration(float64(toGo-1) * step * float64(time.Second)))
	return Held{Tokens: len(prompt.toks) - prompt.past, Step: cost.Step([]engine.Span{sp})}, release
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
// request will write (cached: kvcache.Owner.Prefixes, taken once per
// publish), or a request ahead of it (ahead, to which t's prompt
// is appended) will write first. Without it the pod reports each queued
// question about a cached document as a whole prefill, and looks busier
// than a pod that holds nothing. It is estimated once: the cache may
// evict that prefix before t binds, which is rare next to the cost of
// matching every queued prompt at every step.
func estimate(t *task, cached [][]int, ahead *[][]int) int {
	if t.uncached == 0 {
		t.uncached = len(t.toks) - kvcache.SharedWith(cached, t.toks, *ahead)
	}
	*ahead = append(*ahead, t.toks)
	return t.uncached
}
