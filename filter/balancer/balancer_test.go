package balancer

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

var seedRule = config.LBRule{Policy: ProfileSeed, CacheRatioWeight: 2, RequestLoadWeight: 1, PrefillLoadWeight: 3, CandidatePercent: 10}

// defaultRule is the lb rule a configuration without lb_mapping_rule gets:
// cache_aware with its defaults.
func defaultRule(t testing.TB) config.LBRule {
	t.Helper()
	cfg, err := config.Parse([]byte("model_mapping_rule: {m: [{cluster: c}]}"))
	if err != nil {
		t.Fatal(err)
	}
	return cfg.LBMappingRule.Default
}

// seededIntN is a deterministic, concurrency-safe random source.
func seededIntN(seed uint64) func(int) int {
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	return func(n int) int {
		mu.Lock()
		defer mu.Unlock()
		return r.IntN(n)
	}
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

// TestSeedWorkedExample is the base formula's worked example (docs/configuration.md): pods A/B/C with
// reqs 8/2/5, prompt 4096/1024/2048 and 0, 2 and 1 of 3 blocks cached.
//
// The seed rounds the cache ratios to two decimals (0.67 and 0.33) before
// scoring; with them A = -4.2 and B = 2×0.67 − 0.75 = 0.59 exactly as
// printed. For C it prints -1.54, but its own terms give
// 2×0.33 − 1.2×0.5 − 3×0.5 = 0.66 − 0.6 − 1.5 = -1.44: an arithmetic slip in
// the seed (no rounding yields -1.54). The code uses exact ratios:
// A = -4.2, B = 0.58333…, C = -1.43333…; the ranking B > C > A and the
// choice of B are the seed's.
func TestSeedWorkedExample(t *testing.T) {
	rounded := []Host{
		{Address: "A", Reqs: 8, Prompt: 4096, CacheRatio: 0},
		{Address: "B", Reqs: 2, Prompt: 1024, CacheRatio: 0.67},
		{Address: "C", Reqs: 5, Prompt: 2048, CacheRatio: 0.33},
	}
	s := Scores(rounded, seedRule, nil)
	if !near(s[0], -4.2) || !near(s[1], 0.59) || !near(s[2], -1.44) {
		t.Fatalf("seed-rounded scores = %v, want [-4.2 0.59 -1.44]", s)
	}

	// The same through Choose, from the metadata center's wire answer.
	cands := []endpoints.Endpoint{{Address: "10.0.1.1:8000"}, {Address: "10.0.1.2:8000"}, {Address: "10.0.1.3:8000"}}
	view := View{
		Load: api.LoadStats{
			"10.0.1.1:8000": {TotalReqs: 8, PromptLength: 4096},
			"10.0.1.2:8000": {TotalReqs: 2, PromptLength: 1024},
			"10.0.1.3:8000": {TotalReqs: 5, PromptLength: 2048},
		},
		Cache: map[string]int{"10.0.1.2:8000": 2, "10.0.1.3:8000": 1},
	}
	var hosts [3]Host
	NewTracker().fill("c", cands, view, Request{Blocks: 3}, hosts[:])
	exact := Scores(hosts[:], seedRule, nil)
	if !near(exact[0], -4.2) || !near(exact[1], 2.0*2/3-0.75) || !near(exact[2], 2.0/3-0.6-1.5) {
		t.Fatalf("exact scores = %v", exact)
	}
	if !near(math.Round(exact[0]*100)/100, -4.2) || !near(math.Round(exact[1]*100)/100, 0.58) || !near(math.Round(exact[2]*100)/100, -1.43) {
		t.Fatalf("exact scores rounded = %v", exact)
	}
	for seed := uint64(0); seed < 200; seed++ {
		b := New(Options{IntN: seededIntN(seed)})
		ch, err := b.Choose("c", seedRule, cands, view, Request{Blocks: 3})
		if err != nil || ch.Host.Address != "10.0.1.2:8000" {
			t.Fatalf("seed %d: chose %+v %v, want pod B", seed, ch, err)
		}
		if !near(ch.Host.CacheRatio, 2.0/3) {
			t.Fatalf("cache ratio %v", ch.Host.CacheRatio)
		}
	}
	// The request's own prompt length does not enter the seed's score.
	for seed := uint64(0); seed < 50; seed++ {
		ch, err := New(Options{IntN: seededIntN(seed)}).Choose("c", seedRule, cands, view, Request{Blocks: 3, PromptLength: 1536})
		if err != nil || ch.Host.Address != "10.0.1.2:8000" {
			t.Fatalf("seed %d with a prompt length: chose %+v %v, want pod B", seed, ch, err)
		}
	}
}

func TestDynamicRequestWeight(t *testing.T) {
	// delta = 4 (≤ 5): W2 stays 1; the busiest pod loses exactly W2.
	s := Scores([]Host{{Reqs: 0}, {Reqs: 4}}, seedRule, nil)
	if !near(s[0], 0) || !near(s[1], -1) {
		t.Fatalf("delta 4: %v", s)
	}
	// delta = 10 (> 5): W2' = 1·10/5 = 2.
	s = Scores([]Host{{Reqs: 0}, {Reqs: 10}}, seedRule, nil)
	if !near(s[1], -2) {
		t.Fatalf("delta 10: %v", s)
	}
	// delta floors at 2: one extra request costs half of W2.
	s = Scores([]Host{{Reqs: 3}, {Reqs: 4}}, seedRule, nil)
	if !near(s[1], -0.5) {
		t.Fatalf("delta floor: %v", s)
	}
	// No prompt anywhere: the prefill term is zero, not NaN.
	for _, v := range Scores([]Host{{}, {}}, seedRule, nil) {
		if v != 0 {
			t.Fatalf("idle scores %v", v)
		}
	}
}

func eps(n int) []endpoints.Endpoint {
	out := make([]endpoints.Endpoint, n)
	for i := range out {
		out[i] = endpoints.Endpoint{Address: fmt.Sprintf("10.0.0.%d:8000", i+1)}
	}
	return out
}

func TestTopPercentOnly(t *testing.T) {
	// Ten pods with distinct scores (pod i has i requests): with 30% only
	// the three least loaded may be picked, and each of them is.
	cands := eps(10)
	load := api.LoadStats{}
	for i, e := range cands {
		load[e.Address] = api.EndpointStats{TotalReqs: int64(i)}
	}
	rule := seedRule
	rule.CandidatePercent = 30
	b := New(Options{IntN: seededIntN(1)})
	seen := map[string]int{}
	for range 3000 {
		ch, _ := b.Choose("c", rule, cands, View{Load: load}, Request{})
		seen[ch.Host.Address]++
		b.Tracker().Begin("c", ch.Host.Address, 0, Request{}).End() // over before the next one
	}
	if len(seen) != 3 || seen["10.0.0.1:8000"] == 0 || seen["10.0.0.2:8000"] == 0 || seen["10.0.0.3:8000"] == 0 {
		t.Fatalf("picks %v", seen)
	}
	for _, n := range seen {
		if n < 800 || n > 1200 {
			t.Fatalf("not uniform among the top: %v", seen)
		}
	}
}

func TestEqualScoresSpreadAtRandom(t *testing.T) {
	// Without tie-breaking, candidate_percent 10 of 5 pods means "always the
	// first pod listed" when all score alike.
	cands := eps(5)
	b := New(Options{IntN: seededIntN(2)})
	seen := map[string]int{}
	for range 5000 {
		ch, _ := b.Choose("c", seedRule, cands, View{Load: api.LoadStats{}}, Request{Blocks: 4})
		seen[ch.Host.Address]++
	}
	for _, e := range cands {
		if n := seen[e.Address]; n < 850 || n > 1150 {
			t.Fatalf("ties not broken uniformly: %v", seen)
		}
	}
}

func TestPickTopTieGroupPastTheCut(t *testing.T) {
	// Scores 5, 3, 3, 3 with a cut of 2: the 5 keeps its half, the three 3s
	// share the other half although two of them lie past the cut.
	scores := []float64{3, 3, 5, 3}
	intn := seededIntN(3)
	counts := make([]int, 4)
	for range 12000 {
		counts[pickTop(scores, 50, intn)]++
	}
	if counts[2] < 5700 || counts[2] > 6300 {
		t.Fatalf("best pod share %v", counts)
	}
	for _, i := range []int{0, 1, 3} {
		if counts[i] < 1700 || counts[i] > 2300 {
			t.Fatalf("tied pods %v", counts)
		}
	}
}

func TestBurstSpreadsWithLocalInFlight(t *testing.T) {
	// The metadata center's view is stale (all idle) for the whole burst:
	// only local accounting can stop every decision from picking alike.
	for _, policy := range []string{config.PolicyCacheAware, config.PolicyLeastRequest} {
		cands := eps(4)
		b := New(Options{IntN: seededIntN(4)})
		rule := defaultRule(t)
		rule.Policy = policy
		per := map[string]int{}
		for range 40 {
			ch, err := b.Choose("c", rule, cands, View{Load: api.LoadStats{}}, Request{})
			if err != nil {
				t.Fatal(err)
			}
			b.Tracker().Begin("c", ch.Host.Address, 1000, Request{})
			per[ch.Host.Address]++
		}
		for _, e := range cands {
			if per[e.Address] != 10 {
				t.Fatalf("%s: burst of 40 over 4 pods: %v", policy, per)
			}
		}
	}
}

// A decision counts on its pod from Choose, before the caller begins the
// request: two decisions in that gap do not pick the same idle pod. Begin
// takes the reservation over (the pod counts once), and a decision that is
// never begun lapses after reserveTTL.
func TestDecisionReservesItsPodUntilBegun(t *testing.T) {
	now := time.Unix(1000, 0)
	b := New(Options{IntN: seededIntN(2)})
	tr := b.Tracker()
	tr.now = func() time.Time { return now }
	cands := eps(2)
	rule := seedRule
	rule.Policy = config.PolicyLeastRequest
	view := View{Load: api.LoadStats{}}
	first, err := b.Choose("c", rule, cands, view, Request{PromptLength: 1000})
	if err != nil {
		t.Fatal(err)
	}
	second, err := b.Choose("c", rule, cands, view, Request{PromptLength: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if first.Host.Address == second.Host.Address {
		t.Fatalf("both decisions before either began took %s", first.Host.Address)
	}
	// The reservations count a request and its prefill on each pod; Begin
	// replaces them rather than adding to them.
	var hs [2]Host
	tr.fill("c", cands, view, Request{}, hs[:])
	for _, h := range hs {
		if h.Reqs != 1 || h.Prompt != 1000 {
			t.Fatalf("reserved: %+v", hs)
		}
	}
	f := tr.Begin("c", first.Host.Address, 1000, Request{})
	tr.fill("c", cands, view, Request{}, hs[:])
	for _, h := range hs {
		if h.Reqs != 1 || h.Prompt != 1000 {
			t.Fatalf("one begun, one reserved: %+v", hs)
		}
	}
	// The second is never begun (its client left): it lapses.
	now = now.Add(reserveTTL + time.Millisecond)
	tr.fill("c", cands, view, Request{}, hs[:])
	if begun, lapsed := hs[first.Index], hs[second.Index]; begun.Reqs != 1 || lapsed.Reqs != 0 || lapsed.Prompt != 0 {
		t.Fatalf("after the lapse: begun %+v, lapsed %+v", begun, lapsed)
	}
	f.End()
	if len(tr.clusters) != 0 || len(tr.reserved["c"]) != 0 {
		t.Fatalf("leftover: %v %v", tr.clusters, tr.reserved)
	}
}

// A conversation's next turn comes within a millisecond of the previous
// answer's end, and the metadata center still counts that request on the
// pod until its done lands. Turns alternate between two pods that each
// hold most of the conversation (the holder the last turn, the other pod
// the one before: a turn adds a tenth of the prompt), and that stale
// request was what made the holder lose to the other: the conversation
// moved on every turn with both pods idle.
func TestNextTurnStaysOnItsIdleHolder(t *testing.T) {
	holder, previous := "10.0.0.1:8000", "10.0.0.2:8000"
	view := View{Load: api.LoadStats{holder: {TotalReqs: 1}}, Cache: map[string]int{holder: 24, previous: 22, "10.0.0.3:8000": 16}}
	for seed := range uint64(20) {
		b := New(Options{IntN: seededIntN(seed)})
		last := b.Tracker().Begin("c", holder, 200, Request{})
		last.Acked()
		last.FirstToken()
		last.End() // its done is on its way
		ch, err := b.Choose("c", defaultRule(t), eps(3), view, Request{Blocks: 26, PromptLength: 1700})
		if err != nil || ch.Host.Address != holder {
			t.Fatalf("draw seed %d: chose %+v %v, want the idle holder %s", seed, ch.Host, err, holder)
		}
	}
}

func TestAckedRequestsAreNotCountedTwice(t *testing.T) {
	tr := NewTracker()
	f := tr.Begin("c", "h:1", 100, Request{})
	g := tr.Begin("c", "h:1", 50, Request{})
	cands := []endpoints.Endpoint{{Address: "h:1"}}
	var hs [1]Host

	// The metadata center does not know either yet.
	tr.fill("c", cands, View{Load: api.LoadStats{}}, Request{}, hs[:])
	if hs[0].Reqs != 2 || hs[0].Prompt != 150 {
		t.Fatalf("before ack: %+v", hs[0])
	}
	// f's add landed: the metadata center counts it, the tracker must not.
	f.Acked()
	tr.fill("c", cands, View{Load: api.LoadStats{"h:1": {TotalReqs: 1, PromptLength: 100}}}, Request{}, hs[:])
	if hs[0].Reqs != 2 || hs[0].Prompt != 150 {
		t.Fatalf("after ack: %+v", hs[0])
	}
	// g's first token: its prompt no longer loads the pod.
	g.FirstToken()
	tr.fill("c", cands, View{Load: api.LoadStats{"h:1": {TotalReqs: 1, PromptLength: 100}}}, Request{}, hs[:])
	if hs[0].Reqs != 2 || hs[0].Prompt != 100 {
		t.Fatalf("after first token: %+v", hs[0])
	}
	// Degraded: local counts stand in for the metadata center.
	tr.fill("c", cands, View{Degraded: true, Cache: map[string]int{"h:1": 5}}, Request{Blocks: 5}, hs[:])
	if hs[0].Reqs != 2 || hs[0].Prompt != 100 || hs[0].CacheRatio != 0 {
		t.Fatalf("degraded: %+v", hs[0])
	}
	// Repeated calls change nothing.
	f.Acked()
	g.FirstToken()
	g.End()
	g.End()
	f.End()
	// Both ended here. f's add had landed and its done has not yet: the
	// metadata center still counts f, and the tracker takes it off; g was
	// never counted there.
	seen := func(leases int64) int64 {
		tr.fill("c", cands, View{Load: api.LoadStats{"h:1": {TotalReqs: leases}}}, Request{}, hs[:])
		return hs[0].Reqs
	}
	if n := seen(1); n != 0 {
		t.Fatalf("ended, f's done on its way: %d requests", n)
	}
	// g's add lands after its end, its done behind it: counted there too.
	g.Acked()
	if n := seen(2); n != 0 {
		t.Fatalf("ended, g acked late: %d requests", n)
	}
	// f's done lands: the metadata center no longer counts f; another
	// gateway's request there stays counted.
	f.Released()
	f.Released()
	if n, m := seen(1), seen(2); n != 0 || m != 1 {
		t.Fatalf("f released: %d requests, %d beside another gateway's", n, m)
	}
	g.Released()
	g.Acked()
	if n, u := tr.InFlight("c", "h:1"); n != 0 || u != 0 || len(tr.clusters) != 0 {
		t.Fatalf("leftover: %d %d %v", n, u, tr.clusters)
	}
	var nilFlight *Flight
	nilFlight.Acked()
	nilFlight.FirstToken()
	nilFlight.End()
	nilFlight.Released()
}

func TestTrackerConcurrent(t *testing.T) {
	tr := NewTracker()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 500 {
				f := tr.Begin("c", fmt.Sprint("h", (i+j)%3), j, Request{})
				if j%2 == 0 {
					f.Acked()
				}
				f.FirstToken()
				f.End()
				f.Released()
			}
		}()
	}
	wg.Wait()
	if len(tr.clusters) != 0 {
		t.Fatalf("leaked %v", tr.clusters)
	}
}

func TestPolicies(t *testing.T) {
	cands := eps(4)
	view := View{
		Load:  api.LoadStats{"10.0.0.1:8000": {TotalReqs: 9}, "10.0.0.2:8000": {TotalReqs: 1}, "10.0.0.3:8000": {TotalReqs: 5}, "10.0.0.4:8000": {TotalReqs: 7}},
		Cache: map[string]int{"10.0.0.3:8000": 4, "10.0.0.4:8000": 2},
	}
	b := New(Options{IntN: seededIntN(5)})
	rule := seedRule
	choose := func(policy string) string {
		rule.Policy = policy
		ch, err := b.Choose("c", rule, cands, view, Request{Blocks: 4})
		if err != nil {
			t.Fatal(err)
		}
		return ch.Host.Address
	}
	if got := choose(config.PolicyLeastRequest); got != "10.0.0.2:8000" {
		t.Fatalf("least_request chose %s", got)
	}
	if got := choose(config.PolicyPrefixOnly); got != "10.0.0.3:8000" {
		t.Fatalf("prefix_only chose %s", got)
	}
	var rr []string
	for range 8 {
		rr = append(rr, choose(config.PolicyRoundRobin))
	}
	if fmt.Sprint(rr[:4]) != fmt.Sprint(rr[4:]) || rr[0] == rr[1] || rr[1] == rr[2] || rr[2] == rr[3] || rr[0] == rr[3] {
		t.Fatalf("round_robin order %v", rr)
	}
	seen := map[string]bool{}
	for range 200 {
		seen[choose(config.PolicyRandom)] = true
	}
	if len(seen) != 4 {
		t.Fatalf("random reached %v", seen)
	}
	for name, p := range b.policies {
		want := name != config.PolicyRoundRobin && name != config.PolicyRandom
		if p.NeedsMetadata() != want {
			t.Fatalf("%s NeedsMetadata = %v", name, p.NeedsMetadata())
		}
	}
	rule.Policy = "nope"
	if _, err := b.Choose("c", rule, cands, view, Request{Blocks: 4}); err == nil {
		t.Fatal("unknown policy accepted")
	}
}

func TestFilterAndNoEndpoint(t *testing.T) {
	all := []endpoints.Endpoint{
		{Address: "a:1", Labels: map[string]string{"lora": "sql", "pool": "x"}},
		{Address: "b:1", Labels: map[string]string{"lora": "chat", "pool": "x"}},
		{Address: "c:1"},
	}
	if got := Filter(append([]endpoints.Endpoint(nil), all...), map[string]string{"pool": "x"}, map[string]string{"lora": "sql"}); len(got) != 1 || got[0].Address != "a:1" {
		t.Fatalf("filter = %v", got)
	}
	if got := Filter(append([]endpoints.Endpoint(nil), all...)); len(got) != 3 {
		t.Fatalf("no selector filtered: %v", got)
	}
	none := Filter(append([]endpoints.Endpoint(nil), all...), map[string]string{"lora": "vision"})
	if _, err := New(Options{}).Choose("c", seedRule, none, View{}, Request{}); !errors.Is(err, ErrNoEndpoint) {
		t.Fatalf("err = %v", err)
	}
}

// nthSmallest must find what sorting finds, whatever the order and however
// many ties, infinities and NaNs: the picker's threshold depends on it.
func TestNthSmallestMatchesSort(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	special := []float64{math.NaN(), math.Inf(1), math.Inf(-1), 0, math.Copysign(0, -1), 1, 1, 2}
	for n := 1; n <= 300; n++ {
		a := make([]float64, n)
		for i := range a {
			switch r.IntN(4) {
			case 0:
				a[i] = special[r.IntN(len(special))]
			case 1:
				a[i] = float64(r.IntN(3))
			default:
				a[i] = r.Float64()
			}
		}
		for _, order := range []string{"random", "ascending", "descending"} {
			in := slices.Clone(a)
			switch order {
			case "ascending":
				slices.Sort(in)
			case "descending":
				slices.Sort(in)
				slices.Reverse(in)
			}
			sorted := slices.Clone(in)
			slices.Sort(sorted)
			for _, k := range []int{0, n / 2, n - max(1, n/10), n - 1} {
				got, want := nthSmallest(slices.Clone(in), k), sorted[k]
				if got != want && !(math.IsNaN(got) && math.IsNaN(want)) {
					t.Fatalf("n=%d %s k=%d: got %v, sort has %v", n, order, k, got, want)
				}
			}
		}
	}
}

// A request past its first token here no longer loads its pod, though the
// metadata center counts its prompt until the first-token update lands (or
// the done): a conversation's next turn must not see its holder as still
// prefilling the turn before.
func TestFirstTokenSeenHereIsTakenOffTheMetadataCentersPrompt(t *testing.T) {
	tr := NewTracker()
	cands := []endpoints.Endpoint{{Address: "h:1"}}
	var hs [1]Host
	prompt := func(mc int64) int64 {
		tr.fill("c", cands, View{Load: api.LoadStats{"h:1": {TotalReqs: 1, PromptLength: mc}}}, Request{}, hs[:])
		return hs[0].Prompt
	}
	f := tr.Begin("c", "h:1", 100, Request{})
	f.Acked()
	if p := prompt(100); p != 100 {
		t.Fatalf("prefilling: prompt %d, want 100", p)
	}
	f.FirstToken()
	if p := prompt(100); p != 0 {
		t.Fatalf("first token seen, its update on its way: prompt %d, want 0", p)
	}
	f.FirstTokenLanded()
	f.FirstTokenLanded()
	if p := prompt(0); p != 0 {
		t.Fatalf("first-token update landed: prompt %d, want 0", p)
	}
	if p := prompt(70); p != 70 {
		t.Fatalf("another gateway's request prefilling: prompt %d, want 70", p)
	}

	// The first token before the add landed: the lease arrives with its
	// prompt, taken off until the first-token update lands; a done that
	// lands first ends it too.
	g := tr.Begin("c", "h:1", 40, Request{})
	g.FirstToken()
	g.Acked()
	if p := prompt(40); p != 0 {
		t.Fatalf("acked after its first token: prompt %d, want 0", p)
	}
	g.End()
	g.Released()
	g.FirstTokenLanded()
	if p := prompt(30); p != 30 {
		t.Fatalf("released: prompt %d, want the other 30", p)
	}
	f.End()
	f.Released()
	if n, u := tr.InFlight("c", "h:1"); n != 0 || u != 0 {
		t.Fatalf("leftover: %d %d", n, u)
	}
	var nilFlight *Flight
	nilFlight.FirstTokenLanded()
}

// A route answer asked before a done or a first-token update landed may
// still count the request or its prompt, though the tracker stopped taking
// them off when the update landed: a conversation's next turn is routed
// within a millisecond of the answer's end, and its holder must not look
// busy with the turn before. An answer asked after the landing is read as
// it is.
func TestAnswerAskedBeforeAnUpdateLandedIsCorrected(t *testing.T) {
	tr := NewTracker()
	now := time.Unix(1000, 0)
	tr.now = func() time.Time { return now }
	cands := []endpoints.Endpoint{{Address: "h:1"}}
	var hs [1]Host
	seen := func(asked time.Time, leases, prompt int64) Host {
		tr.fill("c", cands, View{Load: api.LoadStats{"h:1": {TotalReqs: leases, PromptLength: prompt}}, Asked: asked}, Request{}, hs[:])
		return hs[0]
	}
	f := tr.Begin("c", "h:1", 100, Request{})
	f.Acked()
	f.FirstToken()
	f.End()
	asked := now
	now = now.Add(time.Millisecond)
	f.FirstTokenLanded()
	f.Released()
	// Another gateway's request of 30 bytes is prefilling there.
	if h := seen(asked, 2, 130); h.Reqs != 1 || h.Prompt != 30 {
		t.Fatalf("asked before the updates landed: %d requests, prompt %d; want 1, 30", h.Reqs, h.Prompt)
	}
	if h := seen(now.Add(time.Millisecond), 1, 30); h.Reqs != 1 || h.Prompt != 30 {
		t.Fatalf("asked after: %d requests, prompt %d; want 1, 30", h.Reqs, h.Prompt)
	}
	// A request whose add landed after the query was asked is not in the
	// answer: its done landing takes nothing off it.
	g := tr.Begin("c", "h:1", 50, Request{})
	asked2 := now
	now = now.Add(time.Millisecond)
	g.Acked()
	g.FirstToken()
	g.End()
	g.FirstTokenLanded()
	g.Released()
	if h := seen(asked2, 1, 30); h.Reqs != 1 || h.Prompt != 30 {
		t.Fatalf("asked before the add landed: %d requests, prompt %d; want 1, 30", h.Reqs, h.Prompt)
	}
	now = now.Add(eventMemory + time.Second)
	if h := seen(asked, 1, 30); h.Reqs != 1 || h.Prompt != 30 || len(tr.landed["c"]) != 0 {
		t.Fatalf("past eventMemory: %d requests, prompt %d, remembered %v", h.Reqs, h.Prompt, tr.landed)
	}
}

// A pod's own report taken before a first token seen here still counts
// that request's prefill, one taken before an end here still counts that
// request running, and one taken before a request was sent does not count
// it; the tracker says how much of each happened since, and forgets events
// older than any report it is answered.
func TestFilledSinceReport(t *testing.T) {
	tr := NewTracker()
	now := time.Unix(1000, 0)
	tr.now = func() time.Time { return now }
	cands := []endpoints.Endpoint{{Address: "h:1"}}
	var hs [1]Host
	filled := func(ageMS int64) int64 {
		tr.fill("c", cands, View{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{"h:1": {PrefillTokens: 900, AgeMS: ageMS}}}, Request{}, hs[:])
		if n := hs[0].FilledReqsSinceReport; (n > 0) != (hs[0].FilledSinceReport > 0) {
			t.Fatalf("%d requests filled, %d bytes", n, hs[0].FilledSinceReport)
		}
		return hs[0].FilledSinceReport
	}
	f := tr.Begin("c", "h:1", 1000, Request{})
	now = now.Add(50 * time.Millisecond)
	f.FirstToken()
	if n := filled(40); n != 1000 || hs[0].BegunReqsSinceReport != 0 {
		t.Fatalf("report 40 ms old, sent 50 ms ago, first token 0 ms ago: filled %d, want 1000; %d sent since, want 0", n, hs[0].BegunReqsSinceReport)
	}
	if n := filled(80); n != 0 || hs[0].BegunReqsSinceReport != 1 {
		t.Fatalf("report older than the request: filled %d, want 0 (it never counted it); %d sent since, want 1", n, hs[0].BegunReqsSinceReport)
	}
	now = now.Add(100 * time.Millisecond)
	if n := filled(80); n != 0 {
		t.Fatalf("report newer than the first token: filled %d, want 0", n)
	}
	f.End()
	if filled(80); hs[0].EndedReqsSinceReport != 1 {
		t.Fatalf("report older than the end: %d ended since", hs[0].EndedReqsSinceReport)
	}
	now = now.Add(100 * time.Millisecond)
	if filled(80); hs[0].EndedReqsSinceReport != 0 {
		t.Fatalf("report newer than the end: %d ended since", hs[0].EndedReqsSinceReport)
	}
	g := tr.Begin("c", "h:1", 500, Request{})
	now = now.Add(30 * time.Millisecond)
	g.End()
	if filled(80); hs[0].EndedReqsSinceReport != 0 || hs[0].BegunReqsSinceReport != 0 {
		t.Fatalf("a request sent and ended since the report: %d ended, %d sent since; want neither", hs[0].EndedReqsSinceReport, hs[0].BegunReqsSinceReport)
	}
	now = now.Add(eventMemory + time.Second)
	if n := filled(5000); n != 0 || len(tr.fills["c"]) != 0 {
		t.Fatalf("past eventMemory: filled %d, remembered %v", n, tr.fills)
	}
}

// The model reads the pod's reported queue less what was done since the
// report: a conversation's holder that reported the turn before as queued
// is not predicted slower than a cold pod.
func TestStaleReportedQueueIsNotCounted(t *testing.T) {
	p := predictor{m: newTTFTModel(nil, nil, slog.New(slog.DiscardHandler)), bpt: 1, rate: 1000, step: 0.01, promptTokens: 1000, req: Request{PromptLength: 1000}}
	// The report caught the turn before queued and prefilling.
	holder := Host{Address: "a", CacheRatio: 0.9, Signals: true, Waiting: 1, PrefillQueued: 900, FilledSinceReport: 900, FilledReqsSinceReport: 1}
	cold := Host{Address: "b", Signals: true}
	if h, c := p.predict(&holder), p.predict(&cold); h.Total >= c.Total || h.QueuedTokens != 0 || h.SlotWait != 0 {
		t.Fatalf("holder %+v, cold %+v", h, c)
	}
}
