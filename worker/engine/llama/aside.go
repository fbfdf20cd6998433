package llama

/*
#include <stddef.h>
#include <stdint.h>

struct llama_context;
size_t  llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, int32_t dest_seq_id);
int32_t llama_kv_self_seq_pos_max(struct llama_context * ctx, int32_t seq_id);
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	ll "github.com/ollama/ollama/llama"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
)

// Prefill aside (docs/worker.md, "Prefill aside"): a second llama.cpp
// context on the same weights, with room for one sequence, where a long
// prompt is prefilled while the main context's sequences decode. There its
// tokens attend over its own cells only; in the main context's unified
// cache they would attend over every running sequence's cells too. A prefix
// the sequence adopted is copied aside and also stays in the main cache,
// where it is usually shared with the entry it came from; when the sequence
// is next used, only the cells computed aside are written into the cache
// (bringBack), so a shared prefix is never held twice there.
type aside struct {
	lc    *ll.Context
	raw   rawCtx
	cells int // n_ctx of the side context
	seq   int // the main context's seq id being prefilled aside; -1: none
	n     int // positions [0, n) of seq are computed aside
	from  int // positions [0, from) of seq are in the main cache too
}

// sideScratch is the side context's second sequence, through which the
// cells computed aside are written out without the prefix before them;
// it is empty except inside bringBack.
const sideScratch = 1

// openAside builds the side context: n_seq_max 2 (the sequence and
// sideScratch, which shares its cells), n_ctx cells rounded up to
// llama.cpp's padding of 256, the main context's other parameters and
// adapters (the bytes it hands over must be the main context's format).
func openAside(model *ll.Model, cfg Config) (*aside, error) {
	cells := (cfg.AsideCells + 255) / 256 * 256
	lc, err := ll.NewContextWithModel(model, ll.NewContextParams(cells, cfg.NBatch, 2, cfg.Threads, cfg.FlashAttention, cfg.KVCacheType))
	if err != nil {
		return nil, fmt.Errorf("llama: context aside: %w", err)
	}
	for _, a := range cfg.LoRA {
		scale := a.Scale
		if scale == 0 {
			scale = 1
		}
		if err := model.ApplyLoraFromFile(lc, a.Path, scale, cfg.Threads); err != nil {
			return nil, fmt.Errorf("llama: lora %q on the context aside: %w", a.Name, err)
		}
	}
	raw, err := checkedContext(lc, cells, 2)
	if err != nil {
		return nil, err
	}
	return &aside{lc: lc, raw: raw, cells: cells, seq: -1}, nil
}

// AsideCells implements engine.Aside.
func (e *Engine) AsideCells() int {
	if e.side == nil {
		return 0
	}
	return e.side.cells
}

// PrefillAside implements engine.Aside.
func (e *Engine) PrefillAside(seq, pos int, tokens []int) error {
	a := e.side
	switch {
	case a == nil:
		return errors.New("llama: no context aside (Config.AsideCells is 0)")
	case seq < 0 || seq >= e.info.NSeqMax:
		return fmt.Errorf("llama: seq id %d outside 0..%d", seq, e.info.NSeqMax-1)
	case len(tokens) == 0 || len(tokens) > e.info.NBatch:
		return fmt.Errorf("llama: %d tokens aside; want 1..%d", len(tokens), e.info.NBatch)
	case pos+len(tokens) > a.cells:
		return fmt.Errorf("llama: positions up to %d aside; the context aside holds %d", pos+len(tokens), a.cells)
	}
	if seq != a.seq {
		if err := e.moveAside(seq, pos); err != nil {
			return err
		}
	}
	if pos != a.n {
		return fmt.Errorf("llama: seq %d holds %d positions aside, not %d", seq, a.n, pos)
	}
	e.batch.Clear()
	for j, t := range tokens {
		if t < 0 || t >= e.vocab {
			return fmt.Errorf("llama: token %d outside the vocabulary of %d", t, e.vocab)
		}
		e.batch.Add(t, nil, pos+j, false, 0)
	}
	if err := a.lc.Decode(e.batch); err != nil {
		e.dropAside()
		return fmt.Errorf("llama: prefill aside: %w", err)
	}
	a.n += len(tokens)
	return nil
}

// moveAside makes seq the sequence aside, with a copy of the pos cells it
// holds (an adopted prefix; restored first if parked), which stay in the
// cache; at position 0 whatever it held is dropped.
func (e *Engine) moveAside(seq, pos int) error {
	a := e.side
	e.dropAside()
	if pos == 0 {
		e.Remove(seq, 0)
		a.seq = seq
		return nil
	}
	if err := e.restore(seq); err != nil {
		return err
	}
	// llama.cpp answers 0 for an empty sequence too; the count written
	// first in the state bytes tells that case apart.
	if n := int(C.llama_kv_self_seq_pos_max(e.raw, C.int32_t(seq))) + 1; n != pos {
		return fmt.Errorf("llama: seq %d holds %d cells; it cannot start aside at position %d", seq, n, pos)
	}
	st := e.capture(seq, 0, pos)
	if st == nil || len(st.bytes) < 4 || int(binary.NativeEndian.Uint32(st.bytes)) != pos {
		return fmt.Errorf("llama: seq %d does not hold %d cells to copy aside", seq, pos)
	}
	if C.llama_state_seq_set_data(a.raw, (*C.uint8_t)(unsafe.Pointer(&st.bytes[0])), C.size_t(len(st.bytes)), 0) == 0 {
		return fmt.Errorf("llama: copying seq %d's %d cells aside failed", seq, pos)
	}
	a.seq, a.n, a.from = seq, pos, pos
	return nil
}

// bringBack writes the cells computed aside for seq, if it is the sequence
// aside, into the cache after the prefix it holds there: one run of free
// cells as long as what was computed aside, not the whole prompt. Without
// that room it is ErrKVFull and everything stays as it was.
func (e *Engine) bringBack(seq int) error {
	a := e.side
	if a == nil || a.seq != seq {
		return nil
	}
	src, dst := 0, seq
	if a.from > 0 {
		src, dst = sideScratch, e.scratch
		a.lc.KvCacheSeqCp(0, sideScratch, a.from, a.n)
	}
	st := stateOf(a.raw, src, a.n)
	a.lc.KvCacheSeqRm(sideScratch, 0, -1)
	if st == nil {
		// llama.cpp logged why; seq's Steps fail instead of running on
		// missing cells.
		e.Remove(seq, 0)
		e.lost[seq] = true
		return fmt.Errorf("%w: seq %d lost the cells computed aside", engine.ErrKVFull, seq)
	}
	if !e.set(dst, st) {
		return fmt.Errorf("%w: bringing seq %d's %d cells computed aside into the cache", engine.ErrKVFull, seq, a.n-a.from)
	}
	if dst == e.scratch {
		e.lc.KvCacheSeqCp(dst, seq, a.from, a.n)
		e.lc.KvCacheSeqRm(dst, 0, -1)
		e.holes = true
	}
	e.dropAside()
	return nil
}

// land turns seq's cells aside, if it has any, into a parked record of seq
// (park.go), its prefix in the cache dropped: for Park and for a Copy of
// cells that are only aside.
func (e *Engine) land(seq int) {
	a := e.side
	if a == nil || a.seq != seq {
		return
	}
	st := stateOf(a.raw, 0, a.n)
	n := a.n
	e.removeAside(seq, 0)
	if st == nil {
		// llama.cpp logged why; seq's next Step fails instead of running
		// on missing cells.
		e.lost[seq] = true
		return
	}
	e.setParked(seq, &parked{root: st, k: n, n: n})
}

// onlyAside says whether seq is the sequence aside and positions up to to
// are not all in the cache.
func (e *Engine) onlyAside(seq, to int) bool {
	a := e.side
	return a != nil && a.seq == seq && to > a.from
}

// removeAside handles Remove of the sequence aside, here and in the cache;
// false if seq is not it.
func (e *Engine) removeAside(seq, from int) bool {
	a := e.side
	if a == nil || a.seq != seq {
		return false
	}
	from = max(from, 0)
	if from < a.from {
		e.cutRecords(seq, from)
		e.lc.KvCacheSeqRm(seq, from, -1)
		e.holes = true
		a.from = from
	}
	if from == 0 {
		e.dropAside()
	} else if from < a.n {
		a.lc.KvCacheSeqRm(0, from, -1)
		a.n = from
	}
	return true
}

func (e *Engine) dropAside() {
	a := e.side
	a.lc.KvCacheSeqRm(0, 0, -1)
	a.lc.KvCacheSeqRm(sideScratch, 0, -1)
	a.seq, a.n, a.from = -1, 0, 0
}
