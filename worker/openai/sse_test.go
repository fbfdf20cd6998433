package openai

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	oai "github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
)

// pieces are what a byte-level model emits for "Hello 你好 STOP never": the
// CJK characters arrive split across tokens.
var testPieces = []string{"Hel", "lo", " \xe4\xbd", "\xa0\xe5", "\xa5\xbd", " ST", "OP", " never"}

const cachedTokens = 3

// fakeEngine is the smallest server this package allows: it runs the real
// parsing, template, detokenizer, stop matcher and response writers, and
// stands in for inference with testPieces.
func fakeEngine(t *testing.T) http.Handler {
	mux := http.NewServeMux()
	generate := func(p Params, emit func(string) error) (finish string, n int, err error) {
		out := NewOutput(p.Stop)
		for _, piece := range testPieces {
			n++
			text, stopped := out.Push(piece)
			if err := emit(text); err != nil {
				return "", n, err
			}
			if stopped {
				return FinishStop, n, nil
			}
			if p.MaxTokens > 0 && n == p.MaxTokens {
				break
			}
		}
		if err := emit(out.Flush()); err != nil {
			return "", n, err
		}
		return FinishLength, n, nil
	}
	special := func(w http.ResponseWriter, model string) bool {
		switch model {
		case "missing":
			WriteError(w, ModelNotFound(model))
		case "busy":
			WriteError(w, TooManyRequests("queue is full (256 waiting)", 1500*time.Millisecond))
		default:
			return false
		}
		return true
	}
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		body, err := ReadBody(w, r, 1<<20)
		if err != nil {
			WriteError(w, err)
			return
		}
		req, p, perr := ParseChat(body)
		if perr != nil {
			WriteError(w, perr)
			return
		}
		if special(w, p.Model) {
			return
		}
		prompt, rerr := ChatML().Render(req.Messages, true)
		if rerr != nil {
			WriteError(w, rerr)
			return
		}
		id, created := NewChatID(), time.Now()
		if !p.Stream {
			var sb strings.Builder
			finish, n, _ := generate(p, func(s string) error { sb.WriteString(s); return nil })
			WriteJSON(w, http.StatusOK, NewChatCompletion(id, p.Model, created, []ChatChoice{{Message: ChatMessage{Role: RoleAssistant, Content: ptr(sb.String())}, FinishReason: finish}}, NewUsage(len(prompt), n, cachedTokens)))
			return
		}
		s := NewChatStream(w, id, p.Model, created, p.IncludeUsage)
		s.Begin(0)
		if p.Model == "fails-midway" {
			s.Content(0, "partial", nil)
			s.SSE().Error(Internal("llama_decode failed"))
			return
		}
		finish, n, gerr := generate(p, func(text string) error { return s.Content(0, text, nil) })
		if gerr != nil {
			t.Errorf("streaming: %v", gerr)
			return
		}
		s.Finish(0, finish)
		s.End(NewUsage(len(prompt), n, cachedTokens))
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		body, err := ReadBody(w, r, 1<<20)
		if err != nil {
			WriteError(w, err)
			return
		}
		req, p, perr := ParseCompletion(body)
		if perr != nil {
			WriteError(w, perr)
			return
		}
		id, created := NewCompletionID(), time.Now()
		usage := func(n int) *Usage { return NewUsage(len(req.PromptText()), n, 0) }
		if !p.Stream {
			var sb strings.Builder
			finish, n, _ := generate(p, func(s string) error { sb.WriteString(s); return nil })
			WriteJSON(w, http.StatusOK, NewCompletion(id, p.Model, created, []CompletionChoice{{Text: sb.String(), FinishReason: &finish}}, usage(n)))
			return
		}
		s := NewCompletionStream(w, id, p.Model, created, p.IncludeUsage)
		finish, n, _ := generate(p, func(text string) error { return s.Text(0, text, nil) })
		s.Finish(0, finish)
		s.End(usage(n))
	})
	return mux
}

func newClient(t *testing.T) (oai.Client, string) {
	srv := httptest.NewServer(fakeEngine(t))
	t.Cleanup(srv.Close)
	return oai.NewClient(option.WithBaseURL(srv.URL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0)), srv.URL
}

func chatParams(model string, stop ...string) oai.ChatCompletionNewParams {
	p := oai.ChatCompletionNewParams{
		Model:    model,
		Messages: []oai.ChatCompletionMessageParamUnion{oai.SystemMessage("Be brief."), oai.UserMessage("Say hello")},
	}
	if len(stop) > 0 {
		p.Stop = oai.ChatCompletionNewParamsStopUnion{OfStringArray: stop}
	}
	return p
}

const wantText = "Hello 你好 "

func TestOpenAIClientChat(t *testing.T) {
	client, _ := newClient(t)
	ctx := context.Background()
	resp, err := client.Chat.Completions.New(ctx, chatParams("tiny", "STOP"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(resp.ID, "chatcmpl-") || resp.Object != "chat.completion" || resp.Model != "tiny" || resp.Created == 0 {
		t.Errorf("envelope: id %q object %q model %q created %d", resp.ID, resp.Object, resp.Model, resp.Created)
	}
	if len(resp.Choices) != 1 || resp.Choices[0].Message.Content != wantText || resp.Choices[0].FinishReason != "stop" ||
		resp.Choices[0].Message.Role != "assistant" {
		t.Fatalf("choices %+v", resp.Choices)
	}
	u := resp.Usage
	if u.CompletionTokens != 7 || u.TotalTokens != u.PromptTokens+7 || u.PromptTokensDetails.CachedTokens != cachedTokens || u.PromptTokens == 0 {
		t.Errorf("usage %+v", u)
	}

	// Streamed, with usage: parsed back chunk by chunk by the official client.
	p := chatParams("tiny", "STOP")
	p.StreamOptions = oai.ChatCompletionStreamOptionsParam{IncludeUsage: oai.Bool(true)}
	stream := client.Chat.Completions.NewStreaming(ctx, p)
	var acc oai.ChatCompletionAccumulator
	var chunks []oai.ChatCompletionChunk
	for stream.Next() {
		c := stream.Current()
		acc.AddChunk(c)
		chunks = append(chunks, c)
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if len(chunks) < 4 {
		t.Fatalf("%d chunks", len(chunks))
	}
	first, last, final := chunks[0], chunks[len(chunks)-1], chunks[len(chunks)-2]
	if first.Choices[0].Delta.Role != "assistant" || first.Object != "chat.completion.chunk" {
		t.Errorf("first chunk %s", first.RawJSON())
	}
	if final.Choices[0].FinishReason != "stop" {
		t.Errorf("finish chunk %s", final.RawJSON())
	}
	if len(last.Choices) != 0 || last.Usage.CompletionTokens != 7 || last.Usage.PromptTokensDetails.CachedTokens != cachedTokens {
		t.Errorf("usage chunk %s", last.RawJSON())
	}
	for _, c := range chunks {
		if c.ID != first.ID {
			t.Errorf("chunk ids differ: %q %q", c.ID, first.ID)
		}
		for _, ch := range c.Choices {
			if strings.ContainsRune(ch.Delta.Content, '\uFFFD') {
				t.Errorf("a chunk split a character: %q", ch.Delta.Content)
			}
		}
	}
	if got := acc.Choices[0].Message.Content; got != wantText {
		t.Errorf("accumulated %q, want %q", got, wantText)
	}

	// Without stop: everything, finish_reason length, no usage chunk.
	stream = client.Chat.Completions.NewStreaming(ctx, chatParams("tiny"))
	var text strings.Builder
	var reasons []string
	for stream.Next() {
		c := stream.Current()
		if len(c.Choices) == 0 {
			t.Errorf("usage chunk without include_usage: %s", c.RawJSON())
			continue
		}
		text.WriteString(c.Choices[0].Delta.Content)
		if c.Choices[0].FinishReason != "" {
			reasons = append(reasons, c.Choices[0].FinishReason)
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if text.String() != "Hello 你好 STOP never" || len(reasons) != 1 || reasons[0] != "length" {
		t.Errorf("text %q finish %v", text.String(), reasons)
	}
}

func TestOpenAIClientCompletions(t *testing.T) {
	client, _ := newClient(t)
	ctx := context.Background()
	params := oai.CompletionNewParams{
		Model:  "tiny",
		Prompt: oai.CompletionNewParamsPromptUnion{OfString: oai.String("Once upon a time")},
		Stop:   oai.CompletionNewParamsStopUnion{OfString: oai.String("STOP")},
	}
	resp, err := client.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(resp.ID, "cmpl-") || resp.Object != "text_completion" || len(resp.Choices) != 1 ||
		resp.Choices[0].Text != wantText || resp.Choices[0].FinishReason != "stop" || resp.Usage.PromptTokens != int64(len("Once upon a time")) {
		t.Fatalf("completion %s", resp.RawJSON())
	}
	params.StreamOptions = oai.ChatCompletionStreamOptionsParam{IncludeUsage: oai.Bool(true)}
	params.MaxTokens = oai.Int(2)
	stream := client.Completions.NewStreaming(ctx, params)
	var text strings.Builder
	var finish string
	var usage oai.CompletionUsage
	for stream.Next() {
		c := stream.Current()
		if c.Object != "text_completion" || !strings.HasPrefix(c.ID, "cmpl-") {
			t.Errorf("event %s", c.RawJSON())
		}
		for _, ch := range c.Choices {
			text.WriteString(ch.Text)
			if ch.FinishReason != "" {
				finish = string(ch.FinishReason)
			}
		}
		if c.Usage.TotalTokens > 0 {
			usage = c.Usage
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if text.String() != "Hello" || finish != "length" || usage.CompletionTokens != 2 {
		t.Errorf("text %q finish %q usage %+v", text.String(), finish, usage)
	}
}

func TestOpenAIClientErrors(t *testing.T) {
	client, _ := newClient(t)
	ctx := context.Background()
	cases := []struct {
		name   string
		params oai.ChatCompletionNewParams
		status int
		typ    string
		param  string
		retry  string
	}{
		{"bad temperature", func() oai.ChatCompletionNewParams {
			p := chatParams("tiny")
			p.Temperature = oai.Float(7)
			return p
		}(), 400, TypeInvalidRequest, "temperature", ""},
		{"unknown model", chatParams("missing"), 404, TypeNotFound, "model", ""},
		{"overloaded", chatParams("busy"), 429, TypeRateLimit, "", "2"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := client.Chat.Completions.New(ctx, c.params)
			var aerr *oai.Error
			if !errors.As(err, &aerr) {
				t.Fatalf("got %v, want an API error", err)
			}
			if aerr.StatusCode != c.status || aerr.Type != c.typ || aerr.Param != c.param || aerr.Message == "" {
				t.Errorf("status %d type %q param %q message %q", aerr.StatusCode, aerr.Type, aerr.Param, aerr.Message)
			}
			if got := aerr.Response.Header.Get("Retry-After"); got != c.retry {
				t.Errorf("Retry-After %q, want %q", got, c.retry)
			}
		})
	}

	stream := client.Chat.Completions.NewStreaming(ctx, func() oai.ChatCompletionNewParams {
		p := chatParams("fails-midway")
		return p
	}())
	var got strings.Builder
	for stream.Next() {
		for _, ch := range stream.Current().Choices {
			got.WriteString(ch.Delta.Content)
		}
	}
	if err := stream.Err(); err == nil || !strings.Contains(err.Error(), "llama_decode failed") {
		t.Errorf("mid-stream failure surfaced as %v", err)
	}
	if got.String() != "partial" {
		t.Errorf("content before the failure: %q", got.String())
	}
}

// TestSSEFraming checks the bytes on the wire: only "data: <json>\n\n"
// events, ending with "data: [DONE]\n\n", and the error body.
func TestSSEFraming(t *testing.T) {
	_, url := newClient(t)
	body := `{"model":"tiny","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"stop":"STOP"}`
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") || resp.Header.Get("Cache-Control") != "no-cache" {
		t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
	}
	text := string(raw)
	if !strings.HasSuffix(text, "data: [DONE]\n\n") {
		t.Fatalf("stream does not end with [DONE]: %q", text)
	}
	events := strings.Split(strings.TrimSuffix(text, "\n\n"), "\n\n")
	for i, ev := range events {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok || strings.Contains(data, "\n") {
			t.Fatalf("event %d is not a single data line: %q", i, ev)
		}
		if i == len(events)-1 {
			break
		}
		var chunk map[string]any
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		// finish_reason is present and null until the end, as OpenAI sends it.
		if choices := chunk["choices"].([]any); len(choices) == 1 {
			if _, ok := choices[0].(map[string]any)["finish_reason"]; !ok {
				t.Errorf("event %d has no finish_reason: %s", i, data)
			}
		}
	}

	resp, err = http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":-5}`))
	if err != nil {
		t.Fatal(err)
	}
	raw, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	want := `{"error":{"code":400,"type":"invalid_request_error","message":"max_tokens must be at least 1, got -5","param":"max_tokens"}}` + "\n"
	if resp.StatusCode != 400 || string(raw) != want || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("error response %d %q\nwant %q", resp.StatusCode, raw, want)
	}
}

// TestSSEFlushesEachEvent: the client must receive an event while the
// handler is still blocked before writing the next one.
func TestSSEFlushesEachEvent(t *testing.T) {
	firstSeen := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s := NewChatStream(w, "chatcmpl-x", "m", time.Now(), false)
		if s.SSE().Started() {
			t.Error("started before the first event")
		}
		s.Begin(0)
		select {
		case <-firstSeen:
		case <-r.Context().Done():
			return
		}
		s.Content(0, "after", nil)
		s.Finish(0, FinishStop)
		s.End(nil)
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil {
		t.Fatalf("first event never arrived (not flushed?): %v", err)
	}
	if !strings.Contains(line, `"role":"assistant"`) {
		t.Errorf("first event %q", line)
	}
	close(firstSeen)
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(rest), `"content":"after"`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Errorf("rest of stream %q", rest)
	}
}

func TestWriteError(t *testing.T) {
	cases := []struct {
		err    error
		status int
		body   string
		retry  string
	}{
		{ModelNotFound("gpt-9"), 404, `{"error":{"code":404,"type":"not_found_error","message":"model \"gpt-9\" does not exist on this server","param":"model"}}`, ""},
		{Timeout(60 * time.Second), 408, `{"error":{"code":408,"type":"timeout_error","message":"request did not complete within 1m0s","param":null}}`, ""},
		{TooLarge(1024), 413, `{"error":{"code":413,"type":"request_too_large","message":"request body exceeds 1024 bytes","param":null}}`, ""},
		{TooManyRequests("queue full", 100*time.Millisecond), 429, `{"error":{"code":429,"type":"rate_limit_error","message":"queue full","param":null}}`, "1"},
		{Internal("kv cache corrupted"), 500, `{"error":{"code":500,"type":"server_error","message":"kv cache corrupted","param":null}}`, ""},
		{errors.New("secret path /etc/x"), 500, `{"error":{"code":500,"type":"server_error","message":"internal error","param":null}}`, ""},
		{&Error{Status: 400, Type: TypeInvalidRequest, Message: "m", TraceID: "abc123"}, 400, `{"error":{"code":400,"type":"invalid_request_error","message":"m","param":null},"trace_id":"abc123"}`, ""},
	}
	for _, c := range cases {
		rec := httptest.NewRecorder()
		WriteError(rec, c.err)
		if rec.Code != c.status || strings.TrimSpace(rec.Body.String()) != c.body || rec.Header().Get("Retry-After") != c.retry {
			t.Errorf("%v: got %d %s (Retry-After %q)\nwant %d %s (%q)", c.err, rec.Code, rec.Body, rec.Header().Get("Retry-After"), c.status, c.body, c.retry)
		}
	}
}

func ptr[T any](v T) *T { return &v }
