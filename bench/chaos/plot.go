package chaos

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
	"time"
)

var colours = []string{"#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666", "#1f78b4", "#b2df8a"}

type frame struct {
	b                  strings.Builder
	w, h, l, r, t, bot float64
	xmax, ymax         float64
	plotW, plotH       float64
}

func newFrame(title, xlabel, ylabel string, w, h, xmax, ymax float64) *frame {
	f := &frame{w: w, h: h, l: 70, r: 190, t: 40, bot: 50, xmax: xmax, ymax: ymax}
	f.plotW, f.plotH = w-f.l-f.r, h-f.t-f.bot
	fmt.Fprintf(&f.b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif">`+"\n", w, h)
	fmt.Fprintf(&f.b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&f.b, `<text x="%.1f" y="24" text-anchor="middle" font-size="16">%s</text>`+"\n", w/2, esc(title))
	fmt.Fprintf(&f.b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="12">%s</text>`+"\n", f.l+f.plotW/2, h-12, esc(xlabel))
	fmt.Fprintf(&f.b, `<text x="16" y="%.1f" transform="rotate(-90 16 %.1f)" text-anchor="middle" font-size="12">%s</text>`+"\n", f.t+f.plotH/2, f.t+f.plotH/2, esc(ylabel))
	return f
}

func (f *frame) x(v float64) float64 { return f.l + v/f.xmax*f.plotW }
func (f *frame) y(v float64) float64 { return f.t + f.plotH - math.Min(v, f.ymax)/f.ymax*f.plotH }

// bands shades each fault's window from injection to recovery.
func (f *frame) bands(ws []Window) {
	for i, w := range ws {
		x0, x1 := f.x(w.Start.Seconds()), f.x(w.End.Seconds())
		if x1-x0 < 2 {
			x1 = x0 + 2
		}
		fmt.Fprintf(&f.b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="#f4a582" fill-opacity="0.35"><title>%s</title></rect>`+"\n",
			x0, f.t, x1-x0, f.plotH, esc(w.Name+": "+w.What))
		fmt.Fprintf(&f.b, `<text x="%.1f" y="%.1f" font-size="10" transform="rotate(-90 %.1f %.1f)" text-anchor="end">%d %s</text>`+"\n",
			x0+9, f.t+4, x0+9, f.t+4, i+1, esc(w.Name))
	}
}

func (f *frame) axes() {
	fmt.Fprintf(&f.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", f.l, f.t+f.plotH, f.l+f.plotW, f.t+f.plotH)
	fmt.Fprintf(&f.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", f.l, f.t, f.l, f.t+f.plotH)
	for i := 0; i <= 5; i++ {
		v := f.ymax * float64(i) / 5
		y := f.y(v)
		fmt.Fprintf(&f.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", f.l, y, f.l+f.plotW, y)
		fmt.Fprintf(&f.b, `<text x="%.1f" y="%.1f" text-anchor="end" font-size="11">%s</text>`+"\n", f.l-4, y+4, num(v))
		xv := f.xmax * float64(i) / 5
		fmt.Fprintf(&f.b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="11">%s</text>`+"\n", f.x(xv), f.t+f.plotH+16, num(xv))
	}
}

func (f *frame) legend(names []string, cols []string) {
	x := f.l + f.plotW + 15
	for i, n := range names {
		fmt.Fprintf(&f.b, `<rect x="%.1f" y="%.1f" width="12" height="12" fill="%s"/>`+"\n", x, f.t+float64(i)*18, cols[i])
		fmt.Fprintf(&f.b, `<text x="%.1f" y="%.1f" font-size="11">%s</text>`+"\n", x+17, f.t+float64(i)*18+10, esc(n))
	}
}

func (f *frame) polyline(xs, ys []float64, col string) {
	if len(xs) == 0 {
		return
	}
	pts := make([]string, len(xs))
	for i := range xs {
		pts[i] = fmt.Sprintf("%.1f,%.1f", f.x(xs[i]), f.y(ys[i]))
	}
	fmt.Fprintf(&f.b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`+"\n", col, strings.Join(pts, " "))
}

func (f *frame) done(w io.Writer) error {
	f.b.WriteString("</svg>\n")
	_, err := io.WriteString(w, f.b.String())
	return err
}

// PlotTTFT draws every successful request's TTFT at its start time
// (streamed and whole answers apart), failed and lost requests as marks
// along the top, and the faults as shaded bands. The axis stops at 3× the
// p99 so that a few stragglers do not flatten the rest; clipped points sit
// on the top line.
func PlotTTFT(w io.Writer, title string, rs []Record, ws []Window, dur time.Duration) error {
	var vals []float64
	for _, r := range rs {
		if r.Outcome == OK {
			vals = append(vals, ms(r.TTFT))
		}
	}
	sort.Float64s(vals)
	ymax := niceCeil(math.Max(1, 3*quantile(vals, 0.99)))
	f := newFrame(title, "run time (s)", "TTFT (ms)", 1100, 440, math.Max(1, dur.Seconds()), ymax)
	f.bands(ws)
	f.axes()
	cols := map[bool]string{true: colours[0], false: colours[2]}
	for _, r := range rs {
		x := f.x(r.Start.Seconds())
		switch {
		case r.Outcome == OK:
			fmt.Fprintf(&f.b, `<circle cx="%.1f" cy="%.1f" r="1.6" fill="%s" fill-opacity="0.6"/>`+"\n", x, f.y(ms(r.TTFT)), cols[r.Stream])
		case r.Outcome == Aborted:
		default:
			col := "#d7191c"
			if r.Outcome.Lost() {
				col = "black"
			}
			fmt.Fprintf(&f.b, `<path d="M%.1f %.1f l4 4 m0 -4 l-4 4" stroke="%s" stroke-width="1.2"/>`+"\n", x-2, f.t-2, col)
		}
	}
	f.legend([]string{"streamed (first token)", "whole answer", "failed (top marks)", "lost (top marks)", "fault (inject→recover)"},
		[]string{colours[0], colours[2], "#d7191c", "black", "#f4a582"})
	return f.done(w)
}

// PlotErrors draws per-second counts of failed, lost and retried
// requests (by start time), with the faults as bands.
func PlotErrors(w io.Writer, title string, rs []Record, ws []Window, dur time.Duration) error {
	n := int(dur.Seconds()) + 1
	failed, lost, retried, sent := make([]float64, n), make([]float64, n), make([]float64, n), make([]float64, n)
	for _, r := range rs {
		i := min(n-1, int(r.Start.Seconds()))
		sent[i]++
		if len(r.Retries) > 0 {
			retried[i]++
		}
		switch {
		case r.Outcome.Lost():
			lost[i]++
		case r.Outcome == Failed || r.Outcome == Reset:
			failed[i]++
		}
	}
	ymax := 1.0
	for i := range n {
		ymax = math.Max(ymax, math.Max(failed[i], math.Max(lost[i], retried[i])))
	}
	f := newFrame(title, "run time (s)", "requests per second (by start)", 1100, 380, math.Max(1, dur.Seconds()), niceCeil(ymax))
	f.bands(ws)
	f.axes()
	xs := make([]float64, n)
	for i := range xs {
		xs[i] = float64(i) + 0.5
	}
	f.polyline(xs, retried, colours[2])
	f.polyline(xs, failed, "#d7191c")
	f.polyline(xs, lost, "black")
	f.legend([]string{"retried by the client", "failed (status, error event, reset)", "lost (cut / unanswered)"}, []string{colours[2], "#d7191c", "black"})
	return f.done(w)
}

// PlotSoak draws one metric's series over time, one line per process.
func PlotSoak(w io.Writer, title, unit string, samples []Sample, metric string) error {
	by := map[string][]Sample{}
	tmax, ymax := 1.0, 1.0
	for _, s := range samples {
		name, m, ok := strings.Cut(s.Series, " ")
		if !ok {
			name, m = s.Series, s.Series
		}
		if m != metric {
			continue
		}
		by[name] = append(by[name], s)
		tmax, ymax = math.Max(tmax, s.T), math.Max(ymax, s.Value)
	}
	names := make([]string, 0, len(by))
	for n := range by {
		names = append(names, n)
	}
	sort.Strings(names)
	f := newFrame(title, "soak time (s)", unit, 1000, 380, tmax, niceCeil(ymax*1.1))
	f.axes()
	cols := make([]string, len(names))
	for i, n := range names {
		ss := by[n]
		sort.Slice(ss, func(a, b int) bool { return ss[a].T < ss[b].T })
		xs, ys := make([]float64, len(ss)), make([]float64, len(ss))
		for j, s := range ss {
			xs[j], ys[j] = s.T, s.Value
		}
		cols[i] = colours[i%len(colours)]
		f.polyline(xs, ys, cols[i])
	}
	f.legend(names, cols)
	return f.done(w)
}

func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func num(v float64) string {
	switch {
	case v >= 10000:
		return fmt.Sprintf("%.0fk", v/1000)
	case v >= 100 || v == math.Trunc(v):
		return fmt.Sprintf("%.0f", v)
	default:
		return fmt.Sprintf("%.1f", v)
	}
}

func esc(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}
