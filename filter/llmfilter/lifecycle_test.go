package llmfilter

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/standalone"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// With trailers Envoy hands the whole body over as DecodeData(body,
// endStream=false) before DecodeTrailers: the decision must run on it.
func TestBodyBeforeTrailersIsDecided(t *testing.T) {
	conf, m := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	if st := s.phase(false, func() api.StatusType { return s.f.DecodeHeaders(reqHeaders(), false) }); st != api.StopAndBuffer {
		t.Fatalf("DecodeHeaders = %v", st)
	}
	buf := standalone.NewBuffer([]byte(chat("qwen", false, "trailers follow")))
	if st := s.phase(false, func() api.StatusType { return s.f.DecodeData(buf, false) }); st != api.Running {
		t.Fatalf("DecodeData(body, endStream=false) = %v, want Running (the decision)", st)
	}
	if ev := s.e.wait(); ev.reply || ev.status != api.Continue {
		t.Fatalf("decision ended with %+v", ev)
	}
	if s.e.override == "" || m.get("routed") != 1 {
		t.Fatalf("not routed: override %q routed %d", s.e.override, m.get("routed"))
	}
	if st := s.phase(false, func() api.StatusType { return s.f.DecodeTrailers(nil) }); st != api.Continue {
		t.Fatalf("DecodeTrailers = %v", st)
	}
	s.end(nil)
}

// Envoy drops strict for an override posted from a goroutine and routes to
// a member of the cluster: the filter names the pod that really served.
func TestServedByAnotherPodIsReported(t *testing.T) {
	conf, _ := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	s.e.members = map[string]bool{"127.0.0.1:7777": true} // the filter's pods are not in Envoy's cluster
	if ev := s.decode(reqHeaders(), chat("qwen", false, "stale endpoints")); ev.reply {
		t.Fatalf("refused: %s", ev.body)
	}
	if s.e.strict {
		t.Fatal("strict survived a goroutine's override")
	}
	resp := standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"application/json"}})
	s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) })
	if got, _ := resp.Get(headers.UpstreamHost); got != "127.0.0.1:7777" {
		t.Fatalf("%s = %q, want the pod Envoy used", headers.UpstreamHost, got)
	}
	s.end(resp)
}

// A transcoded stream ending with trailers: EncodeTrailers adds the tail
// (final chunk, [DONE]) before the trailers.
func TestStreamTailFlushedAtTrailers(t *testing.T) {
	conf, _ := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	if ev := s.decode(reqHeaders(), chat("tri", true, "stream with trailers")); ev.reply {
		t.Fatalf("refused: %s", ev.body)
	}
	resp := standalone.NewResponseHeaders(200, http.Header{"Content-Type": {"text/event-stream"}})
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeHeaders(resp, false) }); st != api.Continue {
		t.Fatalf("EncodeHeaders = %v", st)
	}
	buf := standalone.NewBuffer([]byte("data: {\"text_output\":\"hi\"}\n\n"))
	s.phase(true, func() api.StatusType { return s.f.EncodeData(buf, false) })
	if st := s.phase(true, func() api.StatusType { return s.f.EncodeTrailers(nil) }); st != api.Continue {
		t.Fatalf("EncodeTrailers = %v", st)
	}
	if !strings.Contains(string(s.e.added), "data: [DONE]") {
		t.Fatalf("tail added before the trailers: %q", s.e.added)
	}
	s.end(resp)
}

// expiringMetric panics like the SDK once its config's handle expired.
type expiringMetric struct {
	expired *atomic.Bool
	calls   *atomic.Int64
}

func (m expiringMetric) Increment(int64) {
	if m.expired.Load() {
		panic("request has been finished")
	}
	m.calls.Add(1)
}
func (m expiringMetric) Get() uint64   { return 0 }
func (m expiringMetric) Record(uint64) {}

type expiringCallbacks struct {
	expired atomic.Bool
	calls   atomic.Int64
}

func (c *expiringCallbacks) DefineCounterMetric(string) api.CounterMetric {
	return expiringMetric{&c.expired, &c.calls}
}
func (c *expiringCallbacks) DefineGaugeMetric(string) api.GaugeMetric {
	return expiringMetric{&c.expired, &c.calls}
}

// Envoy expires the config's handle, then calls Destroy: from then on
// nothing may touch the metrics, and a count in the window between panics
// nowhere.
func TestMetricsAfterDestroyAreNeverTouched(t *testing.T) {
	cb := &expiringCallbacks{}
	cfg, err := config.Parse([]byte(baseConfig("")))
	if err != nil {
		t.Fatal(err)
	}
	conf, err := NewParser(ParserOptions{}).Build(cfg, newEnvoyMetrics(cb, cfg, nil))
	if err != nil {
		t.Fatal(err)
	}
	conf.metrics.Count("routed", 1)
	cb.expired.Store(true)
	conf.metrics.Count("routed", 1) // the window: must not panic
	conf.Destroy()
	before := cb.calls.Load()
	cb.expired.Store(false) // a touch would now be counted
	conf.metrics.Count("routed", 1)
	if cb.calls.Load() != before {
		t.Fatal("a metric was touched after Destroy began")
	}
}

// A route-level config merged with a new parent reports into that parent.
func TestMergeFollowsTheLatestParent(t *testing.T) {
	p1, m1 := newTestConfig(t, baseConfig(""))
	p2, m2 := newTestConfig(t, baseConfig(""))
	cfg, _ := config.Parse([]byte(baseConfig("")))
	p := NewParser(ParserOptions{})
	child, err := p.Build(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(child.Destroy)
	p.Merge(p1, child)
	child.metrics.Count("requests_started", 1)
	p.Merge(p2, child)
	child.metrics.Count("requests_started", 1)
	if m1.get("requests_started") != 1 || m2.get("requests_started") != 1 {
		t.Fatalf("parent 1 got %d, parent 2 got %d; want 1 each", m1.get("requests_started"), m2.get("requests_started"))
	}
}
