// Package report turns the benchmark's per-request results into summaries:
// latency percentiles, throughput, success and true cache-hit rates, load
// imbalance, and renders them as JSON, Markdown and SVG plots.
package report

import (
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Result is what one request of the benchmark observed.
type Result struct {
	Workload string        `json:"workload"`
	Policy   string        `json:"policy"`
	Session  string        `json:"session"`
	Turn     int           `json:"turn"`
	Start    time.Duration `json:"start_ns"` // since the run started
	TTFT     time.Duration `json:"ttft_ns"`  // zero when no token arrived
	Latency  time.Duration `json:"latency_ns"`
	Status   int           `json:"status"`
	Err      string        `json:"error,omitempty"`
	Worker   string        `json:"worker,omitempty"` // upstream host that served it

	PromptTokens     int `json:"prompt_tokens"`
	CachedTokens     int `json:"cached_tokens"`
	CompletionTokens int `json:"completion_tokens"`

	// PredictedTTFTms is the TTFT the gateway predicted for the pod it
	// chose (headers.PredictedTTFT), 0 when it said none.
	PredictedTTFTms float64 `json:"predicted_ttft_ms,omitempty"`
	// PredictedSlotWaitms is the part of it the request was predicted to
	// wait for running requests to end (headers.PredictedSlotWait), 0 when
	// it was predicted to wait for none.
	PredictedSlotWaitms float64 `json:"predicted_slot_wait_ms,omitempty"`
	// PredictedCachedShare is the share of the prompt the gateway believed
	// the pod held in its KV cache (headers.PredictedCachedShare); nil when
	// it stated none.
	PredictedCachedShare *float64 `json:"predicted_cached_share,omitempty"`

	// Where the request ran in a repeated run: the workload's seed, the
	// repeat (1-based) and, on a rate ladder, the step's offered load in
	// requests per second.
	Seed   uint64  `json:"seed,omitempty"`
	Repeat int     `json:"repeat,omitempty"`
	Rate   float64 `json:"rate,omitempty"`
}

// ParsePredictedTTFT reads the value of the gateway's predicted TTFT
// header, or of its predicted slot wait (internal/headers.PredictedTTFT,
// PredictedSlotWait): 0 when absent or not a positive number.
func ParsePredictedTTFT(v string) float64 {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || f <= 0 || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0
	}
	return f
}

// ParseShare reads a share, 0 to 1, such as the gateway's predicted cached
// share (internal/headers.PredictedCachedShare): nil when absent or not a
// share.
func ParseShare(v string) *float64 {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || !(f >= 0 && f <= 1) {
		return nil
	}
	return &f
}

// OK reports whether the request succeeded.
func (r Result) OK() bool { return r.Err == "" && r.Status/100 == 2 }

// Percentiles of a latency distribution, in milliseconds.
type Percentiles struct {
	P50  float64 `json:"p50_ms"`
	P90  float64 `json:"p90_ms"`
	P99  float64 `json:"p99_ms"`
	Mean float64 `json:"mean_ms"`
}

// Summary aggregates the results of one policy on one workload.
type Summary struct {
	Workload string `json:"workload"`
	Policy   string `json:"policy"`

	Requests    int     `json:"requests"`
	Succeeded   int     `json:"succeeded"`
	SuccessRate float64 `json:"success_rate"`

	TTFT    Percentiles `json:"ttft"`
	Latency Percentiles `json:"latency"`

	Duration      float64 `json:"duration_s"`
	Throughput    float64 `json:"throughput_rps"`
	OutputTokensS float64 `json:"output_tokens_per_s"`

	// CacheHitRate is the share of prompt tokens the workers served from
	// their KV cache (usage.prompt_tokens_details.cached_tokens), i.e. what
	// routing really saved, not what the router believed.
	CacheHitRate float64 `json:"cache_hit_rate"`

	// Imbalance is max/mean of requests per worker (1 = perfectly even),
	// counted from the upstream-host header our gateway adds. An external
	// router adds none: UpstreamUnknown then says the imbalance is not
	// known (and Imbalance is 0).
	Imbalance       float64        `json:"load_imbalance"`
	PerWorker       map[string]int `json:"per_worker"`
	UpstreamUnknown bool           `json:"upstream_unknown,omitempty"`

	// External marks a router run in place of our gateway (bench
	// --external, sglang-router): a baseline like the stand-ins.
	External bool `json:"external,omitempty"`

	// PredictionError compares the gateway's predicted TTFT for the chosen
	// pod with the observed one; nil when no answer carried a prediction.
	PredictionError *PredictionError `json:"prediction_error,omitempty"`
	// CacheBelief compares what the gateway believed the chosen pods held
	// of the prompts with what they served from their caches; nil when no
	// answer stated a belief.
	CacheBelief *CacheBelief `json:"cache_belief,omitempty"`

	// Rate is a rate-ladder step's offered load (requests per second).
	Rate float64 `json:"rate,omitempty"`

	// Runs is how many runs a merged summary is the median of (0 or 1: a
	// single run); Spread their range.
	Runs   int     `json:"runs,omitempty"`
	Spread *Spread `json:"spread,omitempty"`
}

// PredictionError is the absolute relative error |predicted − observed| /
// observed of the chosen pod's predicted TTFT over the requests that had a
// prediction and a first token; and the same apart for those predicted to
// wait for running requests to end (SlotWait) and the others (NoSlotWait):
// when the next of a pod's running requests ends is the one part of a TTFT
// no router knows (docs/benchmarks.md, "The prediction's limit").
type PredictionError struct {
	Requests   int `json:"requests"`
	ErrorRange     // over all of them: "median", "p90"
	// SlotWaits is how many of the requests were predicted to wait for
	// ends (a share of Requests).
	SlotWaits  int        `json:"slot_waits"`
	SlotWait   ErrorRange `json:"slot_wait"`
	NoSlotWait ErrorRange `json:"no_slot_wait"`
	// Warm is the error of the Warmed requests sent from the run's
	// WarmUp on: a fresh fleet's first requests are priced at the
	// router's configured defaults until the pods have measured their
	// own costs and the first answers have come back, a start a
	// long-running deployment leaves behind.
	Warmed int        `json:"warmed,omitempty"`
	Warm   ErrorRange `json:"warm"`
}

// WarmUp is how long into a run the prediction's error counts as warm
// (PredictionError.Warm): on the bench's fleets the pods report their
// costs after their first 32 steps, a few seconds in.
const WarmUp = 5 * time.Second

// CacheBelief compares, over the requests whose answer stated one, the
// share of the prompt the gateway believed its pod held in its KV cache
// (Result.PredictedCachedShare) with the share the pod served from it
// (cached_tokens / prompt_tokens): the absolute difference's median and 90th
// percentile (ErrorRange, in shares of the prompt), its mean signed (Bias:
// positive where pods held less than believed), and the shares of the
// requests whose pod held at least a tenth of the prompt less (Less) or
// more (More) than believed: the prefix index's staleness, one of the two
// inputs of the prediction that can be checked apart.
type CacheBelief struct {
	Requests   int     `json:"requests"`
	ErrorRange         // "median", "p90"
	Bias       float64 `json:"bias"`
	Less       float64 `json:"less"`
	More       float64 `json:"more"`
}

// beliefMargin is how far a pod's cache must be from the belief to count
// in CacheBelief.Less or More: a tenth of the prompt, beyond the blocks an
// index and an engine round differently (a prompt's last partial block).
const beliefMargin = 0.1

func cacheBelief(rs []Result) *CacheBelief {
	var abs []float64
	var sum float64
	var less, more int
	for _, r := range rs {
		if !r.OK() || r.PredictedCachedShare == nil || r.PromptTokens <= 0 {
			continue
		}
		d := *r.PredictedCachedShare - float64(r.CachedTokens)/float64(r.PromptTokens)
		abs = append(abs, math.Abs(d))
		sum += d
		switch {
		case d >= beliefMargin:
			less++
		case d <= -beliefMargin:
			more++
		}
	}
	if len(abs) == 0 {
		return nil
	}
	n := float64(len(abs))
	return &CacheBelief{Requests: len(abs), ErrorRange: errorRange(abs), Bias: sum / n, Less: float64(less) / n, More: float64(more) / n}
}

// ErrorRange is a prediction error's median and 90th percentile over a set
// of requests (0 and 0 over none).
type ErrorRange struct {
	Median float64 `json:"median"`
	P90    float64 `json:"p90"`
}

func errorRange(errs []float64) ErrorRange {
	if len(errs) == 0 {
		return ErrorRange{}
	}
	sort.Float64s(errs)
	return ErrorRange{Median: Quantile(errs, 0.5), P90: Quantile(errs, 0.9)}
}

// Spread is the range (min, max) of a merged summary's measures over its runs.
type Spread struct {
	TTFTP50  [2]float64 `json:"ttft_p50_ms"`
	TTFTP90  [2]float64 `json:"ttft_p90_ms"`
	TTFTP99  [2]float64 `json:"ttft_p99_ms"`
	CacheHit [2]float64 `json:"cache_hit_rate"`
}

// Summarize aggregates results; workers lists the fleet so idle workers count
// toward imbalance.
func Summarize(workload, policy string, rs []Result, workers []string) Summary {
	s := Summary{Workload: workload, Policy: policy, Requests: len(rs), PerWorker: map[string]int{}}
	for _, w := range workers {
		s.PerWorker[w] = 0
	}
	var ttft, lat []float64
	var prompt, cached, out int
	var end time.Duration
	for _, r := range rs {
		if e := r.Start + r.Latency; e > end {
			end = e
		}
		if !r.OK() {
			continue
		}
		s.Succeeded++
		lat = append(lat, ms(r.Latency))
		if r.TTFT > 0 {
			ttft = append(ttft, ms(r.TTFT))
		}
		prompt += r.PromptTokens
		cached += r.CachedTokens
		out += r.CompletionTokens
		if r.Worker != "" {
			s.PerWorker[r.Worker]++
		}
	}
	if s.Requests > 0 {
		s.SuccessRate = float64(s.Succeeded) / float64(s.Requests)
	}
	s.TTFT = percentiles(ttft)
	s.Latency = percentiles(lat)
	s.Duration = end.Seconds()
	if s.Duration > 0 {
		s.Throughput = float64(s.Succeeded) / s.Duration
		s.OutputTokensS = float64(out) / s.Duration
	}
	if prompt > 0 {
		s.CacheHitRate = float64(cached) / float64(prompt)
	}
	s.Imbalance = imbalance(s.PerWorker)
	if s.Succeeded > 0 && s.Imbalance == 0 {
		s.UpstreamUnknown, s.PerWorker = true, nil
	}
	s.PredictionError = predictionError(rs)
	s.CacheBelief = cacheBelief(rs)
	return s
}

// Floor is a workload's floor (bench/floor): the TTFT each of its requests
// would have alone on an idle pod that holds the longest prefix it shares
// with any earlier request, the engine's own prefill cost of the rest. No
// router can beat it: every percentile of any policy's TTFT is at least
// the floor's.
type Floor struct {
	Workload string      `json:"workload"`
	Requests int         `json:"requests"`
	TTFT     Percentiles `json:"ttft"`
	// Capacity bounds the fleet's throughput on the cell's requests
	// (requests/s, floor.Bound.Capacity); 0 where the engine gives no bound.
	Capacity float64 `json:"capacity_rps,omitempty"`
	// Runs is how many rounds a merged floor is the median of.
	Runs int `json:"runs,omitempty"`
}

// NewFloor summarizes one run's floors of a workload.
func NewFloor(workload string, ttfts []time.Duration) Floor {
	v := make([]float64, len(ttfts))
	for i, d := range ttfts {
		v[i] = ms(d)
	}
	return Floor{Workload: workload, Requests: len(ttfts), TTFT: percentiles(v)}
}

func predictionError(rs []Result) *PredictionError {
	var errs, slot, other, warm []float64
	for _, r := range rs {
		if r.OK() && r.TTFT > 0 && r.PredictedTTFTms > 0 {
			obs := ms(r.TTFT)
			e := math.Abs(r.PredictedTTFTms-obs) / obs
			errs = append(errs, e)
			if r.PredictedSlotWaitms > 0 {
				slot = append(slot, e)
			} else {
				other = append(other, e)
			}
			if r.Start >= WarmUp {
				warm = append(warm, e)
			}
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return &PredictionError{Requests: len(errs), ErrorRange: errorRange(errs),
		SlotWaits: len(slot), SlotWait: errorRange(slot), NoSlotWait: errorRange(other),
		Warmed: len(warm), Warm: errorRange(warm)}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func percentiles(v []float64) Percentiles {
	if len(v) == 0 {
		return Percentiles{}
	}
	sorted := slices.Clone(v)
	sort.Float64s(sorted)
	var sum float64
	for _, x := range sorted {
		sum += x
	}
	return Percentiles{
		P50:  Quantile(sorted, 0.50),
		P90:  Quantile(sorted, 0.90),
		P99:  Quantile(sorted, 0.99),
		Mean: sum / float64(len(sorted)),
	}
}

// Quantile of sorted values with linear interpolation between closest ranks.
func Quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	pos := q * float64(len(sorted)-1)
	lo := int(math.Floor(pos))
	hi := int(math.Ceil(pos))
	frac := pos - float64(lo)
	return sorted[lo]*(1-frac) + sorted[hi]*frac
}

func imbalance(per map[string]int) float64 {
	if len(per) == 0 {
		return 0
	}
	total, max := 0, 0
	for _, n := range per {
		total += n
		if n > max {
			max = n
		}
	}
	if total == 0 {
		return 0
	}
	return float64(max) / (float64(total) / float64(len(per)))
}
