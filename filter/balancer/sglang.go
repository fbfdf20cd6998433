package balancer

// PolicySGLang names SGLang-like, a baseline standing for SGLang router's
// cache_aware policy.
const PolicySGLang = "sglang"

// SGLang router's thresholds (its defaults).
const (
	sglangBalanceAbs   = 32  // max−min load past which the fleet is imbalanced ...
	sglangBalanceRel   = 1.5 // ... if also max > 1.5·min
	sglangCacheMinRate = 0.5 // a prefix match below this share is not followed
)

// SGLang is SGLang router's cache_aware policy: while the fleet is
// imbalanced (max−min live requests > 32 and max > 1.5·min) the pod with the
// fewest live requests; otherwise the pod with the longest prefix match if it
// covers more than half the prompt, else the pod with the smallest cache.
// SGLang's router measures that by the size of its own radix tree per pod,
// which grows the moment it routes a request there; the nearest thing here
// that also moves at once is the pod's share of recent decisions
// (Host.Share), then its live requests, with the pod's reported KV-cache
// use to break ties. (The
// reported use alone lags by a report: every new conversation of a burst
// would go to the same emptiest pod.) Ties at random.
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
		// use last.
		v := -1e6*h.Share - float64(h.Reqs)
		if h.Signals {
			v -= 1e-3 * h.KVUtil
		}
		return v
	})
}
