package chaos

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Render rewrites a chaos run's report and plots in dir from its
// summary.json and results.json (after a change to the report).
func Render(dir string) (*Result, error) {
	var res Result
	var recs []Record
	for name, v := range map[string]any{"summary.json": &res, "results.json": &recs} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		if err := json.Unmarshal(b, v); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	return &res, writeChaos(dir, &res, recs)
}

func writeChaos(out string, res *Result, recs []Record) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	if err := writeJSON(filepath.Join(out, "summary.json"), res); err != nil {
		return err
	}
	if err := writeJSON(filepath.Join(out, "results.json"), recs); err != nil {
		return err
	}
	if err := writeWith(filepath.Join(out, "report.md"), func(w io.Writer) error { return res.WriteMarkdown(w) }); err != nil {
		return err
	}
	if err := writeWith(filepath.Join(out, "chaos_ttft.svg"), func(w io.Writer) error {
		return PlotTTFT(w, "TTFT under the fault schedule (each dot a request, at its start)", recs, res.Windows, res.Duration)
	}); err != nil {
		return err
	}
	return writeWith(filepath.Join(out, "chaos_errors.svg"), func(w io.Writer) error {
		return PlotErrors(w, "Failed, lost and retried requests per second", recs, res.Windows, res.Duration)
	})
}

func joinCounts(m map[string]int) string {
	if len(m) == 0 {
		return "0"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%d×%s", m[k], k)
	}
	return strings.Join(parts, ", ")
}

// WriteMarkdown renders the per-fault table and the aims.
func (r *Result) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# Chaos run %s\n\n", r.Started)
	keys := make([]string, 0, len(r.Settings))
	for k := range r.Settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%s ", k, r.Settings[k])
	}
	fmt.Fprintf(&b, "\n\nmachine: %s CPUs, %s, load average at start %s\n\n", r.Machine["cpus"], r.Machine["go"], r.Machine["loadavg_at_start"])
	fmt.Fprintf(&b, "Baseline (before the first fault): %d requests, success %.1f%%, TTFT p50 %.0f ms, p90 %.0f ms. "+
		"Index before the first fault: %d entries, precision %s (held only %s); leases %d with %d requests in flight.\n\n",
		r.Baseline.Requests, 100*r.Baseline.SuccessRate, r.Baseline.TTFTP50, r.Baseline.TTFTP90,
		r.Initial.IndexEntries, pct(r.Initial.Precision), pct(r.Initial.StrictPrecision), r.Initial.Leases, r.Initial.InFlight)
	b.WriteString("| # | fault | sent | succeeded | failed (by status) | lost | expected / unexpected failures | retried by client | aborted by client | leases beyond in-flight @+1 s | index @+1 s: entries, precision (held only), in transit + retracting | wrong entries (new since the last check) | recovery |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	prevWrong := r.Initial.Wrong()
	for i, f := range r.Faults {
		rec := "not within the window"
		if f.RecoveryS >= 0 {
			rec = fmt.Sprintf("%.0f s", f.RecoveryS)
		}
		retried := fmt.Sprint(f.Retried)
		if f.Retried > 0 {
			retried += " (" + joinCounts(f.Retries) + ")"
		}
		name := f.Name
		if f.Err != "" {
			name += " ⚠ " + f.Err
		}
		fmt.Fprintf(&b, "| %d | %s | %d | %d | %s | %d | %d / %d | %s | %d | %d | %d, %s (%s), %d + %d | %d (%+d) | %s |\n",
			i+1, name, f.Sent, f.Succeeded, joinCounts(f.Failed), f.Lost, f.Expected, f.Unexpected, retried,
			f.Aborted, f.Check.Orphaned(), f.Check.IndexEntries, pct(f.Check.Precision), pct(f.Check.StrictPrecision),
			f.Check.IndexInTransit, f.Check.IndexRetracting, f.Check.Wrong(), f.Check.Wrong()-prevWrong, rec)
		prevWrong = f.Check.Wrong()
	}
	fmt.Fprintf(&b, "\nAfter the load stopped (in-flight requests answered) and one lease TTL passed: %d live leases; index %d entries, precision %s (wrong entries by host: %v).\n\n",
		r.Final.Leases, r.Final.IndexEntries, pct(r.Final.Precision), r.Final.FalseByHost)
	maxLat := r.Initial.ReportLatencyMax
	for _, f := range r.Faults {
		maxLat = max(maxLat, f.Check.ReportLatencyMax)
	}
	fmt.Fprintf(&b, "Longest eviction-to-acknowledged report the workers listed at the checks: %.0f ms (bound %s; retraction bound %s).\n\n",
		max(maxLat, r.Final.ReportLatencyMax), EvictionBound, RetractionBound)
	b.WriteString("| aim | met | measured |\n|---|---|---|\n")
	for _, a := range r.Aims {
		fmt.Fprintf(&b, "| %s | %s | %s |\n", a.Name, map[bool]string{true: "yes", false: "**no**"}[a.Met], a.Got)
	}
	b.WriteString("\nFaults:\n")
	for i, f := range r.Faults {
		fmt.Fprintf(&b, "%d. %s: %s\n", i+1, f.Name, f.What)
		for _, rs := range f.Restarts {
			fmt.Fprintf(&b, "   - %s worker %s: pid %d → %d, %d requests in flight at the SIGTERM (%d streaming), drained and exited in %.1f s, the new one ready %.1f s later",
				rs.Engine, rs.Worker, rs.OldPID, rs.NewPID, len(rs.InFlight), rs.Streaming, rs.DrainS, rs.ReadyS)
			if rs.Err != "" {
				fmt.Fprintf(&b, " ⚠ %s", rs.Err)
			}
			b.WriteString("\n")
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// AimsMet reports whether every aim was met.
func (r *Result) AimsMet() bool {
	for _, a := range r.Aims {
		if !a.Met {
			return false
		}
	}
	return true
}
