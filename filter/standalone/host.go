// Package standalone runs an Envoy Go HTTP filter without Envoy: it
// implements Envoy's filter callback interfaces over net/http and proxies to
// the host the filter picked, streaming responses chunk by chunk.
//
// The filter object is the very one Envoy loads from the .so; the host
// follows the semantics of contrib/golang in Envoy v1.36 for the parts a
// request-routing filter uses:
//
//   - DecodeHeaders(h, endStream) → Continue forwards; StopAndBuffer delivers
//     the whole body to one DecodeData(buf, true); StopAndBufferWatermark and
//     Continue deliver the body chunk by chunk; LocalReply means the filter
//     called SendLocalReply; Running waits for Continue(status) or
//     SendLocalReply from another goroutine.
//   - The same statuses apply to EncodeHeaders/EncodeData on the response;
//     a response the filter does not buffer is written and flushed chunk by
//     chunk, so SSE reaches the client as the backend produces it.
//   - Local replies (the filter's, 413, 503) pass through the encode phases
//     like in Envoy's filter manager, and OnStreamComplete, OnLog, OnDestroy
//     run in that order when the stream ends, whatever happened.
//   - A request without x-request-id gets one (a UUID), like Envoy's HTTP
//     connection manager, so the trace id reaches the backend.
//   - SetUpstreamOverrideHost accepts only a literal ip:port and is the only
//     routing there is: without it the request goes to Options.Fallback, or
//     gets 503 like a cluster without healthy hosts.
//
// Differences from Envoy, on purpose: the request body is read completely
// (bounded by MaxRequestBody, 413 beyond) before it goes upstream, whatever
// the filter's status, since LLM requests are single JSON documents; trailers
// are neither delivered to the filter nor forwarded; AddData/InjectData are
// not supported.
package standalone

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
	"github.com/google/uuid"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// Defaults of Options.
const (
	DefaultMaxRequestBody  = 8 << 20  // prompts with inline images stay well under this
	DefaultMaxResponseBody = 64 << 20 // only bounds responses the filter buffers
	readChunk              = 32 << 10
)

// Options configure a Host.
type Options struct {
	// Factory and Config are what Envoy would hand the filter: the factory
	// registered for the plugin and the config its parser returned.
	Factory api.StreamFilterFactory
	Config  any
	// Transport reaches the backends; nil: a dedicated http.Transport.
	Transport http.RoundTripper
	// MaxRequestBody bounds the request body (413 beyond), MaxResponseBody
	// the response bodies the filter asks to buffer (500 beyond, as Envoy).
	MaxRequestBody  int64
	MaxResponseBody int64
	// Fallback picks an "ip:port" for requests the filter did not pin
	// (say GET /v1/models); nil or "" means 503. It is the route cluster's
	// load balancer: Envoy uses it too when a non-strict override names a
	// host outside the cluster.
	// cluster is the request's routed cluster (see ClusterHeader).
	Fallback func(r *http.Request, cluster string) string
	// Member, if set, tells whether "ip:port" is a healthy member of the
	// request's cluster. As in Envoy, an override that is not is ignored
	// (non-strict: Fallback picks) or fails with 503 no_healthy_upstream
	// (strict). nil: every host is a member.
	Member func(cluster, host string) bool
	// ClusterHeader, if set, names the request header whose value (as the
	// filter left it) is the request's cluster: Envoy's route
	// cluster_header. "" when absent; Fallback and Member decide what an
	// unknown cluster means.
	ClusterHeader string
	// ConnectRetries is how many times a request whose connection to its
	// upstream failed — nothing of it was sent: refused, unreachable, dial
	// timeout — is sent again, each time to a host of its cluster that
	// Fallback (the cluster's load balancer) picks among those not tried
	// yet. This is Envoy's route retry policy `retry_on: connect-failure`
	// with the `previous_hosts` retry host predicate (Istio adds that
	// predicate to every retry policy); like Envoy's retries it ignores the
	// override host, and UpstreamRemoteAddress then names the pod that
	// really served. 0: no retry, Envoy's behaviour without a retry policy.
	ConnectRetries int
	// ConnectFailed, if set, is told at once about every host a connection
	// failed to, retried or not (passive health: eject it before the
	// stream ends).
	ConnectFailed func(host string)
	// Observe, if set, is told about every finished stream (metrics).
	Observe func(Outcome)
	Logger  *slog.Logger
}

// Outcome summarises one finished stream for metrics.
type Outcome struct {
	Status   int
	Duration time.Duration
	Upstream string // "" when no backend was contacted
	Local    bool   // answered by the filter or the host, not by a backend
	// UpstreamFailed: the backend could not be reached or reset before its
	// response began (connect refused, timeout): the passive health signal.
	UpstreamFailed bool
}

// Host is an http.Handler running one filter per request.
type Host struct {
	opts      Options
	transport http.RoundTripper
	log       *slog.Logger
	bufs      sync.Pool // *[]byte of readChunk bytes: one read buffer per body in flight
}

// New validates the options.
func New(opts Options) (*Host, error) {
	if opts.Factory == nil {
		return nil, errors.New("standalone: Options.Factory is required")
	}
	if opts.MaxRequestBody <= 0 {
		opts.MaxRequestBody = DefaultMaxRequestBody
	}
	if opts.MaxResponseBody <= 0 {
		opts.MaxResponseBody = DefaultMaxResponseBody
	}
	h := &Host{opts: opts, transport: opts.Transport, log: opts.Logger}
	h.bufs.New = func() any { b := make([]byte, readChunk); return &b }
	if h.log == nil {
		h.log = slog.Default()
	}
	if h.transport == nil {
		h.transport = &http.Transport{
			Proxy:                 nil, // backends are pod addresses, never via a proxy
			DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConnsPerHost:   64,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: 0, // prefill of a long prompt may take long; the client decides
			DisableCompression:    true,
		}
	}
	return h, nil
}

// ServeHTTP runs the filter over one request.
func (h *Host) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	if r.Header.Get(headers.RequestID) == "" {
		r.Header.Set(headers.RequestID, uuid.NewString())
	}
	s := newStream(h, r)
	rw := &responseState{w: w}
	reqHdr := NewRequestHeaders(r)
	f := h.opts.Factory(h.opts.Config, s)

	var respHdr *ResponseHeaders
	defer func() {
		// Envoy's order at stream end: OnStreamComplete, access log, destroy.
		// The log sees the headers the client got (a local reply sent while
		// encoding replaces the backend's), or those never sent if the
		// client left first.
		var logResp api.ResponseHeaderMap
		if rw.wroteHeader {
			logResp = NewResponseHeaders(rw.status, w.Header())
		} else if respHdr != nil {
			logResp = respHdr
		}
		h.lifecycle(func() { f.OnStreamComplete() })
		h.lifecycle(func() { f.OnLog(reqHdr, nil, logResp, nil) })
		reason := s.destroy()
		h.lifecycle(func() { f.OnDestroy(reason) })
		if h.opts.Observe != nil {
			s.mu.Lock()
			up, failed := s.upstream, s.upstreamFailed
			s.mu.Unlock()
			h.opts.Observe(Outcome{Status: rw.status, Duration: time.Since(s.start), Upstream: up, Local: rw.local, UpstreamFailed: failed})
		}
	}()

	body, trailers, reply, ok := h.decode(ctx, s, f, reqHdr, r)
	if !ok {
		return
	}
	if reply != nil {
		respHdr = h.localReply(ctx, s, f, rw, reply, r.Header.Get(headers.RequestID))
		return
	}
	respHdr = h.forward(ctx, s, f, rw, reqHdr, body, trailers, r)
	if rw.broken && rw.wroteHeader && ctx.Err() == nil {
		// The backend broke mid-body (or the filter cut it): reset the client
		// connection so a truncated stream never looks complete.
		panic(http.ErrAbortHandler)
	}
}

func (h *Host) lifecycle(fn func()) {
	defer func() {
		if e := recover(); e != nil {
			h.log.Error("panic in filter lifecycle callback", "panic", e)
		}
	}()
	fn()
}

// decode runs DecodeHeaders/DecodeData (and DecodeTrailers) and returns the
// body and trailers to send upstream, or the local reply that ends the
// request. ok is false if the client left.
//
// A request that ends with trailers is driven as Envoy drives it
// (golang_filter.cc doData/doTrailer): no DecodeData sees endStream=true —
// after StopAndBuffer the whole body arrives in one DecodeData(body,
// false) — and DecodeTrailers follows once the data phase continued.
func (h *Host) decode(ctx context.Context, s *stream, f api.StreamFilter, hdr *RequestHeaders, r *http.Request) (body []byte, trailers http.Header, reply *localReply, ok bool) {
	endStream := r.Body == nil || r.Body == http.NoBody
	st, reply, ok := s.call(ctx, false, func() api.StatusType { return f.DecodeHeaders(hdr, endStream) })
	if !ok || reply != nil {
		return nil, nil, reply, ok
	}
	if endStream {
		if st == api.StopAndBuffer || st == api.StopAndBufferWatermark {
			// Envoy's shim panics on this: waiting for data that will never come.
			return nil, nil, &localReply{code: 500, body: "error happened in filter\r\n", details: "filter_wait_data_without_body"}, true
		}
		return nil, nil, nil, true
	}
	if st != api.Continue && st != api.StopAndBuffer && st != api.StopAndBufferWatermark {
		return nil, nil, &localReply{code: 500, body: fmt.Sprintf("filter returned unexpected header status %d", st), details: "filter_bad_status"}, true
	}

	chunks, err := h.readChunks(r.Body, h.opts.MaxRequestBody)
	if err != nil {
		if errors.Is(err, errTooLarge) {
			return nil, nil, &localReply{code: http.StatusRequestEntityTooLarge, details: "request_payload_too_large",
				body: jsonError(http.StatusRequestEntityTooLarge, "payload_too_large",
					fmt.Sprintf("request body exceeds the %d-byte limit", h.opts.MaxRequestBody), r.Header.Get(headers.RequestID)),
				headers: map[string][]string{"content-type": {"application/json"}}}, true
		}
		h.log.Debug("reading request body failed", "err", err)
		return nil, nil, nil, false // client reset mid-body: nothing to answer
	}
	// The body was read to its end: net/http has filled the trailers in.
	trailers = presentTrailers(r.Trailer)
	if st == api.StopAndBuffer {
		chunks = [][]byte{bytes.Join(chunks, nil)}
	}
	var out []byte
	var held []byte                    // data the filter asked to keep buffering
	for i := 0; i < len(chunks); i++ { // chunks may be regrouped below
		c := chunks[i]
		end := i == len(chunks)-1 && trailers == nil
		buf := NewBuffer(append(held, c...))
		held = nil
		st, reply, ok := s.call(ctx, false, func() api.StatusType { return f.DecodeData(buf, end) })
		if !ok || reply != nil {
			return nil, nil, reply, ok
		}
		switch st {
		case api.Continue:
			out = append(out, buf.take()...)
		case api.StopAndBuffer, api.StopAndBufferWatermark:
			if end {
				return nil, nil, &localReply{code: 500, body: "filter wants more data after the end of the stream", details: "filter_bad_status"}, true
			}
			held = buf.take()
			if st == api.StopAndBuffer && i+1 < len(chunks) {
				// Everything else arrives in one final call, as in Envoy.
				rest := bytes.Join(chunks[i+1:], nil)
				chunks = append(chunks[:i+1], rest)
			}
		case api.StopNoBuffer:
			buf.take()
		default:
			return nil, nil, &localReply{code: 500, body: fmt.Sprintf("filter returned unexpected data status %d", st), details: "filter_bad_status"}, true
		}
	}
	if trailers == nil {
		return out, nil, nil, true
	}
	// Data still held when the trailers come goes on with them, as Envoy
	// continues a buffered body when its trailers arrive.
	out = append(out, held...)
	tm := NewHeaderMap(trailers)
	st, reply, ok = s.call(ctx, false, func() api.StatusType { return f.DecodeTrailers(tm) })
	if !ok || reply != nil {
		return nil, nil, reply, ok
	}
	if st != api.Continue {
		return nil, nil, &localReply{code: 500, body: fmt.Sprintf("filter returned unexpected trailer status %d", st), details: "filter_bad_status"}, true
	}
	return out, tm.httpHeader(), nil, true
}

// presentTrailers keeps the trailers that arrived (net/http lists every
// announced name, with no value when it never came); nil when none did.
func presentTrailers(t http.Header) http.Header {
	var out http.Header
	for k, vs := range t {
		if len(vs) == 0 {
			continue
		}
		if out == nil {
			out = http.Header{}
		}
		out[k] = vs
	}
	return out
}

var errTooLarge = errors.New("body too large")

// readChunks reads the body as it arrives, one slice per read.
func (h *Host) readChunks(r io.Reader, limit int64) ([][]byte, error) {
	var chunks [][]byte
	var total int64
	bp := h.bufs.Get().(*[]byte)
	defer h.bufs.Put(bp)
	buf := *bp
	for {
		n, err := r.Read(buf)
		if n > 0 {
			total += int64(n)
			if total > limit {
				return nil, errTooLarge
			}
			chunks = append(chunks, append([]byte(nil), buf[:n]...))
		}
		if err == io.EOF {
			if len(chunks) == 0 {
				chunks = [][]byte{nil} // end_stream arrives as an empty data frame
			}
			return chunks, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// forward sends the request to the chosen host and runs the response through
// the encode phases.
func (h *Host) forward(ctx context.Context, s *stream, f api.StreamFilter, rw *responseState, hdr *RequestHeaders, body []byte, trailers http.Header, r *http.Request) *ResponseHeaders {
	traceID, _ := hdr.Get(headers.RequestID)
	s.mu.Lock()
	target, strict := s.override, s.strict
	s.mu.Unlock()
	cluster := ""
	if h.opts.ClusterHeader != "" {
		// Read now, like Envoy's router computing a cleared route.
		cluster, _ = hdr.Get(h.opts.ClusterHeader)
	}
	if target != "" && h.opts.Member != nil && !h.opts.Member(cluster, target) {
		if strict {
			return h.localReply(ctx, s, f, rw, &localReply{code: http.StatusServiceUnavailable, details: "no_healthy_upstream",
				body:    jsonError(http.StatusServiceUnavailable, "no_healthy_upstream", "the override host is not a healthy member of the cluster", traceID),
				headers: map[string][]string{"content-type": {"application/json"}}}, traceID)
		}
		target = ""
	}
	if target == "" && h.opts.Fallback != nil {
		if fb := h.opts.Fallback(r, cluster); fb != "" {
			if norm, err := normalizeAddress(fb); err == nil {
				target = norm
			}
		}
	}
	if target == "" {
		return h.localReply(ctx, s, f, rw, &localReply{code: http.StatusServiceUnavailable, details: "no_healthy_upstream",
			body:    jsonError(http.StatusServiceUnavailable, "no_healthy_upstream", "no upstream host was selected for this request", traceID),
			headers: map[string][]string{"content-type": {"application/json"}}}, traceID)
	}
	header := hdr.httpHeader()
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		header.Add("x-forwarded-for", ip)
	}
	if header.Get("x-forwarded-proto") == "" {
		header.Set("x-forwarded-proto", hdr.Scheme())
	}
	var resp *http.Response
	tried := make([]string, 0, 1+h.opts.ConnectRetries)
	for {
		out, err := http.NewRequestWithContext(ctx, hdr.Method(), "http://"+target+hdr.Path(), bytes.NewReader(body))
		if err != nil {
			return h.localReply(ctx, s, f, rw, &localReply{code: http.StatusBadRequest, details: "bad_request_line",
				body:    jsonError(http.StatusBadRequest, "bad_request", "cannot build the upstream request: "+err.Error(), traceID),
				headers: map[string][]string{"content-type": {"application/json"}}}, traceID)
		}
		out.Header = header.Clone()
		out.Host = hdr.Host()
		out.ContentLength = int64(len(body))
		if len(body) == 0 {
			out.Body = http.NoBody
		}
		if trailers != nil {
			// Trailers need chunked encoding, as the client sent them.
			out.Trailer = trailers
			out.ContentLength = -1
			if len(body) == 0 {
				out.Body = io.NopCloser(bytes.NewReader(nil))
			}
		}
		s.mu.Lock()
		s.upstream = target
		s.mu.Unlock()

		resp, err = h.transport.RoundTrip(out)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil // client gone: nobody to answer
		}
		h.log.Warn("upstream request failed", "upstream", target, "trace_id", traceID, "err", err)
		tried = append(tried, target)
		connect := connectFailure(err)
		if connect && h.opts.ConnectFailed != nil {
			h.opts.ConnectFailed(target)
		}
		if connect && len(tried) <= h.opts.ConnectRetries {
			if next := h.retryHost(r, cluster, tried); next != "" {
				h.log.Info("retrying on another upstream after a failed connection", "failed", target, "upstream", next, "trace_id", traceID)
				target = next
				continue
			}
		}
		s.mu.Lock()
		s.upstreamFailed = true
		s.mu.Unlock()
		return h.localReply(ctx, s, f, rw, &localReply{code: http.StatusServiceUnavailable, details: "upstream_reset_before_response_started",
			body: jsonError(http.StatusServiceUnavailable, "upstream_unavailable",
				fmt.Sprintf("upstream connect error or disconnect/reset before headers: %v", err), traceID),
			headers: map[string][]string{"content-type": {"application/json"}}}, traceID)
	}
	defer resp.Body.Close()
	respHdr := NewResponseHeaders(resp.StatusCode, resp.Header)
	noBody := r.Method == http.MethodHead || resp.StatusCode == http.StatusNoContent ||
		resp.StatusCode == http.StatusNotModified || resp.ContentLength == 0
	h.encode(ctx, s, f, rw, respHdr, resp.Body, noBody, traceID, func() http.Header { return presentTrailers(resp.Trailer) })
	return respHdr
}

// isEventStream reports whether the response is server-sent events.
func isEventStream(hdr *ResponseHeaders) bool {
	ct, _ := hdr.Get("content-type")
	return strings.HasPrefix(strings.ToLower(strings.TrimSpace(ct)), "text/event-stream")
}

// connectFailure reports whether err is a failed connection: the request
// never left (Envoy's connect-failure retry condition). A request written
// on a reused connection that then broke is not one: the pod may have it.
func connectFailure(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// hostSelectionAttempts bounds how often a retry asks Fallback for a host
// it has not tried (Envoy's host_selection_retry_max_attempts; Istio sets 5).
const hostSelectionAttempts = 5

// retryHost is the host of a connect-failure retry: Fallback's pick for
// the cluster that is not one of tried (Envoy's previous_hosts predicate)
// and is a member of the cluster; "" when none turns up.
func (h *Host) retryHost(r *http.Request, cluster string, tried []string) string {
	if h.opts.Fallback == nil {
		return ""
	}
	for range hostSelectionAttempts {
		fb := h.opts.Fallback(r, cluster)
		norm, err := normalizeAddress(fb)
		if fb == "" || err != nil {
			return ""
		}
		if slices.Contains(tried, norm) || h.opts.Member != nil && !h.opts.Member(cluster, norm) {
			continue
		}
		return norm
	}
	return ""
}

// localReply answers with the reply through the encode phases, like Envoy's
// filter manager does for local replies sent while decoding.
func (h *Host) localReply(ctx context.Context, s *stream, f api.StreamFilter, rw *responseState, lr *localReply, traceID string) *ResponseHeaders {
	hdr := http.Header{}
	for k, vs := range lr.headers {
		for _, v := range vs {
			hdr.Add(k, v)
		}
	}
	if hdr.Get("content-type") == "" && lr.body != "" {
		hdr.Set("content-type", "text/plain")
	}
	hdr.Set("content-length", strconv.Itoa(len(lr.body)))
	s.mu.Lock()
	s.details = lr.details
	s.mu.Unlock()
	rw.local = true
	respHdr := NewResponseHeaders(lr.code, hdr)
	h.encode(ctx, s, f, rw, respHdr, bytes.NewReader([]byte(lr.body)), lr.body == "", traceID, nil)
	return respHdr
}

// responseState tracks what reached the client.
type responseState struct {
	w           http.ResponseWriter
	status      int
	wroteHeader bool
	local       bool
	broken      bool // a write to the client failed
	// tail is the body's last bytes written, to tell whether it ends
	// between two server-sent events (endsEvent).
	tail []byte
}

// endsEvent reports whether the body written so far ends between two
// server-sent events (nothing written yet, or a blank line last), where an
// error event can still be appended whole.
func (rw *responseState) endsEvent() bool {
	return len(rw.tail) == 0 || bytes.HasSuffix(rw.tail, []byte("\n\n")) || bytes.HasSuffix(rw.tail, []byte("\r\n\r\n"))
}

func (rw *responseState) writeHeader(hdr *ResponseHeaders) {
	if rw.wroteHeader {
		return
	}
	code, ok := hdr.Status()
	if !ok || code < 100 || code > 999 {
		code = http.StatusBadGateway
	}
	dst := rw.w.Header()
	for k, vs := range hdr.httpHeader() {
		dst[k] = vs
	}
	if cl, ok := hdr.Get("content-length"); ok {
		dst.Set("content-length", cl)
	}
	rw.w.WriteHeader(code)
	rw.status, rw.wroteHeader = code, true
	if f, ok := rw.w.(http.Flusher); ok {
		f.Flush()
	}
}

func (rw *responseState) write(p []byte) {
	if len(p) == 0 || rw.broken {
		return
	}
	if _, err := rw.w.Write(p); err != nil {
		rw.broken = true
		return
	}
	rw.tail = append(rw.tail, p[max(0, len(p)-4):]...)
	rw.tail = rw.tail[max(0, len(rw.tail)-4):]
	if f, ok := rw.w.(http.Flusher); ok {
		f.Flush()
	}
}

// directReply writes a reply without the filter, for local replies sent
// during the encode phases (Envoy does not re-enter the filter for those).
func (rw *responseState) directReply(lr *localReply) {
	if rw.wroteHeader {
		rw.broken = true // headers already out: all we can do is cut the stream
		return
	}
	hdr := http.Header{}
	for k, vs := range lr.headers {
		hdr[http.CanonicalHeaderKey(k)] = vs
	}
	if hdr.Get("content-type") == "" {
		hdr.Set("content-type", "text/plain")
	}
	rw.local = true
	rh := NewResponseHeaders(lr.code, hdr)
	rh.Set("content-length", strconv.Itoa(len(lr.body)))
	rw.writeHeader(rh)
	rw.write([]byte(lr.body))
}

// encode runs EncodeHeaders/EncodeData over a response and writes what the
// filter lets through. trailers (nil: none) gives the response's trailers
// once body is read to its end; with some, the last EncodeData has
// endStream=false and EncodeTrailers follows, in which the filter may
// AddData the body's tail, as in Envoy.
func (h *Host) encode(ctx context.Context, s *stream, f api.StreamFilter, rw *responseState, hdr *ResponseHeaders, body io.Reader, noBody bool, traceID string, trailers func() http.Header) {
	st, reply, ok := s.call(ctx, true, func() api.StatusType { return f.EncodeHeaders(hdr, noBody) })
	if !ok {
		return
	}
	if reply != nil {
		rw.directReply(reply)
		return
	}
	if noBody {
		rw.writeHeader(hdr)
		return
	}
	buffering := st == api.StopAndBuffer || st == api.StopAndBufferWatermark
	if !buffering {
		rw.writeHeader(hdr)
	}
	var held []byte
	var total int64
	bp := h.bufs.Get().(*[]byte)
	defer h.bufs.Put(bp)
	buf := *bp
	var tr http.Header
	for {
		n, err := body.Read(buf)
		end := err != nil
		if err == io.EOF && trailers != nil {
			tr = trailers()
		}
		if err != nil && err != io.EOF {
			if ctx.Err() != nil {
				return // client gone: nothing more to do
			}
			h.log.Warn("upstream body read failed", "trace_id", traceID, "err", err)
			if !rw.wroteHeader {
				rw.directReply(&localReply{code: http.StatusServiceUnavailable, details: "upstream_reset_after_response_started",
					body:    jsonError(http.StatusServiceUnavailable, "upstream_unavailable", "upstream reset while sending its body: "+err.Error(), traceID),
					headers: map[string][]string{"content-type": {"application/json"}}})
				return
			}
			if rw.status/100 == 2 && rw.endsEvent() && isEventStream(hdr) {
				// Headers are out, but an event stream can still say so in
				// its own terms: an error event in the project's error
				// format and [DONE], as the worker ends a stream that fails
				// (OpenAI streams errors this way), so an SDK raises the
				// error instead of a bare transport failure.
				rw.write([]byte("data: " + jsonError(http.StatusServiceUnavailable, "upstream_unavailable",
					"upstream reset while sending its body: "+err.Error(), traceID) + "\n\ndata: [DONE]\n\n"))
				return
			}
			// Headers are out: cutting the connection is the only honest signal.
			rw.broken = true
			return
		}
		chunk := buf[:n]
		if buffering && st == api.StopAndBuffer && !end {
			// The filter sees the whole body in one final call.
			total += int64(n)
			if total > h.opts.MaxResponseBody {
				rw.directReply(&localReply{code: 500, body: jsonError(500, "response_too_large",
					fmt.Sprintf("response body exceeds the %d-byte buffer limit", h.opts.MaxResponseBody), traceID),
					headers: map[string][]string{"content-type": {"application/json"}}, details: "response_payload_too_large"})
				return
			}
			held = append(held, chunk...)
			continue
		}
		if n == 0 && !end {
			continue
		}
		data := NewBuffer(append(held, chunk...))
		held = nil
		var reply *localReply
		st, reply, ok = s.call(ctx, true, func() api.StatusType { return f.EncodeData(data, end && tr == nil) })
		if !ok {
			return
		}
		if reply != nil {
			rw.directReply(reply)
			return
		}
		switch st {
		case api.Continue:
			if buffering {
				out := data.take()
				if tr == nil {
					hdr.Set("content-length", strconv.Itoa(len(out)))
				} else {
					hdr.Del("content-length") // chunked, to carry the trailers
				}
				rw.writeHeader(hdr)
				rw.write(out)
				buffering = false
			} else {
				rw.write(data.take())
			}
		case api.StopAndBuffer, api.StopAndBufferWatermark:
			held = data.take()
			buffering = true
		case api.StopNoBuffer:
			data.take()
		}
		if end && tr != nil && !rw.broken {
			h.encodeTrailers(ctx, s, f, rw, hdr, held, buffering, tr)
			return
		}
		if end || rw.broken {
			if buffering && !rw.wroteHeader && !rw.broken {
				// The filter kept the data at the very end: Envoy would stall;
				// flush what it holds rather than hang.
				rw.writeHeader(hdr)
				rw.write(held)
			}
			return
		}
	}
}

// encodeTrailers runs EncodeTrailers after the body's last EncodeData,
// writes what the filter still held and what it added (AddData in this
// phase appends to the body, as Envoy's addEncodedData), then the trailers.
func (h *Host) encodeTrailers(ctx context.Context, s *stream, f api.StreamFilter, rw *responseState, hdr *ResponseHeaders, held []byte, buffering bool, tr http.Header) {
	tm := NewHeaderMap(tr)
	s.mu.Lock()
	s.trailersPhase, s.added = true, nil
	s.mu.Unlock()
	_, reply, ok := s.call(ctx, true, func() api.StatusType { return f.EncodeTrailers(tm) })
	s.mu.Lock()
	added := s.added
	s.trailersPhase, s.added = false, nil
	s.mu.Unlock()
	if !ok {
		return
	}
	if reply != nil {
		rw.directReply(reply)
		return
	}
	if !rw.wroteHeader {
		hdr.Del("content-length") // chunked, to carry the trailers
		rw.writeHeader(hdr)
	}
	if buffering {
		rw.write(held)
	}
	rw.write(added)
	if rw.broken {
		return
	}
	// Set after the body: net/http sends these as the chunked body's trailers.
	for k, vs := range tm.httpHeader() {
		for _, v := range vs {
			rw.w.Header().Add(http.TrailerPrefix+k, v)
		}
	}
}

// jsonError renders the project's error document (docs/metadata-center.md, "Errors").
func jsonError(code int, typ, msg, traceID string) string {
	type body struct {
		Error struct {
			Code    int    `json:"code"`
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
		TraceID string `json:"trace_id,omitempty"`
	}
	var b body
	b.Error.Code, b.Error.Type, b.Error.Message, b.TraceID = code, typ, msg, traceID
	out, _ := json.Marshal(b)
	return string(out)
}

func normalizeAddress(a string) (string, error) { return endpoints.NormalizeAddress(a) }
