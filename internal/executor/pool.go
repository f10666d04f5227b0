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
// knows every attempt from its claim until its outcome is written, so that
// heartbeats can name them and cancel those taken back.
//
// It also holds a few tasks claimed ahead of need (ahead): when a handler
// returns, the next task starts on its slot at once, instead of after a
// claim round trip (a claim statement and a wake-up: 3 to 5 ms, a fifth of
// a 20 ms task). The claimer keeps the queue topped up (room). A task
// waiting ahead is heartbeated like a running one; when its shard moves or
// the runner stops, it is given back without spending its attempt
// (Unclaim), as a claim whose handler never started.
type pool struct {
	registry   *Registry
	max        int
	limits     map[string]int // per queue
	results    chan<- result
	stuckAfter time.Duration
	clock      clock.Clock
	m          *Metrics
	tr         *tracer // nil: tracing off
	// giveBack returns claims no handler will run (Store.Unclaim).
	giveBack func(refs []claims.Ref)
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
	// ahead are the tasks claimed ahead of need, in claim order, and
	// aheadOf counts them per queue.
	ahead   []*waiting
	aheadOf map[string]int
	// took is each queue's mean handler time (a moving average), which
	// sizes its ahead buffer.
	took map[string]time.Duration
	// closed: the runner stops; nothing more starts from ahead.
	closed bool
}

// waiting is a task claimed ahead of need, waiting for a free slot.
type waiting struct {
	termCtx context.Context
	task    tasks.Task
	done    func() // ends its hold on the term
	parent  trace.SpanContext
	// stop stops the watch on termCtx.
	stop func() bool
}

func newPool(registry *Registry, max int, limits map[string]int, results chan<- result, stuckAfter time.Duration, clk clock.Clock, m *Metrics, tr *tracer) *pool {
	return &pool{registry: registry, max: max, limits: limits, results: results, stuckAfter: stuckAfter, clock: clk, m: m, tr: tr,
		freed: wake.New(), attempts: map[claims.Ref]*attempt{}, byQueue: map[string]int{}, aheadOf: map[string]int{}, took: map[string]time.Duration{},
		giveBack: func([]claims.Ref) {}}
}

func (p *pool) inFlight() int { return int(p.inflight.Load()) }

// aheadCover is how long the tasks a queue keeps claimed ahead should last
// its workers: four times the longest claim measured under load (10 ms,
// while completions were being written; bench section work), as half the
// buffer is what is left when a claim starts.
const aheadCover = 40 * time.Millisecond

// aheadTarget is how many tasks of a queue of limit workers, whose
// handlers take took on average, the pool keeps claimed ahead: what the
// workers finish in aheadCover, at most one per worker, at least one. room
// tops the buffer up when it is down to half, so half of it feeds the
// slots that free up while the claim is on its way. Measured on 20 ms
// tasks with 64 workers (bench section work, one runner): a buffer of a
// quarter of the workers, topped up at every freed slot, ran dry whenever
// a claim took longer than its 5 ms of tasks, and the runner reached 0.82
// to 0.93 of ideal at 71-76% of a core of PostgreSQL, claiming 10 tasks a
// statement; this one (one per worker at 20 ms), 0.94 to 0.95 at 48-49%,
// about 33 a statement. Sized by time, long tasks are not held back from
// other runners: a queue of 10 s tasks keeps one ahead. Until a handler of
// the queue has returned, its tasks' length is unknown, and one is kept.
func aheadTarget(limit int, took time.Duration) int {
	if took <= 0 {
		return 1
	}
	return min(limit, max(1, int(int64(limit)*int64(aheadCover)/int64(took))))
}

// room is how many tasks of queue the claimer may claim now: the free
// slots within the queue's limit and the pool's, plus what the queue's
// ahead buffer lacks.
//
// While tasks wait ahead and no slot is free, the buffer is topped up only
// once it has fallen to half its target, so that each claim statement
// (planned at each execution) takes many tasks (see aheadTarget).
func (p *pool) room(queue string, limit int) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	running, ahead := p.byQueue[queue], p.aheadOf[queue]
	slots := min(limit-running, p.max-p.inFlight())
	target := aheadTarget(min(limit, p.max), p.took[queue])
	want := max(0, slots+target-ahead)
	if ahead > 0 && slots <= 0 && want < (target+1)/2 {
		return 0
	}
	return want
}

// idle is how many more attempts of any queue may start now.
func (p *pool) idle() int { return p.max - p.inFlight() }

// submit starts a claimed task now when a slot of its queue is free, and
// otherwise keeps it ahead until one is. termDone ends the attempt's hold
// on its term.
func (p *pool) submit(termCtx context.Context, t tasks.Task, termDone func(), parent trace.SpanContext) {
	p.mu.Lock()
	if !p.closed && p.slotLocked(t.Queue) {
		p.mu.Unlock()
		p.start(termCtx, t, termDone, parent)
		return
	}
	w := &waiting{termCtx: termCtx, task: t, done: termDone, parent: parent}
	p.ahead = append(p.ahead, w)
	p.aheadOf[t.Queue]++
	closed := p.closed
	if !closed {
		// The shard moves or the runner detaches: the task goes back to
		// its lane at once, so that the handoff does not wait for it. Set
		// under the lock, because startNext may take w as soon as it is
		// released; AfterFunc runs on a goroutine of its own, so it cannot
		// deadlock on p.mu.
		w.stop = context.AfterFunc(termCtx, p.dropEnded)
	}
	p.mu.Unlock()
	if closed {
		p.drop(w, true)
	}
}

// slotLocked reports whether a task of queue may start now.
func (p *pool) slotLocked(queue string) bool {
	return p.inFlight() < p.max && p.byQueue[queue] < p.limits[queue]
}

// takeLocked removes w from ahead; false when it was gone already.
func (p *pool) takeLocked(w *waiting) bool {
	i := slices.Index(p.ahead, w)
	if i < 0 {
		return false
	}
	p.ahead = slices.Delete(p.ahead, i, i+1)
	p.aheadOf[w.task.Queue]--
	return true
}

// drop takes w out of ahead and, when giveBack, returns its claim (an
// attempt that never started); either way its hold on the term ends.
func (p *pool) drop(w *waiting, giveBack bool) {
	p.mu.Lock()
	ok := p.takeLocked(w)
	p.mu.Unlock()
	if !ok {
		return
	}
	if giveBack {
		p.giveBackAll([]*waiting{w})
		return
	}
	if w.stop != nil {
		w.stop()
	}
	w.done()
	p.freed.Notify()
}

// dropEnded gives back every task waiting ahead whose term has ended, in
// one statement: a detach ends every term at once, and the buffer may hold
// a task per worker. The first of their watches to fire takes them all;
// the others find theirs gone.
func (p *pool) dropEnded() {
	p.mu.Lock()
	var ws []*waiting
	p.ahead = slices.DeleteFunc(p.ahead, func(w *waiting) bool {
		if w.termCtx.Err() == nil {
			return false
		}
		ws = append(ws, w)
		p.aheadOf[w.task.Queue]--
		return true
	})
	p.mu.Unlock()
	p.giveBackAll(ws)
}

// giveBackAll returns the claims of ws, taken out of ahead, in one
// statement, and ends their holds on their terms.
func (p *pool) giveBackAll(ws []*waiting) {
	if len(ws) == 0 {
		return
	}
	refs := make([]claims.Ref, len(ws))
	for i, w := range ws {
		if w.stop != nil {
			w.stop()
		}
		refs[i] = claims.RefOf(w.task)
	}
	p.giveBack(refs)
	for _, w := range ws {
		w.done()
	}
	p.freed.Notify()
}

// startNext starts the oldest task ahead whose queue has a free slot.
func (p *pool) startNext() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	var next *waiting
	for _, w := range p.ahead {
		if p.slotLocked(w.task.Queue) {
			next = w
			break
		}
	}
	if next == nil || !p.takeLocked(next) {
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	if next.stop != nil && !next.stop() {
		// Its term ended meanwhile, and the watch found it taken: it goes
		// back here, and its slot to the next one.
		p.giveBack([]claims.Ref{claims.RefOf(next.task)})
		next.done()
		p.startNext()
		return
	}
	p.start(next.termCtx, next.task, next.done, next.parent)
}

// close starts nothing more from ahead and gives back every task there:
// the runner stops.
func (p *pool) close() {
	p.mu.Lock()
	p.closed = true
	ws := p.ahead
	p.ahead = nil
	for _, w := range ws {
		p.aheadOf[w.task.Queue]--
	}
	p.mu.Unlock()
	p.giveBackAll(ws)
}

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
		if m := p.took[t.Queue]; m == 0 {
			p.took[t.Queue] = max(r.elapsed, time.Microsecond)
		} else {
			p.took[t.Queue] = max(m+(r.elapsed-m)/16, time.Microsecond)
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
		p.startNext()
		p.freed.Notify()
	})
}

// refs names every attempt whose outcome is not written yet: tasks
// waiting ahead, running handlers and outcomes waiting for their write.
func (p *pool) refs() []claims.Ref {
	p.mu.Lock()
	defer p.mu.Unlock()
	refs := make([]claims.Ref, 0, len(p.attempts)+len(p.ahead))
	for ref := range p.attempts {
		refs = append(refs, ref)
	}
	for _, w := range p.ahead {
		refs = append(refs, claims.RefOf(w.task))
	}
	return refs
}

// cancel cancels the handler of attempt ref, if it is still running; it
// reports whether this call ended the handler's context (false when the
// handler returned or its context ended before). A task waiting ahead
// never starts: cancelled by an operator (tasks.ErrCancelled) it is
// recorded cancelled; taken back, it is dropped (its claim is gone).
func (p *pool) cancel(ref claims.Ref, cause error) bool {
	p.mu.Lock()
	if a := p.attempts[ref]; a != nil {
		defer p.mu.Unlock()
		if a.finished || a.ctx.Err() != nil {
			return false
		}
		a.cancel(cause)
		return true
	}
	var w *waiting
	for _, x := range p.ahead {
		if claims.RefOf(x.task) == ref {
			w = x
			break
		}
	}
	p.mu.Unlock()
	if w == nil {
		return false
	}
	if !errors.Is(cause, tasks.ErrCancelled) {
		p.drop(w, false)
		return true
	}
	p.mu.Lock()
	ok := p.takeLocked(w)
	p.mu.Unlock()
	if !ok {
		return false
	}
	if w.stop != nil {
		w.stop()
	}
	p.results <- result{task: w.task, err: tasks.ErrCancelled, cancelled: true, done: w.done}
	p.freed.Notify()
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
