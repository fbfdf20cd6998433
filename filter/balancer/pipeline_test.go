package balancer

import (
	"bytes"
	"fmt"
	"log/slog"
	"math/rand/v2"
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
		got, want := totals(seed, s), Scores(hosts, seedRule, nil)
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

// SGLang-like: the longest prefix above 30% of the prompt, the smallest
// cache below it, the fewest requests once the fleet is imbalanced past both
// thresholds (max−min > 64 and max > 1.5·min).
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
	if got := choose(View{Load: load(70, 0, 5), Cache: map[string]int{"10.0.0.1:8000": 3}}); got != "10.0.0.2:8000" {
		t.Fatalf("imbalanced (70 vs 0): chose %s, want the shortest queue", got)
	}
	if got := choose(View{Load: load(100, 60, 40), Cache: map[string]int{"10.0.0.1:8000": 3}}); got != "10.0.0.1:8000" {
		t.Fatalf("100 vs 40 is within 64: chose %s, want the holder", got)
	}
	if got := choose(View{Load: load(1, 1, 1), Cache: map[string]int{"10.0.0.1:8000": 2}}); got != "10.0.0.1:8000" {
		t.Fatalf("half matched (above 30%%): chose %s, want the holder", got)
	}
	// 30% matched or less: the smallest "tree" — no decisions yet, so the
	// emptiest reported KV cache; then, as decisions pile up on it, the
	// others take their turn before it gets a second.
	sig := map[string]api.PodSignals{"10.0.0.1:8000": {KVCacheUtil: 0.9}, "10.0.0.2:8000": {KVCacheUtil: 0.2}, "10.0.0.3:8000": {KVCacheUtil: 0.5}}
	b = New(Options{IntN: seededIntN(2)})
	counts := map[string]int{}
	for i := range 30 {
		got := choose(View{Load: load(1, 1, 1), Cache: map[string]int{"10.0.0.1:8000": 1}, Signals: sig})
		if i == 0 && got != "10.0.0.2:8000" {
			t.Fatalf("a quarter matched (not above 30%%): chose %s, want the emptiest cache", got)
		}
		counts[got]++
	}
	if counts["10.0.0.1:8000"] < 5 || counts["10.0.0.2:8000"] < 5 || counts["10.0.0.3:8000"] < 5 {
		t.Fatalf("new conversations herded: %v", counts)
	}
}

// saturated is a filter registered from Go: it drops pods whose KV cache
// is full while requests wait there.
type saturated struct{}

func (saturated) Name() string { return "saturated" }
func (saturated) Keep(_ *State, h *Host) bool {
	return !h.Signals || h.KVUtil < 1 || h.Waiting == 0
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
	b := New(Options{IntN: seededIntN(3), Scorers: map[string]Scorer{"running": lowQueue{}}, Filters: map[string]PodFilter{"saturated": saturated{}}})
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
	// The registered filter drops the saturated pod before scoring.
	rule.Filters = []string{"saturated"}
	view.Signals["10.0.0.3:8000"] = api.PodSignals{Running: 1, Waiting: 3, KVCacheUtil: 1}
	ch, err = b.Choose("c", rule, cands, view, Request{Blocks: 4})
	if err != nil || ch.Host.Address != "10.0.0.2:8000" || ch.Index != 1 {
		t.Fatalf("with the filter: chose %+v %v, want index 1", ch, err)
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
// scorer logs its scores under its name and a filter the pods it removed,
// each in one line.
func TestStageMetricsAndScorerLogs(t *testing.T) {
	reg := prometheus.NewRegistry()
	var logs bytes.Buffer
	b := New(Options{Registerer: reg, Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Filters: map[string]PodFilter{"saturated": saturated{}}})
	rule := seedRule
	rule.Filters = []string{"saturated"}
	view := View{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{"10.0.0.2:8000": {Waiting: 2, Running: 4, KVCacheUtil: 1}}}
	if _, err := b.Choose("c", rule, eps(4), view, Request{Blocks: 1}); err != nil {
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
	for _, stage := range []string{"filters", "scorer:prefix", "scorer:seed_load", "scorer:seed_prefill", "picker"} {
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
	for _, want := range []string{"scorer=prefix", "scorer=seed_load", "picker=top_percent", `filter=saturated removed=[10.0.0.2:8000]`} {
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
	if ch, _ := b.Choose("c", rule, eps(1), view, Request{}); ch.Host.Signals {
		t.Error("signals read for a kv_cache scorer of weight 0")
	}
}
