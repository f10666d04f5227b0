package executor

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/tasks"
)

func tracedEnv(t *testing.T, handlers map[string]tasks.Handler, mut ...func(*Config)) (*env, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return newEnv(t, handlers, append(mut, func(c *Config) { c.TracerProvider = tp })...), rec
}

func spanAttr(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// outcomeSpans are the ended outcome spans by task id.
func outcomeSpans(rec *tracetest.SpanRecorder) map[int64]sdktrace.ReadOnlySpan {
	out := map[int64]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.Name() == "shardrun.outcome" {
			out[spanAttr(s, "shardrun.task.id").AsInt64()] = s
		}
	}
	return out
}

// A claim statement that failed is a claim batch span with an error
// status; an outcome the database refused is an outcome span with the
// outcome "refused" and an error status, and so is its batch; the others
// of the batch are completed.
func TestTraceOfFailedClaimsAndRefusedOutcomes(t *testing.T) {
	t.Parallel()
	e, rec := tracedEnv(t, map[string]tasks.Handler{"noop": noop})
	for id := int64(1); id <= 3; id++ {
		e.store.add(id, "noop", 0, 3)
	}
	e.store.refuse = map[int64]bool{2: true}
	e.store.failNext("claim", 1)
	e.own.own(0, 5)
	e.run()
	e.until("three outcome spans", func() bool { return len(outcomeSpans(rec)) == 3 })
	e.shutdown()
	spans := outcomeSpans(rec)
	for id, s := range spans {
		outcome, failed := spanAttr(s, "shardrun.task.outcome").AsString(), s.Status().Code == codes.Error
		if id == 2 && (outcome != "refused" || !failed) || id != 2 && (outcome != "completed" || failed) {
			t.Errorf("task %d: outcome %q, error status %v", id, outcome, failed)
		}
		if spanAttr(s, "shardrun.task.epoch").AsInt64() != 5 || spanAttr(s, "shardrun.runner.id").AsString() != me {
			t.Errorf("task %d: attributes %v", id, s.Attributes())
		}
	}
	var failedClaims, claims, refusedBatches int
	for _, s := range rec.Ended() {
		switch {
		case s.Name() == "shardrun.claim_batch" && s.Status().Code == codes.Error:
			failedClaims++
		case s.Name() == "shardrun.claim_batch":
			claims++
		case s.Name() == "shardrun.write_outcomes" && s.Status().Code == codes.Error:
			refusedBatches++
		}
	}
	if failedClaims != 1 || claims == 0 || refusedBatches == 0 {
		t.Errorf("claim batches %d (failed %d), refused outcome batches %d", claims, failedClaims, refusedBatches)
	}
}

// A completion the fence refused (a newer owner took the shard) is an
// outcome span with the outcome "fence_lost" and an error status.
func TestTraceOfAFenceLostOutcome(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	e, rec := tracedEnv(t, map[string]tasks.Handler{"slow": func(context.Context, *tasks.Task) error { <-release; return nil }})
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 4)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.store.setFence(0, 7, "runner-b")
	close(release)
	e.until("the outcome span", func() bool { return len(outcomeSpans(rec)) == 1 })
	s := outcomeSpans(rec)[1]
	if spanAttr(s, "shardrun.task.outcome").AsString() != "fence_lost" || s.Status().Code != codes.Error {
		t.Fatalf("outcome %q, status %v", spanAttr(s, "shardrun.task.outcome").AsString(), s.Status())
	}
}

// Tracing off: no tracer at all, so nothing of the hot path traces.
func TestTracingOffHasNoTracer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	if e.exec.claimer.tr != nil || e.exec.pool.tr != nil || e.exec.writer.tr != nil {
		t.Fatal("a tracer exists with tracing off")
	}
	if got := (*tracer)(nil).claimed(e.clock.Now(), e.clock.Now(), "default", 1, wokeBy{}, []tasks.Task{{ID: 1}}, nil); got != nil {
		t.Fatalf("a nil tracer gave parents %v", got)
	}
}

// A claim round an enqueue notification started carries the wake-up's
// hops on its batch span: when the notification reached the runner and
// when the claim loop woke for it, both before the claim statement. A
// task added while the previous round still runs is claimed by that
// round, with no wake-up of its own: the test tries again then.
func TestTraceOfAWakeUp(t *testing.T) {
	t.Parallel()
	e, rec := tracedEnv(t, map[string]tasks.Handler{"noop": noop})
	e.own.own(3, 1)
	e.run()
	e.until("the first claim", func() bool { return e.store.count("claim") > 0 })
	for id := int64(1); id <= 20; id++ {
		e.store.add(id, "noop", 3, 1)
		before := time.Now()
		e.exec.Wake(false, []int{3}, nil)
		e.until("the task's claim batch span", func() bool { return batchOf(rec, id) != nil })
		s := batchOf(rec, id)
		if spanAttr(s, "shardrun.wake.notified_unix_nano").Type() == attribute.EMPTY {
			continue
		}
		notified := time.Unix(0, spanAttr(s, "shardrun.wake.notified_unix_nano").AsInt64())
		woke := time.Unix(0, spanAttr(s, "shardrun.wake.woke_unix_nano").AsInt64())
		if notified.Before(before) || woke.Before(notified) || s.StartTime().Before(woke) {
			t.Fatalf("notification sent %v, reached the runner %v, loop woke %v, claim statement sent %v", before, notified, woke, s.StartTime())
		}
		return
	}
	t.Fatal("no claim batch of 20 carried the hops of the wake-up that started its round")
}

// batchOf is the claim batch span that claimed task id, or nil.
func batchOf(rec *tracetest.SpanRecorder, id int64) sdktrace.ReadOnlySpan {
	var batch trace.SpanID
	for _, s := range rec.Ended() {
		if s.Name() == "shardrun.claim" && spanAttr(s, "shardrun.task.id").AsInt64() == id && len(s.Links()) > 0 {
			batch = s.Links()[0].SpanContext.SpanID()
		}
	}
	for _, s := range rec.Ended() {
		if s.Name() == "shardrun.claim_batch" && s.SpanContext().SpanID() == batch {
			return s
		}
	}
	return nil
}
