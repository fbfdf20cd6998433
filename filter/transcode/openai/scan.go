package openai

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
	"unsafe"
)

// scanner is a single-pass JSON reader for request bodies. encoding/json
// validated the whole body, then decoded it, then the prompt strings were
// unquoted: three passes over what is mostly one long prompt, ~40 µs for an
// 8 KiB chat here, most of the decision's budget. This reader validates and
// extracts in one pass and skips unknown fields without decoding them.
// Keys match exactly (as the Python backends do), the last duplicate wins,
// invalid UTF-8 becomes U+FFFD: the fuzz test holds it to a map-based
// encoding/json reference.
type scanner struct {
	b     []byte
	i     int
	depth int
	// texts, when set, receives the decoded prompt texts (see text and
	// Transcoder.ParseBuffered).
	texts *[]byte
}

// maxDepth bounds nesting, so hostile bodies cannot exhaust the stack.
const maxDepth = 1000

type syntaxError struct {
	msg string
	off int
}

func (e *syntaxError) Error() string { return fmt.Sprintf("%s at offset %d", e.msg, e.off) }

func (s *scanner) fail(format string, args ...any) error {
	return &syntaxError{msg: fmt.Sprintf(format, args...), off: s.i}
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek returns the next non-space byte, 0 at the end.
func (s *scanner) peek() byte {
	s.ws()
	if s.i >= len(s.b) {
		return 0
	}
	return s.b[s.i]
}

func (s *scanner) unexpected() error {
	if s.i >= len(s.b) {
		return s.fail("unexpected end of JSON input")
	}
	return s.fail("invalid character %q", s.b[s.i])
}

// rawString scans a string literal and returns it with its quotes, and
// whether it needs unescaping (escapes or non-ASCII to validate).
func (s *scanner) rawString() ([]byte, bool, error) {
	if s.peek() != '"' {
		return nil, false, s.unexpected()
	}
	start := s.i
	s.i++
	slow := false
	b := s.b
	for s.i < len(b) {
		// Plain bytes are the bulk of a prompt: skip them a word at a time.
		i := s.i + strPlainRun(b[s.i:])
		s.i = i
		if i >= len(b) {
			break
		}
		c := b[i]
		switch {
		case c == '"':
			s.i++
			return b[start:s.i], slow, nil
		case c == '\\':
			slow = true
			s.i++
			if s.i >= len(b) {
				return nil, false, s.fail("unexpected end of JSON input")
			}
			switch b[s.i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.i++
			case 'u':
				if s.i+4 >= len(b) {
					return nil, false, s.fail("unexpected end of JSON input")
				}
				for _, h := range b[s.i+1 : s.i+5] {
					if !isHex(h) {
						return nil, false, s.fail("invalid \\u escape")
					}
				}
				s.i += 5
			default:
				return nil, false, s.fail("invalid escape \\%c", b[s.i])
			}
		case c < 0x20:
			return nil, false, s.fail("control character in string")
		default: // non-ASCII: validated (and repaired) when unquoting
			slow = true
			s.i++
			for s.i < len(b) && b[s.i] >= 0x80 {
				s.i++
			}
		}
	}
	return nil, false, s.fail("unexpected end of JSON input")
}

func isHex(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
}

func (s *scanner) str() (string, error) {
	raw, slow, err := s.rawString()
	if err != nil {
		return "", err
	}
	if !slow {
		return string(raw[1 : len(raw)-1]), nil
	}
	return unquote(raw), nil
}

// text decodes a string literal of prompt text. With a texts buffer the
// result aliases it (see Transcoder.ParseBuffered); later appends never
// write over it: they write past it, or into a new array when growing.
func (s *scanner) text() (string, error) {
	if s.texts == nil {
		return s.str()
	}
	start := len(*s.texts)
	out, err := s.decodeString(*s.texts)
	if err != nil {
		*s.texts = out[:start]
		return "", err
	}
	*s.texts = out
	t := out[start:]
	if len(t) == 0 {
		return "", nil
	}
	return unsafe.String(unsafe.SliceData(t), len(t)), nil
}

// decodeString is rawString and appendUnquoted in one pass: it scans a
// string literal and appends its decoded value to out, with the same
// results and errors (at the same offsets) as the two. Prompt text is most
// of a body, and reading it twice was two fifths of a decision.
func (s *scanner) decodeString(out []byte) ([]byte, error) {
	if s.peek() != '"' {
		return out, s.unexpected()
	}
	s.i++
	b := s.b
	for s.i < len(b) {
		i := s.i
		if n := len(out); i+8 <= len(b) && n+8 <= cap(out) {
			// Copy a word ahead into out's spare capacity and keep its
			// plain bytes: scanning and copying in one step. A run scan
			// and then a copy cost a memmove call per run, and in code,
			// markup or non-English text the runs between escapes and
			// non-ASCII letters are a few words long.
			w := binary.LittleEndian.Uint64(b[i:])
			binary.LittleEndian.PutUint64(out[n:n+8], w)
			k := 8
			if m := strSpecialMask(w); m != 0 {
				k = bits.TrailingZeros64(m) >> 3
			}
			out, s.i = out[:n+k], i+k
			if k == 8 {
				continue
			}
			i += k
		} else {
			i += strPlainRun(b[i:])
			out = append(out, b[s.i:i]...)
			s.i = i
			if i >= len(b) {
				break
			}
		}
		switch c := b[i]; {
		case c == '"':
			s.i++
			return out, nil
		case c == '\\':
			s.i++
			if s.i >= len(b) {
				return out, s.fail("unexpected end of JSON input")
			}
			if c, ok := unescapeByte(b[s.i]); ok {
				out = append(out, c)
				s.i++
				continue
			}
			if b[s.i] != 'u' {
				return out, s.fail("invalid escape \\%c", b[s.i])
			}
			if s.i+4 >= len(b) {
				return out, s.fail("unexpected end of JSON input")
			}
			if !allHex(b[s.i+1 : s.i+5]) {
				return out, s.fail("invalid \\u escape")
			}
			r := hex4(b[s.i+1:])
			s.i += 5
			if utf16.IsSurrogate(r) {
				// A pair only if a well-formed \u follows; a malformed one
				// is left for the next round to refuse.
				r2 := rune(-1)
				if s.i+6 <= len(b) && b[s.i] == '\\' && b[s.i+1] == 'u' && allHex(b[s.i+2:s.i+6]) {
					r2 = hex4(b[s.i+2:])
				}
				if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
					s.i += 6
					r = dec
				} else {
					r = utf8.RuneError
				}
			}
			out = utf8.AppendRune(out, r)
		case c < 0x20:
			return out, s.fail("control character in string")
		default: // a run of non-ASCII: one validity check and one copy
			j := i + 1
			for j < len(b) && b[j] >= utf8.RuneSelf {
				j++
			}
			out = appendUTF8(out, b[i:j])
			s.i = j
		}
	}
	return out, s.fail("unexpected end of JSON input")
}

func allHex(b []byte) bool {
	for _, c := range b {
		if !isHex(c) {
			return false
		}
	}
	return true
}

func (s *scanner) literal(lit string) error {
	if len(s.b)-s.i < len(lit) || string(s.b[s.i:s.i+len(lit)]) != lit {
		return s.unexpected()
	}
	s.i += len(lit)
	return nil
}

// number scans a number per the JSON grammar and returns its text.
func (s *scanner) number() ([]byte, error) {
	s.ws()
	start := s.i
	if s.i < len(s.b) && s.b[s.i] == '-' {
		s.i++
	}
	switch {
	case s.i < len(s.b) && s.b[s.i] == '0':
		s.i++
	case s.i < len(s.b) && s.b[s.i] >= '1' && s.b[s.i] <= '9':
		for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
			s.i++
		}
	default:
		return nil, s.unexpected()
	}
	if s.i < len(s.b) && s.b[s.i] == '.' {
		s.i++
		if s.i >= len(s.b) || s.b[s.i] < '0' || s.b[s.i] > '9' {
			return nil, s.unexpected()
		}
		for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
			s.i++
		}
	}
	if s.i < len(s.b) && (s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		s.i++
		if s.i < len(s.b) && (s.b[s.i] == '+' || s.b[s.i] == '-') {
			s.i++
		}
		if s.i >= len(s.b) || s.b[s.i] < '0' || s.b[s.i] > '9' {
			return nil, s.unexpected()
		}
		for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
			s.i++
		}
	}
	return s.b[start:s.i], nil
}

func (s *scanner) int64() (int64, error) {
	start := s.i
	lit, err := s.number()
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseInt(string(lit), 10, 64)
	if err != nil {
		s.i = start
		return 0, errNotInt
	}
	return n, nil
}

// errNotInt is a number that is not a 64-bit integer.
var errNotInt = fmt.Errorf("not an integer")

// object calls fn for each key with the scanner before its value; fn must
// consume the value. Keys are decoded only when they hold escapes.
func (s *scanner) object(fn func(key string) error) error {
	if s.peek() != '{' {
		return s.unexpected()
	}
	if s.depth++; s.depth > maxDepth {
		return s.fail("exceeded max depth")
	}
	s.i++
	if s.peek() == '}' {
		s.i++
		s.depth--
		return nil
	}
	for {
		raw, slow, err := s.rawString()
		if err != nil {
			return err
		}
		key := keyString(raw, slow)
		if s.peek() != ':' {
			return s.unexpected()
		}
		s.i++
		if err := fn(key); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case '}':
			s.i++
			s.depth--
			return nil
		default:
			return s.unexpected()
		}
	}
}

// keyString decodes an object key. The keys the decoder reads come back
// as constants: a request has a dozen of them, each otherwise a small
// allocation (comparing with string(b) does not allocate).
func keyString(raw []byte, slow bool) string {
	if slow {
		return unquote(raw)
	}
	switch k := raw[1 : len(raw)-1]; string(k) {
	case "model":
		return "model"
	case "stream":
		return "stream"
	case "messages":
		return "messages"
	case "role":
		return "role"
	case "content":
		return "content"
	case "type":
		return "type"
	case "text":
		return "text"
	case "name":
		return "name"
	case "prompt":
		return "prompt"
	case "lora":
		return "lora"
	case "label_selector":
		return "label_selector"
	case "tool_calls":
		return "tool_calls"
	case "tool_call_id":
		return "tool_call_id"
	case "image_url":
		return "image_url"
	case "url":
		return "url"
	case "input_audio":
		return "input_audio"
	case "data":
		return "data"
	case "format":
		return "format"
	case "file":
		return "file"
	case "file_data":
		return "file_data"
	case "file_id":
		return "file_id"
	default:
		return string(k)
	}
}

// array calls fn for each element with the scanner before it.
func (s *scanner) array(fn func(i int) error) error {
	if s.peek() != '[' {
		return s.unexpected()
	}
	if s.depth++; s.depth > maxDepth {
		return s.fail("exceeded max depth")
	}
	s.i++
	if s.peek() == ']' {
		s.i++
		s.depth--
		return nil
	}
	for i := 0; ; i++ {
		if err := fn(i); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case ']':
			s.i++
			s.depth--
			return nil
		default:
			return s.unexpected()
		}
	}
}

// skip validates and passes over any value, returning its raw bytes.
func (s *scanner) skip() ([]byte, error) {
	c := s.peek()
	start := s.i
	var err error
	switch {
	case c == '{':
		err = s.object(func(string) error { _, err := s.skip(); return err })
	case c == '[':
		err = s.array(func(int) error { _, err := s.skip(); return err })
	case c == '"':
		_, _, err = s.rawString()
	case c == 't':
		err = s.literal("true")
	case c == 'f':
		err = s.literal("false")
	case c == 'n':
		err = s.literal("null")
	default:
		_, err = s.number()
	}
	return s.b[start:s.i], err
}

// null consumes a null if one is next.
func (s *scanner) null() (bool, error) {
	if s.peek() != 'n' {
		return false, nil
	}
	return true, s.literal("null")
}

// end checks that only whitespace follows.
func (s *scanner) end() error {
	if s.ws(); s.i < len(s.b) {
		return s.fail("invalid character %q after top-level value", s.b[s.i])
	}
	return nil
}
