package lifecycle

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/balancer"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// hostsSeen is a scorer that keeps the candidates of the last decision as
// the scorers saw them (and scores nothing).
type hostsSeen struct {
	mu    sync.Mutex
	hosts map[string]balancer.Host
}

func (*hostsSeen) Name() string { return "hosts_seen" }
func (h *hostsSeen) Score(s *balancer.State, out []float64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.hosts = map[string]balancer.Host{}
	for i, c := range s.Hosts {
		h.hosts[c.Address] = c
		out[i] = 0
	}
}

func (h *hostsSeen) reqs(addr string) int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.hosts[addr].Reqs
}

// A conversation's next turn arrives within a millisecond of the previous
// answer's end, before that request's done update has reached the metadata
// center (a batch window and a round trip). The metadata center still
// counts the request on its pod; the gateway, which saw it end, must not,
// or the holder looks busier than pods that hold nothing of the
// conversation. Once the done lands, nothing is taken off twice. The
// metadata center is the real one; only its batch endpoint is held shut.
func TestEndedRequestLeavesItsPodBeforeTheDoneLands(t *testing.T) {
	var g gate
	mc := server.New(memstore.New(memstore.Options{}), server.Options{Logger: quiet()}).Handler()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == api.PathBatch {
			g.wait()
		}
		mc.ServeHTTP(w, r)
	}))
	t.Cleanup(ts.Close)
	seen := &hostsSeen{}
	e := newGateway(t, configFor(t, ts.URL, "lb_mapping_rule: {default: {policy: seed, scorers: {hosts_seen: 1}}}"),
		routing.Options{Scorers: map[string]balancer.Scorer{"hosts_seen": seen}}, nil)
	t.Cleanup(g.open) // before the reporter's Close drains into it
	system := "You answer questions about one long shared handbook. "
	mcc, err := client.New(client.Options{Address: ts.URL, QueryTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	leases := func(d *Request) int64 {
		ans, err := mcc.Route(context.Background(), d.Cluster, d.Hashes)
		if err != nil {
			t.Fatal(err)
		}
		return ans.Load[d.Host].TotalReqs
	}

	first, err := e.Decide(context.Background(), chatPath(), chatBody(system, "first turn"))
	if err != nil {
		t.Fatal(err)
	}
	e.Started(first)
	eventually(t, "the first turn's lease", func() bool { return leases(first) == 1 })
	settled(t, e)

	g.hold()
	e.FirstToken(first)
	e.Done(first)
	second, err := e.Decide(context.Background(), chatPath(), chatBody(system, "first turn, and a second"))
	if err != nil {
		t.Fatal(err)
	}
	if n := leases(first); n != 1 {
		t.Fatalf("the metadata center counts %d requests on %s before the done lands, want 1", n, first.Host)
	}
	if n := seen.reqs(first.Host); n != 0 {
		t.Fatalf("the next turn saw %d requests on %s, whose only request had ended", n, first.Host)
	}

	g.open()
	eventually(t, "the done to land", func() bool { return leases(first) == 0 && e.Pending() == 0 })
	if _, err := e.Decide(context.Background(), chatPath(), chatBody(system, "another")); err != nil {
		t.Fatal(err)
	}
	// The second turn, decided but not begun, still counts where it was
	// placed (the scorers here rate every pod alike, so that is any pod).
	want := int64(0)
	if second.Host == first.Host {
		want = 1
	}
	if n := seen.reqs(first.Host); n != want {
		t.Fatalf("after the done landed: %d requests on %s, want %d (the second turn went to %s)", n, first.Host, want, second.Host)
	}
	e.Started(second)
	eventually(t, "the second turn's lease", func() bool { return leases(second) == 1 })
	settled(t, e)
	e.Done(second)
	eventually(t, "the second turn's done", func() bool { return leases(second) == 0 && e.Pending() == 0 })
}

// gate holds requests while shut (hold) until it opens.
type gate struct {
	mu sync.Mutex
	ch chan struct{} // nil: open
}

func (g *gate) hold() { g.mu.Lock(); g.ch = make(chan struct{}); g.mu.Unlock() }

func (g *gate) open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ch != nil {
		close(g.ch)
		g.ch = nil
	}
}

func (g *gate) wait() {
	g.mu.Lock()
	ch := g.ch
	g.mu.Unlock()
	if ch != nil {
		<-ch
	}
}
