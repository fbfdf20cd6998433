package redisstore_test

import (
	"context"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/internal/routeload"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// BenchmarkSaveCache measures the write that follows most requests: a host
// saving a 64-block prompt it already holds, in routeload.Default's index
// (the 8-block system prompt held by all 64 hosts), so the cost of keeping
// the route query cheap shows up here if anywhere.
func BenchmarkSaveCache(b *testing.B) { benchSave(b, false) }

// BenchmarkRefreshCache is the gateway's confirmation of the same saves
// (refresh_only: every entry exists, each one's version is read back).
func BenchmarkRefreshCache(b *testing.B) { benchSave(b, true) }

func benchSave(b *testing.B, refresh bool) {
	srv := redistest.Shared(b)
	st, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: srv.Prefix})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = st.Close() })
	sc := routeload.Default()
	ctx := context.Background()
	if err := sc.Populate(ctx, st.Parts()); err != nil {
		b.Fatal(err)
	}
	saves := sc.Saves()
	hs := make([][]prefix.Hash, len(saves))
	for i, sv := range saves {
		for _, w := range sv.Hashes {
			h, err := prefix.ParseHash(w)
			if err != nil {
				b.Fatal(err)
			}
			hs[i] = append(hs[i], h)
		}
	}
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		sv := saves[i%len(saves)]
		var err error
		if refresh {
			err = st.RefreshCache(ctx, sv.Cluster, sv.Host, hs[i%len(saves)], "")
		} else {
			err = st.SaveCacheAs(ctx, sv.Cluster, sv.Host, hs[i%len(saves)], "", 0, 0)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}
