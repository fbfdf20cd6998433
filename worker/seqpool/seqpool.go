// Package seqpool hands out llama.cpp sequence ids and binds each one to the
// owner that holds it.
//
// llama.cpp only accepts seq ids in [0, n_seq_max), while requests are named
// by strings; reusing an id while its previous owner still has cells under it
// corrupts both sequences. The pool makes ownership explicit: an
// id is free, or held by exactly one owner (a running request, or the KV-cache
// entry a finished request left behind), and it only becomes free again when
// that owner releases it.
package seqpool

import (
	"errors"
	"fmt"
	"sync"
)

// MaxSeq is llama.cpp's LLAMA_MAX_SEQ: n_seq_max may not exceed it.
const MaxSeq = 256

// ErrExhausted means every id is held; the caller waits (PENDING) or evicts.
var ErrExhausted = errors.New("seqpool: every sequence id is in use")

// Pool is safe for concurrent use; the scheduler mutates it from its loop and
// /metrics reads it from HTTP goroutines.
type Pool struct {
	mu    sync.Mutex
	free  []int          // LIFO: a just-freed id is reused first, keeping ids low
	owner []string       // seq id -> owner ("" = free)
	byID  map[string]int // owner -> seq id
}

// New returns a pool of n ids, 0..n-1. n must be within 1..MaxSeq, the range
// llama.cpp accepts for n_seq_max.
func New(n int) (*Pool, error) {
	if n < 1 || n > MaxSeq {
		return nil, fmt.Errorf("seqpool: n_seq_max must be within 1..%d, got %d", MaxSeq, n)
	}
	p := &Pool{free: make([]int, 0, n), owner: make([]string, n), byID: make(map[string]int, n)}
	for i := n - 1; i >= 0; i-- {
		p.free = append(p.free, i)
	}
	return p, nil
}

// Acquire binds a free id to owner. An owner holds at most one id: asking
// twice is a bug in the caller and is refused rather than leaking an id.
func (p *Pool) Acquire(owner string) (int, error) {
	if owner == "" {
		return -1, errors.New("seqpool: empty owner")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if s, ok := p.byID[owner]; ok {
		return -1, fmt.Errorf("seqpool: %q already holds seq %d", owner, s)
	}
	if len(p.free) == 0 {
		return -1, ErrExhausted
	}
	s := p.free[len(p.free)-1]
	p.free = p.free[:len(p.free)-1]
	p.owner[s] = owner
	p.byID[owner] = s
	return s, nil
}

// Release frees owner's id and returns it; ok is false if owner held none, so
// releasing twice on two exit paths is harmless.
func (p *Pool) Release(owner string) (seq int, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.byID[owner]
	if !ok {
		return -1, false
	}
	delete(p.byID, owner)
	p.owner[s] = ""
	p.free = append(p.free, s)
	return s, true
}

// Transfer moves from's id to to without freeing it: a finished request's
// cells become a cache entry, or a new request takes a cache entry over.
func (p *Pool) Transfer(from, to string) (int, error) {
	if to == "" {
		return -1, errors.New("seqpool: empty owner")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.byID[from]
	if !ok {
		return -1, fmt.Errorf("seqpool: %q holds no sequence id", from)
	}
	if from == to {
		return s, nil
	}
	if t, ok := p.byID[to]; ok {
		return -1, fmt.Errorf("seqpool: %q already holds seq %d", to, t)
	}
	delete(p.byID, from)
	p.byID[to] = s
	p.owner[s] = to
	return s, nil
}

// Lookup returns the id owner holds.
func (p *Pool) Lookup(owner string) (int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.byID[owner]
	return s, ok
}

// Owner returns who holds seq ("" if free or out of range).
func (p *Pool) Owner(seq int) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if seq < 0 || seq >= len(p.owner) {
		return ""
	}
	return p.owner[seq]
}

// Size is n_seq_max.
func (p *Pool) Size() int { return len(p.owner) }

// InUse counts held ids.
func (p *Pool) InUse() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.byID)
}

// Free counts free ids.
func (p *Pool) Free() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.free)
}
