package epp_test

import (
	"bufio"
	"net/http"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// Through the real Envoy, each decided request is a span of the picker's
// that continues the client's traceparent, holds the decision and the
// route query as children, marks the first token, ends with the request,
// and is the parent the pod gets in its traceparent; a refused request's
// span ends with its error.
func TestTracing(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(t.Context()) })
	pods := startPods(t, 2)
	mc := routingtest.Center(t)
	url := startEnvoy(t, startEPPWith(t, fleetFile(mc.URL, addrs(pods)), epp.BuildOptions{Tracer: tp}))

	const traceID, clientSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	spanOf := func(name, trace string) func() *tracetest.SpanStub {
		return func() *tracetest.SpanStub {
			for _, s := range exp.GetSpans() {
				if s.Name == name && s.SpanContext.TraceID().String() == trace {
					return &s
				}
			}
			return nil
		}
	}
	for _, stream := range []bool{false, true} {
		exp.Reset()
		req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(chat(stream, "trace me")))
		req.Header.Set("content-type", "application/json")
		req.Header.Set("traceparent", "00-"+traceID+"-"+clientSpan+"-01")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
		}
		resp.Body.Close()
		served := resp.Header.Get("x-llm-upstream-host")
		if resp.StatusCode != 200 || served == "" {
			t.Fatalf("stream=%v: %d from %q", stream, resp.StatusCode, served)
		}
		var s *tracetest.SpanStub
		wait.For(t, 10*time.Second, "the request's span to end", func() bool { s = spanOf("llm_epp.request", traceID)(); return s != nil })
		if s.Parent.SpanID().String() != clientSpan || !s.Parent.IsRemote() {
			t.Errorf("stream=%v: the span's parent is %s, want the client's %s", stream, s.Parent.SpanID(), clientSpan)
		}
		attrs := map[string]string{}
		for _, kv := range s.Attributes {
			attrs[string(kv.Key)] = kv.Value.Emit()
		}
		if attrs["llm.model"] != "qwen" || attrs["llm.cluster"] != "pool" || attrs["llm.pod"] != served ||
			attrs["llm.policy"] != "cache_aware" || attrs["llm.cache_ratio"] == "" || attrs["llm.outcome"] != "success" || attrs["http.response.status_code"] != "200" {
			t.Errorf("stream=%v: attributes %v", stream, attrs)
		}
		if len(s.Events) != 1 || s.Events[0].Name != "first_token" {
			t.Errorf("stream=%v: events %v, want first_token", stream, s.Events)
		}
		for _, child := range []string{"routing.decide", "metadata_center.route_query"} {
			c := spanOf(child, traceID)()
			if c == nil {
				t.Errorf("stream=%v: no %s span in the trace", stream, child)
			}
		}
		if d := spanOf("routing.decide", traceID)(); d != nil && d.Parent.SpanID() != s.SpanContext.SpanID() {
			t.Errorf("stream=%v: routing.decide's parent %s, want the request's span %s", stream, d.Parent.SpanID(), s.SpanContext.SpanID())
		}
		var got string
		for _, p := range pods {
			if p.addr == served {
				seen := p.requests()
				got = seen[len(seen)-1].Get("traceparent")
			}
		}
		if want := "00-" + traceID + "-" + s.SpanContext.SpanID().String() + "-01"; got != want {
			t.Errorf("stream=%v: the pod got traceparent %q, want %q (the picker's span)", stream, got, want)
		}
	}

	exp.Reset()
	a := post(t, url, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, map[string]string{"traceparent": "00-" + traceID + "-" + clientSpan + "-01"})
	if a.status != 404 {
		t.Fatalf("unknown model: %d", a.status)
	}
	var s *tracetest.SpanStub
	wait.For(t, 10*time.Second, "the refused request's span", func() bool { s = spanOf("llm_epp.request", traceID)(); return s != nil })
	if s.Status.Code.String() != "Error" {
		t.Errorf("a refused request's span has status %v, want Error", s.Status)
	}
}
