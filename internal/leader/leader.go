// Package leader runs the leader coordinator's services. Every service —
// the sweeps, retention, the unhandled-kind rule, the scheduler — is one
// type that implements Service: built once from its settings, given the
// term when a leadership term starts (Begin), then asked for one pass at a
// time. One Loop runs them all for a term: it owns the timer between
// passes, the jittered pauses between full batches (Pass.Batches), the exit
// when the coordinator fence holds a newer leader (store.ErrNotLeader ends
// the term for every service), the log line and errors counter of a failed
// pass (shardrun_<name>_errors_total), and the test signal.
package leader

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/store"
)

// Service is one of the leader's jobs.
type Service interface {
	// Name names the service in its logger, its errors counter
	// (shardrun_<name>_errors_total) and its Events.
	Name() string
	// Begin starts a leadership term: the service forgets what it learnt
	// in an earlier one.
	Begin(t Term)
	// Pass runs once under the term's epoch. A pass that finds the fence
	// moved returns an error wrapping store.ErrNotLeader.
	Pass(ctx context.Context, p *Pass) Result
}

// Waker is a Service that can be asked for a pass before its time.
type Waker interface {
	// Wake is signalled when a pass should run now.
	Wake() <-chan struct{}
}

// Term is one leadership term as its services see it.
type Term struct {
	// Epoch fences every statement of the term (the coordinator fence).
	Epoch int64
	// Start is when the term began, on Clock.
	Start time.Time
	Clock clock.Clock
	// Log is the service's logger.
	Log hclog.Logger
}

// Result is what one pass did.
type Result struct {
	// Next is how long until the next pass.
	Next time.Duration
	// Detail is the service's own account of the pass (sweeper.Result,
	// maintenance.RetentionResult, …), for Events.
	Detail any
	Err    error
}

// Batch bounds the statements of one rule of a pass.
type Batch struct {
	// Size is the rows one statement may change; a statement that changes
	// fewer ends the rule.
	Size int
	// Timeout bounds each statement (0: none beyond the pass's context).
	Timeout time.Duration
	// Pause is the longest pause between full batches, jittered in
	// [Pause/2, Pause), so that other statements get through (0: none).
	Pause time.Duration
}

// Pass is one pass of a service, as the Loop runs it.
type Pass struct {
	Term
	// Started is when the pass began.
	Started time.Time
	// Statements counts the statements the pass ran (Batches counts its
	// own; a service adds the others).
	Statements int
	errors     prometheus.Counter
}

// Batches runs statement until it changes fewer than b.Size rows, pausing
// between full batches, and returns the rows changed. after, when not nil,
// is called with each statement's start time once it succeeded. It stops
// early, with what it changed and no error, when ctx ends during a pause.
func (p *Pass) Batches(ctx context.Context, b Batch, statement func(ctx context.Context, limit int) (int64, error), after func(start time.Time)) (int64, error) {
	var total int64
	for {
		sctx, cancel := ctx, context.CancelFunc(func() {})
		if b.Timeout > 0 {
			sctx, cancel = context.WithTimeout(ctx, b.Timeout)
		}
		start := p.Clock.Now()
		n, err := statement(sctx, b.Size)
		cancel()
		p.Statements++
		if err != nil {
			return total, err
		}
		if after != nil {
			after(start)
		}
		total += n
		if n < int64(b.Size) {
			return total, nil
		}
		if b.Pause > 0 && !clock.Pause(p.Clock, b.Pause, ctx.Done()) {
			return total, nil
		}
	}
}

// CountError counts a failure that does not fail the pass (a schedule
// that no longer compiles) on the service's errors counter.
func (p *Pass) CountError() { p.errors.Inc() }

// Event is one pass, as tests see it.
type Event struct {
	Service  string
	Epoch    int64
	Started  time.Time
	Duration time.Duration
	// Statements the pass ran.
	Statements int
	// Detail is the service's Result.Detail.
	Detail any
	Err    error
	// NotLeader: the fence holds a newer leader; the term ended.
	NotLeader bool
}

// Config configures a Loop.
type Config struct {
	Clock  clock.Clock
	Logger hclog.Logger
	// Registry receives the errors counter of every service (nil: not
	// registered).
	Registry prometheus.Registerer
}

type entry struct {
	svc    Service
	log    hclog.Logger
	errors prometheus.Counter
}

// Loop runs the leader's services for one leadership term at a time.
type Loop struct {
	// Events, when set before Run, receives every pass; tests wait on it.
	// Nil in production.
	Events *testsignal.Signal[Event]

	cfg      Config
	services []entry
}

// New returns a loop over services; it registers their errors counters.
func New(cfg Config, services ...Service) *Loop {
	if cfg.Clock == nil {
		cfg.Clock = clock.Real()
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	f := promauto.With(cfg.Registry)
	l := &Loop{cfg: cfg}
	for _, s := range services {
		l.services = append(l.services, entry{svc: s, log: cfg.Logger.Named(s.Name()),
			errors: f.NewCounter(prometheus.CounterOpts{Name: fmt.Sprintf("shardrun_%s_errors_total", s.Name()),
				Help: fmt.Sprintf("Passes of the leader's %s service that failed.", s.Name())})})
	}
	return l
}

// Run runs every service under epoch until ctx ends (the term ends) or a
// pass finds the coordinator fence moved to a newer leader: then it ends
// the other services' passes too and returns store.ErrNotLeader.
func (l *Loop) Run(ctx context.Context, epoch int64) error {
	lctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	start := l.cfg.Clock.Now()
	var wg sync.WaitGroup
	for _, e := range l.services {
		term := Term{Epoch: epoch, Start: start, Clock: l.cfg.Clock, Log: e.log}
		wg.Go(func() {
			if err := l.run(lctx, e, term); err != nil {
				cancel(err)
			}
		})
	}
	wg.Wait()
	if err := context.Cause(lctx); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// run is one service's passes for one term.
func (l *Loop) run(ctx context.Context, e entry, term Term) error {
	e.svc.Begin(term)
	var wake <-chan struct{}
	if w, ok := e.svc.(Waker); ok {
		wake = w.Wake()
	}
	t := term.Clock.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C():
		case <-wake:
			t.Stop()
		}
		p := &Pass{Term: term, Started: term.Clock.Now(), errors: e.errors}
		r := e.svc.Pass(ctx, p)
		ev := Event{Service: e.svc.Name(), Epoch: term.Epoch, Started: p.Started, Duration: term.Clock.Now().Sub(p.Started),
			Statements: p.Statements, Detail: r.Detail, Err: r.Err, NotLeader: errors.Is(r.Err, store.ErrNotLeader)}
		switch {
		case ev.NotLeader:
			e.log.Warn("the coordinator fence holds a newer leader; stopping", "epoch", term.Epoch)
		case r.Err != nil && ctx.Err() == nil:
			e.errors.Inc()
			e.log.Error("pass failed", "error", r.Err, "duration", ev.Duration)
		}
		l.Events.Emit(ev)
		if ev.NotLeader {
			return store.ErrNotLeader
		}
		t.Reset(r.Next)
	}
}

// Once begins nothing and runs one pass of s under t, outside any Loop
// (tests of a service: call s.Begin(t) first).
func Once(ctx context.Context, s Service, t Term) (Result, *Pass) {
	p := &Pass{Term: t, Started: t.Clock.Now(), errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "unregistered"})}
	return s.Pass(ctx, p), p
}
