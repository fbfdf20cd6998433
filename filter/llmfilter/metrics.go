package llmfilter

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
)

// Counter names: the decider's and lifecycle's (routed, cache_hit_routes, fallbacks,
// metadata_center_errors, async_dropped, retractions, served_elsewhere,
// ...) and the filter's own.
var counterNames = []string{
	"routed", "cache_hit_routes", "fallbacks", "metadata_center_errors", "async_dropped", "async_errors", "async_batches", "rejected",
	"requests", "local_replies", "upstream_errors", "transcode_errors", "panics",
	"retractions", "served_elsewhere",
}

// gaugeNames are moved by Count with ±delta.
var gaugeNames = []string{"in_flight"}

// metricPrefix namespaces the stats in Envoy's /stats next to everything else.
const metricPrefix = "llm_filter_"

// Metrics is what a config reports to: the events routing and lifecycle
// count (routing.Metrics) and the filter's own, its histograms and the
// labelled request counter. Both hosts export them under the same names
// (docs/operations.md, "Metrics and alerts").
type Metrics interface {
	routing.Metrics
	// Observe records one value of a histogram, in the histogram's unit.
	Observe(histogram string, value uint64)
	// Request counts one finished request.
	Request(RequestLabels)
}

// Histograms, in integer units because Envoy records integers.
const (
	HistTTFT       = "llm_filter_ttft_milliseconds"                 // routed request: start to first response byte
	HistDuration   = "llm_filter_request_duration_milliseconds"     // routed request: start to end of stream
	HistDecision   = "llm_filter_decision_duration_microseconds"    // the decider's Decide, route query included
	HistRouteQuery = "llm_filter_route_query_duration_microseconds" // the metadata center's route query
)

// HistogramNames lists the histograms.
var HistogramNames = []string{HistTTFT, HistDuration, HistDecision, HistRouteQuery}

// HistogramBuckets are Envoy's default histogram bounds
// (HistogramSettingsImpl::defaultBuckets), so both hosts bucket alike.
var HistogramBuckets = []float64{0.5, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000, 600000, 1800000, 3600000}

// RequestsFamily counts finished requests by RequestLabels.
const RequestsFamily = "llm_filter_requests_total"

// RequestLabelNames are the labels of RequestsFamily, in stat-name order.
var RequestLabelNames = []string{"model", "cluster", "scene", "policy", "outcome"}

// Outcomes of a request (label outcome).
const (
	OutcomeSuccess       = "success"        // 2xx from the pod the filter chose
	OutcomeUpstreamError = "upstream_error" // the pod answered non-2xx
	OutcomeFailed        = "failed"         // routed, then a local reply (no healthy upstream, reset, transcoding)
	OutcomeCancelled     = "cancelled"      // the client left before an answer
	OutcomeRejected      = "rejected"       // refused by the filter before routing (4xx/5xx error document)
	OutcomeAnswered      = "answered"       // answered by the filter itself (GET /v1/models)
	OutcomeUnrouted      = "unrouted"       // passed through without a decision (no body)
)

// Outcomes lists every outcome.
var Outcomes = []string{OutcomeSuccess, OutcomeUpstreamError, OutcomeFailed, OutcomeCancelled, OutcomeRejected, OutcomeAnswered, OutcomeUnrouted}

// NoLabel stands for a label without value (a request no rule matched).
const NoLabel = "none"

// RequestLabels are the labels of one finished request. Model, cluster
// and scene come from the matched rule, never from the client, so the
// series are bounded by the configuration.
type RequestLabels struct {
	Model, Cluster, Scene, Policy, Outcome string
}

func labelValue(v string) string {
	if v == "" {
		return NoLabel
	}
	// ";" and "=" delimit labels in the Envoy stat name.
	if strings.ContainsAny(v, ";=") {
		return labelEscaper.Replace(v)
	}
	return v
}

var labelEscaper = strings.NewReplacer(";", "_", "=", "_")

func (l RequestLabels) values() []string {
	return []string{labelValue(l.Model), labelValue(l.Cluster), labelValue(l.Scene), labelValue(l.Policy), labelValue(l.Outcome)}
}

// EnvoyStatName is the Envoy counter of these labels:
// llm_filter_requests_total;model=M;cluster=C;scene=S;policy=P;outcome=O.
// The Go SDK has no labels; the gateway's stats_tags (istio/envoyfilter.yaml)
// turn the ";k=v" parts back into Prometheus labels.
func (l RequestLabels) EnvoyStatName() string {
	var b strings.Builder
	b.WriteString(RequestsFamily)
	for i, v := range l.values() {
		b.WriteString(";" + RequestLabelNames[i] + "=" + v)
	}
	return b.String()
}

// requestLabelSets is every RequestLabels a config can produce: Envoy
// counters are defined at config time.
func requestLabelSets(cfg *config.Config) []RequestLabels {
	var out []RequestLabels
	for _, o := range []string{OutcomeRejected, OutcomeAnswered, OutcomeUnrouted, OutcomeCancelled} {
		out = append(out, RequestLabels{Outcome: o})
	}
	models := make([]string, 0, len(cfg.ModelMappingRule))
	for m := range cfg.ModelMappingRule {
		models = append(models, m)
	}
	slices.Sort(models)
	for _, m := range models {
		for _, r := range cfg.ModelMappingRule[m] {
			for _, o := range []string{OutcomeSuccess, OutcomeUpstreamError, OutcomeFailed, OutcomeCancelled} {
				l := RequestLabels{Model: m, Cluster: r.Cluster, Scene: r.SceneName, Policy: cfg.LBMappingRule.For(r.Cluster).Policy, Outcome: o}
				if !slices.Contains(out, l) {
					out = append(out, l)
				}
			}
		}
	}
	return out
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
	gauges   map[string]api.GaugeMetric
	hists    map[string]func(uint64)
	requests map[RequestLabels]api.CounterMetric

	mu     sync.RWMutex
	closed bool
}

func newEnvoyMetrics(cb api.ConfigCallbackHandler, cfg *config.Config, hist HistogramDefiner) *envoyMetrics {
	if cb == nil {
		// Route-level configs are parsed without callbacks; Merge lends them
		// the listener-level metrics.
		return nil
	}
	m := &envoyMetrics{counters: map[string]api.CounterMetric{}, gauges: map[string]api.GaugeMetric{},
		hists: map[string]func(uint64){}, requests: map[RequestLabels]api.CounterMetric{}}
	for _, n := range counterNames {
		m.counters[n] = cb.DefineCounterMetric(metricPrefix + n)
	}
	for _, n := range gaugeNames {
		m.gauges[n] = cb.DefineGaugeMetric(metricPrefix + n)
	}
	for _, l := range requestLabelSets(cfg) {
		m.requests[l] = cb.DefineCounterMetric(l.EnvoyStatName())
	}
	if hist != nil {
		for _, n := range HistogramNames {
			if rec, ok := hist(cb, n); ok {
				m.hists[n] = rec
			}
		}
	}
	return m
}

// Observe records into an Envoy histogram (dropped without a definer).
func (m *envoyMetrics) Observe(name string, v uint64) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.closed {
		return
	}
	defer func() { _ = recover() }()
	if rec := m.hists[name]; rec != nil {
		rec(v)
	}
}

// Request counts a finished request; label sets the config cannot
// produce are dropped (counters exist only from config time).
func (m *envoyMetrics) Request(l RequestLabels) {
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

// PromMetrics is routing.Metrics over Prometheus, for the standalone gateway.
type PromMetrics struct {
	events   *prometheus.CounterVec
	gauges   *prometheus.GaugeVec
	requests *prometheus.CounterVec
	hists    map[string]prometheus.Histogram
}

// NewPromMetrics registers llm_filter_events_total{event} and
// llm_filter_in_flight on reg.
func NewPromMetrics(reg prometheus.Registerer) (*PromMetrics, error) {
	m := &PromMetrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "llm_filter_events_total",
			Help: "Filter, routing and lifecycle events: routed, cache_hit_routes, fallbacks, metadata_center_errors, async_dropped, requests, local_replies, ...",
		}, []string{"event"}),
		gauges: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "llm_filter_gauge",
			Help: "Filter gauges: in_flight = requests routed and not finished.",
		}, []string{"name"}),
	}
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: RequestsFamily,
		Help: "Finished requests by the matched rule's model, cluster and scene, the cluster's policy, and outcome.",
	}, RequestLabelNames)
	m.hists = map[string]prometheus.Histogram{}
	help := map[string]string{
		HistTTFT:       "Routed requests: time from the request's start to the first response byte.",
		HistDuration:   "Routed requests: time from the request's start to the end of the stream.",
		HistDecision:   "Routing decisions (parse, hash, route query, scoring).",
		HistRouteQuery: "Route queries to the metadata center, failures included.",
	}
	cs := []prometheus.Collector{m.events, m.gauges, m.requests}
	for _, n := range HistogramNames {
		h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: n, Help: help[n], Buckets: HistogramBuckets})
		m.hists[n] = h
		cs = append(cs, h)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, n := range counterNames {
		m.events.WithLabelValues(n) // export zeros so dashboards see every series
	}
	return m, nil
}

// Declare exports every request series cfg can produce at zero, as Envoy
// does by defining them when it parses the config: rate() then sees a
// series from its first request on.
func (m *PromMetrics) Declare(cfg *config.Config) {
	for _, l := range requestLabelSets(cfg) {
		m.requests.WithLabelValues(l.values()...)
	}
}

// Observe records into a histogram.
func (m *PromMetrics) Observe(name string, v uint64) {
	if h := m.hists[name]; h != nil {
		h.Observe(float64(v))
	}
}

// Request counts a finished request.
func (m *PromMetrics) Request(l RequestLabels) {
	m.requests.WithLabelValues(l.values()...).Inc()
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

func (r *metricsRef) Observe(name string, v uint64) {
	if b := r.p.Load(); b != nil {
		b.m.Observe(name, v)
	}
}

func (r *metricsRef) Request(l RequestLabels) {
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
