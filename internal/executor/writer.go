package executor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/tasks"
)

// Bounds of one outcome write and of the final flush at shutdown.
const (
	writeTimeout  = 10 * time.Second
	shutdownFlush = 5 * time.Second
)

// writer is the outcome loop: it records attempts' outcomes in batches —
// everything that arrives within the flush delay of a batch's first
// outcome, up to flushSize — in one statement per kind of write. Each
// attempt's done is called after its write, so a shard is never released
// before its outcomes are written.
type writer struct {
	store Store
	owner string
	own   Ownership
	retry tasks.RetryPolicy
	in    <-chan result
	delay time.Duration
	clock clock.Clock
	log   hclog.Logger
	m     *Metrics
	tr    *tracer // nil: tracing off
	// batchErr is the first write error of the batch being flushed, for
	// its span.
	batchErr error
}

// Run writes outcomes until ctx ends; then it writes what has arrived and
// returns. The executor ends ctx only after the pool's attempts finished,
// so nothing arrives later.
func (w *writer) Run(ctx context.Context) {
	var batch []result
	timer := w.clock.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		var fire <-chan time.Time
		if len(batch) > 0 {
			fire = timer.C()
		}
		select {
		case r := <-w.in:
			if len(batch) == 0 {
				timer.Reset(w.delay)
			}
			batch = append(batch, r)
			if len(batch) < flushSize {
				continue
			}
			timer.Stop()
		case <-fire:
		case <-ctx.Done():
			for more := true; more; {
				select {
				case r := <-w.in:
					batch = append(batch, r)
				default:
					more = false
				}
			}
			w.flush(ctx, batch)
			return
		}
		w.flush(ctx, batch)
		batch = batch[:0]
	}
}

// flush writes one batch — completions, failures, interruptions and
// cancellations, one statement each — then ends each attempt.
func (w *writer) flush(ctx context.Context, batch []result) {
	if len(batch) == 0 {
		return
	}
	var completions []claims.Completion
	var failures []claims.Failure
	var interruptions []claims.Interruption
	var cItems, fItems, iItems, cancelled []result
	for _, r := range batch {
		switch {
		case r.cancelled:
			cancelled = append(cancelled, r)
		case r.err == nil:
			completions = append(completions, claims.Completion{Ref: claims.RefOf(r.task), Result: r.task.Result})
			cItems = append(cItems, r)
		case r.interrupted != nil:
			interruptions = append(interruptions, claims.Interruption{Ref: claims.RefOf(r.task), Reason: "interrupted: " + r.interrupted.Error()})
			iItems = append(iItems, r)
		default:
			failures = append(failures, claims.Failure{Ref: claims.RefOf(r.task), Error: r.err.Error(), Backoff: claims.Backoff{Base: w.retry.Base, Cap: w.retry.Cap},
				Final: errors.Is(r.err, tasks.ErrPermanent), Expired: r.expired})
			fItems = append(fItems, r)
		}
	}
	var batchSpan trace.Span
	if w.tr != nil {
		batchSpan = w.startBatch(batch)
	}
	writeEach(ctx, w, "completing", cItems, completions, w.store.Complete)
	writeEach(ctx, w, "failing", fItems, failures, w.store.Fail)
	writeEach(ctx, w, "interrupting", iItems, interruptions, w.store.Interrupt)
	w.writeCancelled(ctx, cancelled)
	if batchSpan != nil {
		for _, r := range batch {
			r.span.End()
		}
		tracing.End(batchSpan, w.batchErr)
		w.batchErr = nil
	}
	for _, r := range batch {
		r.done()
	}
}

// startBatch starts the span of one outcome write, linked to each
// attempt's outcome span and they to it.
func (w *writer) startBatch(batch []result) trace.Span {
	_, span := w.tr.t.Start(context.Background(), "shardrun.write_outcomes",
		trace.WithAttributes(w.tr.runner, tracing.BatchSize.Int(len(batch))))
	link := trace.Link{SpanContext: span.SpanContext()}
	for _, r := range batch {
		r.span.AddLink(link)
		span.AddLink(trace.Link{SpanContext: r.span.SpanContext()})
	}
	return span
}

// writeEach writes one kind of outcome for items (ins[i] is items[i]'s)
// and accounts for the results. A batch the database refuses for a reason
// other than its unavailability (a value it will not store) is split and
// written one by one, so that one bad outcome cannot hold back the others
// forever; the one it still refuses is logged, counted and left running:
// its claim goes stale once done stops its heartbeats, and the sweeper
// requeues it with its next attempt.
func writeEach[T any](ctx context.Context, w *writer, what string, items []result, ins []T,
	write func(context.Context, string, []T) ([]claims.WriteResult, error)) {
	if len(ins) == 0 {
		return
	}
	res, err := w.write(ctx, what, func(c context.Context) ([]claims.WriteResult, error) { return write(c, w.owner, ins) })
	switch {
	case err == nil:
		w.account(items, res)
	case len(ins) == 1:
		if items[0].span != nil {
			items[0].span.SetAttributes(tracing.TaskOutcome.String("refused"))
			tracing.Fail(items[0].span, err)
			w.batchErr = cmp.Or(w.batchErr, err)
		}
		w.m.WriteRefused.Inc()
		w.log.Error("the database refused a task outcome; the task is retried once its claim goes stale",
			"what", what, "task", items[0].task.ID, "attempt", items[0].task.Attempt, "error", err)
	default:
		for i := range ins {
			writeEach(ctx, w, what, items[i:i+1], ins[i:i+1], write)
		}
	}
}

// write retries a batch write while the database is unavailable: the
// outcomes stay valid as long as the fence does, since the write is fenced.
// Any other error is returned at once (Store.Unavailable): retrying a value
// the database refuses would stop every later outcome. Statements run
// under WithoutCancel(ctx): an outcome being written when shutdown begins
// must land. Once ctx has ended, retries stop shutdownFlush later, with
// nil results and no error.
func (w *writer) write(ctx context.Context, what string, write func(context.Context) ([]claims.WriteResult, error)) ([]claims.WriteResult, error) {
	backoff := dbRetry
	var giveUpAt time.Time
	for {
		timeout := writeTimeout
		if !giveUpAt.IsZero() {
			timeout = min(timeout, max(giveUpAt.Sub(w.clock.Now()), 0))
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		res, err := write(cctx)
		cancel()
		if err == nil {
			return res, nil
		}
		if !w.store.Unavailable(err) {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		now := w.clock.Now()
		if ctx.Err() != nil && giveUpAt.IsZero() {
			giveUpAt = now.Add(shutdownFlush)
		}
		if !giveUpAt.IsZero() && !now.Before(giveUpAt) {
			w.log.Error("giving up writing task outcomes at shutdown", "what", what, "error", err)
			return nil, nil
		}
		wait := backoff.Next()
		if !giveUpAt.IsZero() {
			wait = min(wait, giveUpAt.Sub(now))
		}
		w.log.Warn("writing task outcomes failed; retrying", "what", what, "error", err, "backoff", wait)
		clock.Sleep(w.clock, wait, nil)
	}
}

// account counts what each write did and reports refused ones.
func (w *writer) account(items []result, res []claims.WriteResult) {
	for i, r := range res {
		it := items[i]
		switch r.Outcome {
		case claims.Applied, claims.Completed: // Completed: by the handler's own transaction
			outcome := string(r.State)
			switch {
			case it.interrupted != nil:
				outcome = "interrupted"
			case r.State == tasks.Ready:
				outcome = "retried"
			}
			w.m.Finished.WithLabelValues(it.task.Kind, outcome).Inc()
			w.m.Duration.Observe(it.elapsed.Seconds())
			if it.span != nil {
				it.span.SetAttributes(tracing.TaskOutcome.String(outcome))
			}
		case claims.FenceLost:
			if it.span != nil {
				it.span.SetAttributes(tracing.TaskOutcome.String("fence_lost"))
				it.span.SetStatus(codes.Error, "outcome refused: the shard's fence moved on")
			}
			w.m.FenceRejections.Inc()
			w.log.Warn("outcome refused: shard fence moved on", "task", it.task.ID, "shard", it.task.Shard, "epoch", it.task.Epoch)
			w.own.FenceLost(it.task.Shard, it.task.Epoch)
		default:
			if it.span != nil {
				it.span.SetAttributes(tracing.TaskOutcome.String(r.Outcome.String()))
			}
			w.log.Info("outcome dropped: the task moved on", "task", it.task.ID, "outcome", r.Outcome.String())
		}
	}
}

// writeCancelled records attempts cancelled on request whose handlers
// returned an error (it goes into the task's history; a handler that
// returned nil is completed). If the task's completion or failure landed
// first, the write finds it no longer running and changes nothing: one
// outcome per attempt.
func (w *writer) writeCancelled(ctx context.Context, items []result) {
	if len(items) == 0 {
		return
	}
	cs := make([]claims.Cancellation, len(items))
	for i, r := range items {
		cs[i].Ref = claims.RefOf(r.task)
		if r.err != nil {
			cs[i].Error = r.err.Error()
		}
	}
	writeEach(ctx, w, "recording cancelled", items, cs, w.store.CancelAttempts)
}
