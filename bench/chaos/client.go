// Package chaos is the fault-injection run and the soak
// (docs/operations.md, "Chaos and soak"): steady mixed load on a fleet of
// real processes (bench/fleet) while a schedule injects faults one after
// the other, every request's fate recorded, the router's index checked
// against the workers' own view after each recovery, and the fleet's
// processes sampled for growth.
package chaos

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
)

// Outcome is how a request ended, from the client's side, after its
// retries: bench/client's outcomes (see there), of the last attempt.
type Outcome string

const (
	OK      = Outcome(client.OK)
	Failed  = Outcome(client.Failed)
	Aborted = Outcome(client.Aborted) // the disconnect fault
	Reset   = Outcome(client.Reset)
	Cut     = Outcome(client.Cut)
	// Unanswered: no status at all after every retry (connection errors on
	// every gateway tried, or the request timeout).
	Unanswered = Outcome(client.Unanswered)
)

// Lost reports whether the outcome leaves the client without an answer:
// Cut (it cannot tell an answer from a truncation) or Unanswered.
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
// next gateway at once, a 429 or a 503 with Retry-After (a draining
// worker's) after its Retry-After (capped at maxRetryAfter), at most
// MaxRetries times. That is openai-go's behaviour for these answers
// (internal/requestconfig: MaxRetries 2 by default, shouldRetry retries
// connection errors, 408, 409, 429 and 5xx, retryDelay waits the
// Retry-After-Ms or Retry-After asked for when under a minute); a status
// arrives before any token, so a retried request never had one streamed.
// Unlike the SDK it does not retry other statuses (a 503 without
// Retry-After, a 500, …): they are answers, so that the run counts what
// faults do. The record keeps the attempts and why each retry was made;
// the outcome is the last attempt's, so a request answered on a retry is
// OK. Every request asks for a fixed length (client.Request.FixedLength).
type Client struct {
	Gateways   []string
	Model      string
	MaxRetries int
	Timeout    time.Duration // per request, retries included
	HTTP       *http.Client
}

// Do sends r, starting on gateway first (an index into Gateways), and
// fills rec. It returns the answer's text.
func (c *Client) Do(ctx context.Context, r client.Request, first int, runStart time.Time, rec *Record) string {
	r.Model, r.FixedLength = c.Model, true
	t0 := time.Now()
	rec.Start = t0.Sub(runStart)
	defer func() { rec.End = time.Since(runStart) }()
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	cl := client.Client{HTTP: c.HTTP}
	gw := first
	for attempt := 0; ; attempt++ {
		rec.Attempts = attempt + 1
		rec.Gateway = c.Gateways[gw%len(c.Gateways)]
		res := cl.Do(ctx, rec.Gateway, r)
		rec.Status, rec.Worker, rec.Outcome, rec.Err, rec.TTFT = res.Status, res.Worker, Outcome(res.Outcome), res.Err, 0
		if res.TTFT > 0 {
			rec.TTFT = res.Sent.Add(res.TTFT).Sub(t0) // since the first attempt
		}
		retry, wait := retryable(res)
		if retry == "" || attempt >= c.MaxRetries || ctx.Err() != nil {
			return res.Text
		}
		rec.Retries = append(rec.Retries, retry)
		if retry == "connect" {
			gw++ // another gateway, as a load-balancing client would
		}
		if wait > 0 {
			select {
			case <-time.After(wait):
			case <-ctx.Done():
				return res.Text
			}
		}
	}
}

// maxRetryAfter caps the wait a 429 or a draining worker's 503 asks for.
const maxRetryAfter = 2 * time.Second

// retryable names why an attempt may be repeated ("connect", "429") and
// how long to wait first; empty when its outcome is final.
func retryable(res client.Result) (retry string, wait time.Duration) {
	switch {
	case res.Outcome == client.Unanswered:
		return "connect", 0
	case res.Status == http.StatusTooManyRequests:
		wait = time.Second
		if s, err := strconv.Atoi(res.Header.Get("Retry-After")); err == nil && s >= 0 {
			wait = time.Duration(s) * time.Second
		}
		return "429", min(wait, maxRetryAfter)
	}
	// A draining worker's 503 says when to come back, as the OpenAI SDKs
	// (which retry 5xx) honour: retried like a 429. A 503 without
	// Retry-After is an answer.
	if s, err := strconv.Atoi(res.Header.Get("Retry-After")); res.Status == http.StatusServiceUnavailable && err == nil && s >= 0 {
		return "503", min(time.Duration(s)*time.Second, maxRetryAfter)
	}
	return "", 0
}
