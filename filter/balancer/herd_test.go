package balancer

import (
	"fmt"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

var herdRule = func() config.LBRule { r := seedRule; r.HerdShare = 2; return r }()

// The seed's weights keep a prefix on the pod that holds it until that pod
// has about ten more requests than the idlest. Herd control takes the cache
// credit away from a pod that has been taking more than twice its share and
// is busier than the idlest pod, and only from such a pod.
func TestHerdShareTakesCacheCreditFromAnOverusedBusyHolder(t *testing.T) {
	hosts := []Host{
		{Address: "holder", Reqs: 1, CacheRatio: 1, Share: 0.6},
		{Address: "idle1"}, {Address: "idle2"}, {Address: "idle3"},
	}
	if s := Scores(hosts, seedRule, 1000, nil); s[0] <= s[1] {
		t.Fatalf("seed scores %v: the busy holder should still win without herd control", s)
	}
	if s := Scores(hosts, herdRule, 1000, nil); s[0] >= s[1] {
		t.Fatalf("herd scores %v: a holder at 0.6 of the requests of 4 pods (limit 0.5), busier than the idlest, should lose", s)
	}
	// Not busier than the idlest pod: nothing is waiting there, keep the cache.
	hosts[0].Reqs = 0
	if s := Scores(hosts, herdRule, 1000, nil); s[0] <= s[1] {
		t.Fatalf("scores %v: an idle holder should keep its cache credit whatever its share", s)
	}
	// Within twice its share: the seed's score.
	hosts[0].Reqs, hosts[0].Share = 1, 0.5
	got, want := Scores(hosts, herdRule, 1000, nil), Scores(hosts, seedRule, 1000, nil)
	for i := range got {
		if !near(got[i], want[i]) {
			t.Fatalf("share at the limit: scores %v, want the seed's %v", got, want)
		}
	}
}

// The seed's worked example, with the default herd control and the shares
// a window could hold: B still wins (B is the idlest pod, so it is never
// herded, and the others only lose cache credit).
func TestSeedWorkedExampleWithHerdControl(t *testing.T) {
	for _, shares := range [][3]float64{{0, 0, 0}, {0.2, 0.4, 0.4}, {0.1, 0.8, 0.1}, {0.05, 0.05, 0.9}} {
		hosts := []Host{
			{Address: "A", Reqs: 8, Prompt: 4096, CacheRatio: 0, Share: shares[0]},
			{Address: "B", Reqs: 2, Prompt: 1024, CacheRatio: 2.0 / 3, Share: shares[1]},
			{Address: "C", Reqs: 5, Prompt: 2048, CacheRatio: 1.0 / 3, Share: shares[2]},
		}
		if i := pickTop(Scores(hosts, herdRule, 0, nil), 10, func(int) int { return 0 }); i != 1 {
			t.Fatalf("shares %v: chose %s, want B", shares, hosts[i].Address)
		}
	}
}

// One hot prompt through a real Balancer: the metadata center says one pod
// holds it, and each request stays in flight for the next two decisions (as
// a hot prompt's short requests do). The seed's score never lets the holder
// get ten requests ahead, so it takes every one; herd control stops it once
// it has had more than twice its share while busier than the idlest pod.
func TestHotPromptSpreadsThroughTheBalancer(t *testing.T) {
	const n, requests = 4, 200
	cands := make([]endpoints.Endpoint, n)
	for i := range cands {
		cands[i] = endpoints.Endpoint{Address: fmt.Sprintf("10.0.0.%d:8000", i+1)}
	}
	holder := cands[0].Address
	run := func(rule config.LBRule) map[string]int {
		b := New(Options{IntN: seededIntN(7)})
		got := map[string]int{}
		var flights []*Flight
		for range requests {
			// The metadata center has seen none of them yet: the load comes
			// from the tracker's unacknowledged requests.
			view := View{Load: api.LoadStats{}, Cache: map[string]int{holder: 2}}
			ch, err := b.Choose("c", rule, cands, view, Request{Blocks: 2, PromptLength: 1100})
			if err != nil {
				t.Fatal(err)
			}
			flights = append(flights, b.Tracker().Begin("c", ch.Host.Address, 0))
			if len(flights) > 2 {
				flights[0].End()
				flights = flights[1:]
			}
			got[ch.Host.Address]++
		}
		return got
	}
	if seed := run(seedRule); seed[holder] != requests {
		t.Fatalf("without herd control: %v, want all %d on the holder", seed, requests)
	}
	got := run(herdRule)
	// 2n: the first decisions are made before there are shares to read.
	if limit := requests*2/n + 2*n; got[holder] > limit || got[holder] < requests/n || len(got) != n {
		t.Fatalf("with herd control: %v, want the holder between its share (%d) and twice it (%d), every pod used", got, requests/n, limit)
	}
}

// Shares are counted over the last windowPerHost·n decisions, per cluster
// and candidate set.
func TestRoutedWindow(t *testing.T) {
	tr := NewTracker()
	cands := []endpoints.Endpoint{{Address: "a"}, {Address: "b"}, {Address: "c"}, {Address: "d"}}
	shares := func(cands []endpoints.Endpoint) map[string]float64 {
		out := make([]Host, len(cands))
		tr.fill("c", cands, View{Load: api.LoadStats{}}, 0, out)
		m := map[string]float64{}
		for _, h := range out {
			m[h.Address] = h.Share
		}
		return m
	}
	for range 7 {
		tr.Routed("c", cands, "a")
	}
	if s := shares(cands); s["a"] != 0 {
		t.Fatalf("7 decisions for 4 pods: shares %v, want none yet (under 2 per pod)", s)
	}
	tr.Routed("c", cands, "b")
	if s := shares(cands); s["a"] != 7.0/8 || s["b"] != 1.0/8 {
		t.Fatalf("shares %v, want a 7/8, b 1/8", s)
	}
	// The same set in another order is the same window.
	reversed := []endpoints.Endpoint{cands[3], cands[2], cands[1], cands[0]}
	if s := shares(reversed); s["a"] != 7.0/8 {
		t.Fatalf("reordered candidates: shares %v, want a 7/8", s)
	}
	// The window holds 32 decisions: 32 more for b push every a out.
	for range 32 {
		tr.Routed("c", cands, "b")
	}
	if s := shares(cands); s["a"] != 0 || s["b"] != 1 {
		t.Fatalf("after the window turned over: shares %v, want b 1", s)
	}
	// Another candidate set of the cluster (another label selector) has
	// its own window and leaves this one alone.
	two := cands[:2]
	for range 4 {
		tr.Routed("c", two, "a")
	}
	if s := shares(two); s["a"] != 1 {
		t.Fatalf("the two-pod set: shares %v, want a 1", s)
	}
	if s := shares(cands); s["b"] != 1 {
		t.Fatalf("the four-pod set after decisions in the two-pod set: shares %v, want b still 1", s)
	}
	if len(tr.recent) != 2 {
		t.Fatalf("%d windows, want 2", len(tr.recent))
	}
}

// Requests of two label selectors alternating in one cluster: before the
// window was keyed by candidate set, each switch restarted it and herd
// control never saw a share. Now each set keeps its count.
func TestHerdWindowSurvivesMixedSelectors(t *testing.T) {
	b := New(Options{IntN: seededIntN(3)})
	all := make([]endpoints.Endpoint, 8)
	for i := range all {
		pool := "x"
		if i >= 4 {
			pool = "y"
		}
		all[i] = endpoints.Endpoint{Address: fmt.Sprintf("10.0.0.%d:8000", i+1), Labels: map[string]string{"pool": pool}}
	}
	view := View{Load: api.LoadStats{}}
	for range 40 {
		for _, pool := range []string{"x", "y"} {
			cands := Filter(append([]endpoints.Endpoint(nil), all...), map[string]string{"pool": pool})
			if _, err := b.Choose("c", herdRule, cands, view, Request{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, pool := range []string{"x", "y"} {
		cands := Filter(append([]endpoints.Endpoint(nil), all...), map[string]string{"pool": pool})
		if w := b.tracker.recent[windowKey{"c", b.tracker.setHash(cands)}]; w == nil || w.filled != 32 {
			t.Fatalf("pool %s: window %+v, want 32 decisions", pool, w)
		}
	}
}

// Pods that score alike go to the one with the smallest recent share,
// whatever the random source draws; pods that do not score alike keep the
// score's order however their shares stand.
func TestCacheAwareBreaksTiesByRecentShare(t *testing.T) {
	hosts := []Host{
		{Address: "a", Share: 0.4}, {Address: "b", Share: 0.1},
		{Address: "c", Share: 0.3}, {Address: "d", Share: 0.2},
	}
	for draw := range 4 {
		s := &State{Hosts: hosts, Rule: herdRule, IntN: func(n int) int { return min(draw, n-1) }}
		if i := cacheAware(s); hosts[i].Address != "b" {
			t.Fatalf("draw %d: chose %s, want b (fewest recent requests)", draw, hosts[i].Address)
		}
	}
	// One live request more outweighs any share.
	hosts[1].Reqs = 1
	s := &State{Hosts: hosts, Rule: herdRule, IntN: func(int) int { return 0 }}
	if i := cacheAware(s); hosts[i].Address != "d" {
		t.Fatalf("chose %s, want d (b is busier; d has the smallest share of the rest)", hosts[i].Address)
	}
}

// With herd_wait, herd control only moves a prefix off an overused holder
// when waiting there costs more than copying the prefix elsewhere: the
// prefill queued on the holder plus the request's uncached part, against
// a cold prefill (plus its queue) on the cheapest other pod.
func TestHerdWaitKeepsAPrefixOnItsHolderUntilWaitingCostsMoreThanACopy(t *testing.T) {
	const prompt = 1100
	// One request of the prompt is before its first token on the holder
	// (the metadata center's pending prompt bytes); the pods report their
	// queued prefill tokens themselves (signals < 0: no fresh report).
	choose := func(rule config.LBRule, holderQueued, idleQueued int64) string {
		hosts := []Host{
			{Address: "holder", Reqs: 1, Prompt: prompt, CacheRatio: 1, Share: 0.6},
			{Address: "idle1"}, {Address: "idle2"}, {Address: "idle3"},
		}
		if holderQueued >= 0 {
			hosts[0].Signals, hosts[0].PrefillQueued = true, holderQueued
			for i := 1; i < len(hosts); i++ {
				hosts[i].Signals, hosts[i].PrefillQueued = true, idleQueued
			}
		}
		s := &State{Cluster: "c", Hosts: hosts, Rule: rule, PromptLength: prompt, IntN: func(int) int { return 0 }}
		return hosts[cacheAware(s)].Address
	}
	gated := herdRule
	gated.HerdWait = 1
	// The pending request is a cache hit: ~60 tokens of prefill left on
	// the holder, against 1100 cold ones anywhere else.
	if got := choose(herdRule, 60, 0); got == "holder" {
		t.Fatalf("herd control on shares alone should move the request off the holder, chose %s", got)
	}
	if got := choose(gated, 60, 0); got != "holder" {
		t.Fatalf("herd_wait 1: 60 tokens queued on the holder cost less than a 1100-token copy, chose %s", got)
	}
	// The holder's queue grew past a copy's cost: replicate.
	if got := choose(gated, 1500, 0); got == "holder" {
		t.Fatalf("herd_wait 1: 1500 tokens queued on the holder cost more than a 1100-token copy, chose the holder")
	}
	// ... unless the other pods are busy too: a copy there would wait.
	if got := choose(gated, 1500, 800); got != "holder" {
		t.Fatalf("herd_wait 1: a copy would wait 800+1100 tokens, the holder 1500; chose %s", got)
	}
	// herd_wait 2 tolerates twice a copy's cost on the holder.
	gated.HerdWait = 2
	if got := choose(gated, 1500, 0); got != "holder" {
		t.Fatalf("herd_wait 2: 1500 ≤ 2×1100, chose %s", got)
	}
	// Without fresh reports the gate reads the metadata center's pending
	// prompt bytes: 1100 on the holder, at most 2×1100.
	if got := choose(gated, -1, 0); got != "holder" {
		t.Fatalf("herd_wait 2 without signals: 1100 pending bytes ≤ 2×1100, chose %s", got)
	}
}

// The cold start of shared-prefix: a request whose document (2/3 of its
// prompt) is being prefilled for another user's cold prompt on one pod.
// The seed's weights send it there for the document's cache credit, where
// it waits for that whole prefill and then does its own third; with
// cache_wait 1 the credit goes, since a cold prefill on an idle pod is
// done sooner.
func TestCacheWaitSendsAFollowerAwayFromAPodStillPrefillingAColdPrompt(t *testing.T) {
	const prompt = 3200
	choose := func(rule config.LBRule, queued int64) string {
		hosts := []Host{
			{Address: "prefilling", Reqs: 1, Prompt: prompt, CacheRatio: 2.0 / 3, Signals: true, PrefillQueued: queued},
			{Address: "idle1", Signals: true}, {Address: "idle2", Signals: true}, {Address: "idle3", Signals: true},
		}
		s := &State{Cluster: "c", Hosts: hosts, Rule: rule, PromptLength: prompt, IntN: func(int) int { return 0 }}
		return hosts[cacheAware(s)].Address
	}
	gated := herdRule
	gated.CacheWait = 1
	if got := choose(herdRule, prompt); got != "prefilling" {
		t.Fatalf("without cache_wait the document's credit should win, chose %s", got)
	}
	// 3200 queued + 1067 of its own > 3200 cold on an idle pod.
	if got := choose(gated, prompt); got == "prefilling" {
		t.Fatalf("cache_wait 1: 4267 tokens before the first token on the prefilling pod against 3200 on an idle one, chose it")
	}
	// Nearly done there: 1000 + 1067 < 3200, the document is worth waiting for.
	if got := choose(gated, 1000); got != "prefilling" {
		t.Fatalf("cache_wait 1: 2067 tokens on the prefilling pod against 3200 elsewhere, chose %s", got)
	}
}

// The metadata center counts a request's whole prompt until its first
// token, cache hit or not; the pod's own report counts what it has still to
// prefill. A holder serving a cached request of the same prompt looks as
// busy as a cold copy to own_prefill, and nearly idle to reported_prefill.
func TestReportedPrefillReadsThePodsOwnQueue(t *testing.T) {
	hosts := []Host{
		{Address: "holder", Reqs: 1, Prompt: 3200, CacheRatio: 1, Signals: true, PrefillQueued: 64},
		{Address: "idle", Signals: true},
	}
	s := &State{Cluster: "c", Hosts: hosts, Rule: herdRule, PromptLength: 3200, IntN: func(int) int { return 0 }}
	own, rep := make([]float64, 2), make([]float64, 2)
	PrefillScorer{Own: true}.Score(s, own)
	PrefillScorer{Own: true, Reported: true}.Score(s, rep)
	if !near(own[0], own[1]) {
		t.Fatalf("own_prefill %v: 3200 pending bytes on the holder against a 3200-byte cold prefill should tie", own)
	}
	if want := 1 - 64.0/3200; !near(rep[0], want) || rep[1] != 0 {
		t.Fatalf("reported_prefill %v, want [%g 0]", rep, want)
	}
	// Without a fresh report the metadata center's figure stands.
	hosts[0].Signals = false
	PrefillScorer{Own: true, Reported: true}.Score(s, rep)
	if !near(rep[0], own[0]) || !near(rep[1], own[1]) {
		t.Fatalf("reported_prefill without signals %v, want own_prefill's %v", rep, own)
	}
}

// With G gateways sharing a cluster, a gateway's window holds a G-th of the
// cluster's decisions. It reads shares once the window stands for 2n of
// them, G estimated from the route answers: the cluster's live requests on
// the candidates (the metadata center's leases, every gateway's) at its
// decisions over its own live requests averaged over time. One gateway,
// whose view holds only its own requests, still waits for 2n decisions of
// its own.
func TestWindowWarmsWithTheClustersDecisions(t *testing.T) {
	cands := []endpoints.Endpoint{{Address: "a"}, {Address: "b"}, {Address: "c"}, {Address: "d"}}
	for _, tc := range []struct {
		name string
		// Each decision, one a second, sees leases on a; held of them are
		// this gateway's requests, which it keeps throughout; and one more
		// request of its own lives for brief seconds after each decision.
		leases, held int64
		brief        float64
		degraded     bool
		warmAt       int // decisions
	}{
		{"one gateway", 1, 1, 0, false, 8},
		// A done report on its way leaves a lease that is no longer ours.
		{"one gateway, a lease not yet ended", 4, 3, 0, false, 8},
		{"one gateway, short requests", 0, 0, 0.5, false, 8},
		{"three gateways", 3, 1, 0, false, 3},
		// Requests shorter than the time between this gateway's decisions:
		// it never sees one of its own live at a decision, but the others'
		// are (1 on average against its own 1/3).
		{"three gateways, short requests", 1, 0, 1.0 / 3, false, 3},
		{"many gateways: never under n/2 decisions", 40, 1, 0, false, 2},
		{"no metadata center", 3, 1, 0, true, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := NewTracker()
			now := time.Unix(1000, 0)
			tr.now = func() time.Time { return now }
			for range tc.held {
				tr.Begin("c", "a", 0).Acked()
			}
			view := View{Load: api.LoadStats{"a": {TotalReqs: tc.leases}}, Degraded: tc.degraded}
			out := make([]Host, len(cands))
			for i := 0; i <= 8; i++ {
				s := tr.fill("c", cands, view, 0, out)
				if warm := out[0].Share > 0; warm != (i >= tc.warmAt) {
					t.Fatalf("at decision %d: shares read %v, want from %d decisions on", i+1, warm, tc.warmAt+1)
				}
				tr.routed(s, "a", len(cands))
				if tc.brief > 0 {
					f := tr.Begin("c", "a", 0)
					f.Acked()
					now = now.Add(time.Duration(tc.brief * float64(time.Second)))
					f.End()
					f.Released() // its lease is gone from the next view
					now = now.Add(time.Duration((1 - tc.brief) * float64(time.Second)))
				} else {
					now = now.Add(time.Second)
				}
			}
		})
	}
}
