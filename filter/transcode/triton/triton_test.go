package triton

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func chatReq(body string, stream bool, msgs ...prefix.Message) *transcode.Request {
	return &transcode.Request{Kind: transcode.Chat, Model: "llama 3", Stream: stream, Messages: msgs, Body: []byte(body)}
}

func text(role, s string) prefix.Message {
	return prefix.Message{Role: role, Parts: []prefix.Part{{Type: "text", Text: s}}}
}

func TestTranslateChat(t *testing.T) {
	req := chatReq(`{"model":"llama 3","max_tokens":16,"temperature":0.2,"stop":"END","seed":7}`, false,
		text("system", "be brief"), text("user", "hi"))
	up, err := Translate(req)
	if err != nil {
		t.Fatal(err)
	}
	if up.Path != "/v2/models/llama%203/generate" || up.ContentType != "application/json" {
		t.Fatalf("path %q type %q", up.Path, up.ContentType)
	}
	var g map[string]any
	if err := json.Unmarshal(up.Body, &g); err != nil {
		t.Fatal(err)
	}
	if g["text_input"] != "system: be brief\nuser: hi\nassistant:" || g["max_tokens"] != 16.0 || g["stream"] != false {
		t.Fatalf("body %s", up.Body)
	}
	p := g["parameters"].(map[string]any)
	if p["temperature"] != 0.2 || p["seed"] != 7.0 || p["stop"].([]any)[0] != "END" {
		t.Fatalf("parameters %v", p)
	}
	req.Stream = true
	if up, _ := Translate(req); up.Path != "/v2/models/llama%203/generate_stream" {
		t.Fatalf("stream path %q", up.Path)
	}
}

func TestTranslateRefusals(t *testing.T) {
	img := prefix.Message{Role: "user", Parts: []prefix.Part{{Type: "image_url", URL: "u"}}}
	cases := map[string]*transcode.Request{
		"cannot be sent as text": chatReq(`{}`, false, img),
		"n must be 1":            chatReq(`{"n":2}`, false, text("user", "x")),
		"stop must be":           chatReq(`{"stop":5}`, false, text("user", "x")),
		"one text prompt":        {Kind: transcode.Completion, Model: "m", Prompt: "1 2 ", Body: []byte(`{"prompt":[1,2]}`)},
	}
	for want, req := range cases {
		_, err := Translate(req)
		var te *transcode.Error
		if !errors.As(err, &te) || te.Status != 400 || !strings.Contains(te.Message, want) {
			t.Errorf("%s: got %v", want, err)
		}
	}
}

func TestWholeBody(t *testing.T) {
	up, _ := Translate(chatReq(`{}`, false, text("user", "hi")))
	out, err := up.Response.Body([]byte(`{"model_name":"llama 3","model_version":"1","text_output":"Hello!"}`))
	if err != nil {
		t.Fatal(err)
	}
	var c struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Model   string `json:"model"`
		Choices []struct {
			Message      struct{ Role, Content string } `json:"message"`
			FinishReason string                         `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(out, &c); err != nil {
		t.Fatal(err)
	}
	if c.Object != "chat.completion" || c.Model != "llama 3" || !strings.HasPrefix(c.ID, "chatcmpl-") ||
		c.Choices[0].Message.Content != "Hello!" || c.Choices[0].Message.Role != "assistant" || c.Choices[0].FinishReason != "stop" {
		t.Fatalf("answer %s", out)
	}
	if up.Response.ContentType(false) != "application/json" || up.Response.ContentType(true) != "text/event-stream" {
		t.Fatal("content types")
	}
	if _, err := up.Response.Body([]byte(`{"error":"model overloaded"}`)); err == nil || !strings.Contains(err.Error(), "model overloaded") {
		t.Fatalf("backend error: %v", err)
	}
	if _, err := up.Response.Body([]byte(`<html>`)); err == nil {
		t.Fatal("garbage accepted")
	}

	cup, _ := Translate(&transcode.Request{Kind: transcode.Completion, Model: "m", Prompt: "once", Body: []byte(`{"prompt":"once"}`)})
	out, err = cup.Response.Body([]byte(`{"text_output":" upon"}`))
	if err != nil || !strings.Contains(string(out), `"object":"text_completion"`) || !strings.Contains(string(out), `"text":" upon"`) {
		t.Fatalf("completion %s %v", out, err)
	}
}

// events splits an OpenAI SSE stream into its data payloads.
func events(t *testing.T, s string) []string {
	t.Helper()
	if !strings.HasSuffix(s, "\n\n") {
		t.Fatalf("stream does not end with a blank line: %q", s)
	}
	var out []string
	for _, ev := range strings.Split(strings.TrimSuffix(s, "\n\n"), "\n\n") {
		d, ok := strings.CutPrefix(ev, "data: ")
		if !ok {
			t.Fatalf("event %q", ev)
		}
		out = append(out, d)
	}
	return out
}

func TestStreamSplitAnywhere(t *testing.T) {
	backend := "data: {\"text_output\":\"Hel\"}\n\n: keep-alive\n\ndata: {\"text_output\":\"lo\"}\r\n\r\ndata: {\"text_output\":\"!\"}\n\n"
	for split := 1; split < len(backend); split++ {
		up, _ := Translate(chatReq(`{}`, true, text("user", "hi")))
		a, err1 := up.Response.Chunk([]byte(backend[:split]))
		b, err2 := up.Response.Chunk([]byte(backend[split:]))
		c, err3 := up.Response.Flush()
		if err1 != nil || err2 != nil || err3 != nil {
			t.Fatal(err1, err2, err3)
		}
		got := string(a) + string(b) + string(c)
		evs := events(t, got)
		if len(evs) != 5 || evs[4] != "[DONE]" {
			t.Fatalf("split %d: events %q", split, evs)
		}
		var content string
		for i, e := range evs[:4] {
			var ch struct {
				Object  string `json:"object"`
				Choices []struct {
					Delta        map[string]string `json:"delta"`
					FinishReason *string           `json:"finish_reason"`
				} `json:"choices"`
			}
			if err := json.Unmarshal([]byte(e), &ch); err != nil || ch.Object != "chat.completion.chunk" {
				t.Fatalf("event %q: %v", e, err)
			}
			content += ch.Choices[0].Delta["content"]
			if (i == 0) != (ch.Choices[0].Delta["role"] == "assistant") {
				t.Fatalf("role on event %d: %q", i, e)
			}
			if (i == 3) != (ch.Choices[0].FinishReason != nil) {
				t.Fatalf("finish_reason on event %d", i)
			}
		}
		if content != "Hello!" {
			t.Fatalf("content %q", content)
		}
	}
}

func TestStreamErrorEventAndGarbage(t *testing.T) {
	up, _ := Translate(chatReq(`{}`, true, text("user", "hi")))
	out, err := up.Response.Chunk([]byte("data: {\"error\":\"out of memory\"}\n\n"))
	if err != nil || !strings.Contains(string(out), `"code":503`) || !strings.Contains(string(out), "out of memory") {
		t.Fatalf("error event: %q %v", out, err)
	}
	if _, err := up.Response.Chunk([]byte("data: not json\n\n")); err == nil {
		t.Fatal("garbage event accepted")
	}
}

func TestProtocolTranscoderAlwaysTranslates(t *testing.T) {
	tr := New(parserFunc(func(string, []byte) (*transcode.Request, error) {
		return chatReq(`{}`, false, text("user", "x")), nil
	}))
	req, _ := tr.Parse("", nil)
	up, err := tr.Upstream(req, "vllm")
	if err != nil || up.Path == "" || up.Response == nil {
		t.Fatalf("%+v %v", up, err)
	}
}

type parserFunc func(string, []byte) (*transcode.Request, error)

func (f parserFunc) Parse(p string, b []byte) (*transcode.Request, error) { return f(p, b) }
