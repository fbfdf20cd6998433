package chaos

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
)

// SoakResult is what a soak measured.
type SoakResult struct {
	Started    string            `json:"started"`
	Machine    map[string]string `json:"machine"`
	Settings   map[string]string `json:"settings"`
	Duration   time.Duration     `json:"duration_ns"`
	Requests   int               `json:"requests"`
	Outcomes   map[string]int    `json:"outcomes"`
	LoadAvgEnd string            `json:"loadavg_at_end"`
	Growth     []Growth          `json:"growth"`
}

// Grows lists the series that grow without bound.
func (r *SoakResult) Grows() []string {
	var out []string
	for _, g := range r.Growth {
		if g.Grows {
			out = append(out, g.Series)
		}
	}
	return out
}

// RunSoak runs the chaos topology under the steady load for
// cfg.SoakDuration with no faults, sampling every process and the live
// leases every cfg.SampleEvery, and fits each series' growth.
func RunSoak(ctx context.Context, cfg Config) (*SoakResult, error) {
	cfg.defaults()
	fmt.Fprintf(cfg.Progress, "starting the fleet in %s\n", cfg.Out)
	f, err := fleet.Start(ctx, cfg.spec())
	if err != nil {
		return nil, err
	}
	defer f.Stop()
	hc := client.NewHTTPClient()
	mach := machine() // its load average is the one at the start
	start := time.Now()
	cl := &Client{Gateways: f.Gateways, Model: "tiny", MaxRetries: 2, Timeout: ClientTimeout, HTTP: hc}
	load := NewLoad(cl, cfg.Users, cfg.MaxTokens, cfg.Seed, start)
	load.StreamShare = cfg.StreamShare
	chk := Checker{MC: f.MC, Cluster: fleet.Cluster, Workers: f.Workers, HTTP: hc}
	var targets []Target
	for _, p := range f.Procs() {
		t := Target{Name: p.Name, PID: p.PID}
		switch {
		case p.Name == "metadata-center":
			t.Metrics = f.MC + "/metrics"
		case p.Name == "gateway":
			t.Metrics = f.Gateways[0] + "/metrics"
		case strings.HasPrefix(p.Name, "gateway-"):
			var i int
			fmt.Sscanf(p.Name, "gateway-%d", &i)
			t.Metrics = f.Gateways[i] + "/metrics"
		case strings.HasPrefix(p.Name, "worker-"):
			var i int
			fmt.Sscanf(p.Name, "worker-%d", &i)
			t.Metrics = "http://" + f.Workers[i] + "/metrics"
		}
		targets = append(targets, t)
	}
	runCtx, stop := context.WithTimeout(ctx, cfg.SoakDuration)
	defer stop()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = load.Run(runCtx) }()
	var samples []Sample
	tick := time.NewTicker(cfg.SampleEvery)
	defer tick.Stop()
	for runCtx.Err() == nil {
		t := time.Since(start).Seconds()
		samples = append(samples, SampleProcs(runCtx, hc, targets, t)...)
		if n, err := chk.Leases(runCtx); err == nil {
			samples = append(samples, Sample{t, SeriesLeases, float64(n)})
		}
		rs := load.Records()
		ok := 0
		for _, r := range rs {
			if r.Outcome == OK {
				ok++
			}
		}
		fmt.Fprintf(cfg.Progress, "%7.0fs / %.0fs: %d requests, %d ok, in flight %d, %d samples\n", t, cfg.SoakDuration.Seconds(), len(rs), ok, load.InFlight(), len(samples))
		if err := writeJSON(filepath.Join(cfg.Out, "soak_samples.json"), samples); err != nil {
			return nil, err
		}
		select {
		case <-tick.C:
		case <-runCtx.Done():
		}
	}
	wg.Wait()
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	recs := load.Records()
	res := &SoakResult{Started: start.UTC().Format(time.RFC3339), Machine: mach, Settings: cfg.settings(),
		Duration: time.Since(start), Requests: len(recs), Outcomes: map[string]int{}, Growth: Fit(samples)}
	res.Settings["soak_duration"] = cfg.SoakDuration.String()
	res.Settings["sample_every"] = cfg.SampleEvery.String()
	for _, r := range recs {
		res.Outcomes[string(r.Outcome)]++
	}
	la, _ := os.ReadFile("/proc/loadavg")
	res.LoadAvgEnd = strings.TrimSpace(string(la))
	if err := writeJSON(filepath.Join(cfg.Out, "soak_results.json"), recs); err != nil {
		return nil, err
	}
	return res, writeSoak(cfg.Out, res, samples)
}

func writeSoak(out string, res *SoakResult, samples []Sample) error {
	if err := writeJSON(filepath.Join(out, "soak_summary.json"), res); err != nil {
		return err
	}
	plots := []struct{ file, title, unit, metric string }{
		{"soak_goroutines.svg", "Goroutines per process over the soak", "goroutines", MetricGoroutines},
		{"soak_rss.svg", "Resident memory per process over the soak", "RSS (MiB)", MetricRSS},
		{"soak_fds.svg", "Open file descriptors per process over the soak", "open fds", MetricFDs},
		{"soak_leases.svg", "Live request leases in the metadata center", "leases", SeriesLeases},
	}
	for _, p := range plots {
		if err := writeWith(filepath.Join(out, p.file), func(w io.Writer) error {
			return PlotSoak(w, p.title, p.unit, samples, p.metric)
		}); err != nil {
			return err
		}
	}
	return writeWith(filepath.Join(out, "soak_report.md"), func(w io.Writer) error { return res.WriteMarkdown(w) })
}

// WriteMarkdown renders the growth table.
func (r *SoakResult) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# Soak %s, %s\n\n", r.Started, r.Duration.Round(time.Second))
	fmt.Fprintf(&b, "%d requests: %s. Load average at start %s, at end %s (%s CPUs).\n\n",
		r.Requests, joinCounts(r.Outcomes), r.Machine["loadavg_at_start"], r.LoadAvgEnd, r.Machine["cpus"])
	b.WriteString("| series | first | last | mean (2nd half) | fitted rise over the 2nd half | allowed | slope /h | grows? |\n|---|---|---|---|---|---|---|---|\n")
	for _, g := range r.Growth {
		fmt.Fprintf(&b, "| %s | %.1f | %.1f | %.1f | %+.1f | %.1f | %+.1f | %s |\n", g.Series, g.First, g.Last, g.Mean, g.Rise, g.Limit, g.Slope,
			map[bool]string{true: "**yes**", false: "no"}[g.Grows])
	}
	_, err := io.WriteString(w, b.String())
	return err
}
