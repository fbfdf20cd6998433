package balancer

import (
	"bytes"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

func profile(t *testing.T, name string) *Profile {
	t.Helper()
	p, err := New(Options{}).Policy(name)
	if err != nil {
		t.Fatal(err)
	}
	return p.(*Profile)
}

// totals runs a profile's scorers the way run does and returns the sums.
func totals(p *Profile, s *State) []float64 {
	n := len(s.Hosts)
	out, one := make([]float64, n), make([]float64, n)
	for _, w := range p.Scorers {
		wt := w.weight(s.Rule)
		if ws, ok := w.Scorer.(WeightScaler); ok {
			wt *= ws.WeightScale(s)
		}
		w.Scorer.Score(s, one)
		for i, v := range one {
			if v < 0 || v > 1 {
				panic("scorer " + w.Scorer.Name() + " left [0,1]")
			}
			out[i] += wt * v
		}
	}
	return out
}

func randomHosts(r *rand.Rand, n int) []Host {
	hosts := make([]Host, n)
	for i := range hosts {
		hosts[i] = Host{
			Address: string(rune('a' + i)), Reqs: r.Int64N(20), Prompt: r.Int64N(5) * 1000 * r.Int64N(2),
			CacheRatio: float64(r.IntN(5)) / 4, Share: r.Float64() / 2,
		}
	}
	return hosts
}

// The seed profile is the seed's formula: its weighted sum of [0,1] scores
// is Scores + W2'+W3 for every input (the seed's load weight W2' included),
// so its pick is the seed's pick, and the worked example picks B.
func TestSeedProfileIsTheSeedFormula(t *testing.T) {
	seed := profile(t, ProfileSeed)
	r := rand.New(rand.NewPCG(1, 2))
	for trial := range 500 {
		hosts := randomHosts(r, 2+r.IntN(10))
		s := &State{Hosts: hosts, Rule: seedRule}
		_, delta := seedDelta(hosts)
		w2 := seedRule.RequestLoadWeight
		if delta > 5 {
			w2 *= delta / 5
		}
		got, want := totals(seed, s), Scores(hosts, seedRule, 0, nil)
		for i := range got {
			if !near(got[i], want[i]+w2+seedRule.PrefillLoadWeight) {
				t.Fatalf("trial %d host %d: profile %v, seed %v (+%v)", trial, i, got, want, w2+seedRule.PrefillLoadWeight)
			}
		}
	}
	rule := seedRule
	rule.Policy = ProfileSeed
	cands := []endpoints.Endpoint{{Address: "10.0.1.1:8000"}, {Address: "10.0.1.2:8000"}, {Address: "10.0.1.3:8000"}}
	view := View{
		Load: api.LoadStats{
			"10.0.1.1:8000": {TotalReqs: 8, PromptLength: 4096},
			"10.0.1.2:8000": {TotalReqs: 2, PromptLength: 1024},
			"10.0.1.3:8000": {TotalReqs: 5, PromptLength: 2048},
		},
		Cache: map[string]int{"10.0.1.2:8000": 2, "10.0.1.3:8000": 1},
	}
	for s := range uint64(100) {
		ch, err := New(Options{IntN: seededIntN(s)}).Choose("c", rule, cands, view, Request{Blocks: 3, PromptLength: 1536})
		if err != nil || ch.Host.Address != "10.0.1.2:8000" {
			t.Fatalf("seed profile, draw seed %d: chose %+v %v, want pod B", s, ch, err)
		}
	}
}

// cache_aware as a profile is what cache_aware computed before: the
// reference Scores with herd control and the request's own prefill, plus
// constants, minus the share tie-break. Without pod reports (kv_fit 0) the
// cold_progress term is a constant too: 0.5 where some pod holds part of the
// prompt, else 0.
func TestCacheAwareProfileMatchesItsFormula(t *testing.T) {
	ca := profile(t, config.PolicyCacheAware)
	r := rand.New(rand.NewPCG(3, 4))
	for trial := range 500 {
		hosts := randomHosts(r, 2+r.IntN(10))
		s := &State{Hosts: hosts, Rule: herdRule, PromptLength: 2048}
		_, delta := seedDelta(hosts)
		w2 := herdRule.RequestLoadWeight
		if delta > 5 {
			w2 *= delta / 5
		}
		got, want := totals(ca, s), Scores(hosts, herdRule, 2048, nil)
		cold := 0.0
		if slices.ContainsFunc(hosts, func(h Host) bool { return h.CacheRatio > 0 }) {
			cold = 0.5
		}
		for i := range got {
			w := want[i] + w2 + herdRule.PrefillLoadWeight + cold + shareTieBreak*(1-hosts[i].Share)
			if !near(got[i], w) {
				t.Fatalf("trial %d host %d: profile %v, formula %v", trial, i, got[i], w)
			}
		}
	}
}

// The EPP-like profile: prefix ×3, queue ×2, free KV ×2 from the pods' own
// signals, max score. A pod holding the prefix but reporting a long queue
// and a full cache loses to an idle one; a pod without fresh signals is never
// taken for idle.
func TestEPPProfileReadsPodSignals(t *testing.T) {
	cands := eps(3)
	rule := seedRule
	rule.Policy = ProfileEPP
	view := View{
		Load:  api.LoadStats{},
		Cache: map[string]int{"10.0.0.1:8000": 4},
		Signals: map[string]api.PodSignals{
			"10.0.0.1:8000": {Waiting: 6, Running: 4, KVCacheUtil: 1},
			"10.0.0.2:8000": {Waiting: 0, Running: 1, KVCacheUtil: 0.1},
		},
	}
	b := New(Options{IntN: seededIntN(1)})
	// holder: 3·1 + 0 + 0 = 3; idle: 0 + 2 + 1.8 = 3.8; no signals: 0 + 0 + 0.
	for range 20 {
		ch, err := b.Choose("c", rule, cands, view, Request{Blocks: 4})
		if err != nil || ch.Host.Address != "10.0.0.2:8000" {
			t.Fatalf("chose %+v %v, want the idle pod", ch, err)
		}
	}
	// A short queue on the holder: 3 + 2·(1−1/6)... the holder wins.
	view.Signals["10.0.0.1:8000"] = api.PodSignals{Waiting: 1, KVCacheUtil: 0.5}
	view.Signals["10.0.0.2:8000"] = api.PodSignals{Waiting: 0, KVCacheUtil: 0.1}
	ch, _ := b.Choose("c", rule, cands, view, Request{Blocks: 4})
	if ch.Host.Address != "10.0.0.1:8000" {
		t.Fatalf("chose %s, want the holder (3 + 2·0 + 2·0.5 = 4 > 0 + 2 + 1.8)", ch.Host.Address)
	}
	if !ch.Host.Signals || ch.Host.Waiting != 1 || ch.Host.KVUtil != 0.5 {
		t.Fatalf("signals did not reach the host: %+v", ch.Host)
	}
}

// SGLang-like: the longest prefix above half the prompt, the smallest cache
// below it, the fewest requests once the fleet is imbalanced past both
// thresholds (max−min > 32 and max > 1.5·min).
func TestSGLangPolicy(t *testing.T) {
	cands := eps(3)
	rule := seedRule
	rule.Policy = PolicySGLang
	b := New(Options{IntN: seededIntN(2)})
	choose := func(view View) string {
		ch, err := b.Choose("c", rule, cands, view, Request{Blocks: 4})
		if err != nil {
			t.Fatal(err)
		}
		return ch.Host.Address
	}
	load := func(a, b, c int64) api.LoadStats {
		return api.LoadStats{"10.0.0.1:8000": {TotalReqs: a}, "10.0.0.2:8000": {TotalReqs: b}, "10.0.0.3:8000": {TotalReqs: c}}
	}
	if got := choose(View{Load: load(30, 0, 5), Cache: map[string]int{"10.0.0.1:8000": 3}}); got != "10.0.0.1:8000" {
		t.Fatalf("balanced, 3/4 matched: chose %s, want the holder", got)
	}
	if got := choose(View{Load: load(40, 0, 5), Cache: map[string]int{"10.0.0.1:8000": 3}}); got != "10.0.0.2:8000" {
		t.Fatalf("imbalanced (40 vs 0): chose %s, want the shortest queue", got)
	}
	if got := choose(View{Load: load(40, 30, 20), Cache: map[string]int{"10.0.0.1:8000": 3}}); got != "10.0.0.1:8000" {
		t.Fatalf("40 vs 20 is within 32: chose %s, want the holder", got)
	}
	// Below half matched: the smallest "tree" — no decisions yet, so the
	// emptiest reported KV cache; then, as decisions pile up on it, the
	// others take their turn before it gets a second.
	sig := map[string]api.PodSignals{"10.0.0.1:8000": {KVCacheUtil: 0.9}, "10.0.0.2:8000": {KVCacheUtil: 0.2}, "10.0.0.3:8000": {KVCacheUtil: 0.5}}
	b = New(Options{IntN: seededIntN(2)})
	counts := map[string]int{}
	for i := range 30 {
		got := choose(View{Load: load(1, 1, 1), Cache: map[string]int{"10.0.0.1:8000": 2}, Signals: sig})
		if i == 0 && got != "10.0.0.2:8000" {
			t.Fatalf("half matched (not above): chose %s, want the emptiest cache", got)
		}
		counts[got]++
	}
	if counts["10.0.0.1:8000"] < 5 || counts["10.0.0.2:8000"] < 5 || counts["10.0.0.3:8000"] < 5 {
		t.Fatalf("new conversations herded: %v", counts)
	}
}

// lowQueue is a scorer registered from Go.
type lowQueue struct{}

func (lowQueue) Name() string { return "running" }
func (lowQueue) Score(s *State, out []float64) {
	lowIsBest(s.Hosts, out, func(h *Host) float64 { return float64(h.Running) })
}

// A scorer registered from Go is usable by name from the lb rule, as are the
// picker and filters; unknown names are refused by Check and by Choose.
func TestRuleComposesRegisteredParts(t *testing.T) {
	b := New(Options{IntN: seededIntN(3), Scorers: map[string]Scorer{"running": lowQueue{}}})
	rule := seedRule
	rule.Policy = ProfileEPP
	rule.Scorers = map[string]float64{"running": 1, ScorerPrefix: 0.5}
	if err := b.Check(rule); err != nil {
		t.Fatal(err)
	}
	cands := eps(3)
	view := View{
		Load:  api.LoadStats{},
		Cache: map[string]int{"10.0.0.1:8000": 4},
		Signals: map[string]api.PodSignals{
			"10.0.0.1:8000": {Running: 9}, "10.0.0.2:8000": {Running: 3}, "10.0.0.3:8000": {Running: 1},
		},
	}
	ch, err := b.Choose("c", rule, cands, view, Request{Blocks: 4})
	if err != nil || ch.Host.Address != "10.0.0.3:8000" {
		t.Fatalf("chose %+v %v, want the pod running least", ch, err)
	}
	// The KV-full filter drops the saturated pod before scoring.
	rule.Filters = []string{FilterKVFull}
	view.Signals["10.0.0.3:8000"] = api.PodSignals{Running: 1, Waiting: 3, KVCacheUtil: 1}
	ch, err = b.Choose("c", rule, cands, view, Request{Blocks: 4})
	if err != nil || ch.Host.Address != "10.0.0.2:8000" || ch.Index != 1 {
		t.Fatalf("with kv_full: chose %+v %v, want index 1", ch, err)
	}
	b.RegisterScorer(lowQueue{})
	for _, bad := range []config.LBRule{
		{Policy: "nope"},
		{Policy: ProfileEPP, Scorers: map[string]float64{"nope": 1}},
		{Policy: ProfileEPP, Picker: "nope"},
		{Policy: ProfileEPP, Filters: []string{"nope"}},
		{Policy: config.PolicyRandom, Picker: PickerMaxScore},
	} {
		if err := b.Check(bad); err == nil {
			t.Fatalf("Check accepted %+v", bad)
		}
	}
	if _, err := b.Choose("c", config.LBRule{Policy: ProfileEPP, Picker: "nope"}, cands, view, Request{}); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Fatalf("Choose with an unknown picker: %v", err)
	}
	b.RegisterPolicy("mine", &Profile{Name: "mine", Scorers: []Weighted{{Scorer: lowQueue{}, Weight: 1}}, Picker: MaxScore{}, Metadata: true})
	if ch, err := b.Choose("c", config.LBRule{Policy: "mine"}, cands, view, Request{}); err != nil || ch.Host.Address != "10.0.0.3:8000" {
		t.Fatalf("registered profile chose %+v %v", ch, err)
	}
}

// Each stage's latency lands in the histogram, and at Debug level every
// scorer logs its scores under its name.
func TestStageMetricsAndScorerLogs(t *testing.T) {
	reg := prometheus.NewRegistry()
	var logs bytes.Buffer
	b := New(Options{Registerer: reg, Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	rule := seedRule
	rule.Filters = []string{FilterKVFull}
	if _, err := b.Choose("c", rule, eps(4), View{Load: api.LoadStats{}}, Request{Blocks: 1}); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]uint64{}
	for _, mf := range mfs {
		if mf.GetName() != "llm_filter_balancer_stage_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			seen[label(m, "stage")] = m.GetHistogram().GetSampleCount()
		}
	}
	for _, stage := range []string{"filters", "scorer:prefix_herd", "scorer:seed_load", "scorer:own_prefill", "scorer:kv_fit", "scorer:recent_share", "picker"} {
		if seen[stage] != 1 {
			t.Fatalf("stage %s observed %d times; all: %v", stage, seen[stage], seen)
		}
	}
	// A scorer of weight 0 does not run.
	rule.Scorers = map[string]float64{ScorerPrefix: 1, ScorerQueue: 0}
	if _, err := b.Choose("c", rule, eps(4), View{Load: api.LoadStats{}}, Request{Blocks: 1}); err != nil {
		t.Fatal(err)
	}
	if mfs, _ = reg.Gather(); strings.Contains(fmt.Sprint(mfs), "scorer:queue") {
		t.Fatal("a scorer of weight 0 ran")
	}
	for _, want := range []string{"scorer=prefix_herd", "scorer=seed_load", "picker=top_percent"} {
		if !strings.Contains(logs.String(), want) {
			t.Fatalf("debug log lacks %q:\n%s", want, logs.String())
		}
	}
	// A second balancer on the same registry shares the histogram.
	New(Options{Registerer: reg})
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// Signals are read only for policies that use them: filling them is a map
// lookup per pod on every decision.
func TestSignalsFilledOnlyWhenRead(t *testing.T) {
	b := New(Options{IntN: seededIntN(1)})
	view := View{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{"10.0.0.1:8000": {Running: 2}}}
	for policy, want := range map[string]bool{config.PolicyCacheAware: true, ProfileSeed: false, ProfileEPP: true, PolicySGLang: true, config.PolicyLeastRequest: false} {
		rule := seedRule
		rule.Policy = policy
		ch, err := b.Choose("c", rule, eps(1), view, Request{})
		if err != nil || ch.Host.Signals != want {
			t.Errorf("%s: host %+v %v, want signals %v", policy, ch.Host, err, want)
		}
	}
	rule := seedRule
	rule.Scorers = map[string]float64{ScorerPrefix: 1, ScorerKVCache: 0}
	rule.Filters = []string{} // cache_aware's holder filter reads the pods' queues
	if ch, _ := b.Choose("c", rule, eps(1), view, Request{}); ch.Host.Signals {
		t.Error("signals read for a kv_cache scorer of weight 0")
	}
}

// kv_fit: a pod's free KV cache counts in proportion to the prompt share the
// request would store there anew. A conversation's next turn stays on the
// pod that holds its history although that pod's cache is fuller, and a new
// conversation goes to the pod with room; kv_cache alone moves the turn off
// its history.
func TestKVFitWeighsFreeCacheByWhatTheRequestAdds(t *testing.T) {
	hosts := []Host{
		{Address: "holder", CacheRatio: 0.8, Signals: true, KVUtil: 0.9},
		{Address: "roomy", Signals: true, KVUtil: 0.4},
		{Address: "silent"},
	}
	got := make([]float64, len(hosts))
	KVFitScorer{}.Score(&State{Hosts: hosts}, got)
	if want := []float64{1 - 0.9*0.2, 0.6, 0}; !near(got[0], want[0]) || !near(got[1], want[1]) || got[2] != 0 {
		t.Fatalf("kv_fit %v, want %v", got, want)
	}

	cands := eps(2)
	rule := herdRule
	rule.Scorers = map[string]float64{ScorerPrefix: 1, ScorerKVFit: 3}
	view := View{
		Load:  api.LoadStats{},
		Cache: map[string]int{"10.0.0.1:8000": 4},
		Signals: map[string]api.PodSignals{
			"10.0.0.1:8000": {Running: 3, KVCacheUtil: 0.9},
			"10.0.0.2:8000": {Running: 1, KVCacheUtil: 0.4},
		},
	}
	b := New(Options{IntN: seededIntN(1)})
	// The next turn (4 of 5 blocks held): holder 0.8 + 3·0.82 against 0 + 3·0.6.
	if ch, err := b.Choose("c", rule, cands, view, Request{Blocks: 5}); err != nil || ch.Host.Address != "10.0.0.1:8000" {
		t.Fatalf("next turn went to %+v %v, want the pod holding its history", ch, err)
	}
	// kv_cache in its place: 0.8 + 3·0.1 against 3·0.6.
	rule.Scorers = map[string]float64{ScorerPrefix: 1, ScorerKVCache: 3}
	if ch, _ := b.Choose("c", rule, cands, view, Request{Blocks: 5}); ch.Host.Address != "10.0.0.2:8000" {
		t.Fatalf("kv_cache: chose %s, want the roomy pod", ch.Host.Address)
	}
	// A new conversation (held nowhere) goes where there is room.
	rule.Scorers = map[string]float64{ScorerPrefix: 1, ScorerKVFit: 3}
	view.Cache = map[string]int{}
	if ch, _ := b.Choose("c", rule, cands, view, Request{Blocks: 5}); ch.Host.Address != "10.0.0.2:8000" {
		t.Fatalf("new conversation went to %s, want the roomy pod", ch.Host.Address)
	}
}

// cache_aware weighs a pod's free KV cache by what the request would add
// there (kv_fit): a pod holding a fifth of the prompt with its cache 90% full
// keeps the request against a pod with 60% free (0.4 + (1 − 0.9·0.8)
// against 0.6), where free cache alone (kv_cache: 0.4 + 0.1) would move it.
func TestCacheAwareWeighsFreeCacheByWhatTheRequestAdds(t *testing.T) {
	view := View{
		Load:  api.LoadStats{},
		Cache: map[string]int{"10.0.0.1:8000": 1},
		Signals: map[string]api.PodSignals{
			"10.0.0.1:8000": {Running: 1, KVCacheUtil: 0.9},
			"10.0.0.2:8000": {Running: 1, KVCacheUtil: 0.4},
		},
	}
	b := New(Options{IntN: seededIntN(1)})
	if ch, err := b.Choose("c", herdRule, eps(2), view, Request{Blocks: 5, PromptLength: 2500}); err != nil || ch.Host.Address != "10.0.0.1:8000" {
		t.Fatalf("chose %+v %v, want the pod holding part of the prompt", ch, err)
	}
}

// When every pod runs one cold prefill of someone else's prompt, the
// metadata center sees them alike (one request, its whole prompt before the
// first token) and their reported caches differ by a few points of finished
// requests' entries. For a prompt nobody holds, cache_aware queues behind the
// pod whose own report says its prefill is nearly done, where kv_fit alone
// would take the freest cache; once a pod holds part of the prompt,
// cold_progress leaves the choice to the cache and load terms.
func TestCacheAwareQueuesBehindTheShortestReportedPrefill(t *testing.T) {
	load, sig := api.LoadStats{}, map[string]api.PodSignals{}
	for i, s := range []struct {
		util    float64
		prefill int64
	}{{0.93, 1149}, {0.96, 300}, {0.90, 1149}} {
		h := fmt.Sprintf("10.0.0.%d:8000", i+1)
		load[h] = api.EndpointStats{TotalReqs: 1, PromptLength: 1149}
		sig[h] = api.PodSignals{Running: 1, KVCacheUtil: s.util, PrefillTokens: s.prefill}
	}
	view := View{Load: load, Cache: map[string]int{}, Signals: sig}
	for seed := range uint64(20) {
		ch, err := New(Options{IntN: seededIntN(seed)}).Choose("c", herdRule, eps(3), view, Request{Blocks: 9, PromptLength: 1149})
		if err != nil || ch.Host.Address != "10.0.0.2:8000" {
			t.Fatalf("draw seed %d: chose %+v %v, want the pod 300 tokens from its first token", seed, ch, err)
		}
	}
	hosts := []Host{
		{Signals: true, KVUtil: 0.93, PrefillQueued: 1149}, {Signals: true, KVUtil: 0.96, PrefillQueued: 300},
		{Signals: true, KVUtil: 0.90, PrefillQueued: 1149}, {PrefillQueued: 0},
	}
	fit, progress := make([]float64, 4), make([]float64, 4)
	KVFitScorer{}.Score(&State{Hosts: hosts}, fit)
	if !(fit[2] > fit[0] && fit[0] > fit[1]) {
		t.Fatalf("kv_fit %v: want the 90%%-full pod first", fit)
	}
	ColdProgressScorer{}.Score(&State{Hosts: hosts}, progress)
	if want := []float64{0, 1 - 300.0/1149, 0, 0}; !slices.EqualFunc(progress, want, near) {
		t.Fatalf("cold_progress %v, want %v (no report: 0)", progress, want)
	}
	hosts[0].CacheRatio = 0.2
	ColdProgressScorer{}.Score(&State{Hosts: hosts}, progress)
	if !slices.Equal(progress, []float64{1, 1, 1, 1}) {
		t.Fatalf("cold_progress with the prompt partly held: %v, want all 1", progress)
	}
}

// A user's next question (6 of 7 blocks held by the pod already computing
// that user's other questions) stays there under cache_aware's holder
// filter, where the load terms alone send it to a pod holding only the
// document (4 of 7), which would compute the history again. A new user of
// the document (4 of 7 at best) is left to the scorers, and so is a
// continuation of a prompt whose holders take over half of the requests or
// that queue.
func TestHolderKeepsAContinuationWithItsHistory(t *testing.T) {
	hosts := func() []Host {
		return []Host{
			{Address: "user", Reqs: 4, Prompt: 6000, CacheRatio: 6.0 / 7, Share: 0.3},
			{Address: "doc", Reqs: 1, CacheRatio: 4.0 / 7, Share: 0.3},
			{Address: "idle", Share: 0.3},
		}
	}
	choose := func(rule config.LBRule, hs []Host) string {
		return hs[cacheAware(&State{Hosts: hs, Rule: rule, PromptLength: 3189, IntN: seededIntN(1)})].Address
	}
	on := herdRule
	on.HerdWait, on.HolderRatio = 1, 0.8
	off := on
	off.HolderRatio = 0
	// Without the filter: user 2·6/7 + 0 + 3·0 against doc 2·4/7 + 0.75 + 3·0.79.
	if got := choose(off, hosts()); got != "doc" {
		t.Fatalf("holder_ratio 0: the continuation went to %s, want doc", got)
	}
	if got := choose(on, hosts()); got != "user" {
		t.Fatalf("the continuation went to %s, want the pod holding its history", got)
	}
	// Before the cluster's window of decisions can tell a hot prompt from a
	// user's history, the scorers choose.
	early := hosts()
	for i := range early {
		early[i].Share = 0
	}
	if got := choose(on, early); got != "doc" {
		t.Fatalf("with no shares yet the continuation went to %s, want the scorers' doc", got)
	}
	newUser := hosts()
	newUser[0].CacheRatio = 4.0 / 7
	if got := choose(on, newUser); got != "doc" {
		t.Fatalf("a new user of the document went to %s, want the scorers' choice, doc", got)
	}
	// The user's pod took 60% of the decisions with more requests than the
	// idlest: a prompt many requests share.
	herded := hosts()
	herded[0].Share = 0.6
	if got := choose(on, herded); got != "doc" {
		t.Fatalf("the continuation stayed on a holder with 60%% of the requests (%s), want doc", got)
	}
	herded[0].Reqs = 0
	if got := choose(on, herded); got != "user" {
		t.Fatalf("the continuation left a holder as idle as the idlest for %s", got)
	}
	// Two busy holders of a prompt (a system prompt and a question) keep
	// it while they take no more than 1.5 times their fair share of the
	// requests: with two of three pods that is always, so two users whose
	// histories sit on different pods are not taken for a hot prompt.
	two := []Host{
		{Address: "a", Reqs: 6, Prompt: 8000, CacheRatio: 6.0 / 7, Share: 0.3},
		{Address: "b", Reqs: 6, Prompt: 8000, CacheRatio: 6.0 / 7, Share: 0.3},
		{Address: "idle", Share: 0.2},
	}
	if got := choose(off, two); got != "idle" {
		t.Fatalf("holder_ratio 0: went to %s, want idle", got)
	}
	if got := choose(on, two); got == "idle" {
		t.Fatal("two holders of three pods with 60% of the requests: went to the idle pod")
	}
	// Of five pods, two holders' fair share is 40%: at 60% they still keep
	// the prompt, past 1.5 times that it is hot and the scorers copy it.
	five := append(two[:2:2],
		Host{Address: "idle", Share: 0.1},
		Host{Address: "c", Reqs: 6, Share: 0.15},
		Host{Address: "d", Reqs: 6, Share: 0.15})
	if got := choose(on, five); got == "idle" {
		t.Fatal("two holders of five pods with 60% of the requests: went to the idle pod")
	}
	five[0].Share, five[1].Share, five[3].Share, five[4].Share = 0.35, 0.35, 0.1, 0.1
	if got := choose(on, five); got != "idle" {
		t.Fatalf("two holders of five pods with 70%% of the requests: went to %s, want idle", got)
	}
	// Requests queued, not yet admitted: the pod is not keeping up.
	backlog := hosts()
	backlog[0].Signals, backlog[0].Running, backlog[0].Waiting = true, 8, holderQueue
	if got := choose(on, backlog); got != "doc" {
		t.Fatalf("the continuation stayed on a holder with %d queued (%s), want doc", holderQueue, got)
	}
	backlog[0].Waiting = holderQueue - 1
	if got := choose(on, backlog); got != "user" {
		t.Fatalf("the continuation left a holder with %d queued for %s", holderQueue-1, got)
	}
}

// holder_wait: a holder still prefilling other users' cold prompts lets a
// continuation go when the prefill standing before it there exceeds
// holder_wait times that on the cheapest other pod; the scorers then choose.
func TestHolderWaitLetsABusyHolderGo(t *testing.T) {
	hosts := func(queued int64) []Host {
		return []Host{
			{Address: "user", Reqs: 3, CacheRatio: 6.0 / 7, Share: 0.3, Signals: true, Running: 3, PrefillQueued: queued},
			{Address: "doc", Reqs: 1, CacheRatio: 4.0 / 7, Share: 0.3, Signals: true, Running: 1},
			{Address: "idle", Share: 0.3, Signals: true},
		}
	}
	rule := herdRule
	rule.HerdWait, rule.HolderRatio, rule.HolderWait = 1, 0.8, 2
	choose := func(rule config.LBRule, hs []Host) string {
		return hs[cacheAware(&State{Hosts: hs, Rule: rule, PromptLength: 3500, IntN: seededIntN(1)})].Address
	}
	// Costs: user queued + 500, doc 1500, idle 3500.
	if got := choose(rule, hosts(2400)); got != "user" {
		t.Fatalf("a holder at 2900 against 1500 elsewhere gave the continuation to %s", got)
	}
	if got := choose(rule, hosts(2600)); got != "doc" {
		t.Fatalf("a holder at 3100 against 1500 elsewhere kept the continuation (%s), want the scorers' doc", got)
	}
	rule.HolderWait = 0
	if got := choose(rule, hosts(9000)); got != "user" {
		t.Fatalf("holder_wait 0: the continuation went to %s", got)
	}
}

// A filter before the holder filter narrows the holders it chooses among:
// with `filters: [kv_full, holder]`, a continuation whose best holder is
// KV-full with a request waiting goes to the next pod holding at least
// holder_ratio of it, not to the scorers' pick.
func TestHolderChoosesAmongTheEarlierFiltersSurvivors(t *testing.T) {
	prof := cacheAwareProfile()
	prof.Filters = []PodFilter{KVFull{}, Holder{}}
	rule := herdRule
	rule.HerdWait, rule.HolderRatio = 1, 0.8
	hosts := []Host{
		{Address: "full", Reqs: 5, CacheRatio: 6.0 / 7, Share: 0.2, Signals: true, Running: 4, Waiting: 1, KVUtil: 0.99},
		{Address: "copy", Reqs: 5, Prompt: 6000, CacheRatio: 0.85, Share: 0.2},
		{Address: "doc", Reqs: 1, CacheRatio: 4.0 / 7, Share: 0.3},
		{Address: "idle", Share: 0.3},
	}
	choose := func(hs []Host) string {
		return hs[prof.Choose(&State{Hosts: hs, Rule: rule, PromptLength: 3189, IntN: seededIntN(1)})].Address
	}
	if got := choose(hosts); got != "copy" {
		t.Fatalf("went to %s, want copy: the best holder that is not KV-full", got)
	}
	// The scorers alone would not choose it.
	rule.HolderRatio = 0
	if got := choose(hosts); got == "copy" || got == "full" {
		t.Fatalf("holder_ratio 0: went to %s, want the scorers' doc or idle", got)
	}
}

// Seed 3 of real shared-prefix at 5.9 s: a document's third user asks
// again while two pods compute the document's first copies (one of them
// this user's first question, queued) and the third pod is idle. The
// question goes to a copy and the idle pod is left for a prompt no pod
// holds. It takes the idle pod when both copies queue two requests or more,
// when another pod is idle too, or when only one pod holds the prompt.
func TestReserveKeepsTheLastIdlePodForAnotherPrompt(t *testing.T) {
	prof := cacheAwareProfile()
	holderOnly := *prof
	holderOnly.Filters = []PodFilter{Holder{}}
	rule := herdRule
	rule.HerdWait, rule.HolderRatio, rule.HolderWait = 1, 0.8, 3
	hosts := func(waiting int64) []Host {
		return []Host{
			{Address: "copy1", Reqs: 3, Prompt: 9567, CacheRatio: 4.0 / 7, Share: 0.5, Signals: true, Running: 3 - waiting, Waiting: waiting, PrefillQueued: 2000 + 3189*waiting},
			{Address: "copy2", Reqs: 3, Prompt: 9567, CacheRatio: 6.0 / 7, Share: 0.5, Signals: true, Running: 1, Waiting: 2, PrefillQueued: 8400},
			{Address: "idle", Signals: true},
		}
	}
	choose := func(p *Profile, hs []Host) string {
		return hs[p.Choose(&State{Hosts: hs, Rule: rule, PromptLength: 3189, IntN: seededIntN(1)})].Address
	}
	if got := choose(prof, hosts(1)); got == "idle" {
		t.Fatal("took the last idle pod for a third copy of the prompt")
	}
	// Without the filter the scorers take it.
	if got := choose(&holderOnly, hosts(1)); got != "idle" {
		t.Fatalf("with filters [holder] went to %s, want idle", got)
	}
	if got := choose(prof, hosts(2)); got != "idle" {
		t.Fatalf("with both copies queueing two went to %s, want idle", got)
	}
	two := append(hosts(1), Host{Address: "idle2", Signals: true})
	if got := choose(prof, two); got != "idle" && got != "idle2" {
		t.Fatalf("with two idle pods went to %s, want an idle one", got)
	}
	one := hosts(1)
	one[0].CacheRatio = 0
	if got := choose(prof, one); got != "idle" {
		t.Fatalf("a prompt one pod holds went to %s, want idle: only a third copy is held back", got)
	}
}
