package executor

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/tasks"
)

// errTakenBack cancels an attempt whose heartbeat found the task no longer
// its own: a sweep requeued it, or it was finished elsewhere.
var errTakenBack = errors.New("task taken back: its claim is no longer this attempt's")

// result is one attempt's outcome on its way to the database.
type result struct {
	task    tasks.Task
	err     error // nil: completed
	elapsed time.Duration
	done    func()
}

// attempt is one running handler.
type attempt struct {
	task   tasks.Task
	cancel context.CancelCauseFunc
}

// pool runs each attempt on its own goroutine, at most max at once, and
// knows which attempts are running so that heartbeats can name them and
// cancel those taken back.
type pool struct {
	registry *tasks.Registry
	max      int
	results  chan<- result
	clock    clock.Clock
	m        *Metrics
	// freed is signalled when an attempt ends, so the claimer can refill.
	freed wake.Signal

	wg       sync.WaitGroup
	inflight atomic.Int64
	mu       sync.Mutex
	// running is keyed by the whole claim: a sweep may requeue a task whose
	// handler still runs here, and this runner may claim it again.
	running map[tasks.Ref]*attempt
}

func newPool(registry *tasks.Registry, max int, results chan<- result, clk clock.Clock, m *Metrics) *pool {
	return &pool{registry: registry, max: max, results: results, clock: clk, m: m,
		freed: wake.New(), running: map[tasks.Ref]*attempt{}}
}

func (p *pool) inFlight() int { return int(p.inflight.Load()) }

// free is how many more attempts may start now.
func (p *pool) free() int { return p.max - p.inFlight() }

// start runs one claimed task under its term's context; done is called by
// the writer once the outcome is written.
func (p *pool) start(termCtx context.Context, t tasks.Task, done func()) {
	h, _ := p.registry.Lookup(t.Kind)
	ctx, cancel := context.WithCancelCause(termCtx)
	handlerCtx, stopDeadline := ctx, context.CancelFunc(func() {})
	if t.Deadline != nil {
		handlerCtx, stopDeadline = context.WithDeadline(ctx, *t.Deadline)
	}
	p.mu.Lock()
	p.running[t.Ref()] = &attempt{task: t, cancel: cancel}
	p.mu.Unlock()
	p.inflight.Add(1)
	p.m.InFlight.Inc()
	p.wg.Go(func() {
		start := p.clock.Now()
		task := t
		err := call(handlerCtx, h, &task)
		stopDeadline()
		cancel(nil)
		p.mu.Lock()
		delete(p.running, t.Ref())
		p.mu.Unlock()
		p.results <- result{task: task, err: err, elapsed: p.clock.Now().Sub(start), done: done}
		p.inflight.Add(-1)
		p.m.InFlight.Dec()
		p.freed.Notify()
	})
}

// refs names every running attempt.
func (p *pool) refs() []tasks.Ref {
	p.mu.Lock()
	defer p.mu.Unlock()
	refs := make([]tasks.Ref, 0, len(p.running))
	for _, a := range p.running {
		refs = append(refs, a.task.Ref())
	}
	return refs
}

// cancel cancels the running attempt ref, if it is still that attempt.
func (p *pool) cancel(ref tasks.Ref, cause error) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.running[ref]
	if a == nil {
		return false
	}
	a.cancel(cause)
	return true
}

// wait waits up to timeout for every attempt to end; it reports whether
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
	return h(ctx, t)
}
