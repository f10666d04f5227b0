package schedule

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
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

// SchedulerConfig configures a Scheduler.
type SchedulerConfig struct {
	Store TickStore
	// Epoch is the leadership epoch the ticks are fenced with.
	Epoch int64
	// ShardCount decides the shard of each tick's task; required.
	ShardCount int
	// MaxAttempts for ticks' tasks of schedules that set none. Default 5.
	MaxAttempts int
	MaxWait     time.Duration
	BatchSize   int
	Timeout     time.Duration
	BatchPause  time.Duration
	// Wake, when set, ends the wait between passes early (a schedule was
	// created on this coordinator).
	Wake    wake.Signal
	Clock   clock.Clock
	Logger  hclog.Logger
	Metrics *Metrics
	// Passes, when set, receives every pass's result; tests wait on it.
	Passes *testsignal.Signal[Result]
}

// Validate reports the first bad setting.
func (c *SchedulerConfig) Validate() error {
	switch {
	case c.Store == nil:
		return errors.New("scheduler: a store is required")
	case c.ShardCount < 1:
		return fmt.Errorf("--shard-count: must be at least 1, got %d", c.ShardCount)
	case c.MaxWait <= 0:
		return fmt.Errorf("scheduler MaxWait: must be positive, got %s", c.MaxWait)
	case c.BatchSize < 1:
		return fmt.Errorf("scheduler BatchSize: must be at least 1, got %d", c.BatchSize)
	case c.Timeout <= 0:
		return fmt.Errorf("scheduler Timeout: must be positive, got %s", c.Timeout)
	}
	return nil
}

// Result is what one pass did.
type Result struct {
	Started  time.Time
	Duration time.Duration
	// TermStart is the database time the leader raised the coordinator
	// fence (zero until a pass succeeded): ticks before it were missed
	// while no leader ran.
	TermStart time.Time
	// Due schedules handled, tasks Enqueued, ticks Skipped by the
	// missed-tick policy, Duplicates refused by the unique index (never
	// expected), Batches run.
	Due, Enqueued, Skipped, Duplicates, Batches int
	// NextIn is how long until the earliest next tick (0: none, or due).
	NextIn    time.Duration
	NotLeader bool
	Err       error
}

// Scheduler enqueues the due ticks of every schedule, for one leadership
// term.
type Scheduler struct {
	cfg       SchedulerConfig
	log       hclog.Logger
	clock     clock.Clock
	m         *Metrics
	termStart time.Time
}

// NewScheduler validates cfg and fills the defaults.
func NewScheduler(cfg SchedulerConfig) (*Scheduler, error) {
	cfg.MaxWait = cmp.Or(cfg.MaxWait, DefaultMaxWait)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultBatchSize)
	cfg.Timeout = cmp.Or(cfg.Timeout, DefaultTimeout)
	cfg.BatchPause = cmp.Or(cfg.BatchPause, DefaultBatchPause)
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, tasks.DefaultMaxAttempts)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real()
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	return &Scheduler{cfg: cfg, log: cfg.Logger, clock: cfg.Clock, m: cfg.Metrics}, nil
}

// Run enqueues due ticks until ctx ends or the fence holds a newer leader
// (store.ErrNotLeader). It sleeps until the earliest next tick, at most
// MaxWait, or until woken.
func (s *Scheduler) Run(ctx context.Context) error {
	t := s.clock.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C():
		case <-s.cfg.Wake.C():
			t.Stop()
		}
		r := s.runOnce(ctx)
		if r.NotLeader {
			return store.ErrNotLeader
		}
		wait := s.cfg.MaxWait
		if r.Err == nil && r.NextIn > 0 {
			wait = min(wait, r.NextIn)
		}
		t.Reset(wait)
	}
}

// runOnce enqueues every due tick, in batches of schedules.
func (s *Scheduler) runOnce(ctx context.Context) Result {
	r := Result{Started: s.clock.Now()}
	r.Err = s.pass(ctx, &r)
	r.Duration = s.clock.Now().Sub(r.Started)
	r.TermStart = s.termStart
	switch {
	case errors.Is(r.Err, store.ErrNotLeader):
		r.NotLeader = true
		s.log.Warn("the coordinator fence holds a newer leader; stopping", "epoch", s.cfg.Epoch)
	case r.Err != nil && ctx.Err() == nil:
		s.m.Errors.Inc()
		s.log.Error("enqueueing schedule ticks failed", "error", r.Err, "duration", r.Duration)
	case r.Err == nil:
		s.m.Enqueued.Add(float64(r.Enqueued))
		s.m.Skipped.Add(float64(r.Skipped))
		if r.Duplicates > 0 {
			s.log.Error("ticks refused as duplicates by the unique (schedule, tick) index", "duplicates", r.Duplicates)
		}
		if r.Enqueued+r.Skipped > 0 {
			s.log.Debug("enqueued schedule ticks", "schedules", r.Due, "enqueued", r.Enqueued, "skipped", r.Skipped, "duration", r.Duration)
		}
	}
	s.cfg.Passes.Emit(r)
	return r
}

func (s *Scheduler) pass(ctx context.Context, r *Result) error {
	for {
		bctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
		res, err := s.cfg.Store.EnqueueTicks(bctx, s.cfg.Epoch, s.cfg.BatchSize, s.plan)
		cancel()
		r.Batches++
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
		if !clock.Pause(s.clock, s.cfg.BatchPause, ctx.Done()) {
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
		s.m.Errors.Inc()
		s.log.Error("schedule does not compile; it stops ticking", "schedule", sc.Name, "error", err)
		return store.TickPlan{Next: Never}, nil
	}
	ticks, next, skipped := Plan(timer, sc.NextTick, now, termStart)
	p := store.TickPlan{Next: next, Skipped: skipped}
	for _, at := range ticks {
		in, err := tasks.NewTask{Kind: sc.Kind, Key: sc.Key, Payload: sc.Payload, MaxAttempts: sc.MaxAttempts}.
			Prepare(now, s.cfg.ShardCount, s.cfg.MaxAttempts)
		if err != nil {
			s.m.Errors.Inc()
			s.log.Error("the task of a schedule is invalid; it stops ticking", "schedule", sc.Name, "error", err)
			return store.TickPlan{Next: Never}, nil
		}
		p.Ticks = append(p.Ticks, store.Tick{At: at, Task: in})
	}
	if skipped > 0 {
		s.log.Warn("ticks missed while no leader ran were skipped; enqueued the latest", "schedule", sc.Name,
			"skipped", skipped, "from", sc.NextTick, "term_start", termStart)
	}
	return p, nil
}

// Metrics are the scheduler's metrics.
type Metrics struct {
	Enqueued prometheus.Counter
	Skipped  prometheus.Counter
	Errors   prometheus.Counter
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	f := promauto.With(reg)
	return &Metrics{
		Enqueued: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_schedule_ticks_enqueued_total",
			Help: "Schedule ticks whose task was enqueued."}),
		Skipped: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_schedule_ticks_skipped_total",
			Help: "Schedule ticks missed while no leader ran and not enqueued (only the latest missed tick is)."}),
		Errors: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_schedule_errors_total",
			Help: "Scheduler passes that failed."}),
	}
}
