package envoyhost

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// switchableMC is a real metadata center behind a proxy that can be told to
// hang: accept, read, never answer (until the test ends).
type switchableMC struct {
	url  string
	hang atomic.Bool
	stop chan struct{}
	// The done updates (in POST /v1/batch) held while hanging whose
	// caller gave up (its update_timeout).
	failedDones atomic.Int64
}

func newSwitchableMC(t testing.TB, realURL string) *switchableMC {
	s := &switchableMC{stop: make(chan struct{})}
	u, _ := url.Parse(realURL)
	proxy := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.hang.Load() {
			// Read the request through: then the server watches the
			// connection, and a caller giving up ends the context.
			var b api.Batch
			if r.URL.Path == api.PathBatch {
				_ = json.NewDecoder(r.Body).Decode(&b)
			}
			_, _ = io.Copy(io.Discard, r.Body)
			select {
			case <-r.Context().Done():
				for _, op := range b.Ops {
					if op.Op == api.OpDone {
						s.failedDones.Add(1)
					}
				}
			case <-s.stop:
			}
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { close(s.stop); srv.Close() })
	s.url = srv.URL
	return s
}

// heldRequests sends n chats that the backends hold until release is
// closed; it returns once all n reached a backend.
func heldRequests(t *testing.T, h *Host, bs []*backend, n int) (release func(), results chan int) {
	t.Helper()
	hold := make(chan struct{})
	var before int64
	for _, b := range bs {
		b.mu.Lock()
		b.hold = hold
		b.mu.Unlock()
		before += b.hits.Load()
	}
	results = make(chan int, n)
	for i := 0; i < n; i++ {
		go func(i int) {
			c := &http.Client{Timeout: 60 * time.Second}
			resp, err := c.Post(h.URL()+"/v1/chat/completions", "application/json",
				strings.NewReader(chatBody(fmt.Sprintf("question %d about config pushes", i), i%2 == 0)))
			if err != nil {
				results <- -1
				return
			}
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				results <- -2
				return
			}
			results <- resp.StatusCode
		}(i)
	}
	waitUntil(t, "all held requests at the backends", 20*time.Second, func() bool {
		var hits int64
		for _, b := range bs {
			hits += b.hits.Load()
		}
		return hits-before >= int64(n)
	})
	var once sync.Once
	return func() {
		once.Do(func() {
			for _, b := range bs {
				b.mu.Lock()
				b.hold = nil
				b.mu.Unlock()
			}
			close(hold)
		})
	}, results
}

func expectAll(t *testing.T, results chan int, n int, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for i := 0; i < n; i++ {
		select {
		case code := <-results:
			if code != 200 {
				t.Errorf("a request ended with %d (negative: transport error), want 200", code)
			}
		case <-deadline:
			t.Fatalf("%d of %d requests still stalled after %v", n-i, n, within)
		}
	}
}

// An xDS push replaces the listener config while requests are in flight
// and the metadata center hangs: the old config is destroyed when its last
// stream ends (on that stream's worker thread, its handle already expired).
// The process must survive, no stream may stall, Destroy must not block
// the Envoy thread, and once the metadata center answers again a push under
// load must leave no lease behind.
func TestConfigPushUnderLoadWhileMetadataCenterHangs(t *testing.T) {
	st, realMC := newMetadataCenter(t)
	mc := newSwitchableMC(t, realMC)
	bs := []*backend{newBackend(t), newBackend(t)}
	pods := []string{bs[0].addr, bs[1].addr}
	h := startHost(t, Options{Clusters: map[string][]string{"pool": pods}})
	first, err := h.PushConfig([]byte(filterDoc(mc.url, pods, "")))
	if err != nil {
		t.Fatal(err)
	}

	// Phase 1: the metadata center hangs; route queries time out (300 ms,
	// degraded routing), lease updates queue and fail after 1.5 s.
	mc.hang.Store(true)
	const n = 6
	release, results := heldRequests(t, h, bs, n)
	second, err := h.PushConfig([]byte(filterDoc(mc.url, pods, "")))
	if err != nil {
		t.Fatal(err)
	}
	release()
	expectAll(t, results, n, 20*time.Second)
	waitUntil(t, fmt.Sprintf("config %d destroyed", first), 10*time.Second, func() bool { return destroyedOf(h, first) != nil })
	if d := destroyedOf(h, first); d.Took > 100*time.Millisecond {
		t.Errorf("Destroy of config %d blocked the Envoy thread for %v", first, d.Took)
	}
	// The queued updates fail only after update_timeout: the process must
	// still be there once they have.
	waitUntil(t, "the requests' done updates to fail", 20*time.Second, func() bool { return mc.failedDones.Load() == n })
	if err := h.Err(); err != nil {
		t.Fatal(err)
	}

	// Phase 2: the metadata center is back. A push while requests are in
	// flight must not lose their Done updates.
	mc.hang.Store(false)
	adds0, dels0 := st.adds.Load(), st.deletes.Load()
	release, results = heldRequests(t, h, bs, n)
	third, err := h.PushConfig([]byte(filterDoc(mc.url, pods, "")))
	if err != nil {
		t.Fatal(err)
	}
	release()
	expectAll(t, results, n, 20*time.Second)
	waitUntil(t, fmt.Sprintf("config %d destroyed", second), 10*time.Second, func() bool { return destroyedOf(h, second) != nil })
	waitUntil(t, "every lease of phase 2 released", 10*time.Second, func() bool {
		return st.adds.Load()-adds0 == n && st.deletes.Load()-dels0 == n
	})
	if live := st.liveLeases(); len(live) != 0 {
		t.Fatalf("leases left at the metadata center: %v", live)
	}
	if d := destroyedOf(h, second); d.Took > 100*time.Millisecond {
		t.Errorf("Destroy of config %d blocked the Envoy thread for %v", second, d.Took)
	}
	_ = third
	for _, d := range h.Destroyed() {
		t.Logf("config %d destroyed in %v (worker thread: %v)", d.ID, d.Took, d.OnWorker)
	}
	if err := h.Err(); err != nil {
		t.Fatal(err)
	}
}

func destroyedOf(h *Host, id uint64) *Destroyed {
	for _, d := range h.Destroyed() {
		if d.ID == id {
			return &d
		}
	}
	return nil
}

// A route-level config is merged with every new listener config; after
// the first parent is replaced and destroyed, requests on the route must
// still be served (and the merged views Envoy drops 2 s later must not
// take anything down).
func TestRouteConfigOutlivesItsParent(t *testing.T) {
	_, mc := newMetadataCenter(t)
	b := newBackend(t)
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {b.addr}}})
	doc := filterDoc(mc, []string{b.addr}, "")
	first, err := h.PushConfig([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.SetRouteConfig([]byte(doc)); err != nil {
		t.Fatal(err)
	}
	asked := 0
	ask := func(what string) {
		t.Helper()
		asked++
		done := make(chan struct{})
		var resp *http.Response
		var body []byte
		go func() {
			defer close(done)
			resp, body = post(t, h.URL(), chatBody("route config "+what, false))
		}()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			t.Fatalf("%s: the request hangs; host stderr:\n%s", what, lastLines(h.Stderr(), 20))
		}
		if resp.StatusCode != 200 || resp.Header.Get(headers.UpstreamHost) != b.addr {
			t.Fatalf("%s: status %d, %s=%q: %s", what, resp.StatusCode, headers.UpstreamHost,
				resp.Header.Get(headers.UpstreamHost), body)
		}
	}
	ask("with its first parent")
	if _, err := h.PushConfig([]byte(doc)); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the first parent destroyed", 5*time.Second, func() bool { return destroyedOf(h, first) != nil })
	ask("after its first parent was destroyed")
	// That request made the host merge the route config with the new
	// parent; Envoy's shim destroys the stale merged view 2 s later on a
	// timer of its own (config.go, delayDeleteTime), which nothing reports:
	// requests keep being served across that moment.
	for merged := time.Now(); time.Since(merged) < 2500*time.Millisecond; {
		ask("while the stale merge is destroyed")
	}
	ask("after the stale merge was destroyed")
	if err := h.Err(); err != nil {
		t.Fatal(err)
	}
	m, err := h.Metrics()
	if err != nil {
		t.Fatal(err)
	}
	if m["llm_filter_panics_total"] != 0 || m["golang.panic_error"] != 0 {
		t.Fatalf("panics counted: %v", m)
	}
	if m["llm_filter_routed_total"] != int64(asked) {
		t.Fatalf("llm_filter_routed_total = %d, want %d (each request counted once, in the live config's stats)", m["llm_filter_routed_total"], asked)
	}
}

// The client leaves while the decision waits on the metadata center: no
// crash, nothing started, nothing leaked, the pod never sees the request.
func TestClientGoneWhileDeciding(t *testing.T) {
	st, realMC := newMetadataCenter(t)
	mc := newSwitchableMC(t, realMC)
	b := newBackend(t)
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {b.addr}}})
	if _, err := h.PushConfig([]byte(filterDoc(mc.url, []string{b.addr}, ""))); err != nil {
		t.Fatal(err)
	}
	mc.hang.Store(true)
	for i := 0; i < 4; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		req, _ := http.NewRequestWithContext(ctx, "POST", h.URL()+"/v1/chat/completions", strings.NewReader(chatBody("leaving early", false)))
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			t.Fatalf("the request was answered (%d) although the decision could not finish", resp.StatusCode)
		}
		cancel()
	}
	// Each decision ends (its route query cancelled or timed out) and is
	// counted; it finds its stream gone.
	waitUntil(t, "the four decisions to end", 5*time.Second, func() bool {
		m, err := h.Metrics()
		return err == nil && m["llm_filter_routed_total"] == 4
	})
	mc.hang.Store(false)
	if b.hits.Load() != 0 {
		t.Fatalf("the pod saw %d requests of clients that had left", b.hits.Load())
	}
	resp, body := post(t, h.URL(), chatBody("after the others left", false))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	// The last request's lease must have landed and gone: the client has
	// its answer before the batched add_request reaches the center, and
	// until then adds == deletes == 0 with that request still in flight.
	// Its delete lands after the gauge dropped (filter.finish).
	waitUntil(t, "leases settle", 5*time.Second, func() bool { return st.adds.Load() > 0 && st.adds.Load() == st.deletes.Load() })
	if live := st.liveLeases(); len(live) != 0 {
		t.Fatalf("leases left: %v", live)
	}
	m, _ := h.Metrics()
	if m["llm_filter_in_flight_requests"] != 0 || m["llm_filter_panics_total"] != 0 {
		t.Fatalf("in_flight=%d panics=%d, want 0, 0", m["llm_filter_in_flight_requests"], m["llm_filter_panics_total"])
	}
	if err := h.Err(); err != nil {
		t.Fatal(err)
	}
}

// The filter picks a host Envoy's cluster does not have (its endpoint list
// is stale). Envoy applies a goroutine's override as non-strict, so the
// cluster's load balancer serves the request; the filter must report the
// host that really served it.
func TestChosenHostNotInTheCluster(t *testing.T) {
	st, mc := newMetadataCenter(t)
	real := newBackend(t)
	gone := newBackend(t) // known to the filter only
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {real.addr}}})
	if _, err := h.PushConfig([]byte(filterDoc(mc, []string{gone.addr}, ""))); err != nil {
		t.Fatal(err)
	}
	resp, body := post(t, h.URL(), chatBody("stale endpoints", false))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if gone.hits.Load() != 0 || real.hits.Load() != 1 {
		t.Fatalf("hits: cluster member %d, non-member %d; Envoy only sends to members", real.hits.Load(), gone.hits.Load())
	}
	if got := resp.Header.Get(headers.UpstreamHost); got != real.addr {
		t.Fatalf("%s = %q, but %s served the request", headers.UpstreamHost, got, real.addr)
	}
	// The lease moved to the pod that served, and the prefix is recorded
	// there, not on the chosen pod, which never saw the request.
	waitUntil(t, "the request's leases to end", 10*time.Second, func() bool {
		return st.deletes.Load() == 2 && len(st.liveLeases()) == 0
	})
	st.mu.Lock()
	added := slices.Clone(st.addedOn)
	st.mu.Unlock()
	if want := []string{gone.addr, real.addr}; !slices.Equal(added, want) {
		t.Fatalf("leases added on %v, want %v (the chosen pod, then the one that served)", added, want)
	}
	model, canon, err := openai.Canonical("/v1/chat/completions", []byte(chatBody("stale endpoints", false)))
	if err != nil {
		t.Fatal(err)
	}
	hashes := prefix.Hasher{ChunkSize: prefix.DefaultChunkSize}.Sum(model, canon)
	locs, err := st.QueryCache(context.Background(), "pool", hashes)
	if err != nil {
		t.Fatal(err)
	}
	if want := []api.CacheLocation{{Host: real.addr, Length: len(hashes)}}; !slices.Equal(locs, want) {
		t.Fatalf("index %v, want %v", locs, want)
	}
}

// The router's own rules: a strict override of a non-member fails with
// 503 (UH), a non-strict one falls back, retries never reuse the override.
func TestRouterOverrideSemantics(t *testing.T) {
	b := newBackend(t)
	r := newRouter(nil, map[string][]string{"pool": {b.addr}}, "pool", 1)
	u := &upstream{override: "10.9.9.9:1", strict: true}
	if _, host, details := r.pick(u, 1); host != "" || details != "no_healthy_upstream" {
		t.Fatalf("strict non-member: host %q details %q, want no host, no_healthy_upstream", host, details)
	}
	u.strict = false
	if _, host, _ := r.pick(u, 1); host != b.addr {
		t.Fatalf("non-strict non-member: host %q, want the cluster's %q", host, b.addr)
	}
	r.SetHosts("pool", []string{b.addr, "127.0.0.1:1"})
	u.override = "127.0.0.1:1"
	if _, host, _ := r.pick(u, 1); host != "127.0.0.1:1" {
		t.Fatalf("healthy member override: host %q", host)
	}
	r.SetHealthy("pool", "127.0.0.1:1", false)
	u.strict = true
	if _, host, _ := r.pick(u, 1); host != "" {
		t.Fatalf("strict unhealthy member: host %q, want none", host)
	}
	r.SetHealthy("pool", "127.0.0.1:1", true)
	seen := map[string]bool{}
	for i := 0; i < 4; i++ {
		_, host, _ := r.pick(u, 2)
		seen[host] = true
	}
	if len(seen) != 2 {
		t.Fatalf("retries went to %v: a retry must use the load balancer, not the override", seen)
	}
}
