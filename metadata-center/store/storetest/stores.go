package storetest

import (
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
)

// Named builds one kind of store with default options, for tests and
// benchmarks of what sits on top of a store (the HTTP server, the
// client's batcher).
type Named struct {
	Name string
	New  func(tb testing.TB) store.Store
}

// Stores are the memory store and the Redis store (on the shared test
// redis-server, under a fresh key prefix), in that order.
func Stores() []Named {
	return []Named{
		{"memory", func(testing.TB) store.Store { return memstore.New(memstore.Options{}) }},
		{"redis", func(tb testing.TB) store.Store {
			srv := redistest.Shared(tb)
			st, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: srv.Prefix})
			if err != nil {
				tb.Fatal(err)
			}
			tb.Cleanup(func() { _ = st.Close() })
			return st
		}},
	}
}
