// Package openai is the worker's OpenAI-compatible API layer without any
// inference in it: request types, parsing and validation for
// /v1/chat/completions and /v1/completions, chat-template rendering, response
// and streaming (SSE) types, the error format, and the streaming text helpers
// (incremental UTF-8 detokenizing, stop-sequence matching).
package openai

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// Error types, as the "type" field of an error body.
const (
	TypeInvalidRequest  = "invalid_request_error"
	TypeNotFound        = "not_found_error"
	TypeTimeout         = "timeout_error"
	TypeRequestTooLarge = "request_too_large"
	TypeRateLimit       = "rate_limit_error"
	TypeServer          = "server_error"
	TypeUnavailable     = "service_unavailable"
)

// Error is an API error: an HTTP status and the error body
// {"error":{"code":N,"type":"...","message":"..."}} (docs/worker.md).
type Error struct {
	Status  int
	Type    string
	Message string
	// Param names the offending request field, as OpenAI's "param".
	Param string
	// RetryAfter, when positive, is sent as the Retry-After header (429, 503).
	RetryAfter time.Duration
	// TraceID, when set, is echoed as the body's "trace_id".
	TraceID string
}

func (e *Error) Error() string {
	if e.Param != "" {
		return fmt.Sprintf("%d %s: %s (param %s)", e.Status, e.Type, e.Message, e.Param)
	}
	return fmt.Sprintf("%d %s: %s", e.Status, e.Type, e.Message)
}

// BadRequest is a 400 about one request field (param may be empty).
func BadRequest(param, format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: param, Message: fmt.Sprintf(format, args...)}
}

// ModelNotFound is the 404 for a model this server does not serve.
func ModelNotFound(model string) *Error {
	return &Error{Status: http.StatusNotFound, Type: TypeNotFound, Param: "model",
		Message: fmt.Sprintf("model %q does not exist on this server", model)}
}

// AdapterNotFound is the 404 for a LoRA adapter this server has not loaded
// (or, on an adapter pod, for a request that names none of its adapters).
func AdapterNotFound(name string, loaded []string) *Error {
	msg := fmt.Sprintf("lora adapter %q is not loaded on this server", name)
	if name == "" {
		msg = "this server serves only its LoRA adapters; name one with \"lora\" or as the model"
	}
	return &Error{Status: http.StatusNotFound, Type: TypeNotFound, Param: "lora",
		Message: fmt.Sprintf("%s (loaded: %s)", msg, strings.Join(loaded, ", "))}
}

// Timeout is the 408 for a request that ran past its deadline.
func Timeout(after time.Duration) *Error {
	return &Error{Status: http.StatusRequestTimeout, Type: TypeTimeout,
		Message: fmt.Sprintf("request did not complete within %s", after)}
}

// TooLarge is the 413 for a body over the server's limit.
func TooLarge(limit int64) *Error {
	return &Error{Status: http.StatusRequestEntityTooLarge, Type: TypeRequestTooLarge,
		Message: fmt.Sprintf("request body exceeds %d bytes", limit)}
}

// TooManyRequests is the 429 for a full queue; clients should retry after retryAfter.
func TooManyRequests(message string, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, Message: message, RetryAfter: retryAfter}
}

// Internal is a 500. The message is sent to the client: keep secrets out of it.
func Internal(format string, args ...any) *Error {
	return &Error{Status: http.StatusInternalServerError, Type: TypeServer, Message: fmt.Sprintf(format, args...)}
}

// errorBody is the wire form.
type errorBody struct {
	Error   errorDetail `json:"error"`
	TraceID string      `json:"trace_id,omitempty"`
}

type errorDetail struct {
	Code    int     `json:"code"`
	Type    string  `json:"type"`
	Message string  `json:"message"`
	Param   *string `json:"param"`
}

// MarshalJSON renders the wire body.
func (e *Error) MarshalJSON() ([]byte, error) {
	b := errorBody{Error: errorDetail{Code: e.Status, Type: e.Type, Message: e.Message}, TraceID: e.TraceID}
	if e.Param != "" {
		b.Error.Param = &e.Param
	}
	return json.Marshal(b)
}

// AsError converts any error to an *Error: itself if it is (or wraps) one,
// otherwise a 500 that does not leak the internal message.
func AsError(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return Internal("internal error")
}

// withTrace returns err as an *Error naming the trace id the response
// carries, without changing the caller's value.
func withTrace(w http.ResponseWriter, err error) *Error {
	e := AsError(err)
	if id := w.Header().Get(headers.RequestID); e.TraceID == "" && id != "" {
		c := *e
		c.TraceID = id
		e = &c
	}
	return e
}

// WriteError writes err as a JSON error response (see AsError), with the
// trace id of the response's X-Request-Id header.
func WriteError(w http.ResponseWriter, err error) {
	e := withTrace(w, err)
	body, _ := e.MarshalJSON() // only strings and ints: cannot fail
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)+1))
	if e.RetryAfter > 0 {
		// Whole seconds, rounded up: a client must not retry early.
		h.Set("Retry-After", strconv.FormatInt(int64((e.RetryAfter+time.Second-1)/time.Second), 10))
	}
	w.WriteHeader(e.Status)
	w.Write(append(body, '\n'))
}
