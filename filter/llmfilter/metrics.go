package llmfilter

import (
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
)

// Metrics is what a config reports to (gatewaymetrics.Recorder): the
// events routing and lifecycle count and the filter's own, its histograms
// and the labelled request counter. Every host exports them under the
// names of filter/gatewaymetrics (docs/operations.md, "Metrics and alerts").
type Metrics = gatewaymetrics.Recorder

// EnvoyHistogram is the Envoy stat a gateway histogram is recorded in and
// its unit. Envoy records integers, so the .so cannot record seconds: its
// histograms carry their unit in the name, as Envoy's own do
// (istio_request_duration_milliseconds).
func EnvoyHistogram(name string) (stat string, unit time.Duration) {
	switch name {
	case gatewaymetrics.TTFT, gatewaymetrics.RequestDuration:
		return strings.TrimSuffix(name, "_seconds") + "_milliseconds", time.Millisecond
	default:
		return strings.TrimSuffix(name, "_seconds") + "_microseconds", time.Microsecond
	}
}

// HistogramDefiner defines an Envoy histogram on a config's callbacks and
// returns its recorder. The Go SDK of Envoy v1.36 has no histogram call
// (api.ConfigCallbacks: "TODO Histogram") while its C API has one; the
// .so's main package supplies this through cgo (filter/cmd/llm-filter).
type HistogramDefiner func(cb api.ConfigCallbackHandler, name string) (record func(uint64), ok bool)

// envoyMetrics is routing.Metrics over Envoy's stats. The metric handles are
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
	gauge    api.GaugeMetric
	hists    map[string]map[gatewaymetrics.HistLabels]func(uint64)
	requests map[gatewaymetrics.RequestLabels]api.CounterMetric

	mu     sync.RWMutex
	closed bool
}

func newEnvoyMetrics(cb api.ConfigCallbackHandler, cfg *config.Config, hist HistogramDefiner) *envoyMetrics {
	if cb == nil {
		// Route-level configs are parsed without callbacks; Merge lends them
		// the listener-level metrics.
		return nil
	}
	m := &envoyMetrics{counters: map[string]api.CounterMetric{},
		hists: map[string]map[gatewaymetrics.HistLabels]func(uint64){}, requests: map[gatewaymetrics.RequestLabels]api.CounterMetric{}}
	for _, e := range gatewaymetrics.Events {
		m.counters[e] = cb.DefineCounterMetric(gatewaymetrics.EventMetric(e))
	}
	m.gauge = cb.DefineGaugeMetric(gatewaymetrics.InFlightMetric)
	for _, l := range gatewaymetrics.RequestLabelSets(cfg) {
		m.requests[l] = cb.DefineCounterMetric(l.EnvoyStatName())
	}
	if hist != nil {
		for _, n := range gatewaymetrics.Histograms {
			stat, _ := EnvoyHistogram(n)
			m.hists[n] = map[gatewaymetrics.HistLabels]func(uint64){}
			for _, l := range gatewaymetrics.HistLabelSets(cfg) {
				if rec, ok := hist(cb, l.EnvoyStatName(stat)); ok {
					m.hists[n][l] = rec
				}
			}
		}
	}
	return m
}

// Observe records into an Envoy histogram in its unit (dropped without a
// definer, and for label sets the config cannot produce).
func (m *envoyMetrics) Observe(name string, l gatewaymetrics.HistLabels, d time.Duration) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.closed {
		return
	}
	defer func() { _ = recover() }()
	if rec := m.hists[name][l]; rec != nil {
		_, unit := EnvoyHistogram(name)
		rec(uint64(max(d, 0) / unit))
	}
}

// Request counts a finished request; label sets the config cannot
// produce are dropped (counters exist only from config time).
func (m *envoyMetrics) Request(l gatewaymetrics.RequestLabels) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.closed {
		return
	}
	defer func() { _ = recover() }()
	if c, ok := m.requests[l]; ok {
		c.Increment(1)
	}
}

// Count drops names it does not know rather than define metrics on a worker
// thread: a new name must be added to gatewaymetrics.Events.
func (m *envoyMetrics) Count(name string, delta int64) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.closed {
		return
	}
	defer func() { _ = recover() }() // the config's handle expired: nothing to count into
	if name == gatewaymetrics.InFlight {
		m.gauge.Increment(delta)
		return
	}
	if c, ok := m.counters[name]; ok && delta > 0 {
		c.Increment(delta)
	}
}

// close ends counting: Envoy's Destroy of the config that owns the handles.
func (m *envoyMetrics) close() {
	m.mu.Lock()
	m.closed = true
	m.mu.Unlock()
}

// metricsRef is the Metrics a config's decider and reporter are built with. Route-level
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

func (r *metricsRef) Observe(name string, l gatewaymetrics.HistLabels, d time.Duration) {
	if b := r.p.Load(); b != nil {
		b.m.Observe(name, l, d)
	}
}

func (r *metricsRef) Request(l gatewaymetrics.RequestLabels) {
	if b := r.p.Load(); b != nil {
		b.m.Request(l)
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
