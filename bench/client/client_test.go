package client

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"

	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// served is what the worker stand-in saw of one request.
type served struct {
	req    *openai.ChatRequest
	params openai.Params
}

// worker is an HTTP server on a real listener that reads requests with the
// worker's own parser and answers with the worker's own writers
// (worker/openai, as worker/server uses them), so the client reads exactly
// the frames a worker sends. answer writes each answer; the gateway's
// upstream-host header is set before it runs.
func worker(t *testing.T, answer func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream)) (*httptest.Server, <-chan served) {
	t.Helper()
	seen := make(chan served, 16)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, e := openai.ReadBody(w, r, 1<<20)
		if e != nil {
			openai.WriteError(w, e)
			return
		}
		req, p, e := openai.ParseChat(raw)
		if e != nil {
			openai.WriteError(w, e)
			return
		}
		seen <- served{req, p}
		w.Header().Set(headers.UpstreamHost, "10.0.0.1:8000")
		answer(w, r, openai.NewChatStream(w, openai.NewChatID(), p.Model, time.Now(), p.IncludeUsage))
	}))
	t.Cleanup(srv.Close)
	return srv, seen
}

func send(t *testing.T, c *Client, base string, r Request) Result {
	t.Helper()
	if r.Model == "" {
		r.Model = "tiny"
	}
	if r.Messages == nil {
		r.Messages = []Message{{Role: "system", Content: "be brief"}, {Role: "user", Content: "hello"}}
	}
	return c.Do(context.Background(), base, r)
}

// A streamed answer: TTFT is the first text, not the headers or the role
// chunk that come before it; usage with cached tokens, the serving worker
// and the whole text are recorded, and the request says what was asked.
func TestStreamRecordsFirstTokenUsageAndWorker(t *testing.T) {
	release := make(chan struct{})
	srv, seen := worker(t, func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
		s.Begin(0) // headers and the role chunk: no token yet
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		s.Content(0, "w0 ", nil)
		s.Content(0, "w1", nil)
		s.Finish(0, "length")
		s.End(openai.NewUsage(30, 2, 16))
	})
	var released time.Time
	var progress []bool
	res := send(t, &Client{}, srv.URL, Request{Stream: true, MaxTokens: 2, FixedLength: true, Usage: true,
		Progress: func(worker string, first bool) {
			if worker != "10.0.0.1:8000" {
				t.Errorf("progress names worker %q", worker)
			}
			progress = append(progress, first)
			if !first {
				released = time.Now()
				close(release)
			}
		}})
	if res.Outcome != OK || res.Err != "" || res.Status != 200 || res.Text != "w0 w1" || res.Worker != "10.0.0.1:8000" {
		t.Fatalf("result %+v", res)
	}
	if res.PromptTokens != 30 || res.CompletionTokens != 2 || res.CachedTokens != 16 {
		t.Fatalf("usage %d/%d/%d, want 30 prompt, 2 completion, 16 cached", res.PromptTokens, res.CompletionTokens, res.CachedTokens)
	}
	if min := released.Sub(res.Sent); res.TTFT < min || res.TTFT > res.Latency {
		t.Fatalf("TTFT %v: not after the headers (%v) or beyond the latency %v", res.TTFT, min, res.Latency)
	}
	if len(progress) != 2 || progress[0] || !progress[1] {
		t.Fatalf("progress calls %v, want headers then first token", progress)
	}
	got := <-seen
	if p := got.params; p.Model != "tiny" || !p.Stream || !p.IncludeUsage || p.MaxTokens != 2 || p.MinTokens != 2 || !p.IgnoreEOS || p.Temperature != 0 {
		t.Fatalf("the worker read %+v", p)
	}
	if m := got.req.Messages; len(m) != 2 || m[0].Role != "system" || m[1].Content.String() != "hello" {
		t.Fatalf("messages %+v", m)
	}
}

// Without FixedLength and Usage the request leaves the length to the model
// and asks for no usage chunk; the first token is the finish reason when
// the answer ends before any text.
func TestFinishBeforeTextIsTheFirstToken(t *testing.T) {
	srv, seen := worker(t, func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
		s.Begin(0)
		s.Finish(0, "stop")
		s.End(openai.NewUsage(5, 0, 0))
	})
	res := send(t, &Client{}, srv.URL, Request{Stream: true, MaxTokens: 8})
	if res.Outcome != OK || res.TTFT <= 0 || res.Text != "" || res.PromptTokens != 0 {
		t.Fatalf("result %+v", res)
	}
	if p := (<-seen).params; p.IncludeUsage || p.MinTokens != 0 || p.IgnoreEOS || p.MaxTokens != 8 {
		t.Fatalf("the worker read %+v", p)
	}
}

func TestWholeAnswer(t *testing.T) {
	srv, _ := worker(t, func(w http.ResponseWriter, r *http.Request, _ *openai.ChatStream) {
		openai.WriteJSON(w, http.StatusOK, openai.NewChatCompletion("id", "tiny", time.Now(), []openai.ChatChoice{chatChoice("hi there", "length")}, openai.NewUsage(9, 2, 4)))
	})
	res := send(t, &Client{}, srv.URL, Request{MaxTokens: 2})
	if res.Outcome != OK || res.Text != "hi there" || res.TTFT <= 0 || res.TTFT > res.Latency || res.CachedTokens != 4 || res.Worker != "10.0.0.1:8000" {
		t.Fatalf("result %+v", res)
	}
}

// Every way an answer can end but well, and what the client makes of it.
func TestEveryWayAnAnswerFails(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedPort := "http://" + l.Addr().String()
	l.Close()
	for _, tc := range []struct {
		name   string
		answer func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream)
		want   Outcome
		status int
		text   string
		err    string
	}{
		{name: "status", want: Failed, status: 429, err: `status 429: {"error":{"code":429,"type":"rate_limit_error","message":"queue full"`,
			answer: func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
				openai.WriteError(w, openai.TooManyRequests("queue full", 3*time.Second))
			}},
		{name: "error event", want: Failed, status: 200, text: "a", err: "stream error 500: the engine failed",
			answer: func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
				s.Content(0, "a", nil)
				s.SSE().Error(openai.Internal("the engine failed"))
			}},
		{name: "cut", want: Cut, status: 200, text: "a", err: "stream ended without [DONE]",
			answer: func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
				s.Content(0, "a", nil) // and return: a clean end without [DONE]
			}},
		{name: "bad chunk", want: Cut, status: 200, err: "bad chunk: ",
			answer: func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
				s.SSE().Event(`not an object`)
			}},
		{name: "reset", want: Reset, status: 200, text: "a", err: "stream: unexpected EOF",
			answer: func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
				s.Content(0, "a", nil)
				if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
					conn.Close() // the chunked body never ends
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := worker(t, tc.answer)
			res := send(t, &Client{}, srv.URL, Request{Stream: true, MaxTokens: 4})
			if res.Outcome != tc.want || res.Status != tc.status || res.Text != tc.text || !strings.HasPrefix(res.Err, tc.err) {
				t.Fatalf("result %+v; want %s, status %d, text %q, error %q…", res, tc.want, tc.status, tc.text, tc.err)
			}
			if res.Latency <= 0 || res.Worker != "10.0.0.1:8000" {
				t.Fatalf("result %+v", res)
			}
			if tc.status == 429 && res.Header.Get("Retry-After") != "3" {
				t.Fatalf("Retry-After %q, want 3", res.Header.Get("Retry-After"))
			}
		})
	}
	t.Run("refused", func(t *testing.T) {
		res := send(t, &Client{}, closedPort, Request{Stream: true, MaxTokens: 4})
		if res.Outcome != Unanswered || res.Status != 0 || !strings.Contains(res.Err, "connection refused") {
			t.Fatalf("result %+v", res)
		}
	})
}

// The client's timeout ends a request whose answer never comes, before or
// after its headers, and the worker sees the client leave.
func TestTimeout(t *testing.T) {
	left := make(chan struct{}, 2)
	srv, _ := worker(t, func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
		if r.URL.Query().Get("headers") != "" {
			s.Content(0, "a", nil)
		}
		<-r.Context().Done()
		left <- struct{}{}
	})
	c := &Client{Timeout: 200 * time.Millisecond}
	res := send(t, c, srv.URL, Request{Stream: true, MaxTokens: 4})
	if res.Outcome != Unanswered || !strings.Contains(res.Err, "deadline exceeded") || res.Latency < c.Timeout {
		t.Fatalf("before the headers: %+v", res)
	}
	res = send(t, c, srv.URL+"?headers=1", Request{Stream: true, MaxTokens: 4})
	if res.Outcome != Reset || res.Text != "a" || !strings.Contains(res.Err, "deadline exceeded") || res.Latency < c.Timeout {
		t.Fatalf("mid-stream: %+v", res)
	}
	for range 2 {
		waitFor(t, left, "the worker to see the client leave")
	}
}

// AbortAfterFirst leaves after the first token; the worker sees the
// connection go.
func TestAbortAfterFirstToken(t *testing.T) {
	left := make(chan struct{}, 1)
	srv, _ := worker(t, func(w http.ResponseWriter, r *http.Request, s *openai.ChatStream) {
		s.Content(0, "a", nil)
		<-r.Context().Done() // the client's disconnect, not an end of ours
		left <- struct{}{}
	})
	res := send(t, &Client{}, srv.URL, Request{Stream: true, MaxTokens: 4, AbortAfterFirst: true})
	if res.Outcome != Aborted || res.TTFT <= 0 || res.Text != "a" || res.Err != "" {
		t.Fatalf("result %+v", res)
	}
	waitFor(t, left, "the worker to see the client leave")
}

func waitFor(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// chatChoice is a whole answer's only choice.
func chatChoice(text, finish string) openai.ChatChoice {
	return openai.ChatChoice{Message: openai.ChatMessage{Role: openai.RoleAssistant, Content: &text}, FinishReason: finish}
}
