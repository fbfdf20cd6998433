package llmfilter_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
	"github.com/istio-llm-filter/istio-llm-filter/filter/standalone"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// leaseLog records on which hosts leases were added and deleted: it wraps
// the store's Leases, and batches go through the wrapper one op at a time.
type leaseLog struct {
	store.Store
	store.Leases // the inner store's, which AddLease and DeleteLease wrap
	mu           sync.Mutex
	adds, delete []string
}

func (l *leaseLog) AddLease(ctx context.Context, c, h, id string, p int64) error {
	l.mu.Lock()
	l.adds = append(l.adds, h)
	l.mu.Unlock()
	return l.Leases.AddLease(ctx, c, h, id, p)
}

func (l *leaseLog) DeleteLease(ctx context.Context, c, h, id string) error {
	l.mu.Lock()
	l.delete = append(l.delete, h)
	l.mu.Unlock()
	return l.Leases.DeleteLease(ctx, c, h, id)
}

func (l *leaseLog) Parts() store.Parts {
	p := l.Store.Parts()
	p.Leases = l
	p.Batch = store.Sequential{Leases: l, Index: p.Index}
	return p
}

func (l *leaseLog) hosts() (adds, deletes []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.adds), slices.Clone(l.delete)
}

// The filter knows a pod that is not a healthy member of the routed
// cluster any more; the host, as Envoy does with a non-strict override,
// sends the request to a member its load balancer picks. The lease and the
// prefix then follow the pod that really served: added and saved there,
// done and withdrawn on the chosen one, on both stores (Redis: a real
// redis-server). When the real pod refuses (503), nothing is left in the
// index at all.
func TestLeaseAndPrefixFollowThePodThatServed(t *testing.T) {
	stores := map[string]func(t *testing.T) store.Store{
		"memory": func(t *testing.T) store.Store { return memstore.New(memstore.Options{}) },
		"redis": func(t *testing.T) store.Store {
			srv := redistest.Shared(t)
			st, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: srv.Prefix + "-served"})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = st.Close() })
			return st
		},
	}
	for name, mk := range stores {
		t.Run(name, func(t *testing.T) { testServedElsewhere(t, mk(t)) })
	}
}

func testServedElsewhere(t *testing.T, inner store.Store) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	st := &leaseLog{Store: inner, Leases: inner.Parts().Leases}
	mc := httptest.NewServer(server.New(st, server.Options{Logger: quiet}).Handler())
	t.Cleanup(mc.Close)
	real := newBackend(t)
	var refuse sync.Mutex // held: the real pod answers 503
	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !refuse.TryLock() {
			w.Header().Set("content-type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprint(w, `{"error":{"code":503,"type":"service_unavailable","message":"shutting down"}}`)
			return
		}
		refuse.Unlock()
		real.srv.Config.Handler.ServeHTTP(w, r)
	}))
	t.Cleanup(failing.Close)
	servedBy := failing.Listener.Addr().String()
	const gone = "127.0.0.1:1" // the filter's stale endpoint list still has it
	cfg, err := config.Parse([]byte(fmt.Sprintf(`
metadata_center: {address: %q, query_timeout: 1s, update_timeout: 2s}
model_mapping_rule:
  qwen:
    - cluster: tiny-pool
      backend: llamacpp
lb_mapping_rule:
  default: {policy: cache_aware}
endpoints:
  static: {tiny-pool: [%s]}
`, mc.URL, gone)))
	if err != nil {
		t.Fatal(err)
	}
	m := &counts{m: map[string]int64{}}
	conf, err := llmfilter.NewParser(llmfilter.ParserOptions{Logger: quiet}).Build(cfg, m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conf.Destroy)
	host, err := standalone.New(standalone.Options{Factory: llmfilter.Factory, Config: conf, Logger: quiet,
		ClusterHeader: headers.Cluster,
		Member:        func(_, h string) bool { return h == servedBy },
		Fallback:      func(*http.Request, string) string { return servedBy },
	})
	if err != nil {
		t.Fatal(err)
	}
	gw := httptest.NewServer(host)
	t.Cleanup(gw.Close)

	ask := func(prompt string) (*http.Response, []string) {
		t.Helper()
		body := chatBody(prompt, false)
		resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		model, canon, err := openai.Canonical("/v1/chat/completions", []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return resp, prefix.Wire(prefix.Hasher{ChunkSize: prefix.DefaultChunkSize}.Sum(model, canon))
	}
	index := func(hashes []string) []api.CacheLocation {
		t.Helper()
		hs := make([]prefix.Hash, len(hashes))
		for i, w := range hashes {
			hs[i], _ = prefix.ParseHash(w)
		}
		locs, err := inner.Parts().Index.QueryCache(context.Background(), "tiny-pool", hs)
		if err != nil {
			t.Fatal(err)
		}
		return locs
	}
	settled := func(n int) {
		t.Helper()
		waitUntil(t, "the leases to end", func() bool {
			adds, dels := st.hosts()
			load, err := inner.Parts().Leases.LoadStats(context.Background(), "tiny-pool")
			return err == nil && len(load) == 0 && len(adds) == 2*n && len(dels) == 2*n
		})
	}

	resp, hashes := ask("a prompt for a pod that left")
	if resp.StatusCode != 200 || resp.Header.Get(headers.UpstreamHost) != servedBy {
		t.Fatalf("status %d, served by %q; want 200 from %s", resp.StatusCode, resp.Header.Get(headers.UpstreamHost), servedBy)
	}
	settled(1)
	adds, dels := st.hosts()
	if want := []string{gone, servedBy}; !slices.Equal(adds, want) || !slices.Equal(dels, want) {
		t.Fatalf("leases added on %v and deleted on %v; want both %v (moved from the chosen pod to the real one)", adds, dels, want)
	}
	if got, want := index(hashes), []api.CacheLocation{{Host: servedBy, Length: len(hashes)}}; !slices.Equal(got, want) {
		t.Fatalf("index %v, want %v: the prefix is on the pod that served, not on the chosen one", got, want)
	}

	// The real pod refuses: the chosen pod's routing-time save is
	// withdrawn, the real one never saved.
	refuse.Lock()
	first := hashes
	resp, hashes = ask("another prompt for a pod that left")
	refuse.Unlock()
	if resp.StatusCode != 503 {
		t.Fatalf("status %d, want the pod's 503", resp.StatusCode)
	}
	settled(2)
	// What stays is the first request's save: the system message's block
	// (a block of its own), which both prompts share.
	shared := 0
	for shared < min(len(first), len(hashes)) && first[shared] == hashes[shared] {
		shared++
	}
	if shared != 1 {
		t.Fatalf("the prompts share %d blocks, want 1 (the system message)", shared)
	}
	if got, want := index(hashes), []api.CacheLocation{{Host: servedBy, Length: shared}}; !slices.Equal(got, want) {
		t.Fatalf("index %v after the only pod that saw the request refused it; want only the first request's %v", got, want)
	}
	if m.get("served_elsewhere") != 2 || m.get("retractions") != 2 {
		t.Fatalf("served_elsewhere %d, retractions %d; want 2 and 2 (the chosen pod's early saves)", m.get("served_elsewhere"), m.get("retractions"))
	}
}
