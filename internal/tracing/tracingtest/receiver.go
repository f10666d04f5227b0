// Package tracingtest is an OTLP/HTTP trace receiver for tests: a real HTTP
// server that decodes the exporter's protobuf export requests
// (opentelemetry-proto's collector/trace/v1), so that tests check the spans
// shardrun really exports — names, parenthood, trace ids, attributes,
// links, status — and print a trace as a tree.
package tracingtest

import (
	"compress/gzip"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/shardrun/shardrun/internal/tracing"
)

// Span is one received span, flattened.
type Span struct {
	Service              string
	Name                 string
	Kind                 string // "server", "producer", "consumer", "internal", …
	TraceID, SpanID      string // hex
	TraceState           string // W3C tracestate
	ParentSpanID         string // hex; empty for a root
	Start, End           time.Time
	Attrs                map[string]any // string, int64, bool or float64
	StatusError          bool
	StatusMessage        string
	Links                []Link
	Events               []string
	DroppedLinks         uint32
	ResourceAttrs        map[string]any
	InstrumentationScope string
}

// Link is one link of a span.
type Link struct{ TraceID, SpanID string }

// Duration is End - Start.
func (s Span) Duration() time.Duration { return s.End.Sub(s.Start) }

// Receiver collects the spans exported to it.
type Receiver struct {
	srv      *httptest.Server
	mu       sync.Mutex
	spans    []Span
	requests int
	bytes    int64
	count    int64
	// discard: count the requests, bytes and spans, keep nothing (the
	// bench's sink).
	discard bool
}

// New starts a receiver, closed when the test ends.
func New(t testing.TB) *Receiver {
	r := Start(false)
	t.Cleanup(r.Close)
	return r
}

// Start starts a receiver; discard keeps nothing, counting only the
// requests, their bytes and their spans. Close it when done.
func Start(discard bool) *Receiver {
	r := &Receiver{discard: discard}
	r.srv = httptest.NewServer(http.HandlerFunc(r.serve))
	return r
}

// Close stops the server.
func (r *Receiver) Close() { r.srv.Close() }

// URL is the traces endpoint, for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
// otlptracehttp.WithEndpointURL.
func (r *Receiver) URL() string { return r.srv.URL + "/v1/traces" }

// Received is the number of export requests received, their bytes (as
// sent: compressed when the exporter compresses) and their spans.
func (r *Receiver) Received() (requests int, bytes, spans int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests, r.bytes, r.count
}

func (r *Receiver) serve(w http.ResponseWriter, req *http.Request) {
	if req.Method != http.MethodPost || req.URL.Path != "/v1/traces" {
		http.Error(w, "POST /v1/traces only", http.StatusNotFound)
		return
	}
	var body io.Reader = req.Body
	if req.Header.Get("Content-Encoding") == "gzip" {
		gz, err := gzip.NewReader(req.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		defer gz.Close()
		body = gz
	}
	b, err := io.ReadAll(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var export collectortrace.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &export); err != nil {
		http.Error(w, "decoding the export request: "+err.Error(), http.StatusBadRequest)
		return
	}
	var got []Span
	var count int64
	if r.discard {
		for _, rs := range export.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				count += int64(len(ss.GetSpans()))
			}
		}
	} else {
		got = flatten(&export)
		count = int64(len(got))
	}
	r.mu.Lock()
	r.requests++
	r.bytes += int64(len(b))
	r.count += count
	r.spans = append(r.spans, got...)
	r.mu.Unlock()
	resp, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(resp)
}

func flatten(export *collectortrace.ExportTraceServiceRequest) []Span {
	var out []Span
	for _, rs := range export.GetResourceSpans() {
		res := attrs(rs.GetResource().GetAttributes())
		service, _ := res["service.name"].(string)
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				sp := Span{Service: service, Name: s.GetName(), Kind: kind(s.GetKind()),
					TraceID: hex.EncodeToString(s.GetTraceId()), SpanID: hex.EncodeToString(s.GetSpanId()), TraceState: s.GetTraceState(),
					ParentSpanID: hex.EncodeToString(s.GetParentSpanId()),
					Start:        time.Unix(0, int64(s.GetStartTimeUnixNano())), End: time.Unix(0, int64(s.GetEndTimeUnixNano())),
					Attrs: attrs(s.GetAttributes()), StatusError: s.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR,
					StatusMessage: s.GetStatus().GetMessage(), DroppedLinks: s.GetDroppedLinksCount(),
					ResourceAttrs: res, InstrumentationScope: ss.GetScope().GetName()}
				for _, l := range s.GetLinks() {
					sp.Links = append(sp.Links, Link{TraceID: hex.EncodeToString(l.GetTraceId()), SpanID: hex.EncodeToString(l.GetSpanId())})
				}
				for _, e := range s.GetEvents() {
					sp.Events = append(sp.Events, e.GetName())
				}
				out = append(out, sp)
			}
		}
	}
	return out
}

func kind(k tracepb.Span_SpanKind) string {
	return strings.ToLower(strings.TrimPrefix(k.String(), "SPAN_KIND_"))
}

func attrs(kvs []*commonpb.KeyValue) map[string]any {
	m := make(map[string]any, len(kvs))
	for _, kv := range kvs {
		v := kv.GetValue()
		switch x := v.GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.GetKey()] = x.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.GetKey()] = x.IntValue
		case *commonpb.AnyValue_BoolValue:
			m[kv.GetKey()] = x.BoolValue
		case *commonpb.AnyValue_DoubleValue:
			m[kv.GetKey()] = x.DoubleValue
		default:
			m[kv.GetKey()] = v.String()
		}
	}
	return m
}

// Spans returns every span received so far.
func (r *Receiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.spans)
}

// WaitFor polls the received spans until ok accepts them or timeout
// passes (then the test fails, listing the spans received), and returns
// them. The exporter sends batches on its own schedule: tests flush their
// providers and still poll.
func (r *Receiver) WaitFor(t testing.TB, timeout time.Duration, what string, ok func([]Span) bool) []Span {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		spans := r.Spans()
		if ok(spans) {
			return spans
		}
		if time.Now().After(deadline) {
			var names []string
			for _, s := range spans {
				names = append(names, s.Service+"/"+s.Name)
			}
			t.Fatalf("waiting %s for %s: received %d spans: %v", timeout, what, len(spans), names)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Find returns the spans named name whose attribute key is value (any
// value when key is empty).
func Find(spans []Span, name, key string, value any) []Span {
	var out []Span
	for _, s := range spans {
		if s.Name == name && (key == "" || s.Attrs[key] == value) {
			out = append(out, s)
		}
	}
	return out
}

// ByID returns the span with the given span id.
func ByID(spans []Span, id string) (Span, bool) {
	for _, s := range spans {
		if s.SpanID == id {
			return s, true
		}
	}
	return Span{}, false
}

// Tree prints the spans of one trace as a tree: each span with its
// service, kind, start (from the trace's first span) and duration, status,
// attributes and links (named when the linked span is among spans), its
// children indented under it in start order. A span whose parent was not
// received (the producer's own span, in another process) is printed at
// the top, with its parent's id.
func Tree(spans []Span, traceID string) string {
	var in []Span
	ids := map[string]bool{}
	for _, s := range spans {
		if s.TraceID == traceID {
			in = append(in, s)
			ids[s.SpanID] = true
		}
	}
	if len(in) == 0 {
		return "trace " + traceID + ": no span\n"
	}
	slices.SortFunc(in, func(a, b Span) int { return a.Start.Compare(b.Start) })
	first := in[0].Start
	var b strings.Builder
	fmt.Fprintf(&b, "trace %s\n", traceID)
	var walk func(parent string, depth int)
	walk = func(parent string, depth int) {
		for _, s := range in {
			if s.ParentSpanID != parent {
				continue
			}
			indent := strings.Repeat("   ", depth)
			line := fmt.Sprintf("%s└─ %s  [%s, %s]  at +%s, %s", indent, s.Name, s.Service, s.Kind,
				s.Start.Sub(first).Round(time.Microsecond), s.Duration().Round(time.Microsecond))
			if depth == 0 && parent != "" {
				line += "  (parent " + parent + ", not exported here)"
			}
			if s.StatusError {
				line += "  ERROR: " + s.StatusMessage
			}
			fmt.Fprintln(&b, line)
			keys := make([]string, 0, len(s.Attrs))
			for k := range s.Attrs {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			var kv []string
			for _, k := range keys {
				kv = append(kv, fmt.Sprintf("%s=%v", k, s.Attrs[k]))
			}
			if len(kv) > 0 {
				fmt.Fprintf(&b, "%s     %s\n", indent, strings.Join(kv, " "))
			}
			for _, l := range s.Links {
				name := "span"
				if ls, ok := ByID(spans, l.SpanID); ok {
					name = ls.Name
				}
				fmt.Fprintf(&b, "%s     link → %s %s (trace %s)\n", indent, name, l.SpanID, l.TraceID)
			}
			walk(s.SpanID, depth+1)
		}
	}
	// Roots: spans without a parent, or whose parent is not in the trace.
	seen := map[string]bool{}
	for _, s := range in {
		if s.ParentSpanID == "" || !ids[s.ParentSpanID] {
			if !seen[s.ParentSpanID] {
				seen[s.ParentSpanID] = true
				walk(s.ParentSpanID, 0)
			}
		}
	}
	return b.String()
}

// Provider is a tracer provider for service that exports to r, shut down
// (its spans flushed) and its connections closed when the test ends.
// Flush it before reading what it exported.
func (r *Receiver) Provider(t testing.TB, service string) *tracing.Provider {
	t.Helper()
	transport := http.DefaultTransport.(*http.Transport).Clone()
	p, err := tracing.New(context.Background(), service, otlptracehttp.WithEndpointURL(r.URL()),
		otlptracehttp.WithHTTPClient(&http.Client{Transport: transport}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := p.Shutdown(ctx); err != nil {
			t.Errorf("shutting down the tracer provider of %s: %v", service, err)
		}
		transport.CloseIdleConnections()
	})
	return p
}
