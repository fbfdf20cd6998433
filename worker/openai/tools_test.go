package openai

import (
	"encoding/json"
	"testing"
)

func toolSet(t *testing.T, choice string) *ToolSet {
	t.Helper()
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[` + weatherTool +
		`,{"type":"function","function":{"name":"get_time"}}]`
	if choice != "" {
		body += `,"tool_choice":` + choice
	}
	req, p, err := ParseChat([]byte(body + "}"))
	if err != nil {
		t.Fatal(err)
	}
	if req.ToolSet.Constrained() != (p.JSONSchema != nil) {
		t.Fatalf("tool_choice %s: constrained %v but schema %s", choice, req.ToolSet.Constrained(), p.JSONSchema)
	}
	return req.ToolSet
}

func TestToolChoice(t *testing.T) {
	for choice, want := range map[string]string{"": ToolChoiceAuto, `"auto"`: ToolChoiceAuto, `"none"`: ToolChoiceNone,
		`"required"`: ToolChoiceRequired, `{"type":"function","function":{"name":"get_time"}}`: ToolChoiceFunction} {
		if ts := toolSet(t, choice); ts.Choice != want {
			t.Errorf("tool_choice %s: %q, want %q", choice, ts.Choice, want)
		}
	}
	var named struct {
		Properties struct {
			Name struct {
				Const string `json:"const"`
			} `json:"name"`
		} `json:"properties"`
	}
	if err := json.Unmarshal(toolSet(t, `{"type":"function","function":{"name":"get_time"}}`).CallSchema(), &named); err != nil || named.Properties.Name.Const != "get_time" {
		t.Errorf("named schema: %+v %v", named, err)
	}
	var required struct {
		AnyOf []json.RawMessage `json:"anyOf"`
	}
	if err := json.Unmarshal(toolSet(t, `"required"`).CallSchema(), &required); err != nil || len(required.AnyOf) != 2 {
		t.Errorf("required schema: %+v %v", required, err)
	}
}

func TestParseToolCalls(t *testing.T) {
	ts := toolSet(t, "")
	cases := []struct {
		name, text, content string
		calls               []ToolCallFunction
	}{
		{"hermes", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", "",
			[]ToolCallFunction{{"get_weather", `{"city":"Paris"}`}}},
		{"hermes two and text", "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
			"Let me look.", []ToolCallFunction{{"get_weather", `{"city":"Oslo"}`}, {"get_time", `{}`}}},
		{"hermes unclosed at the end", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}", "", []ToolCallFunction{{"get_time", `{}`}}},
		{"llama3 json", `{"name": "get_weather", "parameters": {"city": "Rome"}}`, "", []ToolCallFunction{{"get_weather", `{"city":"Rome"}`}}},
		{"llama3 python tag and two", `<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Bern"}}`, "",
			[]ToolCallFunction{{"get_time", `{}`}, {"get_weather", `{"city":"Bern"}`}}},
		{"arguments as a string", `{"name": "get_weather", "arguments": "{\"city\": \"Lima\"}"}`, "", []ToolCallFunction{{"get_weather", `{"city":"Lima"}`}}},
		{"plain text", "It is sunny.", "It is sunny.", nil},
		{"unknown tool", `{"name": "rm_rf", "parameters": {}}`, `{"name": "rm_rf", "parameters": {}}`, nil},
		{"broken json", "<tool_call>{\"name\": \"get_time\", </tool_call>", "<tool_call>{\"name\": \"get_time\", </tool_call>", nil},
		{"json that is no call", `{"city": "Paris"}`, `{"city": "Paris"}`, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			content, calls, ok := ts.ParseToolCalls(c.text)
			if ok != (c.calls != nil) || content != c.content || len(calls) != len(c.calls) {
				t.Fatalf("got ok=%v content %q calls %+v", ok, content, calls)
			}
			for i, call := range calls {
				if call.Function != c.calls[i] || call.Type != "function" || len(call.ID) < 10 {
					t.Errorf("call %d: %+v, want %+v", i, call, c.calls[i])
				}
			}
		})
	}
}

func TestToolHold(t *testing.T) {
	cases := []struct {
		text    string
		sentAny bool
		send    int
	}{
		{"Hello", false, 5},
		{"  {\"name\"", false, 0},
		{"<|python", false, 0},
		{"", false, 0},
		{"Sure. <tool_call>{", true, 6},
		{"Sure. <tool", true, 6},
		{"{ not first", true, 11},
	}
	for _, c := range cases {
		if got := ToolHold(c.text, c.sentAny); got != c.send {
			t.Errorf("ToolHold(%q, %v) = %d, want %d", c.text, c.sentAny, got, c.send)
		}
	}
}
