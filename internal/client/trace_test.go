package client_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// storedParent reads a task's stored trace context: its traceparent, ""
// for NULL.
func storedParent(t *testing.T, st *store.Store, id int64) string {
	t.Helper()
	var stored *string
	if err := st.Pool().QueryRow(context.Background(), `SELECT trace_context FROM tasks WHERE id = $1`, id).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if stored == nil {
		return ""
	}
	var m map[string]string
	if err := json.Unmarshal([]byte(*stored), &m); err != nil {
		t.Fatalf("task %d: stored trace context %q: %v", id, *stored, err)
	}
	return m["traceparent"]
}

func traceparent(sc trace.SpanContext) string {
	return "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"
}

func attr(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// TestEnqueueTraceContext: with tracing off nothing is stored (the column
// stays NULL on every insert path); with it on every path stores the
// trace context of its enqueue span, which is a child of the caller's span
// and carries the task's attributes.
func TestEnqueueTraceContext(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st, _ := pgtest.NewStore(t, store.Options{})
	later := time.Now().Add(time.Hour)

	off, err := client.New(st, client.Config{ShardCount: 16})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := off.Enqueue(ctx, tasks.NewTask{Kind: "k"}); err != nil {
		t.Fatal(err)
	}
	if _, err := off.Enqueue(ctx, tasks.NewTask{Kind: "k", Options: tasks.Options{UniqueKey: "off-1"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := off.EnqueueBatch(ctx, []tasks.NewTask{{Kind: "k"}, {Kind: "k", Options: tasks.Options{RunAfter: later}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := off.EnqueueBatch(ctx, []tasks.NewTask{{Kind: "k", Options: tasks.Options{UniqueKey: "off-2"}}, {Kind: "k"}}); err != nil {
		t.Fatal(err)
	}
	var traced int
	if err := st.Pool().QueryRow(ctx, `SELECT count(*) FILTER (WHERE trace_context IS NOT NULL) FROM tasks`).Scan(&traced); err != nil {
		t.Fatal(err)
	}
	if traced != 0 {
		t.Fatalf("tracing off stored %d trace contexts", traced)
	}

	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	on, err := client.New(st, client.Config{ShardCount: 16, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	pctx, producer := tp.Tracer("test").Start(ctx, "producer")
	single, err := on.Enqueue(pctx, tasks.NewTask{Kind: "mail", Options: tasks.Options{Queue: "emails"}})
	if err != nil {
		t.Fatal(err)
	}
	unique, err := on.Enqueue(pctx, tasks.NewTask{Kind: "mail", Options: tasks.Options{UniqueKey: "on-1"}})
	if err != nil {
		t.Fatal(err)
	}
	dup, err := on.Enqueue(pctx, tasks.NewTask{Kind: "mail", Options: tasks.Options{UniqueKey: "on-1"}})
	if err != nil || !dup.Duplicate {
		t.Fatal(dup, err)
	}
	var inTx tasks.Enqueued
	if err := pgx.BeginFunc(ctx, st.Pool(), func(tx pgx.Tx) error {
		inTx, err = on.EnqueueTx(pctx, tx, tasks.NewTask{Kind: "mail"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// COPY (one task due now, one later: two COPYs) and the unique path.
	if _, err := on.EnqueueBatch(pctx, []tasks.NewTask{{Kind: "copy"}, {Kind: "copy", Options: tasks.Options{RunAfter: later}}}); err != nil {
		t.Fatal(err)
	}
	ub, err := on.EnqueueBatch(pctx, []tasks.NewTask{{Kind: "ub", Options: tasks.Options{UniqueKey: "on-2"}}, {Kind: "ub"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := on.Enqueue(pctx, tasks.NewTask{}); err == nil {
		t.Fatal("an invalid task was accepted")
	}
	producer.End()

	spans := rec.Ended()
	byTask := map[int64]sdktrace.ReadOnlySpan{}
	var batches, invalid []sdktrace.ReadOnlySpan
	for _, s := range spans {
		switch {
		case s.Name() == "shardrun.enqueue" && s.Status().Code == codes.Error:
			invalid = append(invalid, s)
		case s.Name() == "shardrun.enqueue" && !attr(s, "shardrun.task.duplicate").AsBool():
			byTask[attr(s, "shardrun.task.id").AsInt64()] = s
		case s.Name() == "shardrun.enqueue_batch":
			batches = append(batches, s)
		}
	}
	for _, s := range spans {
		if s.Name() != "producer" && s.Parent().SpanID() != producer.SpanContext().SpanID() {
			t.Errorf("span %s: parent %s, want the producer's span", s.Name(), s.Parent().SpanID())
		}
		if s.SpanKind() != trace.SpanKindProducer && s.Name() != "producer" {
			t.Errorf("span %s: kind %s, want producer", s.Name(), s.SpanKind())
		}
	}
	for _, e := range []tasks.Enqueued{single, unique, inTx} {
		s, ok := byTask[e.ID]
		if !ok {
			t.Fatalf("no enqueue span for task %d", e.ID)
		}
		if got, want := storedParent(t, st, e.ID), traceparent(s.SpanContext()); got != want {
			t.Errorf("task %d stored %q, want its enqueue span %q", e.ID, got, want)
		}
		if attr(s, "shardrun.task.kind").AsString() != "mail" || attr(s, "shardrun.task.shard").AsInt64() != int64(e.Shard) {
			t.Errorf("task %d: attributes %v", e.ID, s.Attributes())
		}
	}
	if q := attr(byTask[single.ID], "shardrun.task.queue").AsString(); q != "emails" {
		t.Errorf("queue attribute %q", q)
	}
	if len(invalid) != 1 || !strings.Contains(invalid[0].Status().Description, "kind") {
		t.Errorf("the invalid enqueue's span: %v", invalid)
	}
	if len(batches) != 2 {
		t.Fatalf("%d batch spans, want 2", len(batches))
	}
	rows, err := st.Pool().Query(ctx, `SELECT id, kind FROM tasks WHERE kind IN ('copy', 'ub') ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]any, error) {
		var id int64
		var kind string
		err := r.Scan(&id, &kind)
		return [2]any{id, kind}, err
	})
	if err != nil || len(ids) != 4 {
		t.Fatalf("batch tasks: %v %v", ids, err)
	}
	for _, row := range ids {
		b := batches[0]
		if row[1] == "ub" {
			b = batches[1]
		}
		if got, want := storedParent(t, st, row[0].(int64)), traceparent(b.SpanContext()); got != want {
			t.Errorf("batch task %v stored %q, want its batch span %q", row, got, want)
		}
	}
	if attr(batches[1], "shardrun.batch.size").AsInt64() != 2 || ub.Inserted != 2 {
		t.Errorf("unique batch span: %v (%+v)", batches[1].Attributes(), ub)
	}
}
