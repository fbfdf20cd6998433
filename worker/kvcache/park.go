package kvcache

// Parker is implemented by Cells that can move an idle sequence's cells out
// of the compute cache (llama.cpp: into host memory, where they no longer
// slow down every other sequence's attention) and bring them back by
// themselves when the sequence is used again.
type Parker interface {
	// Park moves seq's cells out; the next Step, Copy or Remove that
	// touches seq sees them as before.
	Park(seq int)
	// Parked reports whether seq's cells are out: evicting its entry
	// frees no room in the compute cache.
	Parked(seq int) bool
}

// ParkBudget is implemented by Parkers whose parked host memory is bounded
// (llama.cpp: --kv-park-max-bytes). The Owner keeps ParkedBytes within
// ParkLimit when it parks an entry, evicting idle parked entries through
// its normal eviction path (reports and all) first.
type ParkBudget interface {
	// ParkBytes is the host memory seq takes parked, or would take if
	// parked now.
	ParkBytes(seq int) int64
	// ParkedBytes is the host memory all parked sequences take.
	ParkedBytes() int64
	// ParkLimit is the bound on ParkedBytes.
	ParkLimit() int64
}

// park moves idle entry e's cells to host memory if the cells can be
// parked and the bound allows, after evicting idle parked entries in
// Victim order (cause "park_bytes") until e fits. An entry that cannot fit
// — larger than the bound alone, or the bound taken by sequences that are
// not idle entries (a running request's copy of a parked prefix, restored
// at its first step) — stays in the KV cache, still cached: it costs
// attention time like with --kv-park-idle=false, and KV-full eviction
// (EvictForRoom) takes it before any parked entry when room is needed.
// Evicting it instead would throw away a conversation the cache still
// holds.
func (o *Owner) park(e *Entry) {
	p, ok := o.cells.(Parker)
	if !ok || p.Parked(e.Seq) {
		return
	}
	if b, ok := o.cells.(ParkBudget); ok {
		need := b.ParkBytes(e.Seq)
		limit := b.ParkLimit()
		// What evicting every other idle parked entry could free: if even
		// that is not enough, evict nothing.
		var keep []string
		var freeable int64
		for _, x := range o.books.entries {
			if x.InUse {
				continue
			}
			if x != e && p.Parked(x.Seq) {
				freeable += b.ParkBytes(x.Seq)
			} else {
				keep = append(keep, x.ID)
			}
		}
		if need > limit || b.ParkedBytes()-freeable+need > limit {
			return
		}
		// need is read again after each eviction: evicting the entry whose
		// bytes e would be parked on (its root, docs/worker.md "Seq ids and
		// the KV cache") makes e take all of its own.
		for b.ParkedBytes()+need > limit {
			if !o.evictOne("park_bytes", keep...) {
				return
			}
			if need = b.ParkBytes(e.Seq); need > limit {
				return
			}
		}
	}
	p.Park(e.Seq)
}

// Swap moves running entry id's cells to host memory, as park does for an
// idle one, and reports whether they went: on KV full the scheduler
// swaps out a request that has more work to do rather than drop cells it
// would compute again (they come back with its next step). Entries that
// lead or follow others keep their cells: followers copy from a leader's.
func (o *Owner) Swap(id string) bool {
	e, ok := o.books.Get(id)
	p, can := o.cells.(Parker)
	if !ok || !can || !e.InUse || p.Parked(e.Seq) || e.leader != "" || o.Followers(id) > 0 {
		return false
	}
	o.park(e)
	return p.Parked(e.Seq)
}
