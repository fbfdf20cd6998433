// Package prompthash turns a prompt into the chained prefix-block hashes that
// the filter, the metadata center and the workers all agree on (DESIGN §4).
//
// Two steps, kept separate so that every party can reproduce them:
//
//  1. Canonical bytes: CanonicalChat / CanonicalCompletion render a prompt
//     into one byte string that is injective (different prompts never render
//     the same) and prefix-preserving (a conversation that extends another
//     renders to an extension of its bytes, so shared history shares blocks).
//  2. Hasher.Sum cuts those bytes into UTF-8-safe blocks and chains 64-bit
//     murmur3 over them; element i names the whole prefix up to block i.
//
// Wire renders the sums as the 16-lowercase-hex strings of the metadata-center API.
package prompthash

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"slices"
	"strings"
	"unicode/utf8"
)

// DefaultChunkSize is the block size in bytes when Hasher.ChunkSize is 0.
const DefaultChunkSize = 512

// Control bytes of the canonical form. They are ASCII control characters
// that real prompt text practically never contains; when it does, they are
// escaped, which is what makes the encoding injective.
const (
	escByte  = 0x1b // ESC: the next byte is literal content
	partMark = 0x1d // GS: opens and closes a non-text part digest
	msgMark  = 0x1e // RS: starts a message (followed by the role)
	roleEnd  = 0x1f // US: ends the role, content follows
)

// Part is one piece of a message's content.
// Type is "text" for text (Text is used); any other type ("image_url",
// "input_audio", ...) contributes a SHA-256 digest of its URL or inline data
// (URL), so a 5 MB data: URL costs 64 canonical bytes, not 5 MB.
type Part struct{ Type, Text, URL string }

// Message is one chat message: a role and its content parts in order.
// A plain string content is a single Part{Type: "text"}.
type Message struct {
	Role  string
	Parts []Part
}

// CanonicalChat renders messages as
//
//	for each message:  RS role US content
//	content:           escaped text of text parts, in order;
//	                   GS type ':' hex(sha256(url)) GS for other parts
//
// where RS, US, GS and ESC inside role, text and type are escaped with ESC.
// Hence [A,B] and [B,A] differ, and no content can forge a message or role
// boundary. The end of a message is not marked, so a conversation's bytes are
// a prefix of the bytes of any conversation that continues it. Adjacent text
// parts concatenate, as chat templates render them.
func CanonicalChat(msgs []Message) []byte {
	return AppendCanonicalChat(nil, msgs)
}

// AppendCanonicalChat appends CanonicalChat(msgs) to dst, for callers that
// reuse buffers on the hot path.
func AppendCanonicalChat(dst []byte, msgs []Message) []byte {
	n := 0
	for i := range msgs {
		n += 2 + len(msgs[i].Role)
		for _, p := range msgs[i].Parts {
			if p.Type == "text" {
				n += len(p.Text)
			} else {
				n += 3 + len(p.Type) + 2*sha256.Size
			}
		}
	}
	// A little headroom for escapes so the common case allocates once.
	out := slices.Grow(dst, n+n/64+8)
	for i := range msgs {
		out = append(out, msgMark)
		out = appendEscaped(out, msgs[i].Role)
		out = append(out, roleEnd)
		for _, p := range msgs[i].Parts {
			if p.Type == "text" {
				out = appendEscaped(out, p.Text)
				continue
			}
			out = append(out, partMark)
			out = appendEscaped(out, p.Type)
			out = append(out, ':')
			sum := sha256.Sum256([]byte(p.URL))
			out = hex.AppendEncode(out, sum[:])
			out = append(out, partMark)
		}
	}
	return out
}

// CanonicalCompletion renders a completion prompt: its text, with the control
// bytes escaped as in CanonicalChat. An unescaped RS never appears in it, so
// a completion can never collide with a chat conversation.
func CanonicalCompletion(prompt string) []byte {
	return AppendCanonicalCompletion(nil, prompt)
}

// AppendCanonicalCompletion appends CanonicalCompletion(prompt) to dst.
func AppendCanonicalCompletion(dst []byte, prompt string) []byte {
	return appendEscaped(slices.Grow(dst, len(prompt)+len(prompt)/64+8), prompt)
}

func isControl(c byte) bool {
	return c == escByte || c == partMark || c == msgMark || c == roleEnd
}

// appendEscaped copies s, escaping the control bytes. Real text almost never
// holds them, and four vectorised byte searches prove it faster than one
// byte-by-byte scan, so the common case is those searches and one copy.
func appendEscaped(out []byte, s string) []byte {
	if strings.IndexByte(s, msgMark) < 0 && strings.IndexByte(s, roleEnd) < 0 &&
		strings.IndexByte(s, partMark) < 0 && strings.IndexByte(s, escByte) < 0 {
		return append(out, s...)
	}
	start := 0
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 && isControl(c) {
			out = append(out, s[start:i]...)
			out = append(out, escByte, c)
			start = i + 1
		}
	}
	return append(out, s[start:]...)
}

// Hasher computes chained block hashes. The zero value uses DefaultChunkSize.
type Hasher struct {
	// ChunkSize is the target block size in bytes (0 = 512). A block ends
	// early rather than split a UTF-8 character, so it may be up to 3 bytes
	// shorter.
	ChunkSize int
}

// Seed returns h_{-1} for a model: murmur3 (64-bit, seed 0) of the model name.
// Seeding by model keeps two models' identical prompts apart in the index.
func Seed(model string) uint64 {
	return sum64String(model)
}

// Sum returns one hash per block of canonical:
//
//	h_{-1} = Seed(model)
//	h_i    = murmur3-64(le64(h_{i-1}) ‖ block_i)
//
// where le64 is the 8-byte little-endian encoding. Blocks are ChunkSize bytes
// except that a block never ends inside a UTF-8 character and the last block
// takes whatever remains. Empty input gives no hashes.
func (h Hasher) Sum(model string, canonical []byte) []uint64 {
	return h.AppendSum(nil, model, canonical)
}

// AppendSum is Sum appending to dst, for callers that reuse a slice.
func (h Hasher) AppendSum(dst []uint64, model string, canonical []byte) []uint64 {
	if len(canonical) == 0 {
		return dst
	}
	size := h.chunkSize()
	if dst == nil {
		dst = make([]uint64, 0, (len(canonical)+size-1)/size+1)
	}
	prev := Seed(model)
	for start := 0; start < len(canonical); {
		end := blockEnd(canonical, start, size)
		prev = sum64Prefixed(prev, canonical[start:end])
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

// Wire renders sums in the metadata-center wire form: 16 lowercase hex
// digits each, most significant first. All strings share one allocation.
func Wire(sums []uint64) []string {
	if len(sums) == 0 {
		return nil
	}
	buf := make([]byte, 16*len(sums))
	for i, s := range sums {
		var b [8]byte
		binary.BigEndian.PutUint64(b[:], s)
		hex.Encode(buf[16*i:], b[:])
	}
	all := string(buf)
	out := make([]string, len(sums))
	for i := range out {
		out[i] = all[16*i : 16*i+16]
	}
	return out
}

// ParseWire is the inverse of one Wire element.
func ParseWire(s string) (uint64, bool) {
	if len(s) != 16 {
		return 0, false
	}
	var b [8]byte
	if _, err := hex.Decode(b[:], []byte(s)); err != nil {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] >= 'A' && s[i] <= 'F' {
			return 0, false
		}
	}
	return binary.BigEndian.Uint64(b[:]), true
}
