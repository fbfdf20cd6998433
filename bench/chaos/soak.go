package chaos

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Target is one process the soak samples.
type Target struct {
	Name    string // worker-0, gateway, metadata-center, redis-0, …
	PID     int
	Metrics string // its /metrics URL; empty when it has none (redis)
}

// Sample is one reading of one series at one time.
type Sample struct {
	T      float64 `json:"t_s"`
	Series string  `json:"series"` // "<process> <metric>", or "leases"
	Value  float64 `json:"value"`
}

// Metrics sampled per process. Goroutines come from the process's own
// /metrics (go_goroutines); RSS, open descriptors and threads from /proc,
// which is what Prometheus's process collector reads too, so that Redis
// (no /metrics) is sampled the same way.
const (
	MetricGoroutines = "goroutines"
	MetricRSS        = "rss_mb"
	MetricFDs        = "open_fds"
	MetricThreads    = "threads"
	SeriesLeases     = "leases"
)

// SampleProcs reads every target once.
func SampleProcs(ctx context.Context, hc *http.Client, ts []Target, t float64) []Sample {
	var out []Sample
	for _, p := range ts {
		if rss, threads, err := procStatus(p.PID); err == nil {
			out = append(out, Sample{t, p.Name + " " + MetricRSS, rss / (1 << 20)}, Sample{t, p.Name + " " + MetricThreads, threads})
		}
		if fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.PID)); err == nil {
			out = append(out, Sample{t, p.Name + " " + MetricFDs, float64(len(fds))})
		}
		if p.Metrics != "" {
			if g, err := scrapeGauge(ctx, hc, p.Metrics, "go_goroutines"); err == nil {
				out = append(out, Sample{t, p.Name + " " + MetricGoroutines, g})
			}
		}
	}
	return out
}

func procStatus(pid int) (rssBytes, threads float64, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "VmRSS:":
			kb, _ := strconv.ParseFloat(f[1], 64)
			rssBytes = kb * 1024
		case "Threads:":
			threads, _ = strconv.ParseFloat(f[1], 64)
		}
	}
	return rssBytes, threads, nil
}

func scrapeGauge(ctx context.Context, hc *http.Client, url, name string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return gaugeFrom(resp.Body, name)
}

// gaugeFrom finds an unlabelled sample of name in the text exposition.
func gaugeFrom(r io.Reader, name string) (float64, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			return strconv.ParseFloat(strings.TrimSpace(v), 64)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("no %s", name)
}

// Growth is the verdict on one series.
type Growth struct {
	Series string  `json:"series"`
	First  float64 `json:"first"`
	Last   float64 `json:"last"`
	Mean   float64 `json:"mean_second_half"`
	Slope  float64 `json:"slope_per_hour"` // least squares over the second half
	// Rise is what the fitted line climbs over the second half; Limit how
	// much it may.
	Rise  float64 `json:"rise_second_half"`
	Limit float64 `json:"limit"`
	Grows bool    `json:"grows_without_bound"`
}

// GrowthLimit is how much a series may rise over the soak's second half
// (after warm-up) before it counts as growing without bound: a quarter of
// its mean or an absolute floor per metric, whichever is larger. The
// floors keep noise (a burst of goroutines, the Go heap breathing, the
// requests in flight) from failing a soak; a leak of one goroutine,
// descriptor or lease per request passes them within a minute of load.
func GrowthLimit(series string, mean float64) float64 {
	floor := 0.0
	switch {
	case strings.HasSuffix(series, " "+MetricGoroutines):
		floor = 20
	case strings.HasSuffix(series, " "+MetricRSS):
		floor = 16 // MiB
	case strings.HasSuffix(series, " "+MetricFDs):
		floor = 10
	case strings.HasSuffix(series, " "+MetricThreads):
		floor = 4
	case series == SeriesLeases:
		return 10 // leases follow the load, not the process's size
	}
	return math.Max(floor, mean/4)
}

// Fit groups samples by series and judges each one's growth: the least
// squares line over the second half of the run must not rise more than
// GrowthLimit.
func Fit(samples []Sample) []Growth {
	by := map[string][]Sample{}
	for _, s := range samples {
		by[s.Series] = append(by[s.Series], s)
	}
	var out []Growth
	for name, ss := range by {
		sort.Slice(ss, func(i, j int) bool { return ss[i].T < ss[j].T })
		g := Growth{Series: name, First: ss[0].Value, Last: ss[len(ss)-1].Value}
		half := ss[len(ss)/2:]
		var sx, sy, sxx, sxy float64
		for _, s := range half {
			sx += s.T
			sy += s.Value
			sxx += s.T * s.T
			sxy += s.T * s.Value
		}
		n := float64(len(half))
		g.Mean = sy / n
		if d := n*sxx - sx*sx; len(half) >= 3 && d > 0 {
			slope := (n*sxy - sx*sy) / d // per second
			g.Slope = slope * 3600
			g.Rise = slope * (half[len(half)-1].T - half[0].T)
		}
		g.Limit = GrowthLimit(name, g.Mean)
		g.Grows = g.Rise > g.Limit
		out = append(out, g)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Series < out[j].Series })
	return out
}
