package coordinator

import (
	"fmt"
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/tracing"
)

// traceEnqueue starts the server span of one POST /api/tasks, a child of
// the request's W3C traceparent (and tracestate) when it has one: the
// client's enqueue span is its child and stores that trace with the task,
// so the task's claim, run and outcome spans join the caller's trace. It
// returns the writer and request to serve with, and the function that
// ends the span with the response's status (an error status for 5xx, as
// OpenTelemetry's HTTP conventions say for a server).
func (c *Coordinator) traceEnqueue(w http.ResponseWriter, r *http.Request) (http.ResponseWriter, *http.Request, func()) {
	ctx, span := c.tracer.Start(tracing.FromHTTP(r.Context(), r.Header), "POST /api/tasks",
		trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("http.route", "/api/tasks"),
			attribute.String("url.path", r.URL.Path)))
	sw := &statusWriter{ResponseWriter: w, code: http.StatusOK}
	return sw, r.WithContext(ctx), func() {
		span.SetAttributes(attribute.Int("http.response.status_code", sw.code))
		if sw.code >= 500 {
			span.SetStatus(codes.Error, fmt.Sprintf("HTTP %d", sw.code))
		}
		span.End()
	}
}

// statusWriter remembers the status code written, for the server span.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	s.code = code
	s.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }
