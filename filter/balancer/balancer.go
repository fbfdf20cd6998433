// Package balancer chooses the pod for a request (seed 002 §4, ChooseServer):
// label-selector filtering, then a per-cluster Policy over what the metadata
// center says about load and cached prefixes, corrected by this gateway's own
// in-flight requests that the metadata center does not know about yet.
//
// The default policy, cache_aware, is the seed's score kept exactly
// (DESIGN §5):
//
//	score = W1·cacheRatio − W2'·(reqs−minReqs)/delta − W3·prompt/maxPrompt
//	delta = max(2, maxReqs−minReqs); W2' = W2·delta/5 when delta > 5
//
// sorted descending, then a uniform pick among the top
// max(1, n·candidate_percent/100). Four things are added on top: ties go
// to the pod with the fewest recent requests, then at random (equal scores
// do not pile onto the first pod listed, nor onto a pod whose conversations
// just happen to be between turns);
// reqs/prompt include requests this gateway routed but the metadata center
// has not yet been told of (Tracker), so a burst between updates spreads out;
// and while any pod has prefill pending, a pod's prompt term counts the
// request's own prefill there, L·(1−cacheRatio), so that it weighs the
// prefill standing before the request's first token on that pod. The seed's
// term counts only others' pending prefill: a pod that holds the prefix but
// has just started a cold prompt then scores the full penalty, and the
// request goes to an idle pod where it prefills all L again (on 8 simulated
// pods this halved shared-prefix TTFT p90; docs/benchmarks.md). And herd
// control (rule.HerdShare): a pod that has taken more than HerdShare times
// its fair share of the cluster's recent decisions and is busier than the
// idlest pod gets no cache credit. The seed's weights keep a prompt that
// everyone sends on its pod until that pod has ten more requests than the
// idlest, which on small pods queues what an idle pod could serve; with it
// the prompt is copied to more pods. The seed's worked example still picks
// B with both (B is the idlest pod, so it is never herded).
package balancer

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// ErrNoEndpoint means no endpoint is left after selector filtering: 404
// "no available endpoint" (seed 002 §8.1).
var ErrNoEndpoint = errors.New("no available endpoint")

// Host is one candidate as a policy sees it.
type Host struct {
	Address    string
	Reqs       int64   // live requests: metadata center + unreported local ones
	Prompt     int64   // prompt bytes not yet prefilled, likewise
	CacheRatio float64 // matched leading blocks / total blocks
	// Share is the fraction of the cluster's recent routing decisions that
	// chose this pod, for herd control and cache_aware's tie-break; 0 until
	// there are 2n decisions (Tracker.Routed).
	Share float64
}

// State is the input of one choice. Policies must not keep it.
type State struct {
	Cluster string
	Hosts   []Host
	Rule    config.LBRule
	// PromptLength is the request's prompt size (bytes, like Host.Prompt).
	PromptLength int64
	// IntN returns a uniform int in [0, n); safe for concurrent use.
	IntN func(n int) int

	// floats is scratch for the built-in policies (Balancer.Choose pools it):
	// past 64 hosts their stack buffers spill to the heap on every choice.
	floats []float64
}

// scratch returns two float slices of length n, from s.floats when it is
// big enough.
func (s *State) scratch(n int) (a, b []float64) {
	if cap(s.floats) < 2*n {
		s.floats = make([]float64, 2*n)
	}
	f := s.floats[:2*n]
	return f[:0:n], f[n : n : 2*n]
}

// Policy picks one of State.Hosts and returns its index.
type Policy interface {
	// NeedsMetadata says whether the policy reads load or cache; if not,
	// the metadata center is not queried at all.
	NeedsMetadata() bool
	Choose(s *State) int
}

// View is what the metadata center answered for a cluster.
type View struct {
	Load  api.LoadStats  // host -> stats; nil when degraded
	Cache map[string]int // host -> matched leading blocks
	// Degraded: the query failed or timed out (or there is no metadata
	// center). Load then comes from local accounting only and cache ratios
	// are zero (seed 002 §8.3).
	Degraded bool
}

// Options of New.
type Options struct {
	// IntN overrides the random source (tests); it must be safe for
	// concurrent use. Default: math/rand/v2.IntN.
	IntN func(n int) int
	// Policies adds or replaces policies by name.
	Policies map[string]Policy
}

// Balancer holds the policies, the round-robin counters and the in-flight
// tracker of one engine. Safe for concurrent use.
type Balancer struct {
	intn     func(int) int
	policies map[string]Policy
	tracker  *Tracker
	scratch  sync.Pool // *chooseScratch: 2.5 KiB at 64 pods, per decision
}

// chooseScratch is what one Choose needs; the State is in it because a
// policy is an interface, so &State would otherwise escape to the heap.
type chooseScratch struct {
	hosts  []Host
	floats []float64
	state  State
}

// New builds a balancer with the five built-in policies.
func New(opts Options) *Balancer {
	b := &Balancer{intn: opts.IntN, tracker: NewTracker()}
	if b.intn == nil {
		b.intn = rand.IntN
	}
	b.policies = map[string]Policy{
		config.PolicyCacheAware:   CacheAware{},
		config.PolicyRoundRobin:   NewRoundRobin(),
		config.PolicyRandom:       Random{},
		config.PolicyLeastRequest: LeastRequest{},
		config.PolicyPrefixOnly:   PrefixOnly{},
	}
	for name, p := range opts.Policies {
		b.policies[name] = p
	}
	return b
}

// Tracker returns the in-flight tracker.
func (b *Balancer) Tracker() *Tracker { return b.tracker }

// Policy returns the policy of a name (config validation guarantees it).
func (b *Balancer) Policy(name string) (Policy, error) {
	p, ok := b.policies[name]
	if !ok {
		return nil, fmt.Errorf("unknown load-balancing policy %q", name)
	}
	return p, nil
}

// Filter keeps the endpoints that carry every label of every selector.
// It reuses eps's backing array.
func Filter(eps []endpoints.Endpoint, selectors ...map[string]string) []endpoints.Endpoint {
	n := 0
	for _, s := range selectors {
		n += len(s)
	}
	if n == 0 {
		return eps
	}
	out := eps[:0]
next:
	for _, e := range eps {
		for _, s := range selectors {
			for k, v := range s {
				if got, ok := e.Labels[k]; !ok || got != v {
					continue next
				}
			}
		}
		out = append(out, e)
	}
	return out
}

// Choice is the outcome of Choose.
type Choice struct {
	Host       Host
	Index      int // into the candidates
	Candidates int
}

// Request is what a policy knows of the request being routed.
type Request struct {
	Blocks       int   // prompt hash blocks (for cache ratios)
	PromptLength int64 // prompt bytes
}

// Choose picks a candidate with the rule's policy. cands must already be
// filtered.
func (b *Balancer) Choose(cluster string, rule config.LBRule, cands []endpoints.Endpoint, view View, req Request) (Choice, error) {
	if len(cands) == 0 {
		return Choice{}, ErrNoEndpoint
	}
	p, err := b.Policy(rule.Policy)
	if err != nil {
		return Choice{}, err
	}
	sc, _ := b.scratch.Get().(*chooseScratch)
	if sc == nil {
		sc = new(chooseScratch)
	}
	hosts := slices.Grow(sc.hosts[:0], len(cands))[:len(cands)]
	b.tracker.fill(cluster, cands, view, req.Blocks, hosts)
	sc.state = State{Cluster: cluster, Hosts: hosts, Rule: rule, PromptLength: req.PromptLength, IntN: b.intn, floats: sc.floats}
	i := p.Choose(&sc.state)
	ch := Choice{Host: hosts[i], Index: i, Candidates: len(hosts)}
	b.tracker.Routed(cluster, ch.Host.Address, len(hosts))
	clear(hosts) // do not pin endpoint addresses
	sc.hosts, sc.floats, sc.state = hosts[:0], sc.state.floats, State{}
	b.scratch.Put(sc)
	return ch, nil
}

// Scores computes the seed 002 §4 score of every host, with each host's
// prompt term counting promptLen·(1−cacheRatio) of its own for the request
// while any host has prefill pending (promptLen 0: the seed's score exactly).
func Scores(hosts []Host, rule config.LBRule, promptLen int64, out []float64) []float64 {
	out = out[:0]
	if len(hosts) == 0 {
		return out
	}
	minReqs, maxReqs, maxPending := hosts[0].Reqs, hosts[0].Reqs, int64(0)
	for _, h := range hosts {
		minReqs = min(minReqs, h.Reqs)
		maxReqs = max(maxReqs, h.Reqs)
		maxPending = max(maxPending, h.Prompt)
	}
	// The request's own prefill only matters against others' queued
	// prefill. With no pod prefilling, (1−cacheRatio)·promptLen would just
	// count the cache term a second time (at weight W3) and pile a hot
	// prompt onto the pods that hold it; the prompt term is then off, as in
	// the seed.
	if maxPending == 0 {
		promptLen = 0
	}
	// Herd control: a pod that has been taking more than HerdShare times
	// its fair share of requests and is busier than the idlest pod gets no
	// cache credit, so a prefix that everyone wants is copied to another
	// pod instead of queueing on the few that hold it.
	shareLimit := rule.HerdShare / float64(len(hosts))
	ratio := func(h Host) float64 {
		if rule.HerdShare > 0 && h.Share > shareLimit && h.Reqs > minReqs {
			return 0
		}
		return h.CacheRatio
	}
	prompt := func(h Host) float64 { return float64(h.Prompt) + float64(promptLen)*(1-ratio(h)) }
	maxPrompt := 0.0
	for _, h := range hosts {
		maxPrompt = max(maxPrompt, prompt(h))
	}
	delta := float64(max(2, maxReqs-minReqs))
	w2 := rule.RequestLoadWeight
	if delta > 5 {
		// Float division, as the seed's worked example (6/5 = 1.2) shows.
		w2 = w2 * delta / 5
	}
	for _, h := range hosts {
		s := rule.CacheRatioWeight*ratio(h) - w2*float64(h.Reqs-minReqs)/delta
		if maxPrompt > 0 {
			s -= rule.PrefillLoadWeight * prompt(h) / maxPrompt
		}
		out = append(out, s)
	}
	return out
}

// tieEpsilon treats scores this close as equal: they differ only by
// floating-point noise of the same inputs.
const tieEpsilon = 1e-9

// pickTop implements "sort descending, pick uniformly among the top
// max(1, n·percent/100)" with random tie-breaking: a drawn rank that falls
// on a group of equal scores is replaced by a uniform member of the whole
// group, including members just past the cut, so equal pods are equally
// likely and a better pod's share is unchanged.
//
// It does so without ordering the pods: with T the top-th largest score, the
// pods strictly above T fill ranks 0..g-1 (each rank equally likely, so any
// fixed order of them will do) and the pods at T share the remaining ranks.
func pickTop(scores []float64, percent int, intn func(int) int) int {
	var buf [64]float64
	return pickTopBuf(scores, percent, intn, buf[:0])
}

// pickTopBuf is pickTop sorting a copy of the scores in buf.
func pickTopBuf(scores []float64, percent int, intn func(int) int, buf []float64) int {
	n := len(scores)
	top := max(1, n*percent/100)
	sorted := append(buf[:0], scores...)
	slices.Sort(sorted)
	t := sorted[n-top]
	above, at := 0, 0
	for _, s := range scores {
		switch {
		case s > t+tieEpsilon:
			above++
		case s >= t-tieEpsilon:
			at++
		}
	}
	r := intn(top)
	inGroup := func(s float64) bool { return s > t+tieEpsilon }
	if r >= above {
		r = intn(at)
		inGroup = func(s float64) bool { return s <= t+tieEpsilon && s >= t-tieEpsilon }
	}
	for i, s := range scores {
		if inGroup(s) {
			if r == 0 {
				return i
			}
			r--
		}
	}
	return 0 // unreachable: the group has more than r members
}

// CacheAware is the seed's policy (the default).
type CacheAware struct{}

func (CacheAware) NeedsMetadata() bool { return true }

func (CacheAware) Choose(s *State) int {
	var a, b []float64
	if n := len(s.Hosts); n <= 64 {
		var bufA, bufB [64]float64
		a, b = bufA[:0], bufB[:0]
	} else {
		a, b = s.scratch(n)
	}
	scores := Scores(s.Hosts, s.Rule, s.PromptLength, a)
	// Equal scores go to the pod that has had the fewest recent requests,
	// not a random one: pods that look alike now may not be alike — a pod
	// whose conversations are all between turns is as idle as one with no
	// conversations, but only one of them should get the next one. The
	// nudge (at most shareTieBreak) is far below any difference the
	// weights make, and above tieEpsilon, so it only orders ties.
	for i, h := range s.Hosts {
		scores[i] -= shareTieBreak * h.Share
	}
	return pickTopBuf(scores, s.Rule.CandidatePercent, s.IntN, b)
}

// shareTieBreak orders cache_aware's equal scores by Host.Share.
const shareTieBreak = 1e-6

// Random picks uniformly: a baseline.
type Random struct{}

func (Random) NeedsMetadata() bool { return false }
func (Random) Choose(s *State) int { return s.IntN(len(s.Hosts)) }

// LeastRequest picks the fewest live requests, ties at random.
type LeastRequest struct{}

func (LeastRequest) NeedsMetadata() bool { return true }

func (LeastRequest) Choose(s *State) int {
	return argBest(s, func(h Host) float64 { return -float64(h.Reqs) })
}

// PrefixOnly picks the longest cached prefix, ties at random: what a pure
// cache-affinity router does (and how it herds).
type PrefixOnly struct{}

func (PrefixOnly) NeedsMetadata() bool { return true }

func (PrefixOnly) Choose(s *State) int {
	return argBest(s, func(h Host) float64 { return h.CacheRatio })
}

// argBest returns a uniformly random index among the maxima of key,
// in one pass (reservoir sampling).
func argBest(s *State, key func(Host) float64) int {
	best, bestKey, ties := 0, math.Inf(-1), 0
	for i, h := range s.Hosts {
		k := key(h)
		switch {
		case k > bestKey+tieEpsilon:
			best, bestKey, ties = i, k, 1
		case math.Abs(k-bestKey) <= tieEpsilon:
			ties++
			if s.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// RoundRobin cycles through a cluster's candidates: a baseline. The counter
// is per cluster and survives candidate-list changes (it is taken modulo).
type RoundRobin struct {
	mu   sync.Mutex
	next map[string]uint64
}

// NewRoundRobin returns a round-robin policy with its own counters.
func NewRoundRobin() *RoundRobin { return &RoundRobin{next: map[string]uint64{}} }

func (*RoundRobin) NeedsMetadata() bool { return false }

func (r *RoundRobin) Choose(s *State) int {
	r.mu.Lock()
	n := r.next[s.Cluster]
	r.next[s.Cluster] = n + 1
	r.mu.Unlock()
	return int(n % uint64(len(s.Hosts)))
}
