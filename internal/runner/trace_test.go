package runner

import (
	"context"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/internal/tracing/tracingtest"
	"github.com/shardrun/shardrun/tasks"
)

// TestTraceOfAGoEnqueue follows tasks enqueued through the Go client under
// a producer's span to a real runner and a real OTLP receiver: a task run
// soon after its enqueue has its claim and run spans as children of its
// enqueue span (in the producer's trace), a batch's tasks are children of
// the batch's span, while a task claimed more than an hour after its
// enqueue, and one enqueued with tracing off, start a new trace at their
// claim (the late one linked to its enqueue) with the run under the claim.
func TestTraceOfAGoEnqueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rcv := tracingtest.New(t)
	p := rcv.Provider(t, "shardrun-test")
	traced, err := client.New(e.store, client.Config{ShardCount: testShards, TracerProvider: p.TracerProvider()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, checkout := p.TracerProvider().Tracer("test").Start(context.Background(), "checkout")
	soon, err := traced.Enqueue(ctx, tasks.NewTask{Kind: "noop", Options: tasks.Options{Key: "soon"}})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := traced.EnqueueBatch(ctx, []tasks.NewTask{{Kind: "noop", Options: tasks.Options{UniqueKey: "b1"}}, {Kind: "noop", Options: tasks.Options{UniqueKey: "b2"}}})
	if err != nil {
		t.Fatal(err)
	}
	late, err := traced.Enqueue(ctx, tasks.NewTask{Kind: "noop", Options: tasks.Options{Key: "late"}})
	if err != nil {
		t.Fatal(err)
	}
	checkout.End()
	untraced := e.enqueue("noop", "", 1)[0]
	if _, err := e.store.Pool().Exec(context.Background(), `UPDATE tasks SET created_at = now() - interval '2 hours' WHERE id = $1`, late.ID); err != nil {
		t.Fatal(err)
	}
	r := e.start("runner-1", func(c *Config, _ *Runner) { c.TracerProvider = p.TracerProvider() })
	ids := []int64{soon.ID, batch.Tasks[0].ID, batch.Tasks[1].ID, late.ID, untraced}
	testutil.WaitFor(t, 30*time.Second, "every task completed", func() bool {
		for _, id := range ids {
			if task, err := e.store.Get(context.Background(), id); err != nil || task.State != tasks.Completed {
				return false
			}
		}
		return true
	})
	r.stop()
	if err := p.ForceFlush(context.Background()); err != nil {
		t.Fatal(err)
	}
	spans := rcv.WaitFor(t, 10*time.Second, "every task's outcome span", func(s []tracingtest.Span) bool {
		for _, id := range ids {
			if len(tracingtest.Find(s, "shardrun.outcome", "shardrun.task.id", id)) != 1 {
				return false
			}
		}
		return true
	})
	one := func(name string, id int64) tracingtest.Span {
		t.Helper()
		found := tracingtest.Find(spans, name, "shardrun.task.id", id)
		if len(found) != 1 {
			t.Fatalf("task %d: %d spans %s, want 1", id, len(found), name)
		}
		return found[0]
	}
	producer := checkout.SpanContext()
	t.Logf("the producer's trace:\n%s", tracingtest.Tree(spans, producer.TraceID().String()))

	// Soon: children of its enqueue, in the producer's trace.
	enq := one("shardrun.enqueue", soon.ID)
	if enq.ParentSpanID != producer.SpanID().String() || enq.TraceID != producer.TraceID().String() {
		t.Errorf("the enqueue span's parent %s, want the producer's %s", enq.ParentSpanID, producer.SpanID())
	}
	for _, name := range []string{"shardrun.claim", "shardrun.run"} {
		if s := one(name, soon.ID); s.ParentSpanID != enq.SpanID || s.TraceID != enq.TraceID {
			t.Errorf("task %d: %s's parent %s, want the enqueue span %s", soon.ID, name, s.ParentSpanID, enq.SpanID)
		}
	}
	// The batch: every task's spans under the batch's span.
	batchSpans := tracingtest.Find(spans, "shardrun.enqueue_batch", "", nil)
	if len(batchSpans) != 1 || batchSpans[0].ParentSpanID != producer.SpanID().String() || batchSpans[0].Attrs["shardrun.batch.size"] != int64(2) {
		t.Fatalf("batch spans %+v", batchSpans)
	}
	for _, bt := range batch.Tasks {
		if s := one("shardrun.run", bt.ID); s.ParentSpanID != batchSpans[0].SpanID {
			t.Errorf("batch task %d: run's parent %s, want the batch span %s", bt.ID, s.ParentSpanID, batchSpans[0].SpanID)
		}
	}
	// Late and untraced: a new trace at the claim; the run under it.
	lateEnq := one("shardrun.enqueue", late.ID)
	for _, c := range []struct {
		id   int64
		link string
	}{{late.ID, lateEnq.SpanID}, {untraced, ""}} {
		claim, run := one("shardrun.claim", c.id), one("shardrun.run", c.id)
		if claim.ParentSpanID != "" || claim.TraceID == producer.TraceID().String() {
			t.Errorf("task %d: the claim span is not a new root: parent %q, trace %s", c.id, claim.ParentSpanID, claim.TraceID)
		}
		if run.ParentSpanID != claim.SpanID || run.TraceID != claim.TraceID {
			t.Errorf("task %d: run's parent %s, want its claim %s", c.id, run.ParentSpanID, claim.SpanID)
		}
		var links []string
		for _, l := range claim.Links {
			links = append(links, l.SpanID)
		}
		want := 1 // the claim batch
		if c.link != "" {
			want = 2
		}
		if len(links) != want || (c.link != "" && links[0] != c.link) {
			t.Errorf("task %d: claim links %v, want the enqueue %q and the batch", c.id, links, c.link)
		}
		if c.id == late.ID {
			t.Logf("the trace of the late task:\n%s", tracingtest.Tree(spans, claim.TraceID))
		}
	}
}
