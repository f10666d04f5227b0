package executor

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/tasks"
)

// errTakenBack cancels an attempt whose heartbeat found the task no longer
// its own: a sweep requeued it, or it was finished elsewhere.
var errTakenBack = errors.New("task taken back: its claim is no longer this attempt's")

// result is one attempt's outcome on its way to the database.
type result struct {
	task tasks.Task
	err  error // nil: completed
	// interrupted is set when the attempt's context was ended by the loss
	// of its shard before the handler returned an error: the attempt is
	// given back without spending it.
	interrupted error
	elapsed     time.Duration
	// done ends the attempt once its outcome is written: it leaves the
	// pool's heartbeat set and its hold on the term ends.
	done func()
	// cancelled: an operator cancelled the task, the heartbeat cancelled
	// the handler's context (cause tasks.ErrCancelled), and the handler
	// returned an error; the attempt is recorded as cancelled. A handler
	// that returned nil has done its work: it is a completion.
	cancelled bool
	// expired: the handler failed after the task's deadline passed; the
	// task ends failed, as the sweeper's deadline rule would end it.
	expired bool
	// span is the attempt's outcome span, ended once the outcome is
	// written; nil with tracing off.
	span trace.Span
}

// attempt is one claimed task from the start of its handler until its
// outcome is written.
type attempt struct {
	task   tasks.Task
	ctx    context.Context
	cancel context.CancelCauseFunc
	// finished: the handler returned; the outcome awaits its write. The
	// attempt is still heartbeated, so a database outage that delays the
	// write does not make the claim look stale.
	finished bool
	// cancelledAt is when the attempt's context ended while the handler
	// ran; stuck marks a handler still running StuckAfter later.
	cancelledAt time.Time
	stuck       bool
}

// Stuck is a handler that ignored its cancellation for longer than the
// executor's StuckAfter: while it runs, its slot is taken and, if the
// runner drains, its shard waits.
type Stuck struct {
	TaskID      int64     `json:"task_id"`
	Kind        string    `json:"kind"`
	Shard       int       `json:"shard"`
	Epoch       int64     `json:"epoch"`
	CancelledAt time.Time `json:"cancelled_at"`
}

// pool runs each attempt on its own goroutine, at most max at once, and
// knows every attempt from its start until its outcome is written, so that
// heartbeats can name them and cancel those taken back.
type pool struct {
	registry   *Registry
	max        int
	results    chan<- result
	stuckAfter time.Duration
	clock      clock.Clock
	m          *Metrics
	tr         *tracer // nil: tracing off
	// freed is signalled when a handler returns, so the claimer can refill.
	freed wake.Signal

	wg       sync.WaitGroup
	inflight atomic.Int64 // handlers running
	mu       sync.Mutex
	// byQueue counts the handlers running per queue.
	byQueue map[string]int
	// attempts is keyed by the whole claim: a sweep may requeue a task
	// whose handler still runs here, and this runner may claim it again.
	attempts map[claims.Ref]*attempt
}

func newPool(registry *Registry, max int, results chan<- result, stuckAfter time.Duration, clk clock.Clock, m *Metrics, tr *tracer) *pool {
	return &pool{registry: registry, max: max, results: results, stuckAfter: stuckAfter, clock: clk, m: m, tr: tr,
		freed: wake.New(), attempts: map[claims.Ref]*attempt{}, byQueue: map[string]int{}}
}

func (p *pool) inFlight() int { return int(p.inflight.Load()) }

// free is how many more attempts of queue may start now: within the
// queue's limit and the pool's.
func (p *pool) free(queue string, limit int) int {
	p.mu.Lock()
	running := p.byQueue[queue]
	p.mu.Unlock()
	return min(limit-running, p.max-p.inFlight())
}

// idle is how many more attempts of any queue may start now.
func (p *pool) idle() int { return p.max - p.inFlight() }

// start runs one claimed task under its term's context; termDone ends the
// attempt's hold on the term. With tracing on, the handler runs in a span
// that is a child of parent (see tracer.claimed).
func (p *pool) start(termCtx context.Context, t tasks.Task, termDone func(), parent trace.SpanContext) {
	h, _ := p.registry.Lookup(t.Kind)
	ctx, cancel := context.WithCancelCause(termCtx)
	handlerCtx, stopDeadline := ctx, context.CancelFunc(func() {})
	if t.Deadline != nil {
		handlerCtx, stopDeadline = context.WithDeadline(ctx, *t.Deadline)
	}
	ref := claims.RefOf(t)
	a := &attempt{task: t, ctx: ctx, cancel: cancel}
	p.mu.Lock()
	p.attempts[ref] = a
	p.byQueue[t.Queue]++
	p.mu.Unlock()
	stopWatch := context.AfterFunc(ctx, func() {
		p.mu.Lock()
		if !a.finished {
			a.cancelledAt = p.clock.Now()
		}
		p.mu.Unlock()
	})
	p.inflight.Add(1)
	p.m.InFlight.Inc()
	p.wg.Go(func() {
		start := p.clock.Now()
		task := t
		runCtx, span := handlerCtx, trace.Span(nil)
		if p.tr != nil {
			runCtx, span = p.tr.run(handlerCtx, &task, parent)
		}
		err := call(runCtx, h, &task)
		if err == nil && errors.Is(handlerCtx.Err(), context.DeadlineExceeded) {
			// The success came after the task's deadline: the deadline wins.
			err = fmt.Errorf("deadline exceeded: the handler returned after the task's deadline %s", t.Deadline.UTC().Format(time.RFC3339Nano))
		}
		r := result{task: task, err: err, elapsed: p.clock.Now().Sub(start),
			expired: err != nil && errors.Is(handlerCtx.Err(), context.DeadlineExceeded)}
		if cause := context.Cause(ctx); err != nil && errors.Is(cause, tasks.ErrOwnershipLost) {
			r.interrupted = cause
		}
		r.cancelled = err != nil && tasks.CancelRequested(ctx)
		if span != nil {
			tracing.End(span, err)
			_, r.span = p.tr.t.Start(runCtx, "shardrun.outcome", trace.WithAttributes(taskAttrs(&task)...),
				trace.WithAttributes(p.tr.runner))
		}
		stopWatch()
		stopDeadline()
		cancel(nil)
		p.mu.Lock()
		a.finished = true
		p.byQueue[t.Queue]--
		if a.stuck {
			p.m.Stuck.Dec()
		}
		p.mu.Unlock()
		r.done = func() {
			p.mu.Lock()
			delete(p.attempts, ref)
			p.mu.Unlock()
			termDone()
		}
		p.results <- r
		p.inflight.Add(-1)
		p.m.InFlight.Dec()
		p.freed.Notify()
	})
}

// refs names every attempt whose outcome is not written yet: running
// handlers and outcomes waiting for their write.
func (p *pool) refs() []claims.Ref {
	p.mu.Lock()
	defer p.mu.Unlock()
	refs := make([]claims.Ref, 0, len(p.attempts))
	for ref := range p.attempts {
		refs = append(refs, ref)
	}
	return refs
}

// cancel cancels the handler of attempt ref, if it is still running; it
// reports whether this call ended the handler's context (false when the
// handler returned or its context ended before).
func (p *pool) cancel(ref claims.Ref, cause error) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.attempts[ref]
	if a == nil || a.finished || a.ctx.Err() != nil {
		return false
	}
	a.cancel(cause)
	return true
}

// findStuck marks the handlers still running stuckAfter after their
// context ended, and returns the newly stuck ones.
func (p *pool) findStuck(now time.Time) []Stuck {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Stuck
	for _, a := range p.attempts {
		if a.finished || a.stuck || a.cancelledAt.IsZero() || now.Sub(a.cancelledAt) < p.stuckAfter {
			continue
		}
		a.stuck = true
		p.m.Stuck.Inc()
		p.m.StuckTotal.Inc()
		out = append(out, a.stuckView())
	}
	return out
}

// stuck lists the handlers marked stuck that still run.
func (p *pool) stuck() []Stuck {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Stuck
	for _, a := range p.attempts {
		if a.stuck && !a.finished {
			out = append(out, a.stuckView())
		}
	}
	slices.SortFunc(out, func(a, b Stuck) int { return a.CancelledAt.Compare(b.CancelledAt) })
	return out
}

func (a *attempt) stuckView() Stuck {
	return Stuck{TaskID: a.task.ID, Kind: a.task.Kind, Shard: a.task.Shard, Epoch: a.task.Epoch, CancelledAt: a.cancelledAt}
}

// wait waits up to timeout for every handler to return; it reports whether
// they did.
func (p *pool) wait(timeout time.Duration) bool {
	finished := make(chan struct{})
	go func() { p.wg.Wait(); close(finished) }()
	t := p.clock.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-finished:
		return true
	case <-t.C():
		return false
	}
}

// call runs the handler, turning a panic into an error that carries the
// panic text and stack: the attempt fails, the runner keeps going.
func call(ctx context.Context, h tasks.Handler, t *tasks.Task) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v\n%s", r, debug.Stack())
		}
	}()
	if err = h(ctx, t); err == nil && t.Result != nil {
		// A result set directly (not through SetResult) that jsonb refuses
		// would make the completion's write fail, and be retried, forever.
		if cerr := jsonbody.Check(t.Result); cerr != nil {
			t.Result = nil
			err = fmt.Errorf("the handler's result cannot be stored: %w", cerr)
		}
	}
	return err
}
