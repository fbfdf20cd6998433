package storetest

// The contract of store.Index: saves, queries, TTLs, evictions and versions
// (docs/metadata-center.md, "Versions"). The listing is RunIndex's
// (index.go).

import (
	"fmt"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func testCacheLongestLeadingRun(e *env) {
	hs := hashes("conv", 6)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:4], "", 0, 0))
	// B holds 0, 1 and 3 but not 2: its run stops at 2 although it holds 3.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, []prefix.Hash{hs[0], hs[1], hs[3]}, "", 0, 0))
	// C lacks hash 0, so it holds no leading run at all.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs[1:], "", 0, 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 4}, {Host: hostB, Length: 2}})
	// A shorter query caps the length at its own size.
	e.wantCache(cl, hs[:1], []api.CacheLocation{{Host: hostA, Length: 1}, {Host: hostB, Length: 1}})
	// Ties are broken by host so answers are deterministic.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs[:1], "", 0, 0))
	e.wantCache(cl, hs[:2], []api.CacheLocation{
		{Host: hostA, Length: 2}, {Host: hostB, Length: 2}, {Host: hostC, Length: 2},
	})
	// C now holds hash 0 too, so its whole run counts; saving the same
	// hashes again changes nothing.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:4], "", 0, 0))
	e.wantCache(cl, hs, []api.CacheLocation{
		{Host: hostC, Length: 6}, {Host: hostA, Length: 4}, {Host: hostB, Length: 2},
	})
}

// testCacheSharedPrefix: a system prompt that every host holds, then the
// ways a host can leave that group: a later re-save of part of it (same
// holders, newer expiry), a hole right after level 0, an expired tail, and
// conversations that go further, with and without a hole.
func testCacheSharedPrefix(e *env) {
	const nHosts = 20
	hs := hashes("shared", 6)
	host := func(i int) string { return fmt.Sprintf("10.3.0.%d:9000", i+1) }
	for i := 0; i < nHosts; i++ {
		e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(i), hs[:3], "", 0, 0))
	}
	want := func(over map[int]int) []api.CacheLocation {
		var out []api.CacheLocation
		for i := 0; i < nHosts; i++ {
			n, ok := over[i]
			if !ok {
				n = 3
			}
			if n > 0 {
				out = append(out, api.CacheLocation{Host: host(i), Length: n})
			}
		}
		store.SortLocations(out)
		return out
	}
	e.wantCache(cl, hs, want(nil))
	e.clock.Advance(cacheTTL / 2)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(1), hs[:2], "", 0, 0))
	e.wantCache(cl, hs, want(nil))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(2), hs, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(3), hs, "", 0, 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, host(3), hs[4:5], 0))
	e.wantCache(cl, hs, want(map[int]int{2: 6, 3: 4}))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, host(4), hs[1:2], 0))
	e.wantCache(cl, hs, want(map[int]int{2: 6, 3: 4, 4: 1}))
	// Past the first saves' TTL: that query refreshed everything it
	// matched, so only what it did not match ages out.
	e.clock.Advance(cacheTTL/2 + time.Second)
	e.wantCache(cl, hs, want(map[int]int{2: 6, 3: 4, 4: 1}))
	e.clock.Advance(cacheTTL - time.Second)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(5), hs[:1], "", 0, 0))
	e.clock.Advance(2 * time.Second)
	e.wantCache(cl, hs, want(func() map[int]int {
		m := map[int]int{5: 1}
		for i := 0; i < nHosts; i++ {
			if i != 5 {
				m[i] = 0
			}
		}
		return m
	}()))
}

// testCacheManyHosts: more holders than hashes, with holes and expired
// entries at every depth, against a brute-force reference. (Stores may
// switch strategy between wide and narrow candidate sets; both must agree.)
func testCacheManyHosts(e *env) {
	const nHosts, nHashes = 24, 5
	hs := hashes("many", nHashes)
	host := func(i int) string { return fmt.Sprintf("10.2.0.%d:9000", i+1) }
	held := make([][]bool, nHosts)
	for i := range held {
		held[i] = make([]bool, nHashes)
		var mine []prefix.Hash
		for j := range hs {
			// Host i holds hash j unless the pattern punches a hole.
			if (i+j)%7 != 3 && j <= i%(nHashes+1) {
				held[i][j] = true
				mine = append(mine, hs[j])
			}
		}
		if len(mine) > 0 {
			e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(i), mine, "", 0, 0))
		}
	}
	// Some entries age out: re-save half the hosts' holdings later, then
	// move past the first TTL.
	e.clock.Advance(cacheTTL / 2)
	for i := 0; i < nHosts; i += 2 {
		var mine []prefix.Hash
		for j := range hs {
			if held[i][j] && j != 2 {
				mine = append(mine, hs[j])
			}
		}
		if len(mine) > 0 {
			e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(i), mine, "", 0, 0))
		}
	}
	e.clock.Advance(cacheTTL / 2)
	var want []api.CacheLocation
	for i := 0; i < nHosts; i++ {
		n := 0
		for n < nHashes && held[i][n] && i%2 == 0 && n != 2 {
			n++
		}
		if n > 0 {
			want = append(want, api.CacheLocation{Host: host(i), Length: n})
		}
	}
	store.SortLocations(want)
	if want == nil {
		want = []api.CacheLocation{}
	}
	e.wantCache(cl, hs, want)
	for k := 1; k < nHashes; k++ {
		var short []api.CacheLocation
		for _, l := range want {
			short = append(short, api.CacheLocation{Host: l.Host, Length: min(l.Length, k)})
		}
		store.SortLocations(short)
		e.wantCache(cl, hs[:k], short)
	}
}

func testCacheEmptyAndUnknown(e *env) {
	e.wantCache("nobody", hashes("x", 3), []api.CacheLocation{})
	e.wantCache(cl, nil, []api.CacheLocation{})
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hashes("x", 3), "", 0, 0))
	e.wantCache(cl, nil, []api.CacheLocation{})
	e.wantCache(cl, hashes("y", 3), []api.CacheLocation{})
}

func testCacheTTLAndRefresh(e *env) {
	hot, cold := hashes("hot", 3), hashes("cold", 3)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hot, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, cold, "", 0, 0))
	e.clock.Advance(cacheTTL / 2)
	// A hit refreshes the entries it matched, and only those.
	e.wantCache(cl, hot[:2], []api.CacheLocation{{Host: hostA, Length: 2}})
	e.clock.Advance(cacheTTL / 2)
	e.wantCache(cl, cold, []api.CacheLocation{})
	e.clock.Advance(cacheTTL/2 - time.Millisecond)
	e.wantCache(cl, hot, []api.CacheLocation{{Host: hostA, Length: 2}})
	e.clock.Advance(cacheTTL)
	e.wantCache(cl, hot, []api.CacheLocation{})

	// Saving again restarts the TTL as well.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, cold, "", 0, 0))
	e.clock.Advance(cacheTTL / 2)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, cold[:1], "", 0, 0))
	e.clock.Advance(cacheTTL / 2)
	e.wantCache(cl, cold, []api.CacheLocation{{Host: hostA, Length: 1}})
	e.clock.Advance(cacheTTL)
	e.wantCache(cl, cold, []api.CacheLocation{})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if st.IndexEntries != 0 {
		e.t.Fatalf("IndexEntries after all expired = %d", st.IndexEntries)
	}
}

func testCacheEvict(e *env) {
	hs := hashes("ev", 5)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "", 0, 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, []prefix.Hash{hs[2], hashes("unknown", 1)[0]}, 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 5}, {Host: hostA, Length: 2}})
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, []prefix.Hash{hs[2]}, 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, "unknown-cluster", hostA, hs, 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostB, hs[:1], 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 2}})
}

func testCacheEvictHost(e *env) {
	a, b := hashes("a", 4), hashes("b", 4)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, a, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, b, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, a, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, "other", hostA, a, "", 0, 0))
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostA, 0))
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostA, 0))
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostC, 0))
	e.wantCache(cl, a, []api.CacheLocation{{Host: hostB, Length: 4}})
	e.wantCache(cl, b, []api.CacheLocation{})
	e.wantCache("other", a, []api.CacheLocation{{Host: hostA, Length: 4}})
	// The host can come back and save again (restarted pod).
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, b[:2], "", 0, 0))
	e.wantCache(cl, b, []api.CacheLocation{{Host: hostA, Length: 2}})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if want := int64(4 + 4 + 2); st.IndexEntries != want {
		e.t.Fatalf("IndexEntries = %d, want %d", st.IndexEntries, want)
	}
}

// ms is the store clock's time in Unix milliseconds.
func (e *env) ms() int64 { return e.clock.Now().UnixMilli() }

// A late eviction (a report retried after an outage, say) removes only
// entries saved at or before the time the pod evicted; a save after it,
// even of the same prefix, stays. Query hits are not saves.
func testVersionsEvictBefore(e *env) {
	hs := hashes("ver", 4)
	t0 := e.ms()
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:2], "r1", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "", 0, 0))
	e.clock.Advance(20 * time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[2:], "r2", 0, 0))
	// The pod evicted before anything was saved: nothing goes.
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, hs, t0-1))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 4}, {Host: hostB, Length: 4}})
	// Between the two saves: the first two go, the later two stay.
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, hs, t0+10))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 4}})
	e.wantCache(cl, hs[2:], []api.CacheLocation{{Host: hostA, Length: 2}, {Host: hostB, Length: 2}})
	// A save in the very millisecond of the eviction goes too: ties count
	// as before, so the index errs towards a miss, never a wrong hit.
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, hs[2:3], e.ms()))
	e.wantCache(cl, hs[2:], []api.CacheLocation{{Host: hostB, Length: 2}})
	e.wantCache(cl, hs[3:], []api.CacheLocation{{Host: hostA, Length: 1}, {Host: hostB, Length: 1}})
	// A hit refreshes the TTL but is no save: an eviction after the save
	// and before the hit still removes the entry.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs[:1], "r3", 0, 0))
	evicted := e.ms()
	e.clock.Advance(5 * time.Second)
	e.wantCache(cl, hs[:1], []api.CacheLocation{{Host: hostB, Length: 1}, {Host: hostC, Length: 1}})
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostC, hs[:1], evicted))
	e.wantCache(cl, hs[:1], []api.CacheLocation{{Host: hostB, Length: 1}})
	// No time (an old worker): removed whatever the save time.
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostB, hs, 0))
	e.wantCache(cl, hs, []api.CacheLocation{})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if st.IndexEntries != 1 { // hostA's hs[3]
		e.t.Fatalf("IndexEntries = %d, want 1", st.IndexEntries)
	}
}

// A save made before an eviction but arriving after its report (a
// gateway's routing-time save, sent batched and late under load) does not
// bring the prefix back, nor does one made before a pod's evict-all; a
// save made after either does. A late save does not become an entry's
// last save over a later one. Evictions are remembered for
// store.EvictionMemory, no longer.
func testLateSaveKeepsEvictionsOut(e *env) {
	hs := hashes("late", 4)
	routed := e.ms() // a gateway routes a request for hs to hostA
	e.clock.Advance(10 * time.Millisecond)
	evicted := e.ms() // hostA drops hs[2:] (it served the request; the next turn truncated it)
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, hs[2:], evicted))
	e.clock.Advance(500 * time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "r1", routed, 0)) // the routing-time save lands
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "r1", routed, 0)) // another host's evictions do not matter
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 4}, {Host: hostA, Length: 2}})
	// A request routed there after the eviction: kept.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "r2", evicted+1, 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 4}, {Host: hostB, Length: 4}})
	// r2's save stays the last one: a late save of an earlier decision
	// neither dates the entry back (an eviction between the two keeps it)
	// nor lets its retraction withdraw r2's entry.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "r0", routed, 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, hs, evicted))
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostA, hs, "r0"))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 4}, {Host: hostB, Length: 4}})
	// A restarted pod: saves made before its start epoch, landing after
	// its evict-all, stay out; so do those dated in the future (clamped
	// to now, the tie goes to the eviction).
	fresh := hashes("late-epoch", 2)
	before := e.ms()
	e.clock.Advance(10 * time.Millisecond)
	epoch := e.ms()
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostC, epoch))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, fresh, "old-process", before, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, fresh, "future", epoch+60_000, 0))
	e.wantCache(cl, fresh, []api.CacheLocation{})
	e.clock.Advance(time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, fresh, "new-process", 0, 0))
	e.wantCache(cl, fresh, []api.CacheLocation{{Host: hostC, Length: 2}})
	// Past the memory, an eviction no longer holds back a save dated
	// before it.
	gone := hashes("late-forgotten", 1)
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostB, gone, e.ms()))
	e.clock.Advance(store.EvictionMemory + time.Second)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, gone, "much-later", e.ms()-store.EvictionMemory.Milliseconds()-2000, 0))
	e.wantCache(cl, gone, []api.CacheLocation{{Host: hostB, Length: 1}})
}

// A pod's start epoch: its evict-all removes what was saved before it
// started, and keeps what was saved since (requests it already serves).
func testVersionsEvictHostBefore(e *env) {
	old, fresh := hashes("old", 3), hashes("fresh", 2)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, old, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, old, "", 0, 0))
	e.clock.Advance(10 * time.Millisecond)
	epoch := e.ms()
	e.clock.Advance(10 * time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, fresh, "after-start", 0, 0))
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostA, epoch))
	e.wantCache(cl, old, []api.CacheLocation{{Host: hostB, Length: 3}})
	e.wantCache(cl, fresh, []api.CacheLocation{{Host: hostA, Length: 2}})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if st.IndexEntries != 3+2 {
		e.t.Fatalf("IndexEntries = %d, want 5", st.IndexEntries)
	}
	// Again, late: the same result (idempotent).
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostA, epoch))
	e.wantCache(cl, fresh, []api.CacheLocation{{Host: hostA, Length: 2}})
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostA, 0))
	e.wantCache(cl, fresh, []api.CacheLocation{})
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostC, epoch)) // unknown host
	// The host saves again after an evict-all.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, fresh, "again", 0, 0))
	e.wantCache(cl, fresh, []api.CacheLocation{{Host: hostA, Length: 2}})
}

// A retraction withdraws exactly the entries whose last save it names:
// an entry saved again since, by another request, stays.
func testVersionsRetract(e *env) {
	hs := hashes("retract", 6)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:2], "earlier", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "r1", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "r1", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[4:], "r2", 0, 0)) // another request, meanwhile
	// r1 failed before its first token; the index held hs[:2] on hostA
	// when it was routed, so it retracts hs[2:].
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostA, hs[2:], "r1"))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 6}, {Host: hostA, Length: 2}})
	e.wantCache(cl, hs[4:], []api.CacheLocation{{Host: hostA, Length: 2}, {Host: hostB, Length: 2}})
	// Unnamed, unknown and repeated retractions change nothing.
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostA, hs, ""))
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostA, hs, "nobody"))
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostA, hs[2:], "r1"))
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostC, hs, "r1"))
	e.must(e.st.Index.RetractCache(e.ctx, "unknown-cluster", hostA, hs, "r1"))
	e.wantCache(cl, hs[4:], []api.CacheLocation{{Host: hostA, Length: 2}, {Host: hostB, Length: 2}})
	e.wantCache(cl, hs[:2], []api.CacheLocation{{Host: hostA, Length: 2}, {Host: hostB, Length: 2}})
	// Through a batch, in order: a save and its retraction cancel out; a
	// save another request made after it survives the retraction.
	other := hashes("retract-batch", 3)
	e.must(e.st.Batch.Apply(e.ctx, []store.Op{
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostC, Hashes: other, SaveID: "b1"},
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostB, Hashes: other, SaveID: "b1"},
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostB, Hashes: other[:1], SaveID: "b2"},
		{Kind: store.OpRetractCache, Cluster: cl, Host: hostC, Hashes: other, SaveID: "b1"},
		{Kind: store.OpRetractCache, Cluster: cl, Host: hostB, Hashes: other, SaveID: "b1"},
		{Kind: store.OpRetractCache, Cluster: cl, Host: hostB, Hashes: other}, // no id: nothing
		{Kind: store.OpRetractCache, Cluster: cl, Host: hostB, SaveID: "b2"},  // no hashes: nothing
	}))
	e.wantCache(cl, other, []api.CacheLocation{{Host: hostB, Length: 1}})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if st.IndexEntries != 2+2+6+1 {
		e.t.Fatalf("IndexEntries = %d, want 11", st.IndexEntries)
	}
}

// A refresh (the gateway's confirmation of a routing-time save) renews the
// TTL and the version of the entries host still holds and never inserts
// one: arriving after the pod reported an eviction, it must not bring the
// evicted entry back.
func testRefreshNeverInserts(e *env) {
	hs := hashes("refresh", 4)
	entries := func() int64 {
		e.t.Helper()
		st, err := e.st.Health.Stats(e.ctx)
		e.must(err)
		return st.IndexEntries
	}
	// Nothing held anywhere: nothing appears, not even the host or cluster.
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostA, hs, "r0"))
	e.must(e.st.Index.RefreshCache(e.ctx, "unknown-cluster", hostA, hs, "r0"))
	e.wantCache(cl, hs, []api.CacheLocation{})
	if n := entries(); n != 0 {
		e.t.Fatalf("IndexEntries = %d after refreshing nothing, want 0", n)
	}

	// hostA saved the first two; a refresh of all four keeps it at two.
	t0 := e.ms()
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:2], "r1", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "r1", 0, 0))
	e.clock.Advance(20 * time.Millisecond)
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostA, hs, "r1"))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 4}, {Host: hostA, Length: 2}})
	e.wantCache(cl, hs[2:], []api.CacheLocation{{Host: hostB, Length: 2}})
	if n := entries(); n != 2+4 {
		e.t.Fatalf("IndexEntries = %d, want 6", n)
	}
	// The refresh is no save (as a query hit): an eviction the pod made
	// after the save removes the entry even when its report arrives after
	// the refresh; one made before the save leaves it.
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, hs, t0-1))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 4}, {Host: hostA, Length: 2}})
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, hs[1:], t0+10))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostB, hs[2:], t0+10))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 2}, {Host: hostA, Length: 1}})
	// It does take the save id: a retraction of the first save's id
	// leaves what the refresher vouched for, one of the refresher's goes.
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostB, hs, "r9"))
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostB, hs, "r1"))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 2}, {Host: hostA, Length: 1}})
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostB, hs[1:], "r9"))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs[1:2], "r1", 0, 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 2}, {Host: hostA, Length: 1}})

	// The bug this exists for: the pod evicted hostC's tail, the report
	// landed, and the confirmation of the save comes after it.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs, "r2", 0, 0))
	e.clock.Advance(5 * time.Millisecond)
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostC, hs[2:], e.ms()))
	e.clock.Advance(5 * time.Millisecond)
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostC, hs, "r2"))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 2}, {Host: hostC, Length: 2}, {Host: hostA, Length: 1}})
	e.wantCache(cl, hs[2:], []api.CacheLocation{})
	// The other order: the refresh lands first, then the report of an
	// eviction the pod made after the save: the entry goes all the same.
	evicted := e.ms()
	e.clock.Advance(5 * time.Millisecond)
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostC, hs, "r2"))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostC, hs[1:2], evicted))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 2}, {Host: hostA, Length: 1}, {Host: hostC, Length: 1}})

	// The refresh renews the TTL: hostA refreshed near the end of its
	// entries' life outlives hostB, saved at the same time and not
	// refreshed. No query in between (a hit refreshes too).
	e.clock.Advance(cacheTTL - time.Second)
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostA, hs[:1], "r3"))
	e.clock.Advance(2 * time.Second)
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 1}})
	// An entry that expired is gone for a refresh as well.
	e.clock.Advance(cacheTTL + time.Second)
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostA, hs, "r3"))
	e.wantCache(cl, hs, []api.CacheLocation{})
	if n := entries(); n != 0 {
		e.t.Fatalf("IndexEntries = %d after everything expired, want 0", n)
	}

	// Through a batch, in order: a refresh before the save inserts
	// nothing, the one after it renews; refresh-only ops of a host that
	// holds nothing leave it out.
	other := hashes("refresh-batch", 3)
	e.must(e.st.Batch.Apply(e.ctx, []store.Op{
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostA, Hashes: other, SaveID: "b1", RefreshOnly: true},
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostB, Hashes: other[:2], SaveID: "b1"},
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostB, Hashes: other, SaveID: "b1", RefreshOnly: true},
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostC, SaveID: "b1", RefreshOnly: true}, // no hashes: nothing
	}))
	e.wantCache(cl, other, []api.CacheLocation{{Host: hostB, Length: 2}})
	if n := entries(); n != 2 {
		e.t.Fatalf("IndexEntries = %d after the batch, want 2", n)
	}
	// Past 512 hashes (the Redis script reads versions in slices of 512),
	// each entry keeps its own save time.
	many := hashes("refresh-many", 1100)
	t1 := e.ms()
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, many[:600], "m1", 0, 0))
	e.clock.Advance(10 * time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, many[600:], "m2", 0, 0))
	e.clock.Advance(10 * time.Millisecond)
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostC, many, "m3"))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostC, many, t1+5))
	e.wantCache(cl, many, []api.CacheLocation{})
	e.wantCache(cl, many[600:], []api.CacheLocation{{Host: hostC, Length: 500}})
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostC, 0))

	// The refreshed entries carry the refresh's save id: retracting it
	// withdraws them (a refresh confirms the save of the same request).
	e.must(e.st.Index.RefreshCache(e.ctx, cl, hostB, other, "b2"))
	e.must(e.st.Index.RetractCache(e.ctx, cl, hostB, other, "b2"))
	e.wantCache(cl, other, []api.CacheLocation{})
}

// testCacheCapacity: a save's maxEntries bounds what its host holds, as the
// pod's KV cache does. Past it the least recently saved entries go and, of
// one save, the prompt's last blocks first, so what stays of a prompt is
// still a prefix of it. Other hosts keep theirs; a batch carries the bound
// too.
func testCacheCapacity(e *env) {
	a, b, c, d := hashes("cap-a", 4), hashes("cap-b", 4), hashes("cap-c", 3), hashes("cap-d", 8)
	step := func() { e.clock.Advance(time.Millisecond) }
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, a, "", 0, 6))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, a, "", 0, 0))
	step()
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, b, "", 0, 6))
	e.wantCache(cl, a, []api.CacheLocation{{Host: hostB, Length: 4}, {Host: hostA, Length: 2}})
	e.wantCache(cl, b, []api.CacheLocation{{Host: hostA, Length: 4}})
	step()
	// Using a's first block again makes it the most recent; c then pushes
	// out the three least recent: a's second block, b's last two.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, a[:1], "", 0, 6))
	step()
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, c, "", 0, 6))
	e.wantCache(cl, a, []api.CacheLocation{{Host: hostB, Length: 4}, {Host: hostA, Length: 1}})
	e.wantCache(cl, b, []api.CacheLocation{{Host: hostA, Length: 2}})
	e.wantCache(cl, c, []api.CacheLocation{{Host: hostA, Length: 3}})
	step()
	// A prompt longer than the bound keeps its first blocks.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, d, "", 0, 4))
	e.wantCache(cl, d, []api.CacheLocation{{Host: hostA, Length: 4}})
	e.wantCache(cl, c, []api.CacheLocation{})
	e.wantCache(cl, a, []api.CacheLocation{{Host: hostB, Length: 4}})
	step()
	e.must(e.st.Batch.Apply(e.ctx, []store.Op{{Kind: store.OpSaveCache, Cluster: cl, Host: hostB, Hashes: c, MaxEntries: 5}}))
	e.wantCache(cl, c, []api.CacheLocation{{Host: hostB, Length: 3}})
	e.wantCache(cl, a, []api.CacheLocation{{Host: hostB, Length: 2}})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if want := int64(4 + 5); st.IndexEntries != want {
		e.t.Fatalf("IndexEntries = %d, want %d", st.IndexEntries, want)
	}
}
