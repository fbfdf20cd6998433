package openai

import (
	"strings"
	"unicode/utf8"
)

// TextDecoder turns a stream of token pieces (raw bytes: with a byte-level
// vocabulary one token can be a fraction of a character) into valid UTF-8
// text. It never emits a partial character: an incomplete sequence at the
// end is held until the next piece completes it. Bytes that can never form a
// character become U+FFFD, one per maximal ill-formed subpart (the Unicode
// recommendation, also what browsers and Python do).
type TextDecoder struct {
	pending []byte
}

// Add appends a piece and returns the text that is now complete.
func (d *TextDecoder) Add(piece string) string {
	if len(d.pending) == 0 && utf8.ValidString(piece) {
		return piece // the common case: whole characters
	}
	d.pending = append(d.pending, piece...)
	out, rest := decodeValid(d.pending, false)
	d.pending = append(d.pending[:0], rest...)
	return out
}

// Flush returns whatever is held, an incomplete final sequence becoming
// U+FFFD, and resets the decoder.
func (d *TextDecoder) Flush() string {
	out, _ := decodeValid(d.pending, true)
	d.pending = d.pending[:0]
	return out
}

// Pending reports how many bytes are held back.
func (d *TextDecoder) Pending() int { return len(d.pending) }

// decodeValid returns the valid text of b with ill-formed subparts replaced.
// Unless final, a trailing sequence that could still become valid is
// returned as rest instead.
func decodeValid(b []byte, final bool) (string, []byte) {
	var sb strings.Builder
	sb.Grow(len(b))
	for i := 0; i < len(b); {
		if b[i] < utf8.RuneSelf {
			sb.WriteByte(b[i])
			i++
			continue
		}
		n, complete := sequence(b[i:])
		switch {
		case complete:
			sb.Write(b[i : i+n])
		case i+n == len(b) && !final:
			// A valid prefix cut short by the end of the data.
			return sb.String(), b[i:]
		default:
			sb.WriteRune(utf8.RuneError)
			n = max(n, 1)
		}
		i += n
	}
	return sb.String(), nil
}

// sequence examines the UTF-8 sequence starting at b[0] (>= 0x80). It
// returns the length of the longest valid prefix (at least 1 if b[0] is a
// valid lead byte, 0 otherwise) and whether it is a complete character.
// The second-byte ranges follow the Unicode table of well-formed sequences,
// which excludes overlongs, surrogates and values above U+10FFFF.
func sequence(b []byte) (n int, complete bool) {
	lead := b[0]
	var size int
	lo, hi := byte(0x80), byte(0xBF)
	switch {
	case lead >= 0xC2 && lead <= 0xDF:
		size = 2
	case lead == 0xE0:
		size, lo = 3, 0xA0
	case lead >= 0xE1 && lead <= 0xEC, lead == 0xEE, lead == 0xEF:
		size = 3
	case lead == 0xED:
		size, hi = 3, 0x9F
	case lead == 0xF0:
		size, lo = 4, 0x90
	case lead >= 0xF1 && lead <= 0xF3:
		size = 4
	case lead == 0xF4:
		size, hi = 4, 0x8F
	default:
		return 0, false
	}
	n = 1
	for ; n < size && n < len(b); n++ {
		c := b[n]
		if n > 1 {
			lo, hi = 0x80, 0xBF
		}
		if c < lo || c > hi {
			return n, false
		}
	}
	return n, n == size
}

// StopMatcher finds stop sequences in streamed text. It holds back any tail
// that could be the beginning of a stop sequence, so text after which a stop
// sequence turns out to start is never sent, and it cuts the text at the
// first complete match (the one that completes first); the stop sequence
// itself is not part of the output, as in OpenAI's API.
type StopMatcher struct {
	stops   []string
	held    string
	stopped bool
}

// NewStopMatcher matches the given sequences; empty ones are ignored.
func NewStopMatcher(stops []string) *StopMatcher {
	m := &StopMatcher{}
	for _, s := range stops {
		if s != "" {
			m.stops = append(m.stops, s)
		}
	}
	return m
}

// Push adds text and returns what can be emitted. stopped reports that a
// stop sequence matched; emit is then the text before it and every later
// Push returns nothing.
func (m *StopMatcher) Push(text string) (emit string, stopped bool) {
	if m.stopped {
		return "", true
	}
	if len(m.stops) == 0 {
		return text, false
	}
	buf := m.held + text
	cut := firstMatch(buf, m.stops)
	if cut >= 0 {
		m.stopped, m.held = true, ""
		return buf[:cut], true
	}
	keep := 0
	for _, s := range m.stops {
		keep = max(keep, partialSuffix(buf, s))
	}
	m.held = buf[len(buf)-keep:]
	return buf[:len(buf)-keep], false
}

// Flush returns the held-back text at the end of generation (none after a stop).
func (m *StopMatcher) Flush() string {
	out := m.held
	m.held = ""
	return out
}

// Stopped reports whether a stop sequence matched.
func (m *StopMatcher) Stopped() bool { return m.stopped }

// firstMatch returns where the stop sequence that completes first in buf
// starts (-1 if none does). "First" is by end position, ties going to the
// longer match: that is the order in which a byte-by-byte stream would see
// them complete, so the result does not depend on how text is chunked.
func firstMatch(buf string, stops []string) int {
	cut, end := -1, -1
	for _, s := range stops {
		i := strings.Index(buf, s)
		if i < 0 {
			continue
		}
		if e := i + len(s); end < 0 || e < end || e == end && i < cut {
			cut, end = i, e
		}
	}
	return cut
}

// partialSuffix is the length of the longest suffix of buf that is a proper
// prefix of stop.
func partialSuffix(buf, stop string) int {
	for n := min(len(buf), len(stop)-1); n > 0; n-- {
		if strings.HasSuffix(buf, stop[:n]) {
			return n
		}
	}
	return 0
}

// Output is the text pipeline of one generated sequence: token pieces go in
// (bytes, possibly partial characters), and out comes text that is valid
// UTF-8 and cut before the first stop sequence.
type Output struct {
	dec  TextDecoder
	stop *StopMatcher
}

// NewOutput returns an Output that stops at any of stops.
func NewOutput(stops []string) *Output { return &Output{stop: NewStopMatcher(stops)} }

// Push adds a token's piece. stopped reports that a stop sequence matched:
// generation should end with finish reason "stop" after sending emit.
func (o *Output) Push(piece string) (emit string, stopped bool) {
	return o.stop.Push(o.dec.Add(piece))
}

// Flush returns the text still held when generation ends for another reason
// (EOS, length): an incomplete character becomes U+FFFD, and a held partial
// stop sequence turns out to be text after all.
func (o *Output) Flush() string {
	text, stopped := o.stop.Push(o.dec.Flush())
	if stopped {
		return text
	}
	return text + o.stop.Flush()
}
