package balancer

import "github.com/istio-llm-filter/istio-llm-filter/filter/config"

// The seed's formula written out as one function, as cache_aware computed it
// before it became a profile: the reference the seed and cache_aware
// profiles are tested against (their weighted sums differ from it by the
// constant W2'+W3, and cache_aware's by its share tie-break).

// Scores computes the seed formula's score of every host, with each host's
// prompt term counting promptLen·(1−cacheRatio) of its own for the request
// while any host has prefill pending (promptLen 0: the seed's score exactly).
func Scores(hosts []Host, rule config.LBRule, promptLen int64, out []float64) []float64 {
	out = out[:0]
	if len(hosts) == 0 {
		return out
	}
	minReqs, maxReqs, maxPending := hosts[0].Reqs, hosts[0].Reqs, int64(0)
	for _, h := range hosts {
		minReqs = min(minReqs, h.Reqs)
		maxReqs = max(maxReqs, h.Reqs)
		maxPending = max(maxPending, h.Prompt)
	}
	// The request's own prefill only matters against others' queued
	// prefill. With no pod prefilling, (1−cacheRatio)·promptLen would just
	// count the cache term a second time (at weight W3) and pile a hot
	// prompt onto the pods that hold it; the prompt term is then off, as in
	// the seed.
	if maxPending == 0 {
		promptLen = 0
	}
	// Herd control: a pod that has been taking more than HerdShare times
	// its fair share of requests and is busier than the idlest pod gets no
	// cache credit, so a prefix that everyone wants is copied to another
	// pod instead of queueing on the few that hold it.
	shareLimit := rule.HerdShare / float64(len(hosts))
	ratio := func(h Host) float64 {
		if rule.HerdShare > 0 && h.Share > shareLimit && h.Reqs > minReqs {
			return 0
		}
		return h.CacheRatio
	}
	prompt := func(h Host) float64 { return float64(h.Prompt) + float64(promptLen)*(1-ratio(h)) }
	maxPrompt := 0.0
	for _, h := range hosts {
		maxPrompt = max(maxPrompt, prompt(h))
	}
	delta := float64(max(2, maxReqs-minReqs))
	w2 := rule.RequestLoadWeight
	if delta > 5 {
		// Float division, as the seed's worked example (6/5 = 1.2) shows.
		w2 = w2 * delta / 5
	}
	for _, h := range hosts {
		s := rule.CacheRatioWeight*ratio(h) - w2*float64(h.Reqs-minReqs)/delta
		if maxPrompt > 0 {
			s -= rule.PrefillLoadWeight * prompt(h) / maxPrompt
		}
		out = append(out, s)
	}
	return out
}

// pickTop is pickTopBuf with its own buffer.
func pickTop(scores []float64, percent int, intn func(int) int) int {
	return pickTopBuf(scores, percent, intn, nil)
}

// cacheAware runs the cache_aware profile on s.
func cacheAware(s *State) int { return cacheAwareProfile().Choose(s) }

// cacheAwareProfile returns a fresh copy of the built-in cache_aware profile.
func cacheAwareProfile() *Profile {
	for _, p := range builtinProfiles() {
		if p.Name == config.PolicyCacheAware {
			return p
		}
	}
	panic("no cache_aware profile")
}
