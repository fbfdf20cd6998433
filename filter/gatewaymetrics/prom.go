package gatewaymetrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// Recorder is what a gateway host reports to: the events routing and
// lifecycle count (routing.Metrics), the duration histograms and the
// finished requests.
type Recorder interface {
	// Count adds delta to an event counter (one of Events) or moves the
	// InFlight gauge; unknown names are dropped.
	Count(event string, delta int64)
	// Observe records one duration into a histogram (one of Histograms).
	Observe(histogram string, l HistLabels, d time.Duration)
	// Request counts one finished request.
	Request(RequestLabels)
}

// Prom is Recorder over a Prometheus registry: the standalone gateway's
// and the endpoint picker's metrics.
type Prom struct {
	events   map[string]prometheus.Counter
	inFlight prometheus.Gauge
	requests *prometheus.CounterVec
	hists    map[string]*prometheus.HistogramVec
}

// NewProm registers every gateway metric on reg.
func NewProm(reg prometheus.Registerer) (*Prom, error) {
	m := &Prom{
		events: map[string]prometheus.Counter{},
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: InFlightMetric, Help: "Requests routed and not finished.",
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: Requests,
			Help: "Finished requests by the matched rule's model and cluster, scene, the cluster's policy, and outcome.",
		}, RequestLabelNames),
		hists: map[string]*prometheus.HistogramVec{},
	}
	cs := []prometheus.Collector{m.inFlight, m.requests}
	for _, e := range Events {
		c := prometheus.NewCounter(prometheus.CounterOpts{Name: EventMetric(e), Help: eventHelp(e)})
		m.events[e] = c
		cs = append(cs, c)
	}
	for _, n := range Histograms {
		h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: n, Help: HistogramHelp[n], Buckets: Buckets}, HistLabelNames)
		m.hists[n] = h
		cs = append(cs, h)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func eventHelp(e string) string {
	return "Gateway event " + e + " (docs/operations.md, \"Metrics and alerts\")."
}

// Declare exports every series cfg can produce at zero, as Envoy does by
// defining them when it parses the config: rate() then sees a series from
// its first request on.
func (m *Prom) Declare(cfg *config.Config) {
	for _, l := range RequestLabelSets(cfg) {
		m.requests.WithLabelValues(l.Values()...)
	}
	for _, l := range HistLabelSets(cfg) {
		for _, h := range m.hists {
			h.WithLabelValues(l.Values()...)
		}
	}
}

// Observe records a duration in seconds.
func (m *Prom) Observe(name string, l HistLabels, d time.Duration) {
	if h := m.hists[name]; h != nil {
		h.WithLabelValues(l.Values()...).Observe(d.Seconds())
	}
}

// Request counts a finished request.
func (m *Prom) Request(l RequestLabels) {
	m.requests.WithLabelValues(l.Values()...).Inc()
}

// Count adds to an event counter or moves the in-flight gauge.
func (m *Prom) Count(name string, delta int64) {
	if name == InFlight {
		m.inFlight.Add(float64(delta))
		return
	}
	if c := m.events[name]; c != nil && delta > 0 {
		c.Add(float64(delta))
	}
}
