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
)

// Prefill aside (docs/worker.md, "Prefill aside"): a second llama.cpp
// context on the same weights, with room for one sequence, where a long
// prompt is prefilled while the main context's sequences decode. There its
// tokens attend over its own cells only; in the main context's unified
// cache they would attend over every running sequence's cells too. When the
// sequence is next used, its cells move into the main cache the way a
// parked sequence's do: written out as host bytes, then restored by Step.
type aside struct {
	lc    *ll.Context
	raw   rawCtx
	cells int // n_ctx of the side context
	seq   int // the main context's seq id being prefilled aside; -1: none
	n     int // positions [0, n) of seq are computed aside
}

// openAside builds the side context: n_seq_max 1, n_ctx cells rounded up to
// llama.cpp's padding of 256, the main context's other parameters and
// adapters (the bytes it hands over must be the main context's format).
func openAside(model *ll.Model, cfg Config) (*aside, error) {
	cells := (cfg.AsideCells + 255) / 256 * 256
	lc, err := ll.NewContextWithModel(model, ll.NewContextParams(cells, cfg.NBatch, 1, cfg.Threads, cfg.FlashAttention, cfg.KVCacheType))
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
	raw, err := checkedContext(lc, cells, 1)
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

// moveAside makes seq the sequence aside, with the pos cells it holds
// (an adopted prefix) moved there from the cache (restored first if parked);
// at position 0 whatever it held is dropped.
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
		return fmt.Errorf("llama: seq %d does not hold %d cells to move aside", seq, pos)
	}
	if C.llama_state_seq_set_data(a.raw, (*C.uint8_t)(unsafe.Pointer(&st.bytes[0])), C.size_t(len(st.bytes)), 0) == 0 {
		return fmt.Errorf("llama: moving seq %d's %d cells aside failed", seq, pos)
	}
	e.Remove(seq, 0)
	a.seq, a.n = seq, pos
	return nil
}

// land turns seq's cells aside, if it has any, into a parked record of seq
// (park.go), from which the next Step restores them into the cache.
func (e *Engine) land(seq int) {
	a := e.side
	if a == nil || a.seq != seq {
		return
	}
	st := stateOf(a.raw, 0, a.n)
	n := a.n
	e.dropAside()
	if st == nil {
		// llama.cpp logged why; seq's next Step fails instead of running
		// on missing cells.
		e.lost[seq] = true
		return
	}
	e.setParked(seq, &parked{root: st, k: n, n: n})
}

// removeAside handles Remove of the sequence aside; false if seq is not it.
func (e *Engine) removeAside(seq, from int) bool {
	a := e.side
	if a == nil || a.seq != seq {
		return false
	}
	if from <= 0 {
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
	a.seq, a.n = -1, 0
}
