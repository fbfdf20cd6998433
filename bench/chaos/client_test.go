package chaos

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// A gateway stand-in on a real listener that answers with the worker's
// own writers (worker/openai): each request's last user message names how
// it should be answered. How bench/client reads every kind of answer is
// tested there; this test is about the retries and the record.
func fakeGateway(t *testing.T, calls *atomic.Int64) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		raw, _ := io.ReadAll(r.Body)
		mode := string(raw)
		w.Header().Set(headers.UpstreamHost, "10.0.0.1:80")
		s := openai.NewChatStream(w, "id", "m", time.Now(), false)
		switch {
		case strings.Contains(mode, "whole"):
			openai.WriteJSON(w, http.StatusOK, openai.NewChatCompletion("id", "m", time.Now(), []openai.ChatChoice{chatChoice("hi there", "length")}, nil))
		case strings.Contains(mode, "busy-once") && n == 1:
			w.Header().Set("Retry-After", "0") // retry at once (WriteError sends only positive waits)
			openai.WriteError(w, &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeRateLimit, Message: "queue full"})
		case strings.Contains(mode, "draining-once") && n == 1:
			w.Header().Set("Retry-After", "0")
			openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeUnavailable, Message: "the worker is draining"})
		case strings.Contains(mode, "status"):
			openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeUnavailable, Message: "no"})
		case strings.Contains(mode, "event"):
			s.Content(0, "a", nil)
			s.SSE().Error(openai.Internal("upstream died"))
		default:
			s.Content(0, "a", nil)
			s.Content(0, "b", nil)
			s.Finish(0, "length")
			s.End(nil)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestClientRetriesAndRecords(t *testing.T) {
	var calls atomic.Int64
	gw := fakeGateway(t, &calls)
	// A gateway that refuses connections: a closed port.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + l.Addr().String()
	l.Close()
	for _, tc := range []struct {
		mode     string
		stream   bool
		first    int // gateway index to start on
		abort    bool
		want     Outcome
		attempts int
		retries  string
		text     string
	}{
		{mode: "ok", stream: true, want: OK, attempts: 1, text: "ab"},
		{mode: "whole", want: OK, attempts: 1, text: "hi there"},
		{mode: "status", stream: true, want: Failed, attempts: 1}, // an answer: not retried
		{mode: "busy-once", stream: true, want: OK, attempts: 2, retries: "429", text: "ab"},
		{mode: "draining-once", stream: true, want: OK, attempts: 2, retries: "503", text: "ab"}, // 503 + Retry-After: retried
		{mode: "event", stream: true, want: Failed, attempts: 1, text: "a"},
		{mode: "ok", stream: true, first: 1, want: OK, attempts: 2, retries: "connect", text: "ab"}, // dead gateway first
		{mode: "ok", stream: true, abort: true, want: Aborted, attempts: 1, text: "a"},
	} {
		t.Run(fmt.Sprintf("%s-first%d-abort%v", tc.mode, tc.first, tc.abort), func(t *testing.T) {
			calls.Store(0)
			c := &Client{Gateways: []string{gw.URL, dead}, Model: "m", MaxRetries: 2, Timeout: 10 * time.Second, HTTP: client.NewHTTPClient()}
			var r Record
			runStart := time.Now()
			text := c.Do(context.Background(), client.Request{Messages: []client.Message{{Role: "user", Content: tc.mode}}, Stream: tc.stream, MaxTokens: 4, AbortAfterFirst: tc.abort}, tc.first, runStart, &r)
			if r.Outcome != tc.want || r.Attempts != tc.attempts || text != tc.text || strings.Join(r.Retries, ",") != tc.retries {
				t.Fatalf("outcome %s after %d attempts %v, text %q (%s); want %s after %d %q, %q", r.Outcome, r.Attempts, r.Retries, text, r.Err, tc.want, tc.attempts, tc.retries, tc.text)
			}
			if r.Start < 0 || r.End < r.Start || r.End > time.Since(runStart) {
				t.Fatalf("start %v, end %v", r.Start, r.End)
			}
			if r.Outcome == OK && (r.TTFT <= 0 || r.TTFT > r.End-r.Start || r.Worker != "10.0.0.1:80" || r.Gateway != gw.URL || r.Status != 200 || r.Err != "") {
				t.Fatalf("record %+v", r)
			}
			if r.Outcome == Failed && (r.Err == "" || r.Worker != "10.0.0.1:80") {
				t.Fatalf("record %+v", r)
			}
		})
	}
}

// chatChoice is a whole answer's only choice.
func chatChoice(text, finish string) openai.ChatChoice {
	return openai.ChatChoice{Message: openai.ChatMessage{Role: openai.RoleAssistant, Content: &text}, FinishReason: finish}
}
