package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// startCenter runs the real metadata center (in-memory store) on loopback.
func startCenter(t *testing.T, token string) *httptest.Server {
	t.Helper()
	srv := server.New(memstore.New(memstore.Options{}), server.Options{
		AuthToken: token,
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	return ts
}

func newClient(t *testing.T, addr, token string, query time.Duration) *Client {
	t.Helper()
	c, err := New(Options{Address: addr, QueryTimeout: query, UpdateTimeout: time.Second, AuthToken: token})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func hashes(text string) []string {
	return prefix.Wire(prefix.Hasher{ChunkSize: 16}.Sum("m", prefix.CanonicalCompletion(text)))
}

func TestLifecycleAgainstMetadataCenter(t *testing.T) {
	ts := startCenter(t, "s3cret")
	c := newClient(t, ts.URL, "s3cret", time.Second)
	ctx := context.Background()
	const cluster, a, b = "outbound|8000||qwen", "10.0.0.1:8000", "10.0.0.2:8000"
	long := hashes("the quick brown fox jumps over the lazy dog, twice over")
	if len(long) < 3 {
		t.Fatalf("want several blocks, got %d", len(long))
	}

	if err := c.AddRequest(ctx, api.AddRequest{Cluster: cluster, Host: a, RequestID: "r1", PromptLength: 400}); err != nil {
		t.Fatal(err)
	}
	if err := c.AddRequest(ctx, api.AddRequest{Cluster: cluster, Host: a, RequestID: "r2", PromptLength: 100}); err != nil {
		t.Fatal(err)
	}
	if err := c.SaveCache(ctx, api.CacheSave{Cluster: cluster, Host: b, Hashes: long[:2]}); err != nil {
		t.Fatal(err)
	}
	ans, err := c.Route(ctx, cluster, long)
	if err != nil {
		t.Fatal(err)
	}
	if st := ans.Load[a]; st.TotalReqs != 2 || st.PromptLength != 500 {
		t.Fatalf("load of a = %+v (answer %+v)", st, ans)
	}
	if len(ans.Cache) != 1 || ans.Cache[0].Host != b || ans.Cache[0].Length != 2 {
		t.Fatalf("cache = %+v", ans.Cache)
	}

	if err := c.FirstToken(ctx, api.RequestRef{Cluster: cluster, Host: a, RequestID: "r1"}); err != nil {
		t.Fatal(err)
	}
	ans, _ = c.Route(ctx, cluster, long)
	if st := ans.Load[a]; st.TotalReqs != 2 || st.PromptLength != 100 {
		t.Fatalf("after first token: %+v", st)
	}
	for _, id := range []string{"r1", "r2", "r2"} { // deletes are idempotent
		if err := c.DeleteRequest(ctx, api.RequestRef{Cluster: cluster, Host: a, RequestID: id}); err != nil {
			t.Fatal(err)
		}
	}
	ans, _ = c.Route(ctx, cluster, nil) // no hashes: load only
	if st := ans.Load[a]; st.TotalReqs != 0 {
		t.Fatalf("after done: %+v", ans.Load)
	}
}

func TestErrorsAreTyped(t *testing.T) {
	ts := startCenter(t, "s3cret")
	ctx := context.Background()

	_, err := newClient(t, ts.URL, "wrong", time.Second).Route(ctx, "c", nil)
	var se *StatusError
	if !errors.As(err, &se) || se.Status != 401 || se.Body.Error.Type != "unauthorized" {
		t.Fatalf("bad token: %v", err)
	}
	c := newClient(t, ts.URL, "s3cret", time.Second)
	// The trace id travels as X-Request-Id: the center's error names it.
	err = c.AddRequest(WithTraceID(ctx, "trace-42"), api.AddRequest{Cluster: "c", Host: "not-an-ip", RequestID: "x"})
	if !errors.As(err, &se) || se.Status != 400 || se.Body.Error.Message == "" || !Permanent(err) {
		t.Fatalf("bad host: %v", err)
	}
	if se.Body.TraceID != "trace-42" {
		t.Fatalf("error answer trace_id = %q, want the caller's", se.Body.TraceID)
	}
	// Nothing listening.
	dead := httptest.NewServer(http.NotFoundHandler())
	addr := dead.URL
	dead.Close()
	if _, err := newClient(t, addr, "", time.Second).Route(ctx, "c", nil); err == nil || Permanent(err) {
		t.Fatalf("dead center: %v (a transport error is worth retrying)", err)
	}
	if _, err := New(Options{}); err == nil {
		t.Fatal("empty address accepted")
	}
}

func TestRouteTimeout(t *testing.T) {
	release := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer slow.Close()
	defer close(release)
	c := newClient(t, slow.URL, "", 50*time.Millisecond)
	start := time.Now()
	_, err := c.Route(context.Background(), "c", nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
	// Generous: the point is that it does not wait for the server.
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("took %v", took)
	}
}

func TestDispatcherKeepsPerKeyOrder(t *testing.T) {
	var mu sync.Mutex
	got := map[string][]int{}
	d := NewDispatcher(DispatcherOptions{Workers: 4, QueueSize: 4096})
	for i := range 100 {
		for k := range 10 {
			key := fmt.Sprint("req", k)
			d.Dispatch(Task{Name: "t", Key: key, Run: func(context.Context) error {
				mu.Lock()
				got[key] = append(got[key], i)
				mu.Unlock()
				return nil
			}})
		}
	}
	d.Close(5 * time.Second)
	for k, seq := range got {
		if len(seq) != 100 {
			t.Fatalf("%s ran %d tasks", k, len(seq))
		}
		for i, v := range seq {
			if v != i {
				t.Fatalf("%s out of order: %v", k, seq)
			}
		}
	}
}

func TestDispatcherDropsWhenFullNeverBlocks(t *testing.T) {
	block := make(chan struct{})
	var dropped, failed atomic.Int64
	d := NewDispatcher(DispatcherOptions{
		Workers: 1, QueueSize: 2, Timeout: time.Second,
		OnDrop:   func(Task) { dropped.Add(1) },
		OnResult: func(_ Task, err error, _ time.Duration) { failed.Add(b2i(err != nil)) },
	})
	running := make(chan struct{})
	d.Dispatch(Task{Key: "a", Run: func(ctx context.Context) error {
		close(running)
		<-block
		return nil
	}})
	<-running // the worker is busy; the queue holds 2
	okCount := 0
	for range 10 {
		if d.Dispatch(Task{Key: "a", Run: func(context.Context) error { return errors.New("boom") }}) {
			okCount++
		}
	}
	if okCount != 2 || dropped.Load() != 8 {
		t.Fatalf("queued %d dropped %d, want 2 and 8", okCount, dropped.Load())
	}
	close(block)
	d.Close(5 * time.Second)
	if failed.Load() != 2 {
		t.Fatalf("failed results %d", failed.Load())
	}
	if d.Dispatch(Task{Key: "late", Run: func(context.Context) error { return nil }}) || dropped.Load() != 9 {
		t.Fatal("closed dispatcher accepted a task")
	}
	d.Close(time.Second) // idempotent
}

func TestDispatcherTaskTimeoutAndBoundedClose(t *testing.T) {
	var errs []error
	var mu sync.Mutex
	d := NewDispatcher(DispatcherOptions{Workers: 1, QueueSize: 10, Timeout: 30 * time.Millisecond})
	for range 3 {
		d.Dispatch(Task{Key: "k",
			Run: func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() },
			Done: func(err error) {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}})
	}
	// Each task gets its own 30ms; a 10ms drain bound cancels the rest.
	d.Close(10 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if len(errs) != 3 {
		t.Fatalf("%d outcomes", len(errs))
	}
	for _, err := range errs {
		if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("outcome %v", err)
		}
	}
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// Route asks for the compact answer and reads it; against a metadata
// center that predates it (which ignores the Accept header) it reads the
// JSON answer. Both give the same RouteAnswer.
func TestRouteCompactAndOlderCenter(t *testing.T) {
	srv := server.New(memstore.New(memstore.Options{}), server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	var mu sync.Mutex
	var served []string // Content-Type of each route answer
	record := func(older bool) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if older {
				r.Header.Del("Accept")
			}
			srv.Handler().ServeHTTP(w, r)
			if r.URL.Path == api.PathRouteQuery {
				mu.Lock()
				served = append(served, w.Header().Get("Content-Type"))
				mu.Unlock()
			}
		})
	}
	current, older := httptest.NewServer(record(false)), httptest.NewServer(record(true))
	defer current.Close()
	defer older.Close()
	ctx := context.Background()
	const cluster = "outbound|8000||qwen"
	c := newClient(t, current.URL, "", time.Second)
	long := hashes("the quick brown fox jumps over the lazy dog, twice over")
	for i := range 5 {
		host := fmt.Sprintf("10.0.0.%d:8000", i+1)
		if i < 4 { // one host has a cache entry and no load
			if err := c.AddRequest(ctx, api.AddRequest{Cluster: cluster, Host: host, RequestID: "r", PromptLength: int64(100 * i)}); err != nil {
				t.Fatal(err)
			}
		}
		if i > 1 {
			if err := c.SaveCache(ctx, api.CacheSave{Cluster: cluster, Host: host, Hashes: long[:i-1]}); err != nil {
				t.Fatal(err)
			}
		}
	}
	got, err := c.Route(ctx, cluster, long)
	if err != nil {
		t.Fatal(err)
	}
	want, err := newClient(t, older.URL, "", time.Second).Route(ctx, cluster, long)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(served) != "["+api.MediaRouteCompact+" application/json]" {
		t.Fatalf("answers served as %v, want compact then JSON", served)
	}
	if len(want.Load) != 4 || len(want.Cache) != 3 || want.Cache[0].Length != 3 {
		t.Fatalf("JSON answer %+v: not the state saved", want)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("compact answer %+v, JSON answer %+v", got, want)
	}
}
