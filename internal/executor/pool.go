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

	// giveBack: not an outcome but a task claimed ahead whose handler
	// never started, to give back to its lane with its attempt unspent
	// (Store.Unclaim); done ends its hold on its term once written.
	giveBack bool
	// busy paces the writes of this item that the store answered
	// claims.Busy, and retryAt is when it is written again.
	busy    clock.Backoff
	retryAt time.Time
}

// attempt is one claimed task from the start of its handler until its
// outcome is written.
type attempt struct {
	task   tasks.Task
	ctx    context.Context
	cancel context.CancelCauseFunc
	// started is when the handler started (the executor's clock).
	started time.Time
	// unrecorded: the task waited ahead and its claim does not record its
	// start yet (the heartbeater does, with its next beat).
	unrecorded bool
	// finished: the handler returned (at finishedAt); the outcome awaits
	// its write. The attempt is still heartbeated once its write has
	// waited a heartbeat interval, so a database outage that delays the
	// write does not make the claim look stale (beatable).
	finished   bool
	finishedAt time.Time
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
// knows every attempt from the start of its handler until its outcome is
// written, so that heartbeats can name them and cancel those taken back.
//
// A slot is taken from the moment a claim reserves it (reserve, for the
// tasks a claim statement records as started now) or the claim-ahead
// buffer takes it for a task (take), until the handler returns; so a task
// the store was told starts now always has its slot, and the buffer cannot
// start a task on a slot a claim in flight counts on. The tasks claimed
// ahead of need wait in the buffer (ahead.go), not here.
type pool struct {
	registry   *Registry
	max        int
	limits     map[string]int // per queue
	results    chan<- result
	stuckAfter time.Duration
	clock      clock.Clock
	m          *Metrics
	tr         *tracer // nil: tracing off
	// freed is signalled when a handler returns, so the claimer can refill.
	freed wake.Signal
	// returned is called, outside the lock, when a handler of queue
	// returned: the buffer starts the next task on its slot.
	returned func(queue string)

	wg       sync.WaitGroup
	inflight atomic.Int64 // handlers running
	mu       sync.Mutex
	// taken counts the slots taken (handlers running and slots reserved
	// for a claim in flight), byQueue the same per queue.
	taken   int
	byQueue map[string]int
	// running counts the handlers running per task: a sweep may requeue a
	// task whose handler still runs here (its heartbeats could not be
	// written), and this runner may claim it again; the new attempt waits
	// until the old handler returned. handlers counts them per queue.
	running  map[int64]int
	handlers map[string]int
	// attempts is keyed by the whole claim, for the same reason.
	attempts map[claims.Ref]*attempt
	// live are the attempts whose handler runs (not finished): the
	// passes over handlers (soon, at nearly every claim round; the stuck
	// checks) go over these only, not over the outcomes waiting for their
	// write, which may be every outcome of a database that is down
	// (issue 40) and must not make those passes dearer.
	live map[claims.Ref]*attempt
	// took is each queue's mean handler time (a moving average): with
	// each handler's start, it says which workers free up soon (soon).
	took map[string]time.Duration
}

func newPool(registry *Registry, max int, limits map[string]int, results chan<- result, stuckAfter time.Duration, clk clock.Clock, m *Metrics, tr *tracer) *pool {
	return &pool{registry: registry, max: max, limits: limits, results: results, stuckAfter: stuckAfter, clock: clk, m: m, tr: tr,
		freed: wake.New(), returned: func(string) {}, attempts: map[claims.Ref]*attempt{}, live: map[claims.Ref]*attempt{}, byQueue: map[string]int{},
		running: map[int64]int{}, handlers: map[string]int{}, took: map[string]time.Duration{}}
}

func (p *pool) inFlight() int { return int(p.inflight.Load()) }

// idle is how many more attempts of any queue may start now.
func (p *pool) idle() int { return p.max - p.inFlight() }

// free is how many tasks of queue may start now (its slots not taken,
// within its limit and the pool's), and below how many of its slots are
// not taken within its own limit: those of below beyond free wait only for
// slots of other queues to free up.
func (p *pool) free(queue string) (free, below int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	below = max(0, p.limits[queue]-p.byQueue[queue])
	return max(0, min(below, p.max-p.taken)), below
}

// reserve takes up to n free slots of queue for a claim in flight and
// returns how many it took; the claim starts its first tasks on them
// (startOn) and gives back the rest (unreserve).
func (p *pool) reserve(queue string, n int) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n = max(0, min(n, p.limits[queue]-p.byQueue[queue], p.max-p.taken))
	p.taken += n
	p.byQueue[queue] += n
	return n
}

// unreserve gives back n slots of queue that no task started on.
func (p *pool) unreserve(queue string, n int) {
	if n <= 0 {
		return
	}
	p.mu.Lock()
	p.taken -= n
	p.byQueue[queue] -= n
	p.mu.Unlock()
	p.freed.Notify()
}

// take takes a free slot of queue for task id, unless none is free or a
// handler of the same task still runs here; full says that no slot of
// any queue is free.
func (p *pool) take(queue string, id int64) (ok, full bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.taken >= p.max {
		return false, true
	}
	if p.byQueue[queue] >= p.limits[queue] || p.running[id] > 0 {
		return false, false
	}
	p.taken++
	p.byQueue[queue]++
	p.running[id]++
	return true, false
}

// untake gives back a slot take took, with its mark of the task's
// handler.
func (p *pool) untake(queue string, id int64) {
	p.mu.Lock()
	p.taken--
	p.byQueue[queue]--
	if p.running[id]--; p.running[id] == 0 {
		delete(p.running, id)
	}
	p.mu.Unlock()
	p.freed.Notify()
}

// alone marks a handler of task id as about to run on a slot already
// reserved, unless a handler of the same task still runs here (false).
func (p *pool) alone(id int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running[id] > 0 {
		return false
	}
	p.running[id]++
	return true
}

// budget is one claim round's measure of the workers that free up soon:
// how many tasks may wait ahead of need (ahead.go).
type budget struct {
	// soon counts, per queue, the running handlers expected to return
	// within aheadCover; total is their sum.
	soon  map[string]int
	total int
}

// soon counts the running handlers expected to return within cover of
// now: those that have run for at least their queue's mean handler time
// less cover (one that overran its mean is expected any moment; if it
// keeps running, the task waiting for its slot outstays aheadPatience and
// its queue claims nothing ahead until a handler of it returns). A handler
// of a queue none of whose handlers has returned yet has no estimate: one
// such handler in all counts, so that a queue's first tasks are not held
// back from other runners by the worker count.
//
// Every handler of a queue whose mean is within cover counts, so only the
// handlers of longer queues are looked at one by one: a claim round runs
// at nearly every handler's return when handlers are short, and must not
// cost a pass over every running attempt.
func (p *pool) soon(now time.Time, cover time.Duration) budget {
	p.mu.Lock()
	defer p.mu.Unlock()
	b := budget{soon: map[string]int{}}
	unknown, long := false, false
	for q, n := range p.handlers {
		switch took := p.took[q]; {
		case took == 0 && !unknown:
			unknown = true
			b.soon[q]++
			b.total++
		case took == 0:
		case took <= cover:
			b.soon[q] += n
			b.total += n
		default:
			long = true
		}
	}
	if !long {
		return b
	}
	for _, a := range p.live {
		if took := p.took[a.task.Queue]; !a.finished && took > cover && now.Sub(a.started) >= took-cover {
			b.soon[a.task.Queue]++
			b.total++
		}
	}
	return b
}

// start runs one claimed task on a slot taken for it (reserve and alone,
// or take) under its term's context; termDone ends the attempt's hold on
// the term. With tracing on, the handler runs in a span that is a child of
// parent (see tracer.claimed).
func (p *pool) start(termCtx context.Context, t tasks.Task, termDone func(), parent trace.SpanContext) {
	p.startAttempt(termCtx, t, termDone, parent, false)
}

// startAttempt is start; unrecorded says the task's claim does not record
// it as started yet (it waited ahead): the heartbeater records the start
// with its next beat (Store.Started).
func (p *pool) startAttempt(termCtx context.Context, t tasks.Task, termDone func(), parent trace.SpanContext, unrecorded bool) {
	h, _ := p.registry.Lookup(t.Kind)
	ctx, cancel := context.WithCancelCause(termCtx)
	handlerCtx, stopDeadline := ctx, context.CancelFunc(func() {})
	if t.Deadline != nil {
		handlerCtx, stopDeadline = context.WithDeadline(ctx, *t.Deadline)
	}
	ref := claims.RefOf(t)
	a := &attempt{task: t, ctx: ctx, cancel: cancel, started: p.clock.Now(), unrecorded: unrecorded}
	p.mu.Lock()
	p.attempts[ref] = a
	p.live[ref] = a
	p.handlers[t.Queue]++
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
	// The goroutine reads a.task (written once, above), not t, so that t
	// does not escape: one copy of the task fewer per attempt.
	p.wg.Go(func() {
		start := p.clock.Now()
		task := a.task
		runCtx, span := handlerCtx, trace.Span(nil)
		if p.tr != nil {
			runCtx, span = p.tr.run(handlerCtx, &task, parent)
		}
		err := call(runCtx, h, &task)
		if err == nil && errors.Is(handlerCtx.Err(), context.DeadlineExceeded) {
			// The success came after the task's deadline: the deadline wins.
			err = fmt.Errorf("deadline exceeded: the handler returned after the task's deadline %s", a.task.Deadline.UTC().Format(time.RFC3339Nano))
		}
		r := result{task: task, err: err, elapsed: p.clock.Now().Sub(start),
			expired: err != nil && errors.Is(handlerCtx.Err(), context.DeadlineExceeded)}
		if cause := context.Cause(ctx); err != nil && errors.Is(cause, tasks.ErrOwnershipLost) {
			r.interrupted = cause
		} else if err != nil && (errors.Is(err, tasks.ErrShardMoved) || errors.Is(err, tasks.ErrOwnershipLost)) {
			// The handler's own write found the shard gone from under it
			// (CompleteTx: moved to another database, or to another
			// owner): an interruption, whose attempt is not spent.
			r.interrupted = err
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
		a.finished, a.finishedAt = true, p.clock.Now()
		delete(p.live, ref)
		p.taken--
		p.byQueue[a.task.Queue]--
		if p.running[a.task.ID]--; p.running[a.task.ID] == 0 {
			delete(p.running, a.task.ID)
		}
		if p.handlers[a.task.Queue]--; p.handlers[a.task.Queue] == 0 {
			delete(p.handlers, a.task.Queue)
		}
		if m := p.took[a.task.Queue]; m == 0 {
			p.took[a.task.Queue] = max(r.elapsed, time.Microsecond)
		} else {
			p.took[a.task.Queue] = max(m+(r.elapsed-m)/16, time.Microsecond)
		}
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
		p.returned(a.task.Queue)
		p.freed.Notify()
	})
}

// refs names every attempt whose handler started and whose outcome is not
// written yet: running handlers and outcomes waiting for their write.
func (p *pool) refs() []claims.Ref {
	p.mu.Lock()
	defer p.mu.Unlock()
	refs := make([]claims.Ref, 0, len(p.attempts))
	for ref := range p.attempts {
		refs = append(refs, ref)
	}
	return refs
}

// holds reports whether the pool has a slot taken for task id: its
// handler runs, or is about to start (taken from the ahead buffer, not
// started yet), or its outcome waits for its write.
func (p *pool) holds(id int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.running[id] > 0
}

// unrecorded lists the attempts whose start the store has not recorded
// yet (started from the ahead buffer), for the heartbeater.
func (p *pool) unrecorded() []claims.Ref {
	p.mu.Lock()
	defer p.mu.Unlock()
	var refs []claims.Ref
	for ref, a := range p.attempts {
		if a.unrecorded && !a.finished {
			refs = append(refs, ref)
		}
	}
	return refs
}

// recorded notes that the store recorded the start of these attempts.
func (p *pool) recorded(refs []claims.Ref) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, ref := range refs {
		if a := p.attempts[ref]; a != nil {
			a.unrecorded = false
		}
	}
}

// beatable are the attempts to heartbeat, by ref: all but those whose
// handler returned after cutoff (a heartbeat interval ago), whose outcome
// is on its way to the database. Beaten, they were most of a busy
// runner's beat, and most of them were completed by the time it ran: a
// burn-down's beat of thousands of claims, each missed one classified
// (bench section throughput: 0.12 s of PostgreSQL CPU per 10,000 tasks).
// One whose write has waited longer (the database is down, or another
// transaction holds its claim) is beaten, so that its claim does not
// look stale. By ref: the heartbeater cancels the very attempt it beat
// (cancelExact), never a later one with the same ref (a task given back
// and claimed again under the same term and attempt).
func (p *pool) beatable(cutoff time.Time) map[claims.Ref]*attempt {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[claims.Ref]*attempt, len(p.attempts))
	for ref, a := range p.attempts {
		if !a.finished || !a.finishedAt.After(cutoff) {
			out[ref] = a
		}
	}
	return out
}

// cancelExact cancels the handler of attempt ref, if it is still want and
// still running: found says whether ref is that attempt of the pool,
// cancelled whether this call ended the handler's context (false when the
// handler returned or its context ended before).
func (p *pool) cancelExact(ref claims.Ref, want *attempt, cause error) (found, cancelled bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.attempts[ref]
	if a == nil || (want != nil && a != want) {
		return false, false
	}
	if a.finished || a.ctx.Err() != nil {
		return true, false
	}
	a.cancel(cause)
	return true, true
}

// findStuck marks the handlers still running stuckAfter after their
// context ended, and returns the newly stuck ones.
func (p *pool) findStuck(now time.Time) []Stuck {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Stuck
	for _, a := range p.live {
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
	for _, a := range p.live {
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
