package executor

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/tasks"
)

// The executor's spans (docs/reference.md, Traces). Claims and outcome writes are
// batched: each batch is one span of the runner's own (a root, so a claim
// of 500 tasks is one span, not 500 traces' worth of one statement),
// linked to the tasks' spans; each task gets its own span of the batch in
// the task's trace, linked back to the batch span:
//
//	shardrun.enqueue                (producer; the client, in the producer's trace)
//	├─ shardrun.claim               (per task: the claim statement that took it; link → shardrun.claim_batch)
//	└─ shardrun.run                 (consumer: the handler; its context carries this span)
//	   └─ shardrun.outcome          (per task: from the handler's return until its outcome is written; link → shardrun.write_outcomes)
//
// A task claimed more than tracing.LinkAfter after its enqueue, or
// enqueued without a trace context, starts a new trace at its claim
// (linked to the enqueue span when there is one), and its run is a child of
// that claim span.
//
// A nil *tracer is tracing off: every method returns at once, so the hot
// path allocates nothing for traces.
type tracer struct {
	t      trace.Tracer
	runner attribute.KeyValue
}

func newTracer(tp trace.TracerProvider, runnerID string) *tracer {
	if tp == nil {
		return nil
	}
	return &tracer{t: tracing.Tracer(tp), runner: tracing.Runner.String(runnerID)}
}

// taskAttrs are the attributes of every per-task span of an attempt.
func taskAttrs(t *tasks.Task) []attribute.KeyValue {
	return []attribute.KeyValue{tracing.TaskID.Int64(t.ID), tracing.TaskKind.String(t.Kind),
		tracing.TaskShard.Int(t.Shard), tracing.TaskQueue.String(t.Queue),
		tracing.TaskAttempt.Int(t.Attempt), tracing.TaskEpoch.Int64(t.Epoch)}
}

// claimed records one claim statement that ran from start to end: its
// batch span (with the error of a failed claim) and, for each claimed task,
// a claim span in the task's trace. It returns, per task, the span context
// its run span is a child of.
func (tr *tracer) claimed(start, end time.Time, queue string, shards int, woke wokeBy, claimed []tasks.Task, err error) []trace.SpanContext {
	if tr == nil || (err == nil && len(claimed) == 0) {
		// An empty claim is no event: idle runners would fill the
		// backend with them.
		return nil
	}
	_, batch := tr.t.Start(context.Background(), "shardrun.claim_batch", trace.WithTimestamp(start),
		trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(tr.runner, tracing.TaskQueue.String(queue), tracing.BatchSize.Int(len(claimed)),
			attribute.Int("shardrun.claim.shards", shards)))
	if !woke.notified.IsZero() {
		batch.SetAttributes(tracing.WakeNotified.Int64(woke.notified.UnixNano()), tracing.WakeWoke.Int64(woke.woke.UnixNano()))
	}
	batchLink := trace.Link{SpanContext: batch.SpanContext()}
	parents := make([]trace.SpanContext, len(claimed))
	for i := range claimed {
		t := &claimed[i]
		ctx, opts := tr.parent(t)
		opts = append(opts, trace.WithTimestamp(start), trace.WithLinks(batchLink),
			trace.WithAttributes(taskAttrs(t)...), trace.WithAttributes(tr.runner))
		_, span := tr.t.Start(ctx, "shardrun.claim", opts...)
		span.End(trace.WithTimestamp(end))
		batch.AddLink(trace.Link{SpanContext: span.SpanContext()})
		parents[i] = trace.SpanContextFromContext(ctx)
		if !parents[i].IsValid() {
			// A new trace: the run is a child of the claim.
			parents[i] = span.SpanContext()
		}
	}
	tracing.End(batch, err, trace.WithTimestamp(end))
	return parents
}

// wokeBy is the notification that started a claim round: when it reached
// the runner (the listener's callback) and when the claim loop woke for
// it. Zero for a round no notification started.
type wokeBy struct{ notified, woke time.Time }

// parent is where a task's claim span goes: in the enqueue's trace, or a
// new root linked to the enqueue when the task ran much later or came
// without a trace context.
func (tr *tracer) parent(t *tasks.Task) (context.Context, []trace.SpanStartOption) {
	enqueue := tracing.Extract(t.TraceContext)
	if !enqueue.IsValid() {
		return context.Background(), []trace.SpanStartOption{trace.WithNewRoot()}
	}
	if t.ClaimedAt != nil && t.ClaimedAt.Sub(t.CreatedAt) <= tracing.LinkAfter {
		return trace.ContextWithRemoteSpanContext(context.Background(), enqueue), nil
	}
	return context.Background(), []trace.SpanStartOption{trace.WithNewRoot(), trace.WithLinks(trace.Link{SpanContext: enqueue,
		Attributes: []attribute.KeyValue{attribute.String("shardrun.link", "enqueue")}})}
}

// run starts the run span of an attempt under parent; the handler's
// context carries it.
func (tr *tracer) run(ctx context.Context, t *tasks.Task, parent trace.SpanContext) (context.Context, trace.Span) {
	ctx = trace.ContextWithSpanContext(ctx, parent)
	return tr.t.Start(ctx, "shardrun.run", trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(taskAttrs(t)...), trace.WithAttributes(tr.runner))
}
