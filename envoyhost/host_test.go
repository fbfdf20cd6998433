package envoyhost

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// A chat request goes through the real .so: routed by the filter to a pod
// of the cluster, answered by a real (simulated-engine) worker with the
// TTFT predicted for it, its lease taken and released at a real metadata
// center, its stats counted.
func TestRoutedRequestThroughTheRealLibrary(t *testing.T) {
	st, mc := newMetadataCenter(t)
	pods := []string{simWorker(t), simWorker(t)}
	h := startHost(t, Options{Clusters: map[string][]string{"pool": pods}})
	if _, err := h.PushConfig([]byte(filterDoc(mc, pods, ""))); err != nil {
		t.Fatal(err)
	}
	for _, stream := range []bool{false, true} {
		resp, body := post(t, h.URL(), chatBody("hello there", stream))
		if resp.StatusCode != 200 {
			t.Fatalf("stream=%v: status %d: %s", stream, resp.StatusCode, body)
		}
		served := resp.Header.Get(headers.UpstreamHost)
		if served != pods[0] && served != pods[1] {
			t.Fatalf("stream=%v: %s = %q, want one of %v", stream, headers.UpstreamHost, served, pods)
		}
		if ms, err := strconv.ParseFloat(resp.Header.Get(headers.PredictedTTFT), 64); err != nil || ms <= 0 {
			t.Fatalf("stream=%v: %s = %q, want a positive number of milliseconds", stream, headers.PredictedTTFT, resp.Header.Get(headers.PredictedTTFT))
		}
		if share, err := strconv.ParseFloat(resp.Header.Get(headers.PredictedCachedShare), 64); err != nil || share < 0 || share > 1 {
			t.Fatalf("stream=%v: %s = %q, want a share of the prompt", stream, headers.PredictedCachedShare, resp.Header.Get(headers.PredictedCachedShare))
		}
		if stream && !strings.Contains(string(body), "data: [DONE]") {
			t.Fatalf("stream: body is not a finished SSE stream: %q", body)
		}
		if !stream && !strings.Contains(string(body), `"chat.completion"`) {
			t.Fatalf("json: unexpected body %q", body)
		}
	}
	waitUntil(t, "both leases released at the metadata center", 10*time.Second, func() bool {
		return st.adds.Load() == 2 && st.deletes.Load() == 2
	})
	m, err := h.Metrics()
	if err != nil {
		t.Fatal(err)
	}
	if m["llm_filter_routed_total"] != 2 || m["llm_filter_requests_started_total"] != 2 || m["llm_filter_in_flight_requests"] != 0 {
		t.Fatalf("stats: routed=%d requests=%d in_flight=%d, want 2, 2, 0 (all: %v)",
			m["llm_filter_routed_total"], m["llm_filter_requests_started_total"], m["llm_filter_in_flight_requests"], m)
	}
}

// A request without body is not routed by the filter: the route's cluster
// and its own load balancing serve it.
func TestBodylessRequestUsesTheRoutesCluster(t *testing.T) {
	_, mc := newMetadataCenter(t)
	b := newBackend(t)
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {b.addr}}})
	if _, err := h.PushConfig([]byte(filterDoc(mc, []string{b.addr}, ""))); err != nil {
		t.Fatal(err)
	}
	resp, err := (&httpClient).Get(h.URL() + "/health") // /v1/models is the filter's own answer
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("x-served-by") != b.addr {
		t.Fatalf("GET: status %d served by %q", resp.StatusCode, resp.Header.Get("x-served-by"))
	}
	if resp.Header.Get(headers.UpstreamHost) != "" || resp.Header.Get(headers.PredictedTTFT) != "" || resp.Header.Get(headers.PredictedCachedShare) != "" {
		t.Fatal("an unrouted request must not name a routed pod nor a prediction")
	}
}

// Go's GC finalizers release every request's C memory through
// envoyGoFilterHttpFinalize once its stream is destroyed (deferred while
// the filter still exists): none may be missed, none may crash the host.
func TestRequestsAreFinalizedByGoGC(t *testing.T) {
	b := newBackend(t)
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {b.addr}}})
	if _, err := h.PushConfig([]byte(filterDoc("", []string{b.addr}, ""))); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		if resp, body := post(t, h.URL(), chatBody("finalize me", i%2 == 0)); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
	}
	var m map[string]int64
	if wait.Until(10*time.Second, func() bool {
		if err := h.ForceGC(); err != nil {
			t.Fatal(err)
		}
		var err error
		if m, err = h.Metrics(); err != nil {
			t.Fatal(err)
		}
		return m["envoyhost.requests_in_go"] == 20 && m["envoyhost.requests_finalized"] == 20
	}) {
		return
	}
	t.Fatalf("requests seen by Go %d, finalized %d; want 20, 20", m["envoyhost.requests_in_go"], m["envoyhost.requests_finalized"])
}
