package llmfilter

import (
	"sync"
	"sync/atomic"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
	"github.com/prometheus/client_golang/prometheus"
)

// Counter names: the engine's (routed, cache_hit_routes, fallbacks,
// metadata_center_errors, async_dropped) and the filter's own.
var counterNames = []string{
	"routed", "cache_hit_routes", "fallbacks", "metadata_center_errors", "async_dropped", "async_errors", "rejected",
	"requests", "local_replies", "upstream_errors", "transcode_errors", "panics",
}

// gaugeNames are moved by Count with ±delta.
var gaugeNames = []string{"in_flight"}

// metricPrefix namespaces the stats in Envoy's /stats next to everything else.
const metricPrefix = "llm_filter_"

// Metrics is engine.Metrics; the filter reports its own events through it too.
type Metrics interface {
	Count(name string, delta int64)
}

// envoyMetrics is engine.Metrics over Envoy's stats. The metric handles are
// defined once in Parse (DefineCounterMetric is a config-time call) and the
// maps are read-only afterwards.
//
// The handles belong to the config Envoy parsed them for. Envoy expires
// that config's handle before it calls Destroy (FilterConfig's weak_ptr in
// cgo.cc envoyGoConfigHandlerWrapper), and from then on the SDK panics on
// every metric call — from our dispatcher goroutines, a process abort. So
// close stops all counting under the write lock (no Count is in flight
// once it returns) and Count recovers the panic of the short window between
// the handle's expiry and Destroy.
type envoyMetrics struct {
	counters map[string]api.CounterMetric
	gauges   map[string]api.GaugeMetric

	mu     sync.RWMutex
	closed bool
}

func newEnvoyMetrics(cb api.ConfigCallbacks) *envoyMetrics {
	if cb == nil {
		// Route-level configs are parsed without callbacks; Merge lends them
		// the listener-level metrics.
		return nil
	}
	m := &envoyMetrics{counters: map[string]api.CounterMetric{}, gauges: map[string]api.GaugeMetric{}}
	for _, n := range counterNames {
		m.counters[n] = cb.DefineCounterMetric(metricPrefix + n)
	}
	for _, n := range gaugeNames {
		m.gauges[n] = cb.DefineGaugeMetric(metricPrefix + n)
	}
	return m
}

// Count drops names it does not know rather than define metrics on a worker
// thread: a new name must be added to counterNames.
func (m *envoyMetrics) Count(name string, delta int64) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.closed {
		return
	}
	defer func() { _ = recover() }() // the config's handle expired: nothing to count into
	if c, ok := m.counters[name]; ok {
		if delta > 0 {
			c.Increment(delta)
		}
		return
	}
	if g, ok := m.gauges[name]; ok {
		g.Increment(delta)
	}
}

// close ends counting: Envoy's Destroy of the config that owns the handles.
func (m *envoyMetrics) close() {
	m.mu.Lock()
	m.closed = true
	m.mu.Unlock()
}

// PromMetrics is engine.Metrics over Prometheus, for the standalone gateway.
type PromMetrics struct {
	events *prometheus.CounterVec
	gauges *prometheus.GaugeVec
}

// NewPromMetrics registers llm_filter_events_total{event} and
// llm_filter_in_flight on reg.
func NewPromMetrics(reg prometheus.Registerer) (*PromMetrics, error) {
	m := &PromMetrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "llm_filter_events_total",
			Help: "Filter and decision-engine events: routed, cache_hit_routes, fallbacks, metadata_center_errors, async_dropped, requests, local_replies, ...",
		}, []string{"event"}),
		gauges: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "llm_filter_gauge",
			Help: "Filter gauges: in_flight = requests routed and not finished.",
		}, []string{"name"}),
	}
	for _, c := range []prometheus.Collector{m.events, m.gauges} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, n := range counterNames {
		m.events.WithLabelValues(n) // export zeros so dashboards see every series
	}
	return m, nil
}

func (m *PromMetrics) Count(name string, delta int64) {
	for _, g := range gaugeNames {
		if g == name {
			m.gauges.WithLabelValues(name).Add(float64(delta))
			return
		}
	}
	if delta > 0 {
		m.events.WithLabelValues(name).Add(float64(delta))
	}
}

// metricsRef is the Metrics a config's engine is built with. Route-level
// configs are parsed without callbacks, so they start empty and each Merge
// points them at the parent config it is merged with: Envoy re-merges a
// route config with every new listener config, and the previous parent's
// metrics die with it.
type metricsRef struct {
	p   atomic.Pointer[metricsBox]
	own bool // built with its own metrics: Merge leaves it alone
}

type metricsBox struct{ m Metrics }

func newMetricsRef(m Metrics) *metricsRef {
	r := &metricsRef{}
	if m != nil {
		r.p.Store(&metricsBox{m})
		r.own = true
	}
	return r
}

func (r *metricsRef) Count(name string, delta int64) {
	if b := r.p.Load(); b != nil {
		b.m.Count(name, delta)
	}
}

func (r *metricsRef) empty() bool { return r.p.Load() == nil }

// adopt makes r report into other's metrics (the latest parent wins),
// unless r has its own.
func (r *metricsRef) adopt(other *metricsRef) {
	if r.own {
		return
	}
	if b := other.p.Load(); b != nil {
		r.p.Store(b)
	}
}

// close stops r's own Envoy metrics (see envoyMetrics).
func (r *metricsRef) close() {
	if !r.own {
		return
	}
	if b := r.p.Load(); b != nil {
		if em, ok := b.m.(*envoyMetrics); ok {
			em.close()
		}
	}
}
