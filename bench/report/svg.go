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

// BarChart plots one metric (chosen by value) for every workload × policy as
// grouped bars, e.g. TTFT p90 per policy for each workload.
func (r Run) BarChart(w io.Writer, title, unit string, value func(Summary) float64) error {
	wls, pols := r.Workloads(), r.Policies()
	const width, height, left, right, top, bottom = 900.0, 420.0, 70.0, 170.0, 40.0, 60.0
	plotW, plotH := width-left-right, height-top-bottom
	max := 0.0
	for _, s := range r.Summaries {
		max = math.Max(max, value(s))
	}
	if max == 0 {
		max = 1
	}
	max = niceCeil(max)
	var b strings.Builder
	header(&b, width, height, title)
	axes(&b, left, top, plotW, plotH, max, unit)
	groupW := plotW / float64(len(wls))
	barW := groupW * 0.8 / float64(len(pols))
	for gi, wl := range wls {
		x0 := left + float64(gi)*groupW + groupW*0.1
		for pi, p := range pols {
			s, ok := r.find(wl, p)
			if !ok {
				continue
			}
			h := value(s) / max * plotH
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s %s: %.2f %s</title></rect>`+"\n",
				x0+float64(pi)*barW, top+plotH-h, barW*0.92, h, palette[pi%len(palette)], wl, p, value(s), unit)
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="13">%s</text>`+"\n", x0+groupW*0.4, top+plotH+22, esc(wl))
	}
	legend(&b, width-right+15, top, pols)
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
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

func axes(b *strings.Builder, left, top, plotW, plotH, max float64, unit string) {
	fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", left, top+plotH, left+plotW, top+plotH)
	fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", left, top, left, top+plotH)
	for i := 0; i <= 5; i++ {
		y := top + plotH - plotH*float64(i)/5
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, y, left+plotW, y)
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="end" font-size="11">%g</text>`+"\n", left-6, y+4, max*float64(i)/5)
	}
	fmt.Fprintf(b, `<text x="18" y="%.1f" transform="rotate(-90 18 %.1f)" text-anchor="middle" font-size="12">%s</text>`+"\n", top+plotH/2, top+plotH/2, esc(unit))
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
