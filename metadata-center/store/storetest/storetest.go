// Package storetest is the contract every store.Store must meet, part by
// part, written once and run against each implementation (memstore in
// memory, redisstore against a real redis-server), so the two cannot drift
// apart.
package storetest

import (
	"context"
	"fmt"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Config is what a factory must honour: TTLs and a clock the suite moves.
type Config struct {
	LeaseTTL time.Duration
	CacheTTL time.Duration
	Now      func() time.Time
}

// Factory builds an empty Store for one subtest. It must not share state
// with stores built for other subtests.
type Factory func(t *testing.T, cfg Config) store.Store

// Clock is a manual clock, safe for concurrent use.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock starts at the wall clock's current millisecond, so stores that
// also set real key TTLs (Redis) see plausible times.
func NewClock() *Clock { return &Clock{now: time.Now().Truncate(time.Millisecond)} }

// Now returns the current fake time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

const (
	leaseTTL = 10 * time.Minute
	cacheTTL = 30 * time.Minute
)

type env struct {
	t     *testing.T
	st    store.Parts
	clock *Clock
	ctx   context.Context
}

func setup(t *testing.T, f Factory) *env {
	clock := NewClock()
	st := f(t, Config{LeaseTTL: leaseTTL, CacheTTL: cacheTTL, Now: clock.Now})
	t.Cleanup(func() { _ = st.Close() })
	return &env{t: t, st: st.Parts(), clock: clock, ctx: context.Background()}
}

// Run runs the whole contract as subtests of t.
func Run(t *testing.T, f Factory) {
	tests := []struct {
		name string
		fn   func(*env)
	}{
		{"LeaseCounts", testLeaseCounts},
		{"Signals", testSignals},
		{"Registrations", testRegistrations},
		{"LeaseIdempotentDelete", testLeaseIdempotentDelete},
		{"LeaseReAdd", testLeaseReAdd},
		{"LeaseExpiry", testLeaseExpiry},
		{"ClusterIsolation", testClusterIsolation},
		{"CacheLongestLeadingRun", testCacheLongestLeadingRun},
		{"CacheEmptyAndUnknown", testCacheEmptyAndUnknown},
		{"CacheManyHosts", testCacheManyHosts},
		{"CacheSharedPrefix", testCacheSharedPrefix},
		{"CacheTTLAndRefresh", testCacheTTLAndRefresh},
		{"CacheEvict", testCacheEvict},
		{"CacheEvictHost", testCacheEvictHost},
		{"Route", testRoute},
		{"Stats", testStats},
		{"Concurrent", testConcurrent},
		{"Ping", testPing},
		{"Batch", testBatch},
		{"VersionsEvictBefore", testVersionsEvictBefore},
		{"VersionsEvictHostBefore", testVersionsEvictHostBefore},
		{"VersionsRetract", testVersionsRetract},
		{"RefreshNeverInserts", testRefreshNeverInserts},
		{"LateSaveKeepsEvictionsOut", testLateSaveKeepsEvictionsOut},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(setup(t, f)) })
	}
}

func hashes(name string, n int) []prefix.Hash {
	out := make([]prefix.Hash, n)
	for i := range out {
		// Distinct per prefix and index; the exact values do not matter.
		var h uint64 = 1469598103934665603
		for _, c := range fmt.Sprintf("%s/%d", name, i) {
			h = (h ^ uint64(c)) * 1099511628211
		}
		out[i] = prefix.Hash(h)
	}
	return out
}

func (e *env) must(err error) {
	e.t.Helper()
	if err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) load(cluster string) api.LoadStats {
	e.t.Helper()
	got, err := e.st.Leases.LoadStats(e.ctx, cluster)
	e.must(err)
	return got
}

func (e *env) wantLoad(cluster string, want api.LoadStats) {
	e.t.Helper()
	if got := e.load(cluster); !reflect.DeepEqual(got, want) {
		e.t.Fatalf("LoadStats(%q) = %v, want %v", cluster, got, want)
	}
}

func (e *env) query(cluster string, hs []prefix.Hash) []api.CacheLocation {
	e.t.Helper()
	got, err := e.st.Index.QueryCache(e.ctx, cluster, hs)
	e.must(err)
	return got
}

func (e *env) wantCache(cluster string, hs []prefix.Hash, want []api.CacheLocation) {
	e.t.Helper()
	if got := e.query(cluster, hs); !reflect.DeepEqual(got, want) {
		e.t.Fatalf("QueryCache(%q) = %v, want %v", cluster, got, want)
	}
}

const (
	hostA = "10.0.0.1:8000"
	hostB = "10.0.0.2:8000"
	hostC = "[fd00::3]:8000"
	cl    = "outbound|8000||qwen.llm.svc.cluster.local"
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, "c1", hostA, hs, "", 0))
	e.wantLoad("c2", api.LoadStats{})
	e.wantCache("c2", hs, []api.CacheLocation{})
	e.must(e.st.Leases.DeleteLease(e.ctx, "c2", hostA, "r1"))
	e.must(e.st.Index.EvictHostBefore(e.ctx, "c2", hostA, 0))
	e.wantLoad("c1", api.LoadStats{hostA: {TotalReqs: 1, PromptLength: 3}})
	e.wantCache("c1", hs, []api.CacheLocation{{Host: hostA, Length: 4}})
}

func testCacheLongestLeadingRun(e *env) {
	hs := hashes("conv", 6)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:4], "", 0))
	// B holds 0, 1 and 3 but not 2: its run stops at 2 although it holds 3.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, []prefix.Hash{hs[0], hs[1], hs[3]}, "", 0))
	// C lacks hash 0, so it holds no leading run at all.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs[1:], "", 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 4}, {Host: hostB, Length: 2}})
	// A shorter query caps the length at its own size.
	e.wantCache(cl, hs[:1], []api.CacheLocation{{Host: hostA, Length: 1}, {Host: hostB, Length: 1}})
	// Ties are broken by host so answers are deterministic.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs[:1], "", 0))
	e.wantCache(cl, hs[:2], []api.CacheLocation{
		{Host: hostA, Length: 2}, {Host: hostB, Length: 2}, {Host: hostC, Length: 2},
	})
	// C now holds hash 0 too, so its whole run counts; saving the same
	// hashes again changes nothing.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:4], "", 0))
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
		e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(i), hs[:3], "", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(1), hs[:2], "", 0))
	e.wantCache(cl, hs, want(nil))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(2), hs, "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(3), hs, "", 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, host(3), hs[4:5], 0))
	e.wantCache(cl, hs, want(map[int]int{2: 6, 3: 4}))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, host(4), hs[1:2], 0))
	e.wantCache(cl, hs, want(map[int]int{2: 6, 3: 4, 4: 1}))
	// Past the first saves' TTL: that query refreshed everything it
	// matched, so only what it did not match ages out.
	e.clock.Advance(cacheTTL/2 + time.Second)
	e.wantCache(cl, hs, want(map[int]int{2: 6, 3: 4, 4: 1}))
	e.clock.Advance(cacheTTL - time.Second)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(5), hs[:1], "", 0))
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
			e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(i), mine, "", 0))
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
			e.must(e.st.Index.SaveCacheAs(e.ctx, cl, host(i), mine, "", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hashes("x", 3), "", 0))
	e.wantCache(cl, nil, []api.CacheLocation{})
	e.wantCache(cl, hashes("y", 3), []api.CacheLocation{})
}

func testCacheTTLAndRefresh(e *env) {
	hot, cold := hashes("hot", 3), hashes("cold", 3)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hot, "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, cold, "", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, cold, "", 0))
	e.clock.Advance(cacheTTL / 2)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, cold[:1], "", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "", 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, []prefix.Hash{hs[2], hashes("unknown", 1)[0]}, 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 5}, {Host: hostA, Length: 2}})
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostA, []prefix.Hash{hs[2]}, 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, "unknown-cluster", hostA, hs, 0))
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostB, hs[:1], 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 2}})
}

func testCacheEvictHost(e *env) {
	a, b := hashes("a", 4), hashes("b", 4)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, a, "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, b, "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, a, "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, "other", hostA, a, "", 0))
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostA, 0))
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostA, 0))
	e.must(e.st.Index.EvictHostBefore(e.ctx, cl, hostC, 0))
	e.wantCache(cl, a, []api.CacheLocation{{Host: hostB, Length: 4}})
	e.wantCache(cl, b, []api.CacheLocation{})
	e.wantCache("other", a, []api.CacheLocation{{Host: hostA, Length: 4}})
	// The host can come back and save again (restarted pod).
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, b[:2], "", 0))
	e.wantCache(cl, b, []api.CacheLocation{{Host: hostA, Length: 2}})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if want := int64(4 + 4 + 2); st.IndexEntries != want {
		e.t.Fatalf("IndexEntries = %d, want %d", st.IndexEntries, want)
	}
}

func testRoute(e *env) {
	hs := hashes("route", 8)
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 40))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostB, "r2", 60))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:3], "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs, "", 0))
	got, err := e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	want := api.RouteAnswer{
		Load: api.LoadStats{
			hostA: {TotalReqs: 1, PromptLength: 40},
			hostB: {TotalReqs: 1, PromptLength: 60},
		},
		Cache: []api.CacheLocation{{Host: hostC, Length: 8}, {Host: hostA, Length: 3}},
	}
	if !reflect.DeepEqual(got, want) {
		e.t.Fatalf("Route = %+v, want %+v", got, want)
	}
	// Route must agree with the two separate calls.
	if l := e.load(cl); !reflect.DeepEqual(l, got.Load) {
		e.t.Fatalf("LoadStats %v != Route load %v", l, got.Load)
	}
	if c := e.query(cl, hs); !reflect.DeepEqual(c, got.Cache) {
		e.t.Fatalf("QueryCache %v != Route cache %v", c, got.Cache)
	}
	empty, err := e.st.Router.Route(e.ctx, "nobody", hs)
	e.must(err)
	if !reflect.DeepEqual(empty, api.RouteAnswer{Load: api.LoadStats{}, Cache: []api.CacheLocation{}}) {
		e.t.Fatalf("Route of unknown cluster = %+v", empty)
	}
	// A hit through Route refreshes TTLs like QueryCache does.
	e.clock.Advance(cacheTTL / 2)
	_, err = e.st.Router.Route(e.ctx, cl, hs[:2])
	e.must(err)
	e.clock.Advance(cacheTTL/2 + time.Millisecond)
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 2}, {Host: hostC, Length: 2}})
}

func testStats(e *env) {
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if st != (store.Stats{}) {
		e.t.Fatalf("Stats of an empty store = %+v", st)
	}
	e.must(e.st.Leases.AddLease(e.ctx, "c1", hostA, "r1", 1))
	e.must(e.st.Leases.AddLease(e.ctx, "c2", hostA, "r1", 1))
	e.must(e.st.Leases.AddLease(e.ctx, "c2", hostB, "r2", 1))
	e.must(e.st.Index.SaveCacheAs(e.ctx, "c1", hostA, hashes("s", 3), "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, "c2", hostB, hashes("s", 2), "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, "c2", hostB, hashes("s", 2), "", 0))
	st, err = e.st.Health.Stats(e.ctx)
	e.must(err)
	if want := (store.Stats{LiveLeases: 3, IndexEntries: 5}); st != want {
		e.t.Fatalf("Stats = %+v, want %+v", st, want)
	}
}

// testConcurrent checks that interleaved calls from many goroutines never
// lose or double-count a lease.
func testConcurrent(e *env) {
	const workers, perWorker = 8, 50
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			host := []string{hostA, hostB}[w%2]
			hs := hashes(fmt.Sprint("w", w), 4)
			for i := 0; i < perWorker; i++ {
				id := fmt.Sprintf("w%d-%d", w, i)
				if err := e.st.Leases.AddLease(e.ctx, cl, host, id, 10); err != nil {
					errs <- err
					return
				}
				if err := e.st.Index.SaveCacheAs(e.ctx, cl, host, hs, "", 0); err != nil {
					errs <- err
					return
				}
				if _, err := e.st.Router.Route(e.ctx, cl, hs); err != nil {
					errs <- err
					return
				}
				if err := e.st.Leases.FirstToken(e.ctx, cl, host, id); err != nil {
					errs <- err
					return
				}
				// Keep every fifth lease; delete the rest twice.
				if i%5 != 0 {
					for k := 0; k < 2; k++ {
						if err := e.st.Leases.DeleteLease(e.ctx, cl, host, id); err != nil {
							errs <- err
							return
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		e.t.Fatal(err)
	}
	kept := int64(workers / 2 * perWorker / 5)
	e.wantLoad(cl, api.LoadStats{hostA: {TotalReqs: kept}, hostB: {TotalReqs: kept}})
	st, err := e.st.Health.Stats(e.ctx)
	e.must(err)
	if want := (store.Stats{LiveLeases: 2 * kept, IndexEntries: workers * 4}); st != want {
		e.t.Fatalf("Stats = %+v, want %+v", st, want)
	}
}

func testPing(e *env) {
	ctx, cancel := context.WithTimeout(e.ctx, 2*time.Second)
	defer cancel()
	e.must(e.st.Health.Ping(ctx))
}

// testBatch: Batch.Apply runs a batch in order, across routing clusters,
// with the single calls' semantics, and applying it again changes nothing.
func testBatch(e *env) {
	const other = "other-cluster"
	hs := hashes("batch", 3)
	ops := []store.Op{
		{Kind: store.OpAddLease, Cluster: cl, Host: hostA, RequestID: "r1", PromptLength: 100},
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostA, Hashes: hs},
		{Kind: store.OpAddLease, Cluster: other, Host: hostB, RequestID: "r2", PromptLength: 7},
		{Kind: store.OpAddLease, Cluster: cl, Host: hostA, RequestID: "r3", PromptLength: 30},
		{Kind: store.OpFirstToken, Cluster: cl, Host: hostA, RequestID: "r1"},
		{Kind: store.OpDeleteLease, Cluster: cl, Host: hostA, RequestID: "r3"},
		{Kind: store.OpDeleteLease, Cluster: cl, Host: hostA, RequestID: "never-added"},
		{Kind: store.OpSaveCache, Cluster: other, Host: hostB, Hashes: hs[:1]},
		{Kind: store.OpSaveCache, Cluster: cl, Host: hostB}, // no hashes: nothing
	}
	for range 2 {
		e.must(e.st.Batch.Apply(e.ctx, ops))
		e.wantLoad(cl, api.LoadStats{hostA: {TotalReqs: 1, PromptLength: 0}})
		e.wantLoad(other, api.LoadStats{hostB: {TotalReqs: 1, PromptLength: 7}})
		e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 3}})
		e.wantCache(other, hs, []api.CacheLocation{{Host: hostB, Length: 1}})
	}
	// Order matters: a done before its add leaves the lease (as the single
	// calls would), which is why the client keeps one request's updates in
	// order.
	e.must(e.st.Batch.Apply(e.ctx, []store.Op{
		{Kind: store.OpDeleteLease, Cluster: cl, Host: hostA, RequestID: "r1"},
		{Kind: store.OpDeleteLease, Cluster: cl, Host: hostB, RequestID: "r4"},
		{Kind: store.OpAddLease, Cluster: cl, Host: hostB, RequestID: "r4", PromptLength: 1},
	}))
	e.wantLoad(cl, api.LoadStats{hostB: {TotalReqs: 1, PromptLength: 1}})
	e.must(e.st.Batch.Apply(e.ctx, nil))
}

// Pods' reports: the latest per host, answered with load and cache by
// Route, stamped by the store's clock, and left out once older than the
// default max age (store.DefaultSignalMaxAge), never answered stale.
func testSignals(e *env) {
	hs := hashes("sig", 2)
	if got, err := e.st.Signals.Signals(e.ctx, cl); err != nil || len(got) != 0 {
		e.t.Fatalf("no reports yet: %v %v", got, err)
	}
	e.must(e.st.Signals.ReportSignals(e.ctx, cl, hostA, api.PodSignals{Waiting: 3, Running: 8, KVCacheUtil: 0.75, PrefillTokens: 4096}))
	e.must(e.st.Signals.ReportSignals(e.ctx, cl, hostB, api.PodSignals{Waiting: 1, Running: 2, KVCacheUtil: 0.125, AgeMS: 99999}))
	e.must(e.st.Signals.ReportSignals(e.ctx, "other", hostC, api.PodSignals{Running: 1}))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 10))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "", 0))
	e.clock.Advance(300 * time.Millisecond)
	want := map[string]api.PodSignals{
		hostA: {Waiting: 3, Running: 8, KVCacheUtil: 0.75, PrefillTokens: 4096, AgeMS: 300},
		hostB: {Waiting: 1, Running: 2, KVCacheUtil: 0.125, AgeMS: 300},
	}
	got, err := e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	if !reflect.DeepEqual(got.Signals, want) {
		e.t.Fatalf("Route signals = %+v, want %+v", got.Signals, want)
	}
	if !reflect.DeepEqual(got.Load, api.LoadStats{hostA: {TotalReqs: 1, PromptLength: 10}}) ||
		!reflect.DeepEqual(got.Cache, []api.CacheLocation{{Host: hostB, Length: 2}}) {
		e.t.Fatalf("Route load/cache beside signals = %+v", got)
	}
	if s, err := e.st.Signals.Signals(e.ctx, cl); err != nil || !reflect.DeepEqual(s, want) {
		e.t.Fatalf("Signals = %+v %v, want %+v", s, err, want)
	}
	// A new report replaces the old one and restarts its age.
	e.must(e.st.Signals.ReportSignals(e.ctx, cl, hostA, api.PodSignals{Waiting: 0, Running: 1, KVCacheUtil: 0.5}))
	e.clock.Advance(store.DefaultSignalMaxAge - 300*time.Millisecond + time.Millisecond)
	got, err = e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	wantA := api.PodSignals{Running: 1, KVCacheUtil: 0.5, AgeMS: (store.DefaultSignalMaxAge - 300*time.Millisecond + time.Millisecond).Milliseconds()}
	if !reflect.DeepEqual(got.Signals, map[string]api.PodSignals{hostA: wantA}) {
		e.t.Fatalf("after B's report went stale: %+v, want only A's newer one %+v", got.Signals, wantA)
	}
	e.clock.Advance(store.DefaultSignalMaxAge)
	got, err = e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	if got.Signals != nil {
		e.t.Fatalf("stale reports answered: %+v", got.Signals)
	}
	if s, err := e.st.Signals.Signals(e.ctx, cl); err != nil || len(s) != 0 {
		e.t.Fatalf("stale reports answered by Signals: %+v %v", s, err)
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:2], "r1", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "", 0))
	e.clock.Advance(20 * time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[2:], "r2", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs[:1], "r3", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "r1", routed)) // the routing-time save lands
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "r1", routed)) // another host's evictions do not matter
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 4}, {Host: hostA, Length: 2}})
	// A request routed there after the eviction: kept.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "r2", evicted+1))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostA, Length: 4}, {Host: hostB, Length: 4}})
	// r2's save stays the last one: a late save of an earlier decision
	// neither dates the entry back (an eviction between the two keeps it)
	// nor lets its retraction withdraw r2's entry.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "r0", routed))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, fresh, "old-process", before))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, fresh, "future", epoch+60_000))
	e.wantCache(cl, fresh, []api.CacheLocation{})
	e.clock.Advance(time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, fresh, "new-process", 0))
	e.wantCache(cl, fresh, []api.CacheLocation{{Host: hostC, Length: 2}})
	// Past the memory, an eviction no longer holds back a save dated
	// before it.
	gone := hashes("late-forgotten", 1)
	e.must(e.st.Index.EvictCacheBefore(e.ctx, cl, hostB, gone, e.ms()))
	e.clock.Advance(store.EvictionMemory + time.Second)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, gone, "much-later", e.ms()-store.EvictionMemory.Milliseconds()-2000))
	e.wantCache(cl, gone, []api.CacheLocation{{Host: hostB, Length: 1}})
}

// A pod's start epoch: its evict-all removes what was saved before it
// started, and keeps what was saved since (requests it already serves).
func testVersionsEvictHostBefore(e *env) {
	old, fresh := hashes("old", 3), hashes("fresh", 2)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, old, "", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, old, "", 0))
	e.clock.Advance(10 * time.Millisecond)
	epoch := e.ms()
	e.clock.Advance(10 * time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, fresh, "after-start", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, fresh, "again", 0))
	e.wantCache(cl, fresh, []api.CacheLocation{{Host: hostA, Length: 2}})
}

// A retraction withdraws exactly the entries whose last save it names:
// an entry saved again since, by another request, stays.
func testVersionsRetract(e *env) {
	hs := hashes("retract", 6)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:2], "earlier", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs, "r1", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "r1", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[4:], "r2", 0)) // another request, meanwhile
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:2], "r1", 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "r1", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs[1:2], "r1", 0))
	e.wantCache(cl, hs, []api.CacheLocation{{Host: hostB, Length: 2}, {Host: hostA, Length: 1}})

	// The bug this exists for: the pod evicted hostC's tail, the report
	// landed, and the confirmation of the save comes after it.
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs, "r2", 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, many[:600], "m1", 0))
	e.clock.Advance(10 * time.Millisecond)
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, many[600:], "m2", 0))
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
