package scheduler

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the scheduler's Prometheus series. Each scheduler registers its
// own set on the registry it is given, so several workers in one process
// (tests, fleet benchmarks) never share counters.
type Metrics struct {
	queueDepth    prometheus.Gauge
	running       *prometheus.GaugeVec
	seqInUse      *prometheus.GaugeVec
	kvItems       prometheus.Gauge
	kvBytes       prometheus.Gauge
	kvEntries     *prometheus.GaugeVec
	promptTokens  *prometheus.CounterVec
	generated     prometheus.Counter
	ttft          prometheus.Histogram
	requests      *prometheus.CounterVec
	evictions     *prometheus.CounterVec
	preemptions   prometheus.Counter
	swaps         prometheus.Counter
	stepDuration  prometheus.Histogram
	stepBatchToks prometheus.Histogram
}

// NewMetrics creates the series and registers them on reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		queueDepth: prometheus.NewGauge(prometheus.GaugeOpts{Name: "llmf_worker_queue_depth", Help: "Requests waiting in the request queue."}),
		running: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "llmf_worker_running_requests",
			Help: "Requests in the running set by state (PENDING waits for a seq id, PROCESSING holds one)."}, []string{"state"}),
		seqInUse: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "llmf_worker_seq_ids_in_use",
			Help: "Sequence ids held, by holder: a running request or an idle KV-cache entry."}, []string{"holder"}),
		kvItems: prometheus.NewGauge(prometheus.GaugeOpts{Name: "llmf_worker_kv_cache_items", Help: "Tokens held in the KV cache over all entries (shared prefixes counted per entry)."}),
		kvBytes: prometheus.NewGauge(prometheus.GaugeOpts{Name: "llmf_worker_kv_cache_bytes", Help: "KV-cache bytes of those tokens."}),
		kvEntries: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "llmf_worker_kv_cache_entries",
			Help: "KV-cache entries, by whether a running request uses them."}, []string{"state"}),
		promptTokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "llmf_worker_prompt_tokens_total",
			Help: "Prompt tokens by source: cached (reused from the KV cache) or computed (prefilled)."}, []string{"source"}),
		generated: prometheus.NewCounter(prometheus.CounterOpts{Name: "llmf_worker_generated_tokens_total", Help: "Generated tokens; its rate is tokens/s."}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "llmf_worker_ttft_seconds", Help: "Time from submission to the first generated token.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "llmf_worker_requests_total", Help: "Finished requests by final state."}, []string{"state"}),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "llmf_worker_kv_evictions_total",
			Help: "KV-cache entries evicted, by cause: threshold, seq_ids (a new request needed an id), kv_full (llama_decode found no cells), park_bytes (parking an idle entry would exceed --kv-park-max-bytes)."}, []string{"cause"}),
		preemptions: prometheus.NewCounter(prometheus.CounterOpts{Name: "llmf_worker_preemptions_total", Help: "Running requests sent back to PENDING because the KV cache was full."}),
		swaps: prometheus.NewCounter(prometheus.CounterOpts{Name: "llmf_worker_swaps_total",
			Help: "Running requests whose cells were moved to host memory because the KV cache was full; they resume from them."}),
		stepDuration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "llmf_worker_step_seconds", Help: "Duration of one batched decode step.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}),
		stepBatchToks: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "llmf_worker_step_batch_tokens", Help: "Tokens evaluated per decode step.",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256, 512}}),
	}
	if reg != nil {
		reg.MustRegister(m.queueDepth, m.running, m.seqInUse, m.kvItems, m.kvBytes, m.kvEntries, m.promptTokens,
			m.generated, m.ttft, m.requests, m.evictions, m.preemptions, m.swaps, m.stepDuration, m.stepBatchToks)
	}
	for _, s := range []State{Completed, Timeout, Failed, Cancelled} {
		m.requests.WithLabelValues(s.String())
	}
	for _, c := range []string{"threshold", "seq_ids", "kv_full"} {
		m.evictions.WithLabelValues(c)
	}
	m.promptTokens.WithLabelValues("cached")
	m.promptTokens.WithLabelValues("computed")
	return m
}
