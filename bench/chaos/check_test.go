package chaos

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	workerserver "github.com/istio-llm-filter/istio-llm-filter/worker/server"
)

// An index entry whose pod neither holds nor pends the prefix is forgiven
// only while the index cannot know better: the pod evicted it and the
// center had not acknowledged the report when the index was read, within
// EvictionBound, or the pod refused a request carrying it within
// RetractionBound. Everything else is wrong: a report acknowledged before
// the read, a late one, an old refusal, a prefix never held, a worker that
// does not answer.
func TestCheckForgivesOnlyWhatTheIndexCannotKnowYet(t *testing.T) {
	now := time.Now().UnixMilli()
	ago := func(d time.Duration) int64 { return now - d.Milliseconds() }
	kv := workerserver.KVPrefixes{
		Prefixes: []string{"held"},
		Pending:  []string{"pending"},
		Evicted: []workerserver.Gone{
			{Hash: "unreported", At: ago(300 * time.Millisecond)},                                          // in transit
			{Hash: "acked-after", At: ago(200 * time.Millisecond), Reported: now + 50},                     // in transit: acknowledged after the read began
			{Hash: "acked-before", At: ago(200 * time.Millisecond), Reported: ago(150 * time.Millisecond)}, // wrong: the center knew
			{Hash: "evicted-after", At: now + 30, Reported: now + 31},                                      // held: evicted after the read
			{Hash: "late", At: ago(3 * time.Second)},                                                       // wrong: report beyond the bound
		},
		EvictedSince: ago(10 * time.Second),
		Refused: []workerserver.Gone{
			{Hash: "refused", At: ago(100 * time.Millisecond)},   // retracting
			{Hash: "refused-long-ago", At: ago(3 * time.Second)}, // wrong
		},
	}
	wk := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != workerserver.PathDebugKVPrefixes {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(kv)
	}))
	t.Cleanup(wk.Close)
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "gone", http.StatusServiceUnavailable)
	}))
	t.Cleanup(down.Close)
	addr := func(ts *httptest.Server) string { return strings.TrimPrefix(ts.URL, "http://") }
	index := map[string][]string{
		addr(wk):   {"held", "evicted-after", "pending", "unreported", "acked-after", "acked-before", "late", "refused", "refused-long-ago", "never"},
		addr(down): {"held"},
	}
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

	c := Checker{MC: mc.URL, Cluster: "pool", Workers: []string{addr(wk), addr(down)}, HTTP: http.DefaultClient}
	ch := c.Check(context.Background(), func() int { return 0 })
	got := [...]int{ch.IndexEntries, ch.IndexTrue, ch.IndexPending, ch.IndexInTransit, ch.IndexRetracting, ch.FalseByHost[addr(wk)], ch.FalseByHost[addr(down)]}
	want := [...]int{11, 2, 1, 2, 1, 4, 1}
	if got != want {
		t.Fatalf("entries, held, pending, in transit, retracting, wrong on the worker, wrong on the one down: %v, want %v", got, want)
	}
	if ch.Precision != 6.0/11 || ch.ReportLatencyMax != 250 {
		t.Fatalf("precision %v, longest report %v ms; want 6/11 and 250", ch.Precision, ch.ReportLatencyMax)
	}
}

// A worker whose eviction list does not reach back over the bound cannot
// clear an entry it neither holds nor lists: wrong, and the reason says so.
func TestClassifyWithAnIncompleteEvictionList(t *testing.T) {
	at := time.Now()
	v := &View{Held: map[string]Holding{}, Since: at.Add(-100 * time.Millisecond).UnixMilli()}
	if k, why := Classify(v, "x", at); k != 0 || !strings.Contains(why, "earlier evictions not listed") {
		t.Fatalf("%v, %q", k, why)
	}
}
