package server

import (
	"context"
	"net/http"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
)

// startSpan opens the generation's server span, the child of the request's
// traceparent; nil when tracing is off.
func (s *Server) startSpan(r *http.Request, j *job, start time.Time) trace.Span {
	if s.cfg.Tracer == nil {
		return nil
	}
	ctx := tracing.Extract(r.Context(), r.Header)
	_, span := s.cfg.Tracer.Tracer(tracing.Scope).Start(ctx, "worker.generate", trace.WithSpanKind(trace.SpanKindServer),
		trace.WithTimestamp(start), trace.WithAttributes(
			attribute.String("http.route", r.URL.Path), attribute.String("llm.model", j.model),
			attribute.Int("llm.prompt_tokens", len(j.prompt))))
	return span
}

// endSpans closes the generation's span with its phases as children, laid
// out from the scheduler's timings (scheduler.Result) rather than traced
// inside the batching loop: queue wait (submission to admission), prefill
// (admission to the first token) and decode (first token to the end).
func endSpans(span trace.Span, start time.Time, status int, res *scheduler.Result) {
	end := time.Now()
	span.SetAttributes(attribute.Int("http.response.status_code", status))
	if status >= 400 {
		span.SetStatus(codes.Error, http.StatusText(status))
	}
	if res != nil {
		span.SetAttributes(attribute.Int("llm.cached_tokens", res.CachedTokens), attribute.Int("llm.completion_tokens", res.CompletionTokens),
			attribute.String("llm.state", res.State.String()))
		ctx := trace.ContextWithSpan(context.Background(), span)
		tr := span.TracerProvider().Tracer(tracing.Scope)
		phase := func(name string, from, to time.Time) {
			if to.Before(from) {
				to = from
			}
			_, p := tr.Start(ctx, name, trace.WithTimestamp(from))
			p.End(trace.WithTimestamp(to))
		}
		admitted := minTime(start.Add(res.QueueWait), end)
		phase("worker.queue_wait", start, admitted)
		if res.TTFT > 0 {
			first := minTime(start.Add(res.TTFT), end)
			phase("worker.prefill", admitted, first)
			phase("worker.decode", first, end)
		}
	}
	span.End(trace.WithTimestamp(end))
}

func minTime(a, b time.Time) time.Time {
	if a.After(b) {
		return b
	}
	return a
}
