package lifecycle

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
)

// The metadata center's gin would print its routes for every center a
// test starts.
func init() { gin.SetMode(gin.ReleaseMode) }

// mcCalls reads the metadata center's answered calls by endpoint.
func mcCalls(t testing.TB, base string) map[string]int {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	out := map[string]int{}
	re := regexp.MustCompile(`llmf_metadata_center_requests_total\{code="(\d+)",endpoint="([^"]+)",method="(\w+)"\} (\d+)`)
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		n, _ := strconv.Atoi(m[4])
		out[m[3]+" "+m[2]] += n
	}
	return out
}

// lifecycle runs one request's whole life through the gateway: decide
// (the route query), started, first token and saved, done.
func lifecycle(t testing.TB, e gateway, system, user string) {
	d, err := e.Decide(context.Background(), chatPath(), chatBody(system, user))
	if err != nil {
		t.Error(err)
		return
	}
	e.Started(d)
	e.FirstToken(d)
	e.Saved(d)
	e.Done(d)
}

// served runs one request's life as a pod serving it would pace it: its
// first token after hold/4 of prefill, its end after hold more of
// decoding; done is called once the request is over.
func served(t testing.TB, e gateway, system, user string, hold time.Duration, done func()) {
	d, err := e.Decide(context.Background(), chatPath(), chatBody(system, user))
	if err != nil {
		t.Error(err)
		done()
		return
	}
	e.Started(d)
	time.AfterFunc(hold/4, func() {
		e.FirstToken(d)
		e.Saved(d)
		time.AfterFunc(hold, func() {
			e.Done(d)
			done()
		})
	})
}

// TestBatchedUpdates: with async.batch_window (the default), a request's
// four or five updates reach the real metadata center through /v1/batch,
// never as single calls, in order (no lease is left behind), with far
// fewer calls than updates.
func TestBatchedUpdates(t *testing.T) {
	for _, tc := range []struct {
		name, extra string
		batched     bool
	}{
		// A generous drain: under -race on a loaded machine the unbatched
		// case's thousand calls may still be queued when Close begins, and
		// what a drain gives up on is dropped (a lease left to its TTL).
		{"batched", "async: {drain_timeout: 30s}", true},
		{"unbatched", "async: {batch_window: 0s, drain_timeout: 30s}", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts := center(t)
			m := &counts{}
			e := newGateway(t, configFor(t, ts.URL, tc.extra), routing.Options{Metrics: m}, nil)
			system := strings.Repeat("You are a careful assistant who answers in French. ", 8)
			const workers, per = 8, 25
			var wg sync.WaitGroup
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range per {
						lifecycle(t, e, system, fmt.Sprintf("question %d/%d", w, i))
					}
				}()
			}
			wg.Wait()
			e.Close()
			calls := mcCalls(t, ts.URL)
			mc, _ := client.New(client.Options{Address: ts.URL, QueryTimeout: 2 * time.Second})
			ans, err := mc.Route(context.Background(), cluster, nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(ans.Load) != 0 {
				t.Fatalf("leases left after every request finished: %v (gateway counts %v)", ans.Load, m)
			}
			reqs := workers * per
			singles := calls["POST /v1/load/stats"] + calls["DELETE /v1/load/stats"] + calls["DELETE /v1/load/stats/prompt"] + calls["POST /v1/cache/save"]
			t.Logf("%d requests: %v", reqs, calls)
			if calls["POST /v1/route/query"] != reqs {
				t.Fatalf("%d route queries for %d requests", calls["POST /v1/route/query"], reqs)
			}
			if tc.batched {
				if singles != 0 || calls["POST /v1/batch"] == 0 || calls["POST /v1/batch"] >= reqs {
					t.Fatalf("batched: %d single update calls and %d batches for %d requests", singles, calls["POST /v1/batch"], reqs)
				}
				if m.Get("async_batches") != int64(calls["POST /v1/batch"]) {
					t.Fatalf("reporter counted %d batches, center answered %d", m.Get("async_batches"), calls["POST /v1/batch"])
				}
			} else if calls["POST /v1/batch"] != 0 || singles < 4*reqs {
				t.Fatalf("unbatched: %d batches and %d single calls for %d requests", calls["POST /v1/batch"], singles, reqs)
			}
			if m.Get("async_errors") != 0 || m.Get("async_dropped") != 0 {
				t.Fatalf("metrics %v", m)
			}
		})
	}
}

// BenchmarkCallsPerRequest measures metadata-center calls per request
// (route queries plus update calls, counted by the real metadata center on
// loopback) with requests arriving at a steady rate and each holding its
// pod for 50ms, with batching on (the default) and off, and with batching
// on and every prompt new (each request's lease and save are urgent).
//
//	go test -run '^$' -bench CallsPerRequest -benchtime 2000x ./filter/lifecycle/
func BenchmarkCallsPerRequest(b *testing.B) {
	for _, rate := range []int{200, 1000} {
		for _, tc := range []struct {
			name, extra string
			cold        bool
		}{{"batched", "", false}, {"unbatched", "async: {batch_window: 0s}", false}, {"batched-cold", "", true}} {
			b.Run(fmt.Sprintf("%s/%dreq_s", tc.name, rate), func(b *testing.B) {
				ts := center(b)
				e := newGateway(b, configFor(b, ts.URL, tc.extra), routing.Options{}, nil)
				system := strings.Repeat("You are a careful assistant who answers in French. ", 8)
				var wg sync.WaitGroup
				arrivals := time.NewTicker(time.Second / time.Duration(rate))
				defer arrivals.Stop()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					<-arrivals.C
					wg.Add(1)
					go func() {
						sys := system
						if tc.cold {
							// A prompt nobody sent before: its lease and
							// save are urgent (placesPrefix).
							sys = fmt.Sprintf("%d %s", i, system)
						}
						served(b, e, sys, fmt.Sprintf("question %d", i%50), 50*time.Millisecond, wg.Done)
					}()
				}
				wg.Wait()
				e.Close()
				b.StopTimer()
				calls := mcCalls(b, ts.URL)
				total := 0
				for k, n := range calls {
					if k != "GET /metrics" {
						total += n
					}
				}
				b.ReportMetric(float64(total)/float64(b.N), "mc_calls/req")
				b.ReportMetric(float64(calls["POST /v1/batch"])/float64(b.N), "batches/req")
			})
		}
	}
}
