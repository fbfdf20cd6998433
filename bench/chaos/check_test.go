package chaos

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	workerserver "github.com/istio-llm-filter/istio-llm-filter/worker/server"
)

// A worker's entries dropped between the two reads count as in transit
// (true) only when it answered both: one that stops answering after the
// first read holds nothing, and the index entries naming it are wrong.
func TestCheckForgivesOnlyWhatAnsweringWorkersDroppedDuringTheCheck(t *testing.T) {
	worker := func(first, second []string, failSecond bool) *httptest.Server {
		var reads atomic.Int32
		ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != workerserver.PathDebugKVPrefixes {
				http.NotFound(w, r)
				return
			}
			held := first
			if reads.Add(1) > 1 {
				if failSecond {
					http.Error(w, "gone", http.StatusServiceUnavailable)
					return
				}
				held = second
			}
			_ = json.NewEncoder(w).Encode(workerserver.KVPrefixes{Prefixes: held})
		}))
		t.Cleanup(ts.Close)
		return ts
	}
	dropping := worker([]string{"a1", "a2", "a3"}, []string{"a1"}, false) // dropped a2, a3 mid-check
	dying := worker([]string{"b1", "b2"}, nil, true)                      // stops answering mid-check
	addr := func(ts *httptest.Server) string { return strings.TrimPrefix(ts.URL, "http://") }
	index := map[string][]string{addr(dropping): {"a1", "a2", "a3", "a4"}, addr(dying): {"b1", "b2"}}
	mc := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case api.PathDebugCacheIndex:
			_ = json.NewEncoder(w).Encode(index)
		case api.PathLoadStats:
			_ = json.NewEncoder(w).Encode(api.LoadStats{})
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(mc.Close)

	c := Checker{MC: mc.URL, Cluster: "pool", Workers: []string{addr(dropping), addr(dying)}, HTTP: http.DefaultClient}
	ch := c.Check(context.Background(), func() int { return 0 })
	// True: a1 (held), a2 and a3 (dropped during the check). Wrong: a4
	// (never held), b1 and b2 (their worker stopped answering).
	if ch.IndexEntries != 6 || ch.IndexTrue != 3 || ch.IndexInTransit != 2 || ch.FalseByHost[addr(dying)] != 2 {
		t.Fatalf("entries %d, true %d, in transit %d, wrong by host %v; want 6, 3, 2, 2 on the worker that stopped answering",
			ch.IndexEntries, ch.IndexTrue, ch.IndexInTransit, ch.FalseByHost)
	}
}
