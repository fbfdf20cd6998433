package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/internal/routeload"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// BenchmarkRouteQueryWithPods is the route query of routeload.Default (64
// hosts, 64-block prompts) with no pod registered ("none") and with every
// host registered ("registered": 4 labels and 2 adapters each, all in the
// answer), side by side on both stores: what the registrations cost.
func BenchmarkRouteQueryWithPods(b *testing.B) {
	sc := routeload.Default()
	for _, kind := range []string{"memory", "redis"} {
		for _, registered := range []bool{false, true} {
			name := kind + "/none"
			if registered {
				name = kind + "/registered"
			}
			b.Run(name, func(b *testing.B) {
				var st store.Store
				if kind == "memory" {
					st = memstore.New(memstore.Options{})
				} else {
					srv := redistest.Shared(b)
					rs, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: srv.Prefix + "-podsbench-" + name})
					if err != nil {
						b.Fatal(err)
					}
					st = rs
				}
				b.Cleanup(func() { _ = st.Close() })
				ctx := context.Background()
				parts := st.Parts()
				if err := sc.Populate(ctx, parts); err != nil {
					b.Fatal(err)
				}
				if registered {
					for h := range sc.Hosts {
						reg := api.PodRegistration{Models: []string{"qwen"}, Adapters: []string{fmt.Sprintf("sql-%d", h%4), "chat"},
							Labels: map[string]string{"pool": fmt.Sprint(h % 3), "gpu": "l4", "zone": "eu-1", "app.kubernetes.io/name": "llm-worker"}}
						if err := parts.Registry.Register(ctx, sc.Cluster, sc.Host(h), reg, time.Hour); err != nil {
							b.Fatal(err)
						}
					}
				}
				queries := make([][]prefix.Hash, sc.Prompts)
				for p := range queries {
					queries[p] = sc.Hashes(p)
				}
				ans, err := parts.Router.Route(ctx, sc.Cluster, queries[0])
				if err != nil {
					b.Fatal(err)
				}
				if want := map[bool]int{false: 0, true: sc.Hosts}[registered]; len(ans.Pods) != want {
					b.Fatalf("%d pods in the answer, want %d", len(ans.Pods), want)
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					if _, err := parts.Router.Route(ctx, sc.Cluster, queries[i%len(queries)]); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
