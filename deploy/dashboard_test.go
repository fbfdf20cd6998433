package deploy_test

// The Grafana dashboard (deploy/grafana/llm-router.json) may only use
// metrics the code exports. This test builds and starts the real metadata
// center, a worker on the generated model and the standalone gateway,
// sends traffic through the gateway, scrapes the three /metrics endpoints
// and checks every metric name of every panel expression against them.
// The gateway panels read ${prefix}llm_filter_*: "" is the standalone
// gateway, "envoy_" Istio's Envoy, where only the families both hosts
// export exist (envoyhost/observability_test.go shows them in the real .so).
//
// With LLMF_DASHBOARD_SVG=path it also draws the dashboard from the
// scraped data into an SVG (docs/images/dashboard.svg).

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

type dashboard struct {
	Panels []struct {
		Title   string `json:"title"`
		Targets []struct {
			Expr         string `json:"expr"`
			LegendFormat string `json:"legendFormat"`
		} `json:"targets"`
	} `json:"panels"`
	Templating struct {
		List []struct {
			Name    string `json:"name"`
			Options []struct {
				Value string `json:"value"`
			} `json:"options"`
		} `json:"list"`
	} `json:"templating"`
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	raw, err := os.ReadFile("grafana/llm-router.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	if len(d.Panels) == 0 {
		t.Fatal("no panels")
	}
	return d
}

var (
	reString  = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)
	reMatcher = regexp.MustCompile(`\{[^}]*\}`)
	reRange   = regexp.MustCompile(`\[[^\]]*\]`)
	reGroup   = regexp.MustCompile(`\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	reIdent   = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*(\s*\()?`)
	keywords  = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true}
)

// metricNames returns the metric names a PromQL expression reads.
func metricNames(expr string) []string {
	s := reString.ReplaceAllString(expr, `""`)
	s = reMatcher.ReplaceAllString(s, "")
	s = reRange.ReplaceAllString(s, "")
	s = reGroup.ReplaceAllString(s, "")
	var out []string
	for _, m := range reIdent.FindAllStringSubmatch(s, -1) {
		if m[1] != "" || keywords[m[0]] {
			continue // a function call or an operator
		}
		out = append(out, m[0])
	}
	return out
}

func TestMetricNamesOfExpressions(t *testing.T) {
	got := metricNames(`sum by (le) (rate(envoy_x_bucket{a="b(c)",d=~"e|f"}[5m])) / sum(rate(y_total[$__rate_interval])) and on (i) z`)
	want := []string{"envoy_x_bucket", "y_total", "z"}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("metricNames = %v, want %v", got, want)
	}
}

// sample is one scraped series.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

var reLabel = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

func parseExposition(text string) []sample {
	var out []sample
	for _, line := range strings.Split(text, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, rest := line, ""
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		s := sample{name: name, labels: map[string]string{}}
		if strings.HasPrefix(rest, "{") {
			end := strings.LastIndex(rest, "}")
			for _, m := range reLabel.FindAllStringSubmatch(rest[:end], -1) {
				s.labels[m[1]] = m[2]
			}
			rest = rest[end+1:]
		}
		f := strings.Fields(rest)
		if len(f) > 0 {
			s.value, _ = strconv.ParseFloat(f[0], 64)
		}
		out = append(out, s)
	}
	return out
}

func TestDashboardUsesOnlyExportedMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the metadata center, a worker and the gateway")
	}
	d := loadDashboard(t)
	bin := t.TempDir()
	goBuild(t, bin, "./metadata-center/cmd/metadata-center", "./worker/cmd/worker", "./worker/cmd/mkmodel", "./filter/cmd/gateway")
	model := filepath.Join(t.TempDir(), "tiny.gguf")
	if out, err := exec.Command(filepath.Join(bin, "mkmodel"), "--out", model).CombinedOutput(); err != nil {
		t.Fatalf("mkmodel: %v\n%s", err, out)
	}
	mc := startProc(t, filepath.Join(bin, "metadata-center"), []string{"--listen", "127.0.0.1:0", "--store", "memory"}, nil)
	mcAddr := mc.await(t, "metadata center listening", 30*time.Second)
	w := startProc(t, filepath.Join(bin, "worker"), []string{"--model", model, "--listen", "127.0.0.1:0",
		"--metadata-center", "http://" + mcAddr, "--cluster", "pool", "--model-name", "tiny"}, nil)
	wAddr := w.await(t, "worker ready", 3*time.Minute)
	cfg := filepath.Join(t.TempDir(), "gateway.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`listen: 127.0.0.1:0
filter:
  metadata_center: {address: "http://%s", query_timeout: 500ms}
  model_mapping_rule:
    tiny:
      - {cluster: pool, backend: llamacpp, scene_name: chat}
  lb_mapping_rule:
    default: {policy: cache_aware}
  endpoints:
    static: {pool: [%s]}
`, mcAddr, wAddr)), 0o600); err != nil {
		t.Fatal(err)
	}
	gw := startProc(t, filepath.Join(bin, "gateway"), []string{"--config", cfg}, nil)
	gwAddr := gw.await(t, "gateway listening", 30*time.Second)

	// Traffic: a shared prefix (cache hits), streamed and not, a model list,
	// a refused request.
	prompt := strings.Repeat("You are a terse assistant for the dashboard test. ", 12)
	for i := 0; i < 8; i++ {
		body := fmt.Sprintf(`{"model":"tiny","stream":%v,"max_tokens":4,"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}]}`, i%2 == 0, prompt, i)
		resp, err := http.Post("http://"+gwAddr+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d\n%s", i, resp.StatusCode, gw.output())
		}
	}
	if code, _ := httpGet(t, "http://"+gwAddr+"/v1/models"); code != 200 {
		t.Fatalf("GET /v1/models: %d", code)
	}
	if resp, err := http.Post("http://"+gwAddr+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"nope","messages":[]}`)); err == nil {
		resp.Body.Close()
	}

	var samples []sample
	names := map[string]bool{}
	// The last requests are counted when their handlers return; on a
	// timeout the checks below say what is missing.
	wait.Until(10*time.Second, func() bool {
		samples = samples[:0]
		for _, addr := range []string{gwAddr, wAddr, mcAddr} {
			code, text := httpGet(t, "http://"+addr+"/metrics")
			if code != 200 {
				t.Fatalf("%s/metrics: %d", addr, code)
			}
			samples = append(samples, parseExposition(text)...)
		}
		for _, s := range samples {
			names[s.name] = true
		}
		return sum(samples, "llm_filter_requests_total", nil) >= 10
	})

	// Read through ${prefix}: the families both hosts export under one
	// name. The histograms differ in unit (Envoy records integers), so
	// panels read them by both names; envoyOnly are Envoy's.
	shared := map[string]bool{gatewaymetrics.Requests: true, gatewaymetrics.InFlightMetric: true}
	for _, e := range gatewaymetrics.Events {
		shared[gatewaymetrics.EventMetric(e)] = true
	}
	envoyOnly := map[string]bool{}
	for _, h := range gatewaymetrics.Histograms {
		stat, _ := llmfilter.EnvoyHistogram(h)
		for _, suffix := range []string{"_bucket", "_count", "_sum"} {
			envoyOnly["envoy_"+stat+suffix] = true
		}
	}
	// Istio's and istiod's own metrics, read by the panels of alerts on the
	// mesh: nothing of ours exports them.
	external := map[string]bool{"istio_requests_total": true, "pilot_total_xds_rejects": true}
	prefixes := map[string]bool{}
	for _, v := range d.Templating.List {
		if v.Name == "prefix" {
			for _, o := range v.Options {
				prefixes[o.Value] = true
			}
		}
	}
	if !prefixes[""] || !prefixes["envoy_"] || len(prefixes) != 2 {
		t.Fatalf("variable prefix offers %v, want exactly \"\" and \"envoy_\"", prefixes)
	}
	checked := 0
	for _, p := range d.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			ns := metricNames(strings.ReplaceAll(tg.Expr, "${prefix}", ""))
			if len(ns) == 0 {
				t.Errorf("panel %q: no metric in %q", p.Title, tg.Expr)
			}
			for _, n := range ns {
				checked++
				if envoyOnly[n] || external[n] {
					continue
				}
				if !names[n] {
					t.Errorf("panel %q: %s is not exported (expression %q)", p.Title, n, tg.Expr)
				}
				if strings.Contains(tg.Expr, "${prefix}"+n) && !shared[n] {
					t.Errorf("panel %q: %s is read with ${prefix} but Envoy does not export it", p.Title, n)
				}
			}
		}
	}
	t.Logf("%d metric references in %d panels, all exported", checked, len(d.Panels))
	// The scrape saw the traffic under the rule's labels.
	if n := sum(samples, gatewaymetrics.Requests, map[string]string{"model_name": "tiny", "cluster": "pool", "scene": "chat", "outcome": "success"}); n != 8 {
		t.Errorf("llm_filter_requests_total{model_name=tiny,cluster=pool,scene=chat,outcome=success} = %v, want 8", n)
	}
	if path := os.Getenv("LLMF_DASHBOARD_SVG"); path != "" {
		if err := os.WriteFile(path, []byte(renderSVG(d, samples)), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", path)
	}
}

// sum adds the values of name's samples whose labels include match.
func sum(samples []sample, name string, match map[string]string) float64 {
	var total float64
	for _, s := range samples {
		if s.name != name {
			continue
		}
		ok := true
		for k, v := range match {
			if s.labels[k] != v {
				ok = false
			}
		}
		if ok {
			total += s.value
		}
	}
	return total
}

// selector reads the equality and regex matchers of an expression's first
// {...} (enough for the dashboard's own queries).
func selector(expr string) func(map[string]string) bool {
	m := reMatcher.FindString(expr)
	type cond struct {
		k   string
		re  *regexp.Regexp
		neg bool
	}
	var cs []cond
	for _, part := range regexp.MustCompile(`([a-z_]+)\s*(=~|!~|=|!=)\s*"([^"]*)"`).FindAllStringSubmatch(m, -1) {
		pat := "^(?:" + regexp.QuoteMeta(part[3]) + ")$"
		if strings.HasSuffix(part[2], "~") {
			pat = "^(?:" + part[3] + ")$"
		}
		cs = append(cs, cond{k: part[1], re: regexp.MustCompile(pat), neg: strings.HasPrefix(part[2], "!")})
	}
	return func(l map[string]string) bool {
		for _, c := range cs {
			if c.re.MatchString(l[c.k]) == c.neg {
				return false
			}
		}
		return true
	}
}

// renderSVG draws each panel from the scraped totals: histograms as their
// bucket counts with p50/p95, grouped counters as bars, ratios as a number.
func renderSVG(d dashboard, samples []sample) string {
	const cols, pw, ph, pad = 3, 420, 230, 12
	rows := (len(d.Panels) + cols - 1) / cols
	W, H := cols*(pw+pad)+pad, rows*(ph+pad)+pad+40
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", W, H)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="#111217"/>`+"\n", W, H)
	fmt.Fprintf(&b, `<text x="%d" y="26" fill="#ccccdc" font-size="16">LLM router — deploy/grafana/llm-router.json, drawn from a real scrape (totals after the test's traffic)</text>`+"\n", pad)
	for i, p := range d.Panels {
		x, y := pad+(i%cols)*(pw+pad), 40+pad+(i/cols)*(ph+pad)
		fmt.Fprintf(&b, `<g transform="translate(%d,%d)"><rect width="%d" height="%d" rx="3" fill="#181b1f" stroke="#2c3235"/>`, x, y, pw, ph)
		fmt.Fprintf(&b, `<text x="10" y="20" fill="#ccccdc" font-size="13">%s</text>`, esc(p.Title))
		expr := strings.ReplaceAll(p.Targets[0].Expr, "${prefix}", "")
		names := metricNames(expr)
		switch {
		case strings.Contains(expr, "_bucket"):
			drawHistogram(&b, samples, names[0], selector(expr), pw, ph)
		case strings.Contains(expr, " / "):
			num := filtered(samples, names[0], selector(expr))
			den := filtered(samples, names[len(names)-1], func(map[string]string) bool { return true })
			v := 0.0
			if den > 0 {
				v = num / den
			}
			fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#73bf69" font-size="44" text-anchor="middle">%.1f%%</text>`, pw/2, ph/2+20, 100*v)
			fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#8e8e8e" text-anchor="middle">%.0f of %.0f</text>`, pw/2, ph/2+45, num, den)
		default:
			drawBars(&b, samples, names[0], selector(expr), groupLabels(expr), pw, ph)
		}
		fmt.Fprintf(&b, `<text x="10" y="%d" fill="#6e6e6e" font-size="9">%s</text></g>`+"\n", ph-8, esc(trim(p.Targets[0].Expr, 80)))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

func filtered(samples []sample, name string, keep func(map[string]string) bool) float64 {
	var t float64
	for _, s := range samples {
		if s.name == name && keep(s.labels) {
			t += s.value
		}
	}
	return t
}

func groupLabels(expr string) []string {
	m := regexp.MustCompile(`by \(([^)]*)\)`).FindStringSubmatch(expr)
	if m == nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(m[1], ",") {
		out = append(out, strings.TrimSpace(l))
	}
	return out
}

func drawBars(b *strings.Builder, samples []sample, name string, keep func(map[string]string) bool, by []string, pw, ph int) {
	groups := map[string]float64{}
	for _, s := range samples {
		if s.name != name || !keep(s.labels) {
			continue
		}
		var parts []string
		for _, l := range by {
			parts = append(parts, s.labels[l])
		}
		groups[strings.Join(parts, " / ")] += s.value
	}
	keys := make([]string, 0, len(groups))
	for k := range groups {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	maxV := 0.0
	for _, k := range keys {
		maxV = math.Max(maxV, groups[k])
	}
	if len(keys) == 0 {
		fmt.Fprintf(b, `<text x="10" y="60" fill="#8e8e8e">no samples yet</text>`)
		return
	}
	bh := min(24, (ph-70)/len(keys))
	for i, k := range keys {
		w := 0
		if maxV > 0 {
			w = int(float64(pw-200) * groups[k] / maxV)
		}
		y := 34 + i*bh
		label := k
		if label == "" {
			label = name
		}
		fmt.Fprintf(b, `<text x="10" y="%d" fill="#ccccdc">%s</text><rect x="150" y="%d" width="%d" height="%d" fill="#5794f2"/><text x="%d" y="%d" fill="#ccccdc">%g</text>`,
			y+bh/2+4, esc(trim(label, 22)), y+2, max(w, 1), bh-4, 154+w, y+bh/2+4, groups[k])
	}
}

func drawHistogram(b *strings.Builder, samples []sample, name string, keep func(map[string]string) bool, pw, ph int) {
	cum := map[float64]float64{}
	for _, s := range samples {
		if s.name != name || !keep(s.labels) {
			continue
		}
		le, err := strconv.ParseFloat(s.labels["le"], 64)
		if err != nil {
			continue
		}
		cum[le] += s.value
	}
	var les []float64
	for le := range cum {
		les = append(les, le)
	}
	sort.Float64s(les)
	total := 0.0
	if len(les) > 0 {
		total = cum[les[len(les)-1]]
	}
	if total == 0 {
		fmt.Fprintf(b, `<text x="10" y="60" fill="#8e8e8e">no samples yet</text>`)
		return
	}
	// Buckets up to the first that holds everything.
	last := len(les) - 1
	for i, le := range les {
		if cum[le] >= total {
			last = i
			break
		}
	}
	first := 0
	for first < last && cum[les[first]] == 0 {
		first++
	}
	if first > 0 {
		first--
	}
	shown := les[first : last+1]
	bw := (pw - 40) / max(len(shown), 1)
	maxC, prev := 0.0, 0.0
	counts := make([]float64, len(shown))
	for i, le := range shown {
		if i == 0 && first > 0 {
			prev = cum[les[first-1]]
		}
		counts[i] = cum[le] - prev
		prev = cum[le]
		maxC = math.Max(maxC, counts[i])
	}
	for i, le := range shown {
		h := int(float64(ph-90) * counts[i] / math.Max(maxC, 1))
		x := 20 + i*bw
		fmt.Fprintf(b, `<rect x="%d" y="%d" width="%d" height="%d" fill="#73bf69"/><text x="%d" y="%d" fill="#8e8e8e" font-size="9" text-anchor="middle">≤%g</text>`,
			x+2, ph-45-h, bw-4, max(h, 1), x+bw/2, ph-32, le)
	}
	fmt.Fprintf(b, `<text x="%d" y="20" fill="#ccccdc" text-anchor="end">n=%.0f  p50≈%.3g  p95≈%.3g</text>`, pw-10, total, quantile(0.5, les, cum), quantile(0.95, les, cum))
}

// quantile interpolates like PromQL's histogram_quantile.
func quantile(q float64, les []float64, cum map[float64]float64) float64 {
	total := cum[les[len(les)-1]]
	rank := q * total
	lo, prev := 0.0, 0.0
	for _, le := range les {
		if cum[le] >= rank {
			if math.IsInf(le, 1) {
				return lo
			}
			if cum[le] == prev {
				return le
			}
			return lo + (le-lo)*(rank-prev)/(cum[le]-prev)
		}
		lo, prev = le, cum[le]
	}
	return lo
}

func esc(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}

func trim(s string, n int) string {
	if len([]rune(s)) <= n {
		return s
	}
	return string([]rune(s)[:n-1]) + "…"
}
