package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/ardanlabs/jinja"
)

// NewJinjaTemplate compiles a model's own chat template (its GGUF
// tokenizer.chat_template, a Hugging Face Jinja template) with the model's
// bos_token and eos_token texts. Render then evaluates it as transformers'
// apply_chat_template does: messages, tools, add_generation_prompt,
// bos_token, eos_token, raise_exception, namespace() and Python string
// methods (github.com/ardanlabs/jinja, an engine written for these
// templates).
func NewJinjaTemplate(source, bos, eos string) (Template, error) {
	tpl, err := jinja.Compile(source)
	if err != nil {
		return Template{}, err
	}
	return Template{Family: FamilyJinja, BOS: bos, EOS: eos, jinja: tpl, source: source}, nil
}

// FamilyJinja is a template evaluated from its Jinja source.
const FamilyJinja Family = "jinja"

// RendersTools reports whether the template places tool definitions in
// the prompt: a Jinja template that reads `tools`. The hand-written
// families do not.
func (t Template) RendersTools() bool {
	return t.jinja != nil && strings.Contains(t.source, "tools")
}

// Describe says in a few words which template renders prompts (for the
// log at load).
func (t Template) Describe() string {
	if t.jinja != nil {
		return "the model's own Jinja chat template"
	}
	if t.why != "" {
		return fmt.Sprintf("the built-in %s template (%s)", t.Family, t.why)
	}
	return fmt.Sprintf("the built-in %s template", t.Family)
}

// renderJinja evaluates the model's template. Message content is text
// (parts joined), "developer" is "system", an assistant's tool calls carry
// their arguments as objects (HF templates apply tojson to them, as
// transformers and vLLM pass them), and every JSON object keeps its key
// order, so tool schemas reach the prompt as the client wrote them.
func (t Template) renderJinja(msgs []Message, tools []json.RawMessage, gen bool) (out string, err error) {
	defer func() {
		// The engine is third-party code run on client input: a panic in it
		// is this request's failure, not the worker's.
		if p := recover(); p != nil {
			out, err = "", Internal("the model's chat template failed: %v", p)
		}
	}()
	ms := make([]jinja.Value, len(msgs))
	for i, m := range msgs {
		d := jinja.NewDict()
		dd := d.AsDict()
		role := m.Role
		if role == RoleDeveloper {
			role = RoleSystem
		}
		dd.Set("role", jinja.NewString(role))
		dd.Set("content", jinja.NewString(m.Content.String()))
		if m.Name != "" {
			dd.Set("name", jinja.NewString(m.Name))
		}
		if m.ToolCallID != "" {
			dd.Set("tool_call_id", jinja.NewString(m.ToolCallID))
		}
		if len(m.ToolCalls) > 0 {
			calls, err := templateToolCalls(m.ToolCalls)
			if err != nil {
				return "", BadRequest(fmt.Sprintf("messages[%d].tool_calls", i), "messages[%d].tool_calls: %v", i, err)
			}
			dd.Set("tool_calls", calls)
		}
		ms[i] = d
	}
	data := map[string]jinja.Value{
		"messages":              jinja.NewList(ms),
		"add_generation_prompt": jinja.NewBool(gen),
		"bos_token":             jinja.NewString(t.BOS),
		"eos_token":             jinja.NewString(t.EOS),
	}
	if len(tools) > 0 {
		ts := make([]jinja.Value, len(tools))
		for i, raw := range tools {
			v, err := jinjaValue(raw)
			if err != nil {
				return "", BadRequest(fmt.Sprintf("tools[%d]", i), "tools[%d]: %v", i, err)
			}
			ts[i] = v
		}
		data["tools"] = jinja.NewList(ts)
	}
	if out, err = t.jinja.RenderValues(data); err != nil {
		return "", BadRequest("messages", "the model's chat template cannot render this conversation: %v", err)
	}
	return out, nil
}

// templateToolCalls converts an assistant message's tool_calls, parsing
// each function.arguments string into the object it encodes.
func templateToolCalls(raw json.RawMessage) (jinja.Value, error) {
	v, err := jinjaValue(raw)
	if err != nil {
		return v, err
	}
	if !v.IsList() {
		return v, errors.New("must be an array")
	}
	for _, c := range v.AsList().Items {
		if !c.IsDict() {
			return v, errors.New("each tool call must be an object")
		}
		fn, ok := c.AsDict().Get("function")
		if !ok || !fn.IsDict() {
			continue
		}
		args, ok := fn.AsDict().Get("arguments")
		if !ok || !args.IsString() {
			continue
		}
		if parsed, err := jinjaValue([]byte(args.AsString())); err == nil {
			fn.AsDict().Set("arguments", parsed)
		}
	}
	return v, nil
}

// jinjaValue decodes JSON into template values, objects in key order.
func jinjaValue(raw []byte) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeValue(dec)
	if err != nil {
		return v, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return v, errors.New("unexpected data after the JSON value")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder) (jinja.Value, error) {
	tok, err := dec.Token()
	if err != nil {
		return jinja.None(), err
	}
	switch x := tok.(type) {
	case json.Delim:
		switch x {
		case '{':
			d := jinja.NewDict()
			for dec.More() {
				k, err := dec.Token()
				if err != nil {
					return d, err
				}
				v, err := decodeValue(dec)
				if err != nil {
					return d, err
				}
				d.AsDict().Set(k.(string), v)
			}
			_, err := dec.Token() // '}'
			return d, err
		case '[':
			var items []jinja.Value
			for dec.More() {
				v, err := decodeValue(dec)
				if err != nil {
					return jinja.None(), err
				}
				items = append(items, v)
			}
			_, err := dec.Token() // ']'
			return jinja.NewList(items), err
		}
		return jinja.None(), fmt.Errorf("unexpected %v", x)
	case json.Number:
		return jinja.FromGoValue(x), nil
	case string:
		return jinja.NewString(x), nil
	case bool:
		return jinja.NewBool(x), nil
	case nil:
		return jinja.None(), nil
	}
	return jinja.None(), fmt.Errorf("unexpected JSON token %v", tok)
}
