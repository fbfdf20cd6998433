package report

import (
	"math"
	"strings"
	"testing"
)

func TestAimsOnASharedWorkload(t *testing.T) {
	mk := func(p string, p90, p99, hit float64, failed int) Summary {
		return Summary{Workload: "shared-prefix", Policy: p, Requests: 10, Succeeded: 10 - failed,
			TTFT: Percentiles{P90: p90, P99: p99}, CacheHitRate: hit}
	}
	r := Run{Summaries: []Summary{
		mk("cache_aware", 60, 120, 0.90, 0),
		mk("epp", 80, 130, 0.92, 1),
		mk("round_robin", 100, 200, 0.50, 0),
		mk("ca-variant", 10, 10, 1, 0), // an experiment's arm, not a baseline
	}}
	got := map[string]Aim{}
	for _, a := range r.Aims("shared-prefix", "cache_aware") {
		got[a.What+" "+a.Rival] = a
	}
	want := map[string]bool{
		"TTFT p90 ≥15% below epp":         true,  // −25%
		"TTFT p99 ≥15% below epp":         false, // −7.7%
		"TTFT p90 ≥25% below round_robin": true,  // −40%
		"TTFT p99 ≥25% below round_robin": true,  // −40%
		// 2 points below the best baseline's hit rate, with both percentiles
		// below its: the copies bought latency.
		"cache hit within 1.5 points epp":     true,
		"failed requests no more round_robin": true,
	}
	if len(got) != len(want) {
		t.Fatalf("aims %v, want %d of them", got, len(want))
	}
	for k, met := range want {
		a, ok := got[k]
		if !ok || a.Met != met {
			t.Errorf("%s: %+v (present %v), want met=%v", k, a, ok, met)
		}
	}
	if a := got["TTFT p90 ≥15% below epp"]; math.Abs(a.Margin+0.25) > 1e-9 || a.Mine != 60 || a.Theirs != 80 {
		t.Errorf("margin against epp %+v, want −25%% of 80 ms", a)
	}
	if a := got["cache hit within 1.5 points epp"]; math.Abs(a.Margin+0.02) > 1e-9 || !a.Bought {
		t.Errorf("hit-rate aim %+v, want −0.02, met by latency", a)
	}
	// The same hit rates with epp's p99 lower: nothing bought, not met.
	r.Summaries[1].TTFT.P99 = 110
	for _, a := range r.Aims("shared-prefix", "cache_aware") {
		if a.Kind == AimHitRate && (a.Met || a.Bought) {
			t.Errorf("hit-rate aim %+v with a higher p99, want not met", a)
		}
	}
}

func TestAimsWhereNothingIsShared(t *testing.T) {
	mk := func(p string, p90, p99 float64) Summary {
		return Summary{Workload: "no-sharing", Policy: p, Requests: 4, Succeeded: 4, TTFT: Percentiles{P90: p90, P99: p99}}
	}
	r := Run{Summaries: []Summary{mk("cache_aware", 104, 110), mk("epp", 120, 100), mk("least_request", 100, 130)}}
	aims := r.Aims("no-sharing", "cache_aware")
	if len(aims) != 4 {
		t.Fatalf("aims %+v, want p90, p99, hit rate and failures", aims)
	}
	// Against the best baseline of each percentile, not against epp alone.
	if a := aims[0]; a.Rival != "least_request" || !a.Met || math.Abs(a.Margin-0.04) > 1e-9 {
		t.Errorf("p90 aim %+v, want +4%% against least_request, met", a)
	}
	if a := aims[1]; a.Rival != "epp" || a.Met {
		t.Errorf("p99 aim %+v, want +10%% against epp, missed", a)
	}
	if r.Aims("no-sharing", "absent") != nil || (Run{Summaries: r.Summaries[:1]}).Aims("no-sharing", "cache_aware") != nil {
		t.Error("aims without the policy or without any baseline")
	}
}

func TestAimsRendered(t *testing.T) {
	r := Run{Title: "t", Summaries: []Summary{
		{Workload: "hot-prompt", Policy: "cache_aware", Requests: 2, Succeeded: 2, TTFT: Percentiles{P90: 60, P99: 100}, CacheHitRate: 0.887},
		{Workload: "hot-prompt", Policy: "epp", Requests: 2, Succeeded: 1, TTFT: Percentiles{P90: 80, P99: 100}, CacheHitRate: 0.8874},
	}}
	var b strings.Builder
	if err := r.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"The aims of cache_aware on hot-prompt, from the table above (docs/benchmarks.md, \"The aims, one by one\"): 4 of 4 met.",
		"| TTFT p90 within 5% of the best | epp | 60 ms | 80 ms | -25.0% | yes |",
		"| TTFT p99 no higher | epp | 100 ms | 100 ms | +0.0% | yes |",
		"| failed requests no more | epp | 0 | 1 | -1 | yes |",
		"| cache hit within 1.5 points | epp | 88.7% | 88.7% | -0.0 points | yes |",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, b.String())
		}
	}
}

// A floor of 70 ms at p90: 15% below epp's 80 ms is 68 ms, which no router
// can reach; at p99, 15% below 130 ms is 110.5 ms, above the floor's 100.
// An external router (sglang-router) is a baseline like the stand-ins.
func TestAimsBelowTheFloorAreUnreachable(t *testing.T) {
	mk := func(p string, p90, p99 float64) Summary {
		return Summary{Workload: "kv-pressure", Policy: p, Requests: 4, Succeeded: 4, TTFT: Percentiles{P90: p90, P99: p99}}
	}
	ext := mk("sglang-router", 80, 140)
	ext.External, ext.UpstreamUnknown = true, true
	r := Run{Summaries: []Summary{mk("cache_aware", 75, 105), mk("epp", 80, 130), ext},
		Floors: []Floor{{Workload: "kv-pressure", Requests: 4, TTFT: Percentiles{P50: 20, P90: 70, P99: 100}}}}
	got := map[string]Aim{}
	for _, a := range r.Aims("kv-pressure", "cache_aware") {
		got[a.What+" "+a.Rival] = a
	}
	if a := got["TTFT p90 ≥15% below epp"]; !a.Unreachable || a.Met || a.Floor != 70 || a.Target != 68 {
		t.Errorf("p90 against epp %+v, want unreachable: target 68 below the floor's 70", a)
	}
	if a := got["TTFT p99 ≥15% below epp"]; a.Unreachable || !a.Met || a.Floor != 100 {
		t.Errorf("p99 against epp %+v, want reachable and met (105 ≤ 110.5)", a)
	}
	// A router of another make is a peer: 15% below its 80 ms is 68 ms,
	// below the floor too.
	if a, ok := got["TTFT p90 ≥15% below sglang-router"]; !ok || !a.Unreachable {
		t.Errorf("p90 against sglang-router %+v (present %v), want an unreachable aim", a, ok)
	}
	var b strings.Builder
	if err := r.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| *floor: no router can beat this* | 20.0 | 70.0 | 100.0 |",
		"each of the 4 requests alone on an idle pod",
		"2 unreachable: they ask for a TTFT below the floor",
		"| TTFT p90 ≥15% below | epp | 75 ms | 80 ms | -6.2% | no (unreachable: 68 ms is below the floor's 70 ms) |",
		"| sglang-router | 0.0 | 80.0 | 140.0 | 0.0 | 0.0 | 0.00 | 0.0% | 0.0% | unknown | – |",
		"External routers, run in place of our gateway against the same pods: sglang-router.",
		"Imbalance unknown for sglang-router",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, b.String())
		}
	}
}

// The prediction's aims depend on the fleet: on simulated pods a median
// error of at most 20% and a p90 of at most 50%, on real llama.cpp pods a
// median of at most 35%. They need no baseline, and each states the error
// from the run's WarmUp on beside the whole run's.
func TestPredictionAimsByFleet(t *testing.T) {
	ca := Summary{Workload: "multi-turn", Policy: "cache_aware", Requests: 100, Succeeded: 100,
		PredictionError: &PredictionError{Requests: 100, ErrorRange: ErrorRange{Median: 0.08, P90: 0.56}, Warmed: 80, Warm: ErrorRange{Median: 0.06, P90: 0.34}}}
	run := func(engine string) Run {
		return Run{Settings: map[string]string{"engine": engine}, Summaries: []Summary{ca}}
	}
	aims := run("sim").Aims("multi-turn", "cache_aware")
	if len(aims) != 2 || !aims[0].Met || aims[1].Met || aims[1].Theirs != 0.5 || aims[1].Warm != 0.34 {
		t.Fatalf("simulated pods: %+v, want the median met and the p90 (56%% against 50%%) not", aims)
	}
	var b strings.Builder
	if err := run("vllm").WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"The aims of cache_aware on multi-turn, from the table above (docs/benchmarks.md, \"The aims, one by one\"): 1 of 2 met.",
		"| TTFT prediction error median ≤20% | – | 8% | 20% (the aim) | -12 points | yes (from 5s on: 6%) |",
		"| TTFT prediction error p90 ≤50% | – | 56% | 50% (the aim) | +6 points | no (from 5s on: 34%) |",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, b.String())
		}
	}
	if aims := run("llama").Aims("multi-turn", "cache_aware"); len(aims) != 1 || aims[0].Theirs != 0.35 || !aims[0].Met {
		t.Errorf("real pods: %+v, want the median's aim of 35%% alone, met", aims)
	}
	if aims := run("").Aims("multi-turn", "cache_aware"); aims != nil {
		t.Errorf("no engine named: %+v, want no prediction aims", aims)
	}
	cold := run("sim")
	cold.Summaries[0].PredictionError = &PredictionError{Requests: 10, ErrorRange: ErrorRange{Median: 0.1, P90: 0.2}}
	b.Reset()
	if err := cold.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	if want := "| TTFT prediction error p90 ≤50% | – | 20% | 50% (the aim) | -30 points | yes |"; !strings.Contains(b.String(), want) {
		t.Errorf("a run shorter than the warm-up: report lacks %q:\n%s", want, b.String())
	}
}
