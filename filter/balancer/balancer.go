// Package balancer chooses the pod for a request:
// label-selector filtering, then a per-cluster Policy over what the metadata
// center says about load, cached prefixes and the pods' own signals,
// corrected by this gateway's own in-flight requests that the metadata
// center does not know about yet (Tracker).
//
// Built in:
//
//   - cache_aware (the default): the pod with the lowest predicted time to
//     first token for this request, plus the delay its prefill there adds
//     to the requests waiting on the pod, plus on a busy prefix's holders
//     what a copy on an idle pod would spare its requests, near-ties spread
//     (ttft.go, one file);
//     every decision records its prediction (Choice.Prediction) and the
//     first token checks it (Balancer.Observe).
//   - seed: the seed's formula exactly,
//     W1·cacheRatio − W2'·(reqs−minReqs)/delta − W3·prompt/maxPrompt with
//     delta = max(2, maxReqs−minReqs), W2' = W2·delta/5 when delta > 5, as
//     the weighted sum of three [0,1] scorers (which differs from it by the
//     constant W2'+W3), uniform pick among the top candidate_percent.
//   - epp and sglang: stand-ins for llm-d's endpoint picker and SGLang's
//     router, baselines (standins.go lists how they differ from the real
//     ones).
//   - round_robin, random, least_request, prefix_only: baselines.
//
// seed and epp are Profiles: pod filters → scorers (each rates every pod in
// [0,1] and names itself) → a picker, composed from the lb rule (weights per
// scorer, picker, filters), with per-stage latency histograms and per-scorer
// debug logs. Scorers, filters, pickers and whole policies can be registered
// from Go (Options, Balancer.Register*).
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
	Address string
	Reqs    int64 // live requests: metadata center + unreported local ones
	Prompt  int64 // prompt bytes not yet prefilled, likewise
	// LocalPrefill is the part of Prompt this gateway sent that the
	// metadata center does not count yet (nor, then, the pod's report).
	LocalPrefill int64
	CacheRatio   float64 // matched leading blocks / total blocks
	// Share is the fraction of the cluster's recent routing decisions that
	// chose this pod, for the sglang stand-in; 0 until
	// the window stands for 2n of the cluster's decisions (Tracker: with
	// several gateways, fewer of this gateway's own).
	Share float64

	// The pod's own report (View.Signals); only when Signals is true: the
	// metadata center answers fresh reports only, and a pod without one is
	// never assumed idle.
	Signals       bool
	Waiting       int64   // requests queued on the pod
	Running       int64   // requests the pod is running
	KVUtil        float64 // KV cache running requests hold, 0..1 (idle cached blocks are free)
	PrefillQueued int64   // prompt tokens the pod has still to prefill
	// KVCapacity is the tokens the pod's KV cache holds, MaxRunning the
	// requests it runs at most; 0 = not reported (vLLM reports the first
	// only, our worker both).
	KVCapacity, MaxRunning int64
	// What the pod's compute costs as it measures it (our worker; 0 = not
	// reported, api.PodSignals): PrefillQueued request by request at that
	// cost, fewest tokens first, a prompt token's own cost and its
	// attention to each cell before it, and a decode step of its running
	// set.
	PrefillQueue                                []api.Prefill
	TokenSeconds, AttentionSeconds, StepSeconds float64
	// StepLeft is what is left of the pod's step in progress now, in
	// seconds: its report's, less the report's age (our worker, whose
	// PrefillQueue then counts what is left once that step ends).
	StepLeft float64
	// A prompt the pod holds back while the answers about to end decode
	// (our worker's finish first, api.PodSignals.HeldTokens): HeldTokens
	// left to prefill, the HeldStep it takes alone once they have ended,
	// and HoldLeft until then from now, in seconds: its report's less the
	// report's age, below 0 where the release is that long past. 0: none.
	HeldTokens         int64
	HeldStep, HoldLeft float64
	// ReportsEvictions: the pod tells the metadata center what it evicts
	// (our worker), so the index needs no bound (Choice.MaxBlocks).
	ReportsEvictions bool
	// FilledSinceReport is the prompt bytes of this gateway's requests on
	// the pod sent before the report was taken whose first token came
	// after it, and
	// FilledReqsSinceReport their number: the report still counts them in
	// PrefillQueued (and, if it caught them queued, in Waiting); the pod
	// has done them.
	FilledSinceReport, FilledReqsSinceReport int64
	// EndedReqsSinceReport is the number of this gateway's requests on the
	// pod that were sent before the report was taken and ended after it;
	// BegunReqsSinceReport of those sent after it and not ended.
	EndedReqsSinceReport, BegunReqsSinceReport int64
	// EndedSinceReport and BegunSinceReport are those requests' prompt
	// bytes: about what the ended ones freed of the pod's KV, what the
	// begun ones take once it admits them (predictor.predict).
	EndedSinceReport, BegunSinceReport int64
	// SharedBlocks is how many leading blocks of the prompt this gateway's
	// requests in flight on the pod share: while they run, the pod holds
	// those blocks and admitting the request takes no new room for them.
	SharedBlocks int
}

// State is the input of one choice. Policies must not keep it.
type State struct {
	Cluster string
	Hosts   []Host
	Rule    config.LBRule
	// PromptLength is the request's prompt size (bytes, like Host.Prompt).
	PromptLength int64
	// Blocks, ChunkSize and Ends are the request's (Request): what a pod's
	// CacheRatio covers of the prompt.
	Blocks, ChunkSize int
	Ends              []int
	// IntN returns a uniform int in [0, n); safe for concurrent use.
	IntN func(n int) int

	// BytesPerToken is the request's model's (1 for a byte-level
	// vocabulary): prompt bytes over it are tokens.
	BytesPerToken float64
	// Model, Prompt and Hashes are the request's (Request); Prompt and
	// Hashes may be nil.
	Model  string
	Prompt []byte
	Hashes []string

	// Scratch for the policies (Balancer.Choose pools it): a decision at 64
	// pods would otherwise allocate a few KiB.
	floats []float64
	idx    []int
	kept   []Host
	costs  []Cost
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

// costScratch returns an empty Cost slice of capacity n.
func (s *State) costScratch(n int) []Cost {
	if cap(s.costs) < n {
		s.costs = make([]Cost, 0, n)
	}
	return s.costs[:0]
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
	// Asked is when the query was sent: an update that landed after it
	// may be missing from the answer (Tracker).
	Asked time.Time
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
	// Registerer, if set, gets llm_filter_balancer_stage_seconds{stage},
	// llm_filter_balancer_ttft_prediction_error (Observe) and
	// llm_filter_balancer_bytes_per_token{model_name} (BytesPerToken).
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
	ttft     *ttftModel
	tokens   sync.Map // model -> *BytesPerToken
	bpt      *prometheus.GaugeVec
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
	costs  []Cost
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
	// Rules that name epp_prefix share the epp stand-in's index.
	b.scorers[ScorerEPPPrefix] = b.policies[ProfileEPP].(*Profile).Scorers[0].Scorer
	b.filters = map[string]PodFilter{}
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
	errs := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "llm_filter_balancer_ttft_prediction_error",
		Help: "Relative error of the chosen pod's predicted time to first token, (observed - predicted) / observed: negative when the prediction was too long.",
		// Symmetric in the ratio predicted/observed down to a third and up
		// to a quarter (−3 is a prediction four times too long), finer where
		// the aims lie (|error| ≤ 0.2 median, ≤ 0.5 p90).
		Buckets: []float64{-3, -1, -0.5, -0.35, -0.2, -0.1, -0.05, 0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75},
	})
	cache := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "llm_filter_balancer_cache_belief_error",
		Help: "Share of the prompt the chosen pod was believed to hold in its KV cache less the share it served from it (usage.prompt_tokens_details.cached_tokens): positive when the pod had evicted what the prefix index still listed.",
		// Shares of the prompt, finer near 0 where a sound index lies.
		Buckets: []float64{-0.5, -0.25, -0.1, -0.02, 0.02, 0.1, 0.25, 0.5},
	})
	b.bpt = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "llm_filter_balancer_bytes_per_token",
		Help: "Prompt bytes per token learnt per model from the usage.prompt_tokens of its answers (1 until the first).",
	}, []string{"model_name"})
	if opts.Registerer != nil {
		// A second engine on the same registry (a config reload) shares the
		// first one's collectors.
		b.stages = register(opts.Registerer, b.stages)
		errs = register(opts.Registerer, errs)
		cache = register(opts.Registerer, cache)
		b.bpt = register(opts.Registerer, b.bpt)
	}
	b.ttft = newTTFTModel(errs, cache, b.log)
	b.tracker.held = b.ttft.held
	b.policies[config.PolicyCacheAware] = &CacheAware{m: b.ttft}
	if p, ok := opts.Policies[config.PolicyCacheAware]; ok {
		b.policies[config.PolicyCacheAware] = p
	}
	return b
}

// register registers c, or returns the collector already registered in its
// place.
func register[C prometheus.Collector](r prometheus.Registerer, c C) C {
	if err := r.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if old, ok := are.ExistingCollector.(C); ok {
				return old
			}
		}
	}
	return c
}

// BytesPerToken returns a model's learnt bytes per token (made on first
// use): the response path observes usage.prompt_tokens into it.
func (b *Balancer) BytesPerToken(model string) *BytesPerToken {
	if v, ok := b.tokens.Load(model); ok {
		return v.(*BytesPerToken)
	}
	v, loaded := b.tokens.LoadOrStore(model, &BytesPerToken{gauge: b.bpt.WithLabelValues(model)})
	if !loaded {
		v.(*BytesPerToken).gauge.Set(1)
	}
	return v.(*BytesPerToken)
}

// Observe checks a decision's prediction against the TTFT observed at its
// first token: it exports the relative error, logs both at debug and
// refits the cluster's prefill rate and decode step. A zero Prediction is
// ignored.
func (b *Balancer) Observe(p Prediction, observed time.Duration) {
	b.ttft.observe(p, observed)
}

// ObserveCache checks what a decision believed its pod held of the prompt
// against what the pod served from its KV cache (the answer's usage): the
// llm_filter_balancer_cache_belief_error histogram, and a debug line.
func (b *Balancer) ObserveCache(p Prediction, promptTokens, cachedTokens int64) {
	b.ttft.observeCache(p, promptTokens, cachedTokens)
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
	// Prediction is the chosen pod's predicted time to first token with
	// its parts (whatever the policy), for the decision record and for
	// Observe at the first token.
	Prediction Prediction
	// MaxBlocks is how many prompt-hash blocks the pod's KV cache holds at
	// most: its reported capacity in tokens, in bytes through the model's
	// bytes per token, over the mean size of the prompt's whole blocks
	// (Request.blockSize), rounded up. The saves of the
	// request's prefix carry it, so the index forgets what the pod's cache
	// must have evicted (store.Index.SaveCacheAs). 0: not reported, or the
	// pod reports its evictions itself.
	MaxBlocks int
}

// Request is what a policy knows of the request being routed.
type Request struct {
	Blocks       int   // prompt hash blocks (for cache ratios)
	PromptLength int64 // prompt bytes
	// ChunkSize is the prompt hash's block size in bytes (the rule's
	// prompt_hash.chunk_size). Ends are where the prompt's blocks end
	// (prefix.Hasher.AppendBlocks: a block ends early where a message
	// starts), so a match of m blocks short of the last covers Ends[m-1]
	// bytes. Without Ends, blocks are taken as ChunkSize bytes but the
	// last; without either, a match's share of the blocks stands for its
	// share of the bytes. Ends is not kept past Choose.
	ChunkSize int
	Ends      []int
	// Model names the request's model, whose bytes per token
	// (BytesPerToken) turn PromptLength into tokens.
	Model string
	// Hashes are the prompt's chained block hashes (wire form), for the
	// blocks it shares with requests in flight on a pod (Host.SharedBlocks)
	// and to name its cached prefix (cache_aware's copy credit); nil: none
	// known.
	Hashes []string
	// Prompt is the canonical prompt's bytes, for policies that hash it
	// themselves (the epp stand-in's own prefix index); nil: they read the
	// metadata center's match. Not kept past Choose.
	Prompt []byte
}

// cachedBytes returns the prompt bytes a pod whose index entries match
// ratio of the blocks is expected to hold: the whole prompt when every
// block matched; else the matched blocks' bytes and the block after them up
// to where the prompt diverges from what the pod saw, a point inside that
// block the index does not resolve. Chat prompts end in a part new to every
// pod (the question after a shared system prompt, a conversation's new
// message), of a length the cluster's traffic keeps: tail, the bytes the
// pods whose match was partial did not serve (ttftModel.observeCache). The
// pod is expected to hold the prompt but its last tail bytes, at least the
// matched blocks and at most the block after them (a pod that held more
// would have had it listed, unless it is a previous answer's text, which no
// save names). tail < 0 (none seen yet): half the next block. The blocks are
// ChunkSize bytes but the last, so a ratio stands for the prompt's share only
// when they are alike: 2 of 3 blocks of a 1,100-byte prompt in 512-byte
// blocks leave half of its last 76 bytes, 38, not a third of it.
func (r Request) cachedBytes(ratio, tail float64) int64 {
	held, partial := r.matchedBytes(ratio)
	if !partial {
		return held
	}
	next := r.blockBytes(r.matchedBlocks(ratio)+1) - held
	if tail < 0 {
		return held + next/2
	}
	return held + min(max(r.PromptLength-int64(math.Round(tail))-held, 0), next)
}

// matchedBytes returns the prompt bytes covered by the blocks a match of
// ratio of them names, and whether the match is partial (some blocks but
// not all, in blocks of ChunkSize bytes): then the pod's cache ends past
// them, in bytes the index does not list (cachedBytes' tail).
func (r Request) matchedBytes(ratio float64) (held int64, partial bool) {
	switch {
	case ratio <= 0 || r.PromptLength <= 0:
		return 0, false
	case (r.ChunkSize <= 0 && r.Ends == nil) || r.Blocks <= 0:
		return int64(math.Round(ratio * float64(r.PromptLength))), false
	}
	matched := r.matchedBlocks(ratio)
	if matched >= r.Blocks {
		return r.PromptLength, false
	}
	return r.blockBytes(matched), true
}

// matchedBlocks is how many leading blocks a match of ratio of them names.
func (r Request) matchedBlocks(ratio float64) int {
	return int(math.Round(ratio * float64(r.Blocks)))
}

// blockSize is the mean size in bytes of the prompt's whole blocks (all but
// the last): ChunkSize, less where blocks end early at message starts.
func (r Request) blockSize() float64 {
	if n := min(len(r.Ends), r.Blocks) - 1; n > 0 && r.Ends[n-1] > 0 {
		return float64(r.Ends[n-1]) / float64(n)
	}
	return float64(r.ChunkSize)
}

// blockBytes returns the prompt bytes its leading n blocks cover.
func (r Request) blockBytes(n int) int64 {
	switch {
	case n <= 0 || r.Blocks <= 0:
		return 0
	case n >= r.Blocks:
		return r.PromptLength
	case n <= len(r.Ends):
		return int64(r.Ends[n-1])
	case r.ChunkSize <= 0:
		return r.PromptLength * int64(n) / int64(r.Blocks)
	}
	return min(r.PromptLength, int64(n)*int64(r.ChunkSize))
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
	smp := b.tracker.fill(cluster, cands, view, req, hosts)
	sc.state = State{Cluster: cluster, Hosts: hosts, Rule: rule, PromptLength: req.PromptLength,
		Blocks: req.Blocks, ChunkSize: req.ChunkSize, Ends: req.Ends, IntN: b.intn,
		BytesPerToken: b.BytesPerToken(req.Model).Value(), Model: req.Model, Prompt: req.Prompt, Hashes: req.Hashes,
		floats: sc.floats, idx: sc.idx, kept: sc.kept, costs: sc.costs}
	var i int
	if isProfile {
		sc.obs = stageObserver{b: b, log: b.log, debug: b.log.Enabled(context.Background(), slog.LevelDebug)}
		i = prof.run(&sc.state, &sc.obs)
	} else {
		t0 := time.Now()
		i = p.Choose(&sc.state)
		b.observe(rule.Policy, false, time.Since(t0))
	}
	// The lease's prefill (what every gateway reads as this request's part
	// of the pod's queue until its first token) is the prompt's unmatched
	// share of the blocks, prompt·(1−cacheRatio): mostly more than the pod
	// computes (less where a short message is a block of its own), which
	// on pods that report nothing of themselves is what
	// spreads a hot prefix once its holder is loaded (llmfilter's
	// TestE2EHotPrefixSpreadsOnceItsPodIsLoaded). The unmatched blocks'
	// bytes alone, smaller where blocks end early at message starts, let
	// bursts herd onto small-KV vLLM-like pods (docs/benchmarks.md, "Blocks
	// that end where messages start"). The model's own estimate of the
	// request's uncached part is Request.cachedBytes'.
	ch := Choice{Host: hosts[i], Index: i, Candidates: len(hosts),
		Prefill: int64(math.Round(float64(req.PromptLength) * (1 - hosts[i].CacheRatio)))}
	ch.Prediction = b.ttft.chosen(&sc.state, i)
	if c := hosts[i].KVCapacity; c > 0 && req.ChunkSize > 0 && !hosts[i].ReportsEvictions {
		ch.MaxBlocks = int(math.Ceil(float64(c) * sc.state.BytesPerToken / req.blockSize()))
	}
	b.tracker.routed(smp, ch.Host.Address, len(hosts))
	b.tracker.reserve(cluster, ch.Host.Address, ch.Prefill)
	clear(hosts) // do not pin endpoint addresses
	clear(sc.state.kept[:cap(sc.state.kept)])
	clear(sc.state.costs[:cap(sc.state.costs)])
	sc.hosts, sc.floats, sc.idx, sc.kept, sc.costs, sc.state = hosts[:0], sc.state.floats, sc.state.idx, sc.state.kept, sc.state.costs, State{}
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
