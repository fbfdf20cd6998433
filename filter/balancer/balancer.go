// Package balancer chooses the pod for a request:
// label-selector filtering, then a per-cluster Policy over what the metadata
// center says about load, cached prefixes and the pods' own signals,
// corrected by this gateway's own in-flight requests that the metadata
// center does not know about yet (Tracker).
//
// Most policies are Profiles: pod filters → scorers (each rates every pod in
// [0,1] and names itself) → a picker, composed from the lb rule (weights per
// scorer, picker, filters), with per-stage latency histograms and per-scorer
// debug logs. Scorers, filters, pickers and whole policies can be registered
// from Go (Options, Balancer.Register*). Built in:
//
//   - seed: the seed's formula exactly,
//     W1·cacheRatio − W2'·(reqs−minReqs)/delta − W3·prompt/maxPrompt with
//     delta = max(2, maxReqs−minReqs), W2' = W2·delta/5 when delta > 5, as
//     the weighted sum of three [0,1] scorers (which differs from it by the
//     constant W2'+W3), uniform pick among the top candidate_percent.
//   - cache_aware (the default): the seed plus herd control (a pod that took
//     more than herd_share times its fair share of recent decisions and is
//     busier than the idlest gets no cache credit, unless waiting there
//     costs at most herd_wait times a copy of the prefix on the cheapest
//     other pod), a holder filter (a user's next question goes where its
//     history is) and a reserve (the last idle pod is kept from a third
//     copy of a prompt), the request's own
//     uncached prefill in the prompt term while any pod prefills, the pod's
//     free KV cache as far as the request adds cells there (kv_fit), for a
//     prompt no pod holds the prefill each pod reports left
//     (cold_progress), and ties ordered by recent share.
//     docs/configuration.md says why each is there.
//   - epp: llm-d's endpoint picker's default profile, a baseline: prefix ×3,
//     queue ×2, KV-cache utilization ×2 (pod signals), max-score pick.
//   - sglang: SGLang router's cache_aware, a baseline (SGLang).
//   - round_robin, random, least_request, prefix_only: baselines.
package balancer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// ErrNoEndpoint means no endpoint is left after selector filtering: 404
// "no available endpoint" (docs/envoy-filter.md).
var ErrNoEndpoint = errors.New("no available endpoint")

// Host is one candidate as a policy sees it.
type Host struct {
	Address    string
	Reqs       int64   // live requests: metadata center + unreported local ones
	Prompt     int64   // prompt bytes not yet prefilled, likewise
	CacheRatio float64 // matched leading blocks / total blocks
	// Share is the fraction of the cluster's recent routing decisions that
	// chose this pod, for herd control and cache_aware's tie-break; 0 until
	// the window stands for 2n of the cluster's decisions (Tracker: with
	// several gateways, fewer of this gateway's own).
	Share float64

	// The pod's own report (View.Signals); only when Signals is true: the
	// metadata center answers fresh reports only, and a pod without one is
	// never assumed idle.
	Signals       bool
	Waiting       int64   // requests queued on the pod
	Running       int64   // requests the pod is running
	KVUtil        float64 // used / total KV cache, 0..1
	PrefillQueued int64   // prompt tokens the pod has still to prefill
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

	// Scratch for the policies (Balancer.Choose pools it): a decision at 64
	// pods would otherwise allocate a few KiB.
	floats []float64
	idx    []int
	kept   []Host
	// cluster is every pod of the decision; Profile.run narrows Hosts to
	// the survivors of each filter in turn.
	cluster []Host
	// For the holder filter, once holdKnown: the largest cache ratio among
	// the pods that can take a continuation, 0 when none can.
	hold      float64
	holdKnown bool
	// For holder_wait, once holdKnown: the two lowest prefill costs
	// among State.Hosts.
	costs costFloor
	// For the reserve filter, once reserveKnown: the index in cluster of
	// the idle pod it keeps, -1 for none.
	reserve      int
	reserveKnown bool
}

// holderQueue is the queue (requests a pod has not yet admitted to its
// running set) at which a holder stops counting. A request can sit in a
// busy pod's queue for one step before the pod admits it; more than one
// means the pod is not keeping up. On a hot prompt that overloaded the
// fleet, holders kept until four were queued refused a request (429) that
// the scorers would have placed elsewhere.
const holderQueue = 2

// hotShare is how many times their fair share of the cluster's recent
// decisions (k/n for k holders of n pods) a prompt's holders must take for
// the prompt to count as hot. Against a fixed half, two holders of three
// pods serving their users' histories (two thirds of the requests is their
// fair share) were taken for a hot prompt and their users moved off their
// histories.
const hotShare = 1.5

// holders computes s.hold once per decision: the largest cache ratio among
// the pods holding at least holder_ratio of the prompt that count (see
// counts) and survived the filters before this one, unless the prompt is
// hot: its k holders of the cluster's n pods together took more than
// hotShare·k/n of its recent decisions (and over half) and one of them is
// busier than its idlest pod. A prompt many requests share (a hot system
// prompt) is worth copying, where a user's history serves that user alone.
// Until the cluster's window of decisions can tell (Host.Share is 0 for
// all), the choice is the scorers': a hot prompt's first requests arrive
// while its first copy is still prefilling.
func (s *State) holders() {
	if s.holdKnown {
		return
	}
	s.holdKnown = true
	cluster := s.cluster
	if cluster == nil {
		cluster = s.Hosts
	}
	share, all, busiest, idlest, k := 0.0, 0.0, int64(0), int64(math.MaxInt64), 0
	for i := range cluster {
		h := &cluster[i]
		idlest, all = min(idlest, h.Reqs), all+h.Share
		if h.CacheRatio >= s.Rule.HolderRatio {
			share, busiest, k = share+h.Share, max(busiest, h.Reqs), k+1
		}
	}
	hot := max(0.5, hotShare*float64(k)/float64(len(cluster)))
	if all == 0 || share > hot && busiest > idlest {
		return
	}
	if s.Rule.HolderWait > 0 {
		s.costs = lowestCosts(s.Hosts, float64(s.PromptLength))
	}
	for i := range s.Hosts {
		h := &s.Hosts[i]
		if h.CacheRatio >= s.Rule.HolderRatio && h.CacheRatio > s.hold && s.counts(h) {
			s.hold = h.CacheRatio
		}
	}
}

// counts says whether holder h may keep the prompt: it reports fewer than
// holderQueue requests queued, and the prefill standing before the request
// there is at most holder_wait times that on the cheapest other pod.
func (s *State) counts(h *Host) bool {
	if h.Signals && h.Waiting >= holderQueue {
		return false
	}
	if s.Rule.HolderWait <= 0 {
		return true
	}
	return !s.costs.exceeds(prefillCost(h, float64(s.PromptLength)), s.Rule.HolderWait)
}

// reserveRatio and reserveHolders: a prompt is a copied document when at
// least reserveHolders pods hold reserveRatio of it.
const (
	reserveRatio   = 0.5
	reserveHolders = 2
)

// reserved computes s.reserve once per decision (Reserve): the only idle
// pod that does not hold the prompt, when reserveHolders pods hold it and
// one of them reports fewer than holderQueue requests queued (it keeps up;
// without a report nothing says so). The queue, not the reported prefill:
// a first form released the idle pod when the cheapest holder's prefill
// exceeded twice a copy's, and let go too early, while the holders
// still kept up.
func (s *State) reserved() {
	if s.reserveKnown {
		return
	}
	s.reserveKnown, s.reserve = true, -1
	idle, holders, keepsUp := -1, 0, false
	for i := range s.cluster {
		h := &s.cluster[i]
		if h.CacheRatio >= reserveRatio {
			holders++
			keepsUp = keepsUp || h.Signals && h.Waiting < holderQueue
			continue
		}
		if h.Reqs == 0 && (!h.Signals || h.Running+h.Waiting == 0) {
			if idle >= 0 {
				return
			}
			idle = i
		}
	}
	if holders >= reserveHolders && keepsUp {
		s.reserve = idle
	}
}

// scratch returns two empty float slices of capacity n.
func (s *State) scratch(n int) (a, b []float64) {
	if cap(s.floats) < 3*n {
		s.floats = make([]float64, 3*n)
	}
	f := s.floats[:3*n]
	return f[:0:n], f[n : n : 2*n]
}

// sortBuf returns an empty float slice of capacity n apart from scratch's.
func (s *State) sortBuf(n int) []float64 {
	if cap(s.floats) < 3*n {
		s.floats = make([]float64, 3*n)
	}
	return s.floats[2*n : 2*n : 3*n]
}

func (s *State) ints(n int) []int {
	if cap(s.idx) < n {
		s.idx = make([]int, 0, n)
	}
	return s.idx[:0]
}

func (s *State) hosts(n int) []Host {
	if cap(s.kept) < n {
		s.kept = make([]Host, 0, n)
	}
	return s.kept[:0]
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
	// Signals are the pods' own fresh reports, host -> signals.
	Signals map[string]api.PodSignals
	// Degraded: the query failed or timed out (or there is no metadata
	// center). Load then comes from local accounting only and cache ratios
	// are zero (docs/envoy-filter.md).
	Degraded bool
}

// Options of New.
type Options struct {
	// IntN overrides the random source (tests); it must be safe for
	// concurrent use. Default: math/rand/v2.IntN.
	IntN func(n int) int
	// Policies adds or replaces policies by name (a *Profile is one).
	Policies map[string]Policy
	// Scorers, Filters and Pickers add or replace pipeline parts by name,
	// for the lb rule's `scorers`, `filters` and `picker` keys.
	Scorers map[string]Scorer
	Filters map[string]PodFilter
	Pickers map[string]Picker
	// Logger receives per-scorer debug lines (at Debug level). Default
	// slog.Default().
	Logger *slog.Logger
	// Registerer, if set, gets llm_filter_balancer_stage_seconds{stage}.
	Registerer prometheus.Registerer
}

// Balancer holds the policies, the round-robin counters and the in-flight
// tracker of one engine. Safe for concurrent use.
type Balancer struct {
	intn     func(int) int
	mu       sync.RWMutex // guards the registries below
	policies map[string]Policy
	scorers  map[string]Scorer
	filters  map[string]PodFilter
	pickers  map[string]Picker
	tracker  *Tracker
	scratch  sync.Pool // *chooseScratch: 2.5 KiB at 64 pods, per decision
	log      *slog.Logger
	stages   *prometheus.HistogramVec
	// stageObs and scorerObs cache stage name -> prometheus.Observer.
	stageObs, scorerObs sync.Map
}

// chooseScratch is what one Choose needs; the State is in it because a
// policy is an interface, so &State would otherwise escape to the heap.
type chooseScratch struct {
	hosts  []Host
	floats []float64
	idx    []int
	kept   []Host
	state  State
	obs    stageObserver
}

// New builds a balancer with the built-in policies, profiles, scorers,
// filters and pickers, plus those of opts.
func New(opts Options) *Balancer {
	b := &Balancer{intn: opts.IntN, tracker: NewTracker(), log: opts.Logger}
	if b.intn == nil {
		b.intn = rand.IntN
	}
	if b.log == nil {
		b.log = slog.Default()
	}
	b.policies = map[string]Policy{
		config.PolicyRoundRobin:   NewRoundRobin(),
		config.PolicyRandom:       Random{},
		config.PolicyLeastRequest: LeastRequest{},
		config.PolicyPrefixOnly:   PrefixOnly{},
		PolicySGLang:              SGLang{},
	}
	for _, p := range builtinProfiles() {
		b.policies[p.Name] = p
	}
	b.scorers = builtinScorers()
	b.filters = map[string]PodFilter{FilterKVFull: KVFull{}, FilterHolder: Holder{}, FilterReserve: Reserve{}}
	b.pickers = map[string]Picker{PickerTopPercent: TopPercent{}, PickerMaxScore: MaxScore{}}
	for name, p := range opts.Policies {
		b.policies[name] = p
	}
	for name, p := range opts.Scorers {
		b.scorers[name] = p
	}
	for name, p := range opts.Filters {
		b.filters[name] = p
	}
	for name, p := range opts.Pickers {
		b.pickers[name] = p
	}
	b.stages = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "llm_filter_balancer_stage_seconds",
		Help:    "Time spent per decision in each balancer stage: filters, scorer:<name>, picker for scoring profiles; the policy's name for the others.",
		Buckets: prometheus.ExponentialBuckets(100e-9, 2, 14),
	}, []string{"stage"})
	if opts.Registerer != nil {
		// A second engine on the same registry (a config reload) shares the
		// first one's histogram.
		if err := opts.Registerer.Register(b.stages); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				if h, ok := are.ExistingCollector.(*prometheus.HistogramVec); ok {
					b.stages = h
				}
			}
		}
	}
	return b
}

// RegisterPolicy adds or replaces a policy (a *Profile is one).
func (b *Balancer) RegisterPolicy(name string, p Policy) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.policies[name] = p
}

// RegisterScorer adds or replaces a scorer for the lb rule's `scorers`.
func (b *Balancer) RegisterScorer(s Scorer) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.scorers[s.Name()] = s
}

// Check reports whether the rule names only registered parts: the engine
// calls it for every lb rule when it starts, so a typo fails the config,
// not each request.
func (b *Balancer) Check(r config.LBRule) error {
	p, err := b.Policy(r.Policy)
	if err != nil {
		return err
	}
	prof, ok := p.(*Profile)
	if !ok {
		if len(r.Scorers) > 0 || r.Picker != "" || r.Filters != nil {
			return fmt.Errorf("policy %q is not a scoring profile: scorers, filters and picker do not apply", r.Policy)
		}
		return nil
	}
	b.mu.RLock()
	defer b.mu.RUnlock()
	_, err = b.withRule(prof, r)
	return err
}

// Names lists the registered policies, scorers, filters and pickers.
func (b *Balancer) Names() (policies, scorers, filters, pickers []string) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return sortedNames(b.policies), sortedNames(b.scorers), sortedNames(b.filters), sortedNames(b.pickers)
}

func sortedNames[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Tracker returns the in-flight tracker.
func (b *Balancer) Tracker() *Tracker { return b.tracker }

// Policy returns the policy of a name.
func (b *Balancer) Policy(name string) (Policy, error) {
	b.mu.RLock()
	p, ok := b.policies[name]
	b.mu.RUnlock()
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
			if !e.Matches(s) {
				continue next
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
	// Prefill is what the request adds to the pod's prefill,
	// PromptLength·(1−Host.CacheRatio) rounded: the tracker reserves it,
	// and the caller's Begin and the metadata center count it.
	Prefill int64
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
	prof, isProfile := p.(*Profile)
	if isProfile {
		b.mu.RLock()
		prof, err = b.withRule(prof, rule)
		b.mu.RUnlock()
		if err != nil {
			b.scratch.Put(sc)
			return Choice{}, err
		}
		if !prof.readsSignals(rule) {
			view.Signals = nil
		}
	} else if sr, ok := p.(SignalReader); ok && !sr.ReadsSignals() {
		view.Signals = nil
	}
	hosts := slices.Grow(sc.hosts[:0], len(cands))[:len(cands)]
	smp := b.tracker.fill(cluster, cands, view, req.Blocks, hosts)
	sc.state = State{Cluster: cluster, Hosts: hosts, Rule: rule, PromptLength: req.PromptLength, IntN: b.intn,
		floats: sc.floats, idx: sc.idx, kept: sc.kept}
	var i int
	if isProfile {
		sc.obs = stageObserver{b: b, log: b.log, debug: b.log.Enabled(context.Background(), slog.LevelDebug)}
		i = prof.run(&sc.state, &sc.obs)
	} else {
		t0 := time.Now()
		i = p.Choose(&sc.state)
		b.observe(rule.Policy, false, time.Since(t0))
	}
	ch := Choice{Host: hosts[i], Index: i, Candidates: len(hosts),
		Prefill: int64(math.Round(float64(req.PromptLength) * (1 - hosts[i].CacheRatio)))}
	b.tracker.routed(smp, ch.Host.Address, len(hosts))
	b.tracker.reserve(cluster, ch.Host.Address, ch.Prefill)
	clear(hosts) // do not pin endpoint addresses
	clear(sc.state.kept[:cap(sc.state.kept)])
	sc.hosts, sc.floats, sc.idx, sc.kept, sc.state = hosts[:0], sc.state.floats, sc.state.idx, sc.state.kept, State{}
	b.scratch.Put(sc)
	return ch, nil
}

// observe records a stage's time. The histogram children are cached by
// name: building "scorer:"+name and hashing labels on every decision would
// cost more than some scorers do.
func (b *Balancer) observe(stage string, scorer bool, d time.Duration) {
	cache := &b.stageObs
	if scorer {
		cache = &b.scorerObs
	}
	o, ok := cache.Load(stage)
	if !ok {
		label := stage
		if scorer {
			label = "scorer:" + stage
		}
		o, _ = cache.LoadOrStore(stage, b.stages.WithLabelValues(label))
	}
	o.(prometheus.Observer).Observe(d.Seconds())
}

// tieEpsilon treats scores this close as equal: they differ only by
// floating-point noise of the same inputs.
const tieEpsilon = 1e-9

// pickTopBuf implements "sort descending, pick uniformly among the top
// max(1, n·percent/100)" with random tie-breaking: a drawn rank that falls
// on a group of equal scores is replaced by a uniform member of the whole
// group, including members just past the cut, so equal pods are equally
// likely and a better pod's share is unchanged.
//
// It does so without ordering the pods: with T the top-th largest score, the
// pods strictly above T fill ranks 0..g-1 (each rank equally likely, so any
// fixed order of them will do) and the pods at T share the remaining ranks.
// It selects T in a copy of the scores in buf.
func pickTopBuf(scores []float64, percent int, intn func(int) int, buf []float64) int {
	n := len(scores)
	top := max(1, n*percent/100)
	t := nthSmallest(append(buf[:0], scores...), n-top)
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

// nthSmallest returns a[k] as slices.Sort would leave it (NaN first),
// reordering a: a quickselect, linear where sorting 256 scores was a tenth of
// a decision.
func nthSmallest(a []float64, k int) float64 {
	lo, hi := 0, len(a)-1
	for lo < hi {
		// Median of three, so that sorted input does not go quadratic.
		mid := lo + (hi-lo)/2
		if cmp.Less(a[mid], a[lo]) {
			a[mid], a[lo] = a[lo], a[mid]
		}
		if cmp.Less(a[hi], a[lo]) {
			a[hi], a[lo] = a[lo], a[hi]
		}
		if cmp.Less(a[hi], a[mid]) {
			a[hi], a[mid] = a[mid], a[hi]
		}
		p := a[mid]
		// Hoare's partition: a[lo..j] ≤ p ≤ a[i..hi], and what lies between
		// equals p.
		i, j := lo, hi
		for i <= j {
			for cmp.Less(a[i], p) {
				i++
			}
			for cmp.Less(p, a[j]) {
				j--
			}
			if i <= j {
				a[i], a[j] = a[j], a[i]
				i++
				j--
			}
		}
		switch {
		case k <= j:
			hi = j
		case k >= i:
			lo = i
		default:
			return a[k]
		}
	}
	return a[k]
}

// Random picks uniformly: a baseline.
type Random struct{}

func (Random) ReadsSignals() bool  { return false }
func (Random) NeedsMetadata() bool { return false }
func (Random) Choose(s *State) int { return s.IntN(len(s.Hosts)) }

// LeastRequest picks the fewest live requests, ties at random.
type LeastRequest struct{}

func (LeastRequest) ReadsSignals() bool  { return false }
func (LeastRequest) NeedsMetadata() bool { return true }

func (LeastRequest) Choose(s *State) int {
	return argBest(s, func(h Host) float64 { return -float64(h.Reqs) })
}

// PrefixOnly picks the longest cached prefix, ties at random: what a pure
// cache-affinity router does (and how it herds).
type PrefixOnly struct{}

func (PrefixOnly) ReadsSignals() bool  { return false }
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

func (*RoundRobin) ReadsSignals() bool  { return false }
func (*RoundRobin) NeedsMetadata() bool { return false }

func (r *RoundRobin) Choose(s *State) int {
	r.mu.Lock()
	n := r.next[s.Cluster]
	r.next[s.Cluster] = n + 1
	r.mu.Unlock()
	return int(n % uint64(len(s.Hosts)))
}
