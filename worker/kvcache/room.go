package kvcache

import "time"

// Holder is a running request holding a seq id, as MakeRoom weighs it.
type Holder struct {
	ID       string
	Admitted time.Time // the newest request gives its cells up first
	// Steps: it will evaluate tokens without waiting for a request to
	// leave (it is not itself waiting for room).
	Steps bool
}

// RoomAction is what MakeRoom did or asks the caller to do.
type RoomAction int

const (
	// RoomEvicted: an idle entry with cells in the compute cache was
	// evicted; step again.
	RoomEvicted RoomAction = iota
	// RoomWait: request ID, in the batch, must wait for a request to leave
	// (its cells kept where they are) and step no more until then.
	RoomWait
	// RoomSwapped: request ID's cells were moved to host memory; it waits
	// like RoomWait and its next step brings them back.
	RoomSwapped
	// RoomPreempt: request ID must give its cells up (Release) and
	// recompute them later; they could not be moved.
	RoomPreempt
	// RoomNone: nothing can make room for request ID, alone in the batch;
	// Returning tells whether its cells are out of the compute cache
	// (llama.cpp brings them back only into one run of free cells, and
	// computing them again in the cache may fit where that did not).
	RoomNone
)

// Room is MakeRoom's decision.
type Room struct {
	Action    RoomAction
	ID        string
	Returning bool
}

// MakeRoom decides the next move when the batch of requests batch (in
// span order) did not fit in the KV cache; running are all the requests
// holding seq ids. The caller carries it out and steps again, until the
// batch fits or is empty. In order:
//
//  1. evict an idle entry whose cells are in the compute cache (a parked
//     one frees no room there);
//  2. a request whose cells are out of the cache (parked) waits, its
//     cells kept, while the rest of the batch steps; of several such
//     requests alone in the batch, the newest waits;
//  3. a request returning alone waits for older requests that hold cells
//     in the cache and still step;
//  4. the newest request holding cells in the cache gives them up: to host
//     memory if they can go (Swap), else it is preempted;
//  5. nothing left: RoomNone.
func (o *Owner) MakeRoom(batch []string, running []Holder) Room {
	if o.EvictForRoom("kv_full") {
		return Room{Action: RoomEvicted}
	}
	var kept, returning []string
	for _, id := range batch {
		if o.parked(id) {
			returning = append(returning, id)
		} else {
			kept = append(kept, id)
		}
	}
	switch {
	case len(kept) > 0 && len(returning) > 0:
		return Room{Action: RoomWait, ID: returning[len(returning)-1]}
	case len(kept) == 0 && len(batch) > 1:
		return Room{Action: RoomWait, ID: newestOf(running, batch, nil)}
	}
	inCache := func(h Holder) bool { return !o.parked(h.ID) }
	victim := newestOf(running, nil, inCache)
	if len(kept) == 0 && victim != "" && admitted(running, victim).Before(admitted(running, batch[0])) && othersStep(running, batch[0]) {
		return Room{Action: RoomWait, ID: batch[0]}
	}
	if victim == "" {
		victim = newestOf(running, nil, nil) // nothing holds cells in the cache
	}
	if victim == "" || (len(batch) == 1 && victim == batch[0] && len(running) == 1) {
		return Room{Action: RoomNone, ID: batch[0], Returning: len(kept) == 0}
	}
	if o.Swap(victim) {
		return Room{Action: RoomSwapped, ID: victim}
	}
	return Room{Action: RoomPreempt, ID: victim}
}

// parked tells whether id's cells are out of the compute cache.
func (o *Owner) parked(id string) bool {
	p, ok := o.cells.(Parker)
	e, held := o.books.Get(id)
	return ok && held && p.Parked(e.Seq)
}

// newestOf is the most recently admitted of running, only those in among
// when among is set, only those keep accepts when keep is set; "" if none.
func newestOf(running []Holder, among []string, keep func(Holder) bool) string {
	var best *Holder
	for i := range running {
		h := &running[i]
		if among != nil && !contains(among, h.ID) || keep != nil && !keep(*h) {
			continue
		}
		if best == nil || !h.Admitted.Before(best.Admitted) {
			best = h
		}
	}
	if best == nil {
		return ""
	}
	return best.ID
}

func admitted(running []Holder, id string) time.Time {
	for _, h := range running {
		if h.ID == id {
			return h.Admitted
		}
	}
	return time.Time{}
}

// othersStep tells whether a request other than id steps without waiting.
func othersStep(running []Holder, id string) bool {
	for _, h := range running {
		if h.ID != id && h.Steps {
			return true
		}
	}
	return false
}

// cellCounter is implemented by Cells that count their used cells (shared
// cells once, parked ones not at all).
type cellCounter interface{ UsedCells() int }

// UsedCells is how many KV cells some sequence holds in the compute cache:
// the engine's count when it keeps one, else the entries' tokens.
func (o *Owner) UsedCells() int {
	if cc, ok := o.cells.(cellCounter); ok {
		return cc.UsedCells()
	}
	return int(o.books.Items())
}
