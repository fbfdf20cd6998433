package lifecycle

import (
	"context"
	"fmt"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
)

// eightPods is a fleet big enough that a blind pick rarely lands on the
// pod that holds a prefix (1 in 8).
func eightPods(t testing.TB) endpoints.Source {
	t.Helper()
	var addrs []string
	for i := range 8 {
		addrs = append(addrs, fmt.Sprintf("10.0.1.%d:8000", i+1))
	}
	s, err := endpoints.NewStatic(map[string][]string{cluster: addrs})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// sharedCenters starts n metadata centers on one store: the embedded store
// (n must be 1) or one real redis-server shared by all of them, as
// replicas are deployed.
func sharedCenters(t *testing.T, kind string, n int) []string {
	t.Helper()
	var st store.Store
	switch kind {
	case "memory":
		st = memstore.New(memstore.Options{})
	case "redis":
		srv := redistest.Shared(t)
		var err error
		if st, err = redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: srv.Prefix}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
	}
	var urls []string
	for range n {
		ts := httptest.NewServer(server.New(st, server.Options{Logger: quiet()}).Handler())
		t.Cleanup(ts.Close)
		urls = append(urls, ts.URL)
	}
	return urls
}

// gateways builds n gateways, gateway i on center i%len(mcs), each with its
// own client, tracker and batcher: n gateways of one mesh.
func gateways(t *testing.T, mcs []string, n int, window time.Duration) []gateway {
	t.Helper()
	var out []gateway
	for i := range n {
		cfg := configFor(t, mcs[i%len(mcs)], "")
		cfg.Async.BatchWindow = window
		out = append(out, newGateway(t, cfg, routing.Options{Endpoints: eightPods(t)}, nil))
	}
	return out
}

// settled waits until e has sent every queued update.
func settled(t *testing.T, e gateway) {
	t.Helper()
	eventually(t, "the gateway's updates to reach the metadata center", func() bool { return e.Pending() == 0 })
}

// TestColdPlacementReachesOtherGateways: with a batch window far longer
// than any test, a cold request's lease and routing-time save still reach
// the metadata center at once (they are urgent), so the next requests of
// its prefix on the other gateways find the pod that is prefilling it and
// follow it there, as they would on the first gateway, instead of
// prefilling the prompt again on pods of their own.
func TestColdPlacementReachesOtherGateways(t *testing.T) {
	for _, tc := range []struct {
		store string
		mcs   int
	}{{"memory", 1}, {"redis", 2}} {
		t.Run(fmt.Sprintf("%s/%d_centers", tc.store, tc.mcs), func(t *testing.T) {
			gws := gateways(t, sharedCenters(t, tc.store, tc.mcs), 3, time.Hour)
			system := strings.Repeat("A long shared document that every user of this tenant asks about. ", 128)
			var ds []*Request
			route := func(e gateway, q string) *Request {
				d, err := e.Decide(context.Background(), chatPath(), chatBody(system, q))
				if err != nil || d.Degraded {
					t.Fatalf("%+v %v", d, err)
				}
				e.Started(d)
				ds = append(ds, d)
				return d
			}
			lead := route(gws[0], "first question?")
			if lead.CacheRatio != 0 || !gws[0].placesPrefix(lead) {
				t.Fatalf("the first request of a new prompt: cache ratio %v, urgent %v", lead.CacheRatio, gws[0].placesPrefix(lead))
			}
			settled(t, gws[0]) // an hour's window: only the urgent path gets here
			for i, e := range gws[1:] {
				d := route(e, fmt.Sprintf("question %d?", i))
				if d.Host != lead.Host || d.CacheRatio < 0.9 {
					t.Fatalf("gateway %d sent a follower to %s (cache ratio %.2f); the prompt is prefilling on %s", i+1, d.Host, d.CacheRatio, lead.Host)
				}
				if e.placesPrefix(d) {
					t.Fatalf("a follower that reuses its pod's prefix was sent as urgent (prefill %d bytes)", d.PrefillLength)
				}
			}
			for i, d := range ds {
				gws[min(i, len(gws)-1)].Done(d)
			}
		})
	}
}

// TestHotPrefixSpreadsAcrossGatewaysAsOnOne routes 24 requests of one hot
// prompt, all left in flight, round robin over one gateway and over three
// (on one center, and on two centers sharing one Redis), each request
// once the previous one's updates have reached the metadata center (as
// they have at any rate where a prefill outlasts a batch window). Herd
// control and the load terms must place them on the same number of pods
// with the same counts per pod either way: the cluster-wide leases and
// cache index are what they read, not one gateway's own decisions.
func TestHotPrefixSpreadsAcrossGatewaysAsOnOne(t *testing.T) {
	const requests = 24
	system := strings.Repeat("One hot system prompt that the whole fleet sends. ", 16)
	spread := func(t *testing.T, gws []gateway) []int {
		per := map[string]int{}
		var ds []*Request
		for i := range requests {
			e := gws[i%len(gws)]
			d, err := e.Decide(context.Background(), chatPath(), chatBody(system, fmt.Sprintf("q%d", i)))
			if err != nil || d.Degraded {
				t.Fatalf("%+v %v", d, err)
			}
			e.Started(d)
			settled(t, e)
			per[d.Host]++
			ds = append(ds, d)
		}
		for i, d := range ds {
			gws[i%len(gws)].Done(d)
		}
		var counts []int
		for _, n := range per {
			counts = append(counts, n)
		}
		slices.Sort(counts)
		return counts
	}
	one := spread(t, gateways(t, sharedCenters(t, "memory", 1), 1, time.Millisecond))
	t.Logf("one gateway: requests per pod %v", one)
	if len(one) < 2 {
		t.Fatalf("one gateway kept %d in-flight requests of a hot prompt on one pod", requests)
	}
	for _, tc := range []struct {
		store string
		mcs   int
	}{{"memory", 1}, {"redis", 2}} {
		t.Run(fmt.Sprintf("%s/%d_centers", tc.store, tc.mcs), func(t *testing.T) {
			three := spread(t, gateways(t, sharedCenters(t, tc.store, tc.mcs), 3, time.Millisecond))
			t.Logf("three gateways: requests per pod %v", three)
			if !slices.Equal(one, three) {
				t.Fatalf("requests per pod: %v with one gateway, %v with three", one, three)
			}
		})
	}
}
