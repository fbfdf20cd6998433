package openai

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
)

func TestParseChatValidationErrors(t *testing.T) {
	msgs := `"messages":[{"role":"user","content":"hi"}]`
	cases := []struct {
		name, body, param, msg string
	}{
		{"empty body", ``, "", "request body is empty"},
		{"whitespace body", "  \n", "", "request body is empty"},
		{"truncated", `{"model":"m",`, "", "unexpected end of input"},
		{"syntax", `{"model":"m" "x":1}`, "", "invalid JSON at byte 14"},
		{"trailing data", `{"model":"m",` + msgs + `} {}`, "", "unexpected data after the top-level value"},
		{"not an object", `[1,2]`, "", "must be a JSON object"},
		{"null", `null`, "", "must be a JSON object"},
		{"invalid utf8", "{\"model\":\"\xff\"}", "", "not valid UTF-8"},
		{"missing model", `{` + msgs + `}`, "model", "model is required"},
		{"model wrong type", `{"model":3,` + msgs + `}`, "model", "model: expected a string, got number"},
		{"missing messages", `{"model":"m"}`, "messages", "messages is required"},
		{"null messages", `{"model":"m","messages":null}`, "messages", "messages is required"},
		{"empty messages", `{"model":"m","messages":[]}`, "messages", "at least one message"},
		{"messages not array", `{"model":"m","messages":"hi"}`, "messages", "messages: expected an array, got string"},
		{"message not object", `{"model":"m","messages":["hi"]}`, "messages[0]", "messages[0] must be a JSON object"},
		{"missing role", `{"model":"m","messages":[{"content":"hi"}]}`, "messages[0].role", "messages[0].role is required"},
		{"unknown role", `{"model":"m","messages":[{"role":"user","content":"a"},{"role":"robot","content":"hi"}]}`, "messages[1].role", `"robot" is not one of`},
		{"missing content", `{"model":"m","messages":[{"role":"user"}]}`, "messages[0].content", "content is required for role user"},
		{"null content", `{"model":"m","messages":[{"role":"system","content":null}]}`, "messages[0].content", "content is required for role system"},
		{"content number", `{"model":"m","messages":[{"role":"user","content":5}]}`, "messages[0].content", "must be a string or an array of content parts"},
		{"part without type", `{"model":"m","messages":[{"role":"user","content":[{"text":"a"}]}]}`, "messages[0].content[0].type", "type is required"},
		{"unknown part", `{"model":"m","messages":[{"role":"user","content":[{"type":"video","text":"a"}]}]}`, "messages[0].content[0].type", `"video" is not supported`},
		{"image without url", `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, "messages[0].content[0].image_url", "url is required"},
		{"negative max_tokens", `{"model":"m",` + msgs + `,"max_tokens":-5}`, "max_tokens", "max_tokens must be at least 1, got -5"},
		{"zero max_tokens", `{"model":"m",` + msgs + `,"max_tokens":0}`, "max_tokens", "at least 1"},
		{"fractional max_tokens", `{"model":"m",` + msgs + `,"max_tokens":1.5}`, "max_tokens", "max_tokens: expected an integer, got number"},
		{"string max_tokens", `{"model":"m",` + msgs + `,"max_tokens":"10"}`, "max_tokens", "expected an integer, got string"},
		{"negative max_completion_tokens", `{"model":"m",` + msgs + `,"max_completion_tokens":-1}`, "max_completion_tokens", "at least 1"},
		{"disagreeing limits", `{"model":"m",` + msgs + `,"max_tokens":5,"max_completion_tokens":6}`, "max_completion_tokens", "disagree"},
		{"temperature high", `{"model":"m",` + msgs + `,"temperature":2.5}`, "temperature", "between 0 and 2"},
		{"temperature negative", `{"model":"m",` + msgs + `,"temperature":-0.1}`, "temperature", "between 0 and 2"},
		{"top_p zero", `{"model":"m",` + msgs + `,"top_p":0}`, "top_p", "greater than 0"},
		{"top_p high", `{"model":"m",` + msgs + `,"top_p":1.01}`, "top_p", "at most 1"},
		{"n too many", `{"model":"m",` + msgs + `,"n":17}`, "n", "n must be between 1 and 16"},
		{"n zero", `{"model":"m",` + msgs + `,"n":0}`, "n", "n must be between 1 and 16"},
		{"seed string", `{"model":"m",` + msgs + `,"seed":"x"}`, "seed", "expected an integer"},
		{"stream_options without stream", `{"model":"m",` + msgs + `,"stream_options":{"include_usage":true}}`, "stream_options", "only allowed when stream is true"},
		{"stream not bool", `{"model":"m",` + msgs + `,"stream":"yes"}`, "stream", "expected a boolean"},
		{"stop empty", `{"model":"m",` + msgs + `,"stop":""}`, "stop", "stop[0] is empty"},
		{"stop number", `{"model":"m",` + msgs + `,"stop":4}`, "stop", "must be a string or an array of strings"},
		{"stop token ids", `{"model":"m",` + msgs + `,"stop":[1,2]}`, "stop", "token-id arrays are not supported"},
		{"too many stops", `{"model":"m",` + msgs + `,"stop":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]}`, "stop", "at most 16"},
		{"stop too long", `{"model":"m",` + msgs + `,"stop":"` + strings.Repeat("x", 300) + `"}`, "stop", "longer than 256"},
		{"min_tokens negative", `{"model":"m",` + msgs + `,"min_tokens":-1}`, "min_tokens", "must not be negative"},
		{"min over max", `{"model":"m",` + msgs + `,"min_tokens":9,"max_tokens":4}`, "min_tokens", "exceeds max_tokens"},
		{"ignore_eos not bool", `{"model":"m",` + msgs + `,"ignore_eos":1}`, "ignore_eos", "expected a boolean"},
		{"frequency_penalty high", `{"model":"m",` + msgs + `,"frequency_penalty":2.5}`, "frequency_penalty", "between -2 and 2"},
		{"presence_penalty low", `{"model":"m",` + msgs + `,"presence_penalty":-3}`, "presence_penalty", "between -2 and 2"},
		{"stop_token_ids negative", `{"model":"m",` + msgs + `,"stop_token_ids":[5,-1]}`, "stop_token_ids", "negative"},
		{"stop_token_ids not ints", `{"model":"m",` + msgs + `,"stop_token_ids":["a"]}`, "stop_token_ids", ""},
		{"logprobs not bool", `{"model":"m",` + msgs + `,"logprobs":3}`, "logprobs", "must be a boolean"},
		{"top_logprobs without logprobs", `{"model":"m",` + msgs + `,"top_logprobs":3}`, "top_logprobs", "needs logprobs set to true"},
		{"top_logprobs too many", `{"model":"m",` + msgs + `,"logprobs":true,"top_logprobs":21}`, "top_logprobs", "between 0 and 20"},
		{"tool type", `{"model":"m",` + msgs + `,"tools":[{"type":"retrieval","function":{"name":"f"}}]}`, "tools[0].type", `must be "function"`},
		{"tool name", `{"model":"m",` + msgs + `,"tools":[{"type":"function","function":{"name":"a b"}}]}`, "tools[0].function.name", "1 to 64"},
		{"tool twice", `{"model":"m",` + msgs + `,"tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"f"}}]}`, "tools[1].function.name", "twice"},
		{"tool parameters", `{"model":"m",` + msgs + `,"tools":[{"type":"function","function":{"name":"f","parameters":[]}}]}`, "tools[0].function.parameters", "JSON schema object"},
		{"tool_choice without tools", `{"model":"m",` + msgs + `,"tool_choice":"required"}`, "tool_choice", "only allowed when tools"},
		{"tool_choice unknown", `{"model":"m",` + msgs + `,"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"always"}`, "tool_choice", `"none", "auto", "required"`},
		{"tool_choice other name", `{"model":"m",` + msgs + `,"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}}`, "tool_choice", "not among the tools"},
		{"tool_choice and json", `{"model":"m",` + msgs + `,"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required","response_format":{"type":"json_object"}}`, "response_format", "both constrain"},
		{"unknown format", `{"model":"m",` + msgs + `,"response_format":{"type":"yaml"}}`, "response_format.type", `"yaml" is not one of`},
		{"json_schema without schema", `{"model":"m",` + msgs + `,"response_format":{"type":"json_schema"}}`, "response_format.json_schema", "is required"},
		{"json_schema not an object", `{"model":"m",` + msgs + `,"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":[1]}}}`, "response_format.json_schema.schema", "must be a JSON schema object"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, _, err := ParseChat([]byte(c.body))
			if err == nil {
				t.Fatalf("accepted: %+v", req)
			}
			if err.Status != http.StatusBadRequest || err.Type != TypeInvalidRequest {
				t.Errorf("status %d type %q, want 400 %s", err.Status, err.Type, TypeInvalidRequest)
			}
			if err.Param != c.param {
				t.Errorf("param %q, want %q (message %q)", err.Param, c.param, err.Message)
			}
			if !strings.Contains(err.Message, c.msg) {
				t.Errorf("message %q does not mention %q", err.Message, c.msg)
			}
		})
	}
}

func TestParseChatAccepts(t *testing.T) {
	body := `{
		"model": "qwen",
		"messages": [
			{"role": "system", "content": "Be brief."},
			{"role": "developer", "content": "Use English."},
			{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, {"type": "text", "text": "here"}]},
			{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
			{"role": "tool", "tool_call_id": "c1", "content": "42"}
		],
		"stream": true, "stream_options": {"include_usage": true},
		"max_completion_tokens": 64, "temperature": 0, "top_p": 0.5, "seed": -3,
		"stop": ["\n\n", "END"], "ignore_eos": true, "min_tokens": 8, "n": 1,
		"frequency_penalty": 0.1, "presence_penalty": -0.5, "logprobs": false, "top_logprobs": 0,
		"stop_token_ids": [7, 9],
		"tools": [], "response_format": {"type": "text"}, "parallel_tool_calls": false
	}`
	req, p, err := ParseChat([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := Params{Model: "qwen", MaxTokens: 64, Temperature: 0, TopP: 0.5, Stop: []string{"\n\n", "END"},
		IgnoreEOS: true, MinTokens: 8, Stream: true, IncludeUsage: true, FrequencyPenalty: 0.1, PresencePenalty: -0.5,
		StopTokenIDs: []int{7, 9}, N: 1}
	if p.Seed == nil || *p.Seed != -3 {
		t.Errorf("seed %v", p.Seed)
	}
	p.Seed = nil
	if got, _ := json.Marshal(p); string(got) != mustJSON(t, want) {
		t.Errorf("params\n got %s\nwant %s", got, mustJSON(t, want))
	}
	if len(req.Messages) != 5 {
		t.Fatalf("%d messages", len(req.Messages))
	}
	if got := req.Messages[2].Content.String(); got != "look\nhere" {
		t.Errorf("parts text %q", got)
	}
	if req.Messages[2].Content.Parts[1].ImageURL.URL != "https://x/cat.png" {
		t.Errorf("image part %+v", req.Messages[2].Content.Parts[1])
	}
	if req.Messages[3].Content.Set || len(req.Messages[3].ToolCalls) == 0 {
		t.Errorf("assistant tool-call message %+v", req.Messages[3])
	}
	if req.Messages[4].ToolCallID != "c1" {
		t.Errorf("tool message %+v", req.Messages[4])
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestParseChatDefaults(t *testing.T) {
	_, p, err := ParseChat([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":"###","max_tokens":null}`))
	if err != nil {
		t.Fatal(err)
	}
	if p.MaxTokens != 0 || p.Temperature != DefaultTemperature || p.TopP != DefaultTopP || p.Seed != nil ||
		p.Stream || p.IncludeUsage || p.IgnoreEOS || p.MinTokens != 0 || len(p.Stop) != 1 || p.Stop[0] != "###" {
		t.Errorf("defaults: %+v", p)
	}
	// max_tokens and max_completion_tokens may both be sent if they agree.
	_, p, err = ParseChat([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":7,"max_completion_tokens":7}`))
	if err != nil || p.MaxTokens != 7 {
		t.Errorf("agreeing limits: %+v %v", p, err)
	}
}

func TestParseCompletion(t *testing.T) {
	cases := []struct {
		name, body, param, msg string
	}{
		{"missing prompt", `{"model":"m"}`, "prompt", "prompt is required"},
		{"empty prompt", `{"model":"m","prompt":""}`, "prompt", "must not be empty"},
		{"empty array", `{"model":"m","prompt":[]}`, "prompt", "prompt is required"},
		{"two prompts", `{"model":"m","prompt":["a","b"]}`, "prompt", "one prompt per request"},
		{"token ids", `{"model":"m","prompt":[1,2,3]}`, "prompt", "token-id arrays are not supported"},
		{"prompt object", `{"model":"m","prompt":{"text":"a"}}`, "prompt", "must be a string or an array of strings"},
		{"echo", `{"model":"m","prompt":"a","echo":true}`, "echo", "not supported"},
		{"suffix", `{"model":"m","prompt":"a","suffix":"b"}`, "suffix", "not supported"},
		{"negative max_tokens", `{"model":"m","prompt":"a","max_tokens":-1}`, "max_tokens", "at least 1"},
		{"completion logprobs bool", `{"model":"m","prompt":"a","logprobs":true}`, "logprobs", "integer between 0 and 5"},
		{"completion logprobs too many", `{"model":"m","prompt":"a","logprobs":6}`, "logprobs", "integer between 0 and 5"},
		{"completion top_logprobs", `{"model":"m","prompt":"a","top_logprobs":2}`, "top_logprobs", "chat parameter"},
		{"best_of", `{"model":"m","prompt":"a","best_of":3}`, "best_of", "best_of must be 1"},
		{"malformed", `{"model":"m","prompt":"a"`, "", "unexpected end of input"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := ParseCompletion([]byte(c.body))
			if err == nil {
				t.Fatal("accepted")
			}
			if err.Status != 400 || err.Param != c.param || !strings.Contains(err.Message, c.msg) {
				t.Errorf("got %d %q %q, want 400 %q containing %q", err.Status, err.Param, err.Message, c.param, c.msg)
			}
		})
	}
	for _, body := range []string{`{"model":"m","prompt":"Once upon"}`, `{"model":"m","prompt":["Once upon"]}`} {
		req, p, err := ParseCompletion([]byte(body))
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if req.PromptText() != "Once upon" || p.Model != "m" {
			t.Errorf("%s: prompt %q params %+v", body, req.PromptText(), p)
		}
	}
}

func TestReadBodyLimit(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 2048)
	rec := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodPost, "/v1/completions", bytes.NewReader(big))
	if _, err := ReadBody(rec, r, 1024); err == nil || err.Status != http.StatusRequestEntityTooLarge || !strings.Contains(err.Message, "1024") {
		t.Errorf("oversized body: %v", err)
	}
	r = httptest.NewRequest(http.MethodPost, "/v1/completions", bytes.NewReader(big))
	body, err := ReadBody(httptest.NewRecorder(), r, 4096)
	if err != nil || len(body) != len(big) {
		t.Errorf("body within limit: %d bytes, %v", len(body), err)
	}
}

// FuzzParseChat: any input either parses into a request meeting every
// documented invariant or is refused with a 400 that says why; never a panic.
func FuzzParseChat(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"stop":["x"],"max_tokens":3,"min_tokens":1}`,
		`{"model":"m","messages":[{"role":"assistant","content":null}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":2,"top_p":1,"n":1,"seed":9}`,
		`{"messages":[]}`, `[]`, `{`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, p, err := ParseChat(body)
		if err != nil {
			if err.Status != 400 || err.Type != TypeInvalidRequest || err.Message == "" || req != nil {
				t.Fatalf("bad refusal %+v for %q", err, body)
			}
			if _, mErr := err.MarshalJSON(); mErr != nil {
				t.Fatal(mErr)
			}
			return
		}
		if len(req.Messages) == 0 || strings.TrimSpace(p.Model) == "" {
			t.Fatalf("accepted without messages or model: %q", body)
		}
		if p.MaxTokens < 0 || p.Temperature < 0 || p.Temperature > 2 || p.TopP <= 0 || p.TopP > 1 || p.MinTokens < 0 ||
			(p.MaxTokens > 0 && p.MinTokens > p.MaxTokens) || (p.IncludeUsage && !p.Stream) {
			t.Fatalf("accepted out-of-range params %+v: %q", p, body)
		}
		for _, m := range req.Messages {
			if m.Role == "" || (!m.Content.Set && m.Role != RoleAssistant) {
				t.Fatalf("accepted message %+v: %q", m, body)
			}
		}
		if _, err := ChatML().Render(req.Messages, true); err != nil {
			if e := AsError(err); e.Status != 400 {
				t.Fatalf("render failed with %v", err)
			}
		}
		_ = req.Canonical()
	})
}

func FuzzParseCompletion(f *testing.F) {
	for _, s := range []string{`{"model":"m","prompt":"a"}`, `{"model":"m","prompt":["a"],"stop":"b"}`, `{"prompt":[1]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, _, err := ParseCompletion(body)
		if err != nil {
			if err.Status != 400 || err.Message == "" {
				t.Fatalf("bad refusal %+v", err)
			}
			return
		}
		if req.PromptText() == "" {
			t.Fatalf("accepted an empty prompt: %q", body)
		}
		_ = req.Canonical()
	})
}

func TestParseFeatures(t *testing.T) {
	msgs := `"messages":[{"role":"user","content":"hi"}]`
	_, p, err := ParseChat([]byte(`{"model":"m",` + msgs + `,"n":3,"logprobs":true,"top_logprobs":4,"response_format":{"type":"json_object"}}`))
	if err != nil {
		t.Fatal(err)
	}
	if p.N != 3 || !p.Logprobs || p.TopLogprobs != 4 || string(p.JSONSchema) != `{"type":"object"}` {
		t.Fatalf("params %+v", p)
	}
	_, p, err = ParseChat([]byte(`{"model":"m",` + msgs + `,"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"integer"}}}}`))
	if err != nil || string(p.JSONSchema) != `{"type":"integer"}` {
		t.Fatalf("json_schema: %v %s", err, p.JSONSchema)
	}
	_, p, err = ParseCompletion([]byte(`{"model":"m","prompt":"a","logprobs":2,"n":2}`))
	if err != nil || !p.Logprobs || p.TopLogprobs != 2 || p.N != 2 {
		t.Fatalf("completion: %v %+v", err, p)
	}
	_, p, err = ParseCompletion([]byte(`{"model":"m","prompt":"a","logprobs":0}`))
	if err != nil || !p.Logprobs || p.TopLogprobs != 0 {
		t.Fatalf("completion logprobs 0: %v %+v", err, p)
	}
}

func TestNewTopLogprob(t *testing.T) {
	if got := NewTopLogprob("hé", -0.5); got.Token != "hé" || !slices.Equal(got.Bytes, []int{'h', 0xc3, 0xa9}) {
		t.Errorf("whole UTF-8: %+v", got)
	}
	if got := NewTopLogprob("\xc3", -1); got.Token != `bytes:\xc3` || !slices.Equal(got.Bytes, []int{0xc3}) {
		t.Errorf("a partial character: %+v", got)
	}
}
