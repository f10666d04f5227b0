package tracing_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/tracing"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestEnabled(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		env     map[string]string
		on      bool
		errName string
	}{
		{env: nil, on: false},
		{env: map[string]string{"OTEL_SERVICE_NAME": "x"}, on: false},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, on: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, on: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, on: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, on: false},
		{env: map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, on: false},
		{env: map[string]string{"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, on: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, errName: "OTEL_TRACES_EXPORTER"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, errName: "OTEL_EXPORTER_OTLP_PROTOCOL"},
		// The traces variable wins over the general one.
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
			"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, on: true},
	} {
		on, err := tracing.Enabled(env(c.env))
		switch {
		case c.errName != "" && (err == nil || !strings.HasPrefix(err.Error(), c.errName+":")):
			t.Errorf("%v: error %v, want one naming %s", c.env, err, c.errName)
		case c.errName == "" && err != nil:
			t.Errorf("%v: %v", c.env, err)
		case on != c.on:
			t.Errorf("%v: on = %v, want %v", c.env, on, c.on)
		}
	}
}

// TestOffIsNil: with tracing off there is no provider, and the nil
// provider's methods are safe: callers need one nil check.
func TestOffIsNil(t *testing.T) {
	t.Parallel()
	p, err := tracing.FromEnv(context.Background(), "svc", env(nil))
	if err != nil || p != nil {
		t.Fatalf("FromEnv with nothing set = %v, %v; want nil, nil", p, err)
	}
	if p.TracerProvider() != nil || tracing.Tracer(p.TracerProvider()) != nil {
		t.Error("the provider of tracing off must be a nil interface")
	}
	if err := p.Shutdown(context.Background()); err != nil {
		t.Error(err)
	}
	if got := tracing.Inject(context.Background()); got != "" {
		t.Errorf("Inject without a span = %q, want empty", got)
	}
	if tracing.Extract("").IsValid() || tracing.Extract("not json").IsValid() {
		t.Error("Extract of nothing must be invalid")
	}
}

// TestInjectExtract: the stored form carries traceparent and tracestate,
// and reads back as the same remote span context; an HTTP request's
// headers are read the same way.
func TestInjectExtract(t *testing.T) {
	t.Parallel()
	h := http.Header{}
	h.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	h.Set("tracestate", "vendor=opaque")
	ctx := tracing.FromHTTP(context.Background(), h)
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() || !sc.IsRemote() || sc.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || sc.TraceState().Get("vendor") != "opaque" {
		t.Fatalf("from HTTP: %+v", sc)
	}
	stored := tracing.Inject(ctx)
	want := `{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"vendor=opaque"}`
	if stored != want {
		t.Fatalf("stored %s, want %s", stored, want)
	}
	back := tracing.Extract(stored)
	if !back.Equal(sc) {
		t.Fatalf("read back %+v, want %+v", back, sc)
	}
}
