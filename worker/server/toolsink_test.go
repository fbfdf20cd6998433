package server

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// record is a sink that keeps what it was sent.
type record struct {
	texts   []string
	calls   []openai.ToolCall
	reasons []string
}

func (r *record) text(i int, t string, lp []openai.TokenLogprob) error {
	if t != "" {
		r.texts = append(r.texts, t)
	}
	return nil
}
func (r *record) toolCalls(i int, calls []openai.ToolCall) error { r.calls = calls; return nil }
func (r *record) finish(i int, reason string) error {
	r.reasons = append(r.reasons, reason)
	return nil
}
func (r *record) end(*openai.Usage) error { return nil }
func (r *record) fail(*openai.Error)      {}

func autoTools(t *testing.T) *openai.ToolSet {
	t.Helper()
	req, _, e := openai.ParseChat([]byte(`{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[` + cityTool + `]}`))
	if e != nil {
		t.Fatal(e)
	}
	return req.ToolSet
}

// With tool_choice auto, text streams until what may be a call, which is
// held and parsed at the end.
func TestToolSinkAuto(t *testing.T) {
	cases := []struct {
		name   string
		pieces []string
		texts  []string
		call   string // arguments of the one call expected, "" for none
	}{
		{"text then a call", []string{"Sure. <tool_", "call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"},
			[]string{"Sure. "}, `{"city":"Oslo"}`},
		{"a JSON call", []string{` {"name": "get_weather",`, ` "parameters": {"city": "Paris"}}`}, nil, `{"city":"Paris"}`},
		{"plain text", []string{"It is ", "sunny <tool"}, []string{"It is ", "sunny ", "<tool"}, ""},
		{"JSON that is no call", []string{`{"a": 1}`}, []string{`{"a": 1}`}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := &record{}
			s := &toolSink{sink: r, ts: autoTools(t), held: make([]string, 1), sent: make([]bool, 1)}
			for _, p := range c.pieces {
				s.text(0, p, nil)
			}
			s.finish(0, "stop")
			if strings.Join(r.texts, "|") != strings.Join(c.texts, "|") {
				t.Errorf("content %q, want %q", r.texts, c.texts)
			}
			switch {
			case c.call == "" && (r.calls != nil || r.reasons[0] != "stop"):
				t.Errorf("calls %+v, finish %v", r.calls, r.reasons)
			case c.call != "" && (len(r.calls) != 1 || r.calls[0].Function.Arguments != c.call || r.reasons[0] != openai.FinishToolCalls):
				b, _ := json.Marshal(r.calls)
				t.Errorf("calls %s, finish %v; want arguments %s", b, r.reasons, c.call)
			}
		})
	}
}
