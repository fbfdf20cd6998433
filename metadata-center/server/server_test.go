package server_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
)

func TestMain(m *testing.M) {
	gin.SetMode(gin.ReleaseMode) // silence gin's debug route dump
	os.Exit(m.Run())
}

type client struct {
	t     *testing.T
	base  string
	token string
}

func serve(t *testing.T, st store.Store, opts server.Options) *client {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	ts := httptest.NewServer(server.New(st, opts).Handler())
	t.Cleanup(ts.Close)
	return &client{t: t, base: ts.URL, token: opts.AuthToken}
}

// do sends body (marshalled unless it is a string or []byte) and returns
// status and raw answer.
func (c *client) do(method, path string, body any) (int, []byte) {
	c.t.Helper()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		r = strings.NewReader(b)
	case []byte:
		r = bytes.NewReader(b)
	default:
		raw, err := json.Marshal(b)
		if err != nil {
			c.t.Fatal(err)
		}
		r = bytes.NewReader(raw)
	}
	req, err := http.NewRequest(method, c.base+path, r)
	if err != nil {
		c.t.Fatal(err)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.StatusCode, raw
}

// ok sends and decodes a 200 answer into out (may be nil).
func (c *client) ok(method, path string, body, out any) {
	c.t.Helper()
	code, raw := c.do(method, path, body)
	if code != http.StatusOK {
		c.t.Fatalf("%s %s: %d %s", method, path, code, raw)
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			c.t.Fatalf("%s %s: decode %s: %v", method, path, raw, err)
		}
	}
}

// fails checks an error answer's status and its {"error":{...}} body.
func (c *client) fails(method, path string, body any, code int, typ, msgPart string) {
	c.t.Helper()
	got, raw := c.do(method, path, body)
	if got != code {
		c.t.Fatalf("%s %s %.80v: status %d (%s), want %d", method, path, body, got, raw, code)
	}
	var e api.Error
	if err := json.Unmarshal(raw, &e); err != nil {
		c.t.Fatalf("%s %s: error body %s is not the error format: %v", method, path, raw, err)
	}
	if e.Error.Code != code || e.Error.Type != typ || !strings.Contains(e.Error.Message, msgPart) {
		c.t.Fatalf("%s %s %.80v: error %+v, want code %d type %q message containing %q", method, path, body, e.Error, code, typ, msgPart)
	}
}

func (c *client) load(cluster string) api.LoadStats {
	c.t.Helper()
	var out api.LoadStats
	c.ok("GET", api.PathLoadStats+"?cluster="+cluster, nil, &out)
	return out
}

func hex(i int) string { return fmt.Sprintf("%016x", 0xabc0000+i) }

func hexes(from, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = hex(from + i)
	}
	return out
}

const cl = "outbound|8000||qwen.llm.svc.cluster.local"

// Pods report themselves; the route query answers their fresh reports with
// load and cache in the same round trip, on both stores (Redis: a real
// redis-server); bad reports get 400 in the error format.
func TestPodSignals(t *testing.T) {
	srv := redistest.Shared(t)
	stores := map[string]func(t *testing.T) store.Store{
		"memory": func(t *testing.T) store.Store {
			return memstore.New(memstore.Options{SignalMaxAge: 300 * time.Millisecond})
		},
		"redis": func(t *testing.T) store.Store {
			st, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: srv.Prefix + "-podsignals", SignalMaxAge: 300 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = st.Close() })
			return st
		},
	}
	for name, mk := range stores {
		t.Run(name, func(t *testing.T) {
			c := serve(t, mk(t), server.Options{})
			const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
			reported := time.Now() // no later than both reports
			c.ok("POST", api.PathPodSignals, api.PodReport{Cluster: cl, Host: a, Waiting: 2, Running: 4, KVCacheUtil: 0.9, PrefillTokens: 700}, nil)
			c.ok("POST", api.PathPodSignals, map[string]any{"cluster": cl, "host": "10.0.0.2:08000", "waiting": 0, "running": 1, "kv_cache_util": 0.25, "draining": true}, nil)
			c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: a, RequestID: "r", PromptLength: 5}, nil)
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: b, Hashes: hexes(0, 2)}, nil)
			var ans api.RouteAnswer
			c.ok("POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl, Hashes: hexes(0, 2)}, &ans)
			if len(ans.Signals) != 2 || ans.Signals[a].Waiting != 2 || ans.Signals[a].KVCacheUtil != 0.9 || ans.Signals[a].PrefillTokens != 700 ||
				ans.Signals[b].Running != 1 || ans.Signals[b].KVCacheUtil != 0.25 || ans.Signals[a].AgeMS > 300 ||
				ans.Signals[a].Draining || !ans.Signals[b].Draining {
				t.Fatalf("route signals %+v", ans.Signals)
			}
			if ans.Load[a].TotalReqs != 1 || len(ans.Cache) != 1 || ans.Cache[0].Host != b {
				t.Fatalf("route load/cache beside signals: %+v", ans)
			}
			var got map[string]api.PodSignals
			c.ok("GET", api.PathPodSignals+"?cluster="+cl, nil, &got)
			if len(got) != 2 || got[b].KVCacheUtil != 0.25 || !got[b].Draining {
				t.Fatalf("GET signals %+v", got)
			}
			// Stale reports are not answered: once both are older than the
			// max age, the route answer leaves them out.
			wait.For(t, 10*time.Second, "the reports to go stale", func() bool {
				ans = api.RouteAnswer{}
				c.ok("POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl, Hashes: hexes(0, 2)}, &ans)
				return ans.Signals == nil
			})
			if age := time.Since(reported); age <= 300*time.Millisecond {
				t.Fatalf("reports left out %v after they were made, within the 300ms max age", age)
			}
			for _, bad := range []struct {
				body any
				msg  string
			}{
				{map[string]any{"cluster": cl, "host": a, "waiting": -1}, "waiting must be >= 0"},
				{map[string]any{"cluster": cl, "host": a, "running": -2}, "running must be >= 0"},
				{map[string]any{"cluster": cl, "host": a, "prefill_tokens": -2}, "prefill_tokens must be >= 0"},
				{map[string]any{"cluster": cl, "host": a, "kv_cache_util": 1.5}, "kv_cache_util must be within 0..1"},
				{map[string]any{"cluster": cl, "host": a, "token_seconds": -1e-3}, "token_seconds must be within 0..86400"},
				{map[string]any{"cluster": cl, "host": a, "prefill_queue": []map[string]any{{"tokens": 10, "seconds": -1}}}, "prefill_queue entries need"},
				{map[string]any{"cluster": cl, "host": a, "kv_capacity": -1}, "kv_capacity must be >= 0"},
				{map[string]any{"cluster": cl, "host": a, "max_running": -1}, "max_running must be >= 0"},
				{map[string]any{"cluster": cl, "host": "pod-a", "waiting": 1}, "host"},
				{map[string]any{"host": a}, "cluster"},
				{`{"cluster":"c","host":"10.0.0.1:1","waiting":"x"}`, `field "waiting"`},
			} {
				c.fails("POST", api.PathPodSignals, bad.body, 400, "bad_request", bad.msg)
			}
			c.fails("GET", api.PathPodSignals, nil, 400, "bad_request", "cluster")
		})
	}
}

// pastMilli waits until the wall clock (the stores' clock) is past ms, Unix
// milliseconds: what happens next is dated after it.
func pastMilli(t *testing.T, ms int64) {
	t.Helper()
	wait.For(t, time.Second, "the clock to pass a millisecond", func() bool { return time.Now().UnixMilli() > ms })
}

// TestAPI drives every endpoint through the real handler on a real
// listener, against both stores.
func TestAPI(t *testing.T) {
	for _, st := range storetest.Stores() {
		t.Run(st.Name, func(t *testing.T) { testAPI(t, serve(t, st.New(t), server.Options{})) })
	}
}

// Versions over HTTP, on both stores: a late eviction report (evicted_at
// before the save) leaves a newer save; a retraction withdraws only its
// own save, singly and in a batch.
func TestVersionsHTTP(t *testing.T) {
	for _, st := range storetest.Stores() {
		t.Run(st.Name, func(t *testing.T) {
			c := serve(t, st.New(t), server.Options{})
			const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
			query := func(hs []string) []api.CacheLocation {
				var locs []api.CacheLocation
				c.ok("POST", api.PathCacheQuery, api.CacheQuery{Cluster: cl, Hashes: hs}, &locs)
				return locs
			}
			evictedAt := time.Now().UnixMilli() - 1
			pastMilli(t, evictedAt+1)
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: a, Hashes: hexes(0, 4), SaveID: "r1"}, nil)
			// The report of an eviction that happened before that save
			// arrives now (retried after an outage): the save stays.
			c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: a, Hashes: hexes(0, 4), EvictedAt: evictedAt}, nil)
			c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: a, All: true, EvictedAt: evictedAt}, nil)
			if got, want := query(hexes(0, 4)), []api.CacheLocation{{Host: a, Length: 4}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after late evictions: %v, want %v", got, want)
			}
			// An eviction after the save removes it.
			c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: a, Hashes: hexes(3, 1), EvictedAt: time.Now().UnixMilli()}, nil)
			if got, want := query(hexes(0, 4)), []api.CacheLocation{{Host: a, Length: 3}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after a timely eviction: %v, want %v", got, want)
			}
			// r2 saves on b, r3 saves part of it again; r2 fails before its
			// first token and retracts: only what r3 did not save again goes.
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: b, Hashes: hexes(0, 4), SaveID: "r2"}, nil)
			c.ok("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{
				{Op: api.OpCacheSave, Cluster: cl, Host: b, Hashes: hexes(0, 2), SaveID: "r3"},
				{Op: api.OpCacheRetract, Cluster: cl, Host: b, Hashes: hexes(0, 4), SaveID: "r2"},
			}}, nil)
			if got, want := query(hexes(0, 4)), []api.CacheLocation{{Host: a, Length: 3}, {Host: b, Length: 2}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after the retraction: %v, want %v", got, want)
			}
			c.ok("POST", api.PathCacheRetract, api.CacheRetract{Cluster: cl, Host: b, Hashes: hexes(0, 4), SaveID: "r3"}, nil)
			c.ok("POST", api.PathCacheRetract, api.CacheRetract{Cluster: cl, Host: a, Hashes: hexes(0, 4), SaveID: "r3"}, nil)
			if got, want := query(hexes(0, 4)), []api.CacheLocation{{Host: a, Length: 3}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after r3's retraction: %v, want %v", got, want)
			}
			c.fails("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{{Op: api.OpCacheRetract, Cluster: cl, Host: b, Hashes: hexes(0, 1)}}},
				400, "bad_request", "ops[0] (cache_retract): save_id is required")
			// A confirmation (refresh_only) renews what a holds and never
			// inserts: not the evicted hexes(3), nor anything on b, whether
			// it comes alone or in a batch.
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: a, Hashes: hexes(0, 6), SaveID: "r1", RefreshOnly: true}, nil)
			c.ok("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{
				{Op: api.OpCacheSave, Cluster: cl, Host: b, Hashes: hexes(0, 4), SaveID: "r4", RefreshOnly: true},
			}}, nil)
			if got, want := query(hexes(0, 6)), []api.CacheLocation{{Host: a, Length: 3}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after refresh-only saves: %v, want %v", got, want)
			}
			// It is no save: the report of an eviction the pod made after
			// the save and before the refresh removes the entry though it
			// arrives after the refresh.
			before := time.Now().UnixMilli()
			pastMilli(t, before)
			c.ok("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{
				{Op: api.OpCacheSave, Cluster: cl, Host: a, Hashes: hexes(0, 3), SaveID: "r5", RefreshOnly: true},
			}}, nil)
			c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: a, Hashes: hexes(2, 1), EvictedAt: before}, nil)
			if got, want := query(hexes(0, 6)), []api.CacheLocation{{Host: a, Length: 2}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after an eviction reported after the refresh: %v, want %v", got, want)
			}
			// A save dated by its age before an eviction already applied
			// stays out, alone or in a batch; one made after it lands.
			evicted := time.Now().UnixMilli()
			c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: b, Hashes: hexes(1, 2), EvictedAt: evicted}, nil)
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: b, Hashes: hexes(0, 2), SaveID: "r6", AgeMS: 2000}, nil)
			c.ok("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{
				{Op: api.OpCacheSave, Cluster: cl, Host: b, Hashes: hexes(0, 3), SaveID: "r7", AgeMS: 1000},
			}}, nil)
			if got, want := query(hexes(0, 3)), []api.CacheLocation{{Host: a, Length: 2}, {Host: b, Length: 1}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after saves dated before an eviction: %v, want %v", got, want)
			}
			pastMilli(t, evicted)
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: b, Hashes: hexes(0, 3), SaveID: "r8"}, nil)
			if got, want := query(hexes(0, 3)), []api.CacheLocation{{Host: b, Length: 3}, {Host: a, Length: 2}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after a save made since: %v, want %v", got, want)
			}
			c.fails("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: b, Hashes: hexes(0, 1), AgeMS: -1},
				400, "bad_request", "age_ms -1 is negative")
			c.fails("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{{Op: api.OpCacheSave, Cluster: cl, Host: b, Hashes: hexes(0, 1), AgeMS: api.MaxSaveAgeMS + 1}}},
				400, "bad_request", "ops[0] (cache_save): age_ms 600001 exceeds 600000")
			c.fails("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{{Op: api.OpDone, Cluster: cl, Host: a, RequestID: "r1", RefreshOnly: true}}},
				400, "bad_request", "ops[0] (done): refresh_only is only allowed on cache_save")
			c.fails("POST", api.PathCacheSave, `{"cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"refresh_only":"yes"}`,
				400, "bad_request", "refresh_only")
			// A save bounds what its host holds (the pod's KV capacity in
			// blocks): the least recently saved go, over HTTP and in a batch.
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: a, Hashes: hexes(10, 4), MaxEntries: 3}, nil)
			c.ok("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{{Op: api.OpCacheSave, Cluster: cl, Host: a, Hashes: hexes(20, 2), MaxEntries: 3}}}, nil)
			if got, want := query(hexes(10, 4)), []api.CacheLocation{{Host: a, Length: 1}}; !reflect.DeepEqual(got, want) {
				t.Fatalf("after saves bounded to 3 entries: %v, want %v", got, want)
			}
			c.fails("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: a, Hashes: hexes(0, 1), MaxEntries: -1},
				400, "bad_request", "max_entries -1 is negative")
			c.fails("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{{Op: api.OpCacheSave, Cluster: cl, Host: a, Hashes: hexes(0, 1), MaxEntries: -2}}},
				400, "bad_request", "ops[0] (cache_save): max_entries -2 is negative")
		})
	}
}

func testAPI(t *testing.T, c *client) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	if got := c.load(cl); len(got) != 0 {
		t.Fatalf("empty cluster load = %v", got)
	}
	c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: a, RequestID: "r1", PromptLength: 100}, nil)
	c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: a, RequestID: "r2", PromptLength: 20}, nil)
	c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: b, RequestID: "r3", PromptLength: 5}, nil)
	c.ok("DELETE", api.PathLoadStatsPrompt, api.RequestRef{Cluster: cl, Host: a, RequestID: "r1"}, nil)
	want := api.LoadStats{a: {TotalReqs: 2, PromptLength: 20}, b: {TotalReqs: 1, PromptLength: 5}}
	if got := c.load(cl); !reflect.DeepEqual(got, want) {
		t.Fatalf("load = %v, want %v", got, want)
	}
	// Done twice, and done of an unknown lease: 200, counts never negative.
	for i := 0; i < 2; i++ {
		c.ok("DELETE", api.PathLoadStats, api.RequestRef{Cluster: cl, Host: b, RequestID: "r3"}, nil)
	}
	c.ok("DELETE", api.PathLoadStats, api.RequestRef{Cluster: cl, Host: b, RequestID: "nope"}, nil)
	want = api.LoadStats{a: {TotalReqs: 2, PromptLength: 20}}
	if got := c.load(cl); !reflect.DeepEqual(got, want) {
		t.Fatalf("load = %v, want %v", got, want)
	}

	c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: a, Hashes: hexes(0, 8)}, nil)
	c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: b, Hashes: hexes(0, 3)}, nil)
	var locs []api.CacheLocation
	c.ok("POST", api.PathCacheQuery, api.CacheQuery{Cluster: cl, Hashes: hexes(0, 10)}, &locs)
	if w := []api.CacheLocation{{Host: a, Length: 8}, {Host: b, Length: 3}}; !reflect.DeepEqual(locs, w) {
		t.Fatalf("cache query = %v, want %v", locs, w)
	}
	var ans api.RouteAnswer
	c.ok("POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl, Hashes: hexes(0, 10)}, &ans)
	if w := (api.RouteAnswer{Load: want, Cache: []api.CacheLocation{{Host: a, Length: 8}, {Host: b, Length: 3}}}); !reflect.DeepEqual(ans, w) {
		t.Fatalf("route = %+v, want %+v", ans, w)
	}

	c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: a, Hashes: []string{hex(2)}}, nil)
	c.ok("POST", api.PathCacheQuery, api.CacheQuery{Cluster: cl, Hashes: hexes(0, 10)}, &locs)
	if w := []api.CacheLocation{{Host: b, Length: 3}, {Host: a, Length: 2}}; !reflect.DeepEqual(locs, w) {
		t.Fatalf("after evict = %v, want %v", locs, w)
	}
	c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: b, All: true}, nil)
	c.ok("POST", api.PathCacheQuery, api.CacheQuery{Cluster: cl, Hashes: hexes(0, 10)}, &locs)
	if w := []api.CacheLocation{{Host: a, Length: 2}}; !reflect.DeepEqual(locs, w) {
		t.Fatalf("after evict all = %v, want %v", locs, w)
	}

	// Empty answers are [] and {}, never null: clients index them directly.
	if code, raw := c.do("POST", api.PathRouteQuery, api.RouteQuery{Cluster: "nobody", Hashes: []string{}}); code != 200 || string(raw) != `{"load":{},"cache":[]}` {
		t.Fatalf("empty route = %d %s", code, raw)
	}
	if code, raw := c.do("POST", api.PathCacheQuery, api.CacheQuery{Cluster: "nobody", Hashes: hexes(0, 2)}); code != 200 || string(raw) != `[]` {
		t.Fatalf("empty cache query = %d %s", code, raw)
	}

	var status map[string]string
	c.ok("GET", api.PathHealthz, nil, &status)
	c.ok("GET", api.PathReadyz, nil, &status)
	if status["status"] != "ready" {
		t.Fatalf("readyz = %v", status)
	}

	code, raw := c.do("GET", api.PathMetrics, nil)
	if code != 200 {
		t.Fatalf("metrics: %d", code)
	}
	for _, line := range []string{
		`llmf_metadata_center_requests_total{code="200",endpoint="/v1/route/query",method="POST"} 2`,
		`llmf_metadata_center_requests_total{code="200",endpoint="/v1/load/stats",method="DELETE"} 3`,
		`llmf_metadata_center_request_duration_seconds_count{endpoint="/v1/cache/query",method="POST"} 4`,
		`llmf_metadata_center_live_leases 2`,
		`llmf_metadata_center_index_entries 7`,
		`llmf_metadata_center_store_up 1`,
	} {
		if !strings.Contains(string(raw), line+"\n") {
			t.Errorf("metrics lack %q", line)
		}
	}
}

// TestBadInput sends every kind of bad request and checks both the 4xx
// answer and that the state was left exactly as it was.
func TestBadInput(t *testing.T) {
	st := memstore.New(memstore.Options{})
	c := serve(t, st, server.Options{MaxBodyBytes: 256 << 10})
	const h = "10.0.0.1:8000"
	c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: h, RequestID: "keep", PromptLength: 7}, nil)
	c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: h, Hashes: hexes(0, 4)}, nil)

	add := func(host, id string, prompt int64) api.AddRequest {
		return api.AddRequest{Cluster: cl, Host: host, RequestID: id, PromptLength: prompt}
	}
	tooMany := hexes(0, api.MaxHashes+1)
	cases := []struct {
		method, path string
		body         any
		code         int
		typ, msg     string
	}{
		{"POST", api.PathLoadStats, `{"cluster":`, 400, "bad_request", "invalid JSON"},
		{"POST", api.PathLoadStats, ``, 400, "bad_request", "empty body"},
		{"POST", api.PathLoadStats, `[1,2]`, 400, "bad_request", "invalid JSON"},
		{"POST", api.PathLoadStats, `{"cluster":"c","host":"10.0.0.1:1","request_id":"r","prompt_length":"12"}`, 400, "bad_request", `field "prompt_length"`},
		{"POST", api.PathLoadStats, `{"cluster":"c","host":"10.0.0.1:1","request_id":"r"} trailing`, 400, "bad_request", "invalid JSON"},
		{"POST", api.PathLoadStats, add("", "r", 1), 400, "bad_request", "host is required"},
		{"POST", api.PathLoadStats, api.AddRequest{Host: h, RequestID: "r"}, 400, "bad_request", "cluster is required"},
		{"POST", api.PathLoadStats, add(h, "", 1), 400, "bad_request", "request_id is required"},
		{"POST", api.PathLoadStats, add(h, strings.Repeat("r", server.MaxRequestIDLen+1), 1), 400, "bad_request", "request_id is longer"},
		{"POST", api.PathLoadStats, add(h, "r", -1), 400, "bad_request", "prompt_length -1"},
		{"POST", api.PathLoadStats, add(h, "r", server.MaxPromptLength+1), 400, "bad_request", "prompt_length"},
		{"POST", api.PathLoadStats, add("pod-a.ns:8000", "r", 1), 400, "bad_request", "not an IP address"},
		{"POST", api.PathLoadStats, add("10.0.0.1", "r", 1), 400, "bad_request", "not ip:port"},
		{"POST", api.PathLoadStats, add("10.0.0.1:0", "r", 1), 400, "bad_request", "1..65535"},
		{"POST", api.PathLoadStats, add("10.0.0.1:70000", "r", 1), 400, "bad_request", "1..65535"},
		{"POST", api.PathLoadStats, add("10.0.0.1:http", "r", 1), 400, "bad_request", "1..65535"},
		{"POST", api.PathLoadStats, add("[fe80::1%eth0]:80", "r", 1), 400, "bad_request", "zones"},
		{"POST", api.PathLoadStats, add("10.0.0.1:80|x", "r", 1), 400, "bad_request", "1..65535"},
		{"DELETE", api.PathLoadStats, api.RequestRef{Cluster: cl, Host: "nope"}, 400, "bad_request", "not ip:port"},
		{"DELETE", api.PathLoadStats, `{]`, 400, "bad_request", "invalid JSON"},
		{"DELETE", api.PathLoadStatsPrompt, api.RequestRef{Cluster: cl, Host: h}, 400, "bad_request", "request_id is required"},
		{"GET", api.PathLoadStats, nil, 400, "bad_request", "cluster is required"},
		{"POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: h}, 400, "bad_request", "hashes is required"},
		{"POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: h, Hashes: []string{hex(1), "ABCDEF0123456789"}}, 400, "bad_request", "hashes[1]"},
		{"POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: h, Hashes: []string{"0123456789abcde"}}, 400, "bad_request", "16 lowercase hex"},
		{"POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: h, Hashes: []string{"0123456789abcdeg"}}, 400, "bad_request", "16 lowercase hex"},
		{"POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: h, Hashes: []string{"0x23456789abcdef"}}, 400, "bad_request", "16 lowercase hex"},
		{"POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: h, Hashes: tooMany}, 400, "bad_request", "at most 4096"},
		{"POST", api.PathCacheSave, `{"cluster":"c","host":"10.0.0.1:1","hashes":[1,2]}`, 400, "bad_request", `field "hashes`},
		{"POST", api.PathCacheSave, api.CacheSave{Host: h, Hashes: hexes(0, 1)}, 400, "bad_request", "cluster is required"},
		{"POST", api.PathCacheQuery, api.CacheQuery{Cluster: cl}, 400, "bad_request", "hashes is required"},
		{"POST", api.PathCacheQuery, api.CacheQuery{Cluster: cl, Hashes: tooMany}, 400, "bad_request", "at most 4096"},
		{"POST", api.PathCacheQuery, api.CacheQuery{Hashes: hexes(0, 1)}, 400, "bad_request", "cluster is required"},
		{"POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl}, 400, "bad_request", "hashes is required"},
		{"POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl, Hashes: []string{"zz"}}, 400, "bad_request", "hashes[0]"},
		{"POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl, Hashes: tooMany}, 400, "bad_request", "at most 4096"},
		{"POST", api.PathRouteQuery, `nonsense`, 400, "bad_request", "invalid JSON"},
		{"POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: h}, 400, "bad_request", "unless all is true"},
		{"POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: h, All: true, Hashes: hexes(0, 1)}, 400, "bad_request", "not both"},
		{"POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: h, Hashes: []string{"bad"}}, 400, "bad_request", "hashes[0]"},
		{"POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: "h:1", All: true}, 400, "bad_request", "not an IP address"},
		{"POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: h, All: true, EvictedAt: -5}, 400, "bad_request", "evicted_at -5 is negative"},
		{"POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: h, Hashes: hexes(0, 1), EvictedAt: time.Now().Add(48 * time.Hour).UnixMilli()},
			400, "bad_request", "ahead of the metadata center's clock"},
		{"POST", api.PathCacheEvict, `{"cluster":"c","host":"10.0.0.1:1","all":true,"evicted_at":"now"}`, 400, "bad_request", `field "evicted_at"`},
		{"POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: h, Hashes: hexes(0, 1), SaveID: strings.Repeat("s", server.MaxRequestIDLen+1)}, 400, "bad_request", "save_id is longer"},
		{"POST", api.PathCacheRetract, api.CacheRetract{Cluster: cl, Host: h, Hashes: hexes(0, 1)}, 400, "bad_request", "save_id is required"},
		{"POST", api.PathCacheRetract, api.CacheRetract{Cluster: cl, Host: h, SaveID: "r"}, 400, "bad_request", "hashes is required"},
		{"POST", api.PathCacheRetract, api.CacheRetract{Cluster: cl, Host: h, SaveID: "r", Hashes: []string{"nope"}}, 400, "bad_request", "hashes[0]"},
		{"POST", api.PathCacheRetract, api.CacheRetract{Cluster: cl, Host: "h", SaveID: "r", Hashes: hexes(0, 1)}, 400, "bad_request", "not ip:port"},
		{"POST", api.PathRouteQuery, `{"cluster":"c","hashes":[],"pad":"` + strings.Repeat("x", 300<<10) + `"}`, 413, "payload_too_large", "larger than"},
		{"GET", "/v1/nope", nil, 404, "not_found", "/v1/nope"},
		{"PUT", api.PathLoadStats, nil, 405, "method_not_allowed", "PUT"},
		{"GET", api.PathRouteQuery, nil, 405, "method_not_allowed", "GET"},
	}
	for _, tc := range cases {
		c.fails(tc.method, tc.path, tc.body, tc.code, tc.typ, tc.msg)
	}

	// Arbitrary methods do not become metric labels.
	c.fails("BREW", "/v1/coffee", nil, 404, "not_found", "/v1/coffee")
	_, metrics := c.do("GET", api.PathMetrics, nil)
	if !strings.Contains(string(metrics), `endpoint="unmatched",method="other"`) || strings.Contains(string(metrics), "BREW") {
		t.Fatal("custom method leaked into metric labels")
	}

	// Unknown fields are ignored, not refused.
	c.ok("POST", api.PathCacheQuery, `{"cluster":"`+cl+`","hashes":[],"model":"qwen"}`, nil)

	if got, want := c.load(cl), (api.LoadStats{h: {TotalReqs: 1, PromptLength: 7}}); !reflect.DeepEqual(got, want) {
		t.Fatalf("bad requests changed the load: %v, want %v", got, want)
	}
	var locs []api.CacheLocation
	c.ok("POST", api.PathCacheQuery, api.CacheQuery{Cluster: cl, Hashes: hexes(0, 4)}, &locs)
	if want := []api.CacheLocation{{Host: h, Length: 4}}; !reflect.DeepEqual(locs, want) {
		t.Fatalf("bad requests changed the index: %v, want %v", locs, want)
	}
	// Exactly MaxHashes is still fine.
	c.ok("POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl, Hashes: hexes(0, api.MaxHashes)}, nil)
}

// TestHostCanonical: one pod, several spellings, one lease.
func TestHostCanonical(t *testing.T) {
	c := serve(t, memstore.New(memstore.Options{}), server.Options{})
	c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: "10.0.0.1:080", RequestID: "r", PromptLength: 1}, nil)
	c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: "[::ffff:10.0.0.1]:80", RequestID: "r", PromptLength: 1}, nil)
	c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: "[FD00::0001]:80", RequestID: "r", PromptLength: 1}, nil)
	want := api.LoadStats{"10.0.0.1:80": {TotalReqs: 1, PromptLength: 1}, "[fd00::1]:80": {TotalReqs: 1, PromptLength: 1}}
	if got := c.load(cl); !reflect.DeepEqual(got, want) {
		t.Fatalf("load = %v, want %v", got, want)
	}
	c.ok("DELETE", api.PathLoadStats, api.RequestRef{Cluster: cl, Host: "10.0.0.1:80", RequestID: "r"}, nil)
	c.ok("DELETE", api.PathLoadStats, api.RequestRef{Cluster: cl, Host: "[fd00:0::1]:80", RequestID: "r"}, nil)
	if got := c.load(cl); len(got) != 0 {
		t.Fatalf("load after deletes = %v", got)
	}
}

func TestAuth(t *testing.T) {
	c := serve(t, memstore.New(memstore.Options{}), server.Options{AuthToken: "s3cret"})
	c.ok("GET", api.PathLoadStats+"?cluster=x", nil, nil)

	for _, tc := range []struct{ name, header string }{
		{"none", ""}, {"wrong", "Bearer nope"}, {"prefix", "Bearer s3cre"}, {"scheme", "Basic s3cret"}, {"raw", "s3cret"},
	} {
		req, _ := http.NewRequest("POST", c.base+api.PathRouteQuery, strings.NewReader(`{"cluster":"x","hashes":[]}`))
		if tc.header != "" {
			req.Header.Set("Authorization", tc.header)
		}
		req.Header.Set("X-Request-Id", "trace-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var e api.Error
		err = json.NewDecoder(resp.Body).Decode(&e)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 401 || e.Error.Code != 401 || e.Error.Type != "unauthorized" || e.TraceID != "trace-1" {
			t.Fatalf("%s: %d %+v %v", tc.name, resp.StatusCode, e, err)
		}
		if resp.Header.Get("WWW-Authenticate") == "" {
			t.Fatalf("%s: no WWW-Authenticate", tc.name)
		}
	}
	// Probes and metrics stay open.
	for _, p := range []string{api.PathHealthz, api.PathReadyz, api.PathMetrics} {
		resp, err := http.Get(c.base + p)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s without token: %d", p, resp.StatusCode)
		}
	}
}

// TestLeaseExpiryHTTP: a gateway adds and dies; its lease disappears on its own.
func TestLeaseExpiryHTTP(t *testing.T) {
	clock := storetest.NewClock()
	c := serve(t, memstore.New(memstore.Options{LeaseTTL: time.Minute, Now: clock.Now}), server.Options{})
	c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: "10.0.0.9:1", RequestID: "orphan", PromptLength: 9}, nil)
	clock.Advance(time.Minute - time.Millisecond)
	if got := c.load(cl); got["10.0.0.9:1"].TotalReqs != 1 {
		t.Fatalf("lease gone early: %v", got)
	}
	clock.Advance(time.Millisecond)
	var ans api.RouteAnswer
	c.ok("POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl, Hashes: []string{}}, &ans)
	if len(ans.Load) != 0 {
		t.Fatalf("expired lease still counted: %v", ans.Load)
	}
}

// TestRedisOutage: Redis stops under a running server; calls fail fast
// with 503, /readyz says not ready, and everything comes back on its own
// once Redis is back, without restarting the server.
func TestRedisOutage(t *testing.T) {
	srv := redistest.Start(t)
	st, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: srv.Prefix})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	reg := prometheus.NewRegistry()
	c := serve(t, st, server.Options{Registry: reg})
	route := api.RouteQuery{Cluster: cl, Hashes: hexes(0, 64)}
	c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: "10.0.0.1:1", Hashes: hexes(0, 64)}, nil)
	c.ok("POST", api.PathRouteQuery, route, nil)
	c.ok("GET", api.PathReadyz, nil, nil)

	srv.Stop()
	for _, call := range []struct {
		method, path string
		body         any
	}{
		{"POST", api.PathRouteQuery, route},
		{"POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: "10.0.0.1:1", RequestID: "r"}},
		{"GET", api.PathLoadStats + "?cluster=x", nil},
		{"POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: "10.0.0.1:1", Hashes: hexes(0, 1)}},
		{"GET", api.PathReadyz, nil},
	} {
		start := time.Now()
		c.fails(call.method, call.path, call.body, 503, "store_unavailable", "")
		// Bounded by the store timeouts (a few hundred ms); generous here
		// because two cores are shared with other test binaries.
		if d := time.Since(start); d > 3*time.Second {
			t.Fatalf("%s %s took %v with Redis down", call.method, call.path, d)
		}
	}
	c.ok("GET", api.PathHealthz, nil, nil) // alive, just not ready
	_, raw := c.do("GET", api.PathMetrics, nil)
	for _, line := range []string{
		"llmf_metadata_center_store_up 0",
		`llmf_metadata_center_store_errors_total{op="route query"} 1`,
		`llmf_metadata_center_requests_total{code="503",endpoint="/v1/route/query",method="POST"} 1`,
	} {
		if !strings.Contains(string(raw), line+"\n") {
			t.Errorf("metrics during outage lack %q", line)
		}
	}

	srv.Restart()
	wait.For(t, 15*time.Second, "the server to be ready after Redis came back", func() bool {
		code, _ := c.do("GET", api.PathReadyz, nil)
		return code == 200
	})
	// The restarted Redis is empty: the index is rebuilt by new saves.
	var ans api.RouteAnswer
	c.ok("POST", api.PathRouteQuery, route, &ans)
	if len(ans.Cache) != 0 {
		t.Fatalf("fresh Redis answered %v", ans.Cache)
	}
	c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: "10.0.0.1:1", Hashes: hexes(0, 64)}, nil)
	c.ok("POST", api.PathRouteQuery, route, &ans)
	if want := []api.CacheLocation{{Host: "10.0.0.1:1", Length: 64}}; !reflect.DeepEqual(ans.Cache, want) {
		t.Fatalf("after recovery: %v", ans.Cache)
	}
}

// TestStoreTimeout: a Redis that accepts connections but never answers
// (hung, or a black-holed network path) yields 503 within the bound, not a
// hung request.
func TestStoreTimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			// Read and drop everything; never reply.
			go func() { _, _ = io.Copy(io.Discard, conn) }()
		}
	}()
	st, err := redisstore.New(redisstore.Options{Addr: ln.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	c := serve(t, st, server.Options{StoreTimeout: 200 * time.Millisecond})
	for _, p := range []string{api.PathRouteQuery, api.PathCacheQuery} {
		start := time.Now()
		c.fails("POST", p, api.RouteQuery{Cluster: cl, Hashes: hexes(0, 4)}, 503, "store_unavailable", "")
		if d := time.Since(start); d > 3*time.Second {
			t.Fatalf("%s took %v against a silent Redis", p, d)
		}
	}
	c.fails("GET", api.PathReadyz, nil, 503, "store_unavailable", "not ready")
}
