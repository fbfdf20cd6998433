package balancer

import (
	"bytes"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// within says whether got is within frac of want.
func within(got, want, frac float64) bool { return math.Abs(got-want) <= frac*math.Abs(want) }

// A pod holding the whole prompt beats a pod holding none of it until the
// prefill queued on it costs more than the prompt's prefill on the cold pod
// (both pods otherwise alike, the default rate of 5000 tokens/s); in tokens,
// whatever the bytes per token.
func TestCachedPodWinsUntilItsQueueCostsMoreThanTheUncachedPrefill(t *testing.T) {
	const promptTokens = 4000
	for _, bpt := range []float64{1, 4} {
		for _, tc := range []struct {
			queuedTokens int64
			want         string
		}{
			{0, "holder"}, {2000, "holder"}, {3000, "holder"},
			// Past the tie window: 5000 queued tokens cost 1 s against the
			// cold pod's 0.8 s.
			{5000, "cold"}, {8000, "cold"},
		} {
			holder, cold := "10.0.0.1:8000", "10.0.0.2:8000"
			view := View{
				Load:  api.LoadStats{holder: {TotalReqs: 2, PromptLength: int64(float64(tc.queuedTokens) * bpt)}, cold: {}},
				Cache: map[string]int{holder: 8},
			}
			for seed := range uint64(20) {
				b := New(Options{IntN: seededIntN(seed)})
				if bpt != 1 {
					b.BytesPerToken("qwen").Observe(int64(promptTokens*bpt), promptTokens)
				}
				cands := []endpoints.Endpoint{{Address: holder}, {Address: cold}}
				ch, err := b.Choose("c", defaultRule(t), cands, view, Request{Blocks: 8, PromptLength: int64(promptTokens * bpt), Model: "qwen"})
				if err != nil {
					t.Fatal(err)
				}
				if got := map[string]string{holder: "holder", cold: "cold"}[ch.Host.Address]; got != tc.want {
					t.Fatalf("%g bytes/token, %d tokens queued on the holder: chose the %s pod (%+v), want the %s", bpt, tc.queuedTokens, got, ch.Prediction, tc.want)
				}
				// The prediction is the chosen pod's, in seconds.
				p := ch.Prediction
				// The holder runs requests: the one routed waits for half
				// its step in progress, or for the queue, which runs in
				// those steps.
				wantTotal := 0.025 + max(0.025/2, float64(tc.queuedTokens)/5000)
				if tc.want == "cold" {
					wantTotal = 0.025 + promptTokens/5000.0
				}
				if p.Host != ch.Host.Address || !within(p.Total, wantTotal, 1e-9) || !within(p.Total, p.Wait+p.Prefill+p.Step+p.Fit, 1e-12) {
					t.Fatalf("prediction %+v, want %g s", p, wantTotal)
				}
			}
		}
	}
}

// hostsState is a decision over hosts under the default rule.
func hostsState(t *testing.T, hosts []Host, promptLength int64, seed uint64) *State {
	return &State{Cluster: "c", Hosts: hosts, Rule: defaultRule(t), PromptLength: promptLength, BytesPerToken: 1, IntN: seededIntN(seed)}
}

// A pod whose free KV cannot hold the request's new tokens pays for the
// tokens it would evict or preempt. The free KV is the unused part of the
// capacity the pod reports, else comes from vLLM's reading of utilization
// (the blocks of running requests) and the fleet's mean prompt.
func TestKVFitChargesWhatDoesNotFit(t *testing.T) {
	m := testModel()
	m.means["c"] = &fleetMeans{prompt: 1000, uncached: 500}
	for _, tc := range []struct {
		name    string
		h       Host
		wantFit float64
	}{
		{"no signals: no estimate", Host{Address: "a"}, 0},
		{"half full: 4000 tokens free", Host{Address: "a", Signals: true, Running: 4, KVUtil: 0.5}, 0},
		// 4 running × 1000 tokens are 95%: 210.5 tokens free of the 2000
		// the request adds.
		{"95% full", Host{Address: "a", Signals: true, Running: 4, KVUtil: 0.95}, (2000 - 4000*0.05/0.95) / 5000},
		{"95% full, half the prompt held", Host{Address: "a", Signals: true, Running: 4, KVUtil: 0.95, CacheRatio: 0.5}, (1000 - 4000*0.05/0.95) / 5000},
		{"full, nothing running: no estimate", Host{Address: "a", Signals: true, KVUtil: 1}, 0},
		// A reported capacity of 3000 tokens, half used: 1500 free.
		{"capacity reported", Host{Address: "a", Signals: true, Running: 4, KVUtil: 0.5, KVCapacity: 3000}, 500.0 / 5000},
		{"capacity reported, nothing running", Host{Address: "a", Signals: true, KVCapacity: 1000}, 1000.0 / 5000},
	} {
		s := hostsState(t, []Host{tc.h}, 2000, 1)
		p := m.predictor(s)
		c := p.predict(&s.Hosts[0])
		if !within(c.Fit, tc.wantFit, 1e-9) {
			t.Errorf("%s: fit %g s, want %g", tc.name, c.Fit, tc.wantFit)
		}
	}
	// Through the policy: a pod holding a quarter of the prompt wins over a
	// cold one while it has room, and loses once its KV is full.
	ca := &CacheAware{m: m}
	for _, util := range []float64{0.5, 0.99} {
		hosts := []Host{
			{Address: "holder", CacheRatio: 0.25, Signals: true, Running: 4, KVUtil: util},
			{Address: "cold", Signals: true, Running: 4, KVUtil: 0.5},
		}
		want := 0
		if util > 0.9 {
			want = 1
		}
		for seed := range uint64(20) {
			if got := ca.Choose(hostsState(t, hosts, 2000, seed)); got != want {
				t.Fatalf("holder's KV %g%% used: chose %s", util*100, hosts[got].Address)
			}
		}
	}
}

// Pods predicted within tie_epsilon of the best that compute equally many
// of the request's tokens share the traffic evenly; a pod past it gets none.
func TestNearTiesSpread(t *testing.T) {
	ca := &CacheAware{m: testModel()}
	// Idle pods predict the step plus 1000 tokens' prefill (0.225 s); 40
	// tokens queued add 0.008 s (3.6%, a near-tie); 500 add 0.1 s (44%).
	hosts := []Host{{Address: "a"}, {Address: "b", Prompt: 40}, {Address: "c"}, {Address: "d", Prompt: 500}}
	s := hostsState(t, hosts, 1000, 7)
	counts := make([]int, len(hosts))
	for range 3000 {
		counts[ca.Choose(s)]++
	}
	for i, n := range counts[:3] {
		if n < 850 || n > 1150 {
			t.Fatalf("near-ties %v: pod %d got %d of 3000", counts, i, n)
		}
	}
	if counts[3] != 0 {
		t.Fatalf("a pod 44%% slower was chosen %d times", counts[3])
	}
	// tie_epsilon 0: only exact ties share.
	s.Rule.TieEpsilon = 0
	clear(counts)
	for range 1000 {
		counts[ca.Choose(s)]++
	}
	if counts[1] != 0 || counts[3] != 0 || counts[0] < 400 || counts[2] < 400 {
		t.Fatalf("tie_epsilon 0: %v", counts)
	}
}

// Among near-ties the pod that computes the fewest of the request's tokens
// wins: a pod prefilling the prompt's prefix predicts about what a cold pod
// does for the next request, and only the cold pod spends a second copy.
// Past tie_epsilon the prediction decides.
func TestNearTiesPreferTheFewestComputedTokens(t *testing.T) {
	ca := &CacheAware{m: testModel()}
	// The cold pods predict 0.025 + 2000/5000 = 0.425 s; the holder, with
	// 100 of the prompt's tokens to compute, 0.025 + (queued+100)/5000.
	for _, tc := range []struct {
		queued int64
		want   string
	}{
		{1900, "holder"}, // 0.425 s: a tie
		{1990, "holder"}, // 0.443 s: 4% above
		{2050, "cold"},   // 0.455 s: 7% above
	} {
		hosts := []Host{{Address: "cold1"}, {Address: "holder", CacheRatio: 0.95, Prompt: tc.queued}, {Address: "cold2"}}
		for seed := range uint64(20) {
			if got := hosts[ca.Choose(hostsState(t, hosts, 2000, seed))].Address; !strings.HasPrefix(got, tc.want) {
				t.Fatalf("holder %d tokens queued: chose %s, want %s", tc.queued, got, tc.want)
			}
		}
	}
}

// Among near-ties that compute alike, the pod with the fewest requests in
// flight wins (a new conversation starts on an idle pod rather than beside
// one that is decoding); equals share uniformly; computing fewer tokens
// still comes first.
func TestNearTiesThenTheFewestRequestsInFlight(t *testing.T) {
	ca := &CacheAware{m: testModel()}
	// Requests past their first token add nothing to the prediction: all
	// four cold pods predict the same TTFT.
	hosts := []Host{{Address: "busy", Reqs: 2}, {Address: "idle1"}, {Address: "one", Reqs: 1}, {Address: "idle2"}}
	counts := map[string]int{}
	for seed := range uint64(400) {
		counts[hosts[ca.Choose(hostsState(t, hosts, 1000, seed))].Address]++
	}
	if counts["busy"]+counts["one"] != 0 || counts["idle1"] < 150 || counts["idle2"] < 150 {
		t.Fatalf("chosen %v, want the two idle pods alike", counts)
	}
	// A holder with a request in flight still beats idle cold pods.
	hosts = []Host{{Address: "cold1"}, {Address: "holder", CacheRatio: 0.95, Reqs: 1}, {Address: "cold2"}}
	for seed := range uint64(20) {
		if got := hosts[ca.Choose(hostsState(t, hosts, 2000, seed))].Address; got != "holder" {
			t.Fatalf("chose %s, want the holder", got)
		}
	}
}

// Pods that report only what vLLM's /metrics give (waiting, running,
// kv_cache_usage_perc) get predictions in seconds that grow with their
// queue, and the idle one gets the request. Waiting requests cost a slot
// wait ((waiting+1) requests to end, one every hold/running seconds: 128
// steps each until a request has ended there) and the fleet's mean
// uncached prompt each.
func TestVLLMSignalsOnlyGiveSanePredictions(t *testing.T) {
	b := New(Options{IntN: seededIntN(1)})
	pods := eps(3)
	view := View{
		Load: api.LoadStats{},
		Signals: map[string]api.PodSignals{
			pods[0].Address: {Waiting: 0, Running: 1, KVCacheUtil: 0.1},
			pods[1].Address: {Waiting: 2, Running: 4, KVCacheUtil: 0.7},
			pods[2].Address: {Waiting: 6, Running: 4, KVCacheUtil: 0.9, KVCapacity: 1536},
		},
	}
	rule := defaultRule(t)
	hs := make([]Host, len(pods))
	b.tracker.fill("c", pods, view, Request{}, hs)
	if hs[2].KVCapacity != 1536 || hs[2].KVUtil != 0.9 || hs[2].Waiting != 6 || !hs[2].Signals {
		t.Fatalf("the pod's report reaches the model as %+v", hs[2])
	}
	ch, err := b.Choose("c", rule, pods, view, Request{PromptLength: 1000})
	if err != nil || ch.Host.Address != pods[0].Address {
		t.Fatalf("chose %+v %v, want the idle pod", ch, err)
	}
	// The first decision set the fleet's means: 1000 tokens, all uncached.
	p := b.ttft.predictor(&State{Cluster: "c", Rule: rule, PromptLength: 1000, BytesPerToken: 1})
	var costs []Cost
	for _, a := range pods {
		sig := view.Signals[a.Address]
		h := Host{Address: a.Address, Signals: true, Waiting: sig.Waiting, Running: sig.Running, KVUtil: sig.KVCacheUtil}
		costs = append(costs, p.predict(&h))
	}
	hold := 128 * 0.025
	want := []Cost{
		{SlotWait: 0, QueuedTokens: 0},
		{SlotWait: 3 * hold / 4, QueuedTokens: 2 * 1000},
		{SlotWait: 7 * hold / 4, QueuedTokens: 6 * 1000},
	}
	for i, c := range costs {
		if !within(c.SlotWait, want[i].SlotWait, 1e-9) || !within(c.QueuedTokens, want[i].QueuedTokens, 1e-9) || c.UncachedTokens != 1000 {
			t.Fatalf("pod %d: %+v, want slot wait %g s and %g tokens queued", i, c, want[i].SlotWait, want[i].QueuedTokens)
		}
		if math.IsNaN(c.Total) || c.Total <= 0 || c.Total > 30 || i > 0 && c.Total <= costs[i-1].Total {
			t.Fatalf("predictions %+v: want positive seconds growing with the queue", costs)
		}
	}
	// A request that decoded for 2 s there replaces the assumed hold; its
	// time before the first token does not count, nor does a request that
	// ended without one.
	now := time.Unix(100, 0)
	b.tracker.now = func() time.Time { return now }
	f := b.tracker.Begin("c", pods[1].Address, 0, Request{})
	now = now.Add(5 * time.Second)
	f.FirstToken()
	now = now.Add(2 * time.Second)
	f.End()
	b.tracker.Begin("c", pods[1].Address, 0, Request{}).End()
	b.ttft.mu.RLock()
	defer b.ttft.mu.RUnlock()
	h := Host{Address: pods[1].Address, Signals: true, Waiting: 2, Running: 4}
	if c := p.predict(&h); !within(c.SlotWait, 3*2.0/4, 1e-9) {
		t.Fatalf("slot wait %g s after a 2 s request, want 1.5", c.SlotWait)
	}
	// A pod that reports its running set full has no free slot even with
	// nothing waiting: one of its running requests must end first.
	for _, tc := range []struct {
		running, max int64
		want         float64
	}{{4, 4, 2.0 / 4}, {3, 4, 0}, {4, 0, 0}} {
		h := Host{Address: pods[1].Address, Signals: true, Running: tc.running, MaxRunning: tc.max}
		if c := p.predict(&h); !within(c.SlotWait, tc.want, 1e-9) {
			t.Fatalf("%d running of %d: slot wait %g s, want %g", tc.running, tc.max, c.SlotWait, tc.want)
		}
	}
}

// The prefill queued ahead runs while the request waits for a running
// slot, so the wait is the longer of the two, not their sum. A pod with 3
// requests waiting behind 4 running ones, each holding its slot 1 s:
// 4 × 1/4 = 1 s for a slot; 2000 queued tokens at 5000 tokens/s take 0.4 s
// (inside the slot wait), 10000 take 2 s (past it).
func TestTheQueuePrefillsWhileTheRequestWaitsForASlot(t *testing.T) {
	m := testModel()
	m.fit("pod").hold = 1
	p := m.predictor(&State{Cluster: "c", Rule: defaultRule(t), PromptLength: 500, BytesPerToken: 1})
	for _, tc := range []struct {
		queued   int64
		wantWait float64
	}{{2000, 1}, {10000, 2}} {
		h := Host{Address: "pod", Signals: true, Waiting: 3, Running: 4, PrefillQueued: tc.queued}
		c := p.predict(&h)
		if !within(c.SlotWait, 1, 1e-9) || !within(c.Queue, float64(tc.queued)/5000, 1e-9) || !within(c.Wait, tc.wantWait, 1e-9) ||
			!within(c.Total, tc.wantWait+500.0/5000+0.025, 1e-9) {
			t.Fatalf("%d tokens queued: %+v, want a wait of %g s", tc.queued, c, tc.wantWait)
		}
	}
}

// Where requests wait on a pod, what the request computes there delays
// each of them: a cold pod with requests waiting loses to a holder with
// more (the copy's 2000-token prefill would hold up its 2 waiting requests
// 0.4 s each), while an idle cold pod still wins: its copy delays the
// fleet's mean of 2 waiting requests (0.8 s), less than the holder's wait.
// Each pod runs 4 requests that hold their slot 1 s.
func TestACopyPaysForTheRequestsWaitingBehindIt(t *testing.T) {
	ca := &CacheAware{m: testModel()}
	for _, a := range []string{"holder", "cold", "idle"} {
		ca.m.fit(a).hold = 1
	}
	holder := Host{Address: "holder", CacheRatio: 0.95, Signals: true, Waiting: 4, Running: 4}
	cold := Host{Address: "cold", Signals: true, Waiting: 2, Running: 4}
	// Alone: holder 5/4 s slot wait + 100 tokens; cold 3/4 s + 2000 tokens
	// (0.4 s) + 2 × 0.4 s delay; by TTFT alone the cold pod is 0.08 s faster.
	p := ca.m.predictor(hostsState(t, nil, 2000, 0))
	ch, cc := p.predict(&holder), p.predict(&cold)
	if !(cc.Total < ch.Total) || !within(cc.Delay(0), 2*0.4, 1e-9) || !within(ch.Delay(0), 4*0.02, 1e-9) {
		t.Fatalf("holder %+v, cold %+v: want the cold pod faster for the request, and the delays of its prefills", ch, cc)
	}
	for seed := range uint64(20) {
		hosts := []Host{holder, cold}
		if got := hosts[ca.Choose(hostsState(t, hosts, 2000, seed))].Address; got != "holder" {
			t.Fatalf("chose %s, want the holder: the copy delays the cold pod's waiting requests", got)
		}
		hosts = []Host{holder, cold, {Address: "idle", Signals: true, Running: 1}}
		if got := hosts[ca.Choose(hostsState(t, hosts, 2000, seed))].Address; got != "idle" {
			t.Fatalf("chose %s, want the idle pod: nobody waits there", got)
		}
	}
}

// A pod that has just emptied its queue is filled again from the fleet's
// at once, so a copy there delays the fleet's mean waiting requests per
// pod. A 2000-token copy (0.4 s) on the empty pod against a holder whose
// slot is 0.75 s away: beside a pod with 4 waiting (a mean of 2 a pod) the
// copy costs 0.4 + 2 × 0.4 s and the holder wins; where nobody else waits
// (a mean of 2/3) it costs 0.4 + 0.27 s and the empty pod wins.
func TestACopyOnAnEmptiedPodDelaysTheFleetsWaitingRequests(t *testing.T) {
	ca := &CacheAware{m: testModel()}
	for _, a := range []string{"holder", "empty", "busy"} {
		ca.m.fit(a).hold = 1
	}
	holder := Host{Address: "holder", CacheRatio: 0.95, Signals: true, Waiting: 2, Running: 4}
	empty := Host{Address: "empty", Signals: true, Running: 3, MaxRunning: 4}
	for _, tc := range []struct {
		busyWaiting int64
		want        string
	}{{4, "holder"}, {0, "empty"}} {
		for seed := range uint64(20) {
			hosts := []Host{holder, empty, {Address: "busy", Signals: true, Waiting: tc.busyWaiting, Running: 4, MaxRunning: 4}}
			if got := hosts[ca.Choose(hostsState(t, hosts, 2000, seed))].Address; got != tc.want {
				t.Fatalf("%d waiting on the third pod: chose %s, want %s", tc.busyWaiting, got, tc.want)
			}
		}
	}
}

// A copy's new tokens evict as many cached tokens from the pod's full KV
// cache, recomputed later as often as the cluster's requests find their
// tokens cached. An idle cold pod gives a 1000-token prompt its first token
// at 0.2 + 0.025 s; the holder, its 4 slots taken, after a slot 0.25 s away,
// 50 tokens (0.01 s) and a step: 0.285 s, 0.06 s later. Once the answers
// tell that pods serve 80% of the prompts from cache, the copy's 0.2 s
// prefill costs 0.16 s more and the holder wins; where they served
// nothing, the cold pod stays the pick.
func TestACopyPaysForWhatItEvicts(t *testing.T) {
	for _, tc := range []struct {
		served float64
		want   string
	}{{0.8, "holder"}, {0, "cold"}} {
		ca := &CacheAware{m: testModel()}
		ca.m.fit("holder").hold = 1
		ca.m.routed("c", 1000, 1000)
		for range 200 {
			ca.m.observeCache(Prediction{Cost: Cost{Host: "holder", Total: 0.1}, Cluster: "c", PromptTokens: 1000, bpt: 1},
				1000, int64(tc.served*1000))
		}
		holder := Host{Address: "holder", CacheRatio: 0.95, Signals: true, Running: 4, MaxRunning: 4}
		cold := Host{Address: "cold", Signals: true}
		p := ca.m.predictor(hostsState(t, nil, 1000, 0))
		if ch, cc := p.predict(&holder), p.predict(&cold); !(cc.Total < ch.Total) || !within(cc.Evict, tc.served*cc.Prefill, 0.01*cc.Prefill) {
			t.Fatalf("served %g: holder %+v, cold %+v: want the cold pod faster, its eviction the served share of its prefill", tc.served, ch, cc)
		}
		for seed := range uint64(20) {
			hosts := []Host{holder, cold}
			if got := hosts[ca.Choose(hostsState(t, hosts, 1000, seed))].Address; got != tc.want {
				t.Fatalf("served %g: chose %s, want %s", tc.served, got, tc.want)
			}
		}
	}
}

// A conversation's next turn comes within a millisecond of the answer
// before it, while the pod's last report still shows that answer running
// and another conversation's turn waiting (for KV: two long conversations
// do not fit the pod). The end seen here since the report is taken off
// (the waiting turn took the freed slot), so the wait is not two holds
// for a slot but the one hold the running turn keeps the KV the new turn
// needs: 1,536 tokens of KV, 62% held by the one running request, a
// 960-token prompt, conversations of 900 tokens on average. A shorter
// prompt fits beside it at once.
func TestAnEndSinceTheReportFreesItsSlotAndTheKVDecidesTheWait(t *testing.T) {
	m := testModel()
	m.fit("holder").hold = 0.2
	m.routed("c", 900, 100)
	holder := Host{Address: "holder", Signals: true, Running: 1, Waiting: 1, MaxRunning: 4, KVCapacity: 1536, KVUtil: 0.62}
	p := m.predictor(hostsState(t, nil, 960, 0))
	if c := p.predict(&holder); !within(c.SlotWait, 2*0.2, 1e-9) {
		t.Fatalf("as reported: slot wait %g s, want two holds (0.4 s)", c.SlotWait)
	}
	holder.EndedReqsSinceReport, holder.EndedSinceReport = 1, 900 // a 900-token prompt
	c := p.predict(&holder)
	if !within(c.SlotWait, 0.2, 1e-9) || !within(c.KVShortTokens, 960-(1536-1536*0.62), 1e-9) {
		t.Fatalf("after the end: slot wait %g s, %g tokens short; want one hold (0.2 s), %g short", c.SlotWait, c.KVShortTokens, 960-(1536-1536*0.62))
	}
	p = m.predictor(hostsState(t, nil, 400, 0))
	if c := p.predict(&holder); c.SlotWait != 0 || c.KVShortTokens != 0 {
		t.Fatalf("a 400-token prompt: slot wait %g s, %g tokens short; want it to fit at once", c.SlotWait, c.KVShortTokens)
	}
	// Nothing running after the end: the KV is all free.
	idle := Host{Address: "holder", Signals: true, Running: 1, MaxRunning: 4, KVCapacity: 1536, KVUtil: 0.62, EndedReqsSinceReport: 1}
	if c := m.predictor(hostsState(t, nil, 960, 0)); c.predict(&idle).SlotWait != 0 {
		t.Fatalf("an emptied pod: slot wait %g s", c.predict(&idle).SlotWait)
	}
}

// A request this gateway sent to a pod since its report is there though
// the report does not show it: with every slot taken it waits, and the
// next request waits behind it too; with a slot free it runs at once.
// Each request holds its slot 1 s, 4 run at most.
func TestARequestSentSinceTheReportJoinsThePod(t *testing.T) {
	m := testModel()
	m.fit("pod").hold = 1
	p := m.predictor(hostsState(t, nil, 500, 0))
	full := Host{Address: "pod", Signals: true, Running: 4, MaxRunning: 4, BegunReqsSinceReport: 1}
	if c := p.predict(&full); !within(c.SlotWait, 2.0/4, 1e-9) {
		t.Fatalf("full pod, one request sent since: slot wait %g s, want two of four holds ending (0.5 s)", c.SlotWait)
	}
	roomy := Host{Address: "pod", Signals: true, Running: 2, MaxRunning: 4, BegunReqsSinceReport: 1}
	if c := p.predict(&roomy); c.SlotWait != 0 {
		t.Fatalf("a slot free after the request sent since: slot wait %g s, want none", c.SlotWait)
	}
	full.EndedReqsSinceReport = 1
	if c := p.predict(&full); !within(c.SlotWait, 1.0/4, 1e-9) {
		t.Fatalf("full pod, one sent and one ended since: slot wait %g s, want one hold of four (0.25 s)", c.SlotWait)
	}
}

// Where the request waited for a slot, its observed TTFT is the slot wait
// plus its own prefill: the fit learns the pod's rate from its own tokens,
// not from the queue's, whose prefill the slot wait covered. A pod at
// 10000 tokens/s with 10 ms steps, every request waiting 2 s for a slot
// behind 2000 to 8000 queued tokens: the fit finds 10000 tokens/s (about
// three times that if it counted the queue's tokens as computed in the
// time the request waited).
func TestTheFitLearnsTheRateBehindASlotWait(t *testing.T) {
	m := testModel()
	m.fit("pod").hold = 2
	rule := defaultRule(t)
	for i := range 200 {
		n := int64(200 + (i*733)%4000)
		s := &State{Cluster: "c", Rule: rule, PromptLength: n, BytesPerToken: 1,
			Hosts: []Host{{Address: "pod", Signals: true, Waiting: 3, Running: 4, PrefillQueued: 2000 + int64(i*977)%6000}}}
		p := m.chosen(s, 0)
		if !within(p.SlotWait, 2, 1e-9) || p.Queue >= p.SlotWait {
			t.Fatalf("prediction %+v: want the slot's 2 s wait to cover the queue", p)
		}
		m.observe(p, time.Duration((2+0.01+float64(n)/10000)*float64(time.Second)))
	}
	f := m.means["c"]
	if !within(1/f.secPerByte, 10000, 0.05) || !within(f.step, 0.01, 0.1) {
		t.Fatalf("fit %g tokens/s, step %g s; want 10000 and 0.01", 1/f.secPerByte, f.step)
	}
}

// A pod running anything takes a new request between steps: the request
// waits half a step on average before its prefill, and the fit learns the
// rate and the step behind that wait, not a longer step.
func TestAStepInProgressDelaysTheStart(t *testing.T) {
	m := testModel()
	rule := defaultRule(t)
	idle, busy := Host{Address: "idle", Signals: true}, Host{Address: "busy", Signals: true, Running: 2, Reqs: 2}
	p := m.predictor(&State{Cluster: "c", Rule: rule, PromptLength: 500, BytesPerToken: 1})
	ci, cb := p.predict(&idle), p.predict(&busy)
	if ci.InStep != 0 || !within(cb.InStep, 0.025/2, 1e-9) || !within(cb.Total, ci.Total+0.025/2, 1e-9) {
		t.Fatalf("idle %+v, busy %+v: want the busy pod half a 25 ms step later", ci, cb)
	}
	// A pod at 10,000 tokens/s with 10 ms steps, busy at every request.
	for i := range 200 {
		n := int64(200 + (i*733)%4000)
		s := &State{Cluster: "c", Rule: rule, PromptLength: n, BytesPerToken: 1, Hosts: []Host{busy}}
		pr := m.chosen(s, 0)
		m.observe(pr, time.Duration((0.01/2+0.01+float64(n)/10000)*float64(time.Second)))
	}
	f := m.means["c"]
	if !within(1/f.secPerByte, 10000, 0.05) || !within(f.step, 0.01, 0.1) {
		t.Fatalf("fit %g tokens/s, step %g s; want 10000 and 0.01", 1/f.secPerByte, f.step)
	}
}

// hotPrefix is a decision for a 1,000-byte prompt of 4 blocks whose first 3
// a busy or idle holder has cached, beside two pods holding none of it,
// idle unless othersBusy; every pod's KV holds capacity tokens.
func hotPrefix(t *testing.T, holderBusy, othersBusy bool, capacity int64, seed uint64) *State {
	holder := Host{Address: "holder", CacheRatio: 0.75, Signals: true, KVCapacity: capacity}
	if holderBusy {
		holder.Running, holder.Reqs = 1, 1
	}
	hosts := []Host{holder, {Address: "a", Signals: true, KVCapacity: capacity}, {Address: "b", Signals: true, KVCapacity: capacity}}
	if othersBusy {
		for i := 1; i < len(hosts); i++ {
			hosts[i].Running, hosts[i].Reqs = 1, 1
		}
	}
	s := hostsState(t, hosts, 1000, seed)
	s.Blocks, s.ChunkSize, s.Hashes = 4, 256, []string{"h0", "h1", "h2", "h3"}
	return s
}

// A prefix whose holder is busy whenever its requests come is copied once
// what its requests waited there, per request, over the requests the
// cluster serves before a copy would leave the KV cache, outweighs the
// copy: the holder predicts 116 tokens' prefill and half a step (60.5 ms)
// against a copy's 1,000 tokens (225 ms), a copy wait of 12.3 ms. The first
// two requests go to the holder (one wait alone is no evidence of a rate),
// the third to a pod that copies the prefix. An idle holder keeps its
// prefix whatever was waited before; so does a busy one where no pod
// reports its KV capacity (the copy's life is unknown), and one whose
// prefix's requests found no idle pod to copy to (every pod busy: the
// copy would only add work).
func TestABusyHotPrefixIsCopied(t *testing.T) {
	for _, tc := range []struct {
		name             string
		busy, othersBusy bool
		capacity         int64
		measured         bool // every pod reports its own costs, slower than the rule's defaults
		thirdCopy        bool
	}{
		{"busy holder", true, false, 65536, false, true},
		{"idle holder", false, false, 65536, false, false},
		{"no capacity reported", true, false, 0, false, false},
		{"every pod busy", true, true, 65536, false, false},
		// An idle pod that held the prefix would be priced as the
		// holder is: an idle holder is no later than it, whatever the
		// rule's defaults say.
		{"idle holder, pods measuring themselves", false, false, 65536, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ca := &CacheAware{m: testModel()}
			ca.m.routed("c", 1000, 200) // the cluster's requests compute 200 tokens each
			state := func(busy bool, seed uint64) *State {
				s := hotPrefix(t, busy, tc.othersBusy, tc.capacity, seed)
				if tc.measured {
					for i := range s.Hosts {
						s.Hosts[i].TokenSeconds, s.Hosts[i].StepSeconds = 1e-3, 0.05
					}
				}
				return s
			}
			for i := range uint64(2) {
				if s := state(true, i); s.Hosts[ca.Choose(s)].Address != "holder" {
					t.Fatalf("request %d: chose a copy, want the holder", i+1)
				}
			}
			s := state(tc.busy, 2)
			got := s.Hosts[ca.Choose(s)].Address
			if copied := got != "holder"; copied != tc.thirdCopy {
				t.Fatalf("third request: chose %s; want a copy: %v", got, tc.thirdCopy)
			}
		})
	}
}

// A prefix's copy waits count per decision of its cluster, one standard
// error low (k waits count (k − √k)/k of their sum), decayed by 1/waitMemory
// at each decision: a prefix that stopped waiting stops drawing copies.
func TestPrefixWaitsCountLowAndDecay(t *testing.T) {
	w := prefixWaits{prefixes: map[prefixKey]*prefixWait{}, clusters: map[string]*clusterCount{}}
	hot, none := prefixKey{"c", "hot"}, prefixKey{"c", ""}
	const keep = 1 - 1.0/waitMemory
	for i := range 2 {
		if got := w.add(hot, 0.01); got != 0 {
			t.Fatalf("wait %d: %g earlier, want 0: one wait is no rate", i+1, got)
		}
	}
	// Before the third: two waits, decayed twice and once, over three
	// decisions.
	k := keep*keep + keep
	want := 0.01 * k * (1 - 1/math.Sqrt(k)) / (keep*keep + keep + 1)
	if got := w.add(hot, 0.01); !within(got, want, 1e-9) {
		t.Fatalf("third: %g per decision, want %g", got, want)
	}
	for range 4 * waitMemory {
		w.add(none, 0)
	}
	if got := w.add(hot, 0); got > want*math.Exp(-4)*1.1 {
		t.Fatalf("after 4 memories of other decisions: %g per decision, want under %g", got, want*math.Exp(-4))
	}
	if got := w.add(prefixKey{"d", "hot"}, 0); got != 0 {
		t.Fatalf("another cluster's prefix of the same hash: %g, want 0", got)
	}
}

// A wait the model did not foresee (a request that found the KV cache
// full and waited 0.2 s for a running request to end) is not prefill: one
// observation in eight carrying one leaves the fit of a pod at 10000
// tokens/s with 10 ms steps predicting the others within 15%, short and
// long (bounded only by a factor 4, the step came out 17 ms and a
// 100-token prompt 50% over).
func TestUnforeseenWaitsStayOutOfTheFit(t *testing.T) {
	m := testModel()
	rule := defaultRule(t)
	for i := range 400 {
		n := int64(100 + (i*733)%1000)
		s := &State{Cluster: "c", Rule: rule, PromptLength: n, BytesPerToken: 1, Hosts: []Host{{Address: "pod"}}}
		p := m.chosen(s, 0)
		obs := 0.01 + float64(n)/10000
		if i%8 == 3 {
			obs += 0.2
		}
		m.observe(p, time.Duration(obs*float64(time.Second)))
	}
	for _, n := range []int64{100, 1100} {
		s := &State{Cluster: "c", Rule: rule, PromptLength: n, BytesPerToken: 1, Hosts: []Host{{Address: "pod"}}}
		if p, want := m.chosen(s, 0), 0.01+float64(n)/10000; !within(p.Total, want, 0.15) {
			f := m.means["c"]
			t.Fatalf("%d tokens: predicted %.1f ms, want %.1f (fit %.0f tokens/s, step %.1f ms)", n, p.Total*1000, want*1000, 1/f.secPerByte, f.step*1000)
		}
	}
}

// Until a model's first answer gives its bytes per token, predictions count
// prompt bytes as tokens; the fit, kept in bytes, learns the pod's speed
// from them all the same and predicts in tokens once the ratio is known. A
// pod at 10000 tokens/s with 10 ms steps, 4 bytes a token: after 40
// observations made at 1 byte a token, the first prediction at 4 is within
// 15% for short and long prompts (a fit kept in tokens would have learnt
// 40000 "tokens"/s, and predicted a quarter of every prefill).
func TestTheFitOutlivesLearningTheBytesPerToken(t *testing.T) {
	m := testModel()
	rule := defaultRule(t)
	truth := func(bytes int64) float64 { return 0.01 + float64(bytes)/4/10000 }
	for i := range 40 {
		n := int64(400 + (i*2931)%4000)
		s := &State{Cluster: "c", Rule: rule, PromptLength: n, BytesPerToken: 1, Hosts: []Host{{Address: "pod"}}}
		m.observe(m.chosen(s, 0), time.Duration(truth(n)*float64(time.Second)))
	}
	for _, n := range []int64{400, 4400} {
		s := &State{Cluster: "c", Rule: rule, PromptLength: n, BytesPerToken: 4, Hosts: []Host{{Address: "pod"}}}
		if p := m.chosen(s, 0); !within(p.Total, truth(n), 0.15) || !within(p.UncachedTokens, float64(n)/4, 1e-9) {
			t.Fatalf("%d bytes: predicted %.1f ms for %.0f tokens, want %.1f ms for %d", n, p.Total*1000, p.UncachedTokens, truth(n)*1000, n/4)
		}
	}
}

// Requests this gateway sent that neither the metadata center nor the
// pod's report counts yet stand in the pod's queue.
func TestUnreportedLocalRequestsQueue(t *testing.T) {
	b := New(Options{IntN: seededIntN(1)})
	pods := eps(2)
	view := View{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{pods[0].Address: {}, pods[1].Address: {}}}
	b.Tracker().Begin("c", pods[0].Address, 3000, Request{}) // not acknowledged
	for range 10 {
		ch, err := b.Choose("c", defaultRule(t), pods, view, Request{PromptLength: 100})
		if err != nil || ch.Host.Address != pods[1].Address {
			t.Fatalf("chose %+v %v, want the pod without the unreported 3000 tokens", ch, err)
		}
		b.Tracker().Begin("c", ch.Host.Address, 100, Request{}).End()
	}
	hs := make([]Host, 2)
	b.tracker.fill("c", pods, view, Request{}, hs)
	s := &State{Cluster: "c", Hosts: hs, Rule: defaultRule(t), PromptLength: 100, BytesPerToken: 1}
	if c := b.ttft.chosen(s, 0); c.QueuedTokens != 3000 {
		t.Fatalf("queued %g tokens, want the 3000 sent and not reported", c.QueuedTokens)
	}
}

// The first token checks the prediction: the relative error lands in the
// histogram, both figures in one debug line, and the cluster's fit moves to
// what it observes. A pod that prefills 20000 tokens/s with 10 ms steps is
// predicted within 10% after a few dozen requests of varied sizes, and
// within 5% at the smallest and the largest sizes.
func TestObserveChecksAndRefitsThePrediction(t *testing.T) {
	reg := prometheus.NewRegistry()
	var logs bytes.Buffer
	b := New(Options{IntN: seededIntN(1), Registerer: reg, Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	pods := eps(1)
	view := View{Load: api.LoadStats{}}
	truth := func(p Prediction) time.Duration {
		return time.Duration((0.01 + (p.QueuedTokens+p.UncachedTokens)/20000) * float64(time.Second))
	}
	var lastErr float64
	for i := range 60 {
		n := int64(200 + (i*733)%4000)
		ch, err := b.Choose("c", defaultRule(t), pods, view, Request{PromptLength: n})
		if err != nil {
			t.Fatal(err)
		}
		obs := truth(ch.Prediction)
		lastErr = (obs.Seconds() - ch.Prediction.Total) / obs.Seconds()
		if i == 0 && !within(lastErr, (obs.Seconds()-(0.025+float64(n)/5000))/obs.Seconds(), 1e-9) {
			t.Fatalf("first prediction %+v: not the defaults'", ch.Prediction)
		}
		b.Observe(ch.Prediction, obs)
		f := b.tracker.Begin("c", ch.Host.Address, int(n), Request{})
		f.FirstToken()
		f.End()
		f.Released()
	}
	if math.Abs(lastErr) > 0.1 {
		t.Fatalf("after 60 observations the error is %.0f%%", lastErr*100)
	}
	// The fit is a line, so short and long prompts are both right: the
	// step is not mistaken for prefill nor the prefill for step.
	for _, n := range []int64{100, 4000} {
		ch, err := b.Choose("c", defaultRule(t), pods, view, Request{PromptLength: n})
		if err != nil {
			t.Fatal(err)
		}
		obs := truth(ch.Prediction).Seconds()
		if e := (ch.Prediction.Total - obs) / obs; math.Abs(e) > 0.05 {
			t.Fatalf("%d tokens: predicted %.1f ms, observed %.1f ms", n, ch.Prediction.Total*1000, obs*1000)
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var count uint64
	for _, mf := range mfs {
		if mf.GetName() == "llm_filter_balancer_ttft_prediction_error" {
			count = mf.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	if count != 60 {
		t.Fatalf("histogram holds %d errors, want 60", count)
	}
	for _, want := range []string{"msg=ttft", "observed=", "msg=cache_aware", ".waiting=", ".max_running="} {
		if !strings.Contains(logs.String(), want) {
			t.Fatalf("debug lines lack %q:\n%.2000s", want, logs.String())
		}
	}
	// A zero prediction (a decision without one) is ignored.
	b.Observe(Prediction{}, time.Second)
	b.Observe(Prediction{Cost: Cost{Host: "x", Total: 1}}, time.Second)
}

// Bytes per token: 1 until observed, then the ratio of what was observed,
// following a change over a few hundred requests.
func TestBytesPerToken(t *testing.T) {
	var nilRate *BytesPerToken
	var r BytesPerToken
	if nilRate.Value() != 1 || r.Value() != 1 {
		t.Fatal("unobserved rate is not 1")
	}
	r.Observe(0, 10)
	r.Observe(10, -1)
	if r.Value() != 1 {
		t.Fatalf("bad observations counted: %g", r.Value())
	}
	r.Observe(4000, 1000)
	r.Observe(300, 100)
	if !within(r.Value(), (4000*(1-1.0/256)+300)/(1000*(1-1.0/256)+100), 1e-12) {
		t.Fatalf("value %g", r.Value())
	}
	for range 2000 {
		r.Observe(200, 100)
	}
	if !within(r.Value(), 2, 1e-3) {
		t.Fatalf("after the traffic changed: %g, want 2", r.Value())
	}
	b := New(Options{})
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				b.BytesPerToken(fmt.Sprint("m", i%2)).Observe(3, 1)
			}
		}()
	}
	wg.Wait()
	if !within(b.BytesPerToken("m0").Value(), 3, 1e-12) || b.BytesPerToken("m1") == b.BytesPerToken("m0") {
		t.Fatal("per-model rates")
	}
}

// BenchmarkDecide is one routing decision of the default policy (and of
// the epp stand-in, for comparison) for an 8 KiB prompt at 64 and 256 pods,
// every pod with load, a cached prefix and signals. It reports the p99 of
// single decisions besides the mean.
//
//	go test -run '^$' -bench BenchmarkDecide -benchtime 20000x ./filter/balancer/
func BenchmarkDecide(b *testing.B) {
	for _, policy := range []string{config.PolicyCacheAware, ProfileEPP} {
		for _, n := range []int{64, 256} {
			b.Run(fmt.Sprintf("%s/%d", policy, n), func(b *testing.B) {
				cands := eps(n)
				for i := range cands {
					cands[i].Address = fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250+1)
				}
				view := View{Load: api.LoadStats{}, Cache: map[string]int{}, Signals: map[string]api.PodSignals{}}
				for i, e := range cands {
					view.Load[e.Address] = api.EndpointStats{TotalReqs: int64(i % 7), PromptLength: int64(i%5) * 2048}
					view.Cache[e.Address] = i % 17
					view.Signals[e.Address] = api.PodSignals{Waiting: int64(i % 3), Running: int64(1 + i%4), KVCacheUtil: float64(i%10) / 10, PrefillTokens: int64(i%4) * 1000}
				}
				rule := defaultRule(b)
				rule.Policy = policy
				bal := New(Options{})
				req := Request{Blocks: 16, PromptLength: 8 << 10, Model: "m", Prompt: bytes.Repeat([]byte("an 8 KiB prompt "), 512)}
				times := make([]time.Duration, 0, b.N)
				b.ReportAllocs()
				for b.Loop() {
					t0 := time.Now()
					if _, err := bal.Choose("c", rule, cands, view, req); err != nil {
						b.Fatal(err)
					}
					times = append(times, time.Since(t0))
				}
				sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
				if len(times) > 0 {
					b.ReportMetric(float64(times[len(times)*99/100].Nanoseconds()), "p99-ns")
				}
			})
		}
	}
}

// The epp stand-in's prefix scorer keeps the real EPP's own index: 64-byte
// blocks chained from the model's name, the longest run of leading blocks
// per pod over the prompt's blocks, learnt from its own decisions, an LRU
// of 31,250 blocks per pod.
func TestEPPPrefixIndexesItsOwnDecisions(t *testing.T) {
	p := NewEPPPrefix()
	hosts := []Host{{Address: "a"}, {Address: "b"}, {Address: "c"}}
	prompt := func(shared, own int) []byte {
		return append(bytes.Repeat([]byte("s"), shared), bytes.Repeat([]byte("u"), own)...)
	}
	score := func(model string, pr []byte) []float64 {
		out := make([]float64, len(hosts))
		p.Score(&State{Hosts: hosts, Model: model, Prompt: pr}, out)
		return out
	}
	ten := prompt(640, 0) // 10 blocks + the model's
	if s := score("m", ten); !slices.Equal(s, []float64{0, 0, 0}) {
		t.Fatalf("empty index: %v", s)
	}
	p.Chosen(&State{Hosts: hosts, Model: "m", Prompt: ten}, 0)
	if s := score("m", ten); !slices.Equal(s, []float64{1, 0, 0}) {
		t.Fatalf("after routing the prompt to a: %v", s)
	}
	// Three leading blocks shared, then another user's part; a partial
	// final block is left out.
	other := prompt(3*64, 7*64+10)
	if s := score("m", other); !slices.Equal(s, []float64{4.0 / 11, 0, 0}) {
		t.Fatalf("three shared blocks: %v, want 4/11 for a", s)
	}
	// Another model's prompt matches nothing, not even its first block.
	if s := score("n", ten); !slices.Equal(s, []float64{0, 0, 0}) {
		t.Fatalf("another model: %v", s)
	}
	// A pod that served only another prompt of the model matches the
	// model's block.
	p.Chosen(&State{Hosts: hosts, Model: "m", Prompt: prompt(0, 640)}, 1)
	if s := score("m", ten); !slices.Equal(s, []float64{1, 1.0 / 11, 0}) {
		t.Fatalf("b served the model: %v", s)
	}
	// Shorter than a block: nothing to match.
	if s := score("m", []byte("short")); !slices.Equal(s, []float64{0, 0, 0}) {
		t.Fatalf("short prompt: %v", s)
	}
	// Past 31,250 blocks on a pod its least recently routed go: 250
	// distinct 128-block prompts push out the first prompt's blocks.
	for i := range 250 {
		p.Chosen(&State{Hosts: hosts, Model: "m", Prompt: []byte(strings.Repeat(fmt.Sprintf("%07d|", i), 1024))}, 2)
	}
	if n := p.pods["c"].order.Len(); n != eppPodCapacity {
		t.Fatalf("pod c holds %d blocks, want the capacity %d", n, eppPodCapacity)
	}
	first := []byte(strings.Repeat(fmt.Sprintf("%07d|", 0), 1024))
	if s := score("m", first); s[2] != 1.0/129 {
		t.Fatalf("the oldest prompt after eviction scores %v on c, want the model's block only", s[2])
	}
	// A pod that reports its KV cache (autoTune) keeps as many blocks as
	// the cache has, 16 tokens a block, sized when first chosen: 1,536
	// tokens are 96 blocks. A second 64-block prompt pushes out the
	// first one's 31 least recent, which are its first (the real LRU adds
	// a prompt's blocks in order), and with them its match past the
	// model's block, which the second prompt shares.
	small := []Host{{Address: "d", KVCapacity: 1536}}
	p.Chosen(&State{Hosts: small, Model: "m", Prompt: prompt(0, 63*64)}, 0)
	p.Chosen(&State{Hosts: small, Model: "m", Prompt: bytes.Repeat([]byte("v"), 63*64)}, 0)
	if n := p.pods["d"].order.Len(); n != 96 {
		t.Fatalf("pod d holds %d blocks, want its 96", n)
	}
	out := make([]float64, 1)
	p.Score(&State{Hosts: small, Model: "m", Prompt: prompt(0, 63*64)}, out)
	if out[0] != 1.0/64 {
		t.Fatalf("the first prompt on d scores %v, want the model's block only (its blocks evicted oldest first)", out[0])
	}

	// Through the balancer: the epp stand-in sends the prompt's next
	// request where it sent the first, on its own index alone (the
	// metadata center knows of no cache).
	b := New(Options{IntN: seededIntN(4)})
	rule := defaultRule(t)
	rule.Policy = ProfileEPP
	view := View{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{}}
	pods := eps(4)
	for _, e := range pods {
		view.Signals[e.Address] = api.PodSignals{KVCacheUtil: 0.2}
	}
	first1, err := b.Choose("c", rule, pods, view, Request{PromptLength: 640, Prompt: ten, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	for range 10 {
		ch, err := b.Choose("c", rule, pods, view, Request{PromptLength: 640, Prompt: ten, Model: "m"})
		if err != nil || ch.Host.Address != first1.Host.Address {
			t.Fatalf("chose %+v %v, want %s, where the first went", ch.Host, err, first1.Host.Address)
		}
	}
}

// The first tokens observed on one pod refit its cluster, so however far
// the rule's defaults are from the pods' speed, idle pods keep tying and
// sequential requests keep spreading, and the prediction converges on what
// is observed.
func TestObservationsRefitTheClusterSoIdlePodsKeepTying(t *testing.T) {
	b := New(Options{IntN: seededIntN(1)})
	pods := eps(4)
	view := View{Load: api.LoadStats{}}
	counts := map[string]int{}
	for range 200 {
		ch, err := b.Choose("c", defaultRule(t), pods, view, Request{PromptLength: 300})
		if err != nil {
			t.Fatal(err)
		}
		counts[ch.Host.Address]++
		b.Observe(ch.Prediction, time.Millisecond) // 85 times faster than the defaults predict
		f := b.tracker.Begin("c", ch.Host.Address, 0, Request{})
		f.FirstToken()
		f.End()
		f.Released()
	}
	for _, p := range pods {
		if counts[p.Address] < 30 {
			t.Fatalf("sequential requests to like idle pods: %v", counts)
		}
	}
	hs := make([]Host, len(pods))
	b.tracker.fill("c", pods, view, Request{}, hs)
	s := &State{Cluster: "c", Hosts: hs, Rule: defaultRule(t), PromptLength: 300, BytesPerToken: 1}
	b.ttft.mu.RLock()
	defer b.ttft.mu.RUnlock()
	p := b.ttft.predictor(s)
	for i := range hs {
		if got := p.predict(&hs[i]).Total; !within(got, 0.001, 0.1) {
			t.Fatalf("predicted %.2f ms on %s, observed 1 ms", got*1000, hs[i].Address)
		}
	}
}

// A match covers whole blocks of ChunkSize bytes (only the last block is
// short, unless Ends says where they end) and, in expectation, half the
// block after it, where the pod's cache
// ends: 2 of 3 blocks of a 1,100-byte prompt leave 38 of its last 76 bytes
// to compute, not a third of it.
func TestAMatchCoversWholeBlocks(t *testing.T) {
	for _, tc := range []struct {
		req   Request
		ratio float64
		want  int64
	}{
		{Request{PromptLength: 1100, Blocks: 3, ChunkSize: 512}, 2.0 / 3, 1024 + 38},
		{Request{PromptLength: 1100, Blocks: 3, ChunkSize: 512}, 1, 1100},
		{Request{PromptLength: 1100, Blocks: 3, ChunkSize: 512}, 1.0 / 3, 512 + 256},
		{Request{PromptLength: 1100, Blocks: 3, ChunkSize: 512}, 0, 0},
		{Request{PromptLength: 1000, Blocks: 4}, 0.5, 500}, // no chunk size: the share of the blocks
		// Blocks that end where messages start: a 300-byte system
		// prompt, a 200-byte turn, a 600-byte new part. The system
		// prompt's holder holds its 300 bytes and half the 200 after.
		{Request{PromptLength: 1100, Blocks: 4, ChunkSize: 512, Ends: []int{300, 500, 1012, 1100}}, 1.0 / 4, 300 + 100},
		{Request{PromptLength: 1100, Blocks: 4, ChunkSize: 512, Ends: []int{300, 500, 1012, 1100}}, 2.0 / 4, 500 + 256},
		{Request{PromptLength: 1100, Blocks: 4, ChunkSize: 512, Ends: []int{300, 500, 1012, 1100}}, 3.0 / 4, 1012 + 44},
	} {
		if got := tc.req.cachedBytes(tc.ratio, -1); got != tc.want {
			t.Errorf("%+v, %.2f of the blocks matched: %d bytes cached, want %d", tc.req, tc.ratio, got, tc.want)
		}
	}
	// Through a decision: the holder computes 38 of the 76 bytes past its
	// match.
	b := New(Options{IntN: seededIntN(1)})
	pods := eps(2)
	view := View{Load: api.LoadStats{}, Cache: map[string]int{pods[0].Address: 2}}
	ch, err := b.Choose("c", defaultRule(t), pods, view, Request{PromptLength: 1100, Blocks: 3, ChunkSize: 512})
	if err != nil || ch.Host.Address != pods[0].Address || ch.Prediction.UncachedTokens != 38 {
		t.Fatalf("chose %s predicting %+v (%v); want the holder, 38 tokens to compute", ch.Host.Address, ch.Prediction.Cost, err)
	}
}

// Where a pod's cache ends in the block after its match is learnt from the
// answers: a cluster whose partial holders left the prompt's last 100 bytes
// to compute (its prompts' new part) is predicted so from then on, not half
// the next block, within the matched blocks and the one after them. An answer
// that served less than the match (an eviction the index had not seen)
// teaches nothing, nor one whose whole prompt matched; the median of the
// answers stands, not one odd one.
func TestThePromptsNewPartIsLearnt(t *testing.T) {
	req := Request{PromptLength: 1100, Blocks: 3, ChunkSize: 512}
	for _, tc := range []struct {
		ratio, tail float64
		want        int64
	}{
		{1.0 / 3, 100, 1000}, // the prompt but its last 100 bytes
		{1.0 / 3, 10, 1024},  // at most the block after the match
		{2.0 / 3, 100, 1024}, // at least the matched blocks
		{2.0 / 3, -1, 1024 + 38},
	} {
		if got := req.cachedBytes(tc.ratio, tc.tail); got != tc.want {
			t.Errorf("%.2f of the blocks matched, a tail of %g bytes: %d bytes cached, want %d", tc.ratio, tc.tail, got, tc.want)
		}
	}
	b := New(Options{IntN: seededIntN(1)})
	holder := eps(1)
	view := View{Load: api.LoadStats{}, Cache: map[string]int{holder[0].Address: 1}}
	choose := func() Choice {
		t.Helper()
		ch, err := b.Choose("c", defaultRule(t), holder, view, req)
		if err != nil {
			t.Fatal(err)
		}
		return ch
	}
	first := choose()
	if first.Prediction.UncachedTokens != 1100-512-256 {
		t.Fatalf("before any answer: %.0f tokens to compute, want 332 (half the next block cached)", first.Prediction.UncachedTokens)
	}
	b.ObserveCache(first.Prediction, 1100, 1000) // left its last 100 bytes
	b.ObserveCache(first.Prediction, 1100, 1000)
	b.ObserveCache(first.Prediction, 1100, 600) // an odd prompt: 500 left
	b.ObserveCache(first.Prediction, 1100, 400) // evicted part of the match: nothing learnt
	whole := first.Prediction
	whole.partial, whole.matched = false, 1100
	for range 4 {
		b.ObserveCache(whole, 1100, 1100) // every block matched: nothing to learn
	}
	if got := choose().Prediction.UncachedTokens; !within(got, 100, 1e-9) {
		t.Fatalf("after the answers: %.1f tokens to compute, want 100 (the median new part)", got)
	}

	// A pod matching fewer blocks than the holders left this prompt
	// earlier, where the tail does not tell: half the block after its
	// match; nor does its answer teach the tail.
	pods := eps(2)
	view.Cache = map[string]int{pods[0].Address: 2, pods[1].Address: 1}
	s := &State{Cluster: "c", Hosts: make([]Host, 2), Rule: defaultRule(t), PromptLength: req.PromptLength,
		Blocks: req.Blocks, ChunkSize: req.ChunkSize, BytesPerToken: 1}
	b.tracker.fill("c", pods, view, req, s.Hosts)
	shallow := b.ttft.chosen(s, 1)
	if shallow.UncachedTokens != 1100-512-256 {
		t.Fatalf("a pod matching 1 block beside a holder of 2: %.0f tokens to compute, want 332", shallow.UncachedTokens)
	}
	for range 4 {
		b.ObserveCache(shallow, 1100, 800) // held 288 bytes past its match, left 300
	}
	if got := b.ttft.chosen(s, 0).UncachedTokens; got != 1100-1024 {
		t.Fatalf("the holder of 2 blocks: %.0f tokens to compute, want 76 (its match, which the tail of 100 bytes reaches into)", got)
	}
	view.Cache = map[string]int{holder[0].Address: 1}
	if got := choose().Prediction.UncachedTokens; !within(got, 100, 1e-9) {
		t.Fatalf("after the shallow pod's answers: %.1f tokens to compute, want 100 still", got)
	}
}

// A decision carries the chosen pod's KV capacity in prompt-hash blocks,
// through the model's bytes per token and the prompt's block size, rounded up: what the saves of its
// prefix bound the index's entries of that pod to. A pod that reports no
// capacity gets no bound, nor one that reports its evictions itself (the
// index knows what it holds).
func TestAChoiceBoundsWhatTheIndexKeepsOfItsPod(t *testing.T) {
	b := New(Options{IntN: seededIntN(1)})
	b.BytesPerToken("m").Observe(3600, 1000) // 3.6 bytes a token
	pods := eps(3)
	view := View{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{
		pods[0].Address: {KVCapacity: 1536},
		pods[1].Address: {Running: 3, KVCacheUtil: 0.9},
		pods[2].Address: {KVCapacity: 1536, ReportsEvictions: true},
	}}
	ch, err := b.Choose("c", defaultRule(t), pods[:1], view, Request{PromptLength: 1000, Blocks: 2, ChunkSize: 512, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	if want := 11; ch.MaxBlocks != want { // ⌈1536 × 3.6 / 512⌉ = ⌈10.8⌉
		t.Fatalf("MaxBlocks = %d, want %d", ch.MaxBlocks, want)
	}
	// Blocks that end early at message starts are counted at the mean
	// size of the prompt's whole ones: 384 bytes here.
	ch, _ = b.Choose("c", defaultRule(t), pods[:1], view, Request{PromptLength: 1000, Blocks: 3, ChunkSize: 512, Ends: []int{256, 768, 1000}, Model: "m"})
	if want := 15; ch.MaxBlocks != want { // ⌈1536 × 3.6 / 384⌉ = ⌈14.4⌉
		t.Fatalf("MaxBlocks = %d with blocks of 384 bytes, want %d", ch.MaxBlocks, want)
	}
	if ch, _ := b.Choose("c", defaultRule(t), pods[1:2], view, Request{PromptLength: 1000, Blocks: 2, ChunkSize: 512, Model: "m"}); ch.MaxBlocks != 0 {
		t.Fatalf("a pod without a reported capacity: MaxBlocks = %d, want 0", ch.MaxBlocks)
	}
	if ch, _ := b.Choose("c", defaultRule(t), pods[2:], view, Request{PromptLength: 1000, Blocks: 2, ChunkSize: 512, Model: "m"}); ch.MaxBlocks != 0 {
		t.Fatalf("a pod that reports its evictions: MaxBlocks = %d, want 0", ch.MaxBlocks)
	}
}

// Blocks a running request on the pod holds already take no new room: a
// 960-token prompt whose first 768 tokens (3 blocks of 256) a request this
// gateway runs there shares needs room for 192 only, which the pod has.
// The tracker finds the shared leading run from the requests' block hashes
// and forgets it when they end.
func TestBlocksSharedWithARunningRequestNeedNoRoom(t *testing.T) {
	tr := NewTracker()
	at := time.Now()
	tr.now = func() time.Time { return at } // the report is as new as the requests' events
	pods := []endpoints.Endpoint{{Address: "holder"}}
	view := View{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{
		"holder": {Running: 1, MaxRunning: 4, KVCapacity: 1536, KVCacheUtil: 0.62}}}
	req := Request{PromptLength: 960, Blocks: 4, ChunkSize: 256, Hashes: []string{"s1", "s2", "s3", "q9"}}
	f := tr.Begin("c", "holder", 900, Request{PromptLength: 960, ChunkSize: 256, Hashes: []string{"s1", "s2", "s3", "q1"}})
	f.Acked() // the report counts it running
	hs := make([]Host, 1)
	tr.fill("c", pods, view, req, hs)
	if hs[0].SharedBlocks != 3 {
		t.Fatalf("shared blocks %d, want 3", hs[0].SharedBlocks)
	}
	m := testModel()
	m.fit("holder").hold = 0.2
	m.routed("c", 900, 100)
	s := hostsState(t, nil, 960, 0)
	s.Blocks, s.ChunkSize = req.Blocks, req.ChunkSize
	p := m.predictor(s)
	if c := p.predict(&hs[0]); c.SlotWait != 0 || c.KVShortTokens != 0 {
		t.Fatalf("sharing 768 tokens: slot wait %g s, %g tokens short; want it to fit at once", c.SlotWait, c.KVShortTokens)
	}
	f.End()
	tr.fill("c", pods, view, req, hs)
	if hs[0].SharedBlocks != 0 {
		t.Fatalf("after the end: shared blocks %d, want 0", hs[0].SharedBlocks)
	}
	if c := p.predict(&hs[0]); !within(c.KVShortTokens, 960-(1536-1536*0.62), 1e-9) {
		t.Fatalf("sharing nothing: %g tokens short, want %g", c.KVShortTokens, 960-(1536-1536*0.62))
	}
}

// A request that ended since the pod's report freed its own prompt's
// blocks, not the fleet's mean prompt's: a 1,000-token conversation that
// ends on a pod whose KV (1,536 tokens) running requests fill to 90%
// leaves room for a 900-token prompt, though the fleet's prompts average
// 300 tokens; a 300-token one sent there since takes its own room back.
func TestAnEndedRequestFreesItsOwnBlocks(t *testing.T) {
	m := testModel()
	m.fit("pod").hold = 0.2
	m.routed("c", 300, 100)
	pods := []endpoints.Endpoint{{Address: "pod"}}
	view := View{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{
		"pod": {Running: 2, MaxRunning: 4, KVCapacity: 1536, KVCacheUtil: 0.9, AgeMS: 10}}}
	p := m.predictor(hostsState(t, nil, 900, 0))
	for _, tc := range []struct {
		name        string
		sent        int64 // a prompt sent since the report, bytes; 0: none
		short, wait float64
	}{
		{name: "an end", short: 0},
		{name: "an end and a 300-token start", sent: 300, short: 900 - (1536 - (1536*0.9 - 1000 + 300)), wait: 0.2 / 2},
	} {
		tr := NewTracker()
		at := time.Now()
		tr.now = func() time.Time { return at }
		f := tr.Begin("c", "pod", 0, Request{PromptLength: 1000, Hashes: []string{"s1", "c1"}})
		at = at.Add(20 * time.Millisecond) // the report, 10 ms old, counts it
		f.End()
		if tc.sent > 0 {
			tr.Begin("c", "pod", 0, Request{PromptLength: tc.sent})
		}
		hs := make([]Host, 1)
		tr.fill("c", pods, view, Request{PromptLength: 900}, hs)
		if hs[0].EndedReqsSinceReport != 1 || hs[0].EndedSinceReport != 1000 || hs[0].BegunSinceReport != tc.sent {
			t.Fatalf("%s: since the report %d ended of %d bytes, %d bytes begun; want 1 of 1000, %d", tc.name,
				hs[0].EndedReqsSinceReport, hs[0].EndedSinceReport, hs[0].BegunSinceReport, tc.sent)
		}
		c := p.predict(&hs[0])
		if !within(c.KVShortTokens, tc.short, 1e-6) || !within(c.SlotWait, tc.wait, 1e-9) {
			t.Fatalf("%s: %g tokens short, slot wait %g s; want %g, %g s", tc.name, c.KVShortTokens, c.SlotWait, tc.short, tc.wait)
		}
	}
}

// An answer states the predicted TTFT, where the request was predicted to
// wait longest for running requests to end that wait, in milliseconds, and
// the share of the prompt believed cached on the pod (headers.PredictedTTFT,
// PredictedSlotWait, PredictedCachedShare).
func TestAPredictionStatesItsSlotWaitAndCachedShare(t *testing.T) {
	for _, tc := range []struct {
		p                      Prediction
		ttft, slotWait, cached string
	}{
		{Prediction{Cost: Cost{SlotWait: 0.2, Queue: 0.1, Wait: 0.2, Total: 0.3, UncachedTokens: 250}, PromptTokens: 1000},
			"300.000", "200.000", "0.750"},
		{Prediction{Cost: Cost{SlotWait: 0.2, Queue: 0.4, Wait: 0.4, Total: 0.5, UncachedTokens: 1000}, PromptTokens: 1000},
			"500.000", "", "0.000"}, // behind the queue's prefill; nothing cached
		{Prediction{Cost: Cost{Total: 0.05}, PromptTokens: 10}, "50.000", "", "1.000"},
		{Prediction{Cost: Cost{Total: 0.05}}, "50.000", "", ""}, // no prompt counted
		{Prediction{}, "", "", ""},
	} {
		got := map[string]string{}
		tc.p.State(func(name, value string) { got[name] = value })
		want := map[string]string{}
		for name, v := range map[string]string{headers.PredictedTTFT: tc.ttft, headers.PredictedSlotWait: tc.slotWait,
			headers.PredictedCachedShare: tc.cached} {
			if v != "" {
				want[name] = v
			}
		}
		if !maps.Equal(got, want) {
			t.Fatalf("%+v states %v, want %v", tc.p, got, want)
		}
	}
}

// The answer's usage checks what the decision believed the pod held of the
// prompt: believed less served, as a share of the prompt, in the histogram.
func TestTheCacheBeliefIsCheckedAgainstWhatThePodServed(t *testing.T) {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "y", Buckets: []float64{-0.3, -0.2, 0.2, 0.3}})
	m := newTTFTModel(prometheus.NewHistogram(prometheus.HistogramOpts{Name: "x"}), h, slog.Default())
	// Believed 75% cached; the pod served 25% (+0.5), then all of it (−0.25).
	believed := Prediction{Cost: Cost{Host: "10.0.0.1:8000", Total: 0.1, UncachedTokens: 250}, PromptTokens: 1000}
	m.observeCache(believed, 400, 100)
	m.observeCache(believed, 400, 400)
	for _, bad := range []struct{ prompt, cached int64 }{{0, 0}, {400, 401}, {400, -1}} {
		m.observeCache(believed, bad.prompt, bad.cached)
	}
	m.observeCache(Prediction{}, 400, 100) // no decision
	var d dto.Metric
	if err := h.Write(&d); err != nil {
		t.Fatal(err)
	}
	hist := d.GetHistogram()
	if hist.GetSampleCount() != 2 || !within(hist.GetSampleSum(), 0.25, 1e-9) {
		t.Fatalf("%d observations summing to %g, want 2 summing to 0.25", hist.GetSampleCount(), hist.GetSampleSum())
	}
	if b := hist.GetBucket(); b[0].GetCumulativeCount() != 0 || b[1].GetCumulativeCount() != 1 || b[3].GetCumulativeCount() != 1 {
		t.Fatalf("buckets %v: want −0.25 in (−0.3, −0.2] and +0.5 above 0.3", b)
	}
}

// testModel is a model whose errors go to histograms nobody reads.
func testModel() *ttftModel {
	return newTTFTModel(prometheus.NewHistogram(prometheus.HistogramOpts{Name: "x"}),
		prometheus.NewHistogram(prometheus.HistogramOpts{Name: "y"}), slog.Default())
}

// A pod that reports what its compute costs (our worker) is priced by it,
// not by the cluster's fit: its step, each token's own cost and its
// attention to the cells before it, and of its queue the requests it
// prefills before this one, those with fewer tokens left. A 2,000-token
// prompt whose first 1,500 tokens the pod holds: 500 tokens after 1,500
// cells, 500·0.5 ms + 1 µs·(500·1,500 + 500·501/2) = 1.125 s; of a queue of
// 200 tokens (0.5 s) and 3,800 (2.5 s), it waits for the first only; a step
// of 10 ms, after the rest of the step in progress. A prediction from the
// pod's own figures does not refit the cluster.
func TestAPodsOwnCostPricesItsCompute(t *testing.T) {
	m := testModel()
	rule := defaultRule(t)
	pod := Host{Address: "own", Signals: true, CacheRatio: 0.75, Running: 1, Reqs: 1, PrefillQueued: 4000,
		PrefillQueue: []api.Prefill{{Tokens: 200, Seconds: 0.5}, {Tokens: 3800, Seconds: 2.5}}, TokenSeconds: 5e-4,
		AttentionSeconds: 1e-6, StepSeconds: 0.01}
	s := &State{Cluster: "c", Rule: rule, PromptLength: 2000, BytesPerToken: 1, Hosts: []Host{pod}}
	p := m.predictor(s)
	c := p.predict(&pod)
	want := 500*5e-4 + 1e-6*(500*1500+500*501/2.0)
	if !c.Measured || !within(c.Prefill, want, 1e-9) || !within(c.Queue, 0.5, 1e-9) || !within(c.Step, 0.01, 1e-9) ||
		!within(c.Total, 0.5+want+0.01, 1e-9) {
		t.Fatalf("own cost: %+v, want prefill %.4gs, queue 0.5s, step 10ms", c, want)
	}
	// Mid-step: the pod has 0.2 s left of the step in progress, and its
	// queue is what stands once that step ends. The request waits for the
	// one, then the other.
	mid := pod
	mid.StepLeft = 0.2
	if c := p.predict(&mid); !within(c.InStep, 0.2, 1e-9) || !within(c.Wait, 0.7, 1e-9) || !within(c.Total, 0.7+want+0.01, 1e-9) {
		t.Fatalf("mid-step: %+v, want the step's 0.2 s and then the queue's 0.5 s", c)
	}
	m.observe(m.chosen(s, 0), 2*time.Second)
	if f := m.means["c"]; f.secPerByte != 0 {
		t.Fatalf("the cluster fit learnt %g s/byte from a pod that priced itself", f.secPerByte)
	}
	// A pod yet to measure itself, beside one that has, is priced by the
	// other's costs: its 4,000 queued tokens at the request's own cost a
	// token (no list to tell which it prefills first).
	fresh := pod
	fresh.Address, fresh.PrefillQueue, fresh.TokenSeconds, fresh.AttentionSeconds, fresh.StepSeconds = "fresh", nil, 0, 0, 0
	s.Hosts = []Host{pod, fresh}
	p = m.predictor(s)
	if c := p.predict(&fresh); !c.Measured || !within(c.Prefill, want, 1e-9) || !within(c.Queue, 4000*want/500, 1e-9) || !within(c.Step, 0.01, 1e-9) {
		t.Fatalf("beside a pod that measured itself: %+v, want its costs", c)
	}
	// Where no pod measures itself, the cluster's fit (here the rule's
	// defaults) prices every pod.
	s.Hosts = []Host{fresh}
	p = m.predictor(s)
	if c := p.predict(&fresh); c.Measured || !within(c.Prefill, 500/5000.0, 1e-9) || !within(c.Queue, 4000/5000.0, 1e-9) || !within(c.Step, 0.025, 1e-9) {
		t.Fatalf("no pod's own cost: %+v, want the rule's rate and step", c)
	}
}

// This gateway's requests that reached their first token since the pod's
// report are, the pod prefilling the fewest tokens left first, the
// report's shortest entries: they come off the queue one entry each, not
// as their prompts' uncached sizes at routing (a hit routed at 446 tokens
// may have 35 left in the report), which would empty the queue of the
// others still standing before the request.
func TestFirstTokensSinceTheReportTakeTheShortestEntriesOff(t *testing.T) {
	m := testModel()
	pod := Host{Address: "own", Signals: true, CacheRatio: 0.75, Running: 4, Reqs: 4, PrefillQueued: 1542,
		PrefillQueue: []api.Prefill{{Tokens: 35, Seconds: 0.07}, {Tokens: 150, Seconds: 0.3}, {Tokens: 1357, Seconds: 1.8}},
		TokenSeconds: 5e-4, AttentionSeconds: 1e-6, StepSeconds: 0.01}
	s := &State{Cluster: "c", Rule: defaultRule(t), PromptLength: 600, BytesPerToken: 1, Hosts: []Host{pod}}
	p := m.predictor(s) // 150 uncached tokens: the 1,357-token entry goes after it
	if c := p.predict(&pod); !within(c.Queue, 0.37, 1e-9) {
		t.Fatalf("as reported: %+v, want the two shorter entries' 0.37 s", c)
	}
	filled := pod
	filled.FilledReqsSinceReport, filled.FilledSinceReport = 1, 446
	if c := p.predict(&filled); !within(c.Queue, 0.3, 1e-9) {
		t.Fatalf("one of this gateway's requests at its first token since: %+v, want the 150-token entry's 0.3 s", c)
	}
	filled.FilledReqsSinceReport = 3
	if c := p.predict(&filled); c.Queue != 0 {
		t.Fatalf("three at their first tokens since: %+v, want nothing left ahead", c)
	}
}

// A pod that holds a long prompt back while its other request's answer
// ends (our worker's finish first) steps that prompt alone once the answer
// has ended, a whole n_batch: a conversation's next turn, sent as its
// answer ends, waits for that step. Before the release the request runs
// beside the answer and waits for nothing of it; a request at least as
// long as the held prompt waits for all of it in the queue ahead, not for
// its step twice.
func TestARequestAfterAHoldWaitsForTheReleasedStep(t *testing.T) {
	m := testModel()
	pod := Host{Address: "own", Signals: true, CacheRatio: 0.75, Running: 2, Reqs: 2, PrefillQueued: 1300,
		PrefillQueue: []api.Prefill{{Tokens: 1300, Seconds: 1.7}}, TokenSeconds: 5e-4, AttentionSeconds: 1e-6, StepSeconds: 0.01,
		HeldTokens: 1300, HeldStep: 0.6, HoldLeft: 0.05}
	s := &State{Cluster: "c", Rule: defaultRule(t), PromptLength: 2000, BytesPerToken: 1, Hosts: []Host{pod}}
	p := m.predictor(s)
	if c := p.predict(&pod); c.InStep != 0 || c.Queue != 0 {
		t.Fatalf("during the hold: %+v, want no wait for the held prompt", c)
	}
	// The answer has ended (this gateway saw it): the step has begun.
	ended := pod
	ended.EndedReqsSinceReport = 1
	if c := p.predict(&ended); !within(c.InStep, 0.6, 1e-9) || !within(c.Wait, 0.6, 1e-9) {
		t.Fatalf("after the answer's end: %+v, want the released step's 0.6 s", c)
	}
	// Its release time 0.2 s past, by the report: 0.4 s of the step left.
	past := pod
	past.HoldLeft = -0.2
	if c := p.predict(&past); !within(c.InStep, 0.4, 1e-9) {
		t.Fatalf("0.2 s after the release: %+v, want 0.4 s of the step left", c)
	}
	// A request of no fewer uncached tokens than the held prompt waits
	// for the whole prompt, as queued ahead.
	long := &State{Cluster: "c", Rule: defaultRule(t), PromptLength: 4000, BytesPerToken: 1, Hosts: []Host{ended}}
	long.Hosts[0].CacheRatio = 0
	lp := m.predictor(long)
	if c := lp.predict(&long.Hosts[0]); c.InStep != 0 || !within(c.Queue, 1.7, 1e-9) {
		t.Fatalf("a longer request after the release: %+v, want the queue's 1.7 s alone", c)
	}
}
