package e2e

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// receivedSpan is one span an OTLP exporter sent.
type receivedSpan struct {
	service, name       string
	traceID, id, parent string
}

// otlpReceiver is an OTLP/HTTP trace receiver (protobuf, POST /v1/traces,
// as the collector's otlpreceiver serves it) keeping every span.
type otlpReceiver struct {
	*httptest.Server
	mu    sync.Mutex
	spans []receivedSpan
}

func newOTLPReceiver(t *testing.T) *otlpReceiver {
	r := &otlpReceiver{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodPost || req.URL.Path != "/v1/traces" || req.Header.Get("Content-Type") != "application/x-protobuf" {
			http.Error(w, "want POST /v1/traces application/x-protobuf", http.StatusBadRequest)
			return
		}
		b, err := io.ReadAll(req.Body)
		var msg coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(b, &msg)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.mu.Lock()
		for _, rs := range msg.GetResourceSpans() {
			service := ""
			for _, kv := range rs.GetResource().GetAttributes() {
				if kv.GetKey() == "service.name" {
					service = kv.GetValue().GetStringValue()
				}
			}
			for _, ss := range rs.GetScopeSpans() {
				for _, s := range ss.GetSpans() {
					r.spans = append(r.spans, receivedSpan{service: service, name: s.GetName(),
						traceID: hex.EncodeToString(s.GetTraceId()), id: hex.EncodeToString(s.GetSpanId()), parent: hex.EncodeToString(s.GetParentSpanId())})
				}
			}
		}
		r.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.Write(out)
	}))
	t.Cleanup(r.Close)
	return r
}

// trace returns the spans of one trace, by service and name.
func (r *otlpReceiver) trace(id string) map[string]receivedSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]receivedSpan{}
	for _, s := range r.spans {
		if s.traceID == id {
			out[s.service+" "+s.name] = s
		}
	}
	return out
}

// One request's trace holds the gateway's, the metadata center's and the
// worker's spans: the client's traceparent is continued by the gateway,
// which sends its own to the metadata center (route query) and the pod.
// The same through the real Envoy with our endpoint picker: the picker's
// span is the gateway's.
func TestOneTraceAcrossGatewayMetadataCenterAndWorker(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a llama.cpp worker")
	}
	recv := newOTLPReceiver(t)
	tracing := []string{"--otlp-endpoint", recv.URL}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	f, err := fleet.Start(ctx, fleet.Spec{
		BinDir: binaries(t), LogDir: t.TempDir(), Engine: "llama", Workers: 1,
		Model: testmodel.Path(t), ModelName: "tiny", Policy: "cache_aware",
		WorkerArgs:    append([]string{"--threads", "1"}, tracing...),
		MCArgs:        tracing,
		GatewayFilter: fmt.Sprintf("  tracing: {otlp_endpoint: %q}\n", recv.URL),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Stop()
		if t.Failed() {
			dumpLogs(t, f)
		}
	})
	hosts := []struct{ name, url, service, span, traceID string }{
		{"gateway", f.Gateway, "llm-gateway", "llm_gateway.request", "4bf92f3577b34da6a3ce929d0e0e4736"},
	}
	if url := startEnvoyEPP(t, f); url != "" {
		hosts = append(hosts, struct{ name, url, service, span, traceID string }{
			"envoy-epp", url, "llm-epp", "llm_epp.request", "5bf92f3577b34da6a3ce929d0e0e4737"})
	}
	for _, h := range hosts {
		t.Run(h.name, func(t *testing.T) { oneTrace(t, recv, h.url, h.service, h.span, h.traceID) })
	}
}

// oneTrace sends a request with traceID to the host at url, whose request
// span is service's span, and checks the trace's spans and parents.
func oneTrace(t *testing.T, recv *otlpReceiver, url, service, span, traceID string) {
	const clientSpan = "00f067aa0ba902b7"
	req, _ := http.NewRequest("POST", url+"/v1/chat/completions",
		strings.NewReader(`{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"trace me"}]}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("traceparent", "00-"+traceID+"-"+clientSpan+"-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}

	request, decide, query := service+" "+span, service+" routing.decide", service+" metadata_center.route_query"
	want := []string{
		request, decide, query,
		"llm-metadata-center metadata_center POST /v1/route/query",
		"llm-worker worker.generate", "llm-worker worker.queue_wait", "llm-worker worker.prefill", "llm-worker worker.decode",
	}
	var got map[string]receivedSpan
	// Each process exports in batches (every 5 s by default).
	wait.Until(30*time.Second, func() bool {
		got = recv.trace(traceID)
		for _, w := range want {
			if _, ok := got[w]; !ok {
				return false
			}
		}
		return true
	})
	for _, w := range want {
		if _, ok := got[w]; !ok {
			t.Fatalf("trace %s has no span %q; it has %v", traceID, w, keys(got))
		}
	}
	parentOf := map[string]string{
		request: "", // the client's span
		decide:  request,
		query:   decide,
		"llm-metadata-center metadata_center POST /v1/route/query": query,
		"llm-worker worker.generate":                               request,
		"llm-worker worker.queue_wait":                             "llm-worker worker.generate",
		"llm-worker worker.prefill":                                "llm-worker worker.generate",
		"llm-worker worker.decode":                                 "llm-worker worker.generate",
	}
	for child, parent := range parentOf {
		wantID := clientSpan
		if parent != "" {
			wantID = got[parent].id
		}
		if got[child].parent != wantID {
			t.Errorf("%s: parent %s, want %q (%s)", child, got[child].parent, parent, wantID)
		}
	}
}

func keys(m map[string]receivedSpan) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}
