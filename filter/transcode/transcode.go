// Package transcode is the seam between what clients send and what the
// backends speak (docs/envoy-filter.md steps 2, 3 and 9).
//
// A Transcoder, registered under a protocol name, parses a client request
// body into a Request (model, prompt, stream, label selector, canonical
// prompt bytes for hashing) and, once a rule has chosen the backend, says
// what to send upstream: the body unchanged for OpenAI-speaking backends, or
// a translated body, path and ResponseTranscoder that turns the backend's
// answers back into OpenAI form.
package transcode

import (
	"fmt"
	"net/http"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Kind says which OpenAI endpoint a request is for.
type Kind int

const (
	Chat       Kind = iota + 1 // /v1/chat/completions
	Completion                 // /v1/completions
	Responses                  // /v1/responses: instructions + input
	Messages                   // /v1/messages (Anthropic): system + messages
	Embeddings                 // /v1/embeddings: input
	Rerank                     // /v1/rerank, /rerank, /v2/rerank: query + documents
	Score                      // /v1/score: text_1 (queries) + text_2 (documents)
	Audio                      // /v1/audio/transcriptions, /v1/audio/translations (multipart)
	Other                      // any other path whose JSON body names a model
)

var kindNames = [...]string{Chat: "chat", Completion: "completion", Responses: "responses", Messages: "messages",
	Embeddings: "embeddings", Rerank: "rerank", Score: "score", Audio: "audio", Other: "other"}

func (k Kind) String() string {
	if k > 0 && int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Conversational reports whether the kind's prompt is Messages (rendered
// in chat form); otherwise it is Prompt (completion form), or nothing.
func (k Kind) Conversational() bool {
	switch k {
	case Chat, Responses, Messages, Rerank, Score:
		return true
	}
	return false
}

// Request is what the engine needs to know about one client request.
type Request struct {
	Kind   Kind
	Model  string
	Stream bool
	// Preamble renders before the prompt: the request's tools and
	// response format (prefix.Preamble).
	Preamble []prefix.Part
	// Messages of a conversational request (Kind.Conversational), in order.
	Messages []prefix.Message
	// Prompt of a completion or embeddings request (the first one of a
	// batch). Kinds without either (audio, other) have no prompt: they are
	// routed by load alone.
	Prompt string
	// Selector holds the labels every chosen endpoint must carry: the body's
	// "label_selector" object plus, if "lora" names an adapter, lora=<name>.
	Selector map[string]string
	// LoRA is the body's "lora" adapter name, if any.
	LoRA string
	// Canonical is the prompt in prefix's canonical form; nil when the
	// transcoder leaves it to the caller (see AppendCanonical).
	Canonical []byte
	// Body is the request body as received (not copied: read only).
	Body []byte
}

// AppendCanonical appends the canonical prompt to dst: Canonical if set,
// else the Preamble followed by Messages or Prompt rendered (so a caller can
// use a pooled buffer). A request without a prompt appends nothing.
func (r *Request) AppendCanonical(dst []byte) []byte {
	switch {
	case r.Canonical != nil:
		return append(dst, r.Canonical...)
	case r.Kind.Conversational():
		if len(r.Messages) == 0 {
			return dst
		}
		return prefix.AppendCanonicalChat(prefix.AppendPreamble(dst, r.Preamble), r.Messages)
	case r.Kind == Completion || r.Kind == Embeddings:
		return prefix.AppendCanonicalCompletion(prefix.AppendPreamble(dst, r.Preamble), r.Prompt)
	}
	return dst
}

// HasPrompt reports whether the request carries a prompt to hash.
func (r *Request) HasPrompt() bool {
	switch {
	case r.Canonical != nil:
		return len(r.Canonical) > 0
	case r.Kind.Conversational():
		return len(r.Messages) > 0
	}
	return r.Kind == Completion || r.Kind == Embeddings
}

// Upstream says how to rewrite a request for its backend. The zero value
// means "send it unchanged".
type Upstream struct {
	Body        []byte // new body; nil = unchanged
	Path        string // new :path; "" = unchanged
	ContentType string // new content-type; "" = unchanged
	// Response converts the backend's answers back; nil = pass-through.
	Response ResponseTranscoder
}

// ResponseTranscoder turns one request's backend answer into OpenAI form.
// It is stateful (a stream's events may be split across chunks) and used by
// one goroutine at a time.
type ResponseTranscoder interface {
	// ContentType is the content-type of the translated answer for a
	// streamed (text/event-stream) or whole (application/json) response.
	ContentType(stream bool) string
	// Chunk translates the next piece of a streamed body. It may return
	// nothing when the piece holds no complete event yet.
	Chunk(b []byte) ([]byte, error)
	// Flush ends a stream: whatever is buffered, then the final
	// "data: [DONE]" event.
	Flush() ([]byte, error)
	// Body translates a whole (non-streamed) body. An error means the
	// backend's answer cannot be translated: answer 503 (docs/envoy-filter.md).
	Body(b []byte) ([]byte, error)
}

// Transcoder is one client protocol.
type Transcoder interface {
	// Parse reads a complete request body. path is the request's :path
	// ("" if unknown); errors are *Error.
	Parse(path string, body []byte) (*Request, error)
	// Upstream says what to send to a backend of the given kind
	// (config Backend* names). Errors are *Error.
	Upstream(req *Request, backend string) (Upstream, error)
}

// Error is a request the transcoder refuses, with its HTTP status and the
// error type (docs/envoy-filter.md).
type Error struct {
	Status  int
	Type    string
	Message string
}

func (e *Error) Error() string { return e.Message }

// Error types by status (docs/envoy-filter.md).
const (
	TypeBadRequest      = "bad_request"
	TypeNotFound        = "not_found"
	TypeTooLarge        = "payload_too_large"
	TypeUnavailable     = "service_unavailable"
	TypeInternal        = "internal_error"
	TypeTooManyRequests = "too_many_requests"
)

// BadRequest builds a 400 Error.
func BadRequest(format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeBadRequest, Message: fmt.Sprintf(format, args...)}
}

// NotFound builds a 404 Error.
func NotFound(format string, args ...any) *Error {
	return &Error{Status: http.StatusNotFound, Type: TypeNotFound, Message: fmt.Sprintf(format, args...)}
}

// Registry maps protocol names to transcoders. Build one per engine; it is
// read-only once in use.
type Registry map[string]Transcoder

// Lookup returns the transcoder of a protocol, or a 400 Error naming it.
func (r Registry) Lookup(protocol string) (Transcoder, error) {
	if t, ok := r[protocol]; ok {
		return t, nil
	}
	return nil, BadRequest("unsupported protocol %q", protocol)
}
