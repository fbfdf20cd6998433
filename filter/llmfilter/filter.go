package llmfilter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/lifecycle"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
)

// filter is one request. Envoy calls the phase methods one at a time on its
// worker thread; the decision runs on a goroutine of ours, and OnDestroy may
// come at any moment (client gone), so everything the goroutine shares with
// the phases sits under mu, and no callback is touched once destroyed is set.
type filter struct {
	conf *Config
	cb   api.FilterCallbackHandler
	log  *slog.Logger

	start time.Time

	mu        sync.Mutex
	destroyed bool
	cancel    context.CancelFunc // stops a running decision when the client leaves
	decision  *lifecycle.Request
	started   bool // lifecycle Started called: exactly one Done is owed
	finished  bool // lifecycle Done called

	// Set on the worker thread only.
	reqHeaders  api.RequestHeaderMap
	respHeaders api.ResponseHeaderMap
	traceID     string // guarded by mu: the decision goroutine refines it
	status      int
	streaming   bool // text/event-stream response
	buffering   bool // whole response buffered for transcoding
	success     bool // 2xx from the backend
	firstData   time.Time
	servedBy    string                 // the pod that really answered (Envoy may not have used ours)
	hostReply   bool                   // the response is Envoy's own local reply
	localType   atomic.Pointer[string] // error type of the local reply we sent
	span        trace.Span             // guarded by mu: the request's span, from its decision to OnLog
}

func newFilter(conf *Config, cb api.FilterCallbackHandler) *filter {
	return &filter{conf: conf, cb: cb, log: conf.log, start: time.Now()}
}

var _ api.StreamFilter = (*filter)(nil)

// traceHeaders are tried in order (docs/envoy-filter.md). Envoy's connection
// manager sets x-request-id on every request, so the first usually wins.
var traceHeaders = []string{"x-request-id", "x-trace-id", "x-amzn-trace-id"}

func traceIDOf(h api.RequestHeaderMap) string {
	for _, k := range traceHeaders {
		if v, ok := h.Get(k); ok && v != "" {
			return v
		}
	}
	return uuid.NewString()
}

// --- decode ---

func (f *filter) DecodeHeaders(h api.RequestHeaderMap, endStream bool) (st api.StatusType) {
	defer f.recoverPhase(&st, true)
	f.reqHeaders = h
	trace := traceIDOf(h)
	f.mu.Lock()
	f.traceID = trace
	f.mu.Unlock()
	f.conf.metrics.Count(gatewaymetrics.EventRequestsStarted, 1)
	if _, ok := h.Get(headers.Cluster); ok {
		// Only the filter names the routed cluster: a client's own header
		// would send a request to any cluster the gateway knows.
		h.Del(headers.Cluster)
		f.cb.ClearRouteCache()
	}
	if id, ok := f.modelsQuery(h); ok {
		ctx, cancel := context.WithCancel(context.Background())
		f.mu.Lock()
		f.cancel = cancel
		f.mu.Unlock()
		go f.listModels(ctx, cancel, id)
		return api.Running
	}
	if lr := f.bodylessReply(h, endStream); lr != nil {
		return f.reply(f.cb.DecoderFilterCallbacks(), lr)
	}
	if endStream {
		// No body, nothing to route on (health checks, other GETs): the
		// route's own cluster and load balancing apply (docs/envoy-filter.md).
		return api.Continue
	}
	if cl, ok := h.Get("content-length"); ok {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n > int64(f.conf.cfg.MaxBodyBytes) {
			return f.reply(f.cb.DecoderFilterCallbacks(), &routing.Error{Status: 413, Type: "payload_too_large",
				Message: fmt.Sprintf("request body of %d bytes exceeds max_body_bytes (%d)", n, f.conf.cfg.MaxBodyBytes), TraceID: f.trace()})
		}
	}
	return api.StopAndBuffer
}

func (f *filter) DecodeData(buf api.BufferInstance, endStream bool) (st api.StatusType) {
	defer f.recoverPhase(&st, true)
	// DecodeHeaders answered StopAndBuffer, so Envoy calls DecodeData once
	// with the whole body: endStream=true, or endStream=false when trailers
	// follow (golang_filter.cc doTrailer hands the buffered body over before
	// DecodeTrailers). Both are the complete request. Answering StopAndBuffer
	// to the latter would let Envoy pass the body and trailers on unrouted.
	body := bytes.Clone(buf.Bytes())
	ctx, cancel := context.WithCancel(context.Background())
	f.mu.Lock()
	if f.destroyed {
		f.mu.Unlock()
		cancel()
		return api.LocalReply
	}
	f.cancel = cancel
	f.mu.Unlock()
	// The decision waits on the metadata center (up to query_timeout): never
	// on Envoy's worker thread.
	go f.decide(tracing.Extract(ctx, f.w3c()), cancel, buf, body)
	return api.Running
}

// w3c is the request's W3C trace context headers, read on the worker thread.
func (f *filter) w3c() http.Header {
	h := http.Header{}
	for _, k := range []string{"traceparent", "tracestate"} {
		if v, ok := f.reqHeaders.Get(k); ok {
			h.Set(k, v)
		}
	}
	return h
}

func (f *filter) decide(ctx context.Context, cancel context.CancelFunc, buf api.BufferInstance, body []byte) {
	defer cancel()
	defer func() {
		if e := recover(); e != nil {
			f.asyncPanic(e)
		}
	}()
	ctx, span := f.conf.tracer.Tracer(tracing.Scope).Start(ctx, "llm_gateway.request",
		trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(f.start))
	t0 := time.Now()
	d, err := f.conf.router.Decide(ctx, f.reqHeaders, body)
	if d != nil {
		span.SetAttributes(attribute.String("llm.model", d.Model), attribute.String("llm.cluster", d.Cluster),
			attribute.String("llm.pod", d.Host), attribute.String("llm.policy", d.Policy), attribute.Float64("llm.cache_ratio", d.CacheRatio))
	}
	hl := gatewaymetrics.HistLabels{}
	if d != nil {
		hl = gatewaymetrics.HistLabels{Model: d.Model, Cluster: d.Cluster}
	}
	f.conf.metrics.Observe(gatewaymetrics.Decision, hl, time.Since(t0))
	if d != nil && d.RouteQueryTook > 0 {
		f.conf.metrics.Observe(gatewaymetrics.RouteQuery, hl, d.RouteQueryTook)
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	f.span = span
	if f.destroyed {
		span.End()
		return // the client left while we were deciding; nothing was started
	}
	dec := f.cb.DecoderFilterCallbacks()
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		f.reply(dec, asEngineError(err, f.traceID))
		return
	}
	// The pod continues the request's trace.
	w3c := http.Header{}
	tracing.Inject(ctx, w3c)
	for k := range w3c {
		f.reqHeaders.Set(strings.ToLower(k), w3c.Get(k))
	}
	f.traceID = d.TraceID
	// From a goroutine Envoy v1.36 posts the override and applies it with
	// strict=false whatever we ask (golang_filter.cc setUpstreamOverrideHost):
	// a pod that left the cluster falls back to the cluster's own load
	// balancing. Ask for what Envoy does; EncodeHeaders reports the pod that
	// really served.
	if err := dec.SetUpstreamOverrideHost(d.Host, false); err != nil {
		f.reply(dec, &routing.Error{Status: 503, Type: "invalid_upstream",
			Message: fmt.Sprintf("chosen host %q cannot be used: %v", d.Host, err), TraceID: d.TraceID})
		return
	}
	if d.Body != nil {
		if err := buf.Set(d.Body); err != nil {
			f.reply(dec, &routing.Error{Status: 500, Type: "internal_error", Message: "cannot replace the request body: " + err.Error(), TraceID: d.TraceID})
			return
		}
		if _, ok := f.reqHeaders.Get("content-length"); ok {
			// A chunked request (with trailers, say) stays chunked.
			f.reqHeaders.Set("content-length", strconv.Itoa(len(d.Body)))
		}
	}
	if d.Path != "" {
		f.reqHeaders.SetPath(d.Path)
	}
	// The rule's cluster is Envoy's cluster: the route forwards on this
	// header (cluster_header, istio/gateway.yaml), so a header-conditioned
	// rule reaches its own cluster and the override host is one of its
	// members. The route was computed before we knew: recompute it.
	f.reqHeaders.Set(headers.Cluster, d.Cluster)
	f.cb.ClearRouteCache()
	r := lifecycle.NewRequest(d)
	f.record(r)
	f.decision = r
	f.started = true
	f.conf.life.Started(r)
	f.conf.metrics.Count(gatewaymetrics.InFlight, 1)
	dec.Continue(api.Continue)
}

func asEngineError(err error, traceID string) *routing.Error {
	var e *routing.Error
	if errors.As(err, &e) {
		if e.TraceID == "" {
			c := *e
			c.TraceID = traceID
			return &c
		}
		return e
	}
	return &routing.Error{Status: 500, Type: "internal_error", Message: err.Error(), TraceID: traceID}
}

// reply sends a local reply in the project's error format (docs/metadata-center.md, "Errors"). Callers in a
// goroutine hold f.mu and have checked destroyed.
//
// Each reply is marked in the dynamic metadata (LocalReplyMetadataKey under
// the filter's name) so that the HCM's local_reply_config, which turns
// Envoy's own plain-text replies into the same JSON, leaves ours alone
// (istio/gateway.yaml).
func (f *filter) reply(cb api.FilterProcessCallbacks, e *routing.Error) api.StatusType {
	f.localType.Store(&e.Type)
	body := e.JSON()
	if e.Type == answered {
		body = []byte(e.Message)
	} else {
		f.conf.metrics.Count("local_replies", 1)
	}
	f.cb.StreamInfo().DynamicMetadata().Set(Name, LocalReplyMetadataKey, true)
	cb.SendLocalReply(e.Status, string(body), map[string][]string{"content-type": {"application/json"}}, -1, "llm_filter_"+e.Type)
	return api.LocalReply
}

// LocalReplyMetadataKey is set (true) in the dynamic metadata namespace
// Name on every reply the filter sends itself.
const LocalReplyMetadataKey = "local_reply"

// DecodeTrailers passes request trailers on: the decision already ran on
// the body (DecodeData), and Envoy holds the trailers until it continued.
func (f *filter) DecodeTrailers(api.RequestTrailerMap) api.StatusType { return api.Continue }

// --- encode ---

func (f *filter) EncodeHeaders(h api.ResponseHeaderMap, endStream bool) (st api.StatusType) {
	defer f.recoverPhase(&st, false)
	f.respHeaders = h
	f.status, _ = h.Status()
	d := f.currentDecision()
	if d == nil || f.replied() != "" {
		// An unrouted request, Envoy's own local reply (no route, upstream
		// 503), or the local reply we sent (Envoy may run it through the
		// encoder filters again).
		return api.Continue
	}
	// Name the pod that served the request, so clients and benchmarks can
	// see where routing sent them (like Envoy's %UPSTREAM_HOST%). The
	// override is not strict (see decide): when the chosen pod was not a
	// healthy member of the routed cluster, Envoy's load balancer picked
	// another one, and that is the pod that now holds the prompt's cache.
	served := d.Host
	if addr, ok := f.cb.StreamInfo().UpstreamRemoteAddress(); ok && addr != "" {
		served = addr
	}
	f.servedBy = served
	if details, ok := f.cb.StreamInfo().ResponseCodeDetails(); ok && details != "" && details != "via_upstream" {
		f.hostReply = true // Envoy's own reply (no healthy upstream, reset): no pod answered
	}
	h.Set(headers.UpstreamHost, served)
	d.Prediction.State(h.Set)
	f.meta(AccessBackend, served)
	if served != d.Host && !f.hostReply {
		// Lease, prefix and every later report follow the pod that really
		// has the request; the chosen one never saw it.
		f.log.Warn("the chosen pod did not serve the request (not a healthy member of the cluster in Envoy)",
			"trace_id", f.trace(), "chosen", d.Host, "served", served, "cluster", d.Cluster)
		f.conf.life.Served(d, served)
	}
	f.success = f.status >= 200 && f.status < 300
	if !f.success {
		f.conf.metrics.Count("upstream_errors", 1)
		// The backend refused or failed, and holds no new cache. OpenAI
		// servers already answer errors in OpenAI form (and a 429 or 408
		// tells the client more than a 503), so theirs go back untouched; a
		// translated backend's error is not something the client can read,
		// so it becomes a 503 once its body is in.
		if d.Response == nil || endStream {
			return api.Continue
		}
		f.buffering = true
		return api.StopAndBuffer
	}
	// The backend is answering, so it has (or is building) the prompt's KV
	// cache: record it for the next requests sharing this prefix, on the
	// pod that really serves (Served moved the lease and the routing-time
	// save there above, when Envoy sent the request elsewhere).
	f.conf.life.Saved(d)
	if endStream {
		f.firstToken(d)
		return api.Continue
	}
	ct, _ := h.Get("content-type")
	f.streaming = strings.HasPrefix(strings.ToLower(strings.TrimSpace(ct)), "text/event-stream")
	if d.Response == nil {
		// Streams flow chunk by chunk; a pass-through JSON body needs no
		// buffering either (its first byte is its first token).
		return api.Continue
	}
	if ctype := d.Response.ContentType(f.streaming); ctype != "" {
		h.Set("content-type", ctype)
	}
	if f.streaming {
		h.Del("content-length") // transcoded events have other sizes
		return api.Continue
	}
	f.buffering = true
	return api.StopAndBuffer
}

func (f *filter) EncodeData(buf api.BufferInstance, endStream bool) (st api.StatusType) {
	defer f.recoverPhase(&st, false)
	d := f.currentDecision()
	if d == nil || f.replied() != "" {
		// Nothing of ours, or the body of the local reply we just sent.
		return api.Continue
	}
	if !f.success {
		if !f.buffering {
			return api.Continue
		}
		// After StopAndBuffer the one EncodeData call carries the whole
		// body, with endStream=false when trailers follow.
		return f.reply(f.cb.EncoderFilterCallbacks(), &routing.Error{Status: 503, Type: "backend_error",
			Message: fmt.Sprintf("backend %s answered %d: %s", d.Host, f.status, snippet(buf.Bytes())), TraceID: f.trace()})
	}
	if f.firstData.IsZero() && (buf.Len() > 0 || endStream) {
		f.firstToken(d)
	}
	if d.Response == nil {
		f.conf.life.ResponseData(d, buf.Bytes())
		return api.Continue
	}
	if f.buffering {
		// The whole body (endStream=false: trailers follow), see above.
		out, err := d.Response.Body(buf.Bytes())
		if err != nil {
			f.conf.metrics.Count("transcode_errors", 1)
			f.log.Warn("response transcoding failed", "trace_id", f.trace(), "backend", d.Backend, "err", err)
			return f.reply(f.cb.EncoderFilterCallbacks(), &routing.Error{Status: 503, Type: "transcode_failed",
				Message: "backend response could not be transcoded: " + err.Error(), TraceID: f.trace()})
		}
		_ = buf.Set(out)
		f.conf.life.ResponseData(d, out)
		if _, ok := f.respHeaders.Get("content-length"); ok {
			// A chunked answer stays chunked: over HTTP/1.1 a content-length
			// would drop its trailers.
			f.respHeaders.Set("content-length", strconv.Itoa(len(out)))
		}
		return api.Continue
	}
	// Streamed: headers are gone, so a bad chunk becomes an SSE error event.
	out, err := d.Response.Chunk(buf.Bytes())
	if err == nil && endStream {
		var tail []byte
		tail, err = d.Response.Flush()
		out = append(out, tail...)
	}
	if err != nil {
		f.conf.metrics.Count("transcode_errors", 1)
		f.log.Warn("stream chunk transcoding failed", "trace_id", f.trace(), "backend", d.Backend, "err", err)
		e := &routing.Error{Status: 503, Type: "transcode_failed", Message: "backend stream could not be transcoded: " + err.Error(), TraceID: f.trace()}
		out = append(append([]byte("data: "), e.JSON()...), "\n\n"...)
	}
	_ = buf.Set(out)
	f.conf.life.ResponseData(d, out)
	return api.Continue
}

// snippet keeps error messages readable when a backend answers with a page.
func snippet(b []byte) string {
	const limit = 200
	s := strings.TrimSpace(string(b))
	if len(s) > limit {
		s = strings.ToValidUTF8(s[:limit], "") + "…"
	}
	return s
}

func (f *filter) firstToken(d *lifecycle.Request) {
	f.firstData = time.Now()
	ttft := f.firstData.Sub(f.start)
	f.conf.metrics.Observe(gatewaymetrics.TTFT, gatewaymetrics.HistLabels{Model: d.Model, Cluster: d.Cluster}, ttft)
	f.meta(AccessTTFT, ttft.Milliseconds())
	f.conf.life.FirstToken(d)
}

// EncodeTrailers ends a response that never showed EncodeData(endStream=
// true): a transcoded stream's tail (the last event, [DONE]) is added
// before the trailers, as Envoy's addEncodedData does from this callback.
func (f *filter) EncodeTrailers(api.ResponseTrailerMap) (st api.StatusType) {
	defer f.recoverPhase(&st, false)
	d := f.currentDecision()
	if d == nil || d.Response == nil || !f.success || f.buffering || f.replied() != "" {
		return api.Continue
	}
	tail, err := d.Response.Flush()
	if err != nil {
		f.conf.metrics.Count("transcode_errors", 1)
		f.log.Warn("stream tail transcoding failed", "trace_id", f.trace(), "backend", d.Backend, "err", err)
		e := &routing.Error{Status: 503, Type: "transcode_failed", Message: "backend stream could not be transcoded: " + err.Error(), TraceID: f.trace()}
		tail = append(append([]byte("data: "), e.JSON()...), "\n\n"...)
	}
	if len(tail) > 0 {
		f.cb.EncoderFilterCallbacks().AddData(tail, true)
	}
	return api.Continue
}

func (f *filter) currentDecision() *lifecycle.Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.decision
}

// --- end of stream ---

func (f *filter) OnLog(reqH api.RequestHeaderMap, _ api.RequestTrailerMap, respH api.ResponseHeaderMap, _ api.ResponseTrailerMap) {
	defer f.recoverLifecycle("OnLog")
	status := f.status
	if respH != nil {
		if s, ok := respH.Status(); ok {
			status = s
		}
	}
	d := f.finish()
	dur := time.Since(f.start)
	ttft := time.Duration(0)
	if !f.firstData.IsZero() {
		ttft = f.firstData.Sub(f.start)
	}
	attrs := []any{"trace_id", f.trace(), "status", status, "duration_ms", dur.Milliseconds(), "ttft_ms", ttft.Milliseconds()}
	if d != nil {
		backend := d.Host
		if f.servedBy != "" {
			backend = f.servedBy
		}
		attrs = append(attrs, "model", d.Model, "backend", backend, "chosen", d.Host, "cluster", d.Cluster, "scene", d.SceneName,
			"policy", d.Policy, "cache_ratio", d.CacheRatio, "degraded", d.Degraded, "stream", f.streaming,
			"prompt_length", d.PromptLength, "lease_id", d.RequestID)
	} else if reqH != nil {
		attrs = append(attrs, "path", reqH.Path())
	}
	if t := f.replied(); t != "" && t != answered {
		attrs = append(attrs, "error", t)
	}
	outcome := f.outcome(d, status)
	attrs = append(attrs, "outcome", outcome)
	f.conf.access.Info("completed", attrs...)
	labels := gatewaymetrics.RequestLabels{Outcome: outcome}
	if d != nil {
		labels = gatewaymetrics.RequestLabels{Model: d.Model, Cluster: d.Cluster, Scene: d.SceneName, Policy: d.Policy, Outcome: outcome}
		f.conf.metrics.Observe(gatewaymetrics.RequestDuration, gatewaymetrics.HistLabels{Model: d.Model, Cluster: d.Cluster}, dur)
	}
	f.conf.metrics.Request(labels)
	f.mu.Lock()
	span := f.span
	f.mu.Unlock()
	if span != nil {
		span.SetAttributes(attribute.Int("http.response.status_code", status), attribute.String("llm.outcome", outcome))
		if outcome != gatewaymetrics.OutcomeSuccess {
			span.SetStatus(codes.Error, outcome)
		}
		span.End()
	}
}

// outcome classifies a finished request (label outcome of gatewaymetrics.Requests).
func (f *filter) outcome(d *lifecycle.Request, status int) string {
	t := f.replied()
	switch {
	case d == nil && t == answered:
		return gatewaymetrics.OutcomeAnswered
	case d == nil && t != "":
		return gatewaymetrics.OutcomeRejected
	case status == 0:
		return gatewaymetrics.OutcomeCancelled
	case d == nil:
		return gatewaymetrics.OutcomeUnrouted
	case t != "" || f.hostReply:
		return gatewaymetrics.OutcomeFailed
	case f.success:
		return gatewaymetrics.OutcomeSuccess
	default:
		return gatewaymetrics.OutcomeUpstreamError
	}
}

// finish reports the end of a started request exactly once (OnLog, or
// OnDestroy if Envoy never logs) and returns its decision.
func (f *filter) finish() *lifecycle.Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.started && !f.finished {
		f.finished = true
		// The gauge first: once Done's report reaches the metadata center,
		// whoever reads both sees the request gone from each.
		f.conf.metrics.Count(gatewaymetrics.InFlight, -1)
		f.conf.life.Done(f.decision)
	}
	return f.decision
}

func (f *filter) OnLogDownstreamStart(api.RequestHeaderMap) {}
func (f *filter) OnLogDownstreamPeriodic(api.RequestHeaderMap, api.RequestTrailerMap, api.ResponseHeaderMap, api.ResponseTrailerMap) {
}
func (f *filter) OnStreamComplete() {}

func (f *filter) OnDestroy(api.DestroyReason) {
	defer f.recoverLifecycle("OnDestroy")
	f.mu.Lock()
	f.destroyed = true
	cancel := f.cancel
	f.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	f.finish()
}

// --- panics ---

// recoverPhase turns a panic in a phase into a 500 in the error format (Envoy
// would answer a bare 500 too, but without the trace id).
func (f *filter) recoverPhase(st *api.StatusType, decoding bool) {
	e := recover()
	if e == nil {
		return
	}
	f.conf.metrics.Count("panics", 1)
	f.log.Error("panic in filter phase", "trace_id", f.trace(), "panic", e, "stack", string(debug.Stack()))
	*st = api.Continue
	func() {
		defer func() { _ = recover() }() // the stream may not accept a reply now
		var cb api.FilterProcessCallbacks = f.cb.EncoderFilterCallbacks()
		if decoding {
			cb = f.cb.DecoderFilterCallbacks()
		}
		*st = f.reply(cb, &routing.Error{Status: 500, Type: "internal_error", Message: fmt.Sprint("filter panic: ", e), TraceID: f.trace()})
	}()
}

// trace is the request's trace id; the decision goroutine may update it
// while Envoy runs other phases (its own local replies, OnLog on a reset).
func (f *filter) trace() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.traceID
}

// replied is the error type of the local reply we sent, "" if none.
func (f *filter) replied() string {
	if t := f.localType.Load(); t != nil {
		return *t
	}
	return ""
}

// streamGone recognises the panic Envoy's shim raises ("golang filter has
// been destroyed", "request has been finished") for a callback made after
// Envoy ended the stream but before our OnDestroy ran: a window that no
// Go-side flag can close, and nothing to report.
func streamGone(e any) bool {
	s := fmt.Sprint(e)
	return strings.Contains(s, "has been destroyed") || strings.Contains(s, "request has been finished")
}

// asyncPanic handles a panic on our decision goroutine: Envoy would crash.
func (f *filter) asyncPanic(e any) {
	if streamGone(e) {
		f.log.Debug("stream ended while the decision was being applied", "trace_id", f.trace())
		return
	}
	f.conf.metrics.Count("panics", 1)
	f.log.Error("panic in filter goroutine", "trace_id", f.trace(), "panic", e, "stack", string(debug.Stack()))
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.destroyed {
		return
	}
	defer func() { _ = recover() }()
	f.reply(f.cb.DecoderFilterCallbacks(), &routing.Error{Status: 500, Type: "internal_error", Message: fmt.Sprint("filter panic: ", e), TraceID: f.traceID})
}

func (f *filter) recoverLifecycle(where string) {
	if e := recover(); e != nil {
		f.conf.metrics.Count("panics", 1)
		f.log.Error("panic in "+where, "trace_id", f.trace(), "panic", e, "stack", string(debug.Stack()))
	}
}
