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
)

// A gateway stand-in on a real listener: each request's last user message
// names how it should be answered.
func fakeGateway(t *testing.T, calls *atomic.Int64) *httptest.Server {
	t.Helper()
	chunk := func(w http.ResponseWriter, s string) {
		fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":%q}}]}\n\n", s)
		w.(http.Flusher).Flush()
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		raw, _ := io.ReadAll(r.Body)
		mode := string(raw)
		w.Header().Set("x-llm-upstream-host", "10.0.0.1:80")
		switch {
		case strings.Contains(mode, "whole"):
			fmt.Fprint(w, `{"choices":[{"message":{"role":"assistant","content":"hi there"}}]}`)
		case strings.Contains(mode, "busy-once") && n == 1:
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(429)
			fmt.Fprint(w, `{"error":{"code":429,"type":"rate_limit_error","message":"queue full"}}`)
		case strings.Contains(mode, "status"):
			w.WriteHeader(503)
			fmt.Fprint(w, `{"error":{"code":503,"type":"upstream_unavailable","message":"no"}}`)
		case strings.Contains(mode, "event"):
			chunk(w, "a")
			fmt.Fprint(w, "data: {\"error\":{\"code\":500,\"message\":\"upstream died\"}}\n\ndata: [DONE]\n\n")
		case strings.Contains(mode, "cut"):
			chunk(w, "a") // and return: a clean end without [DONE]
		case strings.Contains(mode, "reset"):
			chunk(w, "a")
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				conn.Close() // the chunked body never ends
			}
		default:
			chunk(w, "a")
			chunk(w, "b")
			fmt.Fprint(w, "data: [DONE]\n\n")
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestClientClassifiesEveryWayAnAnswerEnds(t *testing.T) {
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
		text     string
	}{
		{mode: "ok", stream: true, want: OK, attempts: 1, text: "ab"},
		{mode: "whole", want: OK, attempts: 1, text: "hi there"},
		{mode: "status", stream: true, want: Failed, attempts: 1},
		{mode: "busy-once", stream: true, want: OK, attempts: 2, text: "ab"},
		{mode: "event", stream: true, want: Failed, attempts: 1, text: "a"},
		{mode: "cut", stream: true, want: Cut, attempts: 1, text: "a"},
		{mode: "reset", stream: true, want: Reset, attempts: 1, text: "a"},
		{mode: "ok", stream: true, first: 1, want: OK, attempts: 2, text: "ab"}, // dead gateway first
		{mode: "ok", stream: true, abort: true, want: Aborted, attempts: 1},
	} {
		t.Run(fmt.Sprintf("%s-first%d-abort%v", tc.mode, tc.first, tc.abort), func(t *testing.T) {
			calls.Store(0)
			c := &Client{Gateways: []string{gw.URL, dead}, Model: "m", MaxRetries: 2, Timeout: 10 * time.Second, HTTP: NewHTTPClient()}
			var r Record
			text := c.Do(context.Background(), Request{Messages: []Message{{Role: "user", Content: tc.mode}}, Stream: tc.stream, MaxTokens: 4, AbortAfterFirst: tc.abort}, tc.first, time.Now(), &r)
			if r.Outcome != tc.want || r.Attempts != tc.attempts || text != tc.text {
				t.Fatalf("outcome %s after %d attempts, text %q (%s); want %s after %d, %q", r.Outcome, r.Attempts, text, r.Err, tc.want, tc.attempts, tc.text)
			}
			if r.Outcome == OK && (r.TTFT <= 0 || r.Worker != "10.0.0.1:80" || r.Gateway != gw.URL) {
				t.Fatalf("record %+v", r)
			}
			if tc.first == 1 && (len(r.Retries) != 1 || r.Retries[0] != "connect") {
				t.Fatalf("retries %v", r.Retries)
			}
		})
	}
}
