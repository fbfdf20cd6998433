package storetest

import (
	"reflect"
	"slices"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// RunIndex is the contract of store.Index.CacheIndex: the listing is exactly
// what queries answer — saves appear, evictions (one prefix or a whole
// host) and expiry remove, clusters stay apart.
func RunIndex(t *testing.T, f Factory) {
	e := setup(t, f)
	list := func(cluster string) map[string][]prefix.Hash {
		t.Helper()
		got, err := e.st.Index.CacheIndex(e.ctx, cluster)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	want := func(cluster string, w map[string][]prefix.Hash) {
		t.Helper()
		for _, hs := range w {
			slices.Sort(hs)
		}
		if got := list(cluster); !reflect.DeepEqual(got, w) {
			t.Fatalf("index of %s = %v, want %v", cluster, got, w)
		}
	}
	const c, other = "outbound|8000||idx.llm", "outbound|8000||other.llm"
	a, b := hashes("a", 3), hashes("b", 2)
	want(c, map[string][]prefix.Hash{})

	e.must(e.st.Index.SaveCacheAs(e.ctx, c, "10.0.0.1:80", a, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, c, "10.0.0.2:80", a[:1], "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, c, "10.0.0.2:80", b, "", 0, 0))
	e.must(e.st.Index.SaveCacheAs(e.ctx, other, "10.0.0.9:80", b, "", 0, 0))
	want(c, map[string][]prefix.Hash{
		"10.0.0.1:80": slices.Clone(a),
		"10.0.0.2:80": {a[0], b[0], b[1]},
	})
	want(other, map[string][]prefix.Hash{"10.0.0.9:80": slices.Clone(b)})

	e.must(e.st.Index.EvictCacheBefore(e.ctx, c, "10.0.0.1:80", a[1:2], 0))
	e.must(e.st.Index.EvictHostBefore(e.ctx, c, "10.0.0.2:80", 0))
	want(c, map[string][]prefix.Hash{"10.0.0.1:80": {a[0], a[2]}})

	e.clock.Advance(cacheTTL / 2)
	e.must(e.st.Index.SaveCacheAs(e.ctx, c, "10.0.0.3:80", b[:1], "", 0, 0))
	e.clock.Advance(cacheTTL/2 + 1)
	want(c, map[string][]prefix.Hash{"10.0.0.3:80": b[:1]})
}
