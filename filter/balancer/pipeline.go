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

// Recorder is implemented by a scorer that learns from each decision of its
// profile (the EPP's prefix index): Chosen is called with the decision's
// State and the chosen host's index in s.Hosts once the profile has picked.
type Recorder interface {
	Chosen(s *State, i int)
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

func (PrefixScorer) ReadsSignals() bool       { return false }
func (SeedLoad) ReadsSignals() bool           { return false }
func (PrefillScorer) ReadsSignals() bool      { return false }
func (LeastRequestScorer) ReadsSignals() bool { return false }
func (QueueScorer) ReadsSignals() bool        { return true }
func (KVCacheScorer) ReadsSignals() bool      { return true }

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
			var removed []string // for the debug line, only when it is on
			for _, i := range idx {
				if f.Keep(s, &all[i]) {
					kept = append(kept, i)
				} else if obs != nil && obs.debug {
					removed = append(removed, all[i].Address)
				}
			}
			if len(removed) > 0 {
				obs.log.LogAttrs(context.Background(), slog.LevelDebug, "filter",
					slog.String("cluster", s.Cluster), slog.String("profile", p.Name), slog.String("filter", f.Name()),
					slog.Any("removed", removed))
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
	for _, w := range p.Scorers {
		if r, ok := w.Scorer.(Recorder); ok && w.weight(s.Rule) != 0 {
			r.Chosen(s, i)
		}
	}
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
	ScorerPrefix       = "prefix"        // cached share of the prompt
	ScorerSeedLoad     = "seed_load"     // the seed's request term, W2·delta/5 past delta 5
	ScorerSeedPrefill  = "seed_prefill"  // the seed's prefill term: others' queued prompt
	ScorerLeastRequest = "least_request" // live requests, min–max normalised
	ScorerQueue        = "queue"         // the pod's own waiting requests (pod signals)
	ScorerKVCache      = "kv_cache"      // the pod's free KV cache (pod signals)
)

// Built-in picker names (lb rule key `picker`). No filter is built in; the
// rule's `filters` names those registered from Go.
const (
	PickerTopPercent = "top_percent" // uniform among the top candidate_percent
	PickerMaxScore   = "max_score"   // the best score, ties at random
)

// PrefixScorer is the cached share of the prompt on each pod.
type PrefixScorer struct{}

func (PrefixScorer) Name() string { return ScorerPrefix }

func (PrefixScorer) Score(s *State, out []float64) {
	for i := range s.Hosts {
		out[i] = s.Hosts[i].CacheRatio
	}
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

// PrefillScorer is the seed's prefill term as a score, 1 − prompt/maxPrompt:
// the prompt bytes before first token the metadata center counts on each
// pod (plus this gateway's own not yet counted).
type PrefillScorer struct{}

func (PrefillScorer) Name() string { return ScorerSeedPrefill }

func (PrefillScorer) Score(s *State, out []float64) {
	maxPrompt := 0.0
	for i := range s.Hosts {
		maxPrompt = max(maxPrompt, float64(s.Hosts[i].Prompt))
	}
	for i := range s.Hosts {
		if maxPrompt > 0 {
			out[i] = 1 - float64(s.Hosts[i].Prompt)/maxPrompt
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

// Built-in profile names (lb rule key `policy`), beside the plain policies.
const (
	ProfileSeed = "seed" // the seed's formula exactly
	ProfileEPP  = "epp"  // llm-d EPP's default profile (standins.go)
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
		eppProfile(NewEPPPrefix()),
	}
}

// builtinScorers returns every built-in scorer by name.
func builtinScorers() map[string]Scorer {
	m := map[string]Scorer{}
	for _, s := range []Scorer{PrefixScorer{}, SeedLoad{}, PrefillScorer{}, LeastRequestScorer{}, QueueScorer{}, KVCacheScorer{}} {
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
