package lifecycle

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
)

// The save Saved makes when the answer starts confirms the routing-time
// save: if the pod evicted part of the prompt meanwhile (a non-streamed
// answer's next turn truncates its tail at once) and reported it, the
// confirmation must not write the evicted blocks back — also when the
// index already held the whole prompt there (a repeated prompt). Where
// nothing was saved at routing time on that pod (Envoy served the request
// elsewhere), Saved still inserts. Through the batcher and the dispatcher,
// on both stores.
func TestConfirmationNeverBringsBackAnEvictedEntry(t *testing.T) {
	for cname, mk := range centers(t) {
		for mode, extra := range updateModes {
			t.Run(cname+"/"+mode, func(t *testing.T) {
				ts := mk(t)
				e := newGateway(t, configFor(t, ts.URL, extra), routing.Options{}, nil)
				mc, err := client.New(client.Options{Address: ts.URL, QueryTimeout: 2 * time.Second})
				if err != nil {
					t.Fatal(err)
				}
				testConfirm(t, e, mc)
			})
		}
	}
}

func testConfirm(t *testing.T, e gateway, mc *client.Client) {
	ctx := context.Background()
	const cluster = "canary" // one pod: where a request goes is certain
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
	leases := func() int64 {
		t.Helper()
		ans, err := mc.Route(ctx, cluster, nil)
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		for _, s := range ans.Load {
			n += s.TotalReqs
		}
		return n
	}
	decide := func(system, user string) *Request {
		t.Helper()
		d, err := e.Decide(ctx, hdr{":path": "/v1/chat/completions", "x-env": "canary"}, chatBody(system, user))
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	evictTail := func(d *Request, host string) {
		t.Helper()
		n := len(d.Hashes)
		if err := mc.EvictCache(ctx, api.CacheEvict{Cluster: cluster, Host: host, Hashes: d.Hashes[n-1:],
			EvictedAt: time.Now().UnixMilli()}); err != nil {
			t.Fatal(err)
		}
		if got := held(host, d.Hashes); got != n-1 {
			t.Fatalf("after evicting the tail: %d of %d blocks held", got, n)
		}
	}
	finish := func(d *Request) {
		t.Helper()
		e.Saved(d)
		e.FirstToken(d)
		e.Done(d)
		eventually(t, "the request's updates to land", func() bool { return e.Pending() == 0 && leases() == 0 })
	}
	system := strings.Repeat("You answer questions about rivers, briefly. ", 6)

	// 1. Saved at routing time; the pod evicts the tail before the answer
	// starts: the confirmation leaves it out.
	d1 := decide(system, "Where does the Nile begin?")
	e.Started(d1)
	eventually(t, "the routing-time save", func() bool { return held(d1.Host, d1.Hashes) == len(d1.Hashes) })
	evictTail(d1, d1.Host)
	finish(d1)
	if got := held(d1.Host, d1.Hashes); got != len(d1.Hashes)-1 {
		t.Fatalf("the confirmation brought the evicted block back: %d of %d held, want %d", got, len(d1.Hashes), len(d1.Hashes)-1)
	}

	// 2. Envoy served it on another pod: nothing was saved there, so the
	// save at the answer's start inserts the whole prompt on that pod.
	d2 := decide(system, "Where does the Danube end?")
	e.Started(d2)
	eventually(t, "d2's routing-time save", func() bool { return held(d2.Host, d2.Hashes) == len(d2.Hashes) })
	const other = "10.9.9.9:8000"
	e.Served(d2, other)
	finish(d2)
	if got := held(other, d2.Hashes); got != len(d2.Hashes) {
		t.Fatalf("the pod that served d2 holds %d of %d blocks in the index", got, len(d2.Hashes))
	}
	if got := held(d2.Host, d2.Hashes); got >= len(d2.Hashes) {
		t.Fatalf("the chosen pod kept d2's routing-time save: %d of %d", got, len(d2.Hashes))
	}

	// 3. The index held the whole prompt (a repeated prompt): nothing to
	// save at routing time, and the confirmation still never inserts: the
	// evicted tail stays out. (A save that inserted at the answer's start
	// brought it back.)
	d3 := decide(system, "Where does the Rhine flow?")
	e.Started(d3)
	finish(d3)
	d4 := decide(system, "Where does the Rhine flow?")
	if d4.Host != d3.Host || d4.CacheRatio < 1 {
		t.Fatalf("the repeated prompt went to %s with ratio %v; d3 is on %s", d4.Host, d4.CacheRatio, d3.Host)
	}
	e.Started(d4)
	eventually(t, "d4's lease", func() bool { return e.Pending() == 0 && leases() == 1 })
	evictTail(d4, d4.Host)
	finish(d4)
	if got := held(d4.Host, d4.Hashes); got != len(d4.Hashes)-1 {
		t.Fatalf("the confirmation of a fully matched prompt brought the evicted block back: %d of %d held, want %d", got, len(d4.Hashes), len(d4.Hashes)-1)
	}
}
