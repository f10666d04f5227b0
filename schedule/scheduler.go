package schedule

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/client"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// TickStore is what the Scheduler needs from the database (store.Store).
type TickStore interface {
	EnqueueTicks(ctx context.Context, epoch int64, limit int,
		plan func(sc store.Schedule, now, termStart time.Time) (store.TickPlan, error)) (store.TickResult, error)
}

// Defaults of SchedulerConfig.
const (
	// DefaultMaxWait bounds the sleep between passes: schedules created on
	// another coordinator are seen within it (their ticks are enqueued
	// late, never skipped, since they come due during the term).
	DefaultMaxWait = 5 * time.Second
	// DefaultBatchSize is the schedules one transaction handles.
	DefaultBatchSize = 100
	// DefaultTimeout bounds one batch's transaction.
	DefaultTimeout = 10 * time.Second
	// DefaultBatchPause is the longest jittered pause between full batches.
	DefaultBatchPause = 50 * time.Millisecond
)

// SchedulerConfig is the Scheduler's settings.
type SchedulerConfig struct {
	// MaxWait bounds the sleep between passes. Default DefaultMaxWait.
	MaxWait time.Duration
	// BatchSize is the schedules one transaction handles. Default
	// DefaultBatchSize.
	BatchSize int
	// Timeout bounds one batch's transaction. Default DefaultTimeout.
	Timeout time.Duration
	// BatchPause is the longest jittered pause between full batches.
	// Default DefaultBatchPause.
	BatchPause time.Duration
}

// WithDefaults returns c with its zero settings replaced by the defaults.
func (c SchedulerConfig) WithDefaults() SchedulerConfig {
	c.MaxWait = cmp.Or(c.MaxWait, DefaultMaxWait)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.Timeout = cmp.Or(c.Timeout, DefaultTimeout)
	c.BatchPause = cmp.Or(c.BatchPause, DefaultBatchPause)
	return c
}

// Validate reports the first bad setting.
func (c SchedulerConfig) Validate() error {
	switch {
	case c.MaxWait <= 0:
		return fmt.Errorf("scheduler MaxWait: must be positive, got %s", c.MaxWait)
	case c.BatchSize < 1:
		return fmt.Errorf("scheduler BatchSize: must be at least 1, got %d", c.BatchSize)
	case c.Timeout <= 0:
		return fmt.Errorf("scheduler Timeout: must be positive, got %s", c.Timeout)
	case c.BatchPause < 0:
		return fmt.Errorf("scheduler BatchPause: must not be negative, got %s", c.BatchPause)
	}
	return nil
}

// Result is what one pass did (the Detail of its leader.Result).
type Result struct {
	// TermStart is the database time the leader raised the coordinator
	// fence (zero until a pass succeeded): ticks before it were missed
	// while no leader ran.
	TermStart time.Time
	// Due schedules handled, tasks Enqueued, ticks Skipped by the
	// missed-tick policy, Duplicates refused by the unique index (never
	// expected).
	Due, Enqueued, Skipped, Duplicates int
	// NextIn is how long until the earliest next tick (0: none, or due).
	NextIn time.Duration
}

// Scheduler enqueues the due ticks of every schedule (a leader.Service).
// It sleeps until the earliest next tick, at most MaxWait, or until woken
// (Wake: a schedule was created on this coordinator).
type Scheduler struct {
	cfg       SchedulerConfig
	store     TickStore
	prep      client.Config
	wake      wake.Signal
	m         *metrics
	term      leader.Term
	termStart time.Time
	// errors counts, on the loop's errors counter, schedules that stop
	// ticking; set for each pass.
	errors func()
}

// NewScheduler fills the defaults of cfg, validates it, and registers the
// scheduler's metrics with reg (nil: not registered). prep is the task
// client's configuration: every tick's task is prepared as every enqueued
// task is.
func NewScheduler(st TickStore, prep client.Config, cfg SchedulerConfig, reg prometheus.Registerer) (*Scheduler, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	prep = prep.WithDefaults()
	if err := prep.Validate(); err != nil {
		return nil, fmt.Errorf("scheduler: %w", err)
	}
	if st == nil {
		return nil, errors.New("scheduler: a store is required")
	}
	return &Scheduler{cfg: cfg, store: st, prep: prep, wake: wake.New(), m: newMetrics(reg)}, nil
}

// Name is "schedule" (shardrun_schedule_errors_total).
func (s *Scheduler) Name() string { return "schedule" }

// Wake is signalled by Notify.
func (s *Scheduler) Wake() <-chan struct{} { return s.wake.C() }

// Notify asks for a pass now (a schedule was created); it never blocks.
func (s *Scheduler) Notify() { s.wake.Notify() }

// Begin starts a term: its start is read from the database at its first
// pass.
func (s *Scheduler) Begin(t leader.Term) { s.term, s.termStart = t, time.Time{} }

// Pass enqueues every due tick, in batches of schedules.
func (s *Scheduler) Pass(ctx context.Context, p *leader.Pass) leader.Result {
	s.errors = p.CountError
	var r Result
	err := s.pass(ctx, p, &r)
	r.TermStart = s.termStart
	next := s.cfg.MaxWait
	if err == nil {
		s.m.enqueued.Add(float64(r.Enqueued))
		s.m.skipped.Add(float64(r.Skipped))
		if r.Duplicates > 0 {
			s.term.Log.Error("ticks refused as duplicates by the unique (schedule, tick) index", "duplicates", r.Duplicates)
		}
		if r.Enqueued+r.Skipped > 0 {
			s.term.Log.Debug("enqueued schedule ticks", "schedules", r.Due, "enqueued", r.Enqueued, "skipped", r.Skipped)
		}
		if r.NextIn > 0 {
			next = min(next, r.NextIn)
		}
	}
	return leader.Result{Next: next, Detail: r, Err: err}
}

func (s *Scheduler) pass(ctx context.Context, p *leader.Pass, r *Result) error {
	for {
		bctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
		res, err := s.store.EnqueueTicks(bctx, s.term.Epoch, s.cfg.BatchSize, s.plan)
		cancel()
		p.Statements++
		if err != nil {
			return err
		}
		s.termStart = res.TermStart
		r.Due += res.Schedules
		r.Enqueued += res.Enqueued
		r.Skipped += res.Skipped
		r.Duplicates += res.Duplicates
		r.NextIn = 0
		if !res.NextDue.IsZero() && res.NextDue.After(res.Now) {
			r.NextIn = res.NextDue.Sub(res.Now)
		}
		if res.Schedules < s.cfg.BatchSize && r.NextIn > 0 || res.Schedules == 0 {
			return nil
		}
		// More are due: a jittered pause lets other statements through.
		if !clock.Pause(s.term.Clock, s.cfg.BatchPause, ctx.Done()) {
			return ctx.Err()
		}
	}
}

// plan is the missed-tick policy applied to one due schedule (see the
// package comment). The term starts when the leader raised the
// coordinator fence, whenever its first pass succeeds: ticks that came due
// while its passes failed (the database was down) came due in its term.
func (s *Scheduler) plan(sc store.Schedule, now, termStart time.Time) (store.TickPlan, error) {
	timer, err := TimerOf(sc)
	if err != nil {
		// A stored schedule that no longer compiles (its time zone left the
		// zone database) must not block the others: it stops ticking.
		s.errors()
		s.term.Log.Error("schedule does not compile; it stops ticking", "schedule", sc.Name, "error", err)
		return store.TickPlan{Next: Never}, nil
	}
	ticks, next, skipped := Plan(timer, sc.NextTick, now, termStart)
	p := store.TickPlan{Next: next, Skipped: skipped}
	for _, at := range ticks {
		in, err := s.prep.Prepare(tasks.NewTask{Kind: sc.Kind, Key: sc.Key, Payload: sc.Payload, MaxAttempts: sc.MaxAttempts}, now)
		if err != nil {
			s.errors()
			s.term.Log.Error("the task of a schedule is invalid; it stops ticking", "schedule", sc.Name, "error", err)
			return store.TickPlan{Next: Never}, nil
		}
		p.Ticks = append(p.Ticks, store.Tick{At: at, Task: in})
	}
	if skipped > 0 {
		s.term.Log.Warn("ticks missed while no leader ran were skipped; enqueued the latest", "schedule", sc.Name,
			"skipped", skipped, "from", sc.NextTick, "term_start", termStart)
	}
	return p, nil
}

// metrics are the scheduler's own metrics; its errors counter is the
// loop's.
type metrics struct {
	enqueued, skipped prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	f := promauto.With(reg)
	return &metrics{
		enqueued: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_schedule_ticks_enqueued_total",
			Help: "Schedule ticks whose task was enqueued."}),
		skipped: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_schedule_ticks_skipped_total",
			Help: "Schedule ticks missed while no leader ran and not enqueued (only the latest missed tick is)."}),
	}
}
