package kvcache

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/seqpool"
)

// Cells is the part of the compute engine whose state the Owner keeps in
// step with its books: llama.cpp's unified KV cache, where a cell is tagged
// with the seq ids that use it.
type Cells interface {
	// Copy shares src's cells at positions [from, to) into dst, which holds
	// exactly positions [0, from) of the same tokens. No compute, no copy.
	Copy(src, dst, from, to int)
	// Remove drops seq's cells at positions >= from.
	Remove(seq, from int)
}

// Reports receives what the router's cache index must learn. Both are
// called from the owner's goroutine and must not block.
type Reports interface {
	// Evicted: no entry holds these prompt hashes any more.
	Evicted(hs []prefix.Hash)
	// Cached: an entry holds these hashes again, superseding any eviction
	// of them not sent yet (otherwise a late report, retried after an
	// outage, would delete the index entry the gateway just saved).
	Cached(hs []prefix.Hash)
}

// TimedReports is Reports that also wants to know when an eviction
// happened: the metadata center removes only entries saved before it, so
// a report that arrives late (retried after an outage) never removes a
// newer save (docs/metadata-center.md, "Versions"). The Owner calls
// EvictedAt instead of Evicted when its Reports implements it.
type TimedReports interface {
	Reports
	EvictedAt(hs []prefix.Hash, at time.Time)
}

// Errors of Bind.
var (
	ErrNoSeq = errors.New("kvcache: every seq id is held by a running request")
	ErrInUse = errors.New("kvcache: request id is already in use")
)

// OwnerConfig builds an Owner.
type OwnerConfig struct {
	Limits  Limits
	NSeqMax int
	Cells   Cells
	Reports Reports // optional
	// OnEvict counts an entry evicted to make room ("seq_ids", "kv_full",
	// "threshold"); optional.
	OnEvict func(cause string)
}

// Owner is the one owner of the KV state: seq ids (seqpool), the cells
// under them (Cells), the books of entries (Manager) and what the router is
// told. Each method performs one transition whole — bind a request
// (adopting a cached prefix by taking an entry over or copying its cells,
// or following a prefix still being written), catch a follower up, record
// written tokens, finish, release, evict — so that the invariant "a seq id
// is free, or held by exactly one entry whose Tokens are exactly its cells"
// is kept in one place, as Ollama's runner keeps it in its InputCache.
//
// Like the Manager it is owned by one goroutine.
type Owner struct {
	books   *Manager
	pool    *seqpool.Pool
	cells   Cells
	reports Reports
	onEvict func(string)
}

// NewOwner validates cfg.
func NewOwner(cfg OwnerConfig) (*Owner, error) {
	if cfg.Cells == nil {
		return nil, errors.New("kvcache: owner without cells")
	}
	books, err := New(cfg.Limits)
	if err != nil {
		return nil, err
	}
	pool, err := seqpool.New(cfg.NSeqMax)
	if err != nil {
		return nil, err
	}
	return &Owner{books: books, pool: pool, cells: cfg.Cells, reports: cfg.Reports, onEvict: cfg.OnEvict}, nil
}

// Books are the entries, for reading (metrics, inspection, tests).
func (o *Owner) Books() *Manager { return o.books }

// Pool is the seq-id pool, for reading.
func (o *Owner) Pool() *seqpool.Pool { return o.pool }

// Bound is how a request was bound.
type Bound struct {
	Seq    int
	Reused int    // prompt tokens whose cells it holds already
	From   string // entry the cells came from ("" for none)
	// Leader is a running request whose prompt shares more with this one
	// than any cells written so far: the bound request waits for it to
	// write them (Follow) instead of computing them again.
	Leader string
	// ShareTo is how far the leader's cells will be shared.
	ShareTo int
}

// Bind gives request id a seq id for a prompt of toks and records it as a
// running entry holding whatever it could adopt:
//   - the entry with the longest common token prefix n (idle or running:
//     written cells never change) lends min(n, len(toks)-1) cells — the last
//     prompt token is always evaluated, its logits pick the first output;
//   - an idle entry that is wholly a prefix of toks (a conversation's next
//     turn), or the only thing that could make room, is taken over: same
//     seq id, its divergent tail removed, the old entry gone;
//   - otherwise its cells are shared into a fresh seq id and it stays;
//   - a running request still prefilling a longer common prefix becomes
//     the leader: the new request follows it (see Follow).
//
// Idle entries are evicted when no seq id is free; ErrNoSeq means every id
// is held by a running request and the caller waits.
func (o *Owner) Bind(id string, toks []int, hashes []prefix.Hash) (Bound, error) {
	if len(toks) == 0 {
		return Bound{}, errors.New("kvcache: empty prompt")
	}
	if _, dup := o.books.Get(id); dup {
		return Bound{}, fmt.Errorf("%w: %q", ErrInUse, id)
	}
	last := len(toks) - 1
	e, n := o.books.Match(toks)
	reuse := min(n, last)
	var b Bound
	switch {
	case e != nil && reuse > 0 && !e.InUse && (n == len(e.Tokens) || (o.pool.Free() == 0 && o.books.Idle() == 1)):
		b.Seq = e.Seq
		o.cells.Remove(e.Seq, reuse)
		if _, err := o.pool.Transfer(e.ID, id); err != nil {
			return Bound{}, err
		}
		// The new entry first: hashes both hold are never reported.
		o.add(id, e.Seq, toks[:reuse], hashes)
		_, freed := o.books.Remove(e.ID)
		o.evicted(freed)
	case e != nil && reuse > 0:
		e = o.copySource(e, toks[:reuse])
		seq, err := o.acquire(id, e.ID)
		if err != nil {
			return Bound{}, err
		}
		b.Seq = seq
		o.cells.Copy(e.Seq, seq, 0, reuse)
		o.books.Touch(e.ID)
		o.add(id, seq, toks[:reuse], hashes)
	default:
		reuse = 0
		seq, err := o.acquire(id)
		if err != nil {
			return Bound{}, err
		}
		b.Seq = seq
		o.add(id, seq, nil, hashes)
	}
	if reuse > 0 {
		b.From = e.ID
	}
	me, _ := o.books.Get(id)
	me.planned = slices.Clone(toks)
	o.lead(me)
	b.Reused, _ = o.Follow(id)
	b.Leader, b.ShareTo = me.leader, me.shareTo
	return b, nil
}

// copySource is the entry whose cells a request copies toks from: the
// match e, unless e is parked and another entry holding toks has them in
// the compute cache (a running request, or an idle entry left unparked) or
// is running (its restore is about to put them there, and a copy of it
// restores from the same bytes, which the cells share). Copying e would
// restore a second copy of cells the cache already holds: with questions
// about one document the parked match is usually the last question
// finished, while the one still running holds the document.
func (o *Owner) copySource(e *Entry, toks []int) *Entry {
	p, ok := o.cells.(Parker)
	if !ok || !p.Parked(e.Seq) {
		return e
	}
	rank := func(x *Entry) int {
		switch {
		case !p.Parked(x.Seq):
			return 2
		case x.InUse:
			return 1
		}
		return 0
	}
	best, bestRank := e, 0
	for _, x := range o.books.entries {
		if x == e || commonPrefix(x.Tokens, toks) < len(toks) {
			continue
		}
		if r := rank(x); r > bestRank || (r == bestRank && r > 0 && x.Seq < best.Seq) {
			best, bestRank = x, r
		}
	}
	return best
}

func (o *Owner) add(id string, seq int, toks []int, hashes []prefix.Hash) {
	// Cannot fail: the id was checked by Bind and the owner is the only writer.
	_ = o.books.Add(&Entry{ID: id, Seq: seq, Tokens: slices.Clone(toks), Hashes: hashes, InUse: true})
	if len(hashes) > 0 && o.reports != nil {
		o.reports.Cached(hashes)
	}
}

// Append records tokens whose cells id just wrote after its last one.
func (o *Owner) Append(id string, toks ...int) { o.books.Append(id, toks...) }

// Finish turns id's running entry into an idle cache entry: its cells stay
// under its seq id for later requests. Its followers take what they share.
func (o *Owner) Finish(id string) {
	fs := o.abdicate(id)
	if e, ok := o.books.Get(id); ok {
		e.planned = nil
	}
	o.books.SetInUse(id, false)
	o.relead(fs)
	// After relead: the followers have taken what they share.
	if e, ok := o.books.Get(id); ok {
		o.park(e)
	}
}

// Keep turns id's running entry into an idle cache entry as Finish does,
// for a request that ended early (its client left, its time ran out): the
// cells it wrote stay for the request that retries it, as vLLM's prefix
// cache and SGLang's radix cache keep an aborted request's blocks. A
// follower first takes what its leader wrote. An entry holding fewer cells
// than the prompt's tokens gives up the prompt's hashes (reported
// evicted where no other entry holds them): the router indexes whole
// prompts, and must not send this prompt here on the strength of part of
// it. An entry with no cells is released.
func (o *Owner) Keep(id string, prompt int) {
	e, ok := o.books.Get(id)
	if !ok {
		return
	}
	if e.leader != "" {
		o.Follow(id)
		e.leader, e.shareTo = "", 0
	}
	if len(e.Tokens) == 0 {
		o.Release(id)
		return
	}
	if len(e.Tokens) < prompt {
		o.evicted(o.books.SetHashes(id, nil))
	}
	o.Finish(id)
}

// Release drops id's cells and frees its seq id (a request that failed,
// timed out, was cancelled or preempted). Its followers first take what
// they share.
func (o *Owner) Release(id string) {
	if _, ok := o.books.Get(id); !ok {
		return
	}
	fs := o.abdicate(id)
	o.drop(id)
	o.relead(fs)
}

func (o *Owner) drop(id string) {
	e, _ := o.books.Get(id)
	o.cells.Remove(e.Seq, 0)
	o.pool.Release(id)
	_, freed := o.books.Remove(id)
	o.evicted(freed)
}

func (o *Owner) evicted(hs []prefix.Hash) {
	if len(hs) == 0 || o.reports == nil {
		return
	}
	if tr, ok := o.reports.(TimedReports); ok {
		tr.EvictedAt(hs, time.Now()) // now: the cells are gone this very moment
		return
	}
	o.reports.Evicted(hs)
}

// Unbound reports, of the prompt hashes of a request that leaves without
// ever having been bound (cancelled or timed out in the queue), those no
// entry holds, as evicted now. The router saved them on this pod when it
// routed the request here; the gateway withdraws that save when the
// request fails, but a gateway that died with the request in flight never
// will, and nothing else would tell the index that this pod does not hold
// them (docs/operations.md, "Chaos and soak"). The caller leaves out hashes that other requests
// waiting here carry: their own routing-time saves stay.
func (o *Owner) Unbound(hs []prefix.Hash) {
	var gone []prefix.Hash
	for _, h := range hs {
		if o.books.Refs(h) == 0 {
			gone = append(gone, h)
		}
	}
	o.evicted(gone)
}

// acquire takes a free seq id for owner, evicting idle entries (other than
// keep) while none is free.
func (o *Owner) acquire(owner string, keep ...string) (int, error) {
	for {
		seq, err := o.pool.Acquire(owner)
		if err == nil {
			o.cells.Remove(seq, 0)
			return seq, nil
		}
		if !errors.Is(err, seqpool.ErrExhausted) {
			return -1, err
		}
		if !o.evictOne("seq_ids", keep...) {
			return -1, ErrNoSeq
		}
	}
}

// EvictOne evicts the next idle entry (Manager.Victim's choice); false when
// there is none.
func (o *Owner) EvictOne(cause string) bool { return o.evictOne(cause) }

func (o *Owner) evictOne(cause string, keep ...string) bool {
	v := o.books.Victim(keep...)
	if v == nil {
		return false
	}
	fs := o.abdicate(v.ID)
	o.drop(v.ID)
	o.relead(fs)
	if o.onEvict != nil {
		o.onEvict(cause)
	}
	return true
}

// EvictForRoom evicts the next idle entry whose cells are in the compute
// cache (all idle entries when the cells cannot be parked): evicting a
// parked one would free no cells for a batch that did not fit. False when
// there is none.
func (o *Owner) EvictForRoom(cause string) bool {
	p, ok := o.cells.(Parker)
	if !ok {
		return o.evictOne(cause)
	}
	var keep []string
	for _, e := range o.books.entries {
		if !e.InUse && p.Parked(e.Seq) {
			keep = append(keep, e.ID)
		}
	}
	return o.evictOne(cause, keep...)
}

// EvictOverThreshold evicts idle entries in Victim order until usage is
// back under the threshold or nothing idle is left.
func (o *Owner) EvictOverThreshold(cause string) {
	for o.books.OverThreshold() && o.evictOne(cause) {
	}
}

// Holds reports whether id has an entry (and so a seq id).
func (o *Owner) Holds(id string) bool {
	_, ok := o.books.Get(id)
	return ok
}

// Check verifies the invariant between pool and books: every held seq id
// belongs to exactly one entry of the same id and seq, and followers
// follow running entries. Tests call it after every transition.
func (o *Owner) Check() error {
	if o.pool.InUse() != o.books.Len() {
		return fmt.Errorf("kvcache: %d seq ids held, %d entries", o.pool.InUse(), o.books.Len())
	}
	seen := map[int]string{}
	for _, e := range o.books.entries {
		seq, ok := o.pool.Lookup(e.ID)
		if !ok || seq != e.Seq {
			return fmt.Errorf("kvcache: entry %q on seq %d, pool says %d (%v)", e.ID, e.Seq, seq, ok)
		}
		if other, dup := seen[seq]; dup {
			return fmt.Errorf("kvcache: seq %d held by %q and %q", seq, other, e.ID)
		}
		seen[seq] = e.ID
		if e.leader != "" {
			l, ok := o.books.Get(e.leader)
			if !ok || !l.InUse || l.leader != "" {
				return fmt.Errorf("kvcache: %q follows %q, which is not a running leader", e.ID, e.leader)
			}
		}
	}
	return nil
}

// RunningCells is how many KV cells running requests hold in the compute
// cache, a prefix two of them share (copied or followed) counted once and
// parked cells not at all: what vLLM counts as used KV blocks, where idle
// cached cells are free for the taking.
func (o *Owner) RunningCells() int {
	p, _ := o.cells.(Parker)
	var run [][]int
	for _, e := range o.books.entries {
		if e.InUse && (p == nil || !p.Parked(e.Seq)) {
			run = append(run, e.Tokens)
		}
	}
	// The size of their prefix tree: in lexicographic order each entry
	// shares the most with a neighbour.
	slices.SortFunc(run, slices.Compare)
	n := 0
	for i, toks := range run {
		n += len(toks)
		if i > 0 {
			n -= commonPrefix(run[i-1], toks)
		}
	}
	return n
}
