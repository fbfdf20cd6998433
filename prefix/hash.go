package prefix

import (
	"fmt"
	"unsafe"
)

// Hash is one chained prefix hash: it names a whole prompt prefix up to a
// block boundary. Its wire form is exactly 16 lowercase hex digits, most
// significant first; any other spelling would be a second key for the same
// prefix and silently miss the index, so ParseHash refuses it.
type Hash uint64

const hexDigits = "0123456789abcdef"

// String renders the wire form.
func (h Hash) String() string {
	var b [16]byte
	return string(h.appendTo(b[:0]))
}

func (h Hash) appendTo(dst []byte) []byte {
	for shift := 60; shift >= 0; shift -= 4 {
		dst = append(dst, hexDigits[(h>>uint(shift))&0xf])
	}
	return dst
}

// Wire renders hashes in the wire form. All strings share one allocation.
func Wire(hs []Hash) []string {
	if len(hs) == 0 {
		return nil
	}
	buf := make([]byte, 0, 16*len(hs))
	for _, h := range hs {
		buf = h.appendTo(buf)
	}
	// buf is never written again: the strings may share it without a copy.
	all := unsafe.String(unsafe.SliceData(buf), len(buf))
	out := make([]string, len(hs))
	for i := range out {
		out[i] = all[16*i : 16*i+16]
	}
	return out
}

// ParseHash accepts exactly the wire form.
func ParseHash(s string) (Hash, error) {
	if len(s) != 16 {
		return 0, fmt.Errorf("hash %q: want 16 lowercase hex digits, got %d characters", s, len(s))
	}
	h, bad := parse(s)
	if bad >= 0 {
		return 0, fmt.Errorf("hash %q: want 16 lowercase hex digits, found %q", s, s[bad])
	}
	return h, nil
}

// ParseHashBytes is ParseHash for a decoder's raw bytes, without the error
// text (hot path: the metadata center's route-query parser).
func ParseHashBytes(b []byte) (Hash, bool) {
	if len(b) != 16 {
		return 0, false
	}
	h, bad := parse(b)
	return h, bad < 0
}

// parse reads 16 lowercase hex digits; bad is the index of the first other
// byte, or -1.
func parse[S string | []byte](s S) (h Hash, bad int) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= '0' && c <= '9':
			h = h<<4 | Hash(c-'0')
		case c >= 'a' && c <= 'f':
			h = h<<4 | Hash(c-'a'+10)
		default:
			return 0, i
		}
	}
	return h, -1
}
