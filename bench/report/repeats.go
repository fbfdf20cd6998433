package report

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
)

// Repeated runs. Where runs spread widely (real pods, docs/benchmarks.md),
// one run per policy cannot tell a few percent apart. Merging several runs
// of the same workload makes each run a round: the joint summary is each
// policy's median over the rounds, and the rounds stay in Run.Repeats for a
// table that compares policies measured side by side in the same round.

// medianOf returns one policy's summary over rounds: the median of each
// measure, requests and successes summed over all rounds.
func medianOf(ss []Summary) Summary {
	if len(ss) == 1 {
		return ss[0]
	}
	med := func(f func(Summary) float64) float64 { return median(ss, f) }
	m := Summary{Workload: ss[0].Workload, Policy: ss[0].Policy, External: ss[0].External}
	for _, s := range ss {
		m.Requests += s.Requests
		m.Succeeded += s.Succeeded
		m.UpstreamUnknown = m.UpstreamUnknown || s.UpstreamUnknown
	}
	if m.Requests > 0 {
		m.SuccessRate = float64(m.Succeeded) / float64(m.Requests)
	}
	m.TTFT = medianPercentiles(ss, func(s Summary) Percentiles { return s.TTFT })
	m.Latency = medianPercentiles(ss, func(s Summary) Percentiles { return s.Latency })
	m.Duration = med(func(s Summary) float64 { return s.Duration })
	m.Throughput = med(func(s Summary) float64 { return s.Throughput })
	m.OutputTokensS = med(func(s Summary) float64 { return s.OutputTokensS })
	m.CacheHitRate = med(func(s Summary) float64 { return s.CacheHitRate })
	m.Imbalance = med(func(s Summary) float64 { return s.Imbalance })
	m.Rate = ss[0].Rate
	m.Runs = len(ss)
	span := func(f func(Summary) float64) [2]float64 {
		lo, hi := math.Inf(1), math.Inf(-1)
		for _, s := range ss {
			lo, hi = min(lo, f(s)), max(hi, f(s))
		}
		return [2]float64{lo, hi}
	}
	m.Spread = &Spread{
		TTFTP50:  span(func(s Summary) float64 { return s.TTFT.P50 }),
		TTFTP90:  span(func(s Summary) float64 { return s.TTFT.P90 }),
		TTFTP99:  span(func(s Summary) float64 { return s.TTFT.P99 }),
		CacheHit: span(func(s Summary) float64 { return s.CacheHitRate }),
	}
	// The prediction error's median over the runs that had predictions.
	var preds []*PredictionError
	for _, s := range ss {
		if s.PredictionError != nil {
			preds = append(preds, s.PredictionError)
		}
	}
	if len(preds) > 0 {
		pe := &PredictionError{
			ErrorRange: medianRange(preds, func(pe *PredictionError) (ErrorRange, bool) {
				return pe.ErrorRange, true
			}),
			SlotWait: medianRange(preds, func(pe *PredictionError) (ErrorRange, bool) {
				return pe.SlotWait, pe.SlotWaits > 0
			}),
			NoSlotWait: medianRange(preds, func(pe *PredictionError) (ErrorRange, bool) {
				if pe.SlotWaits == 0 { // every request (reports from before the split say only this)
					return pe.ErrorRange, pe.Requests > 0
				}
				return pe.NoSlotWait, pe.Requests > pe.SlotWaits
			}),
			Warm: medianRange(preds, func(pe *PredictionError) (ErrorRange, bool) {
				return pe.Warm, pe.Warmed > 0
			}),
		}
		for _, p := range preds {
			pe.Requests += p.Requests
			pe.SlotWaits += p.SlotWaits
			pe.Warmed += p.Warmed
		}
		m.PredictionError = pe
	}
	// The cache belief's figures: their medians over the runs that have one.
	var beliefs []*CacheBelief
	for _, s := range ss {
		if s.CacheBelief != nil {
			beliefs = append(beliefs, s.CacheBelief)
		}
	}
	if len(beliefs) > 0 {
		cb := &CacheBelief{
			ErrorRange: medianRange(beliefs, func(b *CacheBelief) (ErrorRange, bool) { return b.ErrorRange, true }),
			Bias:       median(beliefs, func(b *CacheBelief) float64 { return b.Bias }),
			Less:       median(beliefs, func(b *CacheBelief) float64 { return b.Less }),
			More:       median(beliefs, func(b *CacheBelief) float64 { return b.More }),
		}
		for _, b := range beliefs {
			cb.Requests += b.Requests
		}
		m.CacheBelief = cb
	}
	return m
}

// medianFloor is a workload's floor over rounds: each percentile's median,
// the requests summed.
func medianFloor(fs []Floor) Floor {
	if len(fs) == 1 {
		return fs[0]
	}
	m := Floor{Workload: fs[0].Workload, Runs: len(fs), TTFT: medianPercentiles(fs, func(f Floor) Percentiles { return f.TTFT }),
		Capacity: median(fs, func(f Floor) float64 { return f.Capacity })}
	for _, f := range fs {
		m.Requests += f.Requests
	}
	return m
}

// median is the median of f over xs.
func median[T any](xs []T, f func(T) float64) float64 {
	v := make([]float64, len(xs))
	for i, x := range xs {
		v[i] = f(x)
	}
	slices.Sort(v)
	return Quantile(v, 0.5)
}

// medianPercentiles is each percentile's median of f over xs.
func medianPercentiles[T any](xs []T, f func(T) Percentiles) Percentiles {
	return Percentiles{
		P50:  median(xs, func(x T) float64 { return f(x).P50 }),
		P90:  median(xs, func(x T) float64 { return f(x).P90 }),
		P99:  median(xs, func(x T) float64 { return f(x).P99 }),
		Mean: median(xs, func(x T) float64 { return f(x).Mean }),
	}
}

// rounds returns the repeats that ran workload, in merge order.
func (r Run) rounds(workload string) []Run {
	var out []Run
	for _, rr := range r.Repeats {
		if slices.ContainsFunc(rr.Summaries, func(s Summary) bool { return s.Workload == workload }) {
			out = append(out, rr)
		}
	}
	return out
}

// writeRounds renders each round of one workload and cache_aware's change
// against every other policy of the same round.
func writeRounds(b *strings.Builder, workload string, policies []string, rounds []Run) {
	fmt.Fprintf(b, "\nThe table above is each policy's median over the %d runs below that ran it. Each run (TTFT p90 / p99 ms, cache hit):\n\n", len(rounds))
	b.WriteString("| run | " + strings.Join(policies, " | ") + " |\n|---|" + strings.Repeat("---|", len(policies)) + "\n")
	for i, rr := range rounds {
		fmt.Fprintf(b, "| %d (%s) |", i+1, cmp.Or(rr.Label, rr.Started))
		for _, p := range policies {
			s, ok := rr.find(workload, p)
			if !ok {
				b.WriteString(" — |")
				continue
			}
			fmt.Fprintf(b, " %.0f / %.0f, %.1f%%", s.TTFT.P90, s.TTFT.P99, 100*s.CacheHitRate)
			if failed := s.Requests - s.Succeeded; failed > 0 {
				fmt.Fprintf(b, ", %d failed", failed)
			}
			b.WriteString(" |")
		}
		b.WriteString("\n")
	}
	var lines []string
	for _, p := range policies {
		if p == "cache_aware" {
			continue
		}
		d90 := roundChanges(rounds, workload, p, func(s Summary) float64 { return s.TTFT.P90 })
		d99 := roundChanges(rounds, workload, p, func(s Summary) float64 { return s.TTFT.P99 })
		if len(d90) == 0 {
			continue
		}
		each := make([]string, len(d90))
		for i := range d90 {
			each[i] = fmt.Sprintf("%+.0f%% / %+.0f%%", d90[i], d99[i])
		}
		slices.Sort(d90)
		slices.Sort(d99)
		lines = append(lines, fmt.Sprintf("- %s: %s (median %+.0f%% / %+.0f%%)",
			p, strings.Join(each, ", "), Quantile(d90, 0.5), Quantile(d99, 0.5)))
	}
	if len(lines) > 0 {
		b.WriteString("\ncache_aware against each policy in the same run, TTFT p90 / p99:\n\n" + strings.Join(lines, "\n") + "\n")
	}
	writeReachable(b, workload, rounds)
}

// roundChanges is cache_aware's change against policy in each round that
// ran both on workload, in percent of pick's value (mine / theirs − 1), in
// round order; a round where policy has no TTFT (no request succeeded) is
// left out.
func roundChanges(rounds []Run, workload, policy string, pick func(Summary) float64) []float64 {
	var out []float64
	for _, rr := range rounds {
		me, ok1 := rr.find(workload, "cache_aware")
		o, ok2 := rr.find(workload, policy)
		if ok1 && ok2 && o.TTFT.P90 > 0 && o.TTFT.P99 > 0 {
			out = append(out, 100*(pick(me)/pick(o)-1))
		}
	}
	return out
}

// writeReachable renders each latency aim of cache_aware over the rounds
// where it was within reach: a run whose floor lies above the aim's target
// says nothing of the router (no router could meet it there), so the merged
// medians, which count such runs, are read beside how often the aim was
// met where it could be, and the median change over those runs.
func writeReachable(b *strings.Builder, workload string, rounds []Run) {
	type tally struct {
		what, rival      string
		met, unreachable int
		margins          []float64
	}
	var order []string
	tallies := map[string]*tally{}
	for _, rr := range rounds {
		for _, a := range rr.Aims(workload, "cache_aware") {
			if a.Kind != AimLatency {
				continue
			}
			key := a.What + " " + a.Rival
			t := tallies[key]
			if t == nil {
				t = &tally{what: a.What, rival: a.Rival}
				tallies[key] = t
				order = append(order, key)
			}
			switch {
			case a.Unreachable:
				t.unreachable++
			case a.Met:
				t.met++
				fallthrough
			default:
				t.margins = append(t.margins, 100*a.Margin)
			}
		}
	}
	var lines []string
	for _, key := range order {
		t := tallies[key]
		if t.unreachable == 0 {
			continue // the merged verdict and the changes above say it all
		}
		line := fmt.Sprintf("- %s %s: unreachable in %d of %d runs", t.what, t.rival, t.unreachable, t.unreachable+len(t.margins))
		if n := len(t.margins); n > 0 {
			slices.Sort(t.margins)
			line += fmt.Sprintf("; met in %d of the %d others, their median change %+.0f%%", t.met, n, Quantile(t.margins, 0.5))
		}
		lines = append(lines, line)
	}
	if len(lines) > 0 {
		b.WriteString("\nThe latency aims run by run, where a run's floor put some out of any router's reach:\n\n" + strings.Join(lines, "\n") + "\n")
	}
}

// medianRange is the median, over the runs' figures xs that have one, of
// the error range part picks from each.
func medianRange[T any](xs []T, part func(T) (ErrorRange, bool)) ErrorRange {
	var with []ErrorRange
	for _, x := range xs {
		if r, ok := part(x); ok {
			with = append(with, r)
		}
	}
	if len(with) == 0 {
		return ErrorRange{}
	}
	return ErrorRange{Median: median(with, func(r ErrorRange) float64 { return r.Median }),
		P90: median(with, func(r ErrorRange) float64 { return r.P90 })}
}
