package openai

import "encoding/binary"

// Word-at-a-time tests (SWAR) over 8 bytes: prompts are long runs of plain
// text, and testing eight bytes per step is ~3x faster than a byte loop.
// Each test is exact as a boolean: it is non-zero iff some byte qualifies.
const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// hasByte reports whether some byte of w equals c.
func hasByte(w uint64, c byte) bool {
	x := w ^ (lsb * uint64(c))
	return (x-lsb)&^x&msb != 0
}

// strPlainRun returns the length of the leading run of b that needs nothing
// done inside a JSON string: ASCII other than '"', '\\' and controls.
// (Spelled out twice, not parameterised by funcs: the calls would not inline.)
func strPlainRun(b []byte) int {
	i := 0
	for {
		for i+8 <= len(b) && !strWordSpecial(binary.LittleEndian.Uint64(b[i:])) {
			i += 8
		}
		end := min(i+8, len(b))
		for i < end && !strByteSpecial(b[i]) {
			i++
		}
		if i < end || i >= len(b) {
			return i
		}
	}
}

// unqPlainRun is strPlainRun for unquoting: ASCII other than '\\'.
func unqPlainRun(b []byte) int {
	i := 0
	for {
		for i+8 <= len(b) && !unqWordSpecial(binary.LittleEndian.Uint64(b[i:])) {
			i += 8
		}
		end := min(i+8, len(b))
		for i < end && !unqByteSpecial(b[i]) {
			i++
		}
		if i < end || i >= len(b) {
			return i
		}
	}
}

// In a JSON string, plain bytes are ASCII other than '"', '\\' and controls.
func strWordSpecial(w uint64) bool { return strSpecialMask(w) != 0 }

// strSpecialMask marks the special bytes of w (strWordSpecial) with a mask
// whose lowest set bit is the high bit of the first one (little-endian): a
// borrow in the zero-byte tests only runs upward from a byte that
// qualifies, so the bits above the first may be wrong but the first is
// exact, and the mask is non-zero iff some byte is special.
func strSpecialMask(w uint64) uint64 {
	q := w ^ (lsb * '"')
	bs := w ^ (lsb * '\\')
	return (w | (w-lsb*0x20)&^w | (q-lsb)&^q | (bs-lsb)&^bs) & msb
}

func strByteSpecial(c byte) bool { return c == '"' || c == '\\' || c < 0x20 || c >= 0x80 }

// While unquoting, plain bytes are ASCII other than '\\'.
func unqWordSpecial(w uint64) bool { return w&msb != 0 || hasByte(w, '\\') }

func unqByteSpecial(c byte) bool { return c == '\\' || c >= 0x80 }
