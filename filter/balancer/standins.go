package balancer

// Stand-ins for the routers cache_aware is measured against, run inside
// this gateway on the same metadata center so that a benchmark compares
// policies and nothing else. What each takes from the real one, and every
// difference left:
//
// epp — llm-d's inference scheduler (the Gateway API Inference Extension's
// endpoint picker) in its default profile: prefix-cache scorer ×3, queue
// scorer ×2, KV-cache-utilization scorer ×2, max-score picker.
//   - Prefix: the real scorer rates a pod by the share of the prompt's
//     blocks it matched, longest prefix first, in blocks of 16 tokens × 4
//     characters = 64 bytes (DefaultBlockSizeTokens and
//     averageCharactersPerToken in gateway-api-inference-extension
//     pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go; earlier
//     releases: DefaultHashBlockSize = 64 in
//     pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go), at most
//     256 blocks, against its own LRU index of where it sent each block
//     (31,250 blocks per pod). The stand-in reads the metadata center's
//     match instead: the blocks each pod is recorded to hold, in blocks of
//     the gateway's prompt_hash.chunk_size (512 bytes by default, so up to
//     448 bytes of a partly shared block go unmatched where the real one
//     matches them), the whole prompt, and every gateway's decisions.
//     llm-d's guides often set hashBlockSize 256 (4 × vLLM's 64-token
//     blocks); chunk_size 256 reproduces those.
//   - Queue: (max − waiting)/(max − min) over the pods' scraped waiting
//     requests, 1 for all when equal, as the real one; a pod without a
//     fresh report counts as the longest queue (the real one reads its last
//     scrape, however old).
//   - KV cache: 1 − utilization. vLLM's kv_cache_usage_perc counts the
//     blocks of running requests; idle cached blocks are free until reused.
//     Scraped vLLM-like pods report exactly that; our worker reports the
//     cells its live sequences hold (cells parked for reuse not at all,
//     engines that count cells: worker/scheduler.Stats), the same reading.
//   - Picker: the best total, ties at random (max-score-picker with one
//     endpoint shuffles its candidates before it picks).
//   - Not modelled: the real EPP's saturation detector and flow control
//     (it queues or sheds requests when every pod is saturated), LoRA
//     affinity, its out-of-process hop (ext_proc), and its metric refresh
//     (50 ms by default) where the metadata center's scrape interval
//     applies.
//
// sglang — SGLang's router (sgl-router, PyPI sglang-router), policy
// cache_aware with the defaults `python -m sglang_router.launch_router`
// uses (sgl-router/py_src/sglang_router/router_args.py: cache_threshold
// 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5,
// eviction_interval_secs 120, max_tree_size 2^26); the algorithm is
// sgl-router/src/policies/cache_aware.rs.
//   - Balance: imbalanced when max − min load > 64 and max > 1.5·min, then
//     the least loaded pod, as the real one. Its load is the router's own
//     in-flight requests per worker; the stand-in's is the live requests
//     (every gateway's leases plus this gateway's unreported ones).
//   - Cache: the real router matches the request's text character by
//     character against its own radix tree of what it sent each worker and
//     follows the best match when more than 30% of the text matched; the
//     stand-in follows the metadata center's block match (chunk_size
//     blocks) above the same share.
//   - Otherwise the real router takes the worker with the smallest tree
//     (the fewest characters routed there and not yet evicted). The
//     stand-in takes the pod with the smallest share of the recent routing
//     decisions (Host.Share: a window of this gateway's decisions, not
//     character counts), then the fewest live requests, then the lowest
//     reported KV use.
//   - Eviction: the real tree evicts least recently used leaves every 120 s
//     past 2^26 characters; the stand-in has no tree of its own (the
//     metadata center's record follows the pods' caches), its window is
//     the last 8 decisions per pod.
//   - The real router's retries, circuit breaker and rate limiting are not
//     modelled.

// PolicySGLang names the sglang stand-in.
const PolicySGLang = "sglang"

// SGLang router's cache_aware defaults (router_args.py, above).
const (
	sglangBalanceAbs   = 64  // max−min load past which the fleet is imbalanced ...
	sglangBalanceRel   = 1.5 // ... if also max > 1.5·min
	sglangCacheMinRate = 0.3 // a prefix match of this share or less is not followed
)

// SGLang is the sglang stand-in (see the top of this file).
type SGLang struct{}

func (SGLang) NeedsMetadata() bool { return true }
func (SGLang) ReadsSignals() bool  { return true }

func (SGLang) Choose(s *State) int {
	lo, hi := s.Hosts[0].Reqs, s.Hosts[0].Reqs
	for i := range s.Hosts {
		lo, hi = min(lo, s.Hosts[i].Reqs), max(hi, s.Hosts[i].Reqs)
	}
	if hi-lo > sglangBalanceAbs && float64(hi) > sglangBalanceRel*float64(lo) {
		return argBest(s, func(h Host) float64 { return -float64(h.Reqs) })
	}
	best := 0.0
	for i := range s.Hosts {
		best = max(best, s.Hosts[i].CacheRatio)
	}
	if best > sglangCacheMinRate {
		return argBest(s, func(h Host) float64 { return h.CacheRatio })
	}
	return argBest(s, func(h Host) float64 {
		// Share first; live requests (which count this gateway's own at
		// once) while the window is too short to give shares; reported KV
		// use last. (The reported use alone lags by a report: every new
		// conversation of a burst would go to the same emptiest pod.)
		v := -1e6*h.Share - float64(h.Reqs)
		if h.Signals {
			v -= 1e-3 * h.KVUtil
		}
		return v
	})
}

// eppProfile is the epp stand-in (see the top of this file).
func eppProfile() *Profile {
	return &Profile{
		Name:     ProfileEPP,
		Scorers:  []Weighted{{Scorer: PrefixScorer{}, Weight: 3}, {Scorer: QueueScorer{}, Weight: 2}, {Scorer: KVCacheScorer{}, Weight: 2}},
		Picker:   MaxScore{},
		Metadata: true,
	}
}

// QueueScorer is the pod's own count of waiting requests, min–max
// normalised (the EPP's queue scorer). A pod without fresh signals is
// treated as the longest queue: stale figures are never trusted.
type QueueScorer struct{}

func (QueueScorer) Name() string { return ScorerQueue }
func (QueueScorer) Score(s *State, out []float64) {
	hi := 0.0
	for i := range s.Hosts {
		if s.Hosts[i].Signals {
			hi = max(hi, float64(s.Hosts[i].Waiting))
		}
	}
	lowIsBest(s.Hosts, out, func(h *Host) float64 {
		if !h.Signals {
			return hi
		}
		return float64(h.Waiting)
	})
}

// KVCacheScorer is the pod's free KV cache, 1 − utilization (the EPP's
// kv-cache-utilization scorer). Without fresh signals: 0.
type KVCacheScorer struct{}

func (KVCacheScorer) Name() string { return ScorerKVCache }
func (KVCacheScorer) Score(s *State, out []float64) {
	for i := range s.Hosts {
		if s.Hosts[i].Signals {
			out[i] = 1 - min(1, max(0, s.Hosts[i].KVUtil))
		} else {
			out[i] = 0
		}
	}
}
