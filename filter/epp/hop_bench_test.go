package epp_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/envoyrun"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"
)

// BenchmarkExtProcHop measures what the picker adds to a request: the
// same chat request at concurrency 8 through the real Envoy straight to a
// pod (envoy-direct), and through Envoy with our endpoint picker deciding
// each request with the metadata center (envoy-epp; envoy-epp-duplex with
// both bodies FULL_DUPLEX_STREAMED). The pods answer at
// once, so the difference is the ext_proc hop with its decision. Reported:
// p50 and p99 latency of each, in ms, at concurrency 8 (the aim: the hop
// adds at most 1 ms p50 and 3 ms p99) and 1 (the hop alone, no queueing).
//
//	LLMF_TEST_ENVOY=... go test -run '^$' -bench ExtProcHop -benchtime 4000x ./filter/epp/
func BenchmarkExtProcHop(b *testing.B) {
	bin := envoyBinary(b)
	pods := startPods(b, 4)
	mc := routingtest.Center(b)
	eppAddr := startEPP(b, fleetFile(mc.URL, addrs(pods)), false)
	for _, topo := range []struct {
		name string
		o    envoyrun.Options
	}{
		{"envoy-direct", envoyrun.Options{Binary: bin, Direct: addrs(pods)}},
		{"envoy-epp", envoyrun.Options{Binary: bin, EPP: eppAddr}},
		{"envoy-epp-duplex", envoyrun.Options{Binary: bin, EPP: eppAddr, Duplex: true}},
	} {
		b.Run(topo.name, func(b *testing.B) {
			e, err := envoyrun.Start(context.Background(), topo.o)
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			url := e.URL() + "/v1/chat/completions"
			body := chat(false, strings.Repeat("a system prompt shared by many requests. ", 40), "and a question")
			hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
			do := func() time.Duration {
				t0 := time.Now()
				resp, err := hc.Post(url, "application/json", strings.NewReader(body))
				if err != nil {
					b.Error(err)
					return 0
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Errorf("status %d", resp.StatusCode)
				}
				return time.Since(t0)
			}
			for range 200 { // warm connections and caches
				do()
			}
			for _, conc := range []int{8, 1} {
				b.Run(fmt.Sprintf("c%d", conc), func(b *testing.B) { measure(b, conc, do) })
			}
		})
	}
}

// measure runs b.N calls of do, conc at a time, and reports their p50
// and p99 in ms.
func measure(b *testing.B, conc int, do func() time.Duration) {
	lat := make([]time.Duration, b.N)
	var next sync.Mutex
	i := 0
	var wg sync.WaitGroup
	b.ResetTimer()
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				next.Lock()
				k := i
				i++
				next.Unlock()
				if k >= b.N {
					return
				}
				lat[k] = do()
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	slices.Sort(lat)
	q := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / 1e6 }
	b.ReportMetric(q(0.50), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
}
