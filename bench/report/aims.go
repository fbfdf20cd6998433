package report

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// The aims of the routing work, checked on every workload of a run
// (docs/benchmarks.md, "The aims, one by one"):
//   - where prompts share prefixes, TTFT p90 and p99 at most 0.85× every
//     peer's (the stand-ins of llm-d's EPP and SGLang's router, and every
//     router of another make run beside the fleet) and at most 0.75× the
//     simple policies' (round_robin, random, least_request, prefix_only);
//   - where nothing is shared, p90 and p99 within 5% of the best
//     baseline's;
//   - on hot-prompt (one prompt for every request: spreading it is the
//     best placement, and every policy that spreads it is level), p90
//     within 5% of the best baseline's and p99 no higher than epp's;
//   - everywhere, a true cache-hit rate within 1.5 points of the best
//     baseline's, or lower where both TTFT percentiles are below that
//     baseline's (the copies bought latency), and no more failed requests
//     than the baseline with the fewest;
//   - the prediction of the chosen pod's TTFT: a median absolute relative
//     error of at most 20% on simulated pods (our simulated engine, the
//     vLLM-like pods) and 35% on real llama.cpp pods, a p90 of at most 50%
//     on simulated pods; each beside the same from the run's WarmUp on.
const (
	aimVsPeers   = 0.15
	aimVsSimple  = 0.25
	aimLevel     = 0.05
	aimHitPoints = 0.015
	// hitEqual: hit rates that round to the same tenth of a point, as the
	// report prints them, are equal.
	hitEqual      = 0.0005
	noSharingKind = "no-sharing"
	hotPromptKind = "hot-prompt"
	eppPolicy     = "epp"

	aimPredictionMedianSim  = 0.20
	aimPredictionMedianReal = 0.35
	aimPredictionP90Sim     = 0.50
)

// baselines are the policies the aims compare with: the peers' stand-ins
// and the simple policies. Variants and fixed placements of a run are
// experiments, not baselines.
var (
	peers     = []string{eppPolicy, "sglang"}
	baselines = append([]string{"round_robin", "random", "least_request", "prefix_only"}, peers...)
)

// AimKind says what an aim compares.
type AimKind int

const (
	AimLatency AimKind = iota // TTFT in ms; Margin = Mine/Theirs − 1
	AimHitRate                // true cache-hit rates; Margin = Mine − Theirs
	AimFailed                 // failed requests; Margin = Mine − Theirs
	// AimPrediction: the relative error of the predicted TTFT, as a
	// fraction, against the most the aim allows (Theirs, no Rival);
	// Margin = Mine − Theirs. Warm is the same error from the run's
	// WarmUp on (PredictionError.Warm; below 0 where no request was
	// sent that late).
	AimPrediction
)

// Aim is one aim checked on one workload.
type Aim struct {
	Kind  AimKind
	What  string // e.g. "TTFT p90 ≥15% below"
	Rival string // the baseline it is measured against
	// Mine and Theirs are the two values compared; negative margins are
	// lower (see AimKind).
	Mine, Theirs, Margin float64
	Met                  bool
	// Target is the most a latency aim allows (Theirs × (1 + limit)).
	// Floor is the workload's floor of the same percentile (when the run
	// has a floor); Unreachable says Target is below it: no router can
	// meet the aim.
	Target, Floor float64
	Unreachable   bool
	// Bought says a hit-rate aim is met by latency: the hit rate is lower
	// than the rival's by more than the aim allows, but both TTFT
	// percentiles are below the rival's.
	Bought bool
	Warm   float64 // AimPrediction only
}

// Aims checks policy p's aims on one workload: against the baselines that
// ran it, and its prediction's where the run's engine has such aims; nil
// when p is missing or there is nothing to check.
func (r Run) Aims(workload, p string) []Aim {
	me, ok := r.find(workload, p)
	if !ok {
		return nil
	}
	return append(r.rivalAims(workload, me), predictionAims(me, r.Settings["engine"])...)
}

// predictionAims checks me's prediction error (none where it made no
// prediction or the engine is neither simulated nor llama.cpp).
func predictionAims(me Summary, engine string) []Aim {
	e := me.PredictionError
	if e == nil || e.Requests == 0 {
		return nil
	}
	aim := func(what string, mine, warm, limit float64) Aim {
		if e.Warmed == 0 {
			warm = -1
		}
		return Aim{Kind: AimPrediction, What: what, Mine: mine, Theirs: limit, Margin: mine - limit, Met: mine <= limit, Warm: warm}
	}
	switch engine {
	case "sim", "vllm":
		return []Aim{aim(fmt.Sprintf("TTFT prediction error median ≤%.0f%%", 100*aimPredictionMedianSim), e.Median, e.Warm.Median, aimPredictionMedianSim),
			aim(fmt.Sprintf("TTFT prediction error p90 ≤%.0f%%", 100*aimPredictionP90Sim), e.P90, e.Warm.P90, aimPredictionP90Sim)}
	case "llama":
		return []Aim{aim(fmt.Sprintf("TTFT prediction error median ≤%.0f%%", 100*aimPredictionMedianReal), e.Median, e.Warm.Median, aimPredictionMedianReal)}
	}
	return nil
}

// rivalAims checks me against the baselines that ran workload; nil when
// none did.
func (r Run) rivalAims(workload string, me Summary) []Aim {
	p := me.Policy
	var rivals []Summary
	for _, s := range r.Summaries {
		if s.Workload == workload && s.Policy != p && (slices.Contains(baselines, s.Policy) || s.External) {
			rivals = append(rivals, s)
		}
	}
	if len(rivals) == 0 {
		return nil
	}
	var aims []Aim
	fl, hasFloor := r.floor(workload)
	// latency is met when mine/theirs − 1 is at most limit (−0.15: 15% below);
	// it is out of any router's reach when theirs × (1 + limit) is below the floor.
	latency := func(what string, pick func(Summary) float64, rival Summary, limit float64) {
		mine, theirs := pick(me), pick(rival)
		if theirs <= 0 {
			return
		}
		m := mine/theirs - 1
		a := Aim{Kind: AimLatency, What: what, Rival: rival.Policy, Mine: mine, Theirs: theirs, Margin: m, Met: m <= limit,
			Target: theirs * (1 + limit)}
		if hasFloor {
			a.Floor = pick(Summary{TTFT: fl.TTFT})
			a.Unreachable = a.Target < a.Floor
		}
		aims = append(aims, a)
	}
	p90 := func(s Summary) float64 { return s.TTFT.P90 }
	p99 := func(s Summary) float64 { return s.TTFT.P99 }
	bestAt := func(pick func(Summary) float64) Summary {
		return slices.MinFunc(rivals, func(a, b Summary) int { return cmp.Compare(pick(a), pick(b)) })
	}
	level := func(name string, pick func(Summary) float64) {
		latency(fmt.Sprintf("TTFT %s within %.0f%% of the best", name, 100*aimLevel), pick, bestAt(pick), aimLevel)
	}
	switch workload {
	case noSharingKind:
		level("p90", p90)
		level("p99", p99)
	case hotPromptKind:
		level("p90", p90)
		for _, rival := range rivals {
			if rival.Policy == eppPolicy {
				latency("TTFT p99 no higher", p99, rival, 0)
			}
		}
	default:
		for _, rival := range rivals {
			aim, _ := aimAgainst(workload, rival.Policy, rival.External)
			latency(fmt.Sprintf("TTFT p90 ≥%.0f%% below", -100*aim), p90, rival, aim)
			latency(fmt.Sprintf("TTFT p99 ≥%.0f%% below", -100*aim), p99, rival, aim)
		}
	}
	hit := slices.MaxFunc(rivals, func(a, b Summary) int { return cmp.Compare(a.CacheHitRate, b.CacheHitRate) })
	h := Aim{Kind: AimHitRate, What: fmt.Sprintf("cache hit within %.1f points", 100*aimHitPoints), Rival: hit.Policy,
		Mine: me.CacheHitRate, Theirs: hit.CacheHitRate, Margin: me.CacheHitRate - hit.CacheHitRate}
	h.Met = h.Margin >= -aimHitPoints-hitEqual
	if !h.Met && p90(me) < p90(hit) && p99(me) < p99(hit) {
		h.Met, h.Bought = true, true
	}
	aims = append(aims, h)
	failed := func(s Summary) int { return s.Requests - s.Succeeded }
	few := slices.MinFunc(rivals, func(a, b Summary) int { return failed(a) - failed(b) })
	aims = append(aims, Aim{Kind: AimFailed, What: "failed requests no more", Rival: few.Policy, Mine: float64(failed(me)), Theirs: float64(failed(few)),
		Margin: float64(failed(me) - failed(few)), Met: failed(me) <= failed(few)})
	return aims
}

// aimAgainst is the most cache_aware's TTFT p90 and p99 may be against
// policy on a workload where prompts share prefixes, as a change (−0.15:
// 15% below); false where there is no such aim against it (a workload
// judged against the best baseline instead, a variant, a fixed placement).
func aimAgainst(workload, policy string, external bool) (float64, bool) {
	switch {
	case workload == noSharingKind || workload == hotPromptKind:
		return 0, false
	case external || slices.Contains(peers, policy):
		return -aimVsPeers, true
	case slices.Contains(baselines, policy):
		return -aimVsSimple, true
	}
	return 0, false
}

// external says whether policy is a router of another make in r.
func (r Run) external(policy string) bool {
	return slices.ContainsFunc(r.Summaries, func(s Summary) bool { return s.Policy == policy && s.External })
}

// writeAims renders p's aims on one workload as a table.
func writeAims(b *strings.Builder, workload, p string, aims []Aim) {
	met, unreachable := 0, 0
	for _, a := range aims {
		if a.Met {
			met++
		}
		if a.Unreachable {
			unreachable++
		}
	}
	fmt.Fprintf(b, "\nThe aims of %s on %s, from the table above (docs/benchmarks.md, \"The aims, one by one\"): %d of %d met.", p, workload, met, len(aims))
	if unreachable > 0 {
		fmt.Fprintf(b, " %d unreachable: they ask for a TTFT below the floor, which no router can beat.", unreachable)
	}
	b.WriteString("\n\n")
	b.WriteString("| aim | baseline | " + p + " | baseline's | margin | met |\n|---|---|---:|---:|---:|---|\n")
	for _, a := range aims {
		var mine, theirs, margin string
		switch a.Kind {
		case AimHitRate:
			mine, theirs, margin = fmt.Sprintf("%.1f%%", 100*a.Mine), fmt.Sprintf("%.1f%%", 100*a.Theirs), fmt.Sprintf("%+.1f points", 100*a.Margin)
		case AimFailed:
			mine, theirs, margin = fmt.Sprintf("%.0f", a.Mine), fmt.Sprintf("%.0f", a.Theirs), fmt.Sprintf("%+.0f", a.Margin)
		case AimPrediction:
			mine, theirs, margin = fmt.Sprintf("%.0f%%", 100*a.Mine), fmt.Sprintf("%.0f%% (the aim)", 100*a.Theirs), fmt.Sprintf("%+.0f points", 100*a.Margin)
		default:
			mine, theirs, margin = fmt.Sprintf("%.0f ms", a.Mine), fmt.Sprintf("%.0f ms", a.Theirs), fmt.Sprintf("%+.1f%%", 100*a.Margin)
		}
		verdict := "no"
		if a.Met {
			verdict = "yes"
		}
		if a.Bought {
			verdict += " (lower TTFT p90 and p99: the copies bought latency)"
		}
		if a.Unreachable {
			verdict += fmt.Sprintf(" (unreachable: %.0f ms is below the floor's %.0f ms)", a.Target, a.Floor)
		}
		rival := a.Rival
		if a.Kind == AimPrediction {
			rival = "–"
			if a.Warm >= 0 {
				verdict += fmt.Sprintf(" (from %s on: %.0f%%)", WarmUp, 100*a.Warm)
			}
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s |\n", a.What, rival, mine, theirs, margin, verdict)
	}
}
