package balancer

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// Scorer rates every candidate in [0,1], 1 best. It writes one value per
// s.Hosts into out (len(out) == len(s.Hosts)) and must not keep s.
type Scorer interface {
	Name() string
	Score(s *State, out []float64)
}

// WeightScaler is implemented by a scorer whose weight grows with the
// spread of its input on one decision: the seed's request-load term, whose
// W2 becomes W2·delta/5 when delta > 5 (docs/configuration.md).
type WeightScaler interface {
	WeightScale(s *State) float64
}

// PodFilter removes candidates before scoring. If it would remove every
// candidate it is skipped for that decision: a filter narrows the choice, it
// never refuses the request.
type PodFilter interface {
	Name() string
	Keep(s *State, h *Host) bool
}

// Picker chooses one index of scores (one per s.Hosts).
type Picker interface {
	Name() string
	Pick(s *State, scores []float64) int
}

// Weighted is one scorer of a profile. Weight is fixed unless FromRule is
// set, which reads it from the lb rule (the seed's W1/W2/W3 keys).
type Weighted struct {
	Scorer   Scorer
	Weight   float64
	FromRule func(config.LBRule) float64
}

func (w Weighted) weight(r config.LBRule) float64 {
	if w.FromRule != nil {
		return w.FromRule(r)
	}
	return w.Weight
}

// Profile is a policy composed of filters, weighted scorers and a picker.
// The lb rule may replace its scorer weights (key `scorers`), filters
// (`filters`) and picker (`picker`) by name; Balancer.Choose resolves them.
type Profile struct {
	Name    string
	Filters []PodFilter
	Scorers []Weighted
	Picker  Picker
	// Metadata says whether the profile reads load, cache or pod signals
	// (Policy.NeedsMetadata); true for every built-in profile.
	Metadata bool
}

// NeedsMetadata implements Policy.
func (p *Profile) NeedsMetadata() bool { return p.Metadata }

// SignalReader is implemented by parts that read the pods' own signals
// (Host.Signals and what comes with it). Filling them costs a map lookup
// per pod, so it is skipped for policies that read none; a policy or part
// registered from Go that does not implement it is assumed to read them.
type SignalReader interface {
	ReadsSignals() bool
}

// readsSignals says whether a filter or a scorer of
// non-zero weight (under rule r) reads pod signals.
func (p *Profile) readsSignals(r config.LBRule) bool {
	reads := func(v any) bool {
		sr, ok := v.(SignalReader)
		return !ok || sr.ReadsSignals()
	}
	for _, f := range p.Filters {
		if reads(f) {
			return true
		}
	}
	for _, w := range p.Scorers {
		if w.weight(r) != 0 && reads(w.Scorer) {
			return true
		}
	}
	return false
}

// Herd control with herd_wait reads the pods' queued prefill.
func (p PrefixScorer) ReadsSignals() bool     { return p.Herd }
func (SeedLoad) ReadsSignals() bool           { return false }
func (p PrefillScorer) ReadsSignals() bool    { return p.Own }
func (LeastRequestScorer) ReadsSignals() bool { return false }
func (RecentShareScorer) ReadsSignals() bool  { return false }
func (QueueScorer) ReadsSignals() bool        { return true }
func (KVCacheScorer) ReadsSignals() bool      { return true }
func (KVFitScorer) ReadsSignals() bool        { return true }
func (ColdProgressScorer) ReadsSignals() bool { return true }
func (KVFull) ReadsSignals() bool             { return true }

// Choose implements Policy without instrumentation (Balancer.Choose runs
// profiles through run, which times and logs each stage).
func (p *Profile) Choose(s *State) int { return p.run(s, nil) }

// stageObserver receives each stage's duration and, when debug logging is
// on, each scorer's scores; nil = neither.
type stageObserver struct {
	b     *Balancer // observe; nil = not timed
	log   *slog.Logger
	debug bool
}

// run filters, scores and picks. Hosts removed by a filter are moved out of
// s.Hosts for the filters after it and for the scorers (which normalise over
// the survivors); the returned index is into the original s.Hosts.
func (p *Profile) run(s *State, obs *stageObserver) int {
	var t0 time.Time
	timed := obs != nil && obs.b != nil
	if timed {
		t0 = time.Now()
	}
	all := s.Hosts
	s.cluster = all
	idx := s.ints(len(all))
	for i := range all {
		idx = append(idx, i)
	}
	if len(p.Filters) > 0 {
		for _, f := range p.Filters {
			n := 0
			for _, i := range idx {
				if f.Keep(s, &all[i]) {
					n++
				}
			}
			if n == 0 || n == len(idx) {
				continue
			}
			kept := idx[:0]
			for _, i := range idx {
				if f.Keep(s, &all[i]) {
					kept = append(kept, i)
				}
			}
			idx = kept
			hosts := s.hosts(len(idx))
			for _, i := range idx {
				hosts = append(hosts, all[i])
			}
			s.Hosts = hosts
		}
		if timed {
			t1 := time.Now()
			obs.b.observe("filters", false, t1.Sub(t0))
			t0 = t1
		}
	}
	n := len(s.Hosts)
	total, one := s.scratch(n)
	total, one = total[:n], one[:n]
	clear(total)
	for _, w := range p.Scorers {
		wt := w.weight(s.Rule)
		if wt == 0 {
			continue
		}
		if ws, ok := w.Scorer.(WeightScaler); ok {
			wt *= ws.WeightScale(s)
		}
		w.Scorer.Score(s, one)
		for i, v := range one {
			total[i] += wt * v
		}
		if obs != nil {
			if obs.debug {
				obs.log.LogAttrs(context.Background(), slog.LevelDebug, "scorer",
					slog.String("cluster", s.Cluster), slog.String("profile", p.Name), slog.String("scorer", w.Scorer.Name()),
					slog.Float64("weight", wt), slog.Any("scores", scoreAttrs(s.Hosts, one)))
			}
			if timed {
				t1 := time.Now()
				obs.b.observe(w.Scorer.Name(), true, t1.Sub(t0))
				t0 = t1
			}
		}
	}
	i := p.Picker.Pick(s, total)
	if obs != nil {
		if obs.debug {
			obs.log.LogAttrs(context.Background(), slog.LevelDebug, "pick",
				slog.String("cluster", s.Cluster), slog.String("profile", p.Name), slog.String("picker", p.Picker.Name()),
				slog.String("host", s.Hosts[i].Address), slog.Any("totals", scoreAttrs(s.Hosts, total)))
		}
		if timed {
			obs.b.observe("picker", false, time.Since(t0))
		}
	}
	s.Hosts = all
	return idx[i]
}

// scoreAttrs renders host -> score for a debug line (only built when debug
// logging is on).
func scoreAttrs(hosts []Host, scores []float64) map[string]float64 {
	m := make(map[string]float64, len(hosts))
	for i, h := range hosts {
		m[h.Address] = math.Round(scores[i]*1e4) / 1e4
	}
	return m
}

// minMax returns the extremes of key over hosts.
func minMax(hosts []Host, key func(*Host) float64) (lo, hi float64) {
	lo, hi = math.Inf(1), math.Inf(-1)
	for i := range hosts {
		v := key(&hosts[i])
		lo, hi = min(lo, v), max(hi, v)
	}
	return lo, hi
}

// lowIsBest writes (hi−v)/(hi−lo) for every host, 1 for all when they are
// equal: the EPP's normalisation of a cost.
func lowIsBest(hosts []Host, out []float64, key func(*Host) float64) {
	lo, hi := minMax(hosts, key)
	for i := range hosts {
		if hi <= lo {
			out[i] = 1
			continue
		}
		out[i] = (hi - key(&hosts[i])) / (hi - lo)
	}
}

// Built-in scorer names (lb rule key `scorers`).
const (
	ScorerPrefix      = "prefix"       // cached share of the prompt
	ScorerPrefixHerd  = "prefix_herd"  // ... with herd control (herd_share)
	ScorerSeedLoad    = "seed_load"    // the seed's request term, W2·delta/5 past delta 5
	ScorerSeedPrefill = "seed_prefill" // the seed's prefill term: others' queued prompt
	ScorerOwnPrefill  = "own_prefill"  // ... plus the request's own uncached prefill
	// ... with the pod's own report of its pending prefill (pod signals)
	ScorerReportedPrefill = "reported_prefill"
	ScorerLeastRequest    = "least_request" // live requests, min–max normalised
	ScorerQueue           = "queue"         // the pod's own waiting requests (pod signals)
	ScorerKVCache         = "kv_cache"      // the pod's free KV cache (pod signals)
	ScorerKVFit           = "kv_fit"        // ... weighed by the prompt share it lacks
	ScorerColdProgress    = "cold_progress" // its reported prefill left, for a prompt no pod holds
	ScorerRecentShare     = "recent_share"  // fewest recent decisions (tie-break)
)

// Built-in picker and filter names (lb rule keys `picker`, `filters`).
const (
	PickerTopPercent = "top_percent" // uniform among the top candidate_percent
	PickerMaxScore   = "max_score"   // the best score, ties at random
	FilterKVFull     = "kv_full"     // drop pods whose KV cache is full and that queue
	FilterHolder     = "holder"      // keep the best holders of a prompt a pod holds nearly all of
	FilterReserve    = "reserve"     // keep the last idle pod from a third copy of a prompt
)

// PrefixScorer is the cached share of the prompt on each pod. With Herd it
// applies herd control: a pod that took more than herd_share times its fair
// share of recent decisions and is busier than the idlest pod scores 0.
type PrefixScorer struct{ Herd bool }

func (p PrefixScorer) Name() string {
	if p.Herd {
		return ScorerPrefixHerd
	}
	return ScorerPrefix
}

func (p PrefixScorer) Score(s *State, out []float64) {
	if !p.Herd {
		for i := range s.Hosts {
			out[i] = s.Hosts[i].CacheRatio
		}
		return
	}
	g := newHerdGate(s)
	for i := range s.Hosts {
		out[i] = g.ratio(s, i)
	}
}

// herdGate is herd control for one decision: which pods lose their cache
// credit.
type herdGate struct {
	shareLimit float64 // 0: herd control on shares off
	minReqs    int64
	// herd_wait and cache_wait (0: off), and for them the two lowest costs
	// (prefill before this request's first token).
	herdWait, cacheWait float64
	floor               costFloor
	promptLength        float64
}

// newHerdGate prepares herd control under s.Rule.
func newHerdGate(s *State) herdGate {
	var g herdGate
	if len(s.Hosts) == 0 {
		return g
	}
	if s.Rule.HerdShare > 0 {
		g.shareLimit = s.Rule.HerdShare / float64(len(s.Hosts))
		g.minReqs = s.Hosts[0].Reqs
		for i := range s.Hosts {
			g.minReqs = min(g.minReqs, s.Hosts[i].Reqs)
		}
		g.herdWait = s.Rule.HerdWait
	}
	g.cacheWait = s.Rule.CacheWait
	if g.herdWait <= 0 && g.cacheWait <= 0 {
		return g
	}
	g.promptLength = float64(s.PromptLength)
	g.floor = lowestCosts(s.Hosts, g.promptLength)
	return g
}

// costFloor is the two lowest prefillCosts of a decision's pods, so that
// every pod is compared with the cheapest other one in O(1).
type costFloor struct{ best, second float64 }

// lowestCosts returns the two lowest prefillCosts among hosts (+Inf where
// there are too few hosts).
func lowestCosts(hosts []Host, promptLength float64) costFloor {
	f := costFloor{math.Inf(1), math.Inf(1)}
	for i := range hosts {
		c := prefillCost(&hosts[i], promptLength)
		switch {
		case c < f.best:
			f.second, f.best = f.best, c
		case c < f.second:
			f.second = c
		}
	}
	return f
}

// exceeds says whether a pod costing c costs more than factor times the
// cheapest other pod: the second lowest for a pod at the lowest (a tie with
// another pod makes the two equal).
func (f costFloor) exceeds(c, factor float64) bool {
	other := f.best
	if c <= f.best {
		other = f.second
	}
	return c > factor*other
}

// cost is prefillCost under the gate's prompt.
func (g *herdGate) cost(h *Host) float64 { return prefillCost(h, g.promptLength) }

// prefillCost is the prefill that stands before the request's first token on h:
// what the pod reports it has still to prefill (its running requests'
// remaining prompt tokens, cache hits already taken off, and its queue),
// else the prompt bytes the metadata center counts before first token;
// plus the part of this prompt h does not hold. Tokens and bytes are mixed:
// equal on byte-level vocabularies; with a BPE vocabulary the pod's queue
// reads ~4× short, which only makes the gates keep a prefix longer.
func prefillCost(h *Host, promptLength float64) float64 {
	queued := float64(h.Prompt)
	if h.Signals {
		queued = float64(h.PrefillQueued)
	}
	return queued + promptLength*(1-h.CacheRatio)
}

// ratio is host i's cache ratio under herd control. With cache_wait a pod
// whose cost exceeds cache_wait times the cheapest other pod's gets no cache
// credit: the request would wait longer there than a cold prefill takes
// elsewhere. Herd control on shares takes it from a pod that took more than
// herd_share/n of the recent decisions and is busier than the idlest — with
// herd_wait, only if waiting there also costs more than herd_wait times a
// copy of the prefix on the cheapest other pod.
func (g *herdGate) ratio(s *State, i int) float64 {
	h := &s.Hosts[i]
	if h.CacheRatio == 0 {
		return 0
	}
	if g.cacheWait > 0 && g.floor.exceeds(g.cost(h), g.cacheWait) {
		return 0
	}
	if g.shareLimit <= 0 || h.Share <= g.shareLimit || h.Reqs <= g.minReqs {
		return h.CacheRatio
	}
	if g.herdWait > 0 && !g.floor.exceeds(g.cost(h), g.herdWait) {
		return h.CacheRatio
	}
	return 0
}

// SeedLoad is the seed's request-load term as a score: 1 − (reqs−min)/delta,
// delta = max(2, max−min), and a weight scale of delta/5 past delta 5, so
// that W2·scale·(1−score) is the seed's W2'·(reqs−min)/delta exactly.
type SeedLoad struct{}

func (SeedLoad) Name() string { return ScorerSeedLoad }

func seedDelta(hosts []Host) (minReqs int64, delta float64) {
	minReqs, maxReqs := hosts[0].Reqs, hosts[0].Reqs
	for i := range hosts {
		minReqs, maxReqs = min(minReqs, hosts[i].Reqs), max(maxReqs, hosts[i].Reqs)
	}
	return minReqs, float64(max(2, maxReqs-minReqs))
}

func (SeedLoad) Score(s *State, out []float64) {
	minReqs, delta := seedDelta(s.Hosts)
	for i := range s.Hosts {
		out[i] = 1 - float64(s.Hosts[i].Reqs-minReqs)/delta
	}
}

func (SeedLoad) WeightScale(s *State) float64 {
	if _, delta := seedDelta(s.Hosts); delta > 5 {
		// Float division, as the seed's worked example (6/5 = 1.2) shows.
		return delta / 5
	}
	return 1
}

// PrefillScorer is the seed's prefill term as a score, 1 − prompt/maxPrompt.
// With Own, while any pod has prefill pending, a pod's prompt also counts the
// request's own uncached prefill there, L·(1−ratio) (ratio under herd
// control when the rule has herd_share): the prefill that stands before the
// request's first token on that pod. With Reported (and Own), a pod's
// pending prefill is what it reports itself while the report is fresh
// (tokens still to prefill, cache hits of running and queued requests
// taken off)
// instead of the metadata center's prompt bytes before first token, which
// count a cached request in full and a half-done prefill whole.
type PrefillScorer struct{ Own, Reported bool }

func (p PrefillScorer) Name() string {
	switch {
	case p.Own && p.Reported:
		return ScorerReportedPrefill
	case p.Own:
		return ScorerOwnPrefill
	}
	return ScorerSeedPrefill
}

// pending is h's prefill before a new request's first token.
func (p PrefillScorer) pending(h *Host) float64 {
	if p.Reported && h.Signals {
		return float64(h.PrefillQueued)
	}
	return float64(h.Prompt)
}

func (p PrefillScorer) Score(s *State, out []float64) {
	promptLen := int64(0)
	var g herdGate
	if p.Own {
		maxPending := 0.0
		for i := range s.Hosts {
			maxPending = max(maxPending, p.pending(&s.Hosts[i]))
		}
		// With no pod prefilling, the request's own prefill would only
		// count the cache term a second time and pile a hot prompt onto its
		// holders: off, as in the seed.
		if maxPending > 0 {
			promptLen = s.PromptLength
			g = newHerdGate(s)
		}
	}
	maxPrompt := 0.0
	for i := range s.Hosts {
		h := &s.Hosts[i]
		ratio := h.CacheRatio
		if promptLen > 0 {
			ratio = g.ratio(s, i)
		}
		v := p.pending(h) + float64(promptLen)*(1-ratio)
		out[i] = v
		maxPrompt = max(maxPrompt, v)
	}
	for i := range out {
		if maxPrompt > 0 {
			out[i] = 1 - out[i]/maxPrompt
		} else {
			out[i] = 1
		}
	}
}

// LeastRequestScorer is live requests (leases plus this gateway's
// unacknowledged ones), min–max normalised.
type LeastRequestScorer struct{}

func (LeastRequestScorer) Name() string { return ScorerLeastRequest }
func (LeastRequestScorer) Score(s *State, out []float64) {
	lowIsBest(s.Hosts, out, func(h *Host) float64 { return float64(h.Reqs) })
}

// QueueScorer is the pod's own count of waiting requests, min–max
// normalised (the EPP's queue scorer). A pod without fresh signals is
// treated as the longest queue: stale figures are never trusted.
type QueueScorer struct{}

func (QueueScorer) Name() string { return ScorerQueue }
func (QueueScorer) Score(s *State, out []float64) {
	hi := 0.0
	for i := range s.Hosts {
		if s.Hosts[i].Signals {
			hi = max(hi, float64(s.Hosts[i].Waiting))
		}
	}
	lowIsBest(s.Hosts, out, func(h *Host) float64 {
		if !h.Signals {
			return hi
		}
		return float64(h.Waiting)
	})
}

// KVCacheScorer is the pod's free KV cache, 1 − utilization (the EPP's
// kv-cache-utilization scorer). Without fresh signals: 0.
type KVCacheScorer struct{}

func (KVCacheScorer) Name() string { return ScorerKVCache }
func (KVCacheScorer) Score(s *State, out []float64) {
	for i := range s.Hosts {
		if s.Hosts[i].Signals {
			out[i] = 1 - min(1, max(0, s.Hosts[i].KVUtil))
		} else {
			out[i] = 0
		}
	}
}

// KVFitScorer is the pod's free KV cache weighed by the share of the
// prompt the pod would have to store anew, 1 − utilization·(1 − cacheRatio):
// a pod's full cache costs a request in proportion to the cells it adds
// there (evicting someone's cached conversation, or being preempted for
// want of room), and a pod that holds the prompt adds few. Without fresh
// signals: 0, as kv_cache.
type KVFitScorer struct{}

func (KVFitScorer) Name() string { return ScorerKVFit }
func (KVFitScorer) Score(s *State, out []float64) {
	for i := range s.Hosts {
		h := &s.Hosts[i]
		if h.Signals {
			out[i] = 1 - min(1, max(0, h.KVUtil))*(1-h.CacheRatio)
		} else {
			out[i] = 0
		}
	}
}

// ColdProgressScorer orders pods by the prefill they report still to do,
// 1 − queued/max, for a prompt that no candidate holds any of: the choice
// is then load alone, and the metadata center's count (each prompt whole
// until its first token) ties pods that each run one prefill however far
// they have got, where the pod's own report knows which is about to
// finish. Where some pod holds part of the prompt it rates every pod 1
// and leaves the choice to the cache and load terms: weighing the reports
// there too moved documents and conversations off their holders.
// Without a fresh report: 0.
type ColdProgressScorer struct{}

func (ColdProgressScorer) Name() string { return ScorerColdProgress }
func (ColdProgressScorer) Score(s *State, out []float64) {
	most := int64(0)
	for i := range s.Hosts {
		h := &s.Hosts[i]
		if h.CacheRatio > 0 {
			for j := range out {
				out[j] = 1
			}
			return
		}
		if h.Signals {
			most = max(most, h.PrefillQueued)
		}
	}
	for i := range s.Hosts {
		switch h := &s.Hosts[i]; {
		case !h.Signals:
			out[i] = 0
		case most == 0:
			out[i] = 1
		default:
			out[i] = 1 - float64(h.PrefillQueued)/float64(most)
		}
	}
}

// RecentShareScorer is 1 − the pod's share of the cluster's recent
// decisions. At a tiny weight it orders ties: pods that look alike now may
// not be — one whose conversations are all between turns looks as idle as
// one with none, but only one of them should get the next conversation.
type RecentShareScorer struct{}

func (RecentShareScorer) Name() string { return ScorerRecentShare }
func (RecentShareScorer) Score(s *State, out []float64) {
	for i := range s.Hosts {
		out[i] = 1 - s.Hosts[i].Share
	}
}

// TopPercent picks uniformly among the top max(1, n·candidate_percent/100)
// scores (the seed's pick), equal scores at random.
type TopPercent struct{}

func (TopPercent) Name() string { return PickerTopPercent }
func (TopPercent) Pick(s *State, scores []float64) int {
	return pickTopBuf(scores, s.Rule.CandidatePercent, s.IntN, s.sortBuf(len(scores)))
}

// MaxScore picks the best score, ties at random (the EPP's max-score picker).
type MaxScore struct{}

func (MaxScore) Name() string { return PickerMaxScore }
func (MaxScore) Pick(s *State, scores []float64) int {
	best, bestV, ties := 0, math.Inf(-1), 0
	for i, v := range scores {
		switch {
		case v > bestV+tieEpsilon:
			best, bestV, ties = i, v, 1
		case math.Abs(v-bestV) <= tieEpsilon:
			ties++
			if s.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// KVFull drops pods that report a full KV cache (utilization ≥ 0.98) and
// requests waiting: a request sent there waits for a running one to finish
// or evicts someone's cached conversation.
type KVFull struct{}

func (KVFull) Name() string { return FilterKVFull }
func (KVFull) Keep(_ *State, h *Host) bool {
	return !h.Signals || h.KVUtil < 0.98 || h.Waiting == 0
}

// Holder keeps only the pods holding the most of the prompt when one holds
// at least holder_ratio of its blocks (0: off): a user's next question, or
// a conversation's next turn, goes where its history is. The load terms
// would otherwise send it to a pod that looks less busy, which computes the
// history again and delays its own users; the worker runs the shortest
// prefill first (docs/worker.md), so a short continuation starts promptly
// even on a busy holder. A holder with requests queued, or with so much
// prefill standing before the request that a copy elsewhere is cheaper by
// far (holder_wait), does not count, and a hot prompt (its holders take
// well over their fair share of the cluster's requests) is left to the
// scorers, as is one no pod holds so much of (a new user of a shared
// document): see State.holders.
type Holder struct{}

func (Holder) Name() string       { return FilterHolder }
func (Holder) ReadsSignals() bool { return true } // the pods' queues
func (Holder) Keep(s *State, h *Host) bool {
	if s.Rule.HolderRatio <= 0 {
		return true
	}
	s.holders()
	return s.hold < s.Rule.HolderRatio || h.CacheRatio >= s.hold && s.counts(h)
}

// Reserve keeps the cluster's only idle pod from a prompt that two or more
// pods already hold at least half of, while one of them keeps up (fewer
// than two requests queued): a shared document copied twice is served by
// its copies, and the idle pod is left for a prompt no pod holds. On real
// shared-prefix, the third copy of a document that had just arrived took
// the last idle pod five seconds before a second document came, which then
// waited 22–29 s behind it and was copied to every pod in turn.
// With two idle pods or more, or none,
// it keeps every pod.
type Reserve struct{}

func (Reserve) Name() string       { return FilterReserve }
func (Reserve) ReadsSignals() bool { return true } // the pods' running and queued requests
func (Reserve) Keep(s *State, h *Host) bool {
	s.reserved()
	return s.reserve < 0 || h != &s.cluster[s.reserve]
}

// shareTieBreak weighs recent_share in cache_aware and seed-with-ties: far
// below any difference the other weights make, above tieEpsilon.
const shareTieBreak = 1e-6

// Built-in profile names (lb rule key `policy`), beside the plain policies.
const (
	ProfileSeed = "seed" // the seed's formula exactly
	ProfileEPP  = "epp"  // llm-d EPP's default: prefix×3, queue×2, kv×2, max score
)

// builtinProfiles returns the profiles New registers.
func builtinProfiles() []*Profile {
	w1 := func(r config.LBRule) float64 { return r.CacheRatioWeight }
	w2 := func(r config.LBRule) float64 { return r.RequestLoadWeight }
	w3 := func(r config.LBRule) float64 { return r.PrefillLoadWeight }
	return []*Profile{
		{
			Name:     ProfileSeed,
			Scorers:  []Weighted{{Scorer: PrefixScorer{}, FromRule: w1}, {Scorer: SeedLoad{}, FromRule: w2}, {Scorer: PrefillScorer{}, FromRule: w3}},
			Picker:   TopPercent{},
			Metadata: true,
		},
		{
			Name:    config.PolicyCacheAware,
			Filters: []PodFilter{Holder{}, Reserve{}},
			Scorers: []Weighted{
				{Scorer: PrefixScorer{Herd: true}, FromRule: w1},
				{Scorer: SeedLoad{}, FromRule: w2},
				{Scorer: PrefillScorer{Own: true}, FromRule: w3},
				// A pod's free KV cache, from its own report, as far as
				// this request would store cells there anew: a new
				// conversation placed on a full pod evicts someone's
				// cached one, while the next turn of a conversation adds
				// little to the pod that holds its history. Free cache
				// alone (kv_cache) cut kv-pressure's TTFT p99 by 12–24%;
				// weighed so, multi-turn's p90 and p99 and kv-pressure's
				// fell further, as new conversations stopped evicting cached ones.
				{Scorer: KVFitScorer{}, Weight: 1},
				// Among pods that each prefill someone else's prompt, the
				// one about to finish, for a prompt nobody holds: kv_fit
				// would take the freest cache (no-sharing's bursts).
				{Scorer: ColdProgressScorer{}, Weight: 0.5},
				{Scorer: RecentShareScorer{}, Weight: shareTieBreak},
			},
			Picker:   TopPercent{},
			Metadata: true,
		},
		{
			Name:     ProfileEPP,
			Scorers:  []Weighted{{Scorer: PrefixScorer{}, Weight: 3}, {Scorer: QueueScorer{}, Weight: 2}, {Scorer: KVCacheScorer{}, Weight: 2}},
			Picker:   MaxScore{},
			Metadata: true,
		},
	}
}

// builtinScorers returns every built-in scorer by name.
func builtinScorers() map[string]Scorer {
	m := map[string]Scorer{}
	for _, s := range []Scorer{PrefixScorer{}, PrefixScorer{Herd: true}, SeedLoad{}, PrefillScorer{}, PrefillScorer{Own: true}, PrefillScorer{Own: true, Reported: true},
		LeastRequestScorer{}, QueueScorer{}, KVCacheScorer{}, KVFitScorer{}, ColdProgressScorer{}, RecentShareScorer{}} {
		m[s.Name()] = s
	}
	return m
}

// withRule returns p with the rule's overrides applied, or p itself when
// the rule has none.
func (b *Balancer) withRule(p *Profile, r config.LBRule) (*Profile, error) {
	if len(r.Scorers) == 0 && r.Picker == "" && r.Filters == nil {
		return p, nil
	}
	q := *p
	if len(r.Scorers) > 0 {
		q.Scorers = make([]Weighted, 0, len(r.Scorers))
		for _, name := range sortedNames(r.Scorers) {
			sc, ok := b.scorers[name]
			if !ok {
				return nil, fmt.Errorf("unknown scorer %q", name)
			}
			q.Scorers = append(q.Scorers, Weighted{Scorer: sc, Weight: r.Scorers[name]})
		}
	}
	if r.Picker != "" {
		pk, ok := b.pickers[r.Picker]
		if !ok {
			return nil, fmt.Errorf("unknown picker %q", r.Picker)
		}
		q.Picker = pk
	}
	if r.Filters != nil {
		q.Filters = make([]PodFilter, 0, len(r.Filters))
		for _, name := range r.Filters {
			f, ok := b.filters[name]
			if !ok {
				return nil, fmt.Errorf("unknown filter %q", name)
			}
			q.Filters = append(q.Filters, f)
		}
	}
	return &q, nil
}
