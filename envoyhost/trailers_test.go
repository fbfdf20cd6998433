package envoyhost

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// tritonBackend answers Triton's generate / generate_stream and records the
// request it got; respTrailers are sent after the body when set.
type tritonBackend struct {
	addr         string
	hits         atomic.Int64
	mu           sync.Mutex
	path         string
	body         []byte
	trailers     http.Header
	respTrailers map[string]string
}

func newTritonBackend(t testing.TB) *tritonBackend {
	b := &tritonBackend{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.hits.Add(1)
		body, _ := io.ReadAll(r.Body)
		b.mu.Lock()
		b.path, b.body, b.trailers = r.URL.Path, body, r.Trailer.Clone()
		rt := b.respTrailers
		b.mu.Unlock()
		for k := range rt {
			w.Header().Add("Trailer", k)
		}
		if strings.HasSuffix(r.URL.Path, "generate_stream") {
			w.Header().Set("content-type", "text/event-stream")
			fmt.Fprint(w, "data: {\"text_output\":\"hel\"}\n\n")
			w.(http.Flusher).Flush()
			// the last event has no blank line after it: only Flush emits it
			fmt.Fprint(w, "data: {\"text_output\":\"lo\"}")
		} else {
			w.Header().Set("content-type", "application/json")
			fmt.Fprint(w, `{"model_name":"qwen","text_output":"hello"}`)
		}
		for k, v := range rt {
			w.Header().Set(k, v)
		}
	}))
	t.Cleanup(srv.Close)
	b.addr = srv.Listener.Addr().String()
	return b
}

func tritonDoc(mcURL, host string) string {
	return fmt.Sprintf(`metadata_center: {address: %q, query_timeout: 300ms, update_timeout: 1500ms}
model_mapping_rule:
  qwen:
    - cluster: pool
      backend: triton
endpoints:
  static: {pool: [%s]}
`, mcURL, host)
}

// postWithTrailers sends a chunked chat request that ends with trailers.
func postWithTrailers(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/v1/chat/completions", io.NopCloser(strings.NewReader(body)))
	req.ContentLength = -1
	req.Header.Set("content-type", "application/json")
	req.Trailer = http.Header{"X-Body-Digest": {"abc123"}}
	c := &http.Client{Timeout: 20 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("reading the body: %v", err)
	}
	return resp, b
}

// A request ending with trailers reaches the filter as
// DecodeData(body, endStream=false) then DecodeTrailers: it must still be
// routed, and the trailers must reach the pod.
func TestRequestWithTrailersIsRouted(t *testing.T) {
	st, mc := newMetadataCenter(t)
	bs := []*backend{newBackend(t), newBackend(t)}
	pods := []string{bs[0].addr, bs[1].addr}
	h := startHost(t, Options{Clusters: map[string][]string{"pool": pods}})
	if _, err := h.PushConfig([]byte(filterDoc(mc, pods, ""))); err != nil {
		t.Fatal(err)
	}
	resp, body := postWithTrailers(t, h.URL(), chatBody("a request with trailers", false))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	served := resp.Header.Get("x-served-by")
	if got := resp.Header.Get(headers.UpstreamHost); got == "" || got != served {
		t.Fatalf("%s = %q, served by %q: the request was not routed by the filter", headers.UpstreamHost, got, served)
	}
	b := bs[0]
	if served == bs[1].addr {
		b = bs[1]
	}
	gotBody, trailers, _ := b.last()
	if !strings.Contains(string(gotBody), "a request with trailers") || trailers.Get("X-Body-Digest") != "abc123" {
		t.Fatalf("the pod got body %q trailers %v", gotBody, trailers)
	}
	waitUntil(t, "the lease taken and released", 5*time.Second, func() bool { return st.adds.Load() == 1 && st.deletes.Load() == 1 })
}

// Transcoded (Triton) with trailers both ways: the request body is
// rewritten to Triton's form, the JSON answer back to OpenAI's.
func TestTranscodedRequestAndResponseWithTrailers(t *testing.T) {
	_, mc := newMetadataCenter(t)
	tb := newTritonBackend(t)
	tb.respTrailers = map[string]string{"X-Backend-Stats": "ok"}
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {tb.addr}}})
	if _, err := h.PushConfig([]byte(tritonDoc(mc, tb.addr))); err != nil {
		t.Fatal(err)
	}
	resp, body := postWithTrailers(t, h.URL(), chatBody("transcode me", false))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	tb.mu.Lock()
	path, sent := tb.path, string(tb.body)
	tb.mu.Unlock()
	if !strings.HasSuffix(path, "/generate") || !strings.Contains(sent, `"text_input"`) {
		t.Fatalf("the Triton pod got %s %q: the request was not transcoded", path, sent)
	}
	var out struct {
		Object  string `json:"object"`
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &out); err != nil || out.Object != "chat.completion" || len(out.Choices) != 1 || out.Choices[0].Message.Content != "hello" {
		t.Fatalf("the client got %q: the response was not transcoded (%v)", body, err)
	}
	if resp.Trailer.Get("X-Backend-Stats") != "ok" {
		t.Fatalf("response trailers lost: %v", resp.Trailer)
	}
}

// A transcoded stream that ends with trailers never shows EncodeData with
// endStream=true: its tail (the last event, the final chunk, [DONE]) must
// still reach the client.
func TestTranscodedStreamWithTrailersIsFlushed(t *testing.T) {
	_, mc := newMetadataCenter(t)
	tb := newTritonBackend(t)
	tb.respTrailers = map[string]string{"X-Backend-Stats": "ok"}
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {tb.addr}}})
	if _, err := h.PushConfig([]byte(tritonDoc(mc, tb.addr))); err != nil {
		t.Fatal(err)
	}
	resp, body := post(t, h.URL(), chatBody("stream me", true))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	var text strings.Builder
	done := false
	sc := bufio.NewScanner(strings.NewReader(string(body)))
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(line), &ev); err == nil && len(ev.Choices) > 0 {
			text.WriteString(ev.Choices[0].Delta.Content)
		}
	}
	if text.String() != "hello" || !done {
		t.Fatalf("the client got %q (text %q, [DONE] %v): the stream's tail was lost", body, text.String(), done)
	}
}

// Envoy's own buffer limits while the filter buffers (StopAndBuffer):
// a chunked request over per_connection_buffer_limit_bytes is answered 413
// by Envoy (the filter's max_body_bytes check needs a content-length), a
// buffered answer over it 500.
func TestBufferLimitsWhileBuffering(t *testing.T) {
	_, mc := newMetadataCenter(t)
	tb := newTritonBackend(t)
	h := startHost(t, Options{Clusters: map[string][]string{"pool": {tb.addr}}, BufferLimit: 300})
	if _, err := h.PushConfig([]byte(tritonDoc(mc, tb.addr))); err != nil {
		t.Fatal(err)
	}
	// Chunked, and in pieces, each sent once the host has read the one
	// before (or has answered): Envoy only learns the size while buffering
	// (a body that arrives in one read is handed over whole, unbuffered).
	pr, pw := io.Pipe()
	answered := make(chan struct{})
	go func() {
		b := chatBody(strings.Repeat("long question ", 60), false)
		sent := h.BodyBytesRead()
		for len(b) > 0 {
			n := min(200, len(b))
			if _, err := pw.Write([]byte(b[:n])); err != nil {
				return
			}
			b = b[n:]
			sent += int64(n)
			if len(b) == 0 {
				break
			}
			if !wait.Until(10*time.Second, func() bool {
				select {
				case <-answered:
					return true
				default:
					return h.BodyBytesRead() >= sent
				}
			}) {
				pw.CloseWithError(fmt.Errorf("the host neither read the piece nor answered (read %d, sent %d)", h.BodyBytesRead(), sent))
				return
			}
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", h.URL()+"/v1/chat/completions", pr)
	req.ContentLength = -1
	// A connection of its own: answered before its body was read, the
	// request leaves its connection to be closed, and the next request
	// must not be sent on it.
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 20 * time.Second}).Do(req)
	close(answered)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 413 || tb.hits.Load() != 0 {
		t.Fatalf("request over the buffer limit: status %d (%s), pod hits %d; want Envoy's 413", resp.StatusCode, body, tb.hits.Load())
	}

	// The answer: a Triton JSON body bigger than the limit, buffered for
	// transcoding.
	tb.mu.Lock()
	tb.respTrailers = nil
	tb.mu.Unlock()
	big := newTritonBackendAnswering(t, `{"model_name":"qwen","text_output":"`+strings.Repeat("x", 600)+`"}`)
	h.Router().SetHosts("pool", []string{big})
	if _, err := h.PushConfig([]byte(tritonDoc(mc, big))); err != nil {
		t.Fatal(err)
	}
	resp, body = post(t, h.URL(), chatBody("short", false))
	if resp.StatusCode != 500 {
		t.Fatalf("answer over the buffer limit: status %d (%s); want Envoy's 500", resp.StatusCode, body)
	}
	if err := h.Err(); err != nil {
		t.Fatal(err)
	}
}

func newTritonBackendAnswering(t testing.TB, answer string) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		w.Header().Set("content-type", "application/json")
		// chunked in two writes: Envoy sees the size only as data arrives
		fmt.Fprint(w, answer[:len(answer)/2])
		w.(http.Flusher).Flush()
		fmt.Fprint(w, answer[len(answer)/2:])
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}
