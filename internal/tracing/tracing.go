// Package tracing is shardrun's OpenTelemetry setup and what the packages
// that make spans share: the tracer's scope, the attribute keys, how a
// trace context is stored with a task, and when a task's spans join the
// producer's trace rather than start a new one linked to it.
//
// Tracing is off unless the standard OTEL_* environment asks for it
// (FromEnv). Off, no tracer provider exists: the packages that trace take a
// nil trace.TracerProvider and skip every tracing step behind one nil
// check, so the hot path allocates nothing for traces and no task stores a
// trace context. On, the OpenTelemetry SDK exports over OTLP/HTTP in
// batches, configured entirely by the OTEL_* variables the SDK reads
// (endpoint, headers, TLS, timeouts, sampler, resource, batch sizes).
package tracing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of every shardrun span.
const ScopeName = "github.com/shardrun/shardrun"

// The attributes of shardrun's spans (docs/reference.md, Traces).
const (
	TaskID    = attribute.Key("shardrun.task.id")
	TaskKind  = attribute.Key("shardrun.task.kind")
	TaskShard = attribute.Key("shardrun.task.shard")
	TaskQueue = attribute.Key("shardrun.task.queue")
	// TaskAttempt is the attempt number (1 for the first run).
	TaskAttempt = attribute.Key("shardrun.task.attempt")
	// TaskEpoch is the claim's fencing token: the shard's etcd revision.
	TaskEpoch = attribute.Key("shardrun.task.epoch")
	// TaskDuplicate: an enqueue with a unique key an unfinished task held;
	// nothing was inserted and TaskID is the holder's.
	TaskDuplicate = attribute.Key("shardrun.task.duplicate")
	// TaskOutcome is what the outcome write did: completed, retried, dead,
	// failed, cancelled, interrupted, or refused (the claim had moved on).
	TaskOutcome = attribute.Key("shardrun.task.outcome")
	// Runner is the runner id that claimed, ran or wrote.
	Runner = attribute.Key("shardrun.runner.id")
	// BatchSize is the number of tasks of a batch span (an enqueued batch,
	// a claim, an outcome write).
	BatchSize = attribute.Key("shardrun.batch.size")
	// WakeNotified and WakeWoke are set on a claim batch whose round an
	// enqueue notification started: when the notification reached the
	// runner, and when its claim loop woke for it (unix nanoseconds: the
	// hops of the wake-up path, bench section wakeup).
	WakeNotified = attribute.Key("shardrun.wake.notified_unix_nano")
	WakeWoke     = attribute.Key("shardrun.wake.woke_unix_nano")
)

// LinkAfter decides between child and link: a task claimed at most this
// long after it was enqueued has its spans in the producer's trace, as
// children of the enqueue span; one claimed later (a run_after far ahead,
// a long backoff, an operator's retry days later) starts a new trace at
// its claim, linked to the enqueue span, so that a trace does not stay
// open for hours and a backend's trace view stays readable.
const LinkAfter = time.Hour

// Tracer returns the tracer of shardrun's spans from tp, or nil when tp is
// nil (tracing off): callers skip their spans on a nil tracer.
func Tracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		return nil
	}
	return tp.Tracer(ScopeName)
}

// propagator is W3C Trace Context (traceparent, tracestate): what an HTTP
// producer sends and what a task stores.
var propagator = propagation.TraceContext{}

// Inject returns the trace context of ctx's span as stored with a task: a
// JSON object of the W3C fields, {"traceparent": "00-…"} (with
// "tracestate" when there is one). Empty when ctx has no valid span.
func Inject(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	propagator.Inject(ctx, c)
	b, err := json.Marshal(c)
	if err != nil { // a map of strings always marshals
		return ""
	}
	return string(b)
}

// Extract returns the span context stored by Inject, marked remote; the
// zero (invalid) span context for an empty or unreadable one.
func Extract(stored string) trace.SpanContext {
	if stored == "" {
		return trace.SpanContext{}
	}
	var c propagation.MapCarrier
	if err := json.Unmarshal([]byte(stored), &c); err != nil {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(propagator.Extract(context.Background(), c))
}

// FromHTTP returns ctx with the remote span context of an HTTP request's
// traceparent and tracestate headers, when it has valid ones.
func FromHTTP(ctx context.Context, h http.Header) context.Context {
	return propagator.Extract(ctx, propagation.HeaderCarrier(h))
}

// End ends span with an error status when err is not nil.
func End(span trace.Span, err error, opts ...trace.SpanEndOption) {
	Fail(span, err)
	span.End(opts...)
}

// Fail records err on span and sets its status to error; nothing when err
// is nil.
func Fail(span trace.Span, err error) {
	if err == nil {
		return
	}
	span.RecordError(err)
	span.SetStatus(codes.Error, oneLine(err.Error()))
}

// oneLine is the first line of s (a handler's panic carries its stack
// after the first line; the error event keeps all of it).
func oneLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

// Provider is the SDK's tracer provider of one process. A nil *Provider is
// tracing off: TracerProvider returns nil and Shutdown does nothing.
type Provider struct {
	sdk *sdktrace.TracerProvider
}

// TracerProvider is what the runner, coordinator and client configs take;
// nil when p is nil.
func (p *Provider) TracerProvider() trace.TracerProvider {
	if p == nil {
		return nil
	}
	return p.sdk
}

// Shutdown exports the spans still buffered and stops the exporter; call
// it once the process's work has stopped, with a bounded context.
func (p *Provider) Shutdown(ctx context.Context) error {
	if p == nil {
		return nil
	}
	if err := p.sdk.Shutdown(ctx); err != nil {
		return fmt.Errorf("flushing traces: %w", err)
	}
	return nil
}

// ForceFlush exports the spans buffered so far (tests read them then).
func (p *Provider) ForceFlush(ctx context.Context) error {
	if p == nil {
		return nil
	}
	return p.sdk.ForceFlush(ctx)
}

// Enabled reports whether the environment asks for traces: OTLP is the
// traces exporter (OTEL_TRACES_EXPORTER=otlp) or an OTLP endpoint is set
// (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), and
// the SDK is not disabled (OTEL_SDK_DISABLED=true) nor the exporter none
// (OTEL_TRACES_EXPORTER=none). An exporter or protocol shardrun does not
// ship (anything but otlp over http/protobuf or http/json) is an error
// naming the variable.
func Enabled(getenv func(string) string) (bool, error) {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return false, nil
	}
	exporter := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER"))
	switch exporter {
	case "none":
		return false, nil
	case "", "otlp":
	default:
		return false, fmt.Errorf("OTEL_TRACES_EXPORTER: shardrun exports traces over OTLP only (otlp or none), got %q", exporter)
	}
	for _, name := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if v := strings.TrimSpace(getenv(name)); v != "" {
			if v != "http/protobuf" && v != "http/json" {
				return false, fmt.Errorf("%s: shardrun exports OTLP over HTTP (http/protobuf or http/json), got %q", name, v)
			}
			break // the traces variable takes precedence
		}
	}
	return exporter == "otlp" || getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "", nil
}

// FromEnv sets up tracing as the OTEL_* environment says (see Enabled), for
// a process whose service.name is service unless OTEL_SERVICE_NAME (or
// OTEL_RESOURCE_ATTRIBUTES) says otherwise. It returns a nil *Provider
// when tracing is off.
func FromEnv(ctx context.Context, service string, getenv func(string) string) (*Provider, error) {
	on, err := Enabled(getenv)
	if err != nil || !on {
		return nil, err
	}
	return New(ctx, service)
}

// New sets up tracing whatever the environment says: spans are exported
// in batches over OTLP/HTTP to the endpoint of the OTEL_* variables, or of
// opts (tests give their receiver's URL). The sampler is the SDK's, from
// OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (default: parent-based,
// always on).
func New(ctx context.Context, service string, opts ...otlptracehttp.Option) (*Provider, error) {
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("creating the OTLP trace exporter (OTEL_EXPORTER_OTLP_*): %w", err)
	}
	// Later options win: the service name given here is the default, the
	// environment's resource attributes override it.
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", service)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv())
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("reading the trace resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES): %w", err)
	}
	return &Provider{sdk: sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))}, nil
}

// LogErrors sends the SDK's own errors (an export the collector refused or
// could not take) to log, at warn, instead of the standard logger: the
// process's logs stay hclog's.
func LogErrors(log hclog.Logger) {
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn("tracing: exporting spans failed", "error", err)
	}))
}

// ShutdownTimeout bounds the flush of buffered spans at exit.
const ShutdownTimeout = 5 * time.Second

// Close flushes and stops p within ShutdownTimeout, logging a failure:
// the binaries call it on their way out.
func (p *Provider) Close(log hclog.Logger) {
	if p == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), ShutdownTimeout)
	defer cancel()
	if err := p.Shutdown(ctx); err != nil {
		log.Warn("tracing: spans may be lost", "error", err)
	}
}
