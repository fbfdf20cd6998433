package balancer

// Stand-ins for the routers cache_aware is measured against, run inside
// this gateway on the same metadata center so that a benchmark compares
// policies and nothing else. What each takes from the real one, and every
// difference left:
//
// epp — llm-d's inference scheduler (the Gateway API Inference Extension's
// endpoint picker) in its default profile: prefix-cache scorer ×3, queue
// scorer ×2, KV-cache-utilization scorer ×2, max-score picker.
//   - Prefix: as the real scorer (EPPPrefix): the share of the prompt's
//     blocks a pod matched, longest prefix first, in blocks of 16 tokens ×
//     4 characters = 64 bytes (DefaultBlockSizeTokens and
//     averageCharactersPerToken in gateway-api-inference-extension
//     pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go; earlier
//     releases: DefaultHashBlockSize = 64 in
//     pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go), at most
//     256 blocks, against its own LRU index of where it sent each block,
//     learnt at each decision: per pod as many blocks as the pod's KV cache
//     had when the pod was first chosen (autoTune, on by default: the pod's
//     num_gpu_blocks from vllm:cache_config_info), 31,250 where it reported
//     none (DefaultLRUCapacityPerServer; the plugin's makeServer and the
//     indexer's Add). Differences: the block hash (maphash where the real
//     one uses xxhash; only equality matters), the prompt it hashes (the
//     gateway's canonical prompt where the real one hashes the request's
//     prompt text), and one index per gateway as one per EPP replica. The
//     gateway passes the canonical prompt (filter/routing); a Go caller
//     that does not (Request.Prompt nil) gets the metadata center's match
//     instead, in prompt_hash.chunk_size blocks (512 bytes by default). llm-d's
//     guides often set hashBlockSize 256 (4 × vLLM's 64-token blocks).
//   - Queue: (max − waiting)/(max − min) over the pods' scraped waiting
//     requests, 1 for all when equal, as the real one; a pod without a
//     fresh report counts as the longest queue (the real one reads its last
//     scrape, however old).
//   - KV cache: 1 − utilization. vLLM's kv_cache_usage_perc counts the
//     blocks of running requests; idle cached blocks are free until reused.
//     Scraped vLLM-like pods report exactly that. Our worker reports the
//     cells in use where its engine counts cells (cells parked for reuse
//     not at all: the same reading), else the KV-cache manager's tokens
//     (worker/scheduler.Stats), which count idle cached entries as used.
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

import (
	"container/list"
	"encoding/binary"
	"hash/maphash"
	"sync"
)

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

// eppProfile is the epp stand-in (see the top of this file), with its own
// prefix index.
func eppProfile(prefix *EPPPrefix) *Profile {
	return &Profile{
		Name:     ProfileEPP,
		Scorers:  []Weighted{{Scorer: prefix, Weight: 3}, {Scorer: QueueScorer{}, Weight: 2}, {Scorer: KVCacheScorer{}, Weight: 2}},
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

// The real EPP's prefix index (gateway-api-inference-extension, the prefix
// plugin's plugin.go and indexer.go): the prompt in blocks of
// eppBlockBytes, each block's hash chained to the one before and the first
// to the model's name, at most eppMaxBlocks blocks (longer prompts are cut,
// a final partial block is left out); per pod an LRU of the blocks routed
// there, as many entries as the pod's KV cache has blocks (eppPodBlocks);
// a pod's score is its longest run of leading blocks in the index over the
// prompt's blocks (the model's block included, which every pod that served
// the model matches).
const (
	eppBlockBytes  = 16 * 4 // DefaultBlockSizeTokens × averageCharactersPerToken
	eppMaxBlocks   = 256    // DefaultMaxPrefixBlocks
	eppPodCapacity = 31250  // DefaultLRUCapacityPerServer
	// eppTokensPerBlock turns a pod's reported KV capacity in tokens back
	// into its num_gpu_blocks: vLLM's default block size, which the real
	// one's autoTune also takes as its hash block.
	eppTokensPerBlock = 16
)

// eppPodBlocks is how many blocks the index keeps of a pod: its KV cache's
// blocks where it reports them (autoTune), else DefaultLRUCapacityPerServer.
func eppPodBlocks(h *Host) int {
	if h.KVCapacity >= eppTokensPerBlock {
		return int(h.KVCapacity / eppTokensPerBlock)
	}
	return eppPodCapacity
}

// ScorerEPPPrefix names the epp stand-in's prefix scorer.
const ScorerEPPPrefix = "epp_prefix"

// EPPPrefix is the EPP's prefix-cache scorer over its own index of where it
// sent each block (Recorder: the index learns a decision when it is made,
// as the real one's PreRequest). Without the prompt's bytes (Request.Prompt
// unset) it scores the metadata center's match instead, as PrefixScorer.
// Safe for concurrent use.
type EPPPrefix struct {
	mu     sync.Mutex
	seed   maphash.Seed
	owners map[uint64]map[string]struct{} // block -> pods it was sent to
	pods   map[string]*eppLRU
}

// eppLRU is one pod's blocks, most recently routed first, at most capacity
// of them: eppPodBlocks when the pod was first chosen (the real indexer
// sizes a pod's LRU once, at its first Add).
type eppLRU struct {
	order    *list.List // of uint64, front = most recent
	at       map[uint64]*list.Element
	capacity int
}

// NewEPPPrefix returns an empty index.
func NewEPPPrefix() *EPPPrefix {
	return &EPPPrefix{seed: maphash.MakeSeed(), owners: map[uint64]map[string]struct{}{}, pods: map[string]*eppLRU{}}
}

func (*EPPPrefix) Name() string       { return ScorerEPPPrefix }
func (*EPPPrefix) ReadsSignals() bool { return false }

// hashes returns the prompt's chained block hashes into buf, the model's
// first; nil when the prompt is shorter than a block.
func (p *EPPPrefix) hashes(s *State, buf []uint64) []uint64 {
	prompt := s.Prompt
	if len(prompt) < eppBlockBytes {
		return nil
	}
	prompt = prompt[:min(len(prompt), eppBlockBytes*eppMaxBlocks)]
	out := append(buf[:0], maphash.String(p.seed, s.Model))
	var h maphash.Hash
	h.SetSeed(p.seed)
	var prev [8]byte
	for i := 0; i+eppBlockBytes <= len(prompt); i += eppBlockBytes {
		h.Reset()
		_, _ = h.Write(prompt[i : i+eppBlockBytes])
		binary.LittleEndian.PutUint64(prev[:], out[len(out)-1])
		_, _ = h.Write(prev[:])
		out = append(out, h.Sum64())
	}
	return out
}

func (p *EPPPrefix) Score(s *State, out []float64) {
	if s.Prompt == nil {
		PrefixScorer{}.Score(s, out)
		return
	}
	var buf [eppMaxBlocks + 1]uint64
	hs := p.hashes(s, buf[:0])
	clear(out)
	if len(hs) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	// The longest run of leading blocks per pod: block i counts for the
	// pods that hold it, until a block no pod holds (matchLongestPrefix).
	for _, bh := range hs {
		owners := p.owners[bh]
		if len(owners) == 0 {
			break
		}
		for i := range s.Hosts {
			if _, ok := owners[s.Hosts[i].Address]; ok {
				out[i]++
			}
		}
	}
	for i := range out {
		out[i] /= float64(len(hs))
	}
}

// Chosen records that the prompt's blocks went to s.Hosts[i] (the real
// one's PreRequest).
func (p *EPPPrefix) Chosen(s *State, i int) {
	if s.Prompt == nil {
		return
	}
	host := s.Hosts[i].Address
	var buf [eppMaxBlocks + 1]uint64
	hs := p.hashes(s, buf[:0])
	if len(hs) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	l := p.pods[host]
	if l == nil {
		l = &eppLRU{order: list.New(), at: map[uint64]*list.Element{}, capacity: eppPodBlocks(&s.Hosts[i])}
		p.pods[host] = l
	}
	for _, bh := range hs {
		if e, ok := l.at[bh]; ok {
			l.order.MoveToFront(e)
			continue
		}
		l.at[bh] = l.order.PushFront(bh)
		o := p.owners[bh]
		if o == nil {
			o = map[string]struct{}{}
			p.owners[bh] = o
		}
		o[host] = struct{}{}
		for l.order.Len() > l.capacity {
			old := l.order.Remove(l.order.Back()).(uint64)
			delete(l.at, old)
			if o := p.owners[old]; o != nil {
				if delete(o, host); len(o) == 0 {
					delete(p.owners, old)
				}
			}
		}
	}
}
