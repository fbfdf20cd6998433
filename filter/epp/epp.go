// Package epp is the gateway's decision behind any Gateway API Inference
// Extension gateway: an endpoint picker (EPP) speaking Envoy's external
// processing protocol (envoy.service.ext_proc.v3.ExternalProcessor) as the
// Inference Extension's endpoint-picker protocol defines it
// (gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol).
// It is the third host of filter/routing's decision, beside the Envoy Go
// filter (filter/llmfilter) and the standalone gateway (filter/standalone),
// and reports the same lifecycle (filter/lifecycle).
//
// One gRPC stream is one HTTP request. Envoy's ext_proc filter sends, in
// order (processing_mode: request headers SEND, request body BUFFERED,
// response headers SEND, response body STREAMED, trailers SKIP; or both
// bodies FULL_DUPLEX_STREAMED with trailers SEND, where the request headers
// are answered with the decision once the body is in, and every chunk is
// sent back):
//
//	request headers   remembered; a request without a body is sent to a
//	                  pod of default_cluster round robin
//	request body      the decision (routing.Decider.Decide) on the whole
//	                  body: the pod in the x-gateway-destination-endpoint
//	                  header and, with the fallback pods after it, in the
//	                  envoy.lb dynamic metadata (see destination); the transcoded body and
//	                  path when the decision rewrites them; Started
//	response headers  the pod that really served (envoy.lb metadata
//	                  x-gateway-destination-endpoint-served, the response
//	                  header of that name, or Envoy's upstream.address
//	                  attribute) → Served; a 2xx → Saved
//	response body     the first chunk → FirstToken; transcoded answers (a
//	                  JSON answer passed through is not sent: its headers
//	                  are its first token, mode_override)
//	end of stream     Done (also when Envoy resets the stream)
//
// With tracing on (filter.tracing, as the gateway's), each decided request
// is a span, llm_epp.request, from its headers to its end, continuing the
// client's W3C traceparent, with the decision (routing.decide) and the
// route query as its children, the first token as an event, and the model,
// cluster, pod, policy and cache ratio as attributes; the pod gets the
// span as its parent in the traceparent the picker sets.
//
// A refused request gets an ImmediateResponse with routing.Error's status
// and JSON body. The metadata center's failure is not the picker's: the
// decision degrades to the load this picker sees and no cache knowledge
// (routing, "fallbacks"), and a pod is still picked, so Envoy's fail-open
// (failure_mode_allow, the InferencePool's FailOpen) never has to act on
// it; it does when the picker itself is unreachable.
package epp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	procv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/lifecycle"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
)

// The endpoint-picker protocol's names (004-endpoint-picker-protocol).
const (
	// DestinationHeader and DestinationKey carry the picked pods,
	// "ip:port[,ip:port...]", primary first; DestinationNamespace is the
	// dynamic metadata namespace of the key.
	DestinationHeader    = "x-gateway-destination-endpoint"
	DestinationKey       = DestinationHeader
	DestinationNamespace = "envoy.lb"
	// SubsetNamespace / SubsetKey: the gateway's list of the pods the
	// picker may choose from, in the request's filter metadata.
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
	// ServedKey names, in the response's metadata (namespace
	// DestinationNamespace), the pod that really served.
	ServedKey = "x-gateway-destination-endpoint-served"
	// ServedHeader is the same as a response header.
	ServedHeader = ServedKey
)

// The conformance test hooks of the Inference Extension's test picker
// (conformance/testing-epp; pkg/epp/scheduling/framework/plugins/filter,
// HeaderBasedTestingFilter): the request header restricts the candidates
// to the listed "ip" or "ip:port" entries, and the response header echoes
// the pod that served. On only with Options.ConformanceHooks.
const (
	TestSelectionHeader = "test-epp-endpoint-selection"
	TestServedHeader    = "x-conformance-test-served-endpoint"
)

// upstreamAddressAttr and codeDetailsAttr are the Envoy attributes the
// picker asks with the response headers (ext_proc response_attributes).
const (
	upstreamAddressAttr = "upstream.address"
	codeDetailsAttr     = "response.code_details"
)

// Options of New. Decider and Reporter are required.
type Options struct {
	Decider  *routing.Decider
	Reporter *lifecycle.Reporter
	// Endpoints is the decider's source, for the fallback pods and the
	// requests without a body; nil: none of either.
	Endpoints endpoints.Source
	// Outlier, if set, ejects a pod Envoy could not reach (passive health
	// checking as in the standalone gateway: a static pod list has none).
	Outlier *endpoints.Outlier
	// DefaultCluster takes the requests without a body (GET /v1/models);
	// "" with a single cluster configured: that one.
	DefaultCluster string
	// Fallbacks is how many pods follow the chosen one in the destination
	// list, for Envoy's retries.
	Fallbacks int
	// ConformanceHooks turns on the conformance test hooks (TestSelectionHeader).
	ConformanceHooks bool
	// Metrics records the gateway metrics (filter/gatewaymetrics), the
	// same names as the filter's; nil records nothing.
	Metrics gatewaymetrics.Recorder
	// Tracer makes a span per decided request (filter.tracing; see
	// Build), continuing the request's W3C traceparent and sent on to the
	// pod in it; nil traces nothing.
	Tracer trace.TracerProvider
	Logger *slog.Logger
}

// Server is the ExternalProcessor; safe for concurrent use.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	opts   Options
	log    *slog.Logger
	tracer trace.Tracer
	health *health.Server
	next   atomic.Uint64 // round robin of the requests without a body
}

// New returns a server; Register puts it on a gRPC server.
func New(opts Options) (*Server, error) {
	if opts.Decider == nil || opts.Reporter == nil {
		return nil, errors.New("epp: Options.Decider and Options.Reporter are required")
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Metrics == nil {
		opts.Metrics = nopRecorder{}
	}
	if opts.DefaultCluster == "" {
		if st := opts.Decider.Config().Endpoints.Static; len(st) == 1 {
			for c := range st {
				opts.DefaultCluster = c
			}
		}
	}
	if opts.Tracer == nil {
		opts.Tracer = noop.NewTracerProvider()
	}
	return &Server{opts: opts, log: opts.Logger, tracer: opts.Tracer.Tracer(tracing.Scope), health: health.NewServer()}, nil
}

// HealthServices are the gRPC health services the picker answers
// (004-endpoint-picker-protocol, "Health Checking"), "" being the server.
var HealthServices = []string{"", "liveness", "readiness", extprocv3.ExternalProcessor_ServiceDesc.ServiceName}

// NewGRPCServer is the gRPC server the picker is served on, binary and
// tests alike. Every HTTP request is a stream of a few small messages, so
// the per-stream costs dominate: a pool of stream workers (no goroutine
// and stack growth per stream), and fixed flow-control windows wide
// enough for a buffered request body, which turn off the bandwidth
// estimator's pings.
func NewGRPCServer(opts ...grpc.ServerOption) *grpc.Server {
	return grpc.NewServer(append([]grpc.ServerOption{
		grpc.NumStreamWorkers(uint32(runtime.GOMAXPROCS(0))),
		grpc.InitialWindowSize(grpcWindow),
		grpc.InitialConnWindowSize(grpcWindow),
	}, opts...)...)
}

// grpcWindow is the flow-control window of a stream and of a connection.
const grpcWindow = 1 << 20

// Register adds the ExternalProcessor and the gRPC health service, every
// HealthServices entry SERVING: the picker is active-active (the metadata
// center is its shared view), so no replica waits as a follower.
func (s *Server) Register(g *grpc.Server) {
	extprocv3.RegisterExternalProcessorServer(g, s)
	healthpb.RegisterHealthServer(g, s.health)
	for _, name := range HealthServices {
		s.health.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
	}
}

// Shutdown marks every health service NOT_SERVING (draining).
func (s *Server) Shutdown() { s.health.Shutdown() }

// Process serves one HTTP request's exchange.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) (err error) {
	x := &exchange{s: s, ctx: stream.Context(), span: noSpan}
	defer x.finish()
	defer func() {
		if e := recover(); e != nil {
			s.opts.Metrics.Count("panics", 1)
			s.log.Error("panic in the endpoint picker", "trace_id", x.trace, "panic", e, "stack", string(debug.Stack()))
			err = status.Errorf(codes.Internal, "endpoint picker panic: %v", e)
		}
	}()
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		resps, done := x.handle(req)
		for _, resp := range resps {
			if err := stream.Send(resp); err != nil {
				return err
			}
		}
		if done {
			return nil
		}
	}
}

// exchange is one request's state; a stream's messages come one at a time.
type exchange struct {
	s     *Server
	ctx   context.Context
	trace string
	hdrs  headerMap
	body  []byte
	req   *lifecycle.Request
	host  string // the pod of a request sent without a decision

	// reqDuplex, respDuplex: the bodies stream both ways
	// (FULL_DUPLEX_STREAMED): every chunk is answered with its content.
	reqDuplex, respDuplex bool

	answered  bool // response headers came
	status    int
	success   bool
	firstSeen bool
	streaming bool // text/event-stream answer
	buffering bool // a transcoded JSON answer, rewritten whole at its end
	respBody  []byte
	start     time.Time  // the request headers came
	span      trace.Span // the decided request's, ended with it
}

// nopRecorder records nothing.
type nopRecorder struct{}

func (nopRecorder) Count(string, int64)                                      {}
func (nopRecorder) Observe(string, gatewaymetrics.HistLabels, time.Duration) {}
func (nopRecorder) Request(gatewaymetrics.RequestLabels)                     {}

// handle answers one message with what is to be sent (maybe nothing yet);
// done ends the stream (an immediate response).
func (x *exchange) handle(req *extprocv3.ProcessingRequest) (resps []*extprocv3.ProcessingResponse, done bool) {
	if pc := req.GetProtocolConfig(); pc != nil {
		// Sent with the first message: whether the bodies stream both ways.
		x.reqDuplex = pc.GetRequestBodyMode() == procv3.ProcessingMode_FULL_DUPLEX_STREAMED
		x.respDuplex = pc.GetResponseBodyMode() == procv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	one := func(r *extprocv3.ProcessingResponse, done bool) ([]*extprocv3.ProcessingResponse, bool) {
		if r == nil {
			return nil, done
		}
		return []*extprocv3.ProcessingResponse{r}, done
	}
	switch r := req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return one(x.requestHeaders(req, r.RequestHeaders))
	case *extprocv3.ProcessingRequest_RequestBody:
		return x.requestBody(req, r.RequestBody.Body, r.RequestBody.EndOfStream)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		trailers := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
		if x.reqDuplex && x.req == nil {
			// The body ended with the trailers: decide now.
			resps, done := x.requestBody(req, nil, true)
			if done {
				return resps, true
			}
			return append(resps, trailers), false
		}
		return one(trailers, false)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return one(x.responseHeaders(req, r.ResponseHeaders))
	case *extprocv3.ProcessingRequest_ResponseBody:
		return one(x.responseBody(r.ResponseBody), false)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if x.success {
			x.firstToken() // an answer of trailers alone ends here
		}
		return one(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}, false)
	}
	return nil, false
}

// headerMap is the request headers by lower-case name (routing.Headers).
type headerMap map[string]string

func (h headerMap) Get(k string) (string, bool) { v, ok := h[k]; return v, ok }

func readHeaders(m *corev3.HeaderMap) headerMap {
	h := headerMap{}
	if m == nil {
		return h
	}
	for _, hv := range m.Headers {
		v := hv.Value
		if len(hv.RawValue) > 0 {
			v = string(hv.RawValue)
		}
		k := strings.ToLower(hv.Key)
		if old, ok := h[k]; ok {
			v = old + "," + v
		}
		h[k] = v
	}
	return h
}

func (x *exchange) requestHeaders(req *extprocv3.ProcessingRequest, hh *extprocv3.HttpHeaders) (*extprocv3.ProcessingResponse, bool) {
	x.hdrs = readHeaders(hh.Headers)
	x.trace = traceOf(x.hdrs)
	x.s.opts.Metrics.Count(gatewaymetrics.EventRequestsStarted, 1)
	x.start = time.Now()
	if !hh.EndOfStream {
		max := x.s.opts.Decider.Config().MaxBodyBytes
		if cl, ok := x.hdrs["content-length"]; ok {
			if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n > int64(max) {
				return x.reject(&routing.Error{Status: http.StatusRequestEntityTooLarge, Type: transcode.TypeTooLarge,
					Message: fmt.Sprintf("request body of %d bytes exceeds max_body_bytes (%d)", n, max), TraceID: x.trace}), true
			}
		}
		// The body follows: the decision waits for it. Streamed both ways
		// (FULL_DUPLEX_STREAMED), the headers' answer waits too: it carries
		// the destination.
		if x.reqDuplex {
			return nil, false
		}
		return headersResponse(true, nil, nil), false
	}
	// No body, nothing to route on (GET /v1/models, health checks): a pod
	// of the default cluster, round robin, as the route's cluster would.
	host := x.s.anyPod(x.subset(req))
	if host == "" {
		return x.reject(&routing.Error{Status: http.StatusServiceUnavailable, Type: transcode.TypeUnavailable,
			Message: "no available endpoint for a request without a body", TraceID: x.trace}), true
	}
	x.host = host
	return headersResponse(true, destination(host), []string{host}), false
}

func (x *exchange) requestBody(req *extprocv3.ProcessingRequest, chunk []byte, end bool) ([]*extprocv3.ProcessingResponse, bool) {
	x.body = append(x.body, chunk...)
	if !end {
		if x.reqDuplex {
			return nil, false // the chunks come back with the decision
		}
		// A streamed request mode: gather the chunks.
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}}, false
	}
	if max := x.s.opts.Decider.Config().MaxBodyBytes; len(x.body) > max && x.reqDuplex {
		return []*extprocv3.ProcessingResponse{x.reject(&routing.Error{Status: http.StatusRequestEntityTooLarge, Type: transcode.TypeTooLarge,
			Message: fmt.Sprintf("request body of %d bytes exceeds max_body_bytes (%d)", len(x.body), max), TraceID: x.trace})}, true
	}
	ctx := x.ctx
	allow := x.subset(req)
	if allow != nil {
		ctx = routing.WithSubset(ctx, allow)
	}
	ctx, x.span = x.s.tracer.Start(tracing.Extract(ctx, x.w3c()), "llm_epp.request",
		trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(x.start))
	t0 := time.Now()
	d, err := x.s.opts.Decider.Decide(ctx, x.hdrs, x.body)
	if err != nil {
		var re *routing.Error
		if !errors.As(err, &re) {
			re = &routing.Error{Status: http.StatusInternalServerError, Type: transcode.TypeInternal, Message: err.Error(), TraceID: x.trace}
		}
		x.span.SetAttributes(attribute.Int("http.response.status_code", re.Status))
		x.span.SetStatus(otelcodes.Error, err.Error())
		x.span.End()
		x.span = noSpan
		return []*extprocv3.ProcessingResponse{x.reject(re)}, true
	}
	x.span.SetAttributes(attribute.String("llm.model", d.Model), attribute.String("llm.cluster", d.Cluster),
		attribute.String("llm.pod", d.Host), attribute.String("llm.policy", d.Policy), attribute.Float64("llm.cache_ratio", d.CacheRatio))
	x.trace = d.TraceID
	hl := gatewaymetrics.HistLabels{Model: d.Model, Cluster: d.Cluster}
	x.s.opts.Metrics.Observe(gatewaymetrics.Decision, hl, time.Since(t0))
	if d.RouteQueryTook > 0 {
		x.s.opts.Metrics.Observe(gatewaymetrics.RouteQuery, hl, d.RouteQueryTook)
	}
	fallbacks := x.s.fallbacks(d, allow)
	set := destination(d.Host)
	cr := &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}
	if d.Body != nil {
		cr.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: d.Body}}
		if _, ok := x.hdrs["content-length"]; ok {
			cr.HeaderMutation.SetHeaders = append(cr.HeaderMutation.SetHeaders, header("content-length", strconv.Itoa(len(d.Body))))
		}
	}
	if d.Path != "" {
		cr.HeaderMutation.SetHeaders = append(cr.HeaderMutation.SetHeaders, header(":path", d.Path))
	}
	// The pod continues the request's trace under the picker's span.
	w3c := http.Header{}
	tracing.Inject(ctx, w3c)
	for k := range w3c {
		cr.HeaderMutation.SetHeaders = append(cr.HeaderMutation.SetHeaders, header(strings.ToLower(k), w3c.Get(k)))
	}
	x.req = lifecycle.NewRequest(d)
	x.s.opts.Reporter.Started(x.req)
	x.s.opts.Metrics.Count(gatewaymetrics.InFlight, 1)
	md := destinationMetadata(append([]string{d.Host}, fallbacks...))
	if x.reqDuplex {
		// The headers' answer carries the destination; the body goes back
		// whole (rewritten or not) as the one streamed chunk.
		body := x.body
		if d.Body != nil {
			body = d.Body
		}
		cr.BodyMutation = nil
		x.body = nil
		return []*extprocv3.ProcessingResponse{
			{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: cr}}, DynamicMetadata: md},
			{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: !hasTrailers(req)}}}}}}},
		}, false
	}
	x.body = nil
	return []*extprocv3.ProcessingResponse{{
		Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: cr}},
		DynamicMetadata: md,
	}}, false
}

// hasTrailers: the request's body ended with its trailers.
func hasTrailers(req *extprocv3.ProcessingRequest) bool {
	_, ok := req.Request.(*extprocv3.ProcessingRequest_RequestTrailers)
	return ok
}

func (x *exchange) responseHeaders(req *extprocv3.ProcessingRequest, hh *extprocv3.HttpHeaders) (*extprocv3.ProcessingResponse, bool) {
	h := readHeaders(hh.Headers)
	x.answered = true
	x.status, _ = strconv.Atoi(h[":status"])
	served, details := servedBy(req, h)
	chosen := x.host
	if x.req != nil {
		chosen = x.req.Host
	}
	viaUpstream := details == "" || details == "via_upstream"
	if o := x.s.opts.Outlier; o != nil && chosen != "" {
		switch {
		case !viaUpstream && strings.Contains(details, "upstream"):
			// Envoy could not reach the pod (connection refused, reset
			// before any answer): eject it, as the standalone gateway does.
			bad := served
			if bad == "" {
				bad = chosen
			}
			if !o.Ejected(bad) {
				o.Failed(bad)
				x.s.log.Warn("upstream ejected after a failed request", "upstream", bad, "details", details, "trace_id", x.trace)
			}
		case viaUpstream && served != "":
			o.Succeeded(served)
		}
	}
	if served == "" && viaUpstream {
		served = chosen
	}
	var set []*corev3.HeaderValueOption
	if served != "" {
		set = append(set, header(headers.UpstreamHost, served))
		if x.s.opts.ConformanceHooks {
			set = append(set, header(TestServedHeader, served))
		}
	}
	d := x.req
	if d == nil {
		return x.skipBody(headersResponse(false, set, nil)), false
	}
	if served != "" && served != d.Host && viaUpstream {
		x.s.log.Warn("the chosen pod did not serve the request", "trace_id", x.trace, "chosen", d.Host, "served", served, "cluster", d.Cluster)
		x.s.opts.Reporter.Served(d, served)
	}
	x.success = x.status >= 200 && x.status < 300 && viaUpstream
	if !x.success {
		x.s.opts.Metrics.Count("upstream_errors", 1)
		if d.Response != nil && viaUpstream {
			// A translated backend's error is nothing the client can read.
			return x.reject(&routing.Error{Status: http.StatusServiceUnavailable, Type: "backend_error",
				Message: fmt.Sprintf("backend %s answered %d", served, x.status), TraceID: x.trace}), true
		}
		return x.skipBody(headersResponse(false, set, nil)), false
	}
	d.Prediction.State(func(name, value string) { set = append(set, header(name, value)) })
	// The pod is answering, so it has (or is building) the prompt's cache.
	x.s.opts.Reporter.Saved(d)
	if hh.EndOfStream {
		x.firstToken()
		return headersResponse(false, set, nil), false
	}
	ct := strings.ToLower(strings.TrimSpace(h["content-type"]))
	x.streaming = strings.HasPrefix(ct, "text/event-stream")
	var remove []string
	if d.Response != nil {
		if ctype := d.Response.ContentType(x.streaming); ctype != "" {
			set = append(set, header("content-type", ctype))
		}
		remove = append(remove, "content-length") // transcoded bodies have other sizes
		x.buffering = !x.streaming
	}
	r := headersResponse(false, set, nil)
	r.GetResponseHeaders().Response.HeaderMutation.RemoveHeaders = remove
	if d.Response == nil && !x.streaming {
		// A JSON answer passed through: its headers come with the whole
		// generation done, so they are its first token, and its body needs
		// no round trip of ours.
		x.firstToken()
		x.skipBody(r)
	}
	return r, false
}

// skipBody asks Envoy not to send the response body (honoured when the
// filter's allow_mode_override is on; otherwise the body comes and passes
// through unchanged). The stream still ends with the request: Done.
func (x *exchange) skipBody(r *extprocv3.ProcessingResponse) *extprocv3.ProcessingResponse {
	if x.respDuplex {
		return r // the body streams through us either way
	}
	r.ModeOverride = &procv3.ProcessingMode{
		ResponseHeaderMode:  procv3.ProcessingMode_SEND,
		ResponseBodyMode:    procv3.ProcessingMode_NONE,
		ResponseTrailerMode: procv3.ProcessingMode_SKIP,
	}
	return r
}

func (x *exchange) responseBody(hb *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	out := func(m *extprocv3.BodyMutation) *extprocv3.ProcessingResponse {
		if x.respDuplex {
			// Streamed both ways, every chunk is sent back, changed or not.
			body := hb.Body
			switch mm := m.GetMutation().(type) {
			case *extprocv3.BodyMutation_Body:
				body = mm.Body
			case *extprocv3.BodyMutation_ClearBody:
				body = nil
			}
			m = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
				StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: hb.EndOfStream}}}
		}
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: m}}}}
	}
	d := x.req
	if d == nil || !x.success {
		return out(nil)
	}
	if len(hb.Body) > 0 || hb.EndOfStream {
		x.firstToken()
	}
	x.s.opts.Reporter.ResponseData(d, hb.Body)
	if d.Response == nil {
		return out(nil)
	}
	var body []byte
	var err error
	switch {
	case x.buffering && !hb.EndOfStream:
		x.respBody = append(x.respBody, hb.Body...)
		return out(&extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: true}})
	case x.buffering:
		body, err = d.Response.Body(append(x.respBody, hb.Body...))
		x.respBody = nil
	default:
		body, err = d.Response.Chunk(hb.Body)
		if err == nil && hb.EndOfStream {
			var tail []byte
			tail, err = d.Response.Flush()
			body = append(body, tail...)
		}
	}
	if err != nil {
		x.s.opts.Metrics.Count("transcode_errors", 1)
		x.s.log.Warn("response transcoding failed", "trace_id", x.trace, "backend", d.Backend, "err", err)
		e := &routing.Error{Status: http.StatusServiceUnavailable, Type: "transcode_failed", Message: "backend response could not be transcoded: " + err.Error(), TraceID: x.trace}
		body = e.JSON()
		if x.streaming {
			body = append(append([]byte("data: "), body...), "\n\n"...)
		}
	}
	if len(body) == 0 {
		return out(&extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: true}})
	}
	return out(&extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}})
}

func (x *exchange) firstToken() {
	if x.firstSeen {
		return
	}
	x.firstSeen = true
	x.span.AddEvent("first_token")
	x.s.opts.Reporter.FirstToken(x.req)
	x.s.opts.Metrics.Observe(gatewaymetrics.TTFT, gatewaymetrics.HistLabels{Model: x.req.Model, Cluster: x.req.Cluster}, time.Since(x.start))
}

// finish reports the end of a started request once: the stream ends after
// the response's last message, or when Envoy resets it.
func (x *exchange) finish() {
	if x.req == nil {
		return
	}
	if !x.answered {
		// Envoy's own replies (the pod refused the connection, reset, timed
		// out) skip ext_proc: Envoy only closes the stream, as it does when
		// the client leaves. A connection attempt tells the two apart; the
		// pod is left out of picks until it does, so a client retrying at
		// once is not sent to a dead pod again.
		if o := x.s.opts.Outlier; o != nil && !o.Ejected(x.req.Host) {
			o.Suspect(x.req.Host, probeTimeout)
			go x.s.probe(x.req.Host, x.trace)
		}
	}
	x.s.opts.Metrics.Count(gatewaymetrics.InFlight, -1)
	d := x.req
	x.s.opts.Metrics.Observe(gatewaymetrics.RequestDuration, gatewaymetrics.HistLabels{Model: d.Model, Cluster: d.Cluster}, time.Since(x.start))
	outcome := gatewaymetrics.OutcomeSuccess
	switch {
	case !x.answered:
		outcome = gatewaymetrics.OutcomeCancelled // or Envoy's own reply: the probe tells
	case !x.success:
		outcome = gatewaymetrics.OutcomeUpstreamError
	}
	x.s.opts.Metrics.Request(gatewaymetrics.RequestLabels{Model: d.Model, Cluster: d.Cluster, Scene: d.SceneName, Policy: d.Policy, Outcome: outcome})
	x.s.opts.Reporter.Done(d)
	x.req = nil
	if x.status != 0 {
		x.span.SetAttributes(attribute.Int("http.response.status_code", x.status))
	}
	x.span.SetAttributes(attribute.String("llm.outcome", outcome))
	if outcome != gatewaymetrics.OutcomeSuccess {
		x.span.SetStatus(otelcodes.Error, outcome)
	}
	x.span.End()
}

// noSpan is the span of a request not decided (yet): it records nothing.
var noSpan = trace.SpanFromContext(context.Background())

// w3c is the request's W3C trace context headers.
func (x *exchange) w3c() http.Header {
	h := http.Header{}
	for _, k := range []string{"traceparent", "tracestate"} {
		if v := x.hdrs[k]; v != "" {
			h.Set(k, v)
		}
	}
	return h
}

// reject answers the request with the project's error body.
func (x *exchange) reject(e *routing.Error) *extprocv3.ProcessingResponse {
	if e.TraceID == "" {
		e.TraceID = x.trace
	}
	x.s.opts.Metrics.Count("local_replies", 1)
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status:  &typev3.HttpStatus{Code: typev3.StatusCode(e.Status)},
		Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{header("content-type", "application/json")}},
		Body:    e.JSON(),
		Details: "llm_epp_" + e.Type,
	}}}
}

// subset returns the filter on candidate pods the request carries: the
// gateway's subset hint, and the conformance test header when enabled;
// nil when neither is set.
func (x *exchange) subset(req *extprocv3.ProcessingRequest) func(string) bool {
	var hint []string
	if ns := req.GetMetadataContext().GetFilterMetadata()[SubsetNamespace]; ns != nil {
		if v, ok := ns.Fields[SubsetKey]; ok {
			hint = []string{} // set, maybe empty: nothing is eligible
			for _, e := range v.GetListValue().GetValues() {
				hint = append(hint, e.GetStringValue())
			}
			if s := v.GetStringValue(); s != "" {
				hint = append(hint, splitList(s)...)
			}
		}
	}
	var test []string
	if x.s.opts.ConformanceHooks {
		if v := x.hdrs[TestSelectionHeader]; v != "" {
			test = splitList(v)
		}
	}
	if hint == nil && test == nil {
		return nil
	}
	return func(addr string) bool {
		return (hint == nil || slices.Contains(hint, addr)) && (test == nil || matchesAny(test, addr))
	}
}

// matchesAny: an entry is "ip:port", or "ip" for every port of the pod.
func matchesAny(list []string, addr string) bool {
	ip := addr
	if i := strings.LastIndexByte(addr, ':'); i >= 0 {
		ip = strings.Trim(addr[:i], "[]")
	}
	for _, e := range list {
		if e == addr || e == ip {
			return true
		}
	}
	return false
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// fallbacks are the pods Envoy may retry on after the chosen one, in
// order: the cluster's other eligible pods with the fewest requests in
// flight here first.
func (s *Server) fallbacks(d *routing.Decision, allow func(string) bool) []string {
	if s.opts.Fallbacks <= 0 || s.opts.Endpoints == nil {
		return nil
	}
	type cand struct {
		addr string
		n    int64
	}
	var cs []cand
	for _, ep := range s.opts.Endpoints.Endpoints(d.Cluster) {
		if ep.Address == d.Host || allow != nil && !allow(ep.Address) || ep.AdapterPod() {
			continue
		}
		n, _ := s.opts.Reporter.InFlight(d.Cluster, ep.Address)
		cs = append(cs, cand{ep.Address, n})
	}
	slices.SortStableFunc(cs, func(a, b cand) int { return int(a.n - b.n) })
	out := make([]string, 0, min(len(cs), s.opts.Fallbacks))
	for _, c := range cs[:min(len(cs), s.opts.Fallbacks)] {
		out = append(out, c.addr)
	}
	return out
}

// probeTimeout bounds probe's connection attempt.
const probeTimeout = time.Second

// probe ejects host (Options.Outlier, not nil) when it does not accept a
// connection, and clears its suspicion when it does: a request routed there
// ended without an answer.
func (s *Server) probe(host, trace string) {
	o := s.opts.Outlier
	c, err := net.DialTimeout("tcp", host, probeTimeout)
	if err == nil {
		c.Close()
		o.Cleared(host)
		return
	}
	o.Failed(host)
	s.opts.Metrics.Count("ejections", 1)
	s.log.Warn("upstream ejected: a request routed there ended unanswered and it refuses connections", "upstream", host, "trace_id", trace, "err", err)
}

// anyPod is a pod of the default cluster for a request without a body.
func (s *Server) anyPod(allow func(string) bool) string {
	if s.opts.Endpoints == nil || s.opts.DefaultCluster == "" {
		return ""
	}
	eps := s.opts.Endpoints.Endpoints(s.opts.DefaultCluster)
	if allow != nil {
		eps = slices.DeleteFunc(eps, func(e endpoints.Endpoint) bool { return !allow(e.Address) })
	}
	if len(eps) == 0 {
		return ""
	}
	return eps[(s.next.Add(1)-1)%uint64(len(eps))].Address
}

// servedBy is the pod that answered, as the gateway reports it, and
// Envoy's response code details ("" when not sent).
func servedBy(req *extprocv3.ProcessingRequest, h headerMap) (served, details string) {
	if ns := req.GetMetadataContext().GetFilterMetadata()[DestinationNamespace]; ns != nil {
		served = ns.Fields[ServedKey].GetStringValue()
	}
	if served == "" {
		served = h[ServedHeader]
	}
	for _, attrs := range req.GetAttributes() {
		if served == "" {
			served = attrs.Fields[upstreamAddressAttr].GetStringValue()
		}
		if details == "" {
			details = attrs.Fields[codeDetailsAttr].GetStringValue()
		}
	}
	return served, details
}

func traceOf(h headerMap) string {
	for _, k := range headers.TraceIDs {
		if v := h[k]; v != "" {
			return v
		}
	}
	return ""
}

func header(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

// destination sets the destination header to the chosen pod. The
// protocol lets the header carry the fallbacks too, but the ORIGINAL_DST
// cluster Istio generates for an InferencePool reads one "ip:port" from
// it (Envoy's original_dst_cluster.cc answers "no original_dst" to a
// list), so the ordered list with the fallbacks is in the envoy.lb
// metadata alone, where Envoy's override_host load balancing policy
// (Envoy Gateway's) reads it; its first entry is the header's value.
func destination(host string) []*corev3.HeaderValueOption {
	return []*corev3.HeaderValueOption{header(DestinationHeader, host)}
}

func destinationMetadata(hosts []string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		DestinationNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationKey: structpb.NewStringValue(strings.Join(hosts, ",")),
		}}),
	}}
}

// headersResponse continues with the header mutation set; request is the
// direction. hosts, if any, go in the dynamic metadata.
func headersResponse(request bool, set []*corev3.HeaderValueOption, hosts []string) *extprocv3.ProcessingResponse {
	hr := &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}}
	r := &extprocv3.ProcessingResponse{}
	if request {
		r.Response = &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: hr}
	} else {
		r.Response = &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: hr}
	}
	if len(hosts) > 0 {
		r.DynamicMetadata = destinationMetadata(hosts)
	}
	return r
}
