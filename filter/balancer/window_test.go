package balancer

import (
	"fmt"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Shares are counted over the last windowPerHost·n decisions, per cluster
// and candidate set.
func TestRoutedWindow(t *testing.T) {
	tr := NewTracker()
	cands := []endpoints.Endpoint{{Address: "a"}, {Address: "b"}, {Address: "c"}, {Address: "d"}}
	shares := func(cands []endpoints.Endpoint) map[string]float64 {
		out := make([]Host, len(cands))
		tr.fill("c", cands, View{Load: api.LoadStats{}}, Request{}, out)
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

// Requests of two label selectors alternating in one cluster: each
// candidate set keeps its own window, which a switch does not restart.
func TestShareWindowSurvivesMixedSelectors(t *testing.T) {
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
			if _, err := b.Choose("c", sglangRule, cands, view, Request{}); err != nil {
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
				tr.Begin("c", "a", 0, Request{}).Acked()
			}
			view := View{Load: api.LoadStats{"a": {TotalReqs: tc.leases}}, Degraded: tc.degraded}
			out := make([]Host, len(cands))
			for i := 0; i <= 8; i++ {
				s := tr.fill("c", cands, view, Request{}, out)
				if warm := out[0].Share > 0; warm != (i >= tc.warmAt) {
					t.Fatalf("at decision %d: shares read %v, want from %d decisions on", i+1, warm, tc.warmAt+1)
				}
				tr.routed(s, "a", len(cands))
				if tc.brief > 0 {
					f := tr.Begin("c", "a", 0, Request{})
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

var sglangRule = config.LBRule{Policy: PolicySGLang}
