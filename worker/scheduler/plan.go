package scheduler

import (
	"cmp"
	"slices"
)

// candidate is a request with tokens for the next step, as plan sees it.
type candidate struct {
	left       int    // tokens still to evaluate: 1 while decoding, more while prefilling
	generating bool   // it has generated tokens already (decoding)
	toGo       int    // tokens it may still generate before its max_tokens
	lastStep   uint64 // the step that last evaluated it
}

// planConfig are the knobs of a step's plan (Config's, with the engine's n_batch).
type planConfig struct {
	NBatch, MaxBatch, FinishFirst, PrefillChunk int
}

// slot is one span of a planned step: candidate i evaluates its next k tokens.
type slot struct{ i, k int }

// plan builds one step out of candidates (in admission order): every
// decoding sequence's next token first (so decode latency never waits
// behind a long prefill), then prefill chunks, shortest remaining prefill
// first, until n_batch tokens. Shortest first is what makes a cache hit
// fast: its few uncached tokens finish in this step instead of waiting for
// a cold prompt's chunks to go first. Long prompts still take whatever
// budget is left, so they are not starved unless short prefills alone fill
// every step.
//
// At most MaxBatch sequences take part. When more are ready, those that
// waited longest since their last step go first (then shorter remainders):
// every sequence gets a turn within ceil(ready/MaxBatch) steps, and
// decoders cannot lock new prompts out.
//
// FinishFirst > 0: while a generating request has at most that many tokens
// to go, no prompt with a full n_batch or more still to prefill gets
// prefill work: its attention would crowd in the finishing request's cells
// while the finishing request's last steps are short. Shorter prefills run
// beside it.
//
// PrefillChunk > 0: while more than one request steps, the step carries
// at most that many prompt tokens; a request stepping alone takes a whole
// n_batch. Every request in a step waits for its end, and a step lasts as
// long as its tokens times the cells they attend over.
//
// plan is pure: the same candidates and config give the same slots.
func plan(cs []candidate, c planConfig) []slot {
	in := make([]int, 0, len(cs)) // the candidates that take part, in admission order
	for i := range cs {
		in = append(in, i)
	}
	if len(in) > c.MaxBatch {
		slices.SortStableFunc(in, func(a, b int) int {
			if d := cmp.Compare(cs[a].lastStep, cs[b].lastStep); d != 0 {
				return d
			}
			return cmp.Compare(cs[a].left, cs[b].left)
		})
		in = in[:c.MaxBatch]
		slices.Sort(in)
	}
	finishing := false
	for _, i := range in {
		if c.FinishFirst > 0 && cs[i].left == 1 && cs[i].generating && cs[i].toGo <= c.FinishFirst {
			finishing = true
		}
	}
	var out []slot
	var prefill []int
	budget := c.NBatch
	for _, i := range in {
		switch left := cs[i].left; {
		case left == 1 && budget > 0:
			out = append(out, slot{i, 1})
			budget--
		case left >= 2 && !(finishing && left >= c.NBatch):
			prefill = append(prefill, i)
		}
	}
	// Stable: equal remainders keep admission order (first come, first served).
	slices.SortStableFunc(prefill, func(a, b int) int { return cmp.Compare(cs[a].left, cs[b].left) })
	if c.PrefillChunk > 0 && len(out)+len(prefill) > 1 {
		budget = min(budget, c.PrefillChunk)
	}
	for _, i := range prefill {
		if budget == 0 {
			break
		}
		k := min(cs[i].left, budget)
		out = append(out, slot{i, k})
		budget -= k
	}
	return out
}
