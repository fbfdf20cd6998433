package server

import (
	"context"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
)

type metrics struct {
	requests    *prometheus.CounterVec
	latency     *prometheus.HistogramVec
	storeErrors *prometheus.CounterVec
	// signalReports counts pods' reports accepted (pushed and scraped).
	signalReports prometheus.Counter
	// registrations counts pods' registrations accepted.
	registrations prometheus.Counter
	// chunkMismatch counts eviction reports refused because the worker
	// hashes with another chunk size than the cluster's gateways.
	chunkMismatch prometheus.Counter
	// batchOps counts the updates applied through POST /v1/batch by kind.
	batchOps *prometheus.CounterVec
}

func newMetrics(reg *prometheus.Registry, st store.Health, timeout time.Duration) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "llmf", Subsystem: "metadata_center", Name: "requests_total",
			Help: "HTTP requests by endpoint (route pattern), method and status code.",
		}, []string{"endpoint", "method", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "llmf", Subsystem: "metadata_center", Name: "request_duration_seconds",
			Help: "HTTP request latency by endpoint and method.",
			// The route query sits on every request's critical path with a
			// 100 ms client timeout: resolve the sub-millisecond range.
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"endpoint", "method"}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "llmf", Subsystem: "metadata_center", Name: "store_errors_total",
			Help: "Failed store operations by operation.",
		}, []string{"op"}),
		chunkMismatch: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "llmf", Subsystem: "metadata_center", Name: "chunk_size_mismatch_total",
			Help: "Eviction reports refused (409) because the worker's prompt-hash chunk size differs from the cluster's gateways'.",
		}),
		batchOps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "llmf", Subsystem: "metadata_center", Name: "batch_ops_total",
			Help: "Updates applied through POST /v1/batch, by op.",
		}, []string{"op"}),
	}
	m.signalReports = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "llmf", Subsystem: "metadata_center", Name: "pod_signal_reports_total",
		Help: "Pods' reports about themselves accepted through POST /v1/pods/signals.",
	})
	m.registrations = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "llmf", Subsystem: "metadata_center", Name: "pod_registrations_total",
		Help: "Pods' registrations (labels, models, LoRA adapters) accepted with POST /v1/pods/signals.",
	})
	reg.MustRegister(m.registrations)
	reg.MustRegister(m.requests, m.latency, m.storeErrors, m.chunkMismatch, m.signalReports, m.batchOps, newGauges(st, timeout, m.storeErrors))
	return m
}

func (m *metrics) observe(endpoint, method string, code int, d time.Duration) {
	m.requests.WithLabelValues(endpoint, method, strconv.Itoa(code)).Inc()
	m.latency.WithLabelValues(endpoint, method).Observe(d.Seconds())
}

// gauges reads the store's sizes at scrape time, so the numbers are never
// stale and the request path pays nothing for them.
type gauges struct {
	st                              store.Health
	timeout                         time.Duration
	errs                            *prometheus.CounterVec
	leasesDesc, entriesDesc, upDesc *prometheus.Desc
}

func newGauges(st store.Health, timeout time.Duration, errs *prometheus.CounterVec) *gauges {
	return &gauges{st: st, timeout: timeout, errs: errs,
		leasesDesc: prometheus.NewDesc("llmf_metadata_center_live_leases",
			"Request leases neither deleted nor expired.", nil, nil),
		entriesDesc: prometheus.NewDesc("llmf_metadata_center_index_entries",
			"Cache index entries (cluster, host, prefix hash) not expired.", nil, nil),
		upDesc: prometheus.NewDesc("llmf_metadata_center_store_up",
			"1 if the store answered the last scrape, else 0.", nil, nil),
	}
}

func (g *gauges) Describe(ch chan<- *prometheus.Desc) {
	ch <- g.leasesDesc
	ch <- g.entriesDesc
	ch <- g.upDesc
}

func (g *gauges) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), g.timeout)
	defer cancel()
	st, err := g.st.Stats(ctx)
	if err != nil {
		g.errs.WithLabelValues("stats").Inc()
		ch <- prometheus.MustNewConstMetric(g.upDesc, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(g.upDesc, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(g.leasesDesc, prometheus.GaugeValue, float64(st.LiveLeases))
	ch <- prometheus.MustNewConstMetric(g.entriesDesc, prometheus.GaugeValue, float64(st.IndexEntries))
}
