package scheduler

import "fmt"

// phase is where a request is between Submit and its end: one value per
// request instead of flags, so that what it may do next is read off one
// switch (docs/worker.md, "Request life"):
//
//	queued ──admit──▶ pending ──bind──▶ following ──leader wrote the prefix──▶ prefilling
//	                     ▲                  └────────(nothing to follow)─────────▲ │
//	                     │                                                         │ prompt written,
//	                     └──preempted (KV full, cells dropped)── prefilling/decoding ◀┘ first token
//	                                                                   │   ▲
//	                             swappedOut / waitingRoom ◀─KV full────┘   └─a request left
//	prefilling ──client left──▶ filling ──prompt written, or requests queue──▶ ended
//
// Every phase but queued and ended is in the running set; pending holds no
// seq id, the others one.
type phase int

const (
	// queued: in the RequestQueue, waiting for the running set (State QUEUED).
	queued phase = iota
	// pending: in the running set, waiting for a seq id (State PENDING); a
	// preempted request comes back here and waits for a request to leave.
	pending
	// following: holds a seq id and waits for a running leader to write
	// the prefix it shares; it takes the leader's cells, computes nothing.
	following
	// prefilling: evaluates its prompt (after a preemption, prompt and
	// output) in chunks.
	prefilling
	// decoding: generates, one token per step.
	decoding
	// swappedOut: its cells moved to host memory to make room; out of the
	// steps until a request leaves, then they come back with its next step.
	swappedOut
	// waitingRoom: its cells (in host memory) did not fit back into the
	// KV cache; out of the steps until a request leaves.
	waitingRoom
	// filling: its client left during the prefill; it goes on writing its
	// prompt for a retry to find, samples nothing, and ends CANCELLED.
	filling
	// ended: a final State was published.
	ended
)

func (p phase) String() string {
	switch p {
	case queued:
		return "queued"
	case pending:
		return "pending"
	case following:
		return "following"
	case prefilling:
		return "prefilling"
	case decoding:
		return "decoding"
	case swappedOut:
		return "swapped-out"
	case waitingRoom:
		return "waiting-for-room"
	case filling:
		return "filling"
	case ended:
		return "ended"
	}
	return fmt.Sprintf("phase(%d)", int(p))
}

// holdsSeq tells whether a request in phase p holds a seq id (and so a KV
// entry).
func (p phase) holdsSeq() bool { return p >= following && p <= filling }

// waits tells whether p waits for a request to leave the running set
// (task.after) before it steps again.
func (p phase) waits() bool { return p == swappedOut || p == waitingRoom }

// state is the public State of a request in phase p, short of its end.
func (p phase) state() State {
	switch p {
	case queued:
		return Queued
	case pending:
		return Pending
	}
	return Processing
}

// resume is the phase of a request with cells that steps again (after
// binding, following, or waiting for room): decoding once it has generated
// and only its last token is left, else prefilling.
func (t *task) resume() {
	if t.nGen > 0 && len(t.toks)-t.past == 1 {
		t.phase = decoding
	} else {
		t.phase = prefilling
	}
}
