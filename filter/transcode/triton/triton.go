// Package triton translates OpenAI requests into Triton Inference Server's
// generate extension (POST /v2/models/<model>/generate and
// /generate_stream) and its answers back into OpenAI form, streamed or not.
//
// Triton's generate API takes one text input, so a chat is rendered as a
// plain transcript ("<role>: <text>" lines, then "assistant:"); models served
// with their own chat template should get completions instead. Sampling
// fields map as: max_tokens (or max_completion_tokens) and stream become
// top-level inputs; temperature, top_p, top_k, seed, stop, frequency_penalty
// and presence_penalty go under "parameters". Images, audio, token-id prompts
// and n > 1 cannot be expressed and are refused with 400.
package triton

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
)

// Transcoder is the "triton" protocol: clients speak OpenAI (parsed by the
// wrapped parser) and every backend gets the Triton translation.
type Transcoder struct {
	Parser interface {
		Parse(path string, body []byte) (*transcode.Request, error)
	}
}

// New wraps the OpenAI parser p.
func New(p interface {
	Parse(path string, body []byte) (*transcode.Request, error)
}) Transcoder {
	return Transcoder{Parser: p}
}

// Parse implements transcode.Transcoder.
func (t Transcoder) Parse(path string, body []byte) (*transcode.Request, error) {
	return t.Parser.Parse(path, body)
}

// Upstream implements transcode.Transcoder: always Triton.
func (Transcoder) Upstream(req *transcode.Request, _ string) (transcode.Upstream, error) {
	return Translate(req)
}

// sampling is the subset of the OpenAI body that Triton can honour.
type sampling struct {
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	TopP                *float64        `json:"top_p"`
	TopK                *int64          `json:"top_k"`
	Seed                *int64          `json:"seed"`
	Stop                json.RawMessage `json:"stop"`
	FrequencyPenalty    *float64        `json:"frequency_penalty"`
	PresencePenalty     *float64        `json:"presence_penalty"`
	N                   *int64          `json:"n"`
}

type generateRequest struct {
	TextInput  string         `json:"text_input"`
	MaxTokens  *int64         `json:"max_tokens,omitempty"`
	Stream     bool           `json:"stream"`
	Parameters map[string]any `json:"parameters,omitempty"`
}

// Translate builds the Triton request for an OpenAI request.
func Translate(req *transcode.Request) (transcode.Upstream, error) {
	var s sampling
	if len(req.Body) > 0 {
		if err := json.Unmarshal(req.Body, &s); err != nil {
			return transcode.Upstream{}, transcode.BadRequest("invalid sampling fields for triton backend: %s", strings.TrimPrefix(err.Error(), "json: "))
		}
	}
	if s.N != nil && *s.N != 1 {
		return transcode.Upstream{}, transcode.BadRequest("triton backend: n must be 1")
	}
	text, err := render(req)
	if err != nil {
		return transcode.Upstream{}, err
	}
	g := generateRequest{TextInput: text, Stream: req.Stream, MaxTokens: s.MaxTokens}
	if g.MaxTokens == nil {
		g.MaxTokens = s.MaxCompletionTokens
	}
	params := map[string]any{}
	put := func(k string, v any, ok bool) {
		if ok {
			params[k] = v
		}
	}
	put("temperature", deref(s.Temperature), s.Temperature != nil)
	put("top_p", deref(s.TopP), s.TopP != nil)
	put("top_k", deref(s.TopK), s.TopK != nil)
	put("seed", deref(s.Seed), s.Seed != nil)
	put("frequency_penalty", deref(s.FrequencyPenalty), s.FrequencyPenalty != nil)
	put("presence_penalty", deref(s.PresencePenalty), s.PresencePenalty != nil)
	if len(s.Stop) > 0 && string(s.Stop) != "null" {
		stops, err := stopList(s.Stop)
		if err != nil {
			return transcode.Upstream{}, err
		}
		params["stop"] = stops
	}
	if len(params) > 0 {
		g.Parameters = params
	}
	body, err := json.Marshal(g)
	if err != nil {
		return transcode.Upstream{}, &transcode.Error{Status: 500, Type: transcode.TypeInternal, Message: err.Error()}
	}
	op := "generate"
	if req.Stream {
		op = "generate_stream"
	}
	return transcode.Upstream{
		Body:        body,
		Path:        "/v2/models/" + url.PathEscape(req.Model) + "/" + op,
		ContentType: "application/json",
		Response:    newResponse(req),
	}, nil
}

func deref[T any](p *T) T {
	if p == nil {
		var z T
		return z
	}
	return *p
}

func stopList(raw json.RawMessage) ([]string, error) {
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, transcode.BadRequest("stop must be a string or an array of strings")
	}
	return many, nil
}

// render makes Triton's single text input.
func render(req *transcode.Request) (string, error) {
	if req.Kind == transcode.Completion {
		var probe []json.RawMessage
		if json.Unmarshal(promptField(req.Body), &probe) == nil {
			if len(probe) != 1 || !bytes.HasPrefix(bytes.TrimSpace(probe[0]), []byte{'"'}) {
				return "", transcode.BadRequest("triton backend takes one text prompt, not a batch or token ids")
			}
		}
		return req.Prompt, nil
	}
	var b strings.Builder
	for i, m := range req.Messages {
		b.WriteString(m.Role)
		b.WriteString(": ")
		for j, p := range m.Parts {
			switch p.Type {
			case "text":
				b.WriteString(p.Text)
			case "name", "tool_call_id", "tool_calls":
				// Metadata of the turn: not text the model reads here.
			default:
				return "", transcode.BadRequest("triton backend: messages[%d].content[%d] of type %q cannot be sent as text", i, j, p.Type)
			}
		}
		b.WriteByte('\n')
	}
	b.WriteString("assistant:")
	return b.String(), nil
}

func promptField(body []byte) []byte {
	var f struct {
		Prompt json.RawMessage `json:"prompt"`
	}
	if json.Unmarshal(body, &f) != nil {
		return nil
	}
	return f.Prompt
}

// generateResponse is one Triton answer (or stream event).
type generateResponse struct {
	TextOutput *string         `json:"text_output"`
	Error      json.RawMessage `json:"error"`
}

// response is the ResponseTranscoder of one request.
type response struct {
	kind    transcode.Kind
	model   string
	id      string
	created int64
	buf     []byte
	started bool
	done    bool
}

func newResponse(req *transcode.Request) *response {
	prefix := "chatcmpl-"
	if req.Kind == transcode.Completion {
		prefix = "cmpl-"
	}
	return &response{kind: req.Kind, model: req.Model, id: prefix + uuid.NewString(), created: time.Now().Unix()}
}

func (r *response) ContentType(stream bool) string {
	if stream {
		return "text/event-stream"
	}
	return "application/json"
}

// errBackend marks an answer carrying Triton's own error.
var errBackend = errors.New("triton backend error")

func decodeAnswer(b []byte) (string, error) {
	var g generateResponse
	if err := json.Unmarshal(b, &g); err != nil {
		return "", fmt.Errorf("triton answer is not JSON: %w", err)
	}
	if len(g.Error) > 0 && string(g.Error) != "null" {
		var msg string
		if json.Unmarshal(g.Error, &msg) != nil {
			msg = string(g.Error)
		}
		return "", fmt.Errorf("%w: %s", errBackend, msg)
	}
	if g.TextOutput == nil {
		return "", errors.New("triton answer has no text_output")
	}
	return *g.TextOutput, nil
}

// Body implements transcode.ResponseTranscoder.
func (r *response) Body(b []byte) ([]byte, error) {
	text, err := decodeAnswer(b)
	if err != nil {
		return nil, err
	}
	if r.kind == transcode.Completion {
		return json.Marshal(map[string]any{
			"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
			"choices": []any{map[string]any{"index": 0, "text": text, "finish_reason": "stop", "logprobs": nil}},
		})
	}
	return json.Marshal(map[string]any{
		"id": r.id, "object": "chat.completion", "created": r.created, "model": r.model,
		"choices": []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": text}, "finish_reason": "stop"}},
	})
}

// Chunk implements transcode.ResponseTranscoder: complete SSE events in
// b (plus what earlier chunks left) become OpenAI chunk events.
func (r *response) Chunk(b []byte) ([]byte, error) {
	r.buf = append(r.buf, b...)
	var out []byte
	for {
		end, next := eventEnd(r.buf)
		if end < 0 {
			break
		}
		ev, err := r.event(r.buf[:end])
		if err != nil {
			return out, err
		}
		out = append(out, ev...)
		r.buf = r.buf[next:]
	}
	if len(r.buf) == 0 {
		r.buf = nil
	}
	return out, nil
}

// Flush implements transcode.ResponseTranscoder.
func (r *response) Flush() ([]byte, error) {
	var out []byte
	if len(bytes.TrimSpace(r.buf)) > 0 {
		ev, err := r.event(r.buf)
		r.buf = nil
		if err != nil {
			return nil, err
		}
		out = ev
	}
	if r.done {
		return out, nil
	}
	r.done = true
	out = append(out, r.sse(r.chunk("", true))...)
	return append(out, "data: [DONE]\n\n"...), nil
}

// eventEnd finds the blank line that ends the first SSE event.
func eventEnd(b []byte) (end, next int) {
	for i := 0; i < len(b); i++ {
		if b[i] != '\n' {
			continue
		}
		if i+1 < len(b) && b[i+1] == '\n' {
			return i, i + 2
		}
		if i+2 < len(b) && b[i+1] == '\r' && b[i+2] == '\n' {
			return i, i + 3
		}
	}
	return -1, -1
}

func (r *response) event(ev []byte) ([]byte, error) {
	var data []byte
	for _, line := range bytes.Split(ev, []byte{'\n'}) {
		line = bytes.TrimRight(line, "\r")
		if d, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			if len(data) > 0 {
				data = append(data, '\n')
			}
			data = append(data, bytes.TrimPrefix(d, []byte{' '})...)
		}
	}
	if len(data) == 0 {
		return nil, nil // comment or keep-alive
	}
	text, err := decodeAnswer(data)
	if errors.Is(err, errBackend) {
		// The status line is long gone: report in-band, in the error format.
		msg, _ := json.Marshal(map[string]any{"error": map[string]any{"code": 503, "type": transcode.TypeUnavailable, "message": err.Error()}})
		return r.sse(msg), nil
	}
	if err != nil {
		return nil, err
	}
	return r.sse(r.chunk(text, false)), nil
}

func (r *response) chunk(text string, final bool) []byte {
	var finish any
	if final {
		finish = "stop"
	}
	var b []byte
	if r.kind == transcode.Completion {
		b, _ = json.Marshal(map[string]any{
			"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
			"choices": []any{map[string]any{"index": 0, "text": text, "finish_reason": finish, "logprobs": nil}},
		})
		return b
	}
	delta := map[string]any{}
	if !r.started {
		delta["role"] = "assistant"
		r.started = true
	}
	if !final {
		delta["content"] = text
	}
	b, _ = json.Marshal(map[string]any{
		"id": r.id, "object": "chat.completion.chunk", "created": r.created, "model": r.model,
		"choices": []any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish}},
	})
	return b
}

func (r *response) sse(data []byte) []byte {
	out := make([]byte, 0, len(data)+8)
	out = append(out, "data: "...)
	out = append(out, data...)
	return append(out, '\n', '\n')
}
