package tracing

import (
	"context"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

func TestOptionsValidate(t *testing.T) {
	for _, o := range []Options{{}, {Endpoint: "http://collector:4318", SampleRatio: 1}, {Endpoint: "https://c/v1/traces", SampleRatio: 0}} {
		if err := o.Validate(); err != nil {
			t.Errorf("%+v: %v", o, err)
		}
	}
	for _, o := range []Options{{SampleRatio: -0.1}, {SampleRatio: 1.5}, {Endpoint: "collector:4318"}, {Endpoint: "ftp://c"}, {Endpoint: "http://"}} {
		if err := o.Validate(); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
	if p, err := New(Options{}); err != nil || p.Enabled() {
		t.Fatalf("no endpoint: %v, enabled %v", err, p.Enabled())
	}
}

// A provider exports to its endpoint's /v1/traces, continues a caller's
// traceparent, and once shut down leaves no goroutine behind (the filter's
// configs come and go inside Envoy).
func TestExportPropagateAndShutdown(t *testing.T) {
	var spans atomic.Int64
	var traceIDs atomic.Value
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if r.URL.Path != "/v1/traces" || proto.Unmarshal(b, &req) != nil {
			http.Error(w, "bad export", 400)
			return
		}
		for _, rs := range req.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				for _, s := range ss.GetSpans() {
					spans.Add(1)
					traceIDs.Store(s.GetTraceId())
				}
			}
		}
	}))
	defer recv.Close()
	before := runtime.NumGoroutine()

	p, err := New(Options{Endpoint: recv.URL, SampleRatio: 0, Service: "test"})
	if err != nil {
		t.Fatal(err)
	}
	// Ratio 0 samples no new trace, but a sampled caller's is continued.
	in := http.Header{"Traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}
	ctx, span := p.Tracer(Scope).Start(Extract(context.Background(), in), "parent")
	_, child := Start(ctx, "child")
	out := http.Header{}
	Inject(ctx, out)
	if got := out.Get("traceparent"); !strings.HasPrefix(got, "00-4bf92f3577b34da6a3ce929d0e0e4736-") || strings.Contains(got, "00f067aa0ba902b7") {
		t.Errorf("injected traceparent %q: want the trace continued with this span's id", got)
	}
	child.End()
	span.End()
	_, unsampled := p.Tracer(Scope).Start(context.Background(), "new root")
	unsampled.End()

	sctx, cancel := context.WithTimeout(context.Background(), ShutdownTimeout)
	defer cancel()
	if err := p.Shutdown(sctx); err != nil {
		t.Fatal(err)
	}
	if n := spans.Load(); n != 2 {
		t.Errorf("%d spans exported by the shutdown's flush, want 2 (parent and child, not the unsampled root)", n)
	}
	if id, _ := traceIDs.Load().([]byte); hex.EncodeToString(id) != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("exported trace id %x, want the caller's", id)
	}
	if !wait.Until(5*time.Second, func() bool { return runtime.NumGoroutine() <= before }) {
		buf := make([]byte, 1<<16)
		t.Fatalf("%d goroutines after shutdown, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
	}
}
