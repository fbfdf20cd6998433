package report

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
)

// Run is one whole benchmark run: the setting and every summary.
type Run struct {
	Title    string            `json:"title"`
	Started  string            `json:"started"`
	Machine  map[string]string `json:"machine"`
	Settings map[string]string `json:"settings"`
	// Label names a run among the rounds of a merge (seed and repeat).
	Label     string    `json:"label,omitempty"`
	Summaries []Summary `json:"summaries"`
	// Floors are the workloads' floors (bench/floor), one per workload
	// where the engine has a cost model.
	Floors []Floor `json:"floors,omitempty"`
	// NoFloor says why a run has no floors (e.g. real llama.cpp compute).
	NoFloor string `json:"no_floor,omitempty"`
	// Repeats are the runs a merge took medians over (see repeats.go).
	Repeats []Run `json:"repeats,omitempty"`
}

// WriteJSON writes the run as indented JSON.
func (r Run) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// Workloads returns the workload names in first-seen order.
func (r Run) Workloads() []string {
	return uniq(r.Summaries, func(s Summary) string { return s.Workload })
}

// Policies returns the policy names in first-seen order.
func (r Run) Policies() []string {
	return uniq(r.Summaries, func(s Summary) string { return s.Policy })
}

func uniq(ss []Summary, key func(Summary) string) []string {
	var out []string
	for _, s := range ss {
		if k := key(s); !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out
}

// floor returns workload's floor, if the run has one.
func (r Run) floor(workload string) (Floor, bool) {
	for _, f := range r.Floors {
		if f.Workload == workload {
			return f, true
		}
	}
	return Floor{}, false
}

// SetFloor records (or replaces) workload's floor.
func (r *Run) SetFloor(f Floor) {
	for i := range r.Floors {
		if r.Floors[i].Workload == f.Workload {
			r.Floors[i] = f
			return
		}
	}
	r.Floors = append(r.Floors, f)
}

func (r Run) find(workload, policy string) (Summary, bool) {
	for _, s := range r.Summaries {
		if s.Workload == workload && s.Policy == policy {
			return s, true
		}
	}
	return Summary{}, false
}

// Gain compares policy `p` with the best of the others on TTFT p90 for one
// workload: positive = p is that much faster (0.25 = 25% lower p90).
func (r Run) Gain(workload, p string) (gain float64, rival string, ok bool) {
	me, found := r.find(workload, p)
	if !found || me.TTFT.P90 == 0 {
		return 0, "", false
	}
	best := math.Inf(1)
	for _, s := range r.Summaries {
		if s.Workload == workload && s.Policy != p && s.TTFT.P90 > 0 && s.TTFT.P90 < best {
			best, rival = s.TTFT.P90, s.Policy
		}
	}
	if rival == "" {
		return 0, "", false
	}
	return 1 - me.TTFT.P90/best, rival, true
}

// WriteMarkdown renders the run as the tables docs/benchmarks.md quotes.
func (r Run) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s\n\n", r.Title)
	fmt.Fprintf(&b, "Started %s.\n\n", r.Started)
	writeKV(&b, "Machine", r.Machine)
	writeKV(&b, "Settings", r.Settings)
	if len(r.Repeats) > 1 {
		b.WriteString("Cells of runs repeated are medians, with the range over the runs in parentheses.\n\n")
	}
	writeLadders(&b, r)
	for _, wl := range r.Workloads() {
		fmt.Fprintf(&b, "## %s\n\n", wl)
		b.WriteString("| policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms | req/s | success | cache hit | imbalance | TTFT pred. error p50 / p90 | cache belief error p50 / p90 (pod held less / more) |\n")
		b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		var ran []string // the policies this workload ran
		for _, p := range r.Policies() {
			s, ok := r.find(wl, p)
			if !ok {
				continue
			}
			ran = append(ran, p)
			// Merged cells: the median over the runs, their range beside it.
			p50, p90, p99 := fmt.Sprintf("%.1f", s.TTFT.P50), fmt.Sprintf("%.1f", s.TTFT.P90), fmt.Sprintf("%.1f", s.TTFT.P99)
			hit := fmt.Sprintf("%.1f%%", 100*s.CacheHitRate)
			if sp := s.Spread; sp != nil && s.Runs > 1 {
				rng := func(v [2]float64, scale float64) string { return fmt.Sprintf(" (%.1f–%.1f)", scale*v[0], scale*v[1]) }
				p50 += rng(sp.TTFTP50, 1)
				p90 += rng(sp.TTFTP90, 1)
				p99 += rng(sp.TTFTP99, 1)
				hit += rng(sp.CacheHit, 100)
			}
			pred := "–"
			if pe := s.PredictionError; pe != nil {
				pred = fmt.Sprintf("%.0f%% / %.0f%%", 100*pe.Median, 100*pe.P90)
				if pe.Warmed > 0 && pe.Warmed < pe.Requests {
					pred += fmt.Sprintf(" (from %v on: %.0f%% / %.0f%%)", WarmUp, 100*pe.Warm.Median, 100*pe.Warm.P90)
				}
				if pe.SlotWaits > 0 {
					pred += fmt.Sprintf(" (without slot waits %.0f%% / %.0f%%; %.0f%% wait: %.0f%% / %.0f%%)",
						100*pe.NoSlotWait.Median, 100*pe.NoSlotWait.P90, 100*float64(pe.SlotWaits)/float64(pe.Requests),
						100*pe.SlotWait.Median, 100*pe.SlotWait.P90)
				}
			}
			belief := "–"
			if cb := s.CacheBelief; cb != nil {
				belief = fmt.Sprintf("%.0f / %.0f points (%.0f%% / %.0f%%)", 100*cb.Median, 100*cb.P90, 100*cb.Less, 100*cb.More)
			}
			imb := fmt.Sprintf("%.2f", s.Imbalance)
			if s.UpstreamUnknown {
				imb = "unknown"
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %.1f | %.1f | %.2f | %.1f%% | %s | %s | %s | %s |\n",
				p, p50, p90, p99, s.Latency.P50, s.Latency.P99,
				s.Throughput, 100*s.SuccessRate, hit, imb, pred, belief)
		}
		if f, ok := r.floor(wl); ok {
			fmt.Fprintf(&b, "| *floor: no router can beat this* | %.1f | %.1f | %.1f | | | | | | | | |\n", f.TTFT.P50, f.TTFT.P90, f.TTFT.P99)
			fmt.Fprintf(&b, "\nThe floor (bench/floor, docs/benchmarks.md \"Method\"): each of the %d requests alone on an idle pod that holds the longest prefix it shares with any earlier request, its TTFT the engine's own cost of prefilling the rest; every policy's percentiles are at least the floor's.\n", f.Requests)
		} else if r.NoFloor != "" {
			fmt.Fprintf(&b, "\nNo floor: %s.\n", r.NoFloor)
		}
		var ext, unknown []string
		for _, p := range ran {
			s, _ := r.find(wl, p)
			if s.External {
				ext = append(ext, p)
			}
			if s.UpstreamUnknown {
				unknown = append(unknown, p)
			}
		}
		if len(ext) > 0 {
			fmt.Fprintf(&b, "\nExternal routers, run in place of our gateway against the same pods: %s.\n", strings.Join(ext, ", "))
		}
		if len(unknown) > 0 {
			fmt.Fprintf(&b, "Imbalance unknown for %s: no answer named its pod (only our gateway adds the upstream-host header).\n", strings.Join(unknown, ", "))
		}
		if g, rival, ok := r.Gain(wl, "cache_aware"); ok {
			fmt.Fprintf(&b, "\ncache_aware TTFT p90 vs the best other policy (%s): %+.1f%%\n", rival, -100*g)
		}
		if aims := r.Aims(wl, "cache_aware"); aims != nil {
			writeAims(&b, wl, "cache_aware", aims)
		}
		if rounds := r.rounds(wl); len(rounds) > 1 {
			writeRounds(&b, wl, ran, rounds)
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func writeKV(b *strings.Builder, title string, m map[string]string) {
	if len(m) == 0 {
		return
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	fmt.Fprintf(b, "**%s**: ", title)
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(b, "%s=%s", k, m[k])
	}
	b.WriteString("\n\n")
}

// Merge joins runs made separately (one per workload, say, when each needs
// its own arrival rate) into one for a single report. A setting that differs
// between runs is kept per workload: "rate": "shared-prefix 1, multi-turn 0.5".
// Runs of the same workload and policy are repeats: the merged summary is
// the median over them, and the runs are kept in Repeats.
func Merge(runs ...Run) Run {
	// A run that is itself merged (repeats of one invocation, or an
	// earlier --merge) joins as its repeats, so its runs stay listed.
	var flat []Run
	for _, r := range runs {
		if len(r.Repeats) > 0 {
			flat = append(flat, r.Repeats...)
		} else {
			flat = append(flat, r)
		}
	}
	runs = flat
	if len(runs) == 0 {
		return Run{}
	}
	out := Run{Title: runs[0].Title, Started: runs[0].Started, Machine: runs[0].Machine, Settings: map[string]string{}}
	keys := map[string]bool{}
	for _, r := range runs {
		if r.Title != "" && r.Title != runs[0].Title {
			// The titles name the fleet; runs on other fleets keep theirs in Settings.
			out.Title = "Routing policies (merged runs: the fleet of each workload is under Settings)"
		}
		for _, s := range r.Summaries {
			if _, seen := out.find(s.Workload, s.Policy); seen {
				out.Repeats = runs
				continue
			}
			var same []Summary
			for _, rr := range runs {
				if m, ok := rr.find(s.Workload, s.Policy); ok {
					same = append(same, m)
				}
			}
			out.Summaries = append(out.Summaries, medianOf(same))
		}
		for k := range r.Settings {
			keys[k] = true
		}
		if out.NoFloor == "" {
			out.NoFloor = r.NoFloor
		}
	}
	var floorOrder []string
	floors := map[string][]Floor{}
	for _, r := range runs {
		for _, f := range r.Floors {
			if floors[f.Workload] == nil {
				floorOrder = append(floorOrder, f.Workload)
			}
			floors[f.Workload] = append(floors[f.Workload], f)
		}
	}
	for _, wl := range floorOrder {
		out.Floors = append(out.Floors, medianFloor(floors[wl]))
	}
	for k := range keys {
		var vals, groups []string // groups: the runs' workloads, in first-seen order
		per := map[string][]string{}
		for _, r := range runs {
			v, ok := r.Settings[k]
			if !ok {
				v = "-"
			}
			vals = append(vals, v)
			g := strings.Join(r.Workloads(), "+")
			if per[g] == nil {
				groups = append(groups, g)
			}
			if !slices.Contains(per[g], v) {
				per[g] = append(per[g], v) // repeats name theirs once
			}
		}
		if len(slices.Compact(slices.Clone(vals))) == 1 {
			out.Settings[k] = vals[0]
			continue
		}
		for i, g := range groups {
			groups[i] = g + " " + strings.Join(per[g], "/")
		}
		out.Settings[k] = strings.Join(groups, ", ")
	}
	return out
}
