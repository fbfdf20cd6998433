// Package tracing sets up OpenTelemetry tracing for the gateway, the
// metadata center and the worker: an OTLP/HTTP exporter when an endpoint
// is configured (off by default), and W3C traceparent propagation across
// their HTTP calls. No global state is set: each component holds its own
// provider (the .so builds one per filter config and shuts it down with the
// config), and libraries start their spans from the span in the context
// (Start), so they trace exactly when their caller does.
package tracing

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Options configure a provider. An empty Endpoint turns tracing off.
type Options struct {
	// Endpoint is the OTLP/HTTP collector, e.g. http://otel-collector:4318
	// (traces go to its /v1/traces unless the URL names a path).
	Endpoint string
	// SampleRatio is the share of new traces sampled (0..1); a request
	// that arrives with a sampled traceparent is always traced.
	SampleRatio float64
	// Service is the resource's service.name.
	Service string
}

// DefaultSampleRatio samples every trace once an endpoint is set.
const DefaultSampleRatio = 1.0

// Validate checks the endpoint and the ratio.
func (o Options) Validate() error {
	if o.SampleRatio < 0 || o.SampleRatio > 1 {
		return fmt.Errorf("sample ratio %v is outside [0, 1]", o.SampleRatio)
	}
	if o.Endpoint == "" {
		return nil
	}
	u, err := url.Parse(o.Endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("otlp endpoint %q is not an http(s) URL", o.Endpoint)
	}
	return nil
}

// Provider is a component's tracer provider; Shutdown flushes and stops its
// exporter (a no-op when tracing is off).
type Provider struct {
	trace.TracerProvider
	sdk       *sdktrace.TracerProvider
	closeIdle func() // the exporter's own connections
}

// New builds a provider: a no-op one without an endpoint, else one that
// batches spans to the OTLP/HTTP endpoint.
func New(o Options) (*Provider, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.Endpoint == "" {
		return &Provider{TracerProvider: noop.NewTracerProvider()}, nil
	}
	return NewWithExporter(o, nil)
}

// NewWithExporter builds a provider exporting to exp (the OTLP/HTTP
// exporter of o.Endpoint when exp is nil).
func NewWithExporter(o Options, exp sdktrace.SpanExporter) (*Provider, error) {
	closeIdle := func() {}
	if exp == nil {
		u, err := url.Parse(o.Endpoint)
		if err != nil {
			return nil, err
		}
		if u.Path == "" || u.Path == "/" {
			u.Path = "/v1/traces"
		}
		// A transport of its own, closed with the provider: the exporter's
		// shared default would keep idle connections (and their
		// goroutines) after Shutdown.
		tr := http.DefaultTransport.(*http.Transport).Clone()
		closeIdle = tr.CloseIdleConnections
		exp, err = otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(u.String()),
			otlptracehttp.WithHTTPClient(&http.Client{Transport: tr, Timeout: exportTimeout}))
		if err != nil {
			return nil, err
		}
	}
	res := resource.NewSchemaless(attribute.String("service.name", o.Service))
	sdk := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(o.SampleRatio))),
	)
	return &Provider{TracerProvider: sdk, sdk: sdk, closeIdle: closeIdle}, nil
}

// Enabled reports whether spans are exported.
func (p *Provider) Enabled() bool { return p != nil && p.sdk != nil }

// Shutdown flushes the spans not exported yet and stops the exporter,
// bounded by ctx.
func (p *Provider) Shutdown(ctx context.Context) error {
	if !p.Enabled() {
		return nil
	}
	err := p.sdk.Shutdown(ctx)
	p.closeIdle()
	return err
}

// exportTimeout bounds one export call.
const exportTimeout = 10 * time.Second

// ShutdownTimeout bounds a shutdown done in the background.
const ShutdownTimeout = 5 * time.Second

// propagator is W3C Trace Context (the traceparent and tracestate headers).
var propagator = propagation.TraceContext{}

// Extract returns ctx carrying the remote span of h's traceparent, if any.
func Extract(ctx context.Context, h http.Header) context.Context {
	return propagator.Extract(ctx, propagation.HeaderCarrier(h))
}

// Inject writes ctx's span into h as traceparent (nothing without a span).
func Inject(ctx context.Context, h http.Header) {
	propagator.Inject(ctx, propagation.HeaderCarrier(h))
}

// Start starts a child of ctx's span with ctx's span's provider: a library
// call traces when, and where, its caller does.
func Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	return trace.SpanFromContext(ctx).TracerProvider().Tracer(Scope).Start(ctx, name, opts...)
}

// Scope is the instrumentation scope of every span of this module.
const Scope = "github.com/istio-llm-filter/istio-llm-filter"

// RegisterFlags adds --otlp-endpoint and --trace-sample-ratio to fs, the
// same flags on the metadata center and the worker.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.Endpoint, "otlp-endpoint", "", "OTLP/HTTP collector receiving this process's spans, e.g. http://otel-collector:4318 (empty: no tracing)")
	fs.Float64Var(&o.SampleRatio, "trace-sample-ratio", DefaultSampleRatio, "share of new traces sampled (0..1); a request with a sampled traceparent is always traced")
}
