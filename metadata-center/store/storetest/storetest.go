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

// Run runs the whole contract as subtests of t. Each part's tests have a
// file: leases.go, cache.go (Index), signals.go, pods.go (Registry); the
// Router, Health and Batcher tests and the concurrency test are here.
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
		{"CacheCapacity", testCacheCapacity},
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

func testRoute(e *env) {
	hs := hashes("route", 8)
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 40))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostB, "r2", 60))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostA, hs[:3], "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostC, hs, "", 0, 0))
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
	e.must(e.st.Index.SaveCacheAs(e.ctx, "c1", hostA, hashes("s", 3), "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, "c2", hostB, hashes("s", 2), "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, "c2", hostB, hashes("s", 2), "", 0, 0))
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
				if err := e.st.Index.SaveCacheAs(e.ctx, cl, host, hs, "", 0, 0); err != nil {
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
