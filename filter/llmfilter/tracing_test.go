package llmfilter

import (
	"encoding/hex"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/standalone"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// With key tracing set, a request's span continues the client's
// traceparent, the decision is its child, the pod gets the request span as
// its parent, and Destroy flushes the spans and ends every goroutine the
// config started, the exporter's included (Envoy creates and destroys
// configs for the life of the process).
func TestTracingSpansAndDestroyEndsTheExporter(t *testing.T) {
	type span struct{ name, trace, id, parent string }
	var mu sync.Mutex
	var spans []span
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
					spans = append(spans, span{s.GetName(), hex.EncodeToString(s.GetTraceId()), hex.EncodeToString(s.GetSpanId()), hex.EncodeToString(s.GetParentSpanId())})
				}
			}
		}
	}))
	defer recv.Close()
	before := runtime.NumGoroutine()

	cfg, err := config.Parse([]byte(baseConfig("tracing: {otlp_endpoint: \"" + recv.URL + "\", sample_ratio: 0}\n")))
	if err != nil {
		t.Fatal(err)
	}
	conf, err := NewParser(ParserOptions{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Build(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := newStream(t, conf)
	const traceID, clientSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	h := reqHeaders("traceparent", "00-"+traceID+"-"+clientSpan+"-01")
	if ev := s.decode(h, chat("qwen", false, "hi")); ev.reply {
		t.Fatalf("local reply %d %s", ev.code, ev.body)
	}
	tp, _ := h.Get("traceparent")
	parts := strings.Split(tp, "-")
	if len(parts) != 4 || parts[1] != traceID || parts[2] == clientSpan || parts[3] != "01" {
		t.Fatalf("traceparent to the pod %q: want trace %s continued by the gateway's span, sampled", tp, traceID)
	}
	resp := standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"application/json"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, true) }); st != api.Continue {
		t.Fatalf("EncodeHeaders = %v", st)
	}
	s.end(resp)
	conf.Destroy()

	got := map[string]span{}
	wait.For(t, 10*time.Second, "the request's spans", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, sp := range spans {
			got[sp.name] = sp
		}
		return len(got) == 2
	})
	req, dec := got["llm_gateway.request"], got["routing.decide"]
	if req.trace != traceID || req.parent != clientSpan || req.id != parts[2] {
		t.Errorf("request span %+v: want trace %s, parent %s (the client's), id %s (sent to the pod)", req, traceID, clientSpan, parts[2])
	}
	if dec.trace != traceID || dec.parent != req.id {
		t.Errorf("decision span %+v: want the request span's child", dec)
	}
	if !wait.Until(10*time.Second, func() bool { return runtime.NumGoroutine() <= before }) {
		buf := make([]byte, 1<<16)
		t.Fatalf("%d goroutines after Destroy, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
	}
}
