// Package podsignals gathers what third-party pods say about themselves for
// the metadata center: it scrapes their Prometheus /metrics (vLLM, SGLang,
// llama.cpp's llama-server) at an interval and records waiting and running
// requests, KV-cache utilization and the KV cache's size through the store's ReportSignals, where
// the route query finds them. Our own workers push the same signals instead
// (worker/mcreport), so they are not scraped.
//
// A pod that cannot be scraped is simply not reported: its last report ages
// past the store's freshness bound and stops being answered, so a dead pod
// never keeps looking idle.
package podsignals

import (
	"fmt"
	"io"
	"math"
	"strconv"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Backend names, as in the filter's model_mapping_rule.*.backend.
const (
	BackendVLLM     = "vllm"
	BackendSGLang   = "sglang"
	BackendLlamaCpp = "llamacpp"
)

// metricNames says where a backend keeps each signal. A signal may have
// several names (renamed across releases): the first one present wins.
type metricNames struct {
	waiting, running, kvUtil []string
	// The KV cache's size in tokens: a gauge of it (kvTokens), or an info
	// metric (value 1) whose num_gpu_blocks and block_size labels give it
	// (kvInfo). Empty: the backend does not say.
	kvTokens, kvInfo string
}

var backends = map[string]metricNames{
	BackendVLLM: {
		waiting: []string{"vllm:num_requests_waiting"},
		running: []string{"vllm:num_requests_running"},
		// kv_cache_usage_perc since vLLM 0.10 (V1), gpu_cache_usage_perc
		// before; both are fractions 0..1 despite the name.
		kvUtil: []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"},
		// The cache configuration, labels and all (vllm/v1/metrics/loggers.py,
		// log_metrics_info("cache_config", ...)).
		kvInfo: "vllm:cache_config_info",
	},
	BackendSGLang: {
		waiting: []string{"sglang:num_queue_reqs"},
		running: []string{"sglang:num_running_reqs"},
		kvUtil:  []string{"sglang:token_usage"},
		// python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector.
		kvTokens: "sglang:max_total_num_tokens",
	},
	BackendLlamaCpp: {
		waiting: []string{"llamacpp:requests_deferred"},
		running: []string{"llamacpp:requests_processing"},
		kvUtil:  []string{"llamacpp:kv_cache_usage_ratio"},
	},
}

// Scrapable reports whether backend's /metrics can be read.
func Scrapable(backend string) bool {
	_, ok := backends[backend]
	return ok
}

// Parse reads a Prometheus text exposition of backend (with
// prometheus/common/expfmt, the format's reference parser) and returns its
// signals. Series of one metric with different labels (vLLM labels by
// model) are summed; utilization takes their maximum. The running count is
// required: a body without it is not the backend's /metrics.
func Parse(backend string, r io.Reader) (api.PodSignals, error) {
	names, ok := backends[backend]
	if !ok {
		return api.PodSignals{}, fmt.Errorf("podsignals: backend %q has no known /metrics (want %s, %s or %s)", backend, BackendVLLM, BackendSGLang, BackendLlamaCpp)
	}
	want := map[string]bool{}
	for _, l := range [][]string{names.waiting, names.running, names.kvUtil} {
		for _, n := range l {
			want[n] = true
		}
	}
	if names.kvTokens != "" {
		want[names.kvTokens] = true
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(r)
	if err != nil {
		return api.PodSignals{}, fmt.Errorf("podsignals: %w", err)
	}
	sum, peak := map[string]float64{}, map[string]float64{}
	for name := range want {
		f := families[name]
		if f == nil {
			continue
		}
		for _, m := range f.GetMetric() {
			value, ok := sampleValue(m)
			if !ok || math.IsNaN(value) {
				continue
			}
			if _, seen := peak[name]; !seen || value > peak[name] {
				peak[name] = value
			}
			sum[name] += value
		}
	}
	first := func(ns []string, m map[string]float64) (float64, bool) {
		for _, n := range ns {
			if v, ok := m[n]; ok {
				return v, true
			}
		}
		return 0, false
	}
	running, ok := first(names.running, sum)
	if !ok {
		return api.PodSignals{}, fmt.Errorf("podsignals: no %s in the %s /metrics answer", names.running[0], backend)
	}
	waiting, _ := first(names.waiting, sum)
	util, _ := first(names.kvUtil, peak)
	capacity := sum[names.kvTokens]
	if names.kvInfo != "" {
		capacity = infoCapacity(families[names.kvInfo])
	}
	return api.PodSignals{
		Waiting:     int64(math.Max(0, math.Round(waiting))),
		Running:     int64(math.Max(0, math.Round(running))),
		KVCacheUtil: math.Min(1, math.Max(0, util)),
		KVCapacity:  int64(math.Max(0, math.Round(capacity))),
	}, nil
}

// infoCapacity is the KV tokens an info metric's series describe, summed
// (one per engine): num_gpu_blocks × block_size; 0 where a label is missing
// or not a number.
func infoCapacity(f *dto.MetricFamily) float64 {
	var total float64
	for _, m := range f.GetMetric() {
		var blocks, size float64
		for _, l := range m.GetLabel() {
			v, err := strconv.ParseFloat(l.GetValue(), 64)
			if err != nil || v < 0 {
				continue
			}
			switch l.GetName() {
			case "num_gpu_blocks":
				blocks = v
			case "block_size":
				size = v
			}
		}
		total += blocks * size
	}
	return total
}

// sampleValue is the value of a gauge, counter or untyped sample.
func sampleValue(m *dto.Metric) (float64, bool) {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue(), true
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue(), true
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue(), true
	}
	return 0, false
}
