package memstore_test

import (
	"context"
	"fmt"
	"reflect"
	"runtime"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func TestContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T, cfg storetest.Config) store.Store {
		return memstore.New(memstore.Options{LeaseTTL: cfg.LeaseTTL, CacheTTL: cfg.CacheTTL, Now: cfg.Now})
	})
}

// TestLRUCap checks the memory bound: past MaxEntries the least recently
// saved or hit entries go first, across hosts and clusters.
func TestLRUCap(t *testing.T) {
	ctx := context.Background()
	clock := storetest.NewClock()
	st := memstore.New(memstore.Options{MaxEntries: 6, Now: clock.Now, TouchInterval: -1})
	hs := func(p string) []prefix.Hash {
		out := make([]prefix.Hash, 3)
		for i := range out {
			h, err := prefix.ParseHash(fmt.Sprintf("%s%015x", p, i))
			if err != nil {
				t.Fatal(err)
			}
			out[i] = h
		}
		return out
	}
	a, b, c := hs("a"), hs("b"), hs("c")
	const h1, h2 = "10.0.0.1:1", "10.0.0.2:1"
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	query := func(cluster string, q []prefix.Hash) []api.CacheLocation {
		t.Helper()
		got, err := st.QueryCache(ctx, cluster, q)
		must(err)
		return got
	}
	must(st.SaveCacheAs(ctx, "c1", h1, a, "", 0, 0))
	clock.Advance(time.Second)
	must(st.SaveCacheAs(ctx, "c2", h2, b, "", 0, 0))
	clock.Advance(time.Second)
	// A hit on a[0] makes it the most recent entry of a.
	if got := query("c1", a[:1]); !reflect.DeepEqual(got, []api.CacheLocation{{Host: h1, Length: 1}}) {
		t.Fatalf("hit = %v", got)
	}
	clock.Advance(time.Second)
	must(st.SaveCacheAs(ctx, "c1", h2, c[:2], "", 0, 0))
	// 8 entries were saved into 6 slots: a[1] and a[2] were least recent.
	if got := query("c1", a); !reflect.DeepEqual(got, []api.CacheLocation{{Host: h1, Length: 1}}) {
		t.Fatalf("after cap, a = %v", got)
	}
	if got := query("c2", b); !reflect.DeepEqual(got, []api.CacheLocation{{Host: h2, Length: 3}}) {
		t.Fatalf("after cap, b = %v", got)
	}
	stats, err := st.Stats(ctx)
	must(err)
	if stats.IndexEntries != 6 {
		t.Fatalf("IndexEntries = %d, want 6", stats.IndexEntries)
	}
}

// TestTouchCoalescing pins the trade-off documented on TouchInterval: hits
// closer together than the interval refresh the TTL only once.
func TestTouchCoalescing(t *testing.T) {
	ctx := context.Background()
	clock := storetest.NewClock()
	st := memstore.New(memstore.Options{CacheTTL: time.Minute, TouchInterval: 10 * time.Second, Now: clock.Now})
	h := []prefix.Hash{42}
	if err := st.SaveCacheAs(ctx, "c", "10.0.0.1:1", h, "", 0, 0); err != nil {
		t.Fatal(err)
	}
	clock.Advance(5 * time.Second)
	_, _ = st.QueryCache(ctx, "c", h) // within the interval: no refresh
	clock.Advance(55*time.Second - time.Millisecond)
	if got, _ := st.QueryCache(ctx, "c", h); len(got) != 1 {
		t.Fatalf("entry gone before its TTL: %v", got) // this hit is past the interval: refreshes
	}
	clock.Advance(time.Minute - time.Millisecond)
	if got, _ := st.QueryCache(ctx, "c", h); len(got) != 1 {
		t.Fatalf("refreshed entry gone early: %v", got)
	}
	clock.Advance(time.Minute)
	if got, _ := st.QueryCache(ctx, "c", h); len(got) != 0 {
		t.Fatalf("entry outlived its TTL: %v", got)
	}
}

// TestHostChurn: pods come and go with new addresses; interned host ids
// are reused, and answers must still name the right hosts.
func TestHostChurn(t *testing.T) {
	ctx := context.Background()
	st := memstore.New(memstore.Options{})
	hs := []prefix.Hash{1, 2, 3}
	for gen := 0; gen < 50; gen++ {
		a, b := fmt.Sprintf("10.1.%d.1:80", gen), fmt.Sprintf("10.1.%d.2:80", gen)
		if err := st.SaveCacheAs(ctx, "c", a, hs, "", 0, 0); err != nil {
			t.Fatal(err)
		}
		if err := st.SaveCacheAs(ctx, "c", b, hs[:2], "", 0, 0); err != nil {
			t.Fatal(err)
		}
		if err := st.AddLease(ctx, "c", b, "r", 5); err != nil {
			t.Fatal(err)
		}
		ans, err := st.Route(ctx, "c", hs)
		if err != nil {
			t.Fatal(err)
		}
		want := api.RouteAnswer{
			Load:  api.LoadStats{b: {TotalReqs: 1, PromptLength: 5}},
			Cache: []api.CacheLocation{{Host: a, Length: 3}, {Host: b, Length: 2}},
		}
		if !reflect.DeepEqual(ans, want) {
			t.Fatalf("gen %d: %+v, want %+v", gen, ans, want)
		}
		// The pods go away: a restart report for a, b's lease ends and its
		// entries are evicted one by one.
		for _, err := range []error{
			st.EvictHostBefore(ctx, "c", a, 0),
			st.DeleteLease(ctx, "c", b, "r"),
			st.EvictCacheBefore(ctx, "c", b, hs, 0),
		} {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	stats, err := st.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stats != (store.Stats{}) {
		t.Fatalf("after churn: %+v", stats)
	}
}

// BenchmarkEntryBytes measures the heap an index entry costs: 64-block
// prompts saved on 8 hosts, each save named (versions), as gateways save.
func BenchmarkEntryBytes(b *testing.B) {
	const saves, blocks = 4000, 64
	for range b.N {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		st := memstore.New(memstore.Options{})
		for i := range saves {
			hs := make([]prefix.Hash, blocks)
			for j := range hs {
				hs[j] = prefix.Hash(uint64(i)<<20 | uint64(j))
			}
			if err := st.SaveCacheAs(context.Background(), "c", fmt.Sprintf("10.0.0.%d:80", i%8), hs, fmt.Sprintf("req-%08d-0000-0000-0000-000000000000", i), 0, 0); err != nil {
				b.Fatal(err)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/(saves*blocks), "B/entry")
		runtime.KeepAlive(st)
	}
}
