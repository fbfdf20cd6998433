package server_test

import (
	"context"
	"io"
	"log/slog"
	"net/http/httptest"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/internal/routeload"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// BenchmarkRouteQuery measures the route query of routeload.Default (64
// hosts, 64-block prompts) on both stores, in one run so the figures are
// comparable: "store" calls the store's Router directly; "http" goes through the
// real handler over loopback with 64 concurrent clients and reports
// req/s and p50/p99 latency next to ns/op.
func BenchmarkRouteQuery(b *testing.B) {
	benchRoute(b, routeload.Default(), true)
}

// BenchmarkRouteQueryNoSharedPrefix is the same index without the common
// system prompt: each query starts with 4 candidate hosts instead of 64,
// which shows how much of the cost is the shared prefix.
func BenchmarkRouteQueryNoSharedPrefix(b *testing.B) {
	sc := routeload.Default()
	sc.SharedBlocks = 0
	benchRoute(b, sc, false)
}

// BenchmarkRouteQueryWithSignals is BenchmarkRouteQuery's store part with
// every host's fresh pod signals in the answer too.
func BenchmarkRouteQueryWithSignals(b *testing.B) {
	benchRoute(b, routeload.Default(), false, true)
}

func benchRoute(b *testing.B, sc routeload.Scenario, withHTTP bool, withSignals ...bool) {
	for _, s := range storetest.Stores() {
		b.Run(s.Name+"/store", func(b *testing.B) {
			st := s.New(b).Parts()
			if err := sc.Populate(context.Background(), st); err != nil {
				b.Fatal(err)
			}
			if len(withSignals) > 0 && withSignals[0] {
				// Reports older than the max age are left out: keep them
				// fresh while the benchmark runs.
				report := func() {
					for h := range sc.Hosts {
						if err := st.Signals.ReportSignals(context.Background(), sc.Cluster, sc.Host(h), api.PodSignals{Waiting: int64(h % 3), Running: int64(h % 8), KVCacheUtil: float64(h%10) / 10}); err != nil {
							b.Fatal(err)
						}
					}
				}
				report()
				stop := make(chan struct{})
				go func() {
					t := time.NewTicker(200 * time.Millisecond)
					defer t.Stop()
					for {
						select {
						case <-t.C:
							report()
						case <-stop:
							return
						}
					}
				}()
				b.Cleanup(func() { close(stop) })
				if ans, err := st.Router.Route(context.Background(), sc.Cluster, sc.Hashes(0)); err != nil || len(ans.Signals) != sc.Hosts {
					b.Fatalf("signals in the route answer: %d of %d, %v", len(ans.Signals), sc.Hosts, err)
				}
			}
			queries := make([][]prefix.Hash, sc.Prompts)
			for p := range queries {
				queries[p] = sc.Hashes(p)
			}
			ans, err := st.Router.Route(context.Background(), sc.Cluster, queries[0])
			if err != nil {
				b.Fatal(err)
			}
			if err := sc.Check(0, ans); err != nil {
				b.Fatal(err)
			}
			var n atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := cpuTime()
			b.Cleanup(func() {
				// Includes redis-server's work only indirectly (it is another
				// process): for Redis this is the client side alone.
				b.ReportMetric(float64((cpuTime()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
			})
			b.RunParallel(func(pb *testing.PB) {
				ctx := context.Background()
				for pb.Next() {
					p := int(n.Add(1)) % len(queries)
					if _, err := st.Router.Route(ctx, sc.Cluster, queries[p]); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
		if !withHTTP {
			continue
		}
		b.Run(s.Name+"/http", func(b *testing.B) {
			st := s.New(b)
			ts := httptest.NewServer(server.New(st, server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
			defer ts.Close()
			const conc = 64
			cl := routeload.NewClient(ts.URL, "", conc)
			if err := sc.PopulateHTTP(context.Background(), cl); err != nil {
				b.Fatal(err)
			}
			bodies := sc.Bodies()
			var ans api.RouteAnswer
			if err := cl.Do(context.Background(), "POST", api.PathRouteQuery, bodies[0], &ans); err != nil {
				b.Fatal(err)
			}
			if err := sc.Check(0, ans); err != nil {
				b.Fatal(err)
			}
			var (
				n   atomic.Int64
				mu  sync.Mutex
				all []time.Duration
			)
			b.SetParallelism((conc + 1) / max(1, runtime.GOMAXPROCS(0)))
			b.ResetTimer()
			start := time.Now()
			cpu0 := cpuTime()
			b.RunParallel(func(pb *testing.PB) {
				cn, err := routeload.NewConn(ts.URL, "")
				if err != nil {
					b.Error(err)
					return
				}
				defer cn.Close()
				lat := make([]time.Duration, 0, 256)
				for pb.Next() {
					p := int(n.Add(1)) % len(bodies)
					t0 := time.Now()
					if err := cn.Post(api.PathRouteQuery, bodies[p], nil); err != nil {
						b.Error(err)
						return
					}
					lat = append(lat, time.Since(t0))
				}
				mu.Lock()
				all = append(all, lat...)
				mu.Unlock()
			})
			el := time.Since(start)
			cpu := cpuTime() - cpu0
			b.StopTimer()
			slices.Sort(all)
			if len(all) > 0 {
				b.ReportMetric(float64(len(all))/el.Seconds(), "req/s")
				b.ReportMetric(float64(all[len(all)/2].Microseconds()), "p50-µs")
				b.ReportMetric(float64(all[(len(all)-1)*99/100].Microseconds()), "p99-µs")
				// CPU of the whole process (server and client) per request:
				// unlike wall-clock figures it does not depend on what else
				// the shared machine is running.
				b.ReportMetric(float64(cpu.Microseconds())/float64(len(all)), "cpu-µs/req")
			}
		})
	}
}

// cpuTime is the user+system CPU the process has used so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
