package lifecycle

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
)

// centers are the real metadata center on both stores (Redis: a real
// redis-server).
func centers(t *testing.T) map[string]func(t *testing.T) *httptest.Server {
	serve := func(t *testing.T, st store.Store) *httptest.Server {
		ts := httptest.NewServer(server.New(st, server.Options{Logger: quiet()}).Handler())
		t.Cleanup(ts.Close)
		return ts
	}
	return map[string]func(t *testing.T) *httptest.Server{
		"memory": func(t *testing.T) *httptest.Server { return serve(t, memstore.New(memstore.Options{})) },
		"redis": func(t *testing.T) *httptest.Server {
			srv := redistest.Shared(t)
			st, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: fmt.Sprintf("%s-%s", srv.Prefix, t.Name())})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = st.Close() })
			return serve(t, st)
		},
	}
}

// The updates go out batched (POST /v1/batch, the default) or one call each
// (batch_window 0: the dispatcher).
var updateModes = map[string]string{"batched": "", "single": "async: {batch_window: 0s}"}

// A request that fails before its first token withdraws the prefix it saved
// at routing time — only the hashes beyond what the index already held on
// its pod, and only those no other request saved since — through the
// batcher and through the dispatcher, on both stores.
func TestFailureBeforeTheFirstTokenRetractsTheRoutingTimeSave(t *testing.T) {
	for cname, mk := range centers(t) {
		for mode, extra := range updateModes {
			t.Run(cname+"/"+mode, func(t *testing.T) {
				ts := mk(t)
				m := &counts{}
				e := newGateway(t, configFor(t, ts.URL, extra), routing.Options{Metrics: m}, nil)
				mc, _ := client.New(client.Options{Address: ts.URL, QueryTimeout: 2 * time.Second})
				testRetract(t, e, mc, m, ts.URL)
			})
		}
	}
}

func testRetract(t *testing.T, e gateway, mc *client.Client, m *counts, center string) {
	ctx := context.Background()
	// The canary rule's cluster has one pod: where a request goes is
	// certain, and the index is what is tested.
	const cluster = "canary"
	held := func(host string, hashes []string) int {
		t.Helper()
		ans, err := mc.Route(ctx, cluster, hashes)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range ans.Cache {
			if c.Host == host {
				return c.Length
			}
		}
		return 0
	}
	leases := func(host string) int64 {
		t.Helper()
		ans, err := mc.Route(ctx, cluster, nil)
		if err != nil {
			t.Fatal(err)
		}
		return ans.Load[host].TotalReqs
	}
	decide := func(system, user string) *Request {
		t.Helper()
		d, err := e.Decide(ctx, hdr{":path": "/v1/chat/completions", "x-env": "canary"}, chatBody(system, user))
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	system := strings.Repeat("You answer questions about the sea, briefly. ", 6)

	// 1. A cold prompt fails (the pod answered 429): the index forgets it.
	d1 := decide(system, "What is a tide?")
	e.Started(d1)
	eventually(t, "the routing-time save", func() bool { return held(d1.Host, d1.Hashes) == len(d1.Hashes) })
	e.Done(d1) // no first token
	eventually(t, "the retraction and the lease's end", func() bool {
		return held(d1.Host, d1.Hashes) == 0 && leases(d1.Host) == 0
	})

	// 2. A request that succeeds keeps its save.
	acked := func(d *Request) {
		t.Helper()
		eventually(t, "the lease to be acknowledged", func() bool {
			_, unacked := e.InFlight(cluster, d.Host)
			return unacked == 0 && leases(d.Host) > 0
		})
	}
	d2 := decide(system, "Why is the sea salty?")
	e.Started(d2)
	acked(d2) // so that no lease below means the done landed, after anything before it
	e.Saved(d2)
	e.FirstToken(d2)
	e.Done(d2)
	eventually(t, "the successful request's lease to end", func() bool { return leases(d2.Host) == 0 })
	if n := held(d2.Host, d2.Hashes); n != len(d2.Hashes) {
		t.Fatalf("a successful request's prefix: %d of %d blocks held", n, len(d2.Hashes))
	}

	// 3. A follow-up sharing d2's system prompt goes there and fails: the
	// blocks the index already held for d2 stay, the new ones go, though
	// its save named them too.
	d3 := decide(system, "Why is the sea salty? And why is it blue, and how deep does the light reach?")
	if d3.Host != d2.Host || d3.CacheRatio <= 0 || d3.CacheRatio >= 1 {
		t.Fatalf("the follow-up went to %s (ratio %v), its prefix is on %s", d3.Host, d3.CacheRatio, d2.Host)
	}
	shared := held(d2.Host, d3.Hashes)
	e.Started(d3)
	eventually(t, "the follow-up's save", func() bool { return held(d3.Host, d3.Hashes) == len(d3.Hashes) })
	e.Done(d3)
	eventually(t, "the follow-up's retraction", func() bool { return held(d3.Host, d3.Hashes) == shared })
	if n := held(d2.Host, d2.Hashes); n != len(d2.Hashes) {
		t.Fatalf("the failed follow-up withdrew the blocks d2 built: %d of %d held", n, len(d2.Hashes))
	}

	// 4. An overloaded pod: every request of a new prompt goes to the pod
	// the first one's save points at and gets 429. None of the later ones
	// saved (their route answer matched it all, and a 429 confirms
	// nothing), so the first one's retraction leaves the pod nothing to
	// attract the prefix with.
	other := strings.Repeat("You translate into Welsh. ", 8)
	d4 := decide(other, "Good morning")
	e.Started(d4)
	eventually(t, "d4's save", func() bool { return held(d4.Host, d4.Hashes) == len(d4.Hashes) })
	d5 := decide(other, "Good morning")
	if d5.Host != d4.Host {
		t.Fatalf("the same prompt went to %s, its prefix is on %s", d5.Host, d4.Host)
	}
	e.Started(d5)
	eventually(t, "d5's lease", func() bool { return leases(d5.Host) == 2 })
	e.Done(d5)
	e.Done(d4)
	eventually(t, "both leases to end", func() bool { return leases(d4.Host) == 0 })
	if n := held(d4.Host, d4.Hashes); n != 0 {
		t.Fatalf("after both requests failed the pod still holds %d of %d blocks in the index", n, len(d4.Hashes))
	}

	// 5. The same, but the second request's pod answered (2xx: Saved) and
	// goes on prefilling: the first one's retraction must leave the
	// entries, which the second one saved since.
	d6 := decide(other, "Good evening")
	e.Started(d6)
	eventually(t, "d6's save", func() bool { return held(d6.Host, d6.Hashes) == len(d6.Hashes) })
	d7 := decide(other, "Good evening")
	if d7.Host != d6.Host {
		t.Fatalf("the same prompt went to %s, its prefix is on %s", d7.Host, d6.Host)
	}
	before := appliedSaves(t, center)
	e.Started(d7)
	e.Saved(d7)
	// d7's confirmation only refreshes, and its updates and d6's are not
	// ordered with each other when each goes in a call of its own: a
	// retraction landing first would withdraw the entries (a miss, by
	// design: docs/envoy-filter.md, "Lifecycle reports"). This case is
	// about the other order, so the confirmation lands first.
	eventually(t, "d7's lease and confirmation", func() bool {
		return leases(d7.Host) == 2 && appliedSaves(t, center) > before
	})
	e.Done(d6)
	eventually(t, "d6's lease to end", func() bool { return leases(d6.Host) == 1 })
	if n := held(d6.Host, d6.Hashes); n != len(d6.Hashes) {
		t.Fatalf("d6's retraction removed what d7 saved since: %d of %d held", n, len(d6.Hashes))
	}
	e.FirstToken(d7)
	e.Done(d7)
	eventually(t, "d7's lease to end", func() bool { return leases(d7.Host) == 0 })
	if n := held(d7.Host, d7.Hashes); n != len(d7.Hashes) {
		t.Fatalf("d7 succeeded, yet %d of %d blocks are held", n, len(d7.Hashes))
	}
	// 6. A burst: two questions of one new user's context go to one pod,
	// the second routed on the first one's routing-time save, and the pod
	// refuses both. The second one's save names only what the index did
	// not hold (its question's blocks), so the first one's retraction
	// still withdraws the shared context: nothing of the two is left. (A
	// save naming the whole prompt made the shared blocks the second
	// one's, which neither retraction then withdrew: the chaos run's wrong
	// entries after its burst.)
	bees := strings.Repeat("You keep bees and answer in one line. ", 4)
	profile := strings.Repeat("The user keeps twelve hives on a hill in Wales. ", 3)
	d8 := decide(bees, profile+"When do I harvest?")
	e.Started(d8)
	eventually(t, "d8's save", func() bool { return held(d8.Host, d8.Hashes) == len(d8.Hashes) })
	d9 := decide(bees, profile+"How do I calm a swarm?")
	if d9.Host != d8.Host || d9.CacheRatio <= 0 || d9.CacheRatio >= 1 {
		t.Fatalf("the second question went to %s (ratio %v), the first one's save is on %s", d9.Host, d9.CacheRatio, d8.Host)
	}
	e.Started(d9)
	eventually(t, "d9's save", func() bool { return held(d9.Host, d9.Hashes) == len(d9.Hashes) })
	e.Done(d9)
	e.Done(d8)
	eventually(t, "both leases to end", func() bool { return e.Pending() == 0 && leases(d8.Host) == 0 })
	if n, m := held(d8.Host, d8.Hashes), held(d9.Host, d9.Hashes); n != 0 || m != 0 {
		t.Fatalf("after both requests were refused the index still holds %d and %d of their blocks on the pod", n, m)
	}
	// d1, d3, d4, d6, d8 and d9 withdrew saves; d2 and d7 succeeded, d5
	// saved nothing.
	if n := m.Get("retractions"); n != 6 {
		t.Fatalf("retractions counted %d, want 6", n)
	}
	if n := m.Get("async_errors"); n != 0 {
		t.Fatalf("%d updates failed", n)
	}
	if e.Pending() != 0 {
		eventually(t, "the queue to drain", func() bool { return e.Pending() == 0 })
	}
}

// appliedSaves is how many cache saves the metadata center at url has
// applied, one call each or in batches (its /metrics, which count them
// once the store has written them).
func appliedSaves(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	text, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(text), "\n") {
		single := strings.HasPrefix(line, "llmf_metadata_center_requests_total{") && strings.Contains(line, `code="200"`) &&
			strings.Contains(line, `endpoint="/v1/cache/save"`)
		batched := strings.HasPrefix(line, `llmf_metadata_center_batch_ops_total{op="cache_save"}`)
		if single || batched {
			f := strings.Fields(line)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			if err != nil {
				t.Fatalf("metrics line %q: %v", line, err)
			}
			n += int(v)
		}
	}
	return n
}
