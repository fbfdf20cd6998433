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
// Several requests adopting one parked prefix (questions about one
// document) restore it once: a sequence restored from the same bytes that
// still holds the cells another one needs lends them (KvCacheSeqCp, shared
// cells) instead of a second llama_state_seq_set_data writing a second copy
// into the cache. A second copy of a 3,000-token prefix is what filled an
// 8,192-cell cache with three such requests and preempted one of them
// (docs/worker.md "Seq ids and the KV cache").

// parked is a sequence held in host memory: its cells are positions [0, n)
// of state, which holds positions [0, full).
type parked struct {
	state []byte
	n     int
	full  int
}

// restoredFrom is a sequence in the KV cache whose cells [0, n) are
// positions [0, n) of a parked state: state is that state's bytes (the
// identity of the parking, shared by every record cut from it).
type restoredFrom struct {
	state []byte
	n     int
}

func sameState(a, b []byte) bool { return unsafe.SliceData(a) == unsafe.SliceData(b) }

type rawCtx = *C.struct_llama_context

// rawContext is the llama_context pointer of the binding's Context, its first
// field (ollama v0.11.4 llama/llama.go: `type Context struct { c
// *C.struct_llama_context; numThreads int }`). Open checks it against the
// context's n_ctx and n_seq_max before trusting it.
func rawContext(lc *ll.Context) rawCtx {
	return *(**C.struct_llama_context)(unsafe.Pointer(lc))
}

// initPark enables parking if the context pointer checks out.
func (e *Engine) initPark(nCtx, nSeq int) error {
	raw := rawContext(e.lc)
	if raw == nil || int(C.llama_n_ctx(raw)) != nCtx || int(C.llama_n_seq_max(raw)) != nSeq {
		return fmt.Errorf("llama: cannot park idle sequences: the binding's context is not the expected llama_context (ollama/llama changed?)")
	}
	e.raw = raw
	e.parked = map[int]*parked{}
	e.restored = map[int]restoredFrom{}
	e.lost = map[int]bool{}
	return nil
}

// Park implements kvcache.Parker: seq's cells leave the KV cache for host
// memory. Without parking (Config.NoPark) it does nothing.
func (e *Engine) Park(seq int) {
	if e.raw == nil || e.parked[seq] != nil {
		return
	}
	n := int(C.llama_kv_self_seq_pos_max(e.raw, C.int32_t(seq))) + 1
	if n <= 0 {
		return
	}
	size := C.llama_state_seq_get_size(e.raw, C.int32_t(seq))
	buf := make([]byte, int(size))
	got := C.llama_state_seq_get_data(e.raw, (*C.uint8_t)(unsafe.Pointer(&buf[0])), size, C.int32_t(seq))
	if got == 0 {
		return // llama.cpp logged why; the cells simply stay in the cache
	}
	e.lc.KvCacheSeqRm(seq, 0, -1)
	e.holes = true
	delete(e.restored, seq)
	e.parked[seq] = &parked{state: buf[:got], n: n, full: n}
	e.parkedBytes.Add(int64(got))
}

// ParkBytes implements kvcache.ParkBudget: the host memory seq takes
// parked, or would take if parked now (llama.cpp's state size of its
// cells: K and V plus a few bytes of cell metadata per token, and a short
// header, which is all an empty sequence would take).
func (e *Engine) ParkBytes(seq int) int64 {
	if e.raw == nil {
		return 0
	}
	if p := e.parked[seq]; p != nil {
		return int64(len(p.state))
	}
	return int64(C.llama_state_seq_get_size(e.raw, C.int32_t(seq)))
}

// ParkLimit implements kvcache.ParkBudget: the bound on ParkedBytes
// (Config.ParkMaxBytes).
func (e *Engine) ParkLimit() int64 { return e.parkLimit }

// Parked reports whether seq's cells are in host memory, not in the KV
// cache (evicting it frees no cells).
func (e *Engine) Parked(seq int) bool { return e.parked[seq] != nil }

// ParkedBytes is the host memory parked sequences take (shared states
// counted once per sequence). Safe for concurrent use (metrics read it).
func (e *Engine) ParkedBytes() int64 { return e.parkedBytes.Load() }

// ParkedTokens is how many cells the parked sequences would take in the
// KV cache (a state shared by several counted once per sequence). Loop
// goroutine only.
func (e *Engine) ParkedTokens() int {
	n := 0
	for _, p := range e.parked {
		n += p.n
	}
	return n
}

func (e *Engine) forget(seq int) {
	if p := e.parked[seq]; p != nil {
		e.parkedBytes.Add(-int64(len(p.state)))
		delete(e.parked, seq)
	}
}

// restore brings a parked seq back into the KV cache: shared from a
// sequence restored from the same state if one still holds the cells,
// else written anew; ErrKVFull when there is no contiguous room even after
// a defragmentation (it stays parked).
func (e *Engine) restore(seq int) error {
	if e.lost[seq] {
		return fmt.Errorf("%w: seq %d lost cells it shared while the cache was full", engine.ErrKVFull, seq)
	}
	p := e.parked[seq]
	if p == nil {
		return nil
	}
	if twin, ok := e.twin(p); ok {
		e.lc.KvCacheSeqCp(twin, seq, 0, p.n)
		e.forget(seq)
		e.restored[seq] = restoredFrom{state: p.state, n: p.n}
		return nil
	}
	set := func() bool {
		return C.llama_state_seq_set_data(e.raw, (*C.uint8_t)(unsafe.Pointer(&p.state[0])), C.size_t(len(p.state)), C.int32_t(seq)) != 0
	}
	if !set() {
		// set_data needs one contiguous run of free cells; decode
		// defragments by itself, this path does not.
		C.llama_kv_self_defrag(e.raw)
		C.llama_kv_self_update(e.raw)
		if !set() {
			return fmt.Errorf("%w: restoring seq %d (%d cells)", engine.ErrKVFull, seq, p.full)
		}
	}
	if p.n < p.full {
		e.lc.KvCacheSeqRm(seq, p.n, -1)
		e.holes = true
	}
	e.forget(seq)
	e.restored[seq] = restoredFrom{state: p.state, n: p.n}
	return nil
}

// twin is a sequence in the KV cache restored from p's state that still
// holds p's cells, the lowest such seq id (so the choice does not depend
// on map order).
func (e *Engine) twin(p *parked) (int, bool) {
	best := -1
	for s, r := range e.restored {
		if r.n >= p.n && sameState(r.state, p.state) && e.parked[s] == nil && !e.lost[s] && (best < 0 || s < best) {
			best = s
		}
	}
	return best, best >= 0
}

// copyParked handles Copy when src or dst is parked (or dst lost cells).
func (e *Engine) copyParked(src, dst, from, to int) {
	if e.lost[dst] {
		return
	}
	p := e.parked[src]
	if p != nil && from == 0 && e.parked[dst] == nil {
		// dst holds nothing yet: it is src's state cut to [0, to).
		e.forget(dst)
		delete(e.restored, dst)
		e.parked[dst] = &parked{state: p.state, n: min(to, p.n), full: p.full}
		e.parkedBytes.Add(int64(len(p.state)))
		return
	}
	// Rare (a parked sequence shared from the middle, or into a parked
	// one): both must be in the cache for llama.cpp to tag the cells.
	if err := e.restore(dst); err != nil {
		e.lost[dst] = true
		return
	}
	if p != nil {
		if err := e.restore(src); err != nil {
			e.lost[dst] = true
			return
		}
		e.lc.KvCacheSeqCp(src, dst, from, to)
		// src goes back to host memory: its state bytes did not change.
		e.lc.KvCacheSeqRm(src, 0, -1)
		delete(e.restored, src)
		e.parked[src] = p
		e.parkedBytes.Add(int64(len(p.state)))
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
	} else if from < p.n {
		e.parked[seq] = &parked{state: p.state, n: from, full: p.full}
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
