package kvcache

import (
	"slices"
	"strings"
)

// lead makes f follow the running entry, itself no follower, whose planned
// prompt shares the longest prefix with f's beyond what f holds — if any.
func (o *Owner) lead(f *Entry) {
	f.leader, f.shareTo = "", 0
	limit := len(f.planned) - 1
	best, bestN := (*Entry)(nil), len(f.Tokens)
	for _, e := range o.books.entries {
		if e == f || !e.InUse || e.leader != "" || len(e.planned) <= len(e.Tokens) {
			continue // only a prefill in progress will write more
		}
		n := min(commonPrefix(e.planned, f.planned), limit)
		if n < bestN || n == 0 {
			continue
		}
		// Ties: the one furthest ahead, then the id, so the choice does
		// not depend on map order.
		if best == nil || n > bestN || len(e.Tokens) > len(best.Tokens) ||
			(len(e.Tokens) == len(best.Tokens) && e.ID < best.ID) {
			best, bestN = e, n
		}
	}
	if best != nil && bestN > len(f.Tokens) {
		f.leader, f.shareTo = best.ID, bestN
	}
}

// Prefixes returns what SharedWith matches a prompt against: every entry's
// cells and each running entry's whole prompt. The slices are the books'
// own, and the books never write an element of them again (they append
// past a slice's length, or clip it and reallocate), so the caller may
// read them from another goroutine.
func (o *Owner) Prefixes() [][]int {
	out := make([][]int, 0, 2*len(o.books.entries))
	for _, e := range o.books.entries {
		out = append(out, e.Tokens)
		if e.InUse {
			out = append(out, e.planned)
		}
	}
	return out
}

// SharedWith is how much of toks a request bound next would not compute
// itself: the longest prefix of it among prefixes (Owner.Prefixes: what the
// books hold or a running request's prompt will write) and ahead (prompts
// that bind before it). The last token is always evaluated.
func SharedWith(prefixes [][]int, toks []int, ahead [][]int) int {
	n := 0
	for _, p := range prefixes {
		n = max(n, commonPrefix(p, toks))
	}
	for _, a := range ahead {
		n = max(n, commonPrefix(a, toks))
	}
	return min(n, len(toks)-1)
}

// Follow catches request id up with its leader: the cells the leader wrote
// since are shared into id's sequence. It returns how many cells id holds
// and whether it still waits for more (the caller gives it no prefill work
// meanwhile). A follower whose leader is gone, or no longer ahead, stops
// following and computes the rest itself.
func (o *Owner) Follow(id string) (held int, waiting bool) {
	f, ok := o.books.Get(id)
	if !ok {
		return 0, false
	}
	if f.leader == "" {
		return len(f.Tokens), false
	}
	l, ok := o.books.Get(f.leader)
	if !ok {
		f.leader, f.shareTo = "", 0
		return len(f.Tokens), false
	}
	have := len(f.Tokens)
	if upto := min(len(l.Tokens), f.shareTo); upto > have {
		o.cells.Copy(l.Seq, f.Seq, have, upto)
		o.books.Append(id, l.Tokens[have:upto]...)
		o.books.Touch(l.ID)
	}
	if len(f.Tokens) >= f.shareTo || !l.InUse {
		f.leader, f.shareTo = "", 0
		return len(f.Tokens), false
	}
	return len(f.Tokens), true
}

// Followers counts the entries following id.
func (o *Owner) Followers(id string) int {
	n := 0
	for _, e := range o.books.entries {
		if e.leader == id {
			n++
		}
	}
	return n
}

// abdicate is the first half of a leader leaving: each follower takes
// every cell the leader wrote that it shares and stops following. The
// caller then changes the leader's entry and calls relead.
func (o *Owner) abdicate(id string) []*Entry {
	var fs []*Entry
	for _, e := range o.books.entries {
		if e.leader == id {
			fs = append(fs, e)
		}
	}
	for _, f := range fs {
		o.Follow(f.ID)
		f.leader, f.shareTo = "", 0
	}
	return fs
}

// relead finds the former followers new leaders: the one that will share
// the most looks first, finds none among them and computes the rest
// itself; the others then follow it. So a cancelled or preempted leader
// loses nobody's work, and the shared prefix is still computed once.
func (o *Owner) relead(fs []*Entry) {
	slices.SortFunc(fs, func(a, b *Entry) int {
		if c := len(b.planned) - len(a.planned); c != 0 {
			return c
		}
		return strings.Compare(a.ID, b.ID)
	})
	// Those not placed yet can lead nobody (lead skips followers).
	for _, f := range fs {
		f.leader = unplaced
	}
	for _, f := range fs {
		if _, ok := o.books.Get(f.ID); ok {
			o.lead(f)
		} else {
			f.leader = ""
		}
	}
}

// unplaced marks a former follower relead has not placed yet.
const unplaced = "\x00unplaced"
