package mcreport

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

type center struct {
	mu       sync.Mutex
	bodies   []api.CacheEvict
	failures int // answer 503 this many times first
	auth     []string
}

func (c *center) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != api.PathCacheEvict {
		http.Error(w, "wrong call", http.StatusNotFound)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.auth = append(c.auth, r.Header.Get("Authorization"))
	if c.failures > 0 {
		c.failures--
		http.Error(w, "unavailable", http.StatusServiceUnavailable)
		return
	}
	var b api.CacheEvict
	if err := json.NewDecoder(r.Body).Decode(&b); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	c.bodies = append(c.bodies, b)
	w.WriteHeader(http.StatusNoContent)
}

func (c *center) got() []api.CacheEvict {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.bodies)
}

func start(t *testing.T, c *center, cfg Config) *Reporter {
	t.Helper()
	srv := httptest.NewServer(c)
	t.Cleanup(srv.Close)
	cfg.URL, cfg.Cluster, cfg.Host = srv.URL+"/", "outbound|8000||tiny", "10.0.0.7:9001"
	cfg.MaxBackoff = 20 * time.Millisecond
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

func flush(t *testing.T, r *Reporter) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Flush(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestEvictAllFirstThenHashesInWireForm(t *testing.T) {
	c := &center{}
	r := start(t, c, Config{AuthToken: "s3cret"})
	r.Evict([]prefix.Hash{0xabc, 1, 0xabc})
	flush(t, r)
	got := c.got()
	if len(got) < 2 || !got[0].All || got[0].Host != "10.0.0.7:9001" || got[0].Cluster != "outbound|8000||tiny" || len(got[0].Hashes) != 0 {
		t.Fatalf("first call %+v, want {all:true} for this host", got)
	}
	var hs []string
	for _, b := range got[1:] {
		if b.All {
			t.Fatal("all:true sent twice")
		}
		hs = append(hs, b.Hashes...)
	}
	slices.Sort(hs)
	want := prefix.Wire([]prefix.Hash{1, 0xabc})
	slices.Sort(want)
	if !slices.Equal(hs, want) || hs[0] != "0000000000000001" {
		t.Fatalf("hashes %v, want %v (deduplicated, 16 hex digits)", hs, want)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, a := range c.auth {
		if a != "Bearer s3cret" {
			t.Fatalf("authorization %q", a)
		}
	}
}

func TestRetriesWhileTheCenterIsDown(t *testing.T) {
	c := &center{failures: 3}
	r := start(t, c, Config{})
	r.Evict([]prefix.Hash{7})
	flush(t, r)
	got := c.got()
	if len(got) != 2 || !got[0].All || !slices.Equal(got[1].Hashes, prefix.Wire([]prefix.Hash{7})) {
		t.Fatalf("after 3 failures: %+v", got)
	}
}

func TestBatchesAreBoundedAndPendingIsBounded(t *testing.T) {
	c := &center{}
	r := start(t, c, Config{MaxPending: api.MaxHashes + 10})
	hs := make([]prefix.Hash, api.MaxHashes+50)
	for i := range hs {
		hs[i] = prefix.Hash(i + 1)
	}
	r.Evict(hs)
	flush(t, r)
	total := 0
	for _, b := range c.got()[1:] {
		if len(b.Hashes) > api.MaxHashes {
			t.Fatalf("a call carried %d hashes, the API allows %d", len(b.Hashes), api.MaxHashes)
		}
		total += len(b.Hashes)
	}
	if total != api.MaxHashes+10 || r.Pending() != 0 {
		t.Fatalf("sent %d hashes, want the %d that fit the pending set", total, api.MaxHashes+10)
	}
}

func TestNewValidates(t *testing.T) {
	for _, cfg := range []Config{{}, {URL: "127.0.0.1:8080", Cluster: "c", Host: "h:1"}, {URL: "http://x", Host: "h:1"}} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) accepted", cfg)
		}
	}
}

// A worker whose chunk size differs from the gateways' makes hashes that name
// no indexed prefix: the real metadata center refuses its reports (409, not
// retried), while a worker with the gateways' size evicts for real.
func TestChunkSizeMismatchIsRefused(t *testing.T) {
	reg := prometheus.NewRegistry()
	srv := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registry: reg}).Handler())
	t.Cleanup(srv.Close)
	const cluster, host = "outbound|8000||tiny", "10.0.0.7:9001"
	mc, err := client.New(client.Options{Address: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	hs := prefix.Wire([]prefix.Hash{11, 12})
	if err := mc.SaveCache(ctx, api.CacheSave{Cluster: cluster, Host: host, Hashes: hs, ChunkSize: 512}); err != nil {
		t.Fatal(err)
	}
	held := func() int { return heldLength(t, mc, cluster, host, hs) }

	err = mc.EvictCache(ctx, api.CacheEvict{Cluster: cluster, Host: host, Hashes: hs[1:], ChunkSize: 256})
	var se *client.StatusError
	if !errors.As(err, &se) || se.Status != http.StatusConflict || se.Body.Error.Type != "chunk_size_mismatch" || !client.Permanent(err) {
		t.Fatalf("evict with chunk size 256 against gateways' 512: %v", err)
	}
	if !strings.Contains(se.Body.Error.Message, "--prompt-hash-chunk-size to 512") {
		t.Fatalf("the error does not say how to fix it: %q", se.Body.Error.Message)
	}

	// Through the reporter: refused, counted, dropped (not retried forever).
	wrong, err := New(Config{URL: srv.URL, Cluster: cluster, Host: "10.0.0.8:9001", ChunkSize: 256,
		MaxBackoff: 20 * time.Millisecond, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	go wrong.Run(rctx)
	wrong.Evict([]prefix.Hash{12})
	fctx, fcancel := context.WithTimeout(ctx, 5*time.Second)
	defer fcancel()
	if err := wrong.Flush(fctx); err != nil {
		t.Fatalf("refused report still pending: %v", err)
	}
	if got := counterValue(t, wrong.sent.WithLabelValues("rejected")); got != 1 {
		t.Fatalf("rejected reports = %v, want 1", got)
	}
	if n := held(); n != 2 {
		t.Fatalf("after refused reports the host holds %d blocks, want 2", n)
	}

	right, err := New(Config{URL: srv.URL, Cluster: cluster, Host: host, ChunkSize: 512,
		MaxBackoff: 20 * time.Millisecond, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	go right.Run(rctx)
	right.Evict([]prefix.Hash{12})
	if err := right.Flush(fctx); err != nil {
		t.Fatal(err)
	}
	// The start-up evict-all of this host ran first, then the report: the
	// host holds nothing now.
	if n := held(); n != 0 {
		t.Fatalf("after a matching report the host holds %d blocks, want 0", n)
	}
	if got := counterValue(t, right.sent.WithLabelValues("ok")); got < 2 {
		t.Fatalf("ok reports = %v, want the evict-all and the eviction", got)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// A prefix the worker caches again while its eviction report waits for a
// metadata center that is down supersedes the report, and so does a save
// the gateway made after the eviction (the report carries the eviction's
// time, evicted_at): after the outage both index entries survive, while a
// prefix saved before its eviction and not since is removed. On both stores
// (Redis: a real redis-server).
func TestCachedAgainSupersedesAPendingEviction(t *testing.T) {
	stores := map[string]func(t *testing.T) store.Store{
		"memory": func(t *testing.T) store.Store { return memstore.New(memstore.Options{}) },
		"redis": func(t *testing.T) store.Store {
			srv := redistest.Shared(t)
			st, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: srv.Prefix + "-mcreport"})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = st.Close() })
			return st
		},
	}
	for name, mk := range stores {
		t.Run(name, func(t *testing.T) { testSupersede(t, mk(t)) })
	}
}

func testSupersede(t *testing.T, st store.Store) {
	real := httptest.NewServer(server.New(st, server.Options{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registry: prometheus.NewRegistry()}).Handler())
	t.Cleanup(real.Close)
	var down sync.Mutex // held while the worker cannot reach the center
	refused := make(chan struct{}, 100)
	gate := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !down.TryLock() {
			select {
			case refused <- struct{}{}:
			default:
			}
			http.Error(w, "unavailable", http.StatusServiceUnavailable)
			return
		}
		down.Unlock()
		req, _ := http.NewRequestWithContext(r.Context(), r.Method, real.URL+r.URL.Path, r.Body)
		req.Header = r.Header.Clone()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
	}))
	t.Cleanup(gate.Close)
	const cluster, host = "outbound|8000||tiny", "10.0.0.7:9001"
	mc, err := client.New(client.Options{Address: real.URL})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r, err := New(Config{URL: gate.URL, Cluster: cluster, Host: host, ChunkSize: 512,
		MaxBackoff: 20 * time.Millisecond, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	go r.Run(rctx)
	fctx, fcancel := context.WithTimeout(ctx, 5*time.Second)
	defer fcancel()
	r.Evict([]prefix.Hash{1}) // flushed only after the start-up evict-all
	if err := r.Flush(fctx); err != nil {
		t.Fatal(err)
	}

	held := func(h prefix.Hash) int { return heldLength(t, mc, cluster, host, prefix.Wire([]prefix.Hash{h})) }
	save := func(hs ...prefix.Hash) {
		if err := mc.SaveCache(ctx, api.CacheSave{Cluster: cluster, Host: host, Hashes: prefix.Wire(hs), ChunkSize: 512}); err != nil {
			t.Fatal(err)
		}
	}
	save(21, 22, 23)
	clockPasses(t, time.Now()) // the evictions come strictly after those saves
	down.Lock()
	r.Evict([]prefix.Hash{21, 22, 23}) // the worker dropped all three prefixes
	// Wait until that report has been refused: one still on its way when
	// the center comes back could not be withdrawn. The retry comes after
	// the reporter's first backoff (100 ms) and takes the pending set anew.
	select {
	case <-refused:
	case <-fctx.Done():
		t.Fatal("the eviction report never reached the gate")
	}
	clockPasses(t, time.Now())
	// The gateway routes two of the prompts here again and saves them; the
	// worker caches 21 again (the request bound an entry), 22 not yet.
	save(21, 22)
	r.Cached([]prefix.Hash{21})
	if r.Pending() != 2 {
		t.Fatalf("%d reports pending, want 22's and 23's", r.Pending())
	}
	down.Unlock()
	if err := r.Flush(fctx); err != nil {
		t.Fatal(err)
	}
	if held(21) != 1 || held(22) != 1 || held(23) != 0 {
		t.Fatalf("after the outage the index holds 21: %d, 22: %d, 23: %d; want 1, 1 and 0", held(21), held(22), held(23))
	}
}

// The start-up evict-all carries the worker's start (its epoch): entries of
// an earlier process on the same address go, entries the gateways saved for
// this process before the report landed stay. Cleared says when it landed.
func TestStartUpEvictAllKeepsSavesSinceTheStart(t *testing.T) {
	srv := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registry: prometheus.NewRegistry()}).Handler())
	t.Cleanup(srv.Close)
	const cluster, host = "outbound|8000||tiny", "10.0.0.9:9001"
	mc, err := client.New(client.Options{Address: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	save := func(hs ...prefix.Hash) {
		if err := mc.SaveCache(ctx, api.CacheSave{Cluster: cluster, Host: host, Hashes: prefix.Wire(hs)}); err != nil {
			t.Fatal(err)
		}
	}
	held := func(h prefix.Hash) int { return heldLength(t, mc, cluster, host, prefix.Wire([]prefix.Hash{h})) }
	save(30) // the earlier process's
	clockPasses(t, time.Now())
	epoch := time.Now()
	clockPasses(t, epoch)
	save(31) // routed to this process before its evict-all landed
	r, err := New(Config{URL: srv.URL, Cluster: cluster, Host: host, Epoch: epoch, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-r.Cleared():
		t.Fatal("cleared before it ran")
	default:
	}
	rctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	go r.Run(rctx)
	select {
	case <-r.Cleared():
	case <-time.After(5 * time.Second):
		t.Fatal("the start-up evict-all never landed")
	}
	if held(30) != 0 || held(31) != 1 {
		t.Fatalf("after the evict-all the index holds 30: %d, 31: %d; want 0 and 1", held(30), held(31))
	}
}

// A worker whose clock is far ahead of the metadata center's has its
// eviction times refused (400); it reports again without them, so the
// evictions still happen and readiness is not held up.
func TestEvictionTimesFromABrokenClockAreDropped(t *testing.T) {
	srv := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registry: prometheus.NewRegistry()}).Handler())
	t.Cleanup(srv.Close)
	const cluster, host = "outbound|8000||tiny", "10.0.0.9:9002"
	mc, err := client.New(client.Options{Address: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := mc.SaveCache(ctx, api.CacheSave{Cluster: cluster, Host: host, Hashes: prefix.Wire([]prefix.Hash{40, 41})}); err != nil {
		t.Fatal(err)
	}
	held := func(h prefix.Hash) bool {
		ans, err := mc.Route(ctx, cluster, prefix.Wire([]prefix.Hash{h}))
		if err != nil {
			t.Fatal(err)
		}
		return len(ans.Cache) > 0
	}
	ahead := time.Now().Add(72 * time.Hour)
	r, err := New(Config{URL: srv.URL, Cluster: cluster, Host: host, Epoch: ahead, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	go r.Run(rctx)
	select {
	case <-r.Cleared():
	case <-time.After(5 * time.Second):
		t.Fatal("the start-up evict-all never landed")
	}
	if held(40) || held(41) {
		t.Fatal("the evict-all with a refused time removed nothing")
	}
	if err := mc.SaveCache(ctx, api.CacheSave{Cluster: cluster, Host: host, Hashes: prefix.Wire([]prefix.Hash{42})}); err != nil {
		t.Fatal(err)
	}
	r.EvictAt([]prefix.Hash{42}, ahead)
	fctx, fcancel := context.WithTimeout(ctx, 5*time.Second)
	defer fcancel()
	if err := r.Flush(fctx); err != nil {
		t.Fatal(err)
	}
	if held(42) {
		t.Fatal("an eviction with a refused time was dropped instead of reported without it")
	}
	if got := counterValue(t, r.sent.WithLabelValues("rejected")); got != 2 {
		t.Fatalf("rejected reports = %v, want the two timed ones", got)
	}
}

// heldLength is how many of hashes the metadata center says host holds in
// cluster (its route answer's cache length for host).
func heldLength(t *testing.T, mc *client.Client, cluster, host string, hashes []string) int {
	t.Helper()
	locs, err := mc.Route(context.Background(), cluster, hashes)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range locs.Cache {
		if l.Host == host {
			return l.Length
		}
	}
	return 0
}

// clockPasses waits until the wall clock is past t by more than the
// metadata center's millisecond resolution, so that what happens next is
// stamped strictly after t.
func clockPasses(t *testing.T, after time.Time) {
	t.Helper()
	wait.For(t, time.Second, "the clock to advance", func() bool { return time.Now().UnixMilli() > after.UnixMilli()+1 })
}
