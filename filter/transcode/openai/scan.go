package openai

import (
	"fmt"
	"strconv"
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

// keyString decodes an object key (short: the copy is cheap).
func keyString(raw []byte, slow bool) string {
	if !slow {
		return string(raw[1 : len(raw)-1])
	}
	return unquote(raw)
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
