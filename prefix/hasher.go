package prefix

import (
	"bytes"
	"unicode/utf8"
)

// DefaultChunkSize is the block size in bytes when Hasher.ChunkSize is 0.
// Gateways and workers must use the same size for a cluster: the metadata
// center refuses a worker's eviction report whose size differs from the
// gateways' (docs/metadata-center.md).
const DefaultChunkSize = 512

// Hasher computes chained block hashes. The zero value uses DefaultChunkSize.
type Hasher struct {
	// ChunkSize is the target block size in bytes (0 = 512). A block ends
	// early rather than split a UTF-8 character, so it may be up to 3 bytes
	// shorter.
	ChunkSize int
}

// Seed returns h_{-1} for a model: murmur3 (64-bit, seed 0) of the model name.
// Seeding by model keeps two models' identical prompts apart in the index.
func Seed(model string) Hash {
	return Hash(sum64String(model))
}

// Sum returns one hash per block of canonical:
//
//	h_{-1} = Seed(model)
//	h_i    = murmur3-64(le64(h_{i-1}) ‖ block_i)
//
// where le64 is the 8-byte little-endian encoding. A block is ChunkSize bytes,
// or ends earlier at the start of a chat message (an unescaped RS, see
// CanonicalChat), and never inside a UTF-8 character; the last block takes
// whatever remains. Ending blocks where messages start keeps a
// conversation's chain a prefix of its continuation's chain: the previous
// turn's prompt ends where the next assistant message starts, so its last,
// partial block is a whole block of every later turn, and the index tells
// the pod that served the conversation from one that holds only its system
// prompt. Empty input gives no hashes.
func (h Hasher) Sum(model string, canonical []byte) []Hash {
	return h.AppendSum(nil, model, canonical)
}

// AppendSum is Sum appending to dst, for callers that reuse a slice.
func (h Hasher) AppendSum(dst []Hash, model string, canonical []byte) []Hash {
	dst, _ = h.appendBlocks(dst, nil, false, model, canonical)
	return dst
}

// AppendBlocks is AppendSum that also appends, to ends, the offset in
// canonical where each block ends: block i covers canonical[ends[i-1]:ends[i]].
func (h Hasher) AppendBlocks(dst []Hash, ends []int, model string, canonical []byte) ([]Hash, []int) {
	return h.appendBlocks(dst, ends, true, model, canonical)
}

func (h Hasher) appendBlocks(dst []Hash, ends []int, withEnds bool, model string, canonical []byte) ([]Hash, []int) {
	if len(canonical) == 0 {
		return dst, ends
	}
	size := h.chunkSize()
	if dst == nil {
		dst = make([]Hash, 0, (len(canonical)+size-1)/size+bytes.Count(canonical, []byte{msgMark})+1)
	}
	prev := Seed(model)
	for start := 0; start < len(canonical); {
		end := blockEnd(canonical, start, size)
		prev = Hash(sum64Prefixed(uint64(prev), canonical[start:end]))
		dst = append(dst, prev)
		if withEnds {
			ends = append(ends, end)
		}
		start = end
	}
	return dst, ends
}

func (h Hasher) chunkSize() int {
	if h.ChunkSize <= 0 {
		return DefaultChunkSize
	}
	return h.ChunkSize
}

// blockEnd returns the end of the block starting at start: the next message
// start within size bytes, else start+size moved back to the start of the
// UTF-8 character it would split. If that would empty the block (size
// smaller than one character), it moves forward instead.
func blockEnd(b []byte, start, size int) int {
	end := min(start+size, len(b))
	if m := nextMessage(b, start+1, end); m >= 0 {
		return m
	}
	if end == len(b) {
		return end
	}
	e := end
	for e > start && e > end-utf8.UTFMax && !utf8.RuneStart(b[e]) {
		e--
	}
	if e > start && utf8.RuneStart(b[e]) {
		return e
	}
	// No rune start within reach backwards: invalid UTF-8 or a tiny chunk.
	// Move forward past continuation bytes instead, bounded likewise.
	e = end
	for e < len(b) && e < end+utf8.UTFMax && !utf8.RuneStart(b[e]) {
		e++
	}
	return e
}

// nextMessage returns the offset of the first message start (an RS that no
// ESC escapes) in b[from:to], or -1. Only ESC escapes, so an RS is escaped
// exactly when an odd run of ESCs precedes it.
func nextMessage(b []byte, from, to int) int {
	for from < to {
		i := bytes.IndexByte(b[from:to], msgMark)
		if i < 0 {
			return -1
		}
		at := from + i
		esc := 0
		for j := at - 1; j >= 0 && b[j] == escByte; j-- {
			esc++
		}
		if esc%2 == 0 {
			return at
		}
		from = at + 1
	}
	return -1
}
