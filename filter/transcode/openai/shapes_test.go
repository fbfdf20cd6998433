package openai

import (
	"bytes"
	"mime/multipart"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func text(role, s string) prefix.Message {
	return prefix.Message{Role: role, Parts: []prefix.Part{{Type: "text", Text: s}}}
}

func wantCanonical(t *testing.T, req *transcode.Request, want []byte) {
	t.Helper()
	if !bytes.Equal(req.Canonical, want) {
		t.Fatalf("canonical = %q, want %q", req.Canonical, want)
	}
	if !bytes.Equal(req.AppendCanonical(nil), want) {
		t.Fatal("AppendCanonical disagrees with Canonical")
	}
}

func TestChatToolsAndResponseFormatComeFirst(t *testing.T) {
	plain := parse(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	tools := `[{"type":"function","function":{"name":"f","parameters":{}}}]`
	withTools := parse(t, "/v1/chat/completions", `{"model":"m","tools":`+tools+`,"messages":[{"role":"user","content":"hi"}]}`)
	otherTools := parse(t, "/v1/chat/completions", `{"model":"m","tools":[{"type":"function","function":{"name":"g","parameters":{}}}],"messages":[{"role":"user","content":"hi"}]}`)
	// Field order in the body does not matter: tools render first.
	after := parse(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":`+tools+`}`)
	wantCanonical(t, plain, prefix.CanonicalChat([]prefix.Message{text("user", "hi")}))
	want := prefix.AppendCanonicalChat(prefix.AppendPreamble(nil, []prefix.Part{{Type: "tools", URL: tools}}), []prefix.Message{text("user", "hi")})
	wantCanonical(t, withTools, want)
	wantCanonical(t, after, want)
	if bytes.Equal(withTools.Canonical, otherTools.Canonical) || bytes.Equal(withTools.Canonical, plain.Canonical) {
		t.Fatal("different tools hash alike")
	}
	rf := parse(t, "/v1/chat/completions", `{"model":"m","response_format":{"type":"json_object"},"tools":`+tools+`,"messages":[{"role":"user","content":"hi"}]}`)
	wantCanonical(t, rf, prefix.AppendCanonicalChat(prefix.AppendPreamble(nil, []prefix.Part{
		{Type: "tools", URL: tools}, {Type: "response_format", URL: `{"type":"json_object"}`}}), []prefix.Message{text("user", "hi")}))
	nullTools := parse(t, "/v1/chat/completions", `{"model":"m","tools":null,"messages":[{"role":"user","content":"hi"}]}`)
	wantCanonical(t, nullTools, plain.Canonical)
	comp := parse(t, "/v1/completions", `{"model":"m","prompt":"p","response_format":{"type":"json_object"}}`)
	wantCanonical(t, comp, append(prefix.AppendPreamble(nil, []prefix.Part{{Type: "response_format", URL: `{"type":"json_object"}`}}), 'p'))
}

func TestParseResponses(t *testing.T) {
	req := parse(t, "/v1/responses", `{"model":"m","stream":true,"instructions":"be brief","input":"hello"}`)
	if req.Kind != transcode.Responses || req.Model != "m" || !req.Stream {
		t.Fatalf("req = %+v", req)
	}
	// The same prompt as a chat request renders alike.
	chat := parse(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello"}]}`)
	wantCanonical(t, req, chat.Canonical)

	items := parse(t, "/v1/responses", `{"model":"m","input":[
		{"role":"user","content":[{"type":"input_text","text":"look "},{"type":"input_image","image_url":"https://x/i.png"}]},
		{"type":"message","role":"assistant","content":[{"type":"output_text","text":"ok"}]},
		{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"}],
		"tools":[{"type":"function","name":"f"}],"text":{"format":{"type":"json_object"}}}`)
	want := prefix.AppendCanonicalChat(prefix.AppendPreamble(nil, []prefix.Part{
		{Type: "tools", URL: `[{"type":"function","name":"f"}]`}, {Type: "response_format", URL: `{"type":"json_object"}`}}),
		[]prefix.Message{
			{Role: "user", Parts: []prefix.Part{{Type: "text", Text: "look "}, {Type: "image_url", URL: "https://x/i.png"}}},
			text("assistant", "ok"),
			{Role: "function_call", Parts: []prefix.Part{{Type: "function_call", URL: `{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"}`}}},
		})
	wantCanonical(t, items, want)

	// An input of a shape not known here: routed by load, no error.
	odd := parse(t, "/v1/responses", `{"model":"m","input":42}`)
	if odd.HasPrompt() || len(odd.AppendCanonical(nil)) != 0 {
		t.Fatalf("odd input has a prompt: %q", odd.Canonical)
	}
}

func TestParseAnthropicMessages(t *testing.T) {
	req := parse(t, "/v1/messages", `{"model":"claude","max_tokens":16,"system":"be brief",
		"messages":[{"role":"user","content":"hello"}]}`)
	if req.Kind != transcode.Messages || req.Model != "claude" {
		t.Fatalf("req = %+v", req)
	}
	wantCanonical(t, req, prefix.CanonicalChat([]prefix.Message{text("system", "be brief"), text("user", "hello")}))

	blocks := parse(t, "/v1/messages", `{"model":"claude","max_tokens":16,"system":[{"type":"text","text":"be brief"}],
		"tools":[{"name":"get_weather","input_schema":{"type":"object"}}],
		"messages":[{"role":"user","content":[{"type":"text","text":"hello"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]},
		{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"get_weather","input":{}}]}]}`)
	wantCanonical(t, blocks, prefix.AppendCanonicalChat(prefix.AppendPreamble(nil, []prefix.Part{
		{Type: "tools", URL: `[{"name":"get_weather","input_schema":{"type":"object"}}]`}}),
		[]prefix.Message{
			text("system", "be brief"),
			{Role: "user", Parts: []prefix.Part{{Type: "text", Text: "hello"}, {Type: "image", URL: "AAAA"}}},
			{Role: "assistant", Parts: []prefix.Part{{Type: "tool_use", URL: `{"type":"tool_use","id":"t1","name":"get_weather","input":{}}`}}},
		}))
	other := parse(t, "/v1/messages", `{"model":"claude","max_tokens":16,"system":[{"type":"text","text":"be brief"}],
		"tools":[{"name":"get_time","input_schema":{"type":"object"}}],
		"messages":[{"role":"user","content":[{"type":"text","text":"hello"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]},
		{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"get_weather","input":{}}]}]}`)
	if bytes.Equal(blocks.Canonical[:32], other.Canonical[:32]) {
		t.Fatal("different tools share the first bytes")
	}
}

func TestParseEmbeddings(t *testing.T) {
	for body, want := range map[string]string{
		`{"model":"e","input":"a cat"}`:                "a cat",
		`{"model":"e","input":["a cat","a dog"]}`:      "a cat",
		`{"model":"e","input":[1,2,3]}`:                "1 2 3 ",
		`{"model":"e","input":[[4,5],[6]]}`:            "4 5 ",
		`{"model":"e","input":"a cat","dimensions":8}`: "a cat",
	} {
		req := parse(t, "/v1/embeddings", body)
		if req.Kind != transcode.Embeddings || req.Prompt != want {
			t.Errorf("%s: kind %v prompt %q, want %q", body, req.Kind, req.Prompt, want)
		}
		wantCanonical(t, req, prefix.CanonicalCompletion(want))
	}
}

func TestParseRerankAndScore(t *testing.T) {
	want := prefix.CanonicalChat([]prefix.Message{text("query", "capital of France?"), text("document", "Paris"), text("document", "Brasilia")})
	for _, path := range []string{"/v1/rerank", "/rerank", "/v2/rerank"} {
		req := parse(t, path, `{"model":"r","query":"capital of France?","documents":["Paris","Brasilia"],"top_n":1}`)
		if req.Kind != transcode.Rerank {
			t.Fatalf("%s: kind %v", path, req.Kind)
		}
		wantCanonical(t, req, want)
	}
	objs := parse(t, "/v2/rerank", `{"model":"r","query":"capital of France?","documents":[{"text":"Paris"},{"text":"Brasilia"}]}`)
	wantCanonical(t, objs, want)
	for _, path := range []string{"/v1/score", "/score"} {
		req := parse(t, path, `{"model":"r","text_1":"capital of France?","text_2":["Paris","Brasilia"]}`)
		if req.Kind != transcode.Score {
			t.Fatalf("%s: kind %v", path, req.Kind)
		}
		wantCanonical(t, req, want)
	}
	noQuery := parse(t, "/v1/rerank", `{"model":"r","documents":["Paris"]}`)
	if noQuery.HasPrompt() {
		t.Fatal("a rerank without query has a prompt")
	}
}

func multipartBody(t *testing.T, fields map[string]string) (string, []byte) {
	t.Helper()
	var buf bytes.Buffer
	w := multipart.NewWriter(&buf)
	fw, err := w.CreateFormFile("file", "a.wav")
	if err != nil {
		t.Fatal(err)
	}
	fw.Write(bytes.Repeat([]byte{0, 1, 2, 3}, 1000))
	for k, v := range fields {
		if err := w.WriteField(k, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return w.FormDataContentType(), buf.Bytes()
}

func TestParseAudio(t *testing.T) {
	ct, body := multipartBody(t, map[string]string{"model": "whisper", "stream": "true", "language": "en"})
	for _, path := range []string{"/v1/audio/transcriptions", "/v1/audio/translations"} {
		for _, contentType := range []string{ct, ""} { // "" reads the boundary from the body
			req, err := New().ParseHTTP(path, contentType, body, nil)
			if err != nil {
				t.Fatalf("%s %q: %v", path, contentType, err)
			}
			if req.Kind != transcode.Audio || req.Model != "whisper" || !req.Stream || req.HasPrompt() || len(req.Canonical) != 0 {
				t.Fatalf("%s: req = %+v", path, req)
			}
			if !bytes.Equal(req.Body, body) {
				t.Fatal("body changed")
			}
		}
	}
	ct, body = multipartBody(t, map[string]string{"language": "en"})
	if _, err := New().ParseHTTP("/v1/audio/transcriptions", ct, body, nil); err == nil || err.(*transcode.Error).Status != 400 {
		t.Fatalf("no model: err = %v", err)
	}
	if _, err := New().ParseHTTP("/v1/audio/transcriptions", ct, body[:len(body)/2], nil); err == nil {
		t.Fatal("truncated multipart body accepted")
	}
}

func TestUnknownPathWithModelPassesThrough(t *testing.T) {
	body := `{"model":"m","whatever":[1,2]}`
	req := parse(t, "/v1/messages/count_tokens", body)
	if req.Kind != transcode.Other || req.Model != "m" || req.HasPrompt() || string(req.Body) != body {
		t.Fatalf("req = %+v", req)
	}
	up, err := New().Upstream(req, "vllm")
	if err != nil || up.Body != nil || up.Path != "" {
		t.Fatalf("upstream = %+v, %v", up, err)
	}
	if _, err := New().Upstream(parse(t, "/v1/embeddings", `{"model":"m","input":"x"}`), "triton"); err == nil {
		t.Fatal("embeddings translated for triton")
	}
}

func TestCompletionIgnoresTools(t *testing.T) {
	a := parse(t, "/v1/completions", `{"model":"m","prompt":"p","tools":[{"type":"function"}]}`)
	wantCanonical(t, a, prefix.CanonicalCompletion("p"))
}
