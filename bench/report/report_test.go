package report

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestQuantileInterpolates(t *testing.T) {
	v := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, c := range []struct{ q, want float64 }{{0, 1}, {0.5, 5.5}, {0.9, 9.1}, {1, 10}} {
		if got := Quantile(v, c.q); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("Quantile(%v) = %v, want %v", c.q, got, c.want)
		}
	}
}

func TestSummarize(t *testing.T) {
	rs := []Result{
		{Start: 0, TTFT: 10 * time.Millisecond, Latency: 100 * time.Millisecond, Status: 200, Worker: "a", PromptTokens: 100, CachedTokens: 80, CompletionTokens: 10},
		{Start: 50 * time.Millisecond, TTFT: 30 * time.Millisecond, Latency: 150 * time.Millisecond, Status: 200, Worker: "a", PromptTokens: 100, CachedTokens: 0, CompletionTokens: 10},
		{Start: 100 * time.Millisecond, TTFT: 20 * time.Millisecond, Latency: 900 * time.Millisecond, Status: 200, Worker: "b", PromptTokens: 200, CachedTokens: 100, CompletionTokens: 20},
		{Start: 0, Latency: 5 * time.Millisecond, Status: 429, Err: "queue full"},
	}
	s := Summarize("wl", "p", rs, []string{"a", "b", "c"})
	if s.Requests != 4 || s.Succeeded != 3 || s.SuccessRate != 0.75 {
		t.Fatalf("counts: %+v", s)
	}
	if s.TTFT.P50 != 20 || s.TTFT.Mean != 20 {
		t.Fatalf("ttft = %+v", s.TTFT)
	}
	if want := 180.0 / 400; s.CacheHitRate != want {
		t.Fatalf("cache hit = %v, want %v", s.CacheHitRate, want)
	}
	// a:2 b:1 c:0 → mean 1, max 2.
	if s.Imbalance != 2 {
		t.Fatalf("imbalance = %v, want 2", s.Imbalance)
	}
	if s.Duration != 1.0 || s.Throughput != 3 || s.OutputTokensS != 40 {
		t.Fatalf("duration %v throughput %v tok/s %v", s.Duration, s.Throughput, s.OutputTokensS)
	}
	if s.UpstreamUnknown {
		t.Error("imbalance unknown where answers named their worker")
	}
	// An external router's answers name no worker: the imbalance is unknown, not 0.
	for i := range rs {
		rs[i].Worker = ""
	}
	if s := Summarize("wl", "p", rs, []string{"a", "b", "c"}); !s.UpstreamUnknown || s.Imbalance != 0 || s.PerWorker != nil {
		t.Errorf("without upstream hosts: %+v, want the imbalance unknown", s)
	}
}

func sampleRun() Run {
	mk := func(wl, p string, p90 float64) Summary {
		return Summary{Workload: wl, Policy: p, Requests: 1, Succeeded: 1, SuccessRate: 1, TTFT: Percentiles{P50: p90 / 2, P90: p90, P99: p90 * 2}}
	}
	return Run{Title: "t", Summaries: []Summary{
		mk("shared-prefix", "cache_aware", 60), mk("shared-prefix", "round_robin", 100), mk("shared-prefix", "least_request", 80),
		mk("hot-prompt", "cache_aware", 100), mk("hot-prompt", "round_robin", 90), mk("hot-prompt", "least_request", 95),
	}}
}

func TestGainAgainstBestRival(t *testing.T) {
	r := sampleRun()
	g, rival, ok := r.Gain("shared-prefix", "cache_aware")
	if !ok || rival != "least_request" || math.Abs(g-0.25) > 1e-9 {
		t.Fatalf("gain = %v vs %s (%v), want 0.25 vs least_request", g, rival, ok)
	}
	g, rival, _ = r.Gain("hot-prompt", "cache_aware")
	if rival != "round_robin" || g >= 0 {
		t.Fatalf("hot-prompt gain = %v vs %s, want negative vs round_robin", g, rival)
	}
}

func TestRenderings(t *testing.T) {
	r := sampleRun()
	var md bytes.Buffer
	if err := r.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"## shared-prefix", "| cache_aware | 30.0 | 60.0 | 120.0 |", "vs the best other policy (least_request): -25.0%"} {
		if !strings.Contains(md.String(), want) {
			t.Fatalf("markdown lacks %q:\n%s", want, md.String())
		}
	}
	var js bytes.Buffer
	if err := r.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back Run
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || len(back.Summaries) != 6 {
		t.Fatalf("json round trip: %v (%d summaries)", err, len(back.Summaries))
	}
	var svg bytes.Buffer
	if err := r.BarChart(&svg, "TTFT p90", "ms", func(s Summary) float64 { return s.TTFT.P90 }); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(svg.String(), "<rect x="); n != 6+3 { // 6 bars + 3 legend swatches
		t.Fatalf("bar chart has %d rects, want 9", n)
	}
	mustParseXML(t, svg.Bytes())
	if strings.Contains(svg.String(), `stroke="white"`) {
		t.Fatal("no bar is an outlier, yet the chart draws a break mark")
	}
	svg.Reset()
	if err := CDF(&svg, "TTFT CDF", "ms", map[string][]float64{"a": {3, 1, 2}, "b": {5}}, []string{"a", "b"}); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(svg.String(), "<polyline"); n != 2 {
		t.Fatalf("CDF has %d lines, want 2", n)
	}
	mustParseXML(t, svg.Bytes())
}

func TestBarChartClipsAnOutlier(t *testing.T) {
	r := sampleRun()
	r.Summaries = append(r.Summaries, Summary{Workload: "shared-prefix", Policy: "prefix_only", TTFT: Percentiles{P90: 100000}})
	var svg bytes.Buffer
	if err := r.BarChart(&svg, "TTFT p90", "ms", func(s Summary) float64 { return s.TTFT.P90 }); err != nil {
		t.Fatal(err)
	}
	out := svg.String()
	mustParseXML(t, svg.Bytes())
	// shared-prefix's median bar is 90 ms, so its axis stops at 3×90 → 500,
	// and the 100 s bar is drawn clipped with its value written on it.
	for _, want := range []string{">500</text>", ">100k</text>", `stroke="white"`, "prefix_only: 100000.00 ms"} {
		if !strings.Contains(out, want) {
			t.Errorf("clipped chart lacks %q", want)
		}
	}
	if got := panelMax([]float64{60, 100, 80}, 3); got != 100 {
		t.Errorf("panelMax without outlier = %v, want 100", got)
	}
}

func mustParseXML(t *testing.T, b []byte) {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(b))
	for {
		_, err := d.Token()
		if err != nil {
			if err.Error() == "EOF" {
				return
			}
			t.Fatalf("svg is not well-formed XML: %v", err)
		}
	}
}

func TestMergeKeepsDifferingSettingsPerWorkload(t *testing.T) {
	a := Run{Title: "t", Settings: map[string]string{"rate": "1", "workers": "3"},
		Summaries: []Summary{{Workload: "shared-prefix", Policy: "cache_aware"}}}
	b := Run{Settings: map[string]string{"rate": "0.5", "workers": "3"},
		Summaries: []Summary{{Workload: "multi-turn", Policy: "cache_aware"}, {Workload: "multi-turn", Policy: "round_robin"}}}
	m := Merge(a, b)
	if len(m.Summaries) != 3 || m.Title != "t" {
		t.Fatalf("merged %d summaries, title %q", len(m.Summaries), m.Title)
	}
	if m.Settings["workers"] != "3" || m.Settings["rate"] != "shared-prefix 1, multi-turn 0.5" {
		t.Fatalf("settings %v", m.Settings)
	}
	if !slices.Equal(m.Workloads(), []string{"shared-prefix", "multi-turn"}) {
		t.Fatalf("workloads %v", m.Workloads())
	}
	// Runs of one workload with other values name each value once, together.
	c := Run{Settings: map[string]string{"rate": "0.25", "workers": "3"},
		Summaries: []Summary{{Workload: "multi-turn", Policy: "cache_aware"}}}
	if got := Merge(a, b, c, b).Settings["rate"]; got != "shared-prefix 1, multi-turn 0.5/0.25" {
		t.Fatalf("rate %q", got)
	}
	b.Title = "other fleet"
	if m := Merge(a, b); m.Title == a.Title || m.Title == b.Title {
		t.Fatalf("runs on two fleets merged under one fleet's title %q", m.Title)
	}
}

// Runs of the same workload and policies are rounds: the merged table is each
// policy's median, and the report pairs the policies of each round.
func TestMergeOfRepeatedRunsTakesMedians(t *testing.T) {
	round := func(started string, ca, sg float64, failed int) Run {
		return Run{Title: "t", Started: started, Settings: map[string]string{"rate": "1"}, Summaries: []Summary{
			{Workload: "shared-prefix", Policy: "cache_aware", Requests: 10, Succeeded: 10 - failed,
				TTFT: Percentiles{P90: ca, P99: 2 * ca}, CacheHitRate: ca / 1000},
			{Workload: "shared-prefix", Policy: "sglang", Requests: 10, Succeeded: 10,
				TTFT: Percentiles{P90: sg, P99: 4 * sg}, CacheHitRate: 0.9},
		}}
	}
	other := Run{Title: "t", Settings: map[string]string{"rate": "0.5"}, Summaries: []Summary{{Workload: "no-sharing", Policy: "cache_aware", TTFT: Percentiles{P90: 7}}}}
	ra, rb, rc := round("a", 400, 500, 0), round("b", 900, 600, 1), round("c", 500, 1000, 0)
	for i, r := range []*Run{&ra, &rb, &rc} {
		r.SetFloor(Floor{Workload: "shared-prefix", Requests: 10, TTFT: Percentiles{P50: 10, P90: float64(100 * (3 - i)), P99: 300}})
	}
	m := Merge(ra, rb, rc, other)
	if len(m.Floors) != 1 || m.Floors[0].TTFT.P90 != 200 || m.Floors[0].Requests != 30 || m.Floors[0].Runs != 3 {
		t.Fatalf("merged floors %+v, want the median p90 of 300, 200, 100 over 30 requests", m.Floors)
	}
	if len(m.Summaries) != 3 || len(m.Repeats) != 4 {
		t.Fatalf("merged %d summaries and %d repeats, want 3 and 4", len(m.Summaries), len(m.Repeats))
	}
	if got := m.Settings["rate"]; got != "shared-prefix 1, no-sharing 0.5" {
		t.Fatalf("rate %q: the repeats should name theirs once", got)
	}
	ca, _ := m.find("shared-prefix", "cache_aware")
	if ca.TTFT.P90 != 500 || ca.TTFT.P99 != 1000 || ca.CacheHitRate != 0.5 || ca.Requests != 30 || ca.Succeeded != 29 {
		t.Fatalf("cache_aware over three rounds: %+v", ca)
	}
	if g, rival, _ := m.Gain("shared-prefix", "cache_aware"); rival != "sglang" || math.Abs(g-(1-500.0/600)) > 1e-9 {
		t.Fatalf("gain %v against %s, want the medians' 500 against 600", g, rival)
	}
	if ns, _ := m.find("no-sharing", "cache_aware"); ns.TTFT.P90 != 7 {
		t.Fatalf("a workload run once: %+v", ns)
	}
	// Merging the merged run again (a report rendered anew) keeps its runs.
	again := Merge(m)
	if len(again.Repeats) != 4 || len(again.Summaries) != 3 {
		t.Fatalf("merged again: %d summaries and %d repeats, want 3 and 4", len(again.Summaries), len(again.Repeats))
	}
	if ca2, _ := again.find("shared-prefix", "cache_aware"); ca2.TTFT != ca.TTFT || ca2.Succeeded != ca.Succeeded {
		t.Fatalf("cache_aware merged again %+v, want %+v", ca2, ca)
	}
	var b strings.Builder
	if err := m.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"median over the 3 runs below",
		"| 2 (b) | 900 / 1800, 90.0%, 1 failed | 600 / 2400, 90.0% |",
		"- sglang: -20% / -60%, +50% / -25%, -50% / -75% (median -20% / -60%)",
	} {
		if !strings.Contains(b.String(), want) {
			t.Fatalf("report lacks %q:\n%s", want, b.String())
		}
	}
	if strings.Count(b.String(), "median over") != 1 {
		t.Fatalf("the no-sharing run, run once, got a rounds table:\n%s", b.String())
	}
}

// A workload's table of runs has a column for each policy it ran, not for
// every policy of the merged report.
func TestRoundsTableHasTheWorkloadsOwnPolicies(t *testing.T) {
	run := func(started string) Run {
		return Run{Title: "t", Started: started, Summaries: []Summary{
			{Workload: "shared-prefix", Policy: "cache_aware", TTFT: Percentiles{P90: 1, P99: 2}},
			{Workload: "shared-prefix", Policy: "sglang", TTFT: Percentiles{P90: 1, P99: 2}},
			{Workload: "multi-turn", Policy: "cache_aware", TTFT: Percentiles{P90: 1, P99: 2}},
			{Workload: "multi-turn", Policy: "prefix_only", TTFT: Percentiles{P90: 1, P99: 2}},
		}}
	}
	var b strings.Builder
	if err := Merge(run("a"), run("b")).WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| run | cache_aware | sglang |\n", "| run | cache_aware | prefix_only |\n"} {
		if !strings.Contains(b.String(), want) {
			t.Fatalf("report lacks %q:\n%s", want, b.String())
		}
	}
	if strings.Contains(b.String(), " — |") {
		t.Fatalf("a column for a policy the workload did not run:\n%s", b.String())
	}
}

// The prediction error column reads the gateway's predicted TTFT against the
// observed one; without predictions it shows a dash.
func TestPredictionErrorFromTheHeader(t *testing.T) {
	if ParsePredictedTTFT(" 120.5 ") != 120.5 || ParsePredictedTTFT("") != 0 || ParsePredictedTTFT("-3") != 0 || ParsePredictedTTFT("NaN") != 0 {
		t.Fatal("ParsePredictedTTFT")
	}
	var rs []Result
	for i, pred := range []float64{100, 110, 80, 150, 0} { // errors 0, 0.1, 0.2, 0.5, none
		rs = append(rs, Result{Session: fmt.Sprint(i), Status: 200, TTFT: 100 * time.Millisecond, Latency: time.Second, PredictedTTFTms: pred})
	}
	rs[2].PredictedSlotWaitms, rs[3].PredictedSlotWaitms = 60, 120     // errors 0.2 and 0.5 waited for ends
	rs = append(rs, Result{Status: 500, Err: "x", PredictedTTFTms: 1}) // failed: not counted
	s := Summarize("w", "cache_aware", rs, nil)
	if pe := s.PredictionError; pe == nil || pe.Requests != 4 || math.Abs(pe.Median-0.15) > 1e-9 || math.Abs(pe.P90-(0.2+0.7*0.3)) > 1e-9 {
		t.Fatalf("prediction error %+v, want 4 requests, median 0.15, p90 0.41", s.PredictionError)
	}
	if pe := s.PredictionError; pe.SlotWaits != 2 || !near(pe.SlotWait.Median, 0.35) || !near(pe.SlotWait.P90, 0.2+0.9*0.3) ||
		!near(pe.NoSlotWait.Median, 0.05) || !near(pe.NoSlotWait.P90, 0.09) {
		t.Fatalf("prediction error %+v: want 2 slot waits at 0.35 / 0.47, the others at 0.05 / 0.09", pe)
	}
	none := Summarize("w", "round_robin", rs[4:5], nil)
	run := Run{Summaries: []Summary{s, none}}
	var b strings.Builder
	if err := run.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "| 15% / 41% (without slot waits 5% / 9%; 50% wait: 35% / 47%) |") || !strings.Contains(b.String(), "| – |") {
		t.Fatalf("report lacks the prediction error cells:\n%s", b.String())
	}
}

// Repeated runs show the median with the range beside it.
func TestMergedCellsShowTheirRange(t *testing.T) {
	round := func(p90 float64) Run {
		return Run{Summaries: []Summary{{Workload: "w", Policy: "a", Requests: 1, Succeeded: 1, TTFT: Percentiles{P90: p90}, CacheHitRate: p90 / 1000}}}
	}
	m := Merge(round(300), round(100), round(200))
	s, _ := m.find("w", "a")
	if s.Runs != 3 || s.Spread == nil || s.Spread.TTFTP90 != [2]float64{100, 300} || s.TTFT.P90 != 200 {
		t.Fatalf("merged %+v", s)
	}
	var b strings.Builder
	if err := m.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "| 200.0 (100.0–300.0) |") || !strings.Contains(b.String(), "20.0% (10.0–30.0)") {
		t.Fatalf("report lacks the ranges:\n%s", b.String())
	}
}

// A rate ladder is reported as curves with each policy's saturation rate:
// where TTFT p90 passes 2 s, interpolated between the steps around it.
func TestLadderSaturationRate(t *testing.T) {
	rate, below, above := Saturation([]float64{2, 4, 8}, []float64{500, 1000, 3000})
	if below || above || math.Abs(rate-6) > 1e-9 {
		t.Fatalf("saturation %v (%v %v), want 6", rate, below, above)
	}
	if _, below, _ := Saturation([]float64{2}, []float64{2500}); !below {
		t.Fatal("a first step past the limit is not 'at most'")
	}
	if r, _, above := Saturation([]float64{2, 4}, []float64{10, 20}); !above || r != 4 {
		t.Fatal("a ladder that never saturates is not 'more than' its last rate")
	}
	var run Run
	for _, st := range []struct {
		rate   float64
		p, q   string
		pv, qv float64
	}{{2, "a", "b", 500, 400}, {4, "a", "b", 1000, 2400}, {8, "a", "", 3000, 0}} {
		run.Summaries = append(run.Summaries, Summary{Workload: LadderStep("spl", st.rate), Policy: st.p, Rate: st.rate, TTFT: Percentiles{P90: st.pv}})
		if st.q != "" {
			run.Summaries = append(run.Summaries, Summary{Workload: LadderStep("spl", st.rate), Policy: st.q, Rate: st.rate, TTFT: Percentiles{P90: st.qv}})
		}
	}
	var b strings.Builder
	if err := run.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"## spl: latency against load", "| 8 | 3000 / 0 | – |", "| saturation req/s | 6.00 | 3.60 |"} {
		if !strings.Contains(b.String(), want) {
			t.Fatalf("report lacks %q:\n%s", want, b.String())
		}
	}
	if got := run.Ladders(); len(got) != 1 || got[0] != "spl" {
		t.Fatalf("ladders %v", got)
	}
	var svg strings.Builder
	if err := run.LadderChart(&svg, "spl"); err != nil {
		t.Fatal(err)
	}
	if err := xml.Unmarshal([]byte(svg.String()), new(struct{})); err != nil {
		t.Fatalf("ladder chart is not XML: %v", err)
	}
	if n := strings.Count(svg.String(), "<polyline"); n != 2 || !strings.Contains(svg.String(), "stroke-dasharray") {
		t.Fatalf("ladder chart: %d curves, want 2 and the dashed limit", n)
	}
}

// The saturation aim (cache_aware at least 1.2× epp's rate) is decided
// only where the ladder bounds both rates on the side that matters.
func TestSaturationAim(t *testing.T) {
	rates := []float64{2, 4, 8}
	for _, tc := range []struct {
		name       string
		mine, epps []float64 // p90 at each step
		capacity   float64
		want       string
	}{
		{"met", []float64{500, 1000, 3000}, []float64{1000, 3000}, 0, "6.00 / 3.00 req/s = 2.00×, met: yes."},
		{"missed", []float64{500, 2500}, []float64{500, 2500}, 0, "= 1.00×, met: no."},
		// cache_aware never saturates (> 8), epp at 3: more than 2.67×.
		{"a lower bound above the aim", []float64{10, 20, 30}, []float64{1000, 3000}, 0, "met: yes."},
		// Both never saturate: 8 against more than 8, nothing decided.
		{"two lower bounds", []float64{10, 20, 30}, []float64{10, 20, 30}, 0, "met: not decided by this ladder"},
		// epp saturates at 6 (4 + 4·(2000−1000)/(3000−1000)), so 1.2× is
		// 7.2, above a capacity of 5: no router can meet it.
		{"above the capacity", []float64{500, 2500}, []float64{500, 1000, 3000}, 5, "met: unreachable (1.2× epp's rate, 7.20 req/s, is above the fleet's capacity bound, 5.0 req/s)"},
		// The same with a capacity of 8: the aim stands, and is missed.
		{"below the capacity", []float64{500, 2500}, []float64{500, 1000, 3000}, 8, "met: no."},
	} {
		got := saturationAim(rates[:len(tc.mine)], tc.mine, rates[:len(tc.epps)], tc.epps, tc.capacity)
		if !strings.Contains(got, tc.want) {
			t.Errorf("%s: %q, want %q in it", tc.name, got, tc.want)
		}
	}
	// Rendered under the ladder when both policies ran it.
	var run Run
	for i, rate := range rates {
		for p, p90 := range map[string]float64{"cache_aware": []float64{500, 1000, 3000}[i], "epp": []float64{1000, 3000, 5000}[i]} {
			run.Summaries = append(run.Summaries, Summary{Workload: LadderStep("spl", rate), Policy: p, Rate: rate, TTFT: Percentiles{P90: p90}})
		}
	}
	var b strings.Builder
	if err := run.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	if want := "The aim of cache_aware's saturation rate, at least 1.2× epp's: 6.00 / 3.00 req/s = 2.00×, met: yes."; !strings.Contains(b.String(), want) {
		t.Fatalf("report lacks %q:\n%s", want, b.String())
	}
	// With the last step's capacity bound: said, and it decides the aim.
	run.SetFloor(Floor{Workload: LadderStep("spl", 8), Requests: 10, Capacity: 3.5})
	b.Reset()
	if err := run.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"capacity on the ladder's last step (bench/floor, Capacity): 3.5 req/s", "met: unreachable (1.2× epp's rate, 3.60 req/s"} {
		if !strings.Contains(b.String(), want) {
			t.Fatalf("report lacks %q:\n%s", want, b.String())
		}
	}
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

// Merged runs take each part of the prediction error's median over the runs
// that have it: a run where nothing waited for an end does not count as a
// slot wait's error of 0, and its other requests are all its requests.
func TestMergeOfPredictionErrorParts(t *testing.T) {
	run := func(started string, pe PredictionError) Run {
		return Run{Title: "t", Started: started, Summaries: []Summary{{Workload: "w", Policy: "cache_aware", Requests: 10, Succeeded: 10, PredictionError: &pe}}}
	}
	m := Merge(
		run("a", PredictionError{Requests: 10, ErrorRange: ErrorRange{0.1, 0.3}}), // none waited (or a report from before the split)
		run("b", PredictionError{Requests: 10, ErrorRange: ErrorRange{0.2, 0.9}, SlotWaits: 4, SlotWait: ErrorRange{0.5, 1.5}, NoSlotWait: ErrorRange{0.1, 0.2}}),
		run("c", PredictionError{Requests: 10, ErrorRange: ErrorRange{0.3, 1.2}, SlotWaits: 6, SlotWait: ErrorRange{0.7, 2.5}, NoSlotWait: ErrorRange{0.2, 0.4}}))
	s, _ := m.find("w", "cache_aware")
	pe := s.PredictionError
	if pe == nil || pe.Requests != 30 || pe.SlotWaits != 10 || !near(pe.Median, 0.2) || !near(pe.P90, 0.9) ||
		!near(pe.SlotWait.Median, 0.6) || !near(pe.SlotWait.P90, 2) || !near(pe.NoSlotWait.Median, 0.1) || !near(pe.NoSlotWait.P90, 0.3) {
		t.Fatalf("merged prediction error %+v", pe)
	}
}

// The cache belief: the share of the prompt believed cached on the chosen
// pod (headers.PredictedCachedShare) against the share it served; merged
// runs take each figure's median.
func TestCacheBeliefFromTheHeader(t *testing.T) {
	if v := ParseShare(" 0.25 "); v == nil || *v != 0.25 {
		t.Fatal("ParseShare(0.25)")
	}
	for _, bad := range []string{"", "1.5", "-0.1", "NaN", "x"} {
		if ParseShare(bad) != nil {
			t.Fatalf("ParseShare(%q) is a share", bad)
		}
	}
	share := func(v float64) *float64 { return &v }
	rs := []Result{ // believed − served: +0.5, 0, −0.25, 0.05; one states none, one failed
		{Status: 200, PromptTokens: 100, CachedTokens: 25, PredictedCachedShare: share(0.75)},
		{Status: 200, PromptTokens: 100, CachedTokens: 100, PredictedCachedShare: share(1)},
		{Status: 200, PromptTokens: 100, CachedTokens: 25, PredictedCachedShare: share(0)},
		{Status: 200, PromptTokens: 100, CachedTokens: 0, PredictedCachedShare: share(0.05)},
		{Status: 200, PromptTokens: 100, CachedTokens: 0},
		{Status: 500, Err: "x", PromptTokens: 100, PredictedCachedShare: share(1)},
	}
	s := Summarize("w", "cache_aware", rs, nil)
	cb := s.CacheBelief
	if cb == nil || cb.Requests != 4 || !near(cb.Median, 0.15) || !near(cb.P90, 0.25+0.7*0.25) || !near(cb.Bias, 0.3/4) ||
		!near(cb.Less, 0.25) || !near(cb.More, 0.25) {
		t.Fatalf("cache belief %+v, want 4 requests, median 0.15, p90 0.425, bias 0.075, a quarter each held less and more", cb)
	}
	var b strings.Builder
	if err := (Run{Summaries: []Summary{s}}).WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "| 15 / 43 points (25% / 25%) |") {
		t.Fatalf("report lacks the cache belief cell:\n%s", b.String())
	}
	if Summarize("w", "x", rs[4:], nil).CacheBelief != nil {
		t.Fatal("a cache belief without any stated")
	}

	run := func(started string, cb *CacheBelief) Run {
		return Run{Title: "t", Started: started, Summaries: []Summary{{Workload: "w", Policy: "cache_aware", Requests: 10, Succeeded: 10, CacheBelief: cb}}}
	}
	m := Merge(run("a", &CacheBelief{Requests: 10, ErrorRange: ErrorRange{0, 0.1}, Bias: 0.01, Less: 0.1, More: 0}),
		run("b", nil),
		run("c", &CacheBelief{Requests: 10, ErrorRange: ErrorRange{0.1, 0.3}, Bias: 0.03, Less: 0.3, More: 0.2}))
	got, _ := m.find("w", "cache_aware")
	if cb := got.CacheBelief; cb == nil || cb.Requests != 20 || !near(cb.Median, 0.05) || !near(cb.P90, 0.2) || !near(cb.Bias, 0.02) ||
		!near(cb.Less, 0.2) || !near(cb.More, 0.1) {
		t.Fatalf("merged cache belief %+v", got.CacheBelief)
	}
}

// The error of the requests sent from the run's WarmUp on stands beside the
// whole run's: a fresh fleet is priced at the router's defaults at first.
// Merged runs take its median over the runs that have warm requests.
func TestPredictionErrorFromTheWarmUpOn(t *testing.T) {
	var rs []Result
	for i, pred := range []float64{300, 400, 110, 120} { // errors 2, 3 in the first seconds, then 0.1, 0.2
		rs = append(rs, Result{Session: fmt.Sprint(i), Status: 200, TTFT: 100 * time.Millisecond, Latency: time.Second,
			PredictedTTFTms: pred, Start: time.Duration(i) * WarmUp / 2})
	}
	s := Summarize("w", "cache_aware", rs, nil)
	if pe := s.PredictionError; pe == nil || pe.Warmed != 2 || !near(pe.Warm.Median, 0.15) || !near(pe.Warm.P90, 0.19) || !near(pe.Median, 1.1) {
		t.Fatalf("prediction error %+v, want 2 warm requests at 0.15 / 0.19 beside the run's median 1.1", s.PredictionError)
	}
	var b strings.Builder
	if err := (Run{Summaries: []Summary{s}}).WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "| 110% / 270% (from 5s on: 15% / 19%) |") {
		t.Fatalf("report lacks the warm error:\n%s", b.String())
	}
	cold := Summarize("w", "cache_aware", rs[:2], nil) // a run that ended before its warm-up
	if cold.PredictionError.Warmed != 0 {
		t.Fatalf("warm requests in the first seconds: %+v", cold.PredictionError)
	}
	r := func(started string, s Summary) Run { return Run{Title: "t", Started: started, Summaries: []Summary{s}} }
	m, _ := Merge(r("a", s), r("b", cold), r("c", s)).find("w", "cache_aware")
	if pe := m.PredictionError; pe.Warmed != 4 || !near(pe.Warm.Median, 0.15) {
		t.Fatalf("merged %+v, want the warm runs' median 0.15 over 4 requests", pe)
	}
}

// A merged report says, aim by aim, how often each latency aim was met in
// the runs whose floor left it within reach, and the median change there.
func TestLatencyAimsRunByRunWhereReachable(t *testing.T) {
	round := func(started string, ca, epp, floor float64) Run {
		r := Run{Title: "t", Started: started, Summaries: []Summary{
			{Workload: "multi-turn", Policy: "cache_aware", Requests: 10, Succeeded: 10, TTFT: Percentiles{P90: ca, P99: 10 * ca}},
			{Workload: "multi-turn", Policy: "epp", Requests: 10, Succeeded: 10, TTFT: Percentiles{P90: epp, P99: 10 * epp}},
		}}
		r.SetFloor(Floor{Workload: "multi-turn", Requests: 10, TTFT: Percentiles{P90: floor, P99: floor}})
		return r
	}
	// p90 targets 85, 170, 85, 85 against floors 90, 90, 50, 50: out of
	// reach in the first run; met in the third (−30%), missed in the
	// second (−10%) and the fourth (0%). p99: every run within reach.
	m := Merge(round("a", 100, 100, 90), round("b", 180, 200, 90), round("c", 70, 100, 50), round("d", 100, 100, 50))
	var b strings.Builder
	if err := m.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	want := "- TTFT p90 ≥15% below epp: unreachable in 1 of 4 runs; met in 1 of the 3 others, their median change -10%\n"
	if !strings.Contains(b.String(), want) {
		t.Fatalf("report lacks %q:\n%s", want, b.String())
	}
	if strings.Contains(b.String(), "- TTFT p99 ≥15% below epp:") {
		t.Fatalf("an aim within reach in every run is listed run by run:\n%s", b.String())
	}
	// The same changes as a chart: a dot per run, the median, the aim.
	var svg bytes.Buffer
	if err := m.PairedChart(&svg, "p90", func(s Summary) float64 { return s.TTFT.P90 }); err != nil {
		t.Fatal(err)
	}
	mustParseXML(t, svg.Bytes())
	for _, want := range []string{"<title>-30%</title>", "<title>-10%</title>", ">-5% (4 runs)</text>", "<title>the aim: -15%</title>", ">multi-turn</text>"} {
		if !strings.Contains(svg.String(), want) {
			t.Errorf("paired chart lacks %q:\n%s", want, svg.String())
		}
	}
	if n := strings.Count(svg.String(), "<circle"); n != 4 {
		t.Errorf("paired chart has %d dots, want one per run (4)", n)
	}
}
