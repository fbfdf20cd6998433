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

// ChatStream emits one streamed chat completion of one or more choices:
// per choice a first chunk carrying the assistant role, content chunks and a
// chunk with the finish reason (each chunk names its choice's index), then
// the usage chunk when the client asked for it, then [DONE].
type ChatStream struct {
	sse          *SSEWriter
	id, model    string
	created      int64
	includeUsage bool
	began        map[int]bool
}

// NewChatStream prepares a stream; nothing is sent until Begin or Content.
func NewChatStream(w http.ResponseWriter, id, model string, created time.Time, includeUsage bool) *ChatStream {
	return &ChatStream{sse: NewSSEWriter(w), id: id, model: model, created: created.Unix(), includeUsage: includeUsage, began: map[int]bool{}}
}

// SSE exposes the underlying writer (for Started and Error).
func (c *ChatStream) SSE() *SSEWriter { return c.sse }

func (c *ChatStream) chunk(choices []ChunkChoice, usage *Usage) *ChatCompletionChunk {
	return &ChatCompletionChunk{ID: c.id, Object: ObjectChatCompletionChunk, Created: c.created, Model: c.model, Choices: choices, Usage: usage}
}

// Begin sends choice index's role chunk:
// {"delta":{"role":"assistant","content":""}}. Servers call it when the
// request is admitted, so the client sees the stream open before the first
// token.
func (c *ChatStream) Begin(index int) error {
	if c.began[index] {
		return nil
	}
	c.began[index] = true
	empty := ""
	return c.sse.Event(c.chunk([]ChunkChoice{{Index: index, Delta: Delta{Role: RoleAssistant, Content: &empty}}}, nil))
}

// Content sends a content delta of choice index with the logprobs of the
// tokens it came from (nil: none); empty text without logprobs sends
// nothing.
func (c *ChatStream) Content(index int, text string, lp *ChatLogprobs) error {
	if err := c.Begin(index); err != nil {
		return err
	}
	if text == "" && lp == nil {
		return nil
	}
	return c.sse.Event(c.chunk([]ChunkChoice{{Index: index, Delta: Delta{Content: &text}, Logprobs: lp}}, nil))
}

// ToolCalls sends choice index's tool calls, whole, in one delta (each
// call with its index among them).
func (c *ChatStream) ToolCalls(index int, calls []ToolCall) error {
	if err := c.Begin(index); err != nil {
		return err
	}
	cs := make([]ToolCall, len(calls))
	for i, tc := range calls {
		cs[i] = tc
		cs[i].Index = &i
	}
	return c.sse.Event(c.chunk([]ChunkChoice{{Index: index, Delta: Delta{ToolCalls: cs}}}, nil))
}

// Finish sends choice index's finish reason.
func (c *ChatStream) Finish(index int, reason string) error {
	if err := c.Begin(index); err != nil {
		return err
	}
	return c.sse.Event(c.chunk([]ChunkChoice{{Index: index, Delta: Delta{}, FinishReason: &reason}}, nil))
}

// End sends the usage chunk if requested, and [DONE].
func (c *ChatStream) End(usage *Usage) error {
	if c.includeUsage && usage != nil {
		if err := c.sse.Event(c.chunk([]ChunkChoice{}, usage)); err != nil {
			return err
		}
	}
	return c.sse.Done()
}

// CompletionStream emits one streamed text completion of one or more
// choices: text events, per choice an event with the finish reason, the
// usage event if asked for, then [DONE].
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

func (c *CompletionStream) event(choices []CompletionChoice, usage *Usage) *Completion {
	return &Completion{ID: c.id, Object: ObjectTextCompletion, Created: c.created, Model: c.model, Choices: choices, Usage: usage}
}

// Text sends a piece of choice index's text with the logprobs of its
// tokens (nil: none); empty text without logprobs sends nothing.
func (c *CompletionStream) Text(index int, text string, lp *CompletionLogprobs) error {
	if text == "" && lp == nil {
		return nil
	}
	return c.sse.Event(c.event([]CompletionChoice{{Index: index, Text: text, Logprobs: lp}}, nil))
}

// Finish sends choice index's finish reason.
func (c *CompletionStream) Finish(index int, reason string) error {
	return c.sse.Event(c.event([]CompletionChoice{{Index: index, FinishReason: &reason}}, nil))
}

// End sends the usage event if requested, and [DONE].
func (c *CompletionStream) End(usage *Usage) error {
	if c.includeUsage && usage != nil {
		if err := c.sse.Event(c.event([]CompletionChoice{}, usage)); err != nil {
			return err
		}
	}
	return c.sse.Done()
}
