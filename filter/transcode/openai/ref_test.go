package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// refDecode is an independent reference for decodeBody, built on
// encoding/json: json.Valid for syntax, map[string]json.RawMessage for
// objects (exact keys, last duplicate wins), then typed checks field by field.
func refDecode(raw []byte) (*body, error) {
	if !json.Valid(raw) {
		return nil, errors.New("invalid")
	}
	if err := depthOK(raw); err != nil {
		return nil, err
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(raw, &top); err != nil || top == nil {
		return nil, errors.New("not an object")
	}
	b := &body{}
	var err error
	if b.model, err = refString(top["model"]); err != nil {
		return nil, err
	}
	if b.lora, err = refString(top["lora"]); err != nil {
		return nil, err
	}
	if v, ok := top["stream"]; ok && !isNull(v) {
		var x bool
		if err := json.Unmarshal(v, &x); err != nil {
			return nil, err
		}
		b.stream = &x
	}
	if v, ok := top["label_selector"]; ok && !isNull(v) {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(v, &m); err != nil || m == nil {
			return nil, errors.New("label_selector")
		}
		b.labelSelector = map[string]string{}
		for k, e := range m {
			s, err := refString(e)
			if err != nil || s == nil {
				return nil, errors.New("label value")
			}
			b.labelSelector[k] = *s
		}
	}
	if v, ok := top["messages"]; ok && !isNull(v) {
		var arr []json.RawMessage
		if err := json.Unmarshal(v, &arr); err != nil || arr == nil {
			return nil, errors.New("messages")
		}
		b.hasMessages = true
		b.messages = make([]message, 0, len(arr))
		for _, e := range arr {
			var mm map[string]json.RawMessage
			if err := json.Unmarshal(e, &mm); err != nil || mm == nil {
				return nil, errors.New("message")
			}
			var m message
			for key, dst := range map[string]**string{"role": &m.role, "name": &m.name, "tool_call_id": &m.toolCallID} {
				if *dst, err = refString(mm[key]); err != nil {
					return nil, err
				}
			}
			if tc, ok := mm["tool_calls"]; ok && !isNull(tc) {
				m.toolCalls = tc
			}
			if c, ok := mm["content"]; ok && !isNull(c) {
				switch c[0] {
				case '"':
					m.content.text, _ = refString(c)
				case '[':
					var parts []json.RawMessage
					_ = json.Unmarshal(c, &parts)
					m.content.parts = make([]part, 0, len(parts))
					for _, pe := range parts {
						var pm map[string]json.RawMessage
						if err := json.Unmarshal(pe, &pm); err != nil || pm == nil {
							return nil, errors.New("part")
						}
						var p part
						for key, dst := range map[string]**string{"type": &p.typ, "text": &p.text} {
							if *dst, err = refString(pm[key]); err != nil {
								return nil, err
							}
						}
						subs := map[string]map[string]**string{
							"image_url":   {"url": &p.imageURL},
							"input_audio": {"data": &p.audioData, "format": &p.audioFmt},
							"file":        {"file_data": &p.fileData, "file_id": &p.fileID},
						}
						for key, fields := range subs {
							sv, ok := pm[key]
							if !ok || isNull(sv) {
								continue
							}
							var sm map[string]json.RawMessage
							if err := json.Unmarshal(sv, &sm); err != nil || sm == nil {
								return nil, errors.New(key)
							}
							for fk, dst := range fields {
								if *dst, err = refString(sm[fk]); err != nil {
									return nil, err
								}
							}
						}
						m.content.parts = append(m.content.parts, p)
					}
				default:
					return nil, errors.New("content")
				}
			}
			b.messages = append(b.messages, m)
		}
	}
	if v, ok := top["prompt"]; ok && !isNull(v) {
		p, err := refPrompt(v)
		if err != nil {
			return nil, err
		}
		b.prompt = p
	}
	return b, nil
}

func isNull(v json.RawMessage) bool { return string(v) == "null" }

func refString(v json.RawMessage) (*string, error) {
	if v == nil || isNull(v) {
		return nil, nil
	}
	var s string
	if err := json.Unmarshal(v, &s); err != nil {
		return nil, err
	}
	return &s, nil
}

func refPrompt(v json.RawMessage) (*promptValue, error) {
	var s string
	if json.Unmarshal(v, &s) == nil {
		return &promptValue{text: s, batch: 1}, nil
	}
	var ss []string
	if json.Unmarshal(v, &ss) == nil && len(ss) > 0 {
		return &promptValue{text: ss[0], batch: len(ss)}, nil
	}
	var toks []int64
	if json.Unmarshal(v, &toks) == nil && len(toks) > 0 {
		return &promptValue{text: tokText(toks), batch: 1}, nil
	}
	var batches [][]int64
	if json.Unmarshal(v, &batches) == nil && len(batches) > 0 && len(batches[0]) > 0 {
		for _, b := range batches {
			if b == nil { // a null element, which [][]int64 accepts
				return nil, errors.New("null batch")
			}
		}
		return &promptValue{text: tokText(batches[0]), batch: len(batches)}, nil
	}
	return nil, errors.New("prompt")
}

func tokText(toks []int64) string {
	var b strings.Builder
	for _, t := range toks {
		b.WriteString(strconv.FormatInt(t, 10))
		b.WriteByte(' ')
	}
	return b.String()
}

// depthOK mirrors the scanner's nesting bound.
func depthOK(raw []byte) error {
	d := 0
	in := false
	for i := 0; i < len(raw); i++ {
		c := raw[i]
		switch {
		case in && c == '\\':
			i++
		case c == '"':
			in = !in
		case !in && (c == '{' || c == '['):
			if d++; d > maxDepth {
				return errors.New("depth")
			}
		case !in && (c == '}' || c == ']'):
			d--
		}
	}
	return nil
}

func FuzzDecodeMatchesReference(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u","detail":"low"}}]}],"stream":true}`,
		`{"model":"m","prompt":[1,2],"prompt":"x"}`,
		`{"model":"m","prompt":[[1,2],[3]],"lora":"x","label_selector":{"k":"v"}}`,
		`{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_call_id":"1","content":"42"}]}`,
		`{"model":"m","model":5}`,
		`{"model":5,"model":"m"}`,
		`{"stream":"x","stream":false,"model":"é\u00e9\ud83d\ude00"}`,
		`{"model":"m","prompt":["a",1]}`,
		`{"model":"m","prompt":[-0, 12e3]}`,
		`{"model":"m","messages":[{"content":[{"type":"file","file":{"file_id":"f"}},{"type":"input_audio","input_audio":{"data":"d","format":"wav"}}]}]}`,
		` [1,2] `,
		`{"a":{"b":[{"c":[true,false,null,1.5e-3]}]}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, gerr := decodeBody(raw)
		want, werr := refDecode(raw)
		if (gerr == nil) != (werr == nil) {
			t.Fatalf("%q: decodeBody err %v, reference err %v", raw, gerr, werr)
		}
		if gerr != nil {
			return
		}
		normalize(got)
		normalize(want)
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%q:\n got  %s\n want %s", raw, dump(got), dump(want))
		}
	})
}

// normalize makes empty-vs-nil and raw-whitespace differences irrelevant.
func normalize(b *body) {
	for i := range b.messages {
		if b.messages[i].toolCalls != nil {
			b.messages[i].toolCalls = bytes.TrimSpace(b.messages[i].toolCalls)
		}
	}
}

func dump(b *body) string {
	out, _ := json.Marshal(map[string]any{"model": b.model, "stream": b.stream, "lora": b.lora, "sel": b.labelSelector,
		"has": b.hasMessages, "n": len(b.messages), "prompt": b.prompt})
	return string(out)
}
