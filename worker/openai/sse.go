package openai

import (
	"encoding/json"
	"errors"
	"net/http"
	"time"
)

// SSEWriter writes Server-Sent Events as OpenAI streams them: each event is
// "data: <json>\n\n", flushed at once so the client sees every token as it
// is produced; the stream ends with "data: [DONE]\n\n".
type SSEWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	started bool
}

// NewSSEWriter wraps w. Headers are sent with the first event, so an error
// found before it can still be answered with a plain JSON error.
func NewSSEWriter(w http.ResponseWriter) *SSEWriter {
	return &SSEWriter{w: w, rc: http.NewResponseController(w)}
}

// Started reports whether the 200 and event-stream headers were sent.
func (s *SSEWriter) Started() bool { return s.started }

func (s *SSEWriter) start() {
	if s.started {
		return
	}
	s.started = true
	h := s.w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	// Proxies such as nginx buffer responses unless told not to.
	h.Set("X-Accel-Buffering", "no")
	s.w.WriteHeader(http.StatusOK)
}

// Event sends v as one data event and flushes it.
func (s *SSEWriter) Event(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return s.raw(b)
}

func (s *SSEWriter) raw(data []byte) error {
	s.start()
	buf := make([]byte, 0, len(data)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, data...)
	buf = append(buf, "\n\n"...)
	if _, err := s.w.Write(buf); err != nil {
		return err
	}
	if err := s.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return err
	}
	return nil
}

// Done sends the terminating "data: [DONE]" event.
func (s *SSEWriter) Done() error { return s.raw([]byte("[DONE]")) }

// Error reports a failure. Before the first event it is a normal JSON error
// response with its status; once streaming has begun the status is gone, so
// it is sent as an error event (what OpenAI does) and the stream is closed
// with [DONE].
func (s *SSEWriter) Error(err error) error {
	if !s.started {
		WriteError(s.w, err)
		return nil
	}
	e := withTrace(s.w, err)
	b, mErr := e.MarshalJSON()
	if mErr != nil {
		return mErr
	}
	if err := s.raw(b); err != nil {
		return err
	}
	return s.Done()
}

// ChatStream emits one streamed chat completion: a first chunk carrying the
// assistant role, content chunks, a final chunk with the finish reason, the
// usage chunk when the client asked for it, then [DONE].
type ChatStream struct {
	sse          *SSEWriter
	id, model    string
	created      int64
	includeUsage bool
	began        bool
}

// NewChatStream prepares a stream; nothing is sent until Begin or Content.
func NewChatStream(w http.ResponseWriter, id, model string, created time.Time, includeUsage bool) *ChatStream {
	return &ChatStream{sse: NewSSEWriter(w), id: id, model: model, created: created.Unix(), includeUsage: includeUsage}
}

// SSE exposes the underlying writer (for Started and Error).
func (c *ChatStream) SSE() *SSEWriter { return c.sse }

func (c *ChatStream) chunk(choices []ChunkChoice, usage *Usage) *ChatCompletionChunk {
	return &ChatCompletionChunk{ID: c.id, Object: ObjectChatCompletionChunk, Created: c.created, Model: c.model, Choices: choices, Usage: usage}
}

// Begin sends the role chunk: {"delta":{"role":"assistant","content":""}}.
// Servers call it when the request is admitted, so the client sees the
// stream open before the first token.
func (c *ChatStream) Begin() error {
	if c.began {
		return nil
	}
	c.began = true
	empty := ""
	return c.sse.Event(c.chunk([]ChunkChoice{{Delta: Delta{Role: RoleAssistant, Content: &empty}, Logprobs: null()}}, nil))
}

// Content sends a content delta; empty text sends nothing.
func (c *ChatStream) Content(text string) error {
	if err := c.Begin(); err != nil {
		return err
	}
	if text == "" {
		return nil
	}
	return c.sse.Event(c.chunk([]ChunkChoice{{Delta: Delta{Content: &text}, Logprobs: null()}}, nil))
}

// Finish sends the finish reason, the usage chunk if requested, and [DONE].
func (c *ChatStream) Finish(reason string, usage *Usage) error {
	if err := c.Begin(); err != nil {
		return err
	}
	if err := c.sse.Event(c.chunk([]ChunkChoice{{Delta: Delta{}, Logprobs: null(), FinishReason: &reason}}, nil)); err != nil {
		return err
	}
	if c.includeUsage && usage != nil {
		if err := c.sse.Event(c.chunk([]ChunkChoice{}, usage)); err != nil {
			return err
		}
	}
	return c.sse.Done()
}

// CompletionStream emits one streamed text completion: text events, a final
// event with the finish reason, the usage event if asked for, then [DONE].
type CompletionStream struct {
	sse          *SSEWriter
	id, model    string
	created      int64
	includeUsage bool
}

// NewCompletionStream prepares a stream; nothing is sent until Text or Finish.
func NewCompletionStream(w http.ResponseWriter, id, model string, created time.Time, includeUsage bool) *CompletionStream {
	return &CompletionStream{sse: NewSSEWriter(w), id: id, model: model, created: created.Unix(), includeUsage: includeUsage}
}

// SSE exposes the underlying writer (for Started and Error).
func (c *CompletionStream) SSE() *SSEWriter { return c.sse }

func (c *CompletionStream) event(text string, finish *string, usage *Usage) *Completion {
	choices := []CompletionChoice{{Text: text, Logprobs: null(), FinishReason: finish}}
	if usage != nil {
		choices = []CompletionChoice{}
	}
	return &Completion{ID: c.id, Object: ObjectTextCompletion, Created: c.created, Model: c.model, Choices: choices, Usage: usage}
}

// Text sends a piece of generated text; empty text sends nothing.
func (c *CompletionStream) Text(text string) error {
	if text == "" {
		return nil
	}
	return c.sse.Event(c.event(text, nil, nil))
}

// Finish sends the finish reason, the usage event if requested, and [DONE].
func (c *CompletionStream) Finish(reason string, usage *Usage) error {
	if err := c.sse.Event(c.event("", &reason, nil)); err != nil {
		return err
	}
	if c.includeUsage && usage != nil {
		if err := c.sse.Event(c.event("", nil, usage)); err != nil {
			return err
		}
	}
	return c.sse.Done()
}
