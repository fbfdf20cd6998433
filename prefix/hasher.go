package prefix

import "unicode/utf8"

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
// where le64 is the 8-byte little-endian encoding. Blocks are ChunkSize bytes
// except that a block never ends inside a UTF-8 character and the last block
// takes whatever remains. Empty input gives no hashes.
func (h Hasher) Sum(model string, canonical []byte) []Hash {
	return h.AppendSum(nil, model, canonical)
}

// AppendSum is Sum appending to dst, for callers that reuse a slice.
func (h Hasher) AppendSum(dst []Hash, model string, canonical []byte) []Hash {
	if len(canonical) == 0 {
		return dst
	}
	size := h.chunkSize()
	if dst == nil {
		dst = make([]Hash, 0, (len(canonical)+size-1)/size+1)
	}
	prev := Seed(model)
	for start := 0; start < len(canonical); {
		end := blockEnd(canonical, start, size)
		prev = Hash(sum64Prefixed(uint64(prev), canonical[start:end]))
		dst = append(dst, prev)
		start = end
	}
	return dst
}

func (h Hasher) chunkSize() int {
	if h.ChunkSize <= 0 {
		return DefaultChunkSize
	}
	return h.ChunkSize
}

// blockEnd returns the end of the block starting at start: start+size moved
// back to the start of the UTF-8 character it would split. If that would empty
// the block (size smaller than one character), it moves forward instead.
func blockEnd(b []byte, start, size int) int {
	end := start + size
	if end >= len(b) {
		return len(b)
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
