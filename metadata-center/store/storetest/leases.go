package storetest

// The contract of store.Leases: counts per host, idempotent deletes,
// re-adds, expiry, routing clusters apart.

import (
	"reflect"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

func testLeaseCounts(e *env) {
	e.wantLoad(cl, api.LoadStats{})
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 100))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r2", 50))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostB, "r3", 7))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostC, "r4", 0))
	e.wantLoad(cl, api.LoadStats{
		hostA: {TotalReqs: 2, PromptLength: 150},
		hostB: {TotalReqs: 1, PromptLength: 7},
		hostC: {TotalReqs: 1, PromptLength: 0},
	})

	// First token: the lease still counts, its prompt no longer does.
	e.must(e.st.Leases.FirstToken(e.ctx, cl, hostA, "r1"))
	e.must(e.st.Leases.FirstToken(e.ctx, cl, hostA, "r1"))
	e.wantLoad(cl, api.LoadStats{
		hostA: {TotalReqs: 2, PromptLength: 50},
		hostB: {TotalReqs: 1, PromptLength: 7},
		hostC: {TotalReqs: 1, PromptLength: 0},
	})

	// Done after first token removes nothing more from the prompt sum.
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostA, "r1"))
	// Done before first token removes its prompt too.
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostB, "r3"))
	e.wantLoad(cl, api.LoadStats{
		hostA: {TotalReqs: 1, PromptLength: 50},
		hostC: {TotalReqs: 1, PromptLength: 0},
	})
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostA, "r2"))
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostC, "r4"))
	e.wantLoad(cl, api.LoadStats{})
}

func testLeaseIdempotentDelete(e *env) {
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostA, "never-added"))
	e.must(e.st.Leases.FirstToken(e.ctx, cl, hostA, "never-added"))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 10))
	for i := 0; i < 3; i++ {
		e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostA, "r1"))
	}
	// The same request id on another host is another lease.
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostB, "r1"))
	e.wantLoad(cl, api.LoadStats{})
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r2", 5))
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostB, "r2"))
	e.wantLoad(cl, api.LoadStats{hostA: {TotalReqs: 1, PromptLength: 5}})
}

func testLeaseReAdd(e *env) {
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 10))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 30))
	e.wantLoad(cl, api.LoadStats{hostA: {TotalReqs: 1, PromptLength: 30}})
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostA, "r1"))
	e.wantLoad(cl, api.LoadStats{})
}

func testLeaseExpiry(e *env) {
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "old", 100))
	e.clock.Advance(leaseTTL / 2)
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "young", 10))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostB, "renewed", 1))
	e.clock.Advance(leaseTTL/2 - time.Millisecond)
	e.wantLoad(cl, api.LoadStats{
		hostA: {TotalReqs: 2, PromptLength: 110},
		hostB: {TotalReqs: 1, PromptLength: 1},
	})
	// Re-adding restarts the lease's TTL.
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostB, "renewed", 1))
	e.clock.Advance(time.Millisecond)
	// The gateway that added "old" died: its lease is gone by itself.
	e.wantLoad(cl, api.LoadStats{
		hostA: {TotalReqs: 1, PromptLength: 10},
		hostB: {TotalReqs: 1, PromptLength: 1},
	})
	// A late delete of the expired lease must not go negative.
	e.must(e.st.Leases.DeleteLease(e.ctx, cl, hostA, "old"))
	e.clock.Advance(leaseTTL / 2)
	e.wantLoad(cl, api.LoadStats{hostB: {TotalReqs: 1, PromptLength: 1}})
	ans, err := e.st.Router.Route(e.ctx, cl, nil)
	e.must(err)
	if !reflect.DeepEqual(ans.Load, api.LoadStats{hostB: {TotalReqs: 1, PromptLength: 1}}) {
		e.t.Fatalf("Route load after expiry = %v", ans.Load)
	}
	e.clock.Advance(leaseTTL)
	e.wantLoad(cl, api.LoadStats{})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if st.LiveLeases != 0 {
		e.t.Fatalf("LiveLeases after all expired = %d", st.LiveLeases)
	}
}

func testClusterIsolation(e *env) {
	hs := hashes("p", 4)
	e.must(e.st.Leases.AddLease(e.ctx, "c1", hostA, "r1", 3))
	e.must(e.st.Index.SaveCacheAs(e.ctx, "c1", hostA, hs, "", 0, 0))
	e.wantLoad("c2", api.LoadStats{})
	e.wantCache("c2", hs, []api.CacheLocation{})
	e.must(e.st.Leases.DeleteLease(e.ctx, "c2", hostA, "r1"))
	e.must(e.st.Index.EvictHostBefore(e.ctx, "c2", hostA, 0))
	e.wantLoad("c1", api.LoadStats{hostA: {TotalReqs: 1, PromptLength: 3}})
	e.wantCache("c1", hs, []api.CacheLocation{{Host: hostA, Length: 4}})
}
