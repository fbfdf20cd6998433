// Package chaos is the fault-injection run and the soak
// (docs/operations.md, "Chaos and soak"): steady mixed load on a fleet of
// real processes (bench/fleet) while a schedule injects faults one after
// the other, every request's fate recorded, the router's index checked
// against the workers' own view after each recovery, and the fleet's
// processes sampled for growth.
package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
)

// Outcome is how a request ended, from the client's side.
type Outcome string

const (
	// OK: a 2xx answer, whole (a stream ended by [DONE]).
	OK Outcome = "ok"
	// Failed: a clean error answer — a non-2xx status, or a stream that
	// carried an error event and then ended.
	Failed Outcome = "failed"
	// Aborted: the client itself went away mid-stream (the disconnect fault).
	Aborted Outcome = "aborted"
	// Reset: a stream broken off at the transport (an incomplete chunked
	// body, a reset connection): no [DONE] and no error event, but the
	// client's HTTP stack reports an error, so it knows the answer failed.
	Reset Outcome = "reset"
	// Cut: a stream that ended cleanly without [DONE] and without an error
	// event, or an unreadable answer: the client cannot tell an answer
	// from a truncation. Counted as lost.
	Cut Outcome = "cut"
	// Unanswered: no status at all after every retry (connection errors on
	// every gateway tried, or the request timeout). Counted as lost.
	Unanswered Outcome = "unanswered"
)

// Lost reports whether the outcome leaves the client without an answer.
func (o Outcome) Lost() bool { return o == Cut || o == Unanswered }

// Record is what one request observed. Times are since the run started.
type Record struct {
	ID       int           `json:"id"`
	Kind     string        `json:"kind"` // multi-turn | shared-prefix | burst | disconnect
	Stream   bool          `json:"stream"`
	Start    time.Duration `json:"start_ns"`
	End      time.Duration `json:"end_ns"`
	TTFT     time.Duration `json:"ttft_ns"` // zero when no token arrived
	Status   int           `json:"status"`  // of the last attempt; 0: none
	Outcome  Outcome       `json:"outcome"`
	Err      string        `json:"error,omitempty"`
	Attempts int           `json:"attempts"` // 1 + client retries
	Retries  []string      `json:"retries,omitempty"`
	Gateway  string        `json:"gateway"` // of the last attempt
	Worker   string        `json:"worker,omitempty"`
	Fault    string        `json:"fault,omitempty"` // window it started in (Analyze)
}

// Client sends chat completions the way an SDK behind a client-side load
// balancer does: a connection error before any answer is retried on the
// next gateway at once, a 429 (or a 503 with Retry-After: a draining
// worker) after its Retry-After (capped), at most
// MaxRetries times (the OpenAI SDKs' default is 2). Other statuses are
// answers and are not retried, so that the run counts what faults do.
type Client struct {
	Gateways   []string
	Model      string
	MaxRetries int
	Timeout    time.Duration
	HTTP       *http.Client
}

// Request is one chat completion to send.
type Request struct {
	Messages  []Message
	Stream    bool
	MaxTokens int
	// AbortAfterFirst makes the client go away after the first content
	// chunk (the disconnect fault); only with Stream.
	AbortAfterFirst bool
	// Progress, if set, is told the serving worker when the answer's
	// headers arrive and again when its first token does.
	Progress func(worker string, firstToken bool)
}

// Message is an OpenAI chat message.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Do sends r, starting on gateway first (an index into Gateways), and
// fills rec (Start is set by the caller). It returns the answer's text.
func (c *Client) Do(ctx context.Context, r Request, first int, runStart time.Time, rec *Record) string {
	body, _ := json.Marshal(map[string]any{
		"model": c.Model, "messages": r.Messages, "stream": r.Stream,
		"max_tokens": r.MaxTokens, "min_tokens": r.MaxTokens, "ignore_eos": true, "temperature": 0,
	})
	t0 := time.Now()
	rec.Start = t0.Sub(runStart)
	defer func() { rec.End = time.Since(runStart) }()
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	gw := first
	for attempt := 0; ; attempt++ {
		rec.Attempts = attempt + 1
		rec.Gateway = c.Gateways[gw%len(c.Gateways)]
		text, retry, wait := c.once(ctx, body, r, rec, t0)
		if retry == "" || attempt >= c.MaxRetries || ctx.Err() != nil {
			return text
		}
		rec.Retries = append(rec.Retries, retry)
		if retry == "connect" {
			gw++ // another gateway, as a load-balancing client would
		}
		if wait > 0 {
			select {
			case <-time.After(wait):
			case <-ctx.Done():
				return text
			}
		}
		rec.Status, rec.Err, rec.Worker, rec.TTFT = 0, "", "", 0
	}
}

// maxRetryAfter caps the wait a 429 asks for.
const maxRetryAfter = 2 * time.Second

// once makes one attempt. retry names why the attempt may be repeated
// ("connect", "429"), empty when its outcome is final.
func (c *Client) once(ctx context.Context, body []byte, r Request, rec *Record, t0 time.Time) (text, retry string, wait time.Duration) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(rec.Gateway, "/")+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		rec.Outcome, rec.Err = Unanswered, err.Error()
		return "", "", 0
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.HTTP.Do(req)
	if err != nil {
		rec.Outcome, rec.Err = Unanswered, err.Error()
		if ctx.Err() != nil {
			return "", "", 0
		}
		return "", "connect", 0
	}
	defer resp.Body.Close()
	rec.Status = resp.StatusCode
	rec.Worker = resp.Header.Get(llmfilter.UpstreamHostHeader)
	if r.Progress != nil {
		r.Progress(rec.Worker, false)
	}
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		rec.Outcome, rec.Err = Failed, fmt.Sprintf("status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
		if resp.StatusCode == http.StatusTooManyRequests {
			wait = time.Second
			if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s >= 0 {
				wait = time.Duration(s) * time.Second
			}
			return "", "429", min(wait, maxRetryAfter)
		}
		// A draining worker's 503 says when to come back, as the OpenAI
		// SDKs (which retry 5xx) honour: retried like a 429. A 503 without
		// Retry-After is an answer.
		if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); resp.StatusCode == http.StatusServiceUnavailable && err == nil && s >= 0 {
			return "", "503", min(time.Duration(s)*time.Second, maxRetryAfter)
		}
		return "", "", 0
	}
	if !r.Stream {
		return c.whole(resp.Body, rec, t0), "", 0
	}
	return c.stream(resp.Body, r, rec, t0), "", 0
}

func (c *Client) whole(body io.Reader, rec *Record, t0 time.Time) string {
	var ans struct {
		Choices []struct {
			Message Message `json:"message"`
		} `json:"choices"`
	}
	raw, err := io.ReadAll(body)
	if err != nil {
		rec.Outcome, rec.Err = Reset, "body: "+err.Error()
		return ""
	}
	if err := json.Unmarshal(raw, &ans); err != nil || len(ans.Choices) == 0 {
		rec.Outcome, rec.Err = Cut, fmt.Sprintf("bad answer %.200q", raw)
		return ""
	}
	rec.TTFT = time.Since(t0) // unstreamed: the whole answer is the first token
	rec.Outcome = OK
	return ans.Choices[0].Message.Content
}

func (c *Client) stream(body io.Reader, r Request, rec *Record, t0 time.Time) string {
	var text strings.Builder
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
			if sawError {
				rec.Outcome = Failed
			} else {
				rec.Outcome = OK
			}
			return text.String()
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Error *struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal(data, &ch); err != nil {
			rec.Outcome, rec.Err = Cut, "bad chunk: "+err.Error()
			return text.String()
		}
		if ch.Error != nil {
			sawError = true
			rec.Err = fmt.Sprintf("stream error %d: %s", ch.Error.Code, ch.Error.Message)
			continue
		}
		for _, c := range ch.Choices {
			if c.Delta.Content == "" {
				continue
			}
			if rec.TTFT == 0 {
				rec.TTFT = time.Since(t0)
				if r.Progress != nil {
					r.Progress(rec.Worker, true)
				}
				if r.AbortAfterFirst {
					rec.Outcome = Aborted
					return ""
				}
			}
			text.WriteString(c.Delta.Content)
		}
	}
	switch err := sc.Err(); {
	case sawError:
		rec.Outcome = Failed // an error event, then the end: a clean error
	case err != nil && !errors.Is(err, io.EOF):
		rec.Outcome, rec.Err = Reset, "stream: "+err.Error()
	default:
		rec.Outcome, rec.Err = Cut, "stream ended without [DONE]"
	}
	return text.String()
}
