// Package client is the benchmarks' one OpenAI client: it sends a chat
// completion, reads the answer (streamed or whole) and records what the
// caller measures — time to first token on the socket, the worker that
// served it, token usage with cached tokens, the status and error body, and
// how the answer ended.
//
// It speaks the wire protocol itself rather than through an SDK, so that
// TTFT is the arrival of the first chunk that carries generated text,
// measured on the socket, not after an SDK's buffering.
package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// Outcome is how a request ended, from the client's side.
type Outcome string

const (
	// OK: a 2xx answer, whole (a stream ended by [DONE]).
	OK Outcome = "ok"
	// Failed: a clean error answer — a non-2xx status, or a stream that
	// carried an error event and then ended.
	Failed Outcome = "failed"
	// Aborted: the client itself went away after the first token
	// (Request.AbortAfterFirst).
	Aborted Outcome = "aborted"
	// Reset: a stream broken off at the transport (an incomplete chunked
	// body, a reset connection, the timeout mid-answer): no [DONE] and no
	// error event, but the HTTP stack reports an error, so the client knows
	// the answer failed.
	Reset Outcome = "reset"
	// Cut: a stream that ended cleanly without [DONE] and without an error
	// event, or an unreadable answer: the client cannot tell an answer
	// from a truncation.
	Cut Outcome = "cut"
	// Unanswered: no status at all (a connection error, or the timeout
	// before the answer's headers).
	Unanswered Outcome = "unanswered"
)

// Message is an OpenAI chat message.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Request is one chat completion to send.
type Request struct {
	Model     string
	Messages  []Message
	Stream    bool
	MaxTokens int
	// FixedLength asks for exactly MaxTokens tokens (min_tokens and
	// ignore_eos, as vLLM and the worker honour them), so that runs compare
	// on equal work.
	FixedLength bool
	// Usage asks for the usage chunk at the end of a stream
	// (stream_options.include_usage); whole answers always carry usage.
	Usage bool
	// AbortAfterFirst makes the client go away after the first token (a
	// client disconnecting mid-stream); only with Stream.
	AbortAfterFirst bool
	// Progress, if set, is told the serving worker when the answer's
	// headers arrive and again when its first token does.
	Progress func(worker string, firstToken bool)
}

// Result is what one request observed. Durations are since Sent.
type Result struct {
	Sent    time.Time
	Status  int           // 0: no answer
	Header  http.Header   // the answer's headers; nil without an answer
	Worker  string        // the gateway's upstream-host header
	TTFT    time.Duration // zero when no token arrived
	Latency time.Duration // to the end of the answer, or of the attempt
	Outcome Outcome
	Err     string // why the outcome is not OK
	Text    string // the generated text received

	PromptTokens     int
	CompletionTokens int
	CachedTokens     int // usage.prompt_tokens_details.cached_tokens
}

// Client sends requests over HTTP.
type Client struct {
	// HTTP is the transport; nil: one shared by the benchmarks' defaults
	// (NewHTTPClient).
	HTTP *http.Client
	// Timeout bounds each request, answer included; zero: only ctx does.
	Timeout time.Duration
}

// NewHTTPClient is a transport for many concurrent requests to a few hosts:
// enough idle connections per host, no overall timeout (Client.Timeout
// bounds each request).
func NewHTTPClient() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
}

// maxErrorBody bounds how much of an error answer's body is kept.
const maxErrorBody = 1024

// Do sends r to base (e.g. http://127.0.0.1:8000) as one attempt, with no
// retries, and reads its answer.
func (c *Client) Do(ctx context.Context, base string, r Request) (res Result) {
	hc := c.HTTP
	if hc == nil {
		hc = defaultHTTP
	}
	// Sent is stamped before the deadline starts, so that a request the
	// timeout ends reports at least the timeout as its latency.
	res.Sent = time.Now()
	defer func() { res.Latency = time.Since(res.Sent) }()
	if c.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.Timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(base, "/")+"/v1/chat/completions", bytes.NewReader(body(r)))
	if err != nil {
		res.Outcome, res.Err = Unanswered, err.Error()
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		res.Outcome, res.Err = Unanswered, err.Error()
		return res
	}
	defer resp.Body.Close()
	res.Status, res.Header = resp.StatusCode, resp.Header
	res.Worker = resp.Header.Get(headers.UpstreamHost)
	if r.Progress != nil {
		r.Progress(res.Worker, false)
	}
	switch {
	case resp.StatusCode/100 != 2:
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		res.Outcome, res.Err = Failed, fmt.Sprintf("status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	case r.Stream:
		readStream(resp.Body, r, &res)
	default:
		readWhole(resp.Body, &res)
	}
	return res
}

var defaultHTTP = NewHTTPClient()

func body(r Request) []byte {
	b := map[string]any{"model": r.Model, "messages": r.Messages, "stream": r.Stream, "max_tokens": r.MaxTokens, "temperature": 0}
	if r.FixedLength {
		b["min_tokens"], b["ignore_eos"] = r.MaxTokens, true
	}
	if r.Stream && r.Usage {
		b["stream_options"] = map[string]any{"include_usage": true}
	}
	raw, _ := json.Marshal(b) // plain strings and numbers: cannot fail
	return raw
}

// usage is the OpenAI usage object.
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u *usage) record(res *Result) {
	if u == nil {
		return
	}
	res.PromptTokens, res.CompletionTokens = u.PromptTokens, u.CompletionTokens
	if u.PromptTokensDetails != nil {
		res.CachedTokens = u.PromptTokensDetails.CachedTokens
	}
}

func readWhole(body io.Reader, res *Result) {
	var ans struct {
		Choices []struct {
			Message Message `json:"message"`
		} `json:"choices"`
		Usage *usage `json:"usage"`
	}
	raw, err := io.ReadAll(body)
	if err != nil {
		res.Outcome, res.Err = Reset, "body: "+err.Error()
		return
	}
	if err := json.Unmarshal(raw, &ans); err != nil || len(ans.Choices) == 0 {
		res.Outcome, res.Err = Cut, fmt.Sprintf("bad answer %.200q", raw)
		return
	}
	res.TTFT = time.Since(res.Sent) // unstreamed: the whole answer is the first token
	res.Outcome, res.Text = OK, ans.Choices[0].Message.Content
	ans.Usage.record(res)
}

// chunk is one streamed event: a chat completion chunk or an error event.
type chunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usage `json:"usage"`
	Error *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// readStream reads server-sent events to [DONE]. The first token is the
// first chunk carrying text, or the finish reason when the answer ends
// before any text (a model may pick end-of-generation at once).
func readStream(body io.Reader, r Request, res *Result) {
	var text strings.Builder
	defer func() { res.Text = text.String() }()
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	sawError := false
	for sc.Scan() {
		data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			res.Outcome = OK
			if sawError {
				res.Outcome = Failed
			}
			return
		}
		var ch chunk
		if err := json.Unmarshal(data, &ch); err != nil {
			res.Outcome, res.Err = Cut, "bad chunk: "+err.Error()
			return
		}
		if ch.Error != nil {
			sawError = true
			res.Err = fmt.Sprintf("stream error %d: %s", ch.Error.Code, ch.Error.Message)
			continue
		}
		ch.Usage.record(res)
		for _, c := range ch.Choices {
			if c.Delta.Content == "" && c.FinishReason == nil {
				continue
			}
			text.WriteString(c.Delta.Content)
			if res.TTFT == 0 {
				res.TTFT = time.Since(res.Sent)
				if r.Progress != nil {
					r.Progress(res.Worker, true)
				}
				if r.AbortAfterFirst {
					res.Outcome = Aborted
					return // closing the unread body drops the connection
				}
			}
		}
	}
	switch err := sc.Err(); {
	case sawError:
		res.Outcome = Failed // an error event, then the end: a clean error
	case err != nil && !errors.Is(err, io.EOF):
		res.Outcome, res.Err = Reset, "stream: "+err.Error()
	default:
		res.Outcome, res.Err = Cut, "stream ended without [DONE]"
	}
}
