package scheduler

import (
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// vLLM's histogram buckets (vllm/v1/metrics/loggers.py), so that a
// dashboard or picker built for vLLM reads ours the same way.
var (
	vllmTTFTBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
		20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	vllmTPOTBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
		20.0, 40.0, 80.0}
)

// vllmSeries are the histograms of ExportVLLM, observed by the loop.
type vllmSeries struct {
	ttft, tpot prometheus.Observer
}

// ExportVLLM registers on reg, beside the worker's own series, the
// model-server metrics a Gateway API Inference Extension endpoint picker
// (and the metadata center's scraper, metadata-center/podsignals) reads
// from vLLM, under vLLM's names and meanings, each with the model_name
// label:
//
//   - vllm:num_requests_waiting: requests queued for the running set;
//   - vllm:num_requests_running: requests in the running set;
//   - vllm:kv_cache_usage_perc: the fraction (0..1) of KV cells running
//     requests hold; idle cached cells count free, as vLLM counts cached
//     blocks no request holds (our own llmf_worker_kv_cache_* count them);
//   - vllm:lora_requests_info (with adapters): its value the time of the
//     reading, its labels running_lora_adapters and waiting_lora_adapters
//     (the adapters the running and the waiting requests run: every one
//     loaded, since this worker applies them to every sequence) and
//     max_lora;
//   - vllm:time_to_first_token_seconds and
//     vllm:time_per_output_token_seconds histograms, in seconds, with
//     vLLM's buckets.
//
// Call it before Run.
func (s *Scheduler) ExportVLLM(reg prometheus.Registerer, model string, adapters []string) error {
	label := prometheus.Labels{"model_name": model}
	ttft := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "vllm:time_to_first_token_seconds", ConstLabels: label,
		Help: "Histogram of time to first token in seconds.", Buckets: vllmTTFTBuckets})
	tpot := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "vllm:time_per_output_token_seconds", ConstLabels: label,
		Help: "Histogram of time per output token in seconds.", Buckets: vllmTPOTBuckets})
	cs := []prometheus.Collector{ttft, tpot,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "vllm:num_requests_waiting", ConstLabels: label,
			Help: "Number of requests waiting to be processed."}, func() float64 { return float64(s.Stats().Queued) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "vllm:num_requests_running", ConstLabels: label,
			Help: "Number of requests in model execution batches."}, func() float64 { return float64(s.Stats().Running) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "vllm:kv_cache_usage_perc", ConstLabels: label,
			Help: "KV-cache usage. 1 means 100 percent usage."}, func() float64 { return s.Stats().KVUsage() }),
	}
	if len(adapters) > 0 {
		cs = append(cs, &loraInfo{s: s, model: model, adapters: strings.Join(adapters, ","), max: strconv.Itoa(len(adapters)),
			desc: prometheus.NewDesc("vllm:lora_requests_info", "Running stats on lora requests.",
				[]string{"running_lora_adapters", "waiting_lora_adapters", "max_lora"}, label)})
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	s.vllm = &vllmSeries{ttft: ttft, tpot: tpot}
	return nil
}

// loraInfo is vllm:lora_requests_info, read at every scrape.
type loraInfo struct {
	s               *Scheduler
	model, adapters string
	max             string
	desc            *prometheus.Desc
}

func (l *loraInfo) Describe(ch chan<- *prometheus.Desc) { ch <- l.desc }

func (l *loraInfo) Collect(ch chan<- prometheus.Metric) {
	st := l.s.Stats()
	running, waiting := "", ""
	if st.Running > 0 {
		running = l.adapters
	}
	if st.Queued > 0 {
		waiting = l.adapters
	}
	ch <- prometheus.MustNewConstMetric(l.desc, prometheus.GaugeValue, float64(time.Now().UnixNano())/1e9, running, waiting, l.max)
}
