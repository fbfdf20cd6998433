package report

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
)

// Rate ladders. A workload run at increasing offered loads is reported as
// one cell per step, named LadderStep(base, rate); the ladder section puts
// the steps together as latency-against-load curves and finds each policy's
// saturation rate: the offered load where TTFT p90 passes SaturationP90.

// SaturationP90 is the TTFT p90 (ms) past which a ladder step counts as
// saturated.
const SaturationP90 = 2000.0

// LadderStep names the cell of a ladder's step.
func LadderStep(base string, rate float64) string {
	return fmt.Sprintf("%s@%g", base, rate)
}

// ladderBase returns the ladder a cell belongs to ("" if none).
func ladderBase(workload string) string {
	base, _, ok := strings.Cut(workload, "@")
	if !ok {
		return ""
	}
	return base
}

// Saturation returns the offered load where p90 TTFT (ms) passes limit
// over steps sorted by rate, interpolated linearly between the last step
// under it and the first over it. below says the first step already passed
// it (the rate is at most rates[0]); above that no step did (at least the
// last rate).
func Saturation(rates, p90 []float64, limit float64) (rate float64, below, above bool) {
	for i := range rates {
		if p90[i] <= limit {
			continue
		}
		if i == 0 {
			return rates[0], true, false
		}
		f := (limit - p90[i-1]) / (p90[i] - p90[i-1])
		return rates[i-1] + f*(rates[i]-rates[i-1]), false, false
	}
	if len(rates) == 0 {
		return math.NaN(), false, false
	}
	return rates[len(rates)-1], false, true
}

// writeLadders renders every ladder of the run: TTFT p90 / p99 by offered
// load and policy, and each policy's saturation rate.
func writeLadders(b *strings.Builder, r Run) {
	var bases []string
	for _, wl := range r.Workloads() {
		if base := ladderBase(wl); base != "" && !slices.Contains(bases, base) {
			bases = append(bases, base)
		}
	}
	for _, base := range bases {
		type step struct {
			rate float64
			wl   string
		}
		var steps []step
		for _, wl := range r.Workloads() {
			if ladderBase(wl) == base {
				s := r.Summaries[slices.IndexFunc(r.Summaries, func(s Summary) bool { return s.Workload == wl })]
				steps = append(steps, step{s.Rate, wl})
			}
		}
		slices.SortFunc(steps, func(a, b step) int { return cmp.Compare(a.rate, b.rate) })
		var policies []string
		for _, p := range r.Policies() {
			if slices.ContainsFunc(steps, func(st step) bool { _, ok := r.find(st.wl, p); return ok }) {
				policies = append(policies, p)
			}
		}
		fmt.Fprintf(b, "## %s: latency against load\n\nTTFT p90 / p99 ms at each offered load (requests/s); a policy's steps stop once its p90 passes %.0f s.\n\n", base, SaturationP90/1000)
		b.WriteString("| req/s | " + strings.Join(policies, " | ") + " |\n|---:|" + strings.Repeat("---:|", len(policies)) + "\n")
		for _, st := range steps {
			fmt.Fprintf(b, "| %g |", st.rate)
			for _, p := range policies {
				if s, ok := r.find(st.wl, p); ok {
					fmt.Fprintf(b, " %.0f / %.0f |", s.TTFT.P90, s.TTFT.P99)
				} else {
					b.WriteString(" – |")
				}
			}
			b.WriteString("\n")
		}
		b.WriteString("| saturation req/s |")
		for _, p := range policies {
			var rates, p90 []float64
			for _, st := range steps {
				if s, ok := r.find(st.wl, p); ok {
					rates, p90 = append(rates, st.rate), append(p90, s.TTFT.P90)
				}
			}
			rate, below, above := Saturation(rates, p90, SaturationP90)
			switch {
			case below:
				fmt.Fprintf(b, " ≤ %g |", rate)
			case above:
				fmt.Fprintf(b, " > %g |", rate)
			default:
				fmt.Fprintf(b, " %.2f |", rate)
			}
		}
		b.WriteString("\n\n")
	}
}
