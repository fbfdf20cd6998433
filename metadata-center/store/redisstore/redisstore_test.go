package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func newStore(t *testing.T, srv *redistest.Server, o redisstore.Options) *redisstore.Store {
	t.Helper()
	o.Addr = srv.Addr
	if o.KeyPrefix == "" {
		o.KeyPrefix = srv.Prefix
	}
	st, err := redisstore.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

func TestContract(t *testing.T) {
	srv := redistest.Shared(t)
	storetest.Run(t, func(t *testing.T, cfg storetest.Config) store.Store {
		// A prefix per subtest: the shared server outlives them all.
		return newStore(t, srv, redisstore.Options{
			KeyPrefix: srv.Prefix + "-" + strings.ReplaceAll(t.Name(), "/", "-"),
			LeaseTTL:  cfg.LeaseTTL, CacheTTL: cfg.CacheTTL, Now: cfg.Now,
		})
	})
}

func TestOptionsValidation(t *testing.T) {
	if _, err := redisstore.New(redisstore.Options{}); err == nil {
		t.Fatal("New without Addr succeeded")
	}
	if _, err := redisstore.New(redisstore.Options{Addr: "127.0.0.1:1", KeyPrefix: "a{b"}); err == nil {
		t.Fatal("New with a brace in KeyPrefix succeeded")
	}
}

// TestKeyLayout checks the Redis Cluster contract on a real server: every
// key one cluster's calls create carries that cluster's hash tag, and
// every key has a TTL, so nothing outlives an abandoned cluster.
func TestKeyLayout(t *testing.T) {
	srv := redistest.Shared(t)
	st := newStore(t, srv, redisstore.Options{})
	ctx := context.Background()
	const cluster = "outbound|8000||qwen.llm.svc.cluster.local"
	const host = "10.1.2.3:8000"
	hs := []prefix.Hash{1, 2, 3}
	for _, err := range []error{
		st.AddLease(ctx, cluster, host, "r1", 10),
		st.AddLease(ctx, cluster, host, "r2", 10),
		st.FirstToken(ctx, cluster, host, "r2"),
		st.SaveCacheAs(ctx, cluster, host, hs, "", 0, 0),
		st.EvictCacheBefore(ctx, cluster, host, []prefix.Hash{9}, time.Now().UnixMilli()), // remembered: the x: set
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.Route(ctx, cluster, hs); err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	got, err := rdb.Keys(ctx, "*"+srv.Prefix+"*").Result()
	if err != nil {
		t.Fatal(err)
	}
	tag := "{" + srv.Prefix + ":" + cluster + "}"
	want := map[string]bool{
		tag + ":lx": true, tag + ":lp": true, tag + ":lr": true, tag + ":lq": true,
		tag + ":px": true, tag + ":pxt": true,
		tag + ":e:" + host: true, tag + ":v:" + host: true, tag + ":x:" + host: true, tag + ":hosts": true,
		"{" + srv.Prefix + "}:clusters": true,
	}
	for _, k := range got {
		if !want[k] {
			t.Errorf("unexpected key %q", k)
		}
		delete(want, k)
		ttl, err := rdb.PTTL(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		if ttl <= 0 {
			t.Errorf("key %q has no TTL (%v)", k, ttl)
		}
	}
	for k := range want {
		t.Errorf("missing key %q", k)
	}
}

// TestUnavailable checks the bounded failure and self-recovery at the
// store level: a stopped Redis gives ErrUnavailable quickly, a restarted
// one serves again without touching the Store.
func TestUnavailable(t *testing.T) {
	srv := redistest.Start(t)
	st := newStore(t, srv, redisstore.Options{})
	ctx := context.Background()
	if err := st.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	for _, call := range []func() error{
		func() error { return st.Ping(ctx) },
		func() error { return st.AddLease(ctx, "c", "10.0.0.1:1", "r", 1) },
		func() error { _, err := st.Route(ctx, "c", []prefix.Hash{1}); return err },
		func() error { _, err := st.Stats(ctx); return err },
	} {
		start := time.Now()
		err := call()
		if !errors.Is(err, store.ErrUnavailable) {
			t.Fatalf("with Redis down: err = %v, want ErrUnavailable", err)
		}
		// Generous for a loaded 2-core machine; without the short timeouts
		// and disabled retries this took seconds.
		if d := time.Since(start); d > 3*time.Second {
			t.Fatalf("failing call took %v", d)
		}
	}
	srv.Restart()
	wait.For(t, 15*time.Second, "the store to recover after Redis came back", func() bool { return st.Ping(ctx) == nil })
	if err := st.AddLease(ctx, "c", "10.0.0.1:1", "r", 1); err != nil {
		t.Fatalf("after recovery: %v", err)
	}
}

// clockedStore is a store on srv with a one-minute cache TTL whose clock
// the test moves (starting at 1,000,000 ms).
func clockedStore(t *testing.T, srv *redistest.Server) (*redisstore.Store, *atomic.Int64) {
	t.Helper()
	nowMs := new(atomic.Int64)
	nowMs.Store(1_000_000)
	st := newStore(t, srv, redisstore.Options{CacheTTL: time.Minute,
		Now: func() time.Time { return time.UnixMilli(nowMs.Load()) }})
	return st, nowMs
}

// TestHolderLists checks the per-prefix holder lists on a real server: a
// prefix every host holds is one sorted string of records, levels written
// by the same saves are byte-identical (the query's shortcut), and the
// shortcut never hides a host that dropped out of a later level or has a
// hole, nor one whose record expired.
func TestHolderLists(t *testing.T) {
	srv := redistest.Shared(t)
	st, nowMs := clockedStore(t, srv)
	ctx := context.Background()
	hs := []prefix.Hash{7, 8, 9, 10}
	for i := 20; i >= 1; i-- {
		must(t, st.SaveCacheAs(ctx, "c", fmt.Sprintf("10.0.0.%d:1", i), hs[:2], "", 0, 0))
	}
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.3:1", hs, "", 0, 0))
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.4:1", hs, "", 0, 0))
	must(t, st.EvictCacheBefore(ctx, "c", "10.0.0.4:1", hs[2:3], 0))
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	tag := "{" + srv.Prefix + ":c}"
	l7, err := rdb.HGet(ctx, tag+":px", "0000000000000007").Result()
	must(t, err)
	l8, err := rdb.HGet(ctx, tag+":px", "0000000000000008").Result()
	must(t, err)
	if l7 != l8 || !strings.HasPrefix(l7, "1060000;10.0.0.10:1 0;10.0.0.11:1 0;") || strings.Count(l7, ";") != 20 {
		t.Fatalf("shared levels: %q and %q, want the same 20 sorted records", l7, l8)
	}
	if got, err := rdb.HGet(ctx, tag+":px", "0000000000000009").Result(); err != nil || got != "1060000;10.0.0.3:1 0" {
		t.Fatalf("level 9 = %q (%v)", got, err)
	}
	locs, err := st.QueryCache(ctx, "c", hs)
	must(t, err)
	if len(locs) != 20 || locs[0] != (api.CacheLocation{Host: "10.0.0.3:1", Length: 4}) ||
		locs[1] != (api.CacheLocation{Host: "10.0.0.10:1", Length: 2}) || locs[19].Length != 2 {
		t.Fatalf("QueryCache = %v", locs)
	}
	// Host 5 saves again later: its records outlive the others', so the
	// shared levels stop being identical only where it is written.
	nowMs.Add(30_000)
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.5:1", hs[:1], "", 0, 0))
	// In place: the leading minimum stays, host 5's offset from it grows.
	if got, err := rdb.HGet(ctx, tag+":px", "0000000000000007").Result(); err != nil ||
		!strings.HasPrefix(got, "1060000;") || !strings.Contains(got, ";10.0.0.5:1 30000;") {
		t.Fatalf("level 7 after an in-place save = %q (%v)", got, err)
	}
	nowMs.Add(31_000)
	locs, err = st.QueryCache(ctx, "c", hs)
	must(t, err)
	if want := []api.CacheLocation{{Host: "10.0.0.5:1", Length: 1}}; !reflect.DeepEqual(locs, want) {
		t.Fatalf("after expiry: QueryCache = %v, want %v", locs, want)
	}
	// That query refreshed host 5; the dead records go with the next
	// rewrite of the level.
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.6:1", hs[:1], "", 0, 0))
	if got, err := rdb.HGet(ctx, tag+":px", "0000000000000007").Result(); err != nil || got != "1121000;10.0.0.5:1 0;10.0.0.6:1 0" {
		t.Fatalf("level 7 after rewrite = %q (%v)", got, err)
	}
	must(t, st.EvictHostBefore(ctx, "c", "10.0.0.5:1", 0))
	must(t, st.EvictCacheBefore(ctx, "c", "10.0.0.6:1", hs[:1], 0))
	if n, err := rdb.HExists(ctx, tag+":px", "0000000000000007").Result(); err != nil || n {
		t.Fatalf("empty holder list left behind (%v, %v)", n, err)
	}
	if _, err := rdb.ZScore(ctx, tag+":pxt", "0000000000000007").Result(); err != redis.Nil {
		t.Fatalf("holder time of an empty list left behind (%v)", err)
	}
}

// TestDeadHolderListsSwept: Redis 7.0 has no per-field TTL, so a prefix
// whose every record has expired is dropped from the {P:C}:px hash by the
// cluster's next save (its {P:C}:pxt score says so) instead of waiting for
// the whole hash to expire, which a busy cluster never lets happen.
func TestDeadHolderListsSwept(t *testing.T) {
	srv := redistest.Shared(t)
	st, nowMs := clockedStore(t, srv)
	ctx := context.Background()
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.1:1", []prefix.Hash{1, 2, 3}, "", 0, 0))
	nowMs.Add(30_000)
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.2:1", []prefix.Hash{2}, "", 0, 0))
	nowMs.Add(31_000) // host 1's records are dead, host 2's live on
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.3:1", []prefix.Hash{9}, "", 0, 0))
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	tag := "{" + srv.Prefix + ":c}"
	for h, want := range map[string]bool{"0000000000000001": false, "0000000000000002": true,
		"0000000000000003": false, "0000000000000009": true} {
		got, err := rdb.HExists(ctx, tag+":px", h).Result()
		must(t, err)
		_, zerr := rdb.ZScore(ctx, tag+":pxt", h).Result()
		if got != want || (zerr == nil) != want {
			t.Errorf("prefix %s: holder list kept %v, time kept %v (%v); want %v", h, got, zerr == nil, zerr, want)
		}
	}
	locs, err := st.QueryCache(ctx, "c", []prefix.Hash{1, 2})
	must(t, err)
	if len(locs) != 0 {
		t.Fatalf("QueryCache after expiry = %v", locs)
	}
}

// TestMaxHashes: the longest query the API accepts must run through every
// script path (Lua's unpack has a limit of a few thousand values).
func TestMaxHashes(t *testing.T) {
	srv := redistest.Shared(t)
	// 4096 hashes per script take tens of milliseconds; a loaded -race run
	// can stretch that past the default 500 ms timeout, which is not what
	// this test is about.
	st := newStore(t, srv, redisstore.Options{IOTimeout: 10 * time.Second})
	ctx := context.Background()
	hs := make([]prefix.Hash, api.MaxHashes)
	for i := range hs {
		hs[i] = prefix.Hash(i + 1)
	}
	// Narrow path: 3 hosts, one full, one half, one with a hole.
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.1:1", hs, "", 0, 0))
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.2:1", hs[:2048], "", 0, 0))
	must(t, st.SaveCacheAs(ctx, "c", "10.0.0.3:1", hs, "", 0, 0))
	must(t, st.EvictCacheBefore(ctx, "c", "10.0.0.3:1", hs[3000:3001], 0))
	want := []api.CacheLocation{{Host: "10.0.0.1:1", Length: 4096}, {Host: "10.0.0.3:1", Length: 3000}, {Host: "10.0.0.2:1", Length: 2048}}
	got, err := st.QueryCache(ctx, "c", hs)
	must(t, err)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("QueryCache = %v, want %v", got, want)
	}
	ans, err := st.Route(ctx, "c", hs)
	must(t, err)
	if !reflect.DeepEqual(ans.Cache, want) {
		t.Fatalf("Route cache = %v, want %v", ans.Cache, want)
	}
	must(t, st.EvictCacheBefore(ctx, "c", "10.0.0.1:1", hs, 0))
	must(t, st.EvictHostBefore(ctx, "c", "10.0.0.3:1", 0))
	got, err = st.QueryCache(ctx, "c", hs)
	must(t, err)
	if want := []api.CacheLocation{{Host: "10.0.0.2:1", Length: 2048}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("after evictions = %v", got)
	}
}

// TestBatchAfterScriptFlush: a node that lost its script cache (restart,
// a promoted replica) answers NOSCRIPT inside a pipeline; Apply resends
// with the script source and the batch still lands, in order.
func TestBatchAfterScriptFlush(t *testing.T) {
	srv := redistest.Shared(t)
	st := newStore(t, srv, redisstore.Options{})
	ctx := context.Background()
	const c = "flushed"
	ops := []store.Op{
		{Kind: store.OpAddLease, Cluster: c, Host: "10.0.0.1:1", RequestID: "a", PromptLength: 5},
		{Kind: store.OpSaveCache, Cluster: c, Host: "10.0.0.1:1", Hashes: []prefix.Hash{9, 10}},
		{Kind: store.OpAddLease, Cluster: c, Host: "10.0.0.1:1", RequestID: "b", PromptLength: 5},
		{Kind: store.OpDeleteLease, Cluster: c, Host: "10.0.0.1:1", RequestID: "a"},
	}
	if err := st.Apply(ctx, ops[:1]); err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := st.Apply(ctx, ops); err != nil {
		t.Fatal(err)
	}
	load, err := st.LoadStats(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(load, api.LoadStats{"10.0.0.1:1": {TotalReqs: 1, PromptLength: 5}}) {
		t.Fatalf("load after batch = %v", load)
	}
	locs, err := st.QueryCache(ctx, c, []prefix.Hash{9, 10})
	if err != nil || len(locs) != 1 || locs[0].Length != 2 {
		t.Fatalf("cache after batch = %v, %v", locs, err)
	}
}

// must fails the test at once on err.
func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
