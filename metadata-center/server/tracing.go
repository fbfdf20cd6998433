package server

import (
	"net/http"

	"github.com/gin-gonic/gin"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
)

// traced runs each call inside a server span named after its route
// ("metadata_center POST /v1/route/query"), the child of the caller's
// traceparent: the gateway's route query shows up in the request's trace.
func (s *Server) traced(tr trace.Tracer) gin.HandlerFunc {
	return func(c *gin.Context) {
		route := c.FullPath()
		if route == "" {
			route = "unknown"
		}
		ctx := tracing.Extract(c.Request.Context(), c.Request.Header)
		ctx, span := tr.Start(ctx, "metadata_center "+c.Request.Method+" "+route, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(attribute.String("http.request.method", c.Request.Method), attribute.String("http.route", route)))
		defer span.End()
		c.Request = c.Request.WithContext(ctx)
		c.Next()
		status := c.Writer.Status()
		span.SetAttributes(attribute.Int("http.response.status_code", status))
		if status >= 500 {
			span.SetStatus(codes.Error, http.StatusText(status))
		}
	}
}
