package report

import (
	"cmp"
	"fmt"
	"io"
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

// Saturation returns the offered load where p90 TTFT (ms) passes SaturationP90
// over steps sorted by rate, interpolated linearly between the last step
// under it and the first over it. below says the first step already passed
// it (the rate is at most rates[0]); above that no step did (at least the
// last rate).
func Saturation(rates, p90 []float64) (rate float64, below, above bool) {
	const limit = SaturationP90
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

// ladderStep is one step of a ladder: its rate and its cell's name.
type ladderStep struct {
	rate float64
	cell string
}

// Ladders returns the ladders of the run, in first-seen order.
func (r Run) Ladders() []string {
	var bases []string
	for _, wl := range r.Workloads() {
		if base := ladderBase(wl); base != "" && !slices.Contains(bases, base) {
			bases = append(bases, base)
		}
	}
	return bases
}

// ladder returns a ladder's steps by rate and the policies that ran any.
func (r Run) ladder(base string) ([]ladderStep, []string) {
	var steps []ladderStep
	for _, wl := range r.Workloads() {
		if ladderBase(wl) == base {
			s := r.Summaries[slices.IndexFunc(r.Summaries, func(s Summary) bool { return s.Workload == wl })]
			steps = append(steps, ladderStep{s.Rate, wl})
		}
	}
	slices.SortFunc(steps, func(a, b ladderStep) int { return cmp.Compare(a.rate, b.rate) })
	var policies []string
	for _, p := range r.Policies() {
		if slices.ContainsFunc(steps, func(st ladderStep) bool { _, ok := r.find(st.cell, p); return ok }) {
			policies = append(policies, p)
		}
	}
	return steps, policies
}

// curve returns one policy's (rate, TTFT p90) points on a ladder.
func (r Run) curve(steps []ladderStep, p string) (rates, p90 []float64) {
	for _, st := range steps {
		if s, ok := r.find(st.cell, p); ok {
			rates, p90 = append(rates, st.rate), append(p90, s.TTFT.P90)
		}
	}
	return rates, p90
}

// writeLadders renders every ladder of the run: TTFT p90 / p99 by offered
// load and policy, and each policy's saturation rate.
func writeLadders(b *strings.Builder, r Run) {
	for _, base := range r.Ladders() {
		steps, policies := r.ladder(base)
		fmt.Fprintf(b, "## %s: latency against load\n\nTTFT p90 / p99 ms at each offered load (requests/s); a policy's steps stop once its p90 passes %.0f s.\n\n", base, SaturationP90/1000)
		b.WriteString("| req/s | " + strings.Join(policies, " | ") + " |\n|---:|" + strings.Repeat("---:|", len(policies)) + "\n")
		for _, st := range steps {
			fmt.Fprintf(b, "| %g |", st.rate)
			for _, p := range policies {
				if s, ok := r.find(st.cell, p); ok {
					fmt.Fprintf(b, " %.0f / %.0f |", s.TTFT.P90, s.TTFT.P99)
				} else {
					b.WriteString(" – |")
				}
			}
			b.WriteString("\n")
		}
		b.WriteString("| saturation req/s |")
		for _, p := range policies {
			rate, below, above := Saturation(r.curve(steps, p))
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
		capacity := r.capacity(steps)
		if capacity > 0 {
			fmt.Fprintf(b, "The fleet's capacity on the ladder's last step (bench/floor, Capacity): %.1f req/s, the most any router could serve: every request computing only what no earlier request computed, every pod decoding its fullest batch, never idle.\n\n", capacity)
		}
		if slices.Contains(policies, "cache_aware") && slices.Contains(policies, eppPolicy) {
			mine, mineP90 := r.curve(steps, "cache_aware")
			theirs, theirsP90 := r.curve(steps, eppPolicy)
			b.WriteString(saturationAim(mine, mineP90, theirs, theirsP90, capacity) + "\n\n")
		}
	}
}

// aimSaturation is the aim of cache_aware's saturation rate: at least this
// many times epp's on the same ladder (docs/benchmarks.md, "The aims, one
// by one").
const aimSaturation = 1.2

// capacity is the fleet's capacity bound on a ladder's last step that has
// one (0: none).
func (r Run) capacity(steps []ladderStep) float64 {
	for i := len(steps) - 1; i >= 0; i-- {
		if f, ok := r.floor(steps[i].cell); ok && f.Capacity > 0 {
			return f.Capacity
		}
	}
	return 0
}

// saturationAim says whether cache_aware's saturation rate (mine) is at
// least aimSaturation × epp's (theirs), or that the ladder cannot tell: a
// rate known only as a bound (a first step already past the limit, a last
// step still below it) decides only when the bound is on the right side.
// Where the target is above the fleet's capacity bound (capacity > 0), no
// router can meet it: p90 passes any limit once the offered load exceeds
// what the fleet can serve.
func saturationAim(mine, mineP90, theirs, theirsP90 []float64, capacity float64) string {
	m, mBelow, mAbove := Saturation(mine, mineP90)
	t, tBelow, tAbove := Saturation(theirs, theirsP90)
	ratio := m / t
	verdict := "not decided by this ladder (a rate known only as a bound)"
	switch {
	case capacity > 0 && aimSaturation*t > capacity && !tBelow:
		verdict = fmt.Sprintf("unreachable (%.1f× epp's rate, %.2f req/s, is above the fleet's capacity bound, %.1f req/s)", aimSaturation, aimSaturation*t, capacity)
	case ratio >= aimSaturation && !mBelow && !tAbove:
		verdict = "yes"
	case ratio < aimSaturation && !mAbove && !tBelow:
		verdict = "no"
	}
	return fmt.Sprintf("The aim of cache_aware's saturation rate, at least %.1f× epp's: %.2f / %.2f req/s = %.2f×, met: %s.",
		aimSaturation, m, t, ratio, verdict)
}

// LadderChart plots a ladder's TTFT p90 against offered load, one line per
// policy, with the saturation limit dashed.
func (r Run) LadderChart(w io.Writer, base string) error {
	const width, height, left, right, top, bottom = 900.0, 420.0, 70.0, 170.0, 40.0, 60.0
	plotW, plotH := width-left-right, height-top-bottom
	steps, policies := r.ladder(base)
	maxRate, maxMS := 1.0, SaturationP90
	for _, st := range steps {
		maxRate = math.Max(maxRate, st.rate)
		for _, p := range policies {
			if s, ok := r.find(st.cell, p); ok {
				maxMS = math.Max(maxMS, s.TTFT.P90)
			}
		}
	}
	maxRate, maxMS = niceCeil(maxRate), niceCeil(maxMS)
	var b strings.Builder
	header(&b, width, height, base+": TTFT p90 against offered load")
	axes(&b, left, top, plotW, plotH, maxMS)
	for i := 0; i <= 5; i++ {
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="11">%s</text>`+"\n",
			left+plotW*float64(i)/5, top+plotH+16, shortNum(maxRate*float64(i)/5))
	}
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="12">offered load (requests/s); TTFT p90 in ms</text>`+"\n", left+plotW/2, top+plotH+40)
	limitY := top + plotH - plotH*SaturationP90/maxMS
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="gray" stroke-dasharray="6,4"/>`+"\n", left, limitY, left+plotW, limitY)
	for i, p := range policies {
		rates, p90 := r.curve(steps, p)
		var pts []string
		for j := range rates {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", left+plotW*rates[j]/maxRate, top+plotH-plotH*p90[j]/maxMS))
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", palette[i%len(palette)], strings.Join(pts, " "))
	}
	legend(&b, width-right+15, top, policies)
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}
