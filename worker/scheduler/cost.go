package scheduler

import (
	"math"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

// stepCost learns what this pod's steps cost from the steps it runs, so that
// it can tell the routers in seconds what it has to compute (Stats): a step
// of the batch spans lasts about
//
//	base + perToken·tokens + perPair·pairs + perSample·sampled
//
// where pairs counts, over the batch's tokens, the cells each attends to
// (its position: k tokens written after pos cells make k·pos + k(k+1)/2
// pairs), the term that makes a long prompt cost more per token than a
// short one. These are llama.cpp's own costs (worker/engine/sim uses the
// same form); a step's duration is measured exactly here, with no queueing
// in it, which a router's observed TTFTs never are.
//
// The fit is a least-squares plane over the recent steps (decayed by
// 1/costMemory a step), its coefficients held at 0 or above: a coefficient
// the data cannot separate (a run of decode steps only, where tokens and
// samples move together) drops out and the others carry it. Owned by the
// scheduler's loop; not safe for concurrent use.
type stepCost struct {
	xtx [costTerms][costTerms]float64 // decayed Σ x·xᵀ
	xty [costTerms]float64            // decayed Σ x·seconds
	n   float64                       // decayed count of steps
}

// The plane's terms, in the order of a step's features (features).
const (
	costBase = iota
	costToken
	costKPair // per thousand pairs: keeps the sums' magnitudes alike
	costSample
	costTerms
)

// costMemory is how many steps the fit mostly remembers: a few seconds of
// traffic, enough prefill steps among the decode ones to separate the
// per-token cost from the per-sample one, short enough to follow a pod
// whose speed changes (thermal limits, a neighbour on its accelerator).
const costMemory = 512

// minCostSteps is how many steps the fit needs before it says anything.
const minCostSteps = 32

// Cost is what the pod's steps cost, as the fit has it (zero until known).
type Cost struct {
	Base, PerToken, PerPair, PerSample float64 // seconds
}

// Known says whether the fit has seen enough steps to be used.
func (c Cost) Known() bool { return c.PerToken > 0 || c.PerPair > 0 }

// Prefill is the compute of n prompt tokens written after cached cells:
// each token's own cost and its attention to the cells before it.
func (c Cost) Prefill(n, cached int) float64 {
	if n <= 0 {
		return 0
	}
	return c.PerToken*float64(n) + c.PerPair*pairs(n, cached)
}

// Step is the time of a step of spans at this cost (the fit's plane).
func (c Cost) Step(spans []engine.Span) float64 {
	x := features(spans)
	return c.Base*x[costBase] + c.PerToken*x[costToken] + c.PerPair*1000*x[costKPair] + c.PerSample*x[costSample]
}

// pairs is Σ over k tokens written after pos cells of the cells each
// attends to, itself included.
func pairs(k, pos int) float64 {
	return float64(k)*float64(pos) + float64(k)*float64(k+1)/2
}

// features is a step's x: 1, tokens, thousands of pairs, samples.
func features(spans []engine.Span) [costTerms]float64 {
	x := [costTerms]float64{costBase: 1}
	for _, sp := range spans {
		k := len(sp.Tokens)
		x[costToken] += float64(k)
		x[costKPair] += pairs(k, sp.Pos) / 1000
		if sp.Sampler != nil {
			x[costSample]++
		}
	}
	return x
}

// observe adds one step that took d.
func (f *stepCost) observe(spans []engine.Span, d time.Duration) {
	x, y := features(spans), d.Seconds()
	if y <= 0 {
		return
	}
	const keep = 1 - 1.0/costMemory
	f.n = f.n*keep + 1
	for i := range costTerms {
		for j := range costTerms {
			f.xtx[i][j] = f.xtx[i][j]*keep + x[i]*x[j]
		}
		f.xty[i] = f.xty[i]*keep + x[i]*y
	}
}

// cost solves the plane, dropping a term whose coefficient comes out
// negative (or that the steps never varied) and solving again, until all
// that remain are positive.
func (f *stepCost) cost() Cost {
	if f.n < minCostSteps {
		return Cost{}
	}
	var in [costTerms]bool
	for i := range in {
		in[i] = f.xtx[i][i] > 0
	}
	for {
		b, ok := f.solve(in)
		if !ok {
			return Cost{}
		}
		drop := -1
		for i := range costTerms {
			if in[i] && b[i] < 0 && (drop < 0 || b[i] < b[drop]) {
				drop = i
			}
		}
		if drop < 0 {
			return Cost{Base: b[costBase], PerToken: b[costToken], PerPair: b[costKPair] / 1000, PerSample: b[costSample]}
		}
		in[drop] = false
	}
}

// solve is least squares over the terms in, by Gaussian elimination with
// partial pivoting on the normal equations (four unknowns at most). A term
// whose pivot vanishes (collinear with the others) drops out at 0.
func (f *stepCost) solve(in [costTerms]bool) ([costTerms]float64, bool) {
	var idx []int
	for i := range costTerms {
		if in[i] {
			idx = append(idx, i)
		}
	}
	n := len(idx)
	if n == 0 {
		return [costTerms]float64{}, false
	}
	var a [costTerms][costTerms + 1]float64
	for r, i := range idx {
		for c, j := range idx {
			a[r][c] = f.xtx[i][j]
		}
		a[r][n] = f.xty[i]
	}
	var zero [costTerms]bool
	for c := range n {
		p := c
		for r := c + 1; r < n; r++ {
			if math.Abs(a[r][c]) > math.Abs(a[p][c]) {
				p = r
			}
		}
		a[c], a[p] = a[p], a[c]
		if math.Abs(a[c][c]) <= 1e-9*math.Abs(f.xtx[idx[c]][idx[c]])+1e-300 {
			zero[c] = true
			continue
		}
		for r := c + 1; r < n; r++ {
			k := a[r][c] / a[c][c]
			for cc := c; cc <= n; cc++ {
				a[r][cc] -= k * a[c][cc]
			}
		}
	}
	var sol [costTerms]float64
	for c := n - 1; c >= 0; c-- {
		if zero[c] {
			continue
		}
		v := a[c][n]
		for cc := c + 1; cc < n; cc++ {
			v -= a[c][cc] * sol[cc]
		}
		sol[c] = v / a[c][c]
	}
	var b [costTerms]float64
	for r, i := range idx {
		b[i] = sol[r]
	}
	return b, true
}
