package executor

import (
	"cmp"
	"container/heap"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/tasks"
)

// Bounds of one outcome write and of the final flush at shutdown.
const (
	writeTimeout  = 10 * time.Second
	shutdownFlush = 5 * time.Second
)

// busyRetry paces the writes of an item the store answered claims.Busy
// (its claim row is held by a transaction still open, as a handler's
// after CompleteTx): such a transaction commits within milliseconds as a
// rule, and one left open is ended by the database's idle timeout.
var busyRetry = clock.Backoff{Min: 20 * time.Millisecond, Max: time.Second}

// retryGrain is the step busy items' retry times are rounded up to, so
// that items answered Busy at different moments are retried together: a
// database that cannot be reached has every write of its claims answered
// Busy by the router (issue 40), and thousands of its outcomes may wait.
// Retried each at its own instant, they cost the writer a round — and a
// statement — apiece; grouped, a round per grain at most.
const retryGrain = 20 * time.Millisecond

// writer is the outcome loop: it records attempts' outcomes in batches —
// everything that arrives within the flush delay of a batch's first
// outcome, up to flushSize a statement — in one statement per kind of
// write. The same batches give back the tasks claimed ahead that never
// started, and record the starts of those that did (post). Each item's
// done is called after its write, so a shard is never released before its
// outcomes and give-backs are written.
//
// No write waits for a transaction the runner does not control: the store
// skips a claim row another transaction holds and answers claims.Busy for
// it. The other items of the statement are done; the busy ones are
// written again later, each with a backoff of its own (busyRetry), in
// later batches, and their attempts stay in the heartbeat set until then.
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

	// wake is signalled by post.
	wake   wake.Signal
	mu     sync.Mutex
	posted []result
	// later are the items the store answered Busy, each written again
	// from its retryAt: a heap by retryAt, so that a round costs the
	// same whatever the number of items waiting (they may be all the
	// outcomes of a database that is down). Owned by Run.
	later retryQueue
}

// retryQueue is a min-heap of busy items by retryAt (container/heap).
type retryQueue []result

func (q retryQueue) Len() int           { return len(q) }
func (q retryQueue) Less(i, j int) bool { return q[i].retryAt.Before(q[j].retryAt) }
func (q retryQueue) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *retryQueue) Push(x any)        { *q = append(*q, x.(result)) }
func (q *retryQueue) Pop() any {
	old := *q
	r := old[len(old)-1]
	old[len(old)-1] = result{} // drop its references
	*q = old[:len(old)-1]
	return r
}

// post hands the writer items that come from elsewhere than a handler's
// return (give-backs, starts, cancels of tasks that waited ahead). It
// never blocks: the claim loop, the heartbeats and a term's end call it.
func (w *writer) post(rs ...result) {
	if len(rs) == 0 {
		return
	}
	w.mu.Lock()
	w.posted = append(w.posted, rs...)
	w.mu.Unlock()
	w.wake.Notify()
}

// take returns what was posted since the last take.
func (w *writer) take() []result {
	w.mu.Lock()
	defer w.mu.Unlock()
	rs := w.posted
	w.posted = nil
	return rs
}

// Run writes outcomes until ctx ends; then it writes what has arrived and
// returns. The executor ends ctx only after the pool's attempts finished,
// so nothing arrives later.
func (w *writer) Run(ctx context.Context) {
	// One batch's backing array for the loop's life, cleared after each
	// flush: grown anew for every batch, a result (a task's copy) a few
	// times over, it was the runner's largest allocation (bench section
	// throughput: 1.4 KB per task).
	batch := make([]result, 0, flushSize)
	var flushAt time.Time // zero: no batch
	timer := w.clock.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		due := flushAt
		if at := w.nextRetry(); !at.IsZero() && (due.IsZero() || at.Before(due)) {
			due = at
		}
		var fire <-chan time.Time
		if !due.IsZero() {
			timer.Reset(due.Sub(w.clock.Now()))
			fire = timer.C()
		}
		select {
		case r := <-w.in:
			// What was posted before this outcome was sent joins it, so
			// that a start and the outcome of the same attempt meet.
			batch = append(append(batch, r), w.take()...)
		case <-w.wake.C():
			batch = append(batch, w.take()...)
		case <-fire:
		case <-ctx.Done():
			timer.Stop()
			for more := true; more; {
				select {
				case r := <-w.in:
					batch = append(batch, r)
				default:
					more = false
				}
			}
			w.drain(ctx, append(batch, w.take()...))
			return
		}
		timer.Stop()
		now := w.clock.Now()
		if len(batch) > 0 && flushAt.IsZero() {
			flushAt = now.Add(w.delay)
		}
		if len(batch) >= flushSize || (!flushAt.IsZero() && !now.Before(flushAt)) {
			all := append(batch, w.dueLater(now)...)
			w.flush(ctx, all)
			clear(all) // the written items' tasks are not kept
			if cap(all) > cap(batch) {
				batch = all
			}
			batch, flushAt = batch[:0], time.Time{}
		} else if due := w.dueLater(now); len(due) > 0 {
			w.flush(ctx, due)
		}
	}
}

// nextRetry is the earliest retryAt of the busy items (zero: none).
func (w *writer) nextRetry() time.Time {
	if len(w.later) == 0 {
		return time.Time{}
	}
	return w.later[0].retryAt
}

// dueLater takes the busy items due at now out of later, at most
// flushSize: one statement's worth a round, so that a round's cost does
// not grow with the items waiting, and the outcomes that arrive meanwhile
// are written between the statements of a long backlog (the rest are due
// already: the next round comes at once).
func (w *writer) dueLater(now time.Time) []result {
	var due []result
	for len(w.later) > 0 && len(due) < flushSize && !w.later[0].retryAt.After(now) {
		due = append(due, heap.Pop(&w.later).(result))
	}
	return due
}

// drain writes the last batch at shutdown, and its busy items again until
// they are written or shutdownFlush has passed.
func (w *writer) drain(ctx context.Context, batch []result) {
	w.flush(ctx, batch)
	giveUpAt := w.clock.Now().Add(shutdownFlush)
	for len(w.later) > 0 {
		now := w.clock.Now()
		if !now.Before(giveUpAt) {
			w.log.Error("giving up writing at shutdown: claims still held by transactions that stay open", "items", len(w.later))
			for _, r := range w.later {
				if r.span != nil {
					r.span.End()
				}
				r.done()
			}
			w.later = nil
			return
		}
		at := w.nextRetry()
		if at.After(giveUpAt) {
			at = giveUpAt
		}
		clock.Sleep(w.clock, at.Sub(now), nil)
		w.flush(ctx, append(w.dueLater(w.clock.Now()), w.take()...))
	}
}

// flush writes batch, flushSize items a statement at most.
func (w *writer) flush(ctx context.Context, batch []result) {
	for len(batch) > flushSize {
		w.flushSome(ctx, batch[:flushSize])
		batch = batch[flushSize:]
	}
	w.flushSome(ctx, batch)
}

// flushSome writes one batch — give-backs, completions, failures,
// interruptions and cancellations, one statement each — then ends each
// item, except those the store answered Busy: they go to later.
func (w *writer) flushSome(ctx context.Context, batch []result) {
	if len(batch) == 0 {
		return
	}
	var backs []claims.Ref
	var completions []claims.Completion
	var failures []claims.Failure
	var interruptions []claims.Interruption
	var bItems, cItems, fItems, iItems, cancelled []*result
	for i := range batch {
		r := &batch[i]
		r.retryAt = time.Time{}
		switch {
		case r.giveBack:
			backs = append(backs, claims.RefOf(r.task))
			bItems = append(bItems, r)
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
	writeEach(ctx, w, "giving back claims", bItems, backs, w.store.Unclaim)
	writeEach(ctx, w, "completing", cItems, completions, w.store.Complete)
	writeEach(ctx, w, "failing", fItems, failures, w.store.Fail)
	writeEach(ctx, w, "interrupting", iItems, interruptions, w.store.Interrupt)
	w.writeCancelled(ctx, cancelled)
	if batchSpan != nil {
		tracing.End(batchSpan, w.batchErr)
		w.batchErr = nil
	}
	for i := range batch {
		r := &batch[i]
		if !r.retryAt.IsZero() {
			heap.Push(&w.later, *r)
			continue
		}
		if r.span != nil {
			r.span.End()
		}
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
		if r.span == nil {
			continue // not a handler's outcome
		}
		r.span.AddLink(link)
		span.AddLink(trace.Link{SpanContext: r.span.SpanContext()})
	}
	return span
}

// writeEach writes one kind of item for items (ins[i] is items[i]'s) and
// accounts for the results. A batch the database refuses for a reason
// other than its unavailability (a value it will not store) is split and
// written one by one, so that one bad outcome cannot hold back the others
// forever; the one it still refuses is logged, counted and left running:
// its claim goes stale once done stops its heartbeats, and the sweeper
// requeues it with its next attempt.
func writeEach[T any](ctx context.Context, w *writer, what string, items []*result, ins []T,
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
		w.log.Error("the database refused a write about a claim; the stale sweep takes the claim back (an attempt whose handler never started keeps its attempt)",
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

// retryTime is at rounded up to retryGrain: see there.
func retryTime(at time.Time) time.Time {
	if t := at.Truncate(retryGrain); t.Before(at) {
		return t.Add(retryGrain)
	}
	return at
}

// account counts what each write did and reports refused ones. An item
// the store answered Busy gets its retryAt: it is written again then.
func (w *writer) account(items []*result, res []claims.WriteResult) {
	now := w.clock.Now()
	for i, r := range res {
		if i >= len(items) {
			break
		}
		it := items[i]
		if r.Outcome == claims.Busy {
			if it.busy.Min == 0 {
				it.busy = busyRetry
			}
			it.retryAt = retryTime(now.Add(it.busy.Next()))
			w.log.Debug("claim held by another transaction; writing it again later", "task", it.task.ID, "attempt", it.task.Attempt,
				"retry_in", it.retryAt.Sub(now))
			continue
		}
		switch {
		case it.giveBack:
			w.log.Trace("claim written", "task", it.task.ID, "give_back", it.giveBack, "outcome", r.Outcome.String())
			if r.Outcome == claims.FenceLost {
				w.m.FenceRejections.Inc()
				w.own.FenceLost(it.task.Shard, it.task.Epoch)
			}
			continue
		}
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
func (w *writer) writeCancelled(ctx context.Context, items []*result) {
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
