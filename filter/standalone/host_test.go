package standalone

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// testFilter records every call and lets each test script the statuses.
type testFilter struct {
	api.PassThroughStreamFilter
	cb  api.FilterCallbackHandler
	rec *recorder

	decodeHeaders func(f *testFilter, h api.RequestHeaderMap, end bool) api.StatusType
	decodeData    func(f *testFilter, b api.BufferInstance, end bool) api.StatusType
	encodeHeaders func(f *testFilter, h api.ResponseHeaderMap, end bool) api.StatusType
	encodeData    func(f *testFilter, b api.BufferInstance, end bool) api.StatusType
}

type recorder struct {
	mu      sync.Mutex
	calls   []string
	logCode int
	reason  api.DestroyReason
	done    chan struct{}
}

func (r *recorder) add(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, fmt.Sprintf(format, args...))
}

func (r *recorder) list() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.calls...)
}

func (f *testFilter) DecodeHeaders(h api.RequestHeaderMap, end bool) api.StatusType {
	f.rec.add("DecodeHeaders end=%v", end)
	if f.decodeHeaders != nil {
		return f.decodeHeaders(f, h, end)
	}
	if end {
		return api.Continue
	}
	return api.StopAndBuffer
}

func (f *testFilter) DecodeData(b api.BufferInstance, end bool) api.StatusType {
	f.rec.add("DecodeData len=%d end=%v", b.Len(), end)
	if f.decodeData != nil {
		return f.decodeData(f, b, end)
	}
	return api.Continue
}

func (f *testFilter) EncodeHeaders(h api.ResponseHeaderMap, end bool) api.StatusType {
	code, _ := h.Status()
	f.rec.add("EncodeHeaders status=%d end=%v", code, end)
	if f.encodeHeaders != nil {
		return f.encodeHeaders(f, h, end)
	}
	return api.Continue
}

func (f *testFilter) EncodeData(b api.BufferInstance, end bool) api.StatusType {
	f.rec.add("EncodeData end=%v", end)
	if f.encodeData != nil {
		return f.encodeData(f, b, end)
	}
	return api.Continue
}

func (f *testFilter) OnStreamComplete() { f.rec.add("OnStreamComplete") }

func (f *testFilter) OnLog(_ api.RequestHeaderMap, _ api.RequestTrailerMap, resp api.ResponseHeaderMap, _ api.ResponseTrailerMap) {
	code := 0
	if resp != nil {
		code, _ = resp.Status()
	}
	f.rec.mu.Lock()
	f.rec.logCode = code
	f.rec.mu.Unlock()
	f.rec.add("OnLog")
}

func (f *testFilter) OnDestroy(r api.DestroyReason) {
	f.rec.mu.Lock()
	f.rec.reason = r
	f.rec.mu.Unlock()
	f.rec.add("OnDestroy")
	close(f.rec.done)
}

// harness: a backend, a host with a scripted filter in front, and the
// recorder of the last stream.
type harness struct {
	t       *testing.T
	backend *httptest.Server
	gw      *httptest.Server
	mu      sync.Mutex
	last    *recorder
	script  func(*testFilter)
	factory api.StreamFilterFactory
}

func newHarness(t *testing.T, backend http.Handler, opts Options, script func(*testFilter)) *harness {
	t.Helper()
	h := &harness{t: t, script: script}
	if backend != nil {
		h.backend = httptest.NewServer(backend)
		t.Cleanup(h.backend.Close)
	}
	h.factory = h.gwFactory()
	opts.Factory = func(c any, cb api.FilterCallbackHandler) api.StreamFilter {
		h.mu.Lock()
		fac := h.factory
		h.mu.Unlock()
		return fac(c, cb)
	}
	host, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	h.gw = httptest.NewServer(host)
	t.Cleanup(h.gw.Close)
	return h
}

func (h *harness) backendAddr() string { return h.backend.Listener.Addr().String() }

// gwFactory builds the scripted, recording filter.
func (h *harness) gwFactory() api.StreamFilterFactory {
	return func(_ any, cb api.FilterCallbackHandler) api.StreamFilter {
		rec := &recorder{done: make(chan struct{})}
		h.mu.Lock()
		h.last = rec
		script := h.script
		h.mu.Unlock()
		f := &testFilter{cb: cb, rec: rec}
		if script != nil {
			script(f)
		}
		return f
	}
}

// setFactory replaces the filter the host builds for the next streams.
func (h *harness) setFactory(f api.StreamFilterFactory) {
	h.mu.Lock()
	h.factory = f
	h.mu.Unlock()
}

func (h *harness) rec() *recorder {
	h.mu.Lock()
	defer h.mu.Unlock()
	select {
	case <-h.last.done:
	case <-time.After(5 * time.Second):
		h.t.Fatal("stream never destroyed")
	}
	return h.last
}

func pin(addr string) func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
	return func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
		if err := f.cb.DecoderFilterCallbacks().SetUpstreamOverrideHost(addr, true); err != nil {
			panic(err)
		}
		return api.Continue
	}
}

type seen struct {
	mu     sync.Mutex
	method string
	path   string
	body   string
	header http.Header
	length int64
}

func echoBackend(s *seen) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.method, s.path, s.body, s.header, s.length = r.Method, r.URL.RequestURI(), string(b), r.Header.Clone(), r.ContentLength
		s.mu.Unlock()
		w.Header().Set("content-type", "application/json")
		fmt.Fprintf(w, `{"echo":%q}`, string(b))
	})
}

func TestBufferedRequestIsPinnedRewrittenAndTraced(t *testing.T) {
	var got seen
	var h *harness
	h = newHarness(t, echoBackend(&got), Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			if !end {
				t.Errorf("StopAndBuffer must deliver the body in one final call")
			}
			_ = b.SetString(strings.ToUpper(b.String()))
			f.cb.DecoderFilterCallbacks().SetUpstreamOverrideHost(h.backendAddr(), true)
			return api.Continue
		}
		f.decodeHeaders = func(f *testFilter, hdr api.RequestHeaderMap, end bool) api.StatusType {
			hdr.SetPath("/rewritten?x=1")
			hdr.Set("x-added", "yes")
			return api.StopAndBuffer
		}
	})
	body := strings.Repeat("hello ", 20000) // several reads
	resp, err := http.Post(h.gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, out)
	}
	got.mu.Lock()
	defer got.mu.Unlock()
	if got.body != strings.ToUpper(body) || got.length != int64(len(body)) {
		t.Fatalf("backend got %d bytes (content-length %d), want the rewritten body", len(got.body), got.length)
	}
	if got.path != "/rewritten?x=1" || got.header.Get("x-added") != "yes" {
		t.Fatalf("path %q header %v", got.path, got.header)
	}
	if got.header.Get("x-request-id") == "" {
		t.Fatal("x-request-id must be generated when the client sent none")
	}
	calls := h.rec().list()
	want := []string{
		"DecodeHeaders end=false",
		fmt.Sprintf("DecodeData len=%d end=true", len(body)),
		"EncodeHeaders status=200 end=false",
	}
	for i, w := range want {
		if calls[i] != w {
			t.Fatalf("calls = %v, want prefix %v", calls, want)
		}
	}
	if n := len(calls); calls[n-3] != "OnStreamComplete" || calls[n-2] != "OnLog" || calls[n-1] != "OnDestroy" {
		t.Fatalf("end of stream order = %v", calls[n-3:])
	}
}

func TestClientRequestIDIsKept(t *testing.T) {
	var got seen
	var h *harness
	h = newHarness(t, echoBackend(&got), Options{Fallback: func(*http.Request, string) string { return h.backendAddr() }}, nil)
	req, _ := http.NewRequest("GET", h.gw.URL+"/v1/models", nil)
	req.Header.Set("X-Request-Id", "abc-123")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if got.header.Get("x-request-id") != "abc-123" || got.method != "GET" {
		t.Fatalf("backend saw %v %v", got.method, got.header)
	}
	if calls := h.rec().list(); calls[0] != "DecodeHeaders end=true" || calls[1] != "EncodeHeaders status=200 end=false" {
		t.Fatalf("a body-less request must see DecodeHeaders(end=true) and no DecodeData: %v", calls)
	}
}

func TestRunningThenContinueFromGoroutine(t *testing.T) {
	var got seen
	var h *harness
	h = newHarness(t, echoBackend(&got), Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			returned := make(chan struct{})
			defer close(returned)
			go func() {
				defer f.cb.DecoderFilterCallbacks().RecoverPanic()
				<-returned // the decision ends after DecodeData answered Running
				_ = b.SetString(`{"decided":true}`)
				f.cb.DecoderFilterCallbacks().SetUpstreamOverrideHost(h.backendAddr(), true)
				f.cb.DecoderFilterCallbacks().Continue(api.Continue)
			}()
			return api.Running
		}
	})
	resp, err := http.Post(h.gw.URL+"/x", "application/json", strings.NewReader(`{"a":1}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || got.body != `{"decided":true}` {
		t.Fatalf("status %d backend body %q", resp.StatusCode, got.body)
	}
	if r := h.rec(); r.reason != api.Normal {
		t.Fatalf("destroy reason %v", r.reason)
	}
}

func TestLocalReplySyncAndAsyncGoThroughEncode(t *testing.T) {
	for _, async := range []bool{false, true} {
		t.Run(fmt.Sprint("async=", async), func(t *testing.T) {
			h := newHarness(t, nil, Options{}, func(f *testFilter) {
				f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
					reply := func() {
						f.cb.DecoderFilterCallbacks().SendLocalReply(404, `{"error":{"code":404}}`,
							map[string][]string{"content-type": {"application/json"}}, 0, "no_route")
					}
					if !async {
						reply()
						return api.LocalReply
					}
					go reply()
					return api.Running
				}
			})
			resp, err := http.Post(h.gw.URL+"/x", "application/json", strings.NewReader(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			out, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 404 || string(out) != `{"error":{"code":404}}` || resp.Header.Get("content-type") != "application/json" {
				t.Fatalf("got %d %q %v", resp.StatusCode, out, resp.Header)
			}
			r := h.rec()
			calls := r.list()
			if !contains(calls, "EncodeHeaders status=404 end=false") || r.logCode != 404 {
				t.Fatalf("local reply must pass EncodeHeaders and reach OnLog: %v (log %d)", calls, r.logCode)
			}
		})
	}
}

func contains(s []string, x string) bool {
	for _, v := range s {
		if v == x {
			return true
		}
	}
	return false
}

func decodeErr(t *testing.T, b []byte) (code int, typ, trace string) {
	t.Helper()
	var doc struct {
		Error struct {
			Code int    `json:"code"`
			Type string `json:"type"`
		} `json:"error"`
		TraceID string `json:"trace_id"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatalf("error body %q is not the error JSON: %v", b, err)
	}
	return doc.Error.Code, doc.Error.Type, doc.TraceID
}

func TestBodyOverLimitIs413(t *testing.T) {
	h := newHarness(t, nil, Options{MaxRequestBody: 1000}, nil)
	req, _ := http.NewRequest("POST", h.gw.URL+"/x", strings.NewReader(strings.Repeat("a", 1001)))
	req.Header.Set("x-request-id", "t-413")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	code, typ, trace := decodeErr(t, out)
	if resp.StatusCode != 413 || code != 413 || typ != "payload_too_large" || trace != "t-413" {
		t.Fatalf("got %d %s", resp.StatusCode, out)
	}
	if calls := h.rec().list(); contains(calls, "DecodeData len=1001 end=true") {
		t.Fatalf("an oversized body must not reach the filter: %v", calls)
	}
}

func TestNoUpstreamAndDeadUpstreamAre503(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	deadAddr := dead.Listener.Addr().String()
	dead.Close()
	h := newHarness(t, nil, Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			if b.String() == "pin" {
				f.cb.DecoderFilterCallbacks().SetUpstreamOverrideHost(deadAddr, true)
			}
			return api.Continue
		}
	})
	for _, body := range []string{"nopin", "pin"} {
		resp, err := http.Post(h.gw.URL+"/x", "text/plain", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		code, typ, trace := decodeErr(t, out)
		if resp.StatusCode != 503 || code != 503 || trace == "" {
			t.Fatalf("%s: got %d %s", body, resp.StatusCode, out)
		}
		r := h.rec()
		if r.logCode != 503 || !contains(r.list(), "EncodeHeaders status=503 end=false") {
			t.Fatalf("%s (%s): the 503 must go through the filter: %v", body, typ, r.list())
		}
	}
}

func TestSetUpstreamOverrideHostRules(t *testing.T) {
	errs := make(chan error, 8)
	h := newHarness(t, nil, Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			cb := f.cb.DecoderFilterCallbacks()
			for _, bad := range []string{"localhost:80", "10.0.0.1", "", " 10.0.0.1:80"} {
				errs <- cb.SetUpstreamOverrideHost(bad, true)
			}
			cb.SendLocalReply(418, "", nil, 0, "")
			return api.LocalReply
		}
		f.encodeHeaders = func(f *testFilter, _ api.ResponseHeaderMap, _ bool) api.StatusType {
			func() {
				defer func() { errs <- fmt.Errorf("%v", recover()) }()
				f.cb.DecoderFilterCallbacks().SetUpstreamOverrideHost("10.0.0.1:80", true)
			}()
			return api.Continue
		}
	})
	resp, err := http.Post(h.gw.URL+"/x", "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	for i := 0; i < 4; i++ {
		if e := <-errs; !errors.Is(e, api.ErrInvalidIPAddress) {
			t.Fatalf("bad host accepted: %v", e)
		}
	}
	if e := <-errs; !strings.Contains(e.Error(), ErrInvalidPhase.Error()) {
		t.Fatalf("override in the encode phase must panic with ErrInvalidPhase, got %v", e)
	}
	if resp.StatusCode != 418 {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

func TestPanicInFilterIs500(t *testing.T) {
	h := newHarness(t, nil, Options{}, func(f *testFilter) {
		f.decodeData = func(*testFilter, api.BufferInstance, bool) api.StatusType { panic("boom") }
	})
	resp, err := http.Post(h.gw.URL+"/x", "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 500 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if h.rec().logCode != 500 {
		t.Fatal("OnLog must see the 500")
	}
}

func TestGoroutinePanicRecoveredAs500(t *testing.T) {
	h := newHarness(t, nil, Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, _ api.BufferInstance, _ bool) api.StatusType {
			go func() {
				defer f.cb.DecoderFilterCallbacks().RecoverPanic()
				var m map[string]int
				m["x"] = 1 // nil map write
			}()
			return api.Running
		}
	})
	resp, err := http.Post(h.gw.URL+"/x", "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 500 {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

func TestDoubleContinuePanicsNotInGo(t *testing.T) {
	second := make(chan any, 1)
	var h *harness
	h = newHarness(t, echoBackend(&seen{}), Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, _ api.BufferInstance, _ bool) api.StatusType {
			cb := f.cb.DecoderFilterCallbacks()
			cb.SetUpstreamOverrideHost(h.backendAddr(), true)
			go func() {
				cb.Continue(api.Continue)
				defer func() { second <- recover() }()
				cb.Continue(api.Continue)
			}()
			return api.Running
		}
	})
	resp, err := http.Post(h.gw.URL+"/x", "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if e := <-second; e != ErrNotInGo && e != ErrFilterDestroyed {
		t.Fatalf("second Continue: %v", e)
	}
}

// sseBackend writes one event, then waits for release before the rest.
func sseBackend(release <-chan struct{}) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "text/event-stream")
		fl := w.(http.Flusher)
		fmt.Fprint(w, "data: {\"n\":1}\n\n")
		fl.Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, "data: {\"n\":2}\n\n")
		fl.Flush()
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
}

func TestSSEIsForwardedChunkByChunk(t *testing.T) {
	release := make(chan struct{})
	var h *harness
	h = newHarness(t, sseBackend(release), Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			return pin(h.backendAddr())(f, b, end)
		}
		f.encodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			_ = b.SetString(strings.ReplaceAll(b.String(), `"n"`, `"N"`))
			return api.Continue
		}
	})
	resp, err := http.Post(h.gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	line, err := rd.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	// The backend is still blocked: this line crossed the gateway unbuffered.
	if line != "data: {\"N\":1}\n" {
		t.Fatalf("first line %q", line)
	}
	close(release)
	rest, _ := io.ReadAll(rd)
	if !strings.Contains(string(rest), `data: {"N":2}`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("rest %q", rest)
	}
	calls := h.rec().list()
	n := 0
	for _, c := range calls {
		if strings.HasPrefix(c, "EncodeData") {
			n++
		}
	}
	if n < 2 || !contains(calls, "EncodeData end=true") {
		t.Fatalf("expected per-chunk EncodeData ending with end=true: %v", calls)
	}
}

func TestBufferedResponseIsRewrittenWithLength(t *testing.T) {
	var h *harness
	h = newHarness(t, echoBackend(&seen{}), Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			return pin(h.backendAddr())(f, b, end)
		}
		f.encodeHeaders = func(*testFilter, api.ResponseHeaderMap, bool) api.StatusType { return api.StopAndBuffer }
		f.encodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			if !end {
				t.Error("buffered response must arrive in one final call")
			}
			_ = b.SetString("[" + b.String() + "]")
			return api.Continue
		}
	})
	resp, err := http.Post(h.gw.URL+"/x", "text/plain", strings.NewReader("abc"))
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(out) != `[{"echo":"abc"}]` || resp.ContentLength != int64(len(out)) {
		t.Fatalf("got %q (content-length %d)", out, resp.ContentLength)
	}
}

func TestLocalReplyDuringEncodeReplacesResponse(t *testing.T) {
	var h *harness
	h = newHarness(t, echoBackend(&seen{}), Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			return pin(h.backendAddr())(f, b, end)
		}
		f.encodeHeaders = func(*testFilter, api.ResponseHeaderMap, bool) api.StatusType { return api.StopAndBuffer }
		f.encodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			go f.cb.EncoderFilterCallbacks().SendLocalReply(503, `{"error":{"code":503}}`, nil, 0, "transcode")
			return api.Running
		}
	})
	resp, err := http.Post(h.gw.URL+"/x", "text/plain", strings.NewReader("abc"))
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || string(out) != `{"error":{"code":503}}` {
		t.Fatalf("got %d %q", resp.StatusCode, out)
	}
	if code := h.rec().logCode; code != 503 {
		t.Fatalf("OnLog saw status %d, want the 503 the client got", code)
	}
}

func TestClientGoneWhileRunningThenLateContinue(t *testing.T) {
	late := make(chan any, 1)
	started := make(chan struct{})
	h := newHarness(t, nil, Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, _ api.BufferInstance, _ bool) api.StatusType {
			cb := f.cb.DecoderFilterCallbacks()
			go func() {
				close(started)
				<-f.rec.done // wait until the host destroyed the stream
				defer func() { late <- recover() }()
				cb.Continue(api.Continue)
			}()
			return api.Running
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", h.gw.URL+"/x", strings.NewReader("x"))
	go func() { <-started; cancel() }()
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Fatal("request should have been cancelled")
	}
	r := h.rec()
	if r.reason != api.Terminate {
		t.Fatalf("destroy reason %v, want Terminate (client gone while in Go)", r.reason)
	}
	if e := <-late; e != ErrFilterDestroyed {
		t.Fatalf("late Continue: %v", e)
	}
	if calls := r.list(); calls[len(calls)-1] != "OnDestroy" || !contains(calls, "OnLog") {
		t.Fatalf("calls %v", calls)
	}
}

func TestClientGoneMidStream(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	backendDone := make(chan struct{})
	backend := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(backendDone)
		w.Header().Set("content-type", "text/event-stream")
		fmt.Fprint(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done() // only the gateway cancelling ends this
	})
	var h *harness
	h = newHarness(t, backend, Options{}, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			return pin(h.backendAddr())(f, b, end)
		}
	})
	conn, err := net.Dial("tcp", h.gw.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprint(conn, "POST /x HTTP/1.1\r\nHost: gw\r\nContent-Length: 1\r\n\r\nx")
	rd := bufio.NewReader(conn)
	for {
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(line, "data: 1") {
			break
		}
	}
	conn.Close()
	select {
	case <-backendDone:
	case <-time.After(5 * time.Second):
		t.Fatal("backend request not cancelled after the client left")
	}
	r := h.rec()
	if r.logCode != 200 || !contains(r.list(), "OnLog") {
		t.Fatalf("OnLog must still run with the status sent: %v %d", r.list(), r.logCode)
	}
}

func TestHeaderMapAndBuffer(t *testing.T) {
	m := NewResponseHeaders(201, http.Header{"Content-Type": {"a"}, "X-Multi": {"1", "2"}})
	if c, ok := m.Status(); !ok || c != 201 {
		t.Fatal("status")
	}
	if v, _ := m.Get("CONTENT-TYPE"); v != "a" {
		t.Fatal("case-insensitive get")
	}
	m.Add("x-multi", "3")
	if got := m.Values("x-multi"); len(got) != 3 {
		t.Fatalf("values %v", got)
	}
	m.Set("x-multi", "only")
	if got := m.Values("x-multi"); len(got) != 1 || got[0] != "only" {
		t.Fatalf("set %v", got)
	}
	m.Del("x-multi")
	if _, ok := m.Get("x-multi"); ok {
		t.Fatal("del")
	}
	n := 0
	m.Range(func(k, v string) bool { n++; m.Set("x-during-range", "ok"); return true })
	if n != 2 || m.GetAllHeaders()["x-during-range"][0] != "ok" {
		t.Fatalf("range saw %d", n)
	}

	b := NewBuffer([]byte("world"))
	_ = b.PrependString("hello ")
	_ = b.WriteUint16(42)
	if b.String() != "hello world42" {
		t.Fatalf("buffer %q", b.String())
	}
	b.Drain(6)
	if b.String() != "world42" || b.Len() != 7 {
		t.Fatalf("drain %q", b.String())
	}
	b.Reset()
	if b.Bytes() != nil || b.Len() != 0 {
		t.Fatal("reset")
	}
	_ = b.Set(bytes.Repeat([]byte("x"), 3))
	if b.String() != "xxx" {
		t.Fatal("set")
	}
}

func TestWatermarkDeliversChunksAndRegroupsOnStopAndBuffer(t *testing.T) {
	var got seen
	var h *harness
	var sizes []int
	var mu sync.Mutex
	h = newHarness(t, echoBackend(&got), Options{}, func(f *testFilter) {
		f.decodeHeaders = func(*testFilter, api.RequestHeaderMap, bool) api.StatusType { return api.StopAndBufferWatermark }
		calls := 0
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			mu.Lock()
			sizes = append(sizes, b.Len())
			mu.Unlock()
			calls++
			if calls == 1 && !end {
				return api.StopAndBuffer // keep it and wait for the rest in one piece
			}
			if !end {
				t.Error("after StopAndBuffer the rest must come in one final call")
			}
			f.cb.DecoderFilterCallbacks().SetUpstreamOverrideHost(h.backendAddr(), true)
			return api.Continue
		}
	})
	// A chunked upload arriving in pieces: each piece once the gateway has
	// read the ones before (the host reads the body to its end, a chunk per
	// read, before the data phase).
	var read atomic.Int64
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = countingBody{r.Body, &read}
		h.gw.Config.Handler.ServeHTTP(w, r)
	}))
	defer gw.Close()
	pr, pw := io.Pipe()
	go func() {
		for i := 0; i < 3; i++ {
			pw.Write([]byte(strings.Repeat(string(rune('a'+i)), 1000)))
			if !wait.Until(10*time.Second, func() bool { return read.Load() >= int64(1000*(i+1)) }) {
				pw.CloseWithError(errors.New("the gateway never read the piece"))
				return
			}
		}
		pw.Close()
	}()
	resp, err := http.Post(gw.URL+"/x", "text/plain", pr)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	mu.Lock()
	defer mu.Unlock()
	if len(sizes) != 2 || sizes[0] != 1000 || sizes[1] != 3000 {
		t.Fatalf("DecodeData sizes %v, want [1000 3000] (first chunk, then held + rest)", sizes)
	}
	if len(got.body) != 3000 {
		t.Fatalf("backend got %d bytes", len(got.body))
	}
}

func TestBackendResetMidBody(t *testing.T) {
	for _, buffered := range []bool{false, true} {
		t.Run(fmt.Sprint("buffered=", buffered), func(t *testing.T) {
			backend := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("content-length", "1000")
				w.WriteHeader(200)
				w.Write([]byte("partial"))
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler) // cut the connection mid-body
			})
			var h *harness
			h = newHarness(t, backend, Options{}, func(f *testFilter) {
				f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
					return pin(h.backendAddr())(f, b, end)
				}
				if buffered {
					f.encodeHeaders = func(*testFilter, api.ResponseHeaderMap, bool) api.StatusType { return api.StopAndBuffer }
				}
			})
			resp, err := http.Post(h.gw.URL+"/x", "text/plain", strings.NewReader("x"))
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if buffered {
				if resp.StatusCode != 503 || err != nil {
					t.Fatalf("a reset before the buffered body completed must be a 503, got %d %q %v", resp.StatusCode, body, err)
				}
			} else if err == nil {
				t.Fatalf("a reset mid-stream must reach the client as an error, got a clean %q", body)
			}
			h.rec()
		})
	}
}

func TestFallbackForUnpinnedRequests(t *testing.T) {
	var got seen
	var h *harness
	h = newHarness(t, echoBackend(&got), Options{Fallback: func(r *http.Request, _ string) string {
		if r.URL.Path == "/bad" {
			return "not-an-address"
		}
		return h.backendAddr()
	}}, nil)
	resp, err := http.Get(h.gw.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || got.path != "/v1/models" {
		t.Fatalf("status %d path %q", resp.StatusCode, got.path)
	}
	h.rec()
	resp, err = http.Get(h.gw.URL + "/bad")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Fatalf("an invalid fallback must be a 503, got %d", resp.StatusCode)
	}
}

// As in Envoy: an override outside the cluster is ignored when it came from
// a goroutine (strict dropped, the cluster's load balancer picks) and fails
// with 503 when a phase set it strict synchronously.
func TestOverrideOutsideTheClusterFollowsEnvoy(t *testing.T) {
	var got seen
	var h *harness
	opts := Options{
		Fallback: func(*http.Request, string) string { return h.backendAddr() },
		Member:   func(_, host string) bool { return host == h.backendAddr() },
	}
	async := true
	h = newHarness(t, echoBackend(&got), opts, func(f *testFilter) {
		f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
			if !async {
				_ = f.cb.DecoderFilterCallbacks().SetUpstreamOverrideHost("10.255.0.1:80", true)
				return api.Continue
			}
			go func() {
				defer f.cb.DecoderFilterCallbacks().RecoverPanic()
				_ = f.cb.DecoderFilterCallbacks().SetUpstreamOverrideHost("10.255.0.1:80", true)
				f.cb.DecoderFilterCallbacks().Continue(api.Continue)
			}()
			return api.Running
		}
	})
	resp, err := http.Post(h.gw.URL+"/x", "application/json", strings.NewReader(`{"a":1}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || got.body != `{"a":1}` {
		t.Fatalf("goroutine override outside the cluster: status %d, backend saw %q; want the cluster's pick", resp.StatusCode, got.body)
	}
	h.rec()
	async = false
	resp, err = http.Post(h.gw.URL+"/x", "application/json", strings.NewReader(`{"a":2}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Fatalf("strict override outside the cluster: status %d, want 503", resp.StatusCode)
	}
}

// deadAddr is an address nobody listens on: a pod that died.
func deadAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// A request whose connection to its pinned pod fails was never sent: with
// ConnectRetries it goes to another member the cluster's load balancer
// picks (Envoy's retry_on: connect-failure with previous_hosts), the filter
// sees that pod as the upstream, and the failed pod is reported at once.
func TestConnectFailureIsRetriedOnAnotherHost(t *testing.T) {
	dead := deadAddr(t)
	var got seen
	var h *harness
	var mu sync.Mutex
	var failed []string
	var served string
	picks := 0
	opts := Options{
		ConnectRetries: 1,
		// Round robin that would hand the dead pod out again first: the
		// retry must skip a host it tried.
		Fallback: func(*http.Request, string) string {
			mu.Lock()
			defer mu.Unlock()
			picks++
			if picks%2 == 1 {
				return dead
			}
			return h.backendAddr()
		},
		ConnectFailed: func(host string) { mu.Lock(); failed = append(failed, host); mu.Unlock() },
	}
	h = newHarness(t, echoBackend(&got), opts, func(f *testFilter) {
		f.decodeData = pin(dead)
		f.encodeHeaders = func(f *testFilter, _ api.ResponseHeaderMap, _ bool) api.StatusType {
			served, _ = f.cb.StreamInfo().UpstreamRemoteAddress()
			return api.Continue
		}
	})
	resp, err := http.Post(h.gw.URL+"/x", "application/json", strings.NewReader(`{"a":1}`))
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || got.body != `{"a":1}` {
		t.Fatalf("status %d %s; the live pod saw %q", resp.StatusCode, out, got.body)
	}
	h.rec()
	mu.Lock()
	defer mu.Unlock()
	if served != h.backendAddr() {
		t.Fatalf("the filter saw upstream %q, want the pod that served, %s", served, h.backendAddr())
	}
	if len(failed) != 1 || failed[0] != dead {
		t.Fatalf("failed connections reported: %v, want [%s]", failed, dead)
	}
}

// Only a failed connection is retried: a pod that took the request and
// broke before answering may be running it, so the client gets the 503.
// Without ConnectRetries nothing is retried (Envoy without a retry policy).
func TestOnlyConnectFailuresAreRetried(t *testing.T) {
	var other seen
	otherPod := httptest.NewServer(echoBackend(&other))
	defer otherPod.Close()
	breaks := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		panic(http.ErrAbortHandler) // took the request, answers nothing
	})
	for _, tc := range []struct {
		name    string
		retries int
		backend http.Handler
		pinDead bool
	}{
		{"reset after the request was sent", 1, breaks, false},
		{"connect failure without retries", 0, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h *harness
			dead := deadAddr(t)
			opts := Options{ConnectRetries: tc.retries, Fallback: func(*http.Request, string) string { return otherPod.Listener.Addr().String() }}
			h = newHarness(t, tc.backend, opts, func(f *testFilter) {
				f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
					if tc.pinDead {
						return pin(dead)(f, b, end)
					}
					return pin(h.backendAddr())(f, b, end)
				}
			})
			resp, err := http.Post(h.gw.URL+"/x", "application/json", strings.NewReader(`{"a":1}`))
			if err != nil {
				t.Fatal(err)
			}
			out, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 503 {
				t.Fatalf("status %d %s, want 503", resp.StatusCode, out)
			}
			h.rec()
			other.mu.Lock()
			defer other.mu.Unlock()
			if other.body != "" {
				t.Fatalf("the request was sent to another pod too: %q", other.body)
			}
		})
	}
}

// A server-sent-event stream whose backend dies between two events ends
// with an error event in the project's error format and [DONE], as the
// worker ends a stream that fails, instead of a bare broken connection;
// one that dies inside an event is still cut (a half event cannot be
// closed into valid JSON).
func TestBrokenEventStreamEndsWithAnErrorEvent(t *testing.T) {
	for _, tc := range []struct {
		name    string
		written string
		event   bool
	}{
		{"between events", "data: {\"n\":1}\n\n", true},
		{"inside an event", "data: {\"n\":1}\n\ndata: {\"n\"", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			backend := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("content-type", "text/event-stream")
				w.WriteHeader(200)
				fmt.Fprint(w, tc.written)
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler) // the pod died mid-stream
			})
			var h *harness
			h = newHarness(t, backend, Options{}, func(f *testFilter) {
				f.decodeData = func(f *testFilter, b api.BufferInstance, end bool) api.StatusType {
					return pin(h.backendAddr())(f, b, end)
				}
			})
			req, _ := http.NewRequest(http.MethodPost, h.gw.URL+"/x", strings.NewReader(`{"stream":true}`))
			req.Header.Set("x-request-id", "trace-broken")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			h.rec()
			if !tc.event {
				if err == nil {
					t.Fatalf("a stream broken inside an event must reach the client as a transport error, got a clean %q", body)
				}
				return
			}
			if err != nil {
				t.Fatalf("the stream must end cleanly after its error event: %v (%q)", err, body)
			}
			rest, ok := strings.CutPrefix(string(body), tc.written)
			if !ok || !strings.HasSuffix(rest, "\n\ndata: [DONE]\n\n") {
				t.Fatalf("body %q: want what the pod sent, an error event and [DONE]", body)
			}
			ev, _ := strings.CutPrefix(strings.TrimSuffix(rest, "\n\ndata: [DONE]\n\n"), "data: ")
			code, typ, trace := decodeErr(t, []byte(ev))
			if code != 503 || typ != "upstream_unavailable" || trace != "trace-broken" {
				t.Fatalf("error event %q", ev)
			}
		})
	}
}

// countingBody counts the bytes read from a request body.
type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}
