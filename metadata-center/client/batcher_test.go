package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
)

func centerOn(t *testing.T, st store.Store) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(server.New(st, server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
	t.Cleanup(ts.Close)
	return ts
}

// batchCalls reads how many POST /v1/batch calls the center answered 200.
func batchCalls(t *testing.T, base string) int {
	t.Helper()
	resp, err := http.Get(base + api.PathMetrics)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`llmf_metadata_center_requests_total\{code="200",endpoint="/v1/batch",method="POST"\} (\d+)`).FindSubmatch(b)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(string(m[1]))
	return n
}

// TestBatcherLifecyclesAgainstMetadataCenter runs 400 request lifecycles
// (add, save, first token, done) from 8 goroutines through one Batcher
// into the real metadata center, on memory and on Redis. Every lease ends
// up deleted — a done that overtook its add would leave one behind — every
// save lands, and the updates travel in far fewer calls than one each.
func TestBatcherLifecyclesAgainstMetadataCenter(t *testing.T) {
	for _, st := range storetest.Stores() {
		t.Run(st.Name, func(t *testing.T) {
			ts := centerOn(t, st.New(t))
			c := newClient(t, ts.URL, "", time.Second)
			var failed, results atomic.Int64
			b := NewBatcher(c, BatcherOptions{
				Window: 2 * time.Millisecond,
				OnResult: func(ops []api.BatchOp, err error, _ time.Duration) {
					results.Add(1)
					if err != nil {
						failed.Add(int64(len(ops)))
						t.Errorf("batch of %d failed: %v", len(ops), err)
					}
				},
			})
			const cluster, workers, per = "outbound|8000||qwen", 8, 50
			hs := hashes("a shared system prompt that is long enough for several blocks")
			var wg sync.WaitGroup
			var acked atomic.Int64
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range per {
						id := fmt.Sprintf("w%d-r%d", w, i)
						host := fmt.Sprintf("10.0.0.%d:8000", 1+i%4)
						var sent chan struct{} // every tenth request: closed when its add has landed
						if i%10 == 0 {
							sent = make(chan struct{})
						}
						b.Add(api.BatchOp{Op: api.OpAddRequest, Cluster: cluster, Host: host, RequestID: id, PromptLength: 100},
							func(err error) {
								if err == nil {
									acked.Add(1)
								}
								if sent != nil {
									close(sent)
								}
							})
						b.Add(api.BatchOp{Op: api.OpCacheSave, Cluster: cluster, Host: host, Hashes: hs, ChunkSize: 16}, nil)
						b.Add(api.BatchOp{Op: api.OpFirstToken, Cluster: cluster, Host: host, RequestID: id}, nil)
						b.Add(api.BatchOp{Op: api.OpDone, Cluster: cluster, Host: host, RequestID: id}, nil)
						if sent != nil {
							// Arrivals spread over time: the worker goes on once
							// its add has left, so a request's updates fall into
							// different batches.
							select {
							case <-sent:
							case <-time.After(10 * time.Second):
								t.Errorf("worker %d: request %d's add not answered in 10s", w, i)
								return
							}
						}
					}
				}()
			}
			wg.Wait()
			b.Close(5 * time.Second)
			if failed.Load() != 0 {
				t.Fatalf("%d updates failed", failed.Load())
			}
			if acked.Load() != workers*per {
				t.Fatalf("%d adds acknowledged, want %d", acked.Load(), workers*per)
			}
			ans, err := c.Route(context.Background(), cluster, hs)
			if err != nil {
				t.Fatal(err)
			}
			if len(ans.Load) != 0 {
				t.Fatalf("leases left after every done: %v (an update overtook another)", ans.Load)
			}
			if len(ans.Cache) != 4 || ans.Cache[0].Length != len(hs) {
				t.Fatalf("cache = %v, want the 4 hosts holding %d blocks", ans.Cache, len(hs))
			}
			calls, updates := batchCalls(t, ts.URL), workers*per*4
			t.Logf("%d updates in %d batch calls (%.1f per call)", updates, calls, float64(updates)/float64(calls))
			if calls != int(results.Load()) || calls == 0 || calls > updates/4 {
				t.Fatalf("%d updates took %d calls (%d batches reported): batching did not coalesce", updates, calls, results.Load())
			}
		})
	}
}

// TestBatcherSaveLandingAfterAnEvictionStaysOut: a routing-time save that
// waits in the batcher while the pod serves the request and reports a
// later eviction of part of it is dated back to when it was queued, so
// landing last it does not bring the evicted blocks back; a save queued
// after the eviction lands as usual.
func TestBatcherSaveLandingAfterAnEvictionStaysOut(t *testing.T) {
	for _, st := range storetest.Stores() {
		t.Run(st.Name, func(t *testing.T) {
			ts := centerOn(t, st.New(t))
			c := newClient(t, ts.URL, "", time.Second)
			b := NewBatcher(c, BatcherOptions{Window: 300 * time.Millisecond})
			defer b.Close(5 * time.Second)
			const cluster, host = "outbound|8000||qwen", "10.0.0.1:8000"
			hs := hashes("a conversation long enough for several blocks of sixteen bytes each")
			ctx := context.Background()
			landed := make(chan error, 2)
			queued := time.Now().UnixMilli()
			b.Add(api.BatchOp{Op: api.OpCacheSave, Cluster: cluster, Host: host, Hashes: hs, ChunkSize: 16, SaveID: "r1"},
				func(err error) { landed <- err })
			// The pod evicts after the routing decision: 100 ms after the
			// save was queued, reported at once (the pod's clock may run
			// ahead of ours). The center dates the save by its age when the
			// batch left, so the time the batch spends in transit moves it
			// later; under -race on a busy machine that took more than 5 ms:
			// the margin is well inside the window.
			if err := c.EvictCache(ctx, api.CacheEvict{Cluster: cluster, Host: host, Hashes: hs[2:], ChunkSize: 16,
				EvictedAt: queued + 100}); err != nil {
				t.Fatal(err)
			}
			if err := <-landed; err != nil {
				t.Fatal(err)
			}
			if ans, err := c.Route(ctx, cluster, hs); err != nil || len(ans.Cache) != 1 || ans.Cache[0].Length != 2 {
				t.Fatalf("after the late save: cache %v (%v), want %s holding the 2 blocks it kept", ans.Cache, err, host)
			}
			// The first save left a window (300 ms) after it was queued, long
			// after the eviction's time: this one is made after the eviction.
			b.Add(api.BatchOp{Op: api.OpCacheSave, Cluster: cluster, Host: host, Hashes: hs, ChunkSize: 16, SaveID: "r2"},
				func(err error) { landed <- err })
			if err := <-landed; err != nil {
				t.Fatal(err)
			}
			if ans, err := c.Route(ctx, cluster, hs); err != nil || len(ans.Cache) != 1 || ans.Cache[0].Length != len(hs) {
				t.Fatalf("after a save made after the eviction: cache %v (%v), want %s holding all %d blocks", ans.Cache, err, host, len(hs))
			}
		})
	}
}

// fakeSender records batches and can be made to block.
type fakeSender struct {
	mu      sync.Mutex
	batches [][]api.BatchOp
	block   chan struct{}
	started chan struct{}
}

func (f *fakeSender) Batch(ctx context.Context, ops []api.BatchOp) error {
	f.mu.Lock()
	f.batches = append(f.batches, append([]api.BatchOp(nil), ops...))
	f.mu.Unlock()
	if f.started != nil {
		select {
		case f.started <- struct{}{}:
		default:
		}
	}
	if f.block != nil {
		select {
		case <-f.block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

func (f *fakeSender) sizes() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []int
	for _, b := range f.batches {
		out = append(out, len(b))
	}
	return out
}

func op(i int) api.BatchOp {
	return api.BatchOp{Op: api.OpDone, Cluster: "c", Host: "10.0.0.1:1", RequestID: strconv.Itoa(i)}
}

// TestBatcherWindowAndMaxOps: a lone update leaves after the window, not
// later; a full batch leaves at once, however long the window.
func TestBatcherWindowAndMaxOps(t *testing.T) {
	f := &fakeSender{}
	b := NewBatcher(f, BatcherOptions{Window: 20 * time.Millisecond})
	sent := make(chan error, 1)
	b.Add(op(0), func(err error) { sent <- err })
	select {
	case <-sent:
	case <-time.After(5 * time.Second):
		t.Fatal("a lone update was never sent")
	}
	b.Close(time.Second)

	f = &fakeSender{}
	b = NewBatcher(f, BatcherOptions{Window: time.Hour, MaxOps: 10})
	var wg sync.WaitGroup
	wg.Add(10)
	for i := range 25 {
		b.Add(op(i), func(error) {
			if i < 10 {
				wg.Done()
			}
		})
	}
	wg.Wait() // the first 10 left without waiting for the hour
	b.Close(5 * time.Second)
	if got := f.sizes(); len(got) != 3 || got[0] != 10 || got[1] != 10 || got[2] != 5 {
		t.Fatalf("batch sizes %v, want [10 10 5] (full batches at once, the rest on close)", got)
	}
	// Order is kept across batches.
	i := 0
	for _, bt := range f.batches {
		for _, o := range bt {
			if o.RequestID != strconv.Itoa(i) {
				t.Fatalf("op %d is %s", i, o.RequestID)
			}
			i++
		}
	}
}

// TestBatcherUrgent: an urgent update on an idle batcher leaves at once,
// however long the window, taking the updates queued before it along in
// order; one added less than a window after that batch waits for the window
// (or Close) with what follows it, so urgency never sends more than one
// batch per window.
func TestBatcherUrgent(t *testing.T) {
	f := &fakeSender{}
	b := NewBatcher(f, BatcherOptions{Window: time.Hour})
	sent := make(chan error, 1)
	b.Add(op(0), nil)
	b.AddUrgent(Update{Op: op(1), Done: func(err error) { sent <- err }})
	select {
	case err := <-sent:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("an urgent update waited for the hour-long window")
	}
	b.AddUrgent(Update{Op: op(2)})
	b.Add(op(3), nil)
	if p := b.Pending(); p != 2 {
		t.Fatalf("%d pending after the urgent batch, want 2 (held for the window)", p)
	}
	b.Close(5 * time.Second)
	if got := f.sizes(); len(got) != 2 || got[0] != 2 || got[1] != 2 {
		t.Fatalf("batch sizes %v, want [2 2]: the first urgent batch at once with the update before it, the second on close", got)
	}
	i := 0
	for _, bt := range f.batches {
		for _, o := range bt {
			if o.RequestID != strconv.Itoa(i) {
				t.Fatalf("op %d is %s", i, o.RequestID)
			}
			i++
		}
	}
}

// TestBatcherDropsWhenFullAndClosesBounded: with the sender stuck, Add
// never blocks, refuses past the queue size and counts it; Close gives up
// after its bound and fails what is left with context.Canceled.
func TestBatcherDropsWhenFullAndClosesBounded(t *testing.T) {
	f := &fakeSender{block: make(chan struct{}), started: make(chan struct{}, 1)}
	var dropped atomic.Int64
	var mu sync.Mutex
	var outcomes []error
	b := NewBatcher(f, BatcherOptions{Window: time.Millisecond, QueueSize: 5, Timeout: time.Minute,
		OnDrop: func(api.BatchOp) { dropped.Add(1) }})
	record := func(err error) {
		mu.Lock()
		outcomes = append(outcomes, err)
		mu.Unlock()
	}
	b.Add(op(0), record)
	<-f.started // the sender is stuck on the first batch
	start := time.Now()
	queued := 0
	for i := 1; i <= 20; i++ {
		if b.Add(op(i), record) {
			queued++
		}
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Add blocked for %v", d)
	}
	if queued != 5 || dropped.Load() != 15 || b.Pending() != 6 {
		t.Fatalf("queued %d dropped %d pending %d, want 5, 15, 6", queued, dropped.Load(), b.Pending())
	}
	start = time.Now()
	b.Close(50 * time.Millisecond)
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("Close took %v with a 50ms bound", d)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(outcomes) != 6 {
		t.Fatalf("%d outcomes, want 6", len(outcomes))
	}
	for _, err := range outcomes {
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("outcome %v, want context.Canceled", err)
		}
	}
	if b.Add(op(99), nil) || dropped.Load() != 16 {
		t.Fatal("closed batcher accepted an update")
	}
	b.Close(time.Second) // idempotent
}

// TestBatchFallsBackToSingleCalls: a metadata center without /v1/batch
// (an older version during a rolling upgrade) still gets every update.
func TestBatchFallsBackToSingleCalls(t *testing.T) {
	real := startCenter(t, "")
	mux := http.NewServeMux()
	mux.Handle(api.PathBatch, http.NotFoundHandler())
	mux.Handle("/", httpProxy(real.URL))
	old := httptest.NewServer(mux)
	defer old.Close()
	c := newClient(t, old.URL, "", time.Second)
	ctx := context.Background()
	const cl, h = "c", "10.0.0.1:8000"
	for range 2 { // the second time without trying /v1/batch
		if err := c.Batch(ctx, []api.BatchOp{
			{Op: api.OpAddRequest, Cluster: cl, Host: h, RequestID: "a", PromptLength: 3},
			{Op: api.OpAddRequest, Cluster: cl, Host: h, RequestID: "b", PromptLength: 4},
			{Op: api.OpFirstToken, Cluster: cl, Host: h, RequestID: "b"},
			{Op: api.OpDone, Cluster: cl, Host: h, RequestID: "a"},
			{Op: api.OpCacheSave, Cluster: cl, Host: h, Hashes: hashes("some prompt text")},
		}); err != nil {
			t.Fatal(err)
		}
	}
	ans, err := c.Route(ctx, cl, hashes("some prompt text"))
	if err != nil {
		t.Fatal(err)
	}
	if ans.Load[h] != (api.EndpointStats{TotalReqs: 1, PromptLength: 0}) || len(ans.Cache) != 1 {
		t.Fatalf("after fallback: %+v", ans)
	}
	if !c.noBatch.Load() {
		t.Fatal("client did not remember the missing endpoint")
	}
}

// httpProxy forwards to base (the real center behind an "old" facade).
func httpProxy(base string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, _ := http.NewRequestWithContext(r.Context(), r.Method, base+r.URL.RequestURI(), r.Body)
		req.Header = r.Header.Clone()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		maps.Copy(w.Header(), resp.Header)
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	})
}
