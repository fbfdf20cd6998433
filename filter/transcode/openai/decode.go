package openai

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// body is what Parse reads from a request; absent and null fields are nil.
type body struct {
	model         *string
	messages      []message
	hasMessages   bool
	prompt        *promptValue
	stream        *bool
	labelSelector map[string]string
	lora          *string
	// tools and responseFormat are the raw JSON of those fields (nil when
	// absent): they render into the prompt's preamble.
	tools, responseFormat []byte
}

type message struct {
	role       *string
	name       *string
	content    content
	toolCalls  []byte // raw JSON, nil when absent or null
	toolCallID *string
}

// content is a message's "content": a string, an array of parts, or null.
type content struct {
	text  *string
	parts []part
}

type part struct {
	typ, text, imageURL *string
	audioData, audioFmt *string
	fileData, fileID    *string
}

// promptValue is a completion prompt: text (the first of a batch), or
// token ids rendered as text.
type promptValue struct {
	text  string
	batch int // number of prompts
}

// typeError is a field of the wrong JSON type (or shape). Decoding goes on
// after one, so that a syntax error later in the body still wins.
type typeError struct {
	field, want string
}

func (e *typeError) Error() string {
	if e.want == "" {
		return fmt.Sprintf("field %q must not be empty", e.field)
	}
	return fmt.Sprintf("field %q must be %s", e.field, e.want)
}

func isTypeError(err error) bool {
	var te *typeError
	return errors.As(err, &te)
}

var errNotObject = errors.New("request body must be an object")

// fields runs fn on each key of an object. A type error is remembered
// against its key and forgotten if the key comes again and decodes (the last
// duplicate wins, as in encoding/json); syntax errors stop at once. It
// returns the syntax error, else the first remaining type error.
func (s *scanner) fields(fn func(key string) error) error {
	var keys []string
	var errs []error
	err := s.object(func(key string) error {
		err := fn(key)
		if err != nil && !isTypeError(err) {
			return err
		}
		for i, k := range keys {
			if k == key {
				keys = append(keys[:i], keys[i+1:]...)
				errs = append(errs[:i], errs[i+1:]...)
				break
			}
		}
		if err != nil {
			keys, errs = append(keys, key), append(errs, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// elems runs fn on each element of an array, going on past type errors.
func (s *scanner) elems(fn func(i int) error) error {
	var first error
	err := s.array(func(i int) error {
		err := fn(i)
		if err != nil && isTypeError(err) {
			if first == nil {
				first = err
			}
			return nil
		}
		return err
	})
	if err != nil {
		return err
	}
	return first
}

// skipTyped consumes a value of the wrong type and reports it.
func (s *scanner) skipTyped(field, want string) error {
	if _, err := s.skip(); err != nil {
		return err
	}
	return &typeError{field: field, want: want}
}

// decodeBody reads a request body in one pass (see scanner).
func decodeBody(raw []byte) (*body, error) { return decodeBodyTexts(raw, nil) }

// decodeBodyTexts is decodeBody decoding prompt texts into *texts when it
// is not nil (see scanner.texts).
func decodeBodyTexts(raw []byte, texts *[]byte) (*body, error) {
	s := &scanner{b: raw, texts: texts}
	if s.peek() != '{' {
		if _, err := s.skip(); err != nil {
			return nil, err
		}
		if err := s.end(); err != nil {
			return nil, err
		}
		return nil, errNotObject
	}
	b := &body{}
	err := s.fields(func(key string) error {
		switch key {
		case "model":
			return s.optString(&b.model, "model")
		case "stream":
			return s.optBool(&b.stream, "stream")
		case "lora":
			return s.optString(&b.lora, "lora")
		case "messages":
			var err error
			b.messages, b.hasMessages, err = s.messages()
			return err
		case "prompt":
			var err error
			b.prompt, err = s.prompt()
			return err
		case "label_selector":
			var err error
			b.labelSelector, err = s.stringMap("label_selector")
			return err
		case "tools":
			var err error
			b.tools, err = s.skip()
			return err
		case "response_format":
			var err error
			b.responseFormat, err = s.skip()
			return err
		}
		_, err := s.skip()
		return err
	})
	if err == nil {
		err = s.end()
	}
	if err != nil {
		return nil, err
	}
	return b, nil
}

func (s *scanner) optString(dst **string, field string) error {
	return s.optStr(dst, field, false)
}

// optText is optString for prompt text (see scanner.text).
func (s *scanner) optText(dst **string, field string) error {
	return s.optStr(dst, field, true)
}

func (s *scanner) optStr(dst **string, field string, text bool) error {
	*dst = nil
	if isNull, err := s.null(); isNull || err != nil {
		return err
	}
	if s.peek() != '"' {
		return s.skipTyped(field, "a string")
	}
	var v string
	var err error
	if text {
		v, err = s.text()
	} else {
		v, err = s.str()
	}
	if err != nil {
		return err
	}
	*dst = &v
	return nil
}

func (s *scanner) optBool(dst **bool, field string) error {
	*dst = nil
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case 't', 'f':
		v := s.peek() == 't'
		lit := "false"
		if v {
			lit = "true"
		}
		if err := s.literal(lit); err != nil {
			return err
		}
		*dst = &v
		return nil
	}
	return s.skipTyped(field, "a boolean")
}

func (s *scanner) stringMap(field string) (map[string]string, error) {
	if isNull, err := s.null(); isNull || err != nil {
		return nil, err
	}
	if s.peek() != '{' {
		return nil, s.skipTyped(field, "an object of strings")
	}
	m := map[string]string{}
	err := s.fields(func(key string) error {
		delete(m, key)
		var v *string
		if s.peek() == 'n' {
			// null is not a string here (encoding/json would keep "").
			return s.skipTyped(field+"."+key, "a string")
		}
		if err := s.optString(&v, field+"."+key); err != nil {
			return err
		}
		m[key] = *v
		return nil
	})
	if err != nil {
		return nil, err
	}
	return m, nil
}

// messages reads "messages"; set is false for null.
func (s *scanner) messages() ([]message, bool, error) {
	if isNull, err := s.null(); isNull || err != nil {
		return nil, false, err
	}
	if s.peek() != '[' {
		return nil, false, s.skipTyped("messages", "an array")
	}
	msgs := make([]message, 0, 4)
	err := s.elems(func(i int) error {
		f := "messages[" + strconv.Itoa(i) + "]"
		if s.peek() != '{' {
			return s.skipTyped(f, "an object")
		}
		var m message
		err := s.fields(func(key string) error {
			switch key {
			case "role":
				return s.optString(&m.role, f+".role")
			case "name":
				return s.optString(&m.name, f+".name")
			case "tool_call_id":
				return s.optString(&m.toolCallID, f+".tool_call_id")
			case "tool_calls":
				raw, err := s.skip()
				m.toolCalls = nil
				if err == nil && string(raw) != "null" {
					m.toolCalls = raw
				}
				return err
			case "content":
				var err error
				m.content, err = s.content(f + ".content")
				return err
			}
			_, err := s.skip()
			return err
		})
		msgs = append(msgs, m)
		return err
	})
	if err != nil {
		return nil, false, err
	}
	return msgs, true, nil
}

func (s *scanner) content(field string) (content, error) {
	switch s.peek() {
	case 'n':
		return content{}, s.literal("null")
	case '"':
		v, err := s.text()
		return content{text: &v}, err
	case '[':
	default:
		return content{}, s.skipTyped(field, "a string, an array of parts or null")
	}
	c := content{parts: make([]part, 0, 2)}
	err := s.elems(func(j int) error {
		pf := field + "[" + strconv.Itoa(j) + "]"
		if s.peek() != '{' {
			return s.skipTyped(pf, "an object")
		}
		var p part
		err := s.fields(func(key string) error {
			switch key {
			case "type":
				return s.optString(&p.typ, pf+".type")
			case "text":
				return s.optText(&p.text, pf+".text")
			case "image_url":
				p.imageURL = nil
				return s.subObject(pf+".image_url", map[string]**string{"url": &p.imageURL})
			case "input_audio":
				p.audioData, p.audioFmt = nil, nil
				return s.subObject(pf+".input_audio", map[string]**string{"data": &p.audioData, "format": &p.audioFmt})
			case "file":
				p.fileData, p.fileID = nil, nil
				return s.subObject(pf+".file", map[string]**string{"file_data": &p.fileData, "file_id": &p.fileID})
			}
			_, err := s.skip()
			return err
		})
		c.parts = append(c.parts, p)
		return err
	})
	if err != nil {
		return content{}, err
	}
	return c, nil
}

// subObject reads an optional object (null allowed) of optional strings.
func (s *scanner) subObject(field string, dst map[string]**string) error {
	if isNull, err := s.null(); isNull || err != nil {
		return err
	}
	if s.peek() != '{' {
		return s.skipTyped(field, "an object")
	}
	return s.fields(func(k string) error {
		if d, ok := dst[k]; ok {
			return s.optString(d, field+"."+k)
		}
		_, err := s.skip()
		return err
	})
}

const promptWant = "a string, an array of strings or token ids"

// prompt reads "prompt": a string, strings, token ids, or arrays of token
// ids. The first element fixes the shape; every other must match it.
func (s *scanner) prompt() (*promptValue, error) {
	switch s.peek() {
	case 'n':
		return nil, s.literal("null")
	case '"':
		v, err := s.text()
		return &promptValue{text: v, batch: 1}, err
	case '[':
	default:
		return nil, s.skipTyped("prompt", promptWant)
	}
	var (
		shape  byte
		p      promptValue
		tokens strings.Builder
		bad    bool
		n      int
	)
	token := func(first bool) error {
		if !isNumStart(s.peek()) {
			bad = true
			_, err := s.skip()
			return err
		}
		start := s.i
		v, err := s.int64()
		if errors.Is(err, errNotInt) {
			bad = true
			s.i = start
			_, err = s.skip()
			return err
		}
		if first {
			tokens.WriteString(strconv.FormatInt(v, 10))
			tokens.WriteByte(' ')
		}
		return err
	}
	err := s.array(func(i int) error {
		n++
		c := s.peek()
		if i == 0 {
			shape = c
			if isNumStart(c) {
				shape = '0'
			}
		}
		switch {
		case bad:
		case shape == '"' && c == '"':
			if i > 0 {
				// Only the first prompt of a batch is routed on.
				_, _, err := s.rawString()
				return err
			}
			v, err := s.text()
			p.text = v
			return err
		case shape == '0':
			return token(true)
		case shape == '[' && c == '[':
			empty := true
			err := s.array(func(int) error {
				empty = false
				return token(i == 0)
			})
			if empty && i == 0 {
				bad = true
			}
			return err
		}
		bad = true
		_, err := s.skip()
		return err
	})
	if err != nil {
		return nil, err
	}
	switch {
	case n == 0:
		return nil, &typeError{field: "prompt"}
	case bad:
		return nil, &typeError{field: "prompt", want: promptWant}
	case shape == '"':
		p.batch = n
	case shape == '0':
		p.text, p.batch = tokens.String(), 1
	default:
		p.text, p.batch = tokens.String(), n
	}
	return &p, nil
}

func isNumStart(c byte) bool { return c == '-' || c >= '0' && c <= '9' }
