package llama

/*
#include <stddef.h>
#include <stdint.h>

// llama.cpp's state API, which the ollama binding does not wrap; the symbols
// are in the binary through that package's cgo objects.
struct llama_context;
size_t   llama_state_seq_get_size(struct llama_context * ctx, int32_t seq_id);
size_t   llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, int32_t seq_id);
size_t   llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, int32_t dest_seq_id);
int32_t  llama_kv_self_seq_pos_max(struct llama_context * ctx, int32_t seq_id);
void     llama_kv_self_defrag(struct llama_context * ctx);
void     llama_kv_self_update(struct llama_context * ctx);
uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);
int32_t  llama_kv_self_used_cells(const struct llama_context * ctx);

// llama.cpp's debugging view of the KV cache (llama.h of the pinned
// version), for cellExtent.
struct llama_kv_cache_view_cell { int32_t pos; };
struct llama_kv_cache_view {
	int32_t n_cells, n_seq_max, token_count, used_cells, max_contiguous, max_contiguous_idx;
	struct llama_kv_cache_view_cell * cells;
	int32_t * cells_sequences;
};
struct llama_kv_cache_view llama_kv_cache_view_init(const struct llama_context * ctx, int32_t n_seq_max);
void llama_kv_cache_view_free(struct llama_kv_cache_view * view);
void llama_kv_cache_view_update(const struct llama_context * ctx, struct llama_kv_cache_view * view);

// cell_extent reports the used cells and one past the highest used cell.
static void cell_extent(struct llama_context * ctx, int32_t * used, int32_t * top) {
	struct llama_kv_cache_view v = llama_kv_cache_view_init(ctx, 1);
	llama_kv_cache_view_update(ctx, &v);
	*used = 0;
	*top = 0;
	for (int32_t i = 0; i < v.n_cells; i++) {
		if (v.cells_sequences[i] >= 0) {
			(*used)++;
			*top = i + 1;
		}
	}
	llama_kv_cache_view_free(&v);
}
*/
import "C"

import (
	"fmt"
	"unsafe"

	ll "github.com/ollama/ollama/llama"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

// Parking moves an idle sequence's cells out of llama.cpp's unified KV cache
// into host memory (llama_state_seq_get_data) and back when it is used
// again (llama_state_seq_set_data). Why: llama.cpp attends over every used
// cell of the unified cache up to the highest one and masks out the other
// sequences' cells, so cached conversations slow every prefill down — the
// plain kernel pays for each masked cell like for a real one, and the flash
// attention kernel, which skips them, is itself ~1.6× slower than the plain
// one on this CPU (docs/worker.md "A crowded KV cache"). With idle entries
// parked, only running sequences share the cache and the plain kernel runs
// uncrowded. The bytes are the same K and V values, so output is unchanged.
//
// A parked sequence is restored lazily: Step restores the sequences of its
// spans, Copy from a parked sequence into an empty one only records that the
// destination will be restored from the same bytes (cut to its length), and
// Remove cuts or drops the record. So taking a parked entry over or adopting
// its prefix costs one restore, when the new request first computes.
//
// A prefix many sequences share (a document, a system prompt) is held once,
// in the cache and in host memory (docs/worker.md "Seq ids and the KV
// cache"):
//   - restoring: a sequence restored from the same bytes that still holds
//     the cells another one needs lends them (KvCacheSeqCp) instead of a
//     second llama_state_seq_set_data writing a second copy into the cache;
//   - parking: a sequence whose first cells were restored from bytes still
//     parked keeps only its own cells in new bytes, on top of those (its
//     root). Restoring it sets its own bytes and shares the root's cells
//     from a sequence that holds them, or restores the root into the
//     engine's scratch sequence for the moment it takes to share them.
//     Sequences that share cells computed in the cache (one copied the
//     other's prefix) are related the same way once one of them is parked:
//     its bytes become the others' root for the cells they share (kin).

// hostState is the bytes of one llama_state_seq_get_data: a sequence's
// cells from a position on, up to position to. They are host memory while a
// parked record holds them (refs); restored sequences point to their root
// for identity.
type hostState struct {
	bytes []byte
	to    int
	refs  int
}

// parked is a sequence held in host memory: positions [0, n), of which
// [0, min(n, k)) are root's cells and the rest tail's.
type parked struct {
	root *hostState // from 0
	k    int
	tail *hostState // from k; nil when n <= k
	n    int
}

// restoredFrom is a sequence in the KV cache whose cells [0, n) are
// positions [0, n) of root.
type restoredFrom struct {
	root *hostState
	n    int
}

type rawCtx = *C.struct_llama_context

// checkedContext is lc's llama_context, checked against the n_ctx and
// n_seq_max it was created with before it is trusted.
func checkedContext(lc *ll.Context, nCtx, nSeq int) (rawCtx, error) {
	raw := rawContext(lc)
	if raw == nil || int(C.llama_n_ctx(raw)) != nCtx || int(C.llama_n_seq_max(raw)) != nSeq {
		return nil, fmt.Errorf("llama: the binding's context is not the expected llama_context (ollama/llama changed?)")
	}
	return raw, nil
}

// rawContext is the llama_context pointer of the binding's Context, its first
// field (ollama v0.11.4 llama/llama.go: `type Context struct { c
// *C.struct_llama_context; numThreads int }`).
func rawContext(lc *ll.Context) rawCtx {
	return *(**C.struct_llama_context)(unsafe.Pointer(lc))
}

// initPark turns parking on. The context has one seq id more than the
// engine serves (nSeq): the scratch sequence.
func (e *Engine) initPark(nSeq int) {
	e.scratch = nSeq
	e.parked = map[int]*parked{}
	e.restored = map[int]restoredFrom{}
	e.kin = map[int]map[int]int{}
	e.lost = map[int]bool{}
}

// Park implements kvcache.Parker: seq's cells leave the KV cache for host
// memory. Without parking (Config.NoPark) it does nothing.
func (e *Engine) Park(seq int) {
	if e.parked == nil || e.parked[seq] != nil {
		return
	}
	root, k, n := e.parkPlan(seq)
	if n <= 0 {
		return
	}
	p := &parked{root: root, k: k, n: n}
	if root == nil || k < n {
		st := e.capture(seq, k, n)
		if st == nil {
			return // llama.cpp logged why; the cells simply stay in the cache
		}
		if root == nil {
			p.root, p.k = st, n
			e.adoptKin(seq, st)
		} else {
			p.tail = st
		}
	}
	e.cutRecords(seq, 0)
	e.lc.KvCacheSeqRm(seq, 0, -1)
	e.holes = true
	e.setParked(seq, p)
}

// link records that a and b share their first n cells (b a copy of a's
// prefix), and so b shares with a's other kin as much of it as they do.
func (e *Engine) link(a, b, n int) {
	if n <= 0 || a == b {
		return
	}
	set := func(x, y, n int) {
		if e.kin[x] == nil {
			e.kin[x] = map[int]int{}
		}
		e.kin[x][y] = n
	}
	for k, m := range e.kin[a] {
		if k != b {
			set(b, k, min(m, n))
			set(k, b, min(m, n))
		}
	}
	set(a, b, n)
	set(b, a, n)
}

// cutRecords records that seq lost its cells from position from on: what it
// holds of its root and shares with its kin ends there.
func (e *Engine) cutRecords(seq, from int) {
	if r, ok := e.restored[seq]; ok {
		if from <= 0 {
			delete(e.restored, seq)
		} else if from < r.n {
			e.restored[seq] = restoredFrom{root: r.root, n: from}
		}
	}
	for k, m := range e.kin[seq] {
		if m <= from {
			continue
		}
		if from <= 0 {
			delete(e.kin[k], seq)
			delete(e.kin[seq], k)
			if len(e.kin[k]) == 0 {
				delete(e.kin, k)
			}
		} else {
			e.kin[k][seq], e.kin[seq][k] = from, from
		}
	}
	if len(e.kin[seq]) == 0 {
		delete(e.kin, seq)
	}
}

// adoptKin makes seq's new bytes the root of the cells its kin share with
// it, for kin with no longer root of their own: parked later, they keep only
// the rest, and restored, they share those cells instead of a second copy.
func (e *Engine) adoptKin(seq int, st *hostState) {
	for k, m := range e.kin[seq] {
		if e.parked[k] != nil || e.lost[k] {
			continue
		}
		if r, ok := e.restored[k]; ok && r.root.refs > 0 && r.n >= m {
			continue
		}
		e.restored[k] = restoredFrom{root: st, n: m}
	}
}

// parkPlan is how seq (n cells) would be parked: on root's first k cells,
// its own bytes holding the rest; root nil when it holds bytes of its own
// from 0 (k = 0).
func (e *Engine) parkPlan(seq int) (root *hostState, k, n int) {
	n = int(C.llama_kv_self_seq_pos_max(e.raw, C.int32_t(seq))) + 1
	if r, ok := e.restored[seq]; ok && r.root.refs > 0 && r.n > 0 {
		return r.root, min(r.n, n), n
	}
	return nil, 0, n
}

// capture takes seq's cells at positions [from, to) into host bytes: all
// of seq directly, a range through the scratch sequence (the cells are
// shared into it, not copied).
func (e *Engine) capture(seq, from, to int) *hostState {
	src := e.scratchRange(seq, from, to)
	defer e.clearScratch(src)
	return stateOf(e.raw, src, to)
}

// stateOf is all of seq's cells in ctx as host bytes, which end at
// position to; nil when llama.cpp could not write them (it logs why).
func stateOf(ctx rawCtx, seq, to int) *hostState {
	size := C.llama_state_seq_get_size(ctx, C.int32_t(seq))
	buf := make([]byte, int(size))
	got := C.llama_state_seq_get_data(ctx, (*C.uint8_t)(unsafe.Pointer(&buf[0])), size, C.int32_t(seq))
	if got == 0 {
		return nil
	}
	return &hostState{bytes: buf[:got], to: to}
}

// scratchRange is the sequence holding exactly seq's cells [from, to): seq
// itself when that is all of it, else the scratch sequence.
func (e *Engine) scratchRange(seq, from, to int) int {
	if from == 0 {
		return seq
	}
	e.lc.KvCacheSeqRm(e.scratch, 0, -1)
	e.lc.KvCacheSeqCp(seq, e.scratch, from, to)
	return e.scratch
}

func (e *Engine) clearScratch(seq int) {
	if seq == e.scratch {
		e.lc.KvCacheSeqRm(e.scratch, 0, -1)
	}
}

// ParkBytes implements kvcache.ParkBudget: the host memory evicting seq
// would free if it is parked (the bytes no other record holds), or parking
// it now would take (llama.cpp's state size of the cells it would keep: K
// and V plus a few bytes of cell metadata per token, and a short header).
func (e *Engine) ParkBytes(seq int) int64 {
	if e.parked == nil {
		return 0
	}
	if p := e.parked[seq]; p != nil {
		var n int64
		for _, h := range []*hostState{p.root, p.tail} {
			if h != nil && h.refs == 1 {
				n += int64(len(h.bytes))
			}
		}
		return n
	}
	root, k, n := e.parkPlan(seq)
	if root != nil && k >= n {
		return 0
	}
	src := e.scratchRange(seq, k, n)
	defer e.clearScratch(src)
	return int64(C.llama_state_seq_get_size(e.raw, C.int32_t(src)))
}

// ParkLimit implements kvcache.ParkBudget: the bound on ParkedBytes
// (Config.ParkMaxBytes).
func (e *Engine) ParkLimit() int64 { return e.parkLimit }

// Parked reports whether seq's cells are in host memory, not in the KV
// cache (evicting it frees no cells).
func (e *Engine) Parked(seq int) bool { return e.parked[seq] != nil }

// ParkedBytes is the host memory parked sequences take, each state once
// however many records share it. Safe for concurrent use (metrics read it).
func (e *Engine) ParkedBytes() int64 { return e.parkedBytes.Load() }

// UsedCells is how many cells of the KV cache some sequence holds, shared
// cells once (llama_kv_self_used_cells): the KV use the pod reports, which
// an entry-by-entry count would overstate by every shared prefix. Loop
// goroutine only.
func (e *Engine) UsedCells() int { return int(C.llama_kv_self_used_cells(e.raw)) }

func (e *Engine) hold(h *hostState) {
	if h == nil {
		return
	}
	if h.refs == 0 {
		e.parkedBytes.Add(int64(len(h.bytes)))
	}
	h.refs++
}

func (e *Engine) unhold(h *hostState) {
	if h == nil {
		return
	}
	if h.refs--; h.refs == 0 {
		e.parkedBytes.Add(-int64(len(h.bytes)))
		h.bytes = nil // gone with the last record; restored sequences keep only the identity
	}
}

// setParked makes p seq's record, holding its states before letting the
// old record's go (they may be the same).
func (e *Engine) setParked(seq int, p *parked) {
	e.hold(p.root)
	e.hold(p.tail)
	e.forget(seq)
	e.parked[seq] = p
}

func (e *Engine) forget(seq int) {
	if p := e.parked[seq]; p != nil {
		e.unhold(p.root)
		e.unhold(p.tail)
		delete(e.parked, seq)
	}
}

// cut is p holding positions [0, n) only.
func (p *parked) cut(n int) *parked {
	if n >= p.n {
		return p
	}
	if n <= p.k {
		return &parked{root: p.root, k: n, n: n}
	}
	return &parked{root: p.root, k: p.k, tail: p.tail, n: n}
}

// restore brings a parked seq back into the KV cache; ErrKVFull when there
// is no contiguous room even after a defragmentation (it stays parked).
func (e *Engine) restore(seq int) error {
	if e.lost[seq] {
		return fmt.Errorf("%w: seq %d lost cells it shared while the cache was full", engine.ErrKVFull, seq)
	}
	p := e.parked[seq]
	if p == nil {
		return nil
	}
	k := min(p.n, p.k)
	withTail := p.tail != nil && p.n > p.k
	if withTail {
		// The tail first: setting a sequence's state clears it.
		if !e.set(seq, p.tail) {
			return fmt.Errorf("%w: restoring seq %d (%d cells)", engine.ErrKVFull, seq, p.tail.to-p.k)
		}
		e.cutTo(seq, p.tail.to, p.n)
	}
	twin, m := e.twin(p.root, k)
	if m > 0 {
		e.lc.KvCacheSeqCp(twin, seq, 0, m)
	}
	if m < k {
		// The rest of the root's cells come from its bytes: set straight
		// into seq when nothing else is there, else into the scratch
		// sequence and shared from it.
		dst := seq
		if withTail || m > 0 {
			dst = e.scratch
		}
		if !e.set(dst, p.root) {
			e.lc.KvCacheSeqRm(seq, 0, -1)
			return fmt.Errorf("%w: restoring seq %d (%d cells)", engine.ErrKVFull, seq, p.root.to)
		}
		if dst == e.scratch {
			e.lc.KvCacheSeqCp(dst, seq, m, k)
			e.lc.KvCacheSeqRm(dst, 0, -1)
			e.holes = true
		} else {
			e.cutTo(seq, p.root.to, k)
		}
	}
	e.forget(seq)
	e.restored[seq] = restoredFrom{root: p.root, n: k}
	return nil
}

// set writes h's cells into seq (clearing it), defragmenting once if
// there is no contiguous room: llama_state_seq_set_data needs one run of
// free cells, and unlike decode it does not defragment by itself.
func (e *Engine) set(seq int, h *hostState) bool {
	try := func() bool {
		return C.llama_state_seq_set_data(e.raw, (*C.uint8_t)(unsafe.Pointer(&h.bytes[0])), C.size_t(len(h.bytes)), C.int32_t(seq)) != 0
	}
	if try() {
		return true
	}
	C.llama_kv_self_defrag(e.raw)
	C.llama_kv_self_update(e.raw)
	return try()
}

// cutTo drops seq's cells from n when it holds more (up to full).
func (e *Engine) cutTo(seq, full, n int) {
	if n < full {
		e.lc.KvCacheSeqRm(seq, n, -1)
		e.holes = true
	}
}

// twin is the sequence in the KV cache holding most of root's first n
// cells (restored from root, or sharing cells computed in the cache with
// the sequence that was parked as root), and how many; -1, 0 for none.
func (e *Engine) twin(root *hostState, n int) (seq, held int) {
	seq = -1
	for s, r := range e.restored {
		if r.root != root || e.parked[s] != nil || e.lost[s] {
			continue
		}
		if m := min(r.n, n); m > held || (m == held && m > 0 && s < seq) {
			seq, held = s, m
		}
	}
	return seq, held
}

// copyParked handles Copy when src or dst is parked (or dst lost cells).
func (e *Engine) copyParked(src, dst, from, to int) {
	if e.lost[dst] {
		return
	}
	p := e.parked[src]
	if p != nil && from == 0 && e.parked[dst] == nil {
		// dst holds nothing yet: it is src's record cut to [0, to).
		e.cutRecords(dst, 0)
		e.setParked(dst, p.cut(to))
		return
	}
	// Rare (a parked sequence shared from the middle, or into a parked
	// one): both must be in the cache for llama.cpp to tag the cells.
	if err := e.restore(dst); err != nil {
		e.lost[dst] = true
		return
	}
	if p != nil {
		// src goes back to host memory afterwards, its record unchanged;
		// holding its states keeps them while it is in the cache.
		e.hold(p.root)
		e.hold(p.tail)
		defer func() { e.unhold(p.root); e.unhold(p.tail) }()
		if err := e.restore(src); err != nil {
			e.lost[dst] = true
			return
		}
		e.lc.KvCacheSeqCp(src, dst, from, to)
		e.lc.KvCacheSeqRm(src, 0, -1)
		e.cutRecords(src, 0)
		e.setParked(src, p)
		return
	}
	e.lc.KvCacheSeqCp(src, dst, from, to)
}

// removeParked handles Remove of a parked or lost seq; false if seq is
// neither.
func (e *Engine) removeParked(seq, from int) bool {
	if from <= 0 {
		delete(e.lost, seq)
	}
	p := e.parked[seq]
	if p == nil {
		return false
	}
	if from <= 0 {
		e.forget(seq)
	} else {
		e.setParked(seq, p.cut(from))
	}
	return true
}

// compactCells asks llama.cpp to move cells down into the holes that
// removals left, before the next decode. Why: the plain attention kernel
// multiplies every new token against every cell up to the highest used one
// (llama-kv-cache.cpp, find_slot: n = cell_max()), so a running sequence
// whose cells sit above a parked or finished one's pays for the hole as if
// it were full. llama-server defragments at 10% holes (common's
// defrag_thold 0.1); the binding's default context parameters turn that
// off and do not expose it, so the engine looks after every removal. A
// defragmentation moves as many cells as there are holes below the
// highest used cell.
func (e *Engine) compactCells() {
	if !e.holes || !e.compact {
		return
	}
	e.holes = false
	if used, top := e.cellExtent(); top > used {
		C.llama_kv_self_defrag(e.raw)
	}
}

// cellExtent is how many cells of the KV cache are used and one past the
// highest used one — the cells every new token attends over. It copies
// llama.cpp's view of every cell (n_ctx × 8 bytes), so it runs only after
// removals.
func (e *Engine) cellExtent() (used, top int) {
	var u, t C.int32_t
	C.cell_extent(e.raw, &u, &t)
	return int(u), int(t)
}
