package report

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
)

// palette gives each policy a stable, distinguishable colour.
var palette = []string{"#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"}

// BarChart plots one metric (chosen by value) for every workload × policy:
// one panel per workload, each with its own y axis, because workloads differ
// by orders of magnitude (a hot prompt's TTFT is milliseconds, a herded
// shared prefix's is minutes). A panel's axis stops at clipFactor × its median
// bar so that one runaway policy does not flatten the others; a clipped bar
// is drawn to the top with a break mark, and every bar carries its value.
func (r Run) BarChart(w io.Writer, title, unit string, value func(Summary) float64) error {
	const clipFactor = 3.0
	wls, pols := r.Workloads(), r.Policies()
	const panelW, height, left, right, top, bottom = 230.0, 420.0, 60.0, 170.0, 50.0, 60.0
	width := left + panelW*float64(len(wls)) + right
	plotH := height - top - bottom
	var b strings.Builder
	header(&b, width, height, title)
	fmt.Fprintf(&b, `<text x="18" y="%.1f" transform="rotate(-90 18 %.1f)" text-anchor="middle" font-size="12">%s</text>`+"\n", top+plotH/2, top+plotH/2, esc(unit))
	for gi, wl := range wls {
		var vals []float64
		for _, p := range pols {
			if s, ok := r.find(wl, p); ok {
				vals = append(vals, value(s))
			}
		}
		max := panelMax(vals, clipFactor)
		x0 := left + float64(gi)*panelW
		plotW := panelW - 40
		axes(&b, x0, top, plotW, plotH, max)
		barW := plotW * 0.9 / float64(len(pols))
		for pi, p := range pols {
			s, ok := r.find(wl, p)
			if !ok {
				continue
			}
			v := value(s)
			h := math.Min(v, max) / max * plotH
			x := x0 + plotW*0.05 + float64(pi)*barW
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s %s: %.2f %s</title></rect>`+"\n",
				x, top+plotH-h, barW*0.9, h, palette[pi%len(palette)], esc(wl), esc(p), v, esc(unit))
			labelY, fill := top+plotH-h-4, "black"
			if v > max { // break mark: two white slashes across the bar's top; the value goes inside
				for _, dy := range []float64{10, 16} {
					fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="white" stroke-width="2"/>`+"\n",
						x-1, top+dy+3, x+barW*0.9+1, top+dy-3)
				}
				labelY, fill = top+32, "white"
			}
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="10" fill="%s">%s</text>`+"\n",
				x+barW*0.45, labelY, fill, shortNum(v))
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="13">%s</text>`+"\n", x0+plotW/2, top+plotH+22, esc(wl))
	}
	legend(&b, width-right+15, top, pols)
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// PairedChart plots, for each workload run in several rounds, cache_aware's
// change against every other policy of the same round (pick's value, mine /
// theirs − 1): a dot per round, the median as a bar, the aim against that
// policy as a dashed line where it has one. The changes are what a verdict
// reads (docs/benchmarks.md, "Method"); the axis runs from −100% to +100%,
// and a change beyond it is drawn on its edge.
func (r Run) PairedChart(w io.Writer, title string, pick func(Summary) float64) error {
	const limit = 100.0
	type column struct {
		policy  string
		changes []float64
	}
	var panels [][]column
	var names []string
	for _, wl := range r.Workloads() {
		var cols []column
		for _, p := range r.Policies() {
			if p == "cache_aware" {
				continue
			}
			c := column{policy: p, changes: roundChanges(r.rounds(wl), wl, p, pick)}
			if len(c.changes) > 0 {
				cols = append(cols, c)
			}
		}
		if len(cols) > 0 {
			panels, names = append(panels, cols), append(names, wl)
		}
	}
	const colW, height, left, top, bottom = 90.0, 420.0, 60.0, 50.0, 60.0
	width := left + 20
	for _, cols := range panels {
		width += colW*float64(len(cols)) + 40
	}
	plotH := height - top - bottom
	y := func(v float64) float64 { return top + plotH*(limit-max(-limit, min(limit, v)))/(2*limit) }
	var b strings.Builder
	header(&b, width, height, title)
	fmt.Fprintf(&b, `<text x="18" y="%.1f" transform="rotate(-90 18 %.1f)" text-anchor="middle" font-size="12">cache_aware against it, %%</text>`+"\n", top+plotH/2, top+plotH/2)
	x0 := left
	for pi, cols := range panels {
		plotW := colW * float64(len(cols))
		for v := -limit; v <= limit; v += 50 {
			stroke := "#ddd"
			if v == 0 {
				stroke = "black"
			}
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s"/>`+"\n", x0, y(v), x0+plotW, y(v), stroke)
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end" font-size="11">%+.0f</text>`+"\n", x0-4, y(v)+4, v)
		}
		for ci, c := range cols {
			cx := x0 + colW*(float64(ci)+0.5)
			if aim, ok := aimAgainst(names[pi], c.policy, r.external(c.policy)); ok {
				aim *= 100
				fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#c00" stroke-dasharray="4 3"><title>the aim: %+.0f%%</title></line>`+"\n",
					cx-colW*0.4, y(aim), cx+colW*0.4, y(aim), aim)
			}
			for i, v := range c.changes {
				jitter := colW * 0.3 * (float64(i%7)/6 - 0.5)
				fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s" fill-opacity="0.6"><title>%+.0f%%</title></circle>`+"\n",
					cx+jitter, y(v), palette[ci%len(palette)], v)
			}
			med := median(c.changes, func(v float64) float64 { return v })
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black" stroke-width="3"/>`+"\n", cx-colW*0.3, y(med), cx+colW*0.3, y(med))
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="10">%+.0f%% (%d runs)</text>`+"\n", cx, top+plotH+14, med, len(c.changes))
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="11">%s</text>`+"\n", cx, top+plotH+28, esc(c.policy))
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="13">%s</text>`+"\n", x0+plotW/2, top+plotH+48, esc(names[pi]))
		x0 += plotW + 40
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// panelMax is a panel's axis top: the largest value, or clip × the median
// when the largest is further out than that, rounded up to a readable tick.
func panelMax(vals []float64, clip float64) float64 {
	if len(vals) == 0 {
		return 1
	}
	s := append([]float64(nil), vals...)
	sort.Float64s(s)
	max := s[len(s)-1]
	if med := Quantile(s, 0.5); med > 0 && max > clip*med {
		max = clip * med
	}
	if max <= 0 {
		return 1
	}
	return niceCeil(max)
}

// shortNum prints a bar's value compactly: 3159 → "3.2k", 91.7 → "91.7".
func shortNum(v float64) string {
	switch {
	case v >= 10000:
		return fmt.Sprintf("%.0fk", v/1000)
	case v >= 1000:
		return fmt.Sprintf("%.1fk", v/1000)
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	default:
		return fmt.Sprintf("%.1f", v)
	}
}

// CDF plots the empirical distribution of a per-request latency for each
// policy on one workload.
func CDF(w io.Writer, title, unit string, series map[string][]float64, order []string) error {
	const width, height, left, right, top, bottom = 900.0, 420.0, 70.0, 170.0, 40.0, 60.0
	plotW, plotH := width-left-right, height-top-bottom
	max := 0.0
	for _, v := range series {
		for _, x := range v {
			max = math.Max(max, x)
		}
	}
	if max == 0 {
		max = 1
	}
	max = niceCeil(max)
	var b strings.Builder
	header(&b, width, height, title)
	// y axis is probability 0..1; x axis is the latency.
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", left, top+plotH, left+plotW, top+plotH)
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", left, top, left, top+plotH)
	for i := 0; i <= 5; i++ {
		x := left + plotW*float64(i)/5
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="11">%.0f</text>`+"\n", x, top+plotH+16, max*float64(i)/5)
		y := top + plotH - plotH*float64(i)/5
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end" font-size="11">%.1f</text>`+"\n", left-6, y+4, float64(i)/5)
	}
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="12">%s</text>`+"\n", left+plotW/2, top+plotH+40, esc(unit))
	for i, name := range order {
		v := append([]float64(nil), series[name]...)
		if len(v) == 0 {
			continue
		}
		sort.Float64s(v)
		var pts []string
		for j, x := range v {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", left+x/max*plotW, top+plotH-plotH*float64(j+1)/float64(len(v))))
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", palette[i%len(palette)], strings.Join(pts, " "))
	}
	legend(&b, width-right+15, top, order)
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func header(b *strings.Builder, w, h float64, title string) {
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif">`+"\n", w, h)
	fmt.Fprintf(b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(b, `<text x="%.1f" y="24" text-anchor="middle" font-size="16">%s</text>`+"\n", w/2, esc(title))
}

func axes(b *strings.Builder, left, top, plotW, plotH, max float64) {
	fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", left, top+plotH, left+plotW, top+plotH)
	fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", left, top, left, top+plotH)
	for i := 0; i <= 5; i++ {
		y := top + plotH - plotH*float64(i)/5
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, y, left+plotW, y)
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="end" font-size="11">%s</text>`+"\n", left-4, y+4, shortNum(max*float64(i)/5))
	}
}

func legend(b *strings.Builder, x, y float64, names []string) {
	for i, n := range names {
		fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="12" height="12" fill="%s"/>`+"\n", x, y+float64(i)*20, palette[i%len(palette)])
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f" font-size="12">%s</text>`+"\n", x+18, y+float64(i)*20+10, esc(n))
	}
}

// niceCeil rounds up to 1, 2 or 5 times a power of ten so axis ticks read well.
func niceCeil(v float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func esc(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}
