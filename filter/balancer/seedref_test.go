package balancer

import "github.com/istio-llm-filter/istio-llm-filter/filter/config"

// The seed's formula written out as one function: the reference the seed
// profile is tested against (its weighted sum differs from it by the
// constant W2'+W3).

// Scores computes the seed formula's score of every host.
func Scores(hosts []Host, rule config.LBRule, out []float64) []float64 {
	out = out[:0]
	if len(hosts) == 0 {
		return out
	}
	minReqs, maxReqs := hosts[0].Reqs, hosts[0].Reqs
	maxPrompt := 0.0
	for _, h := range hosts {
		minReqs = min(minReqs, h.Reqs)
		maxReqs = max(maxReqs, h.Reqs)
		maxPrompt = max(maxPrompt, float64(h.Prompt))
	}
	delta := float64(max(2, maxReqs-minReqs))
	w2 := rule.RequestLoadWeight
	if delta > 5 {
		// Float division, as the seed's worked example (6/5 = 1.2) shows.
		w2 = w2 * delta / 5
	}
	for _, h := range hosts {
		s := rule.CacheRatioWeight*h.CacheRatio - w2*float64(h.Reqs-minReqs)/delta
		if maxPrompt > 0 {
			s -= rule.PrefillLoadWeight * float64(h.Prompt) / maxPrompt
		}
		out = append(out, s)
	}
	return out
}

// pickTop is pickTopBuf with its own buffer.
func pickTop(scores []float64, percent int, intn func(int) int) int {
	return pickTopBuf(scores, percent, intn, nil)
}
