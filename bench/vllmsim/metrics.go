package vllmsim

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// ttftBuckets are vLLM's for vllm:time_to_first_token_seconds.
var ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
	1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}

// collector reads a pod's state at scrape time, as vLLM's gauges are set at
// every engine step (so they are never older than one step).
type collector struct {
	p                                            *Pod
	running, waiting, usage, cacheConfig         *prometheus.Desc
	queries, hits, preempt, prompt, gen, success *prometheus.Desc
}

func newTTFT(model string) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{Name: "vllm:time_to_first_token_seconds",
		Help: "Histogram of time to first token in seconds.", Buckets: ttftBuckets,
		ConstLabels: prometheus.Labels{"model_name": model}})
}

func newCollector(p *Pod) *collector {
	labels := prometheus.Labels{"model_name": p.cfg.ModelName}
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, labels) }
	return &collector{
		p: p,
		// An info metric: its labels are the cache configuration, its value 1.
		cacheConfig: prometheus.NewDesc("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", nil,
			prometheus.Labels{"block_size": strconv.Itoa(p.cfg.BlockSize), "num_gpu_blocks": strconv.Itoa(p.cfg.NumBlocks),
				"enable_prefix_caching": "True"}),
		running: d("vllm:num_requests_running", "Number of requests in model execution batches."),
		waiting: d("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
		usage:   d("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
		queries: d("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens."),
		hits:    d("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
		preempt: d("vllm:num_preemptions_total", "Cumulative number of preemption from the engine."),
		prompt:  d("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
		gen:     d("vllm:generation_tokens_total", "Number of generation tokens processed."),
		success: d("vllm:request_success_total", "Count of successfully processed requests."),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.running, c.waiting, c.usage, c.cacheConfig, c.queries, c.hits, c.preempt, c.prompt, c.gen, c.success} {
		ch <- d
	}
	c.p.ttft.Describe(ch)
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	p := c.p
	p.mu.Lock()
	running, waiting, usage, st := len(p.running), len(p.waiting), p.kv.usage(), p.stats
	p.mu.Unlock()
	g := func(d *prometheus.Desc, v float64) { ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v) }
	k := func(d *prometheus.Desc, v int64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	g(c.running, float64(running))
	g(c.waiting, float64(waiting))
	g(c.usage, usage)
	g(c.cacheConfig, 1)
	k(c.queries, st.queries)
	k(c.hits, st.hits)
	k(c.preempt, st.preemptions)
	k(c.prompt, st.promptTokens)
	k(c.gen, st.generationTokens)
	k(c.success, st.finished)
	p.ttft.Collect(ch)
}
