package envoyhost

import (
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// Through the real .so with key tracing: the request's spans reach an
// OTLP/HTTP receiver, and replacing and then dropping the config (Envoy's
// Destroy) flushes and shuts the exporter down without taking the host
// down.
func TestTracingInEnvoy(t *testing.T) {
	var mu sync.Mutex
	names := map[string]string{} // span name -> trace id
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if r.URL.Path != "/v1/traces" || proto.Unmarshal(b, &req) != nil {
			http.Error(w, "bad export", http.StatusBadRequest)
			return
		}
		mu.Lock()
		defer mu.Unlock()
		for _, rs := range req.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				for _, s := range ss.GetSpans() {
					names[s.GetName()] = hex.EncodeToString(s.GetTraceId())
				}
			}
		}
	}))
	defer recv.Close()

	_, mc := newMetadataCenter(t)
	pod := simWorker(t)
	h := startHost(t, Options{LogLevel: 3, Clusters: map[string][]string{"pool": {pod}}})
	tracing := fmt.Sprintf("tracing: {otlp_endpoint: %q}\n", recv.URL)
	if _, err := h.PushConfig([]byte(filterDoc(mc, []string{pod}, tracing))); err != nil {
		t.Fatal(err)
	}
	if resp, body := post(t, h.URL(), chatBody("trace me", false)); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	// A new config destroys the first; then the listener goes.
	if _, err := h.PushConfig([]byte(filterDoc(mc, []string{pod}, tracing))); err != nil {
		t.Fatal(err)
	}
	if err := h.DropConfig(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the request's spans", 15*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		tid := names["llm_gateway.request"]
		return tid != "" && names["routing.decide"] == tid && names["metadata_center.route_query"] == tid
	})
	if err := h.Err(); err != nil {
		t.Fatalf("host: %v\n%s", err, h.Stderr())
	}
}
