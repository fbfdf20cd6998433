package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// Tool is an element of a chat request's tools.
type Tool struct {
	Type     string       `json:"type"`
	Function ToolFunction `json:"function"`
}

// ToolFunction is a tool's function definition.
type ToolFunction struct {
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
}

// Tool choice modes.
const (
	ToolChoiceNone     = "none"     // no tool call: tools are not put in the prompt
	ToolChoiceAuto     = "auto"     // the model may call tools; calls are parsed from its output
	ToolChoiceRequired = "required" // the output is constrained to a call of one of the tools
	ToolChoiceFunction = "function" // the output is constrained to a call of the named tool
)

// ToolSet is a chat request's validated tools and tool_choice.
type ToolSet struct {
	Defs []Tool
	// Raw are the tools elements as the client wrote them (templates get
	// them with their key order).
	Raw []json.RawMessage
	// Choice is one of the ToolChoice modes; Name the function of
	// ToolChoiceFunction.
	Choice string
	Name   string
}

var toolName = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,64}$`)

// parseTools validates tools and tool_choice; nil when the request has no
// tools.
func parseTools(rawTools, rawChoice json.RawMessage) (*ToolSet, *Error) {
	choice := strings.TrimSpace(string(rawChoice))
	var raw []json.RawMessage
	if t := strings.TrimSpace(string(rawTools)); t != "" && t != "null" {
		if err := json.Unmarshal(rawTools, &raw); err != nil {
			return nil, BadRequest("tools", "tools must be an array of tool objects")
		}
	}
	if len(raw) == 0 {
		if choice != "" && choice != "null" && choice != `"none"` {
			return nil, BadRequest("tool_choice", "tool_choice is only allowed when tools are given")
		}
		return nil, nil
	}
	ts := &ToolSet{Raw: raw, Defs: make([]Tool, len(raw)), Choice: ToolChoiceAuto}
	seen := map[string]bool{}
	for i, r := range raw {
		p := fmt.Sprintf("tools[%d]", i)
		var fn json.RawMessage
		var typ string
		if e := decodeObject(r, p, []field{{"type", &typ}, {"function", &fn}}); e != nil {
			return nil, e
		}
		if typ != "function" {
			return nil, BadRequest(p+".type", "%s.type must be \"function\", got %q", p, typ)
		}
		d := &ts.Defs[i]
		d.Type = typ
		if e := decodeObject(fn, p+".function", []field{{"name", &d.Function.Name}, {"description", &d.Function.Description},
			{"parameters", &d.Function.Parameters}}); e != nil {
			return nil, e
		}
		if !toolName.MatchString(d.Function.Name) {
			return nil, BadRequest(p+".function.name", "%s.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got %q", p, d.Function.Name)
		}
		if seen[d.Function.Name] {
			return nil, BadRequest(p+".function.name", "%s.function.name %q is given twice", p, d.Function.Name)
		}
		seen[d.Function.Name] = true
		if ps := bytes.TrimSpace(d.Function.Parameters); len(ps) > 0 && !bytes.Equal(ps, []byte("null")) && ps[0] != '{' {
			return nil, BadRequest(p+".function.parameters", "%s.function.parameters must be a JSON schema object", p)
		}
	}
	switch choice {
	case "", "null", `"auto"`:
	case `"none"`:
		ts.Choice = ToolChoiceNone
	case `"required"`:
		ts.Choice = ToolChoiceRequired
	default:
		var named struct {
			Type     string `json:"type"`
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		}
		if err := json.Unmarshal(rawChoice, &named); err != nil || named.Type != "function" {
			return nil, BadRequest("tool_choice", `tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}`)
		}
		if !seen[named.Function.Name] {
			return nil, BadRequest("tool_choice", "tool_choice names function %q, which is not among the tools", named.Function.Name)
		}
		ts.Choice, ts.Name = ToolChoiceFunction, named.Function.Name
	}
	return ts, nil
}

// Constrained reports whether the output must be a tool call (required or
// a named function): CallSchema then gives its JSON schema.
func (ts *ToolSet) Constrained() bool {
	return ts != nil && (ts.Choice == ToolChoiceRequired || ts.Choice == ToolChoiceFunction)
}

// CallSchema is the JSON schema of one call of the allowed tools:
// {"name": <one of them>, "arguments": <its parameters>}.
func (ts *ToolSet) CallSchema() []byte {
	var alts []json.RawMessage
	for _, d := range ts.Defs {
		if ts.Choice == ToolChoiceFunction && d.Function.Name != ts.Name {
			continue
		}
		params := bytes.TrimSpace(d.Function.Parameters)
		if len(params) == 0 || bytes.Equal(params, []byte("null")) {
			params = []byte(`{"type":"object"}`)
		}
		name, _ := json.Marshal(d.Function.Name)
		alts = append(alts, json.RawMessage(fmt.Sprintf(
			`{"type":"object","properties":{"name":{"const":%s},"arguments":%s},"required":["name","arguments"],"additionalProperties":false}`, name, params)))
	}
	if len(alts) == 1 {
		return alts[0]
	}
	b, _ := json.Marshal(map[string]any{"anyOf": alts})
	return b
}

// ToolCall is a tool call of an assistant message (Index only in stream
// deltas).
type ToolCall struct {
	Index    *int             `json:"index,omitempty"`
	ID       string           `json:"id"`
	Type     string           `json:"type"`
	Function ToolCallFunction `json:"function"`
}

// ToolCallFunction is the function a tool call calls; Arguments is the
// JSON text of its arguments object.
type ToolCallFunction struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// FinishToolCalls is the finish reason of an answer that calls tools.
const FinishToolCalls = "tool_calls"

// Tool call forms in model output.
var hermesCall = regexp.MustCompile(`(?s)<tool_call>\s*(.*?)\s*(?:</tool_call>|$)`)

// ParseToolCalls finds the tool calls in a model's output: Hermes/Qwen's
// <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, or the
// whole output being Llama 3's {"name": ..., "parameters": {...}} (several
// separated by ";", optionally after <|python_tag|>). Only calls of the
// given tools count; content is the text outside the calls. ok is false
// when the output holds no call.
func (ts *ToolSet) ParseToolCalls(text string) (content string, calls []ToolCall, ok bool) {
	if ms := hermesCall.FindAllStringSubmatchIndex(text, -1); ms != nil {
		var rest strings.Builder
		last := 0
		for _, m := range ms {
			c, ok := ts.parseCall(text[m[2]:m[3]])
			if !ok {
				return text, nil, false
			}
			calls = append(calls, c)
			rest.WriteString(text[last:m[0]])
			last = m[1]
		}
		rest.WriteString(text[last:])
		return strings.TrimSpace(rest.String()), calls, true
	}
	body := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(text), "<|python_tag|>"))
	if !strings.HasPrefix(body, "{") {
		return text, nil, false
	}
	for _, part := range splitCalls(body) {
		c, ok := ts.parseCall(part)
		if !ok {
			return text, nil, false
		}
		calls = append(calls, c)
	}
	return "", calls, len(calls) > 0
}

// splitCalls splits "{...}; {...}" into its JSON objects.
func splitCalls(s string) []string {
	var out []string
	dec := json.NewDecoder(strings.NewReader(s))
	for {
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			if off := dec.InputOffset(); int(off) < len(s) {
				rest := strings.TrimLeft(s[off:], " \t\r\n;")
				if rest != "" && rest != s[off:] {
					return append(out, splitCalls(rest)...)
				}
				return append(out, s[off:]) // not JSON: parseCall refuses it
			}
			return out
		}
		out = append(out, string(v))
	}
}

// parseCall reads {"name": ..., "arguments"|"parameters": {...}} naming one
// of the tools.
func (ts *ToolSet) parseCall(s string) (ToolCall, bool) {
	var c struct {
		Name       string          `json:"name"`
		Arguments  json.RawMessage `json:"arguments"`
		Parameters json.RawMessage `json:"parameters"`
	}
	if err := json.Unmarshal([]byte(s), &c); err != nil {
		return ToolCall{}, false
	}
	known := false
	for _, d := range ts.Defs {
		known = known || d.Function.Name == c.Name
	}
	if !known {
		return ToolCall{}, false
	}
	args := bytes.TrimSpace(c.Arguments)
	if len(args) == 0 {
		args = bytes.TrimSpace(c.Parameters)
	}
	if len(args) > 0 && args[0] == '"' {
		// Arguments written as a JSON string of JSON.
		var inner string
		if json.Unmarshal(args, &inner) == nil && json.Valid([]byte(inner)) {
			args = []byte(inner)
		}
	}
	if len(args) == 0 || bytes.Equal(args, []byte("null")) {
		args = []byte("{}")
	}
	var obj map[string]json.RawMessage
	if json.Unmarshal(args, &obj) != nil {
		return ToolCall{}, false
	}
	var buf bytes.Buffer
	json.Compact(&buf, args)
	return ToolCall{ID: "call_" + randomID(), Type: "function", Function: ToolCallFunction{Name: c.Name, Arguments: buf.String()}}, true
}

// ToolHold tells how much of a streamed output may be sent as content
// while tool calls are parsed at the end: everything before a (possible)
// "<tool_call>", and nothing of an output that starts like a JSON call.
func ToolHold(text string, sentAny bool) (send int) {
	if i := strings.Index(text, "<tool_call>"); i >= 0 {
		return i
	}
	if !sentAny {
		t := strings.TrimLeft(text, " \t\r\n")
		for _, start := range []string{"{", "<|python_tag|>"} {
			if strings.HasPrefix(t, start) || (t != "" && strings.HasPrefix(start, t)) {
				return 0
			}
		}
		if t == "" {
			return 0
		}
	}
	// Hold a tail that may be the start of "<tool_call>".
	for k := min(len(text), len("<tool_call>")-1); k > 0; k-- {
		if strings.HasSuffix(text, "<tool_call>"[:k]) {
			return len(text) - k
		}
	}
	return len(text)
}
