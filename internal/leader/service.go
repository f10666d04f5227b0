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
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shardrun/shardrun/internal/clock"
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

// Once begins nothing and runs one pass of s under t, outside any Loop
// (tests of a service: call s.Begin(t) first).
func Once(ctx context.Context, s Service, t Term) (Result, *Pass) {
	p := &Pass{Term: t, Started: t.Clock.Now(), errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "unregistered"})}
	return s.Pass(ctx, p), p
}
