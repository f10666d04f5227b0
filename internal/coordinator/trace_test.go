package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/internal/tracing/tracingtest"
	"github.com/shardrun/shardrun/tasks"
)

// TestTraceOfAnHTTPEnqueue follows two tasks from POST /api/tasks, sent
// with a W3C traceparent, through a real coordinator and a real runner to
// a real OTLP/HTTP receiver: each task's spans — the API's server span, the
// enqueue, the claim, the handler's run and the outcome write — are in the
// caller's trace, each the child it should be, with the task's attributes;
// the claim and outcome batches are spans of the runner's own, linked both
// ways; the handler's context carries its run span; and a failing
// handler's run span has an error status. With -v it prints the trace.
func TestTraceOfAnHTTPEnqueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rcv := tracingtest.New(t)
	coordTraces := rcv.Provider(t, "shardrun-coordinator")
	runnerTraces := rcv.Provider(t, "shardrun-runner")
	c := e.start("coord", nil, func(cfg *Config) { cfg.TracerProvider = coordTraces.TracerProvider() })

	cfg := runner.DefaultConfig()
	cfg.EtcdEndpoints, cfg.EtcdPrefix, cfg.Cluster = e.etcd.Endpoints(), "/shardrun/", "test"
	cfg.ShardCount, cfg.DatabaseURL, cfg.AdminAddr = 16, e.dsn, "127.0.0.1:0"
	cfg.RunnerID, cfg.LeaseTTL, cfg.RecoveryWindow = "runner-1", 2*time.Second, 200*time.Millisecond
	cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "runner-1", Level: hclog.Warn, Output: testWriter{t}})
	cfg.TracerProvider = runnerTraces.TracerProvider()
	r, err := runner.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.HandleBuiltins(); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[int64]trace.SpanContext{} // the span each handler's context carried
	if err := r.Handle("charge", func(ctx context.Context, task *tasks.Task) error {
		mu.Lock()
		seen[task.ID] = trace.SpanContextFromContext(ctx)
		mu.Unlock()
		return task.SetResult(map[string]string{"charged": "ok"})
	}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stopRunner := sync.OnceFunc(func() { cancel(); <-done })
	t.Cleanup(stopRunner)
	<-r.Started()

	const (
		okTrace, okParent     = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
		failTrace, failParent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	)
	post := func(body, traceID, parent string) int64 {
		t.Helper()
		code, resp := testutil.HTTP(t, http.MethodPost, "http://"+c.Addr()+"/api/tasks", "", body,
			"Content-Type", "application/json", "traceparent", fmt.Sprintf("00-%s-%s-01", traceID, parent),
			"tracestate", "shop=checkout")
		if code != http.StatusCreated {
			t.Fatalf("POST /api/tasks: %d %s", code, resp)
		}
		var out struct{ ID int64 }
		if err := json.Unmarshal([]byte(resp), &out); err != nil {
			t.Fatal(err)
		}
		return out.ID
	}
	okID := post(`{"kind": "charge", "key": "order-1842", "payload": {"amount": 1299}}`, okTrace, okParent)
	failID := post(`{"kind": "fail", "payload": {"times": 9}, "max_attempts": 1}`, failTrace, failParent)
	testutil.WaitFor(t, 30*time.Second, "both tasks finished", func() bool {
		a, err1 := e.store.Get(context.Background(), okID)
		b, err2 := e.store.Get(context.Background(), failID)
		return err1 == nil && err2 == nil && a.State == tasks.Completed && b.State == tasks.Dead
	})
	stopRunner() // its last outcome spans end with the writes; Run returns after them
	for _, p := range []interface{ ForceFlush(context.Context) error }{coordTraces, runnerTraces} {
		if err := p.ForceFlush(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	spans := rcv.WaitFor(t, 10*time.Second, "the outcome spans of both tasks", func(s []tracingtest.Span) bool {
		return len(tracingtest.Find(s, "shardrun.outcome", "shardrun.task.id", okID)) == 1 &&
			len(tracingtest.Find(s, "shardrun.outcome", "shardrun.task.id", failID)) == 1
	})
	t.Logf("the trace of task %d:\n%s", okID, tracingtest.Tree(spans, okTrace))
	t.Logf("the trace of task %d (its handler fails):\n%s", failID, tracingtest.Tree(spans, failTrace))

	for _, tc := range []struct {
		id            int64
		kind          string
		trace, parent string
		outcome       string
	}{{okID, "charge", okTrace, okParent, "completed"}, {failID, "fail", failTrace, failParent, "dead"}} {
		one := func(name string, service string) tracingtest.Span {
			t.Helper()
			var found []tracingtest.Span
			for _, s := range spans {
				if s.Name == name && s.TraceID == tc.trace {
					found = append(found, s)
				}
			}
			if len(found) != 1 {
				t.Fatalf("task %d: %d spans %s in trace %s, want 1", tc.id, len(found), name, tc.trace)
			}
			if found[0].Service != service {
				t.Errorf("task %d: span %s from %q, want %q", tc.id, name, found[0].Service, service)
			}
			return found[0]
		}
		server := one("POST /api/tasks", "shardrun-coordinator")
		enqueue := one("shardrun.enqueue", "shardrun-coordinator")
		claim := one("shardrun.claim", "shardrun-runner")
		run := one("shardrun.run", "shardrun-runner")
		outcome := one("shardrun.outcome", "shardrun-runner")
		parents := []struct {
			child  tracingtest.Span
			parent string
		}{{server, tc.parent}, {enqueue, server.SpanID}, {claim, enqueue.SpanID}, {run, enqueue.SpanID}, {outcome, run.SpanID}}
		for _, p := range parents {
			if p.child.ParentSpanID != p.parent {
				t.Errorf("task %d: %s's parent is %s, want %s", tc.id, p.child.Name, p.child.ParentSpanID, p.parent)
			}
		}
		for _, s := range []tracingtest.Span{enqueue, claim, run, outcome} {
			if s.TraceState != "shop=checkout" {
				t.Errorf("task %d: %s has tracestate %q, want the caller's", tc.id, s.Name, s.TraceState)
			}
		}
		kinds := map[string]string{server.Name: "server", enqueue.Name: "producer", claim.Name: "internal", run.Name: "consumer", outcome.Name: "internal"}
		for _, s := range []tracingtest.Span{server, enqueue, claim, run, outcome} {
			if s.Kind != kinds[s.Name] {
				t.Errorf("task %d: %s is of kind %s, want %s", tc.id, s.Name, s.Kind, kinds[s.Name])
			}
			if s.InstrumentationScope != "github.com/shardrun/shardrun" {
				t.Errorf("%s: scope %q", s.Name, s.InstrumentationScope)
			}
		}
		if server.Attrs["http.response.status_code"] != int64(201) || server.Attrs["http.route"] != "/api/tasks" {
			t.Errorf("server span attributes %v", server.Attrs)
		}
		if enqueue.Attrs["shardrun.task.id"] != tc.id || enqueue.Attrs["shardrun.task.kind"] != tc.kind {
			t.Errorf("enqueue span attributes %v", enqueue.Attrs)
		}
		task, err := e.store.Get(context.Background(), tc.id)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range []tracingtest.Span{claim, run, outcome} {
			want := map[string]any{"shardrun.task.id": tc.id, "shardrun.task.kind": tc.kind,
				"shardrun.task.shard": int64(task.Shard), "shardrun.task.queue": "default",
				"shardrun.task.attempt": int64(1), "shardrun.task.epoch": task.Epoch, "shardrun.runner.id": "runner-1"}
			for k, v := range want {
				if s.Attrs[k] != v {
					t.Errorf("task %d: %s: %s = %v, want %v", tc.id, s.Name, k, s.Attrs[k], v)
				}
			}
		}
		if task.Epoch <= 0 {
			t.Errorf("task %d: epoch %d", tc.id, task.Epoch)
		}
		if outcome.Attrs["shardrun.task.outcome"] != tc.outcome {
			t.Errorf("task %d: outcome attribute %v, want %s", tc.id, outcome.Attrs["shardrun.task.outcome"], tc.outcome)
		}
		if outcome.StatusError {
			t.Errorf("task %d: the outcome write has an error status: %s", tc.id, outcome.StatusMessage)
		}
		wantErr := tc.outcome != "completed"
		if run.StatusError != wantErr || (wantErr && run.StatusMessage != "fail: attempt 1 of the first 9 that fail") {
			t.Errorf("task %d: run span status error=%v %q", tc.id, run.StatusError, run.StatusMessage)
		}
		if wantErr && (len(run.Events) != 1 || run.Events[0] != "exception") {
			t.Errorf("task %d: run span events %v, want the error's", tc.id, run.Events)
		}
		if !wantErr {
			mu.Lock()
			carried := seen[tc.id]
			mu.Unlock()
			if carried.SpanID().String() != run.SpanID || carried.TraceID().String() != tc.trace {
				t.Errorf("the handler's context carried span %s of trace %s, want the run span %s", carried.SpanID(), carried.TraceID(), run.SpanID)
			}
		}
		// Order: enqueue, then claim, then run, then the outcome.
		if claim.Start.Before(enqueue.End) || run.Start.Before(claim.End) || outcome.Start.Before(run.End) {
			t.Errorf("task %d: spans out of order: enqueue %s–%s claim %s–%s run %s–%s outcome %s",
				tc.id, enqueue.Start, enqueue.End, claim.Start, claim.End, run.Start, run.End, outcome.Start)
		}
		// The batches: roots of the runner's own, linked to the task's spans and back.
		for _, pair := range []struct {
			task  tracingtest.Span
			batch string
		}{{claim, "shardrun.claim_batch"}, {outcome, "shardrun.write_outcomes"}} {
			if len(pair.task.Links) != 1 {
				t.Fatalf("task %d: %s has links %v, want one to its batch", tc.id, pair.task.Name, pair.task.Links)
			}
			b, ok := tracingtest.ByID(spans, pair.task.Links[0].SpanID)
			if !ok || b.Name != pair.batch || b.ParentSpanID != "" || b.TraceID == tc.trace || b.Service != "shardrun-runner" {
				t.Fatalf("task %d: %s links to %+v, want a root %s of the runner", tc.id, pair.task.Name, b, pair.batch)
			}
			back := false
			for _, l := range b.Links {
				back = back || l.SpanID == pair.task.SpanID
			}
			if !back || b.Attrs["shardrun.batch.size"].(int64) < 1 {
				t.Errorf("task %d: batch %s does not link back to %s (links %v, size %v)", tc.id, b.Name, pair.task.Name, b.Links, b.Attrs["shardrun.batch.size"])
			}
		}
	}
}
