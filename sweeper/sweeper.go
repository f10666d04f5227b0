// Package sweeper finds task claims that nobody works on any more and puts
// the work back in line. Only the leader coordinator runs it. Each pass
// applies two rules, in this order, each as conditional statements in
// bounded batches:
//
//  1. Deadline: a ready task past its deadline is failed ("deadline
//     exceeded") at once, a running one only one stale threshold after it:
//     its runner ends the handler at the deadline and records the outcome
//     itself, and the sweep is the backstop for a runner that is gone.
//  2. Stale: a running task whose last sign of life — its last heartbeat,
//     or its claim when it never beat — is older than the stale threshold
//     goes back to ready with attempt+1 after a backoff, or to dead when its
//     attempts are used up. A claim with no heartbeat is judged from its
//     claim time, so a runner that crashed before its first beat cannot
//     leave a task stuck forever.
//
// Grace: the stale rule, and the deadline rule for running tasks, are
// skipped until the sweeper has run for one stale threshold after gaining
// leadership (a new leader has not seen any heartbeats yet, and runners
// keep working across coordinator restarts), while the database has been
// up for less than one threshold (no heartbeat could be written while it
// was down), and for one threshold after a pass that failed or had a
// statement slower than the runners' heartbeat interval (the sweeper could
// not reach the database in time, so runners probably could not either:
// their heartbeats and outcomes may still be on the way).
//
// A sweep racing a completion is safe: every statement re-checks the state,
// attempt and horizon it selected on, so exactly one of them changes the
// row. Every statement also requires the leader's fence, so a deposed leader
// that has not noticed yet sweeps nothing.
package sweeper

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/executor"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Store is what the sweeper needs from the database (store.Store).
type Store interface {
	SweepDeadlines(ctx context.Context, epoch int64, runningGrace time.Duration, limit int) (int64, error)
	Uptime(ctx context.Context) (time.Duration, error)
	SweepStale(ctx context.Context, epoch int64, threshold time.Duration, limit int, b store.Backoff) (requeued, dead int64, err error)
}

// Defaults of Config. The runners' heartbeat interval and the retry
// backoff default to executor.DefaultHeartbeatInterval, tasks.DefaultRetryBase
// and tasks.DefaultRetryCap: one default, shared with the runners.
const (
	DefaultInterval       = 5 * time.Second
	DefaultStaleThreshold = 30 * time.Second
	DefaultBatchSize      = 1000
)

// Bounds of Config.
const (
	// MinInterval: a pass is at least two statements; more often than every
	// 10ms is a busy loop on the database.
	MinInterval = 10 * time.Millisecond
	// MaxInterval: a sweep less often than hourly leaves stale claims and
	// missed deadlines unnoticed for too long.
	MaxInterval = time.Hour
	// MaxStaleThreshold: a running task silent for a day is not coming back.
	MaxStaleThreshold = 24 * time.Hour
	// MaxBatchSize: rows one statement locks and changes (their ids travel
	// in arrays).
	MaxBatchSize = 100_000
)

// Config configures a Sweeper.
type Config struct {
	Store Store
	// Epoch is the leadership epoch the sweeps are fenced with.
	Epoch int64
	// Interval between passes. Default 5s.
	Interval time.Duration
	// StaleThreshold: a running task silent for longer is stale. Default
	// 30s; must exceed the runners' HeartbeatInterval.
	StaleThreshold time.Duration
	// HeartbeatInterval is the runners' task heartbeat interval, for
	// validation only. Default executor.DefaultHeartbeatInterval.
	HeartbeatInterval time.Duration
	// BatchSize bounds the rows one statement changes, so a pass over a
	// huge backlog never holds many row locks at once. Default 1000.
	BatchSize int
	// Backoff before a requeued stale task's next attempt. Default
	// tasks.DefaultRetryBase and tasks.DefaultRetryCap.
	Backoff store.Backoff
	Clock   clock.Clock
	Logger  hclog.Logger
	Metrics *Metrics
	// Passes, when set, receives every pass's result; tests wait on it. Nil
	// in production.
	Passes *testsignal.Signal[Result]
}

// WithDefaults returns c with its zero settings replaced by the defaults,
// as New does; a coordinator fills its sweeper configuration with it.
func (c Config) WithDefaults() Config {
	c.Interval = cmp.Or(c.Interval, DefaultInterval)
	c.StaleThreshold = cmp.Or(c.StaleThreshold, DefaultStaleThreshold)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, executor.DefaultHeartbeatInterval)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	if c.Backoff == (store.Backoff{}) {
		c.Backoff = store.Backoff{Base: tasks.DefaultRetryBase, Cap: tasks.DefaultRetryCap}
	}
	return c
}

// Validate reports the first bad setting, by its flag. It checks the
// settings as they are: a zero that New would replace by the default is an
// error here, so that a flag given as 0 is refused rather than replaced.
func (c *Config) Validate() error {
	switch {
	case c.Interval < MinInterval || c.Interval > MaxInterval:
		return fmt.Errorf("--sweep-interval: must be %s to %s, got %s", MinInterval, MaxInterval, c.Interval)
	case c.HeartbeatInterval <= 0:
		return fmt.Errorf("--heartbeat-interval: must be positive, got %s", c.HeartbeatInterval)
	case c.StaleThreshold <= c.HeartbeatInterval || c.StaleThreshold > MaxStaleThreshold:
		return fmt.Errorf("--stale-threshold: must exceed the runners' --heartbeat-interval (%s) and be at most %s, got %s", c.HeartbeatInterval, MaxStaleThreshold, c.StaleThreshold)
	case c.BatchSize < 1 || c.BatchSize > MaxBatchSize:
		return fmt.Errorf("--sweep-batch: must be 1 to %d (rows one statement locks), got %d", MaxBatchSize, c.BatchSize)
	}
	return tasks.ValidateBackoff(c.Backoff.Base, c.Backoff.Cap)
}

// Result is what one pass did.
type Result struct {
	Started        time.Time
	Duration       time.Duration
	DeadlineFailed int64
	Requeued       int64
	Dead           int64
	// Statements run (batches of both rules).
	Statements int
	// InGrace: the stale rule was skipped, for Grace.
	InGrace bool
	// Grace says why the stale rule was skipped: the leadership is new,
	// the database restarted, or the sweeper could not reach it.
	Grace string
	// NotLeader: the fence holds a newer leader; the sweeper stops.
	NotLeader bool
	Err       error
}

// Sweeper is the sweep loop of one leadership term.
type Sweeper struct {
	cfg   Config
	log   hclog.Logger
	clock clock.Clock
	m     *Metrics
	// graceUntil: no stale rule before it. It starts one threshold after
	// leadership began, and moves to one threshold after the first pass
	// that succeeds after a failed or slow one: while the sweeper could
	// not reach the database in time, runners probably could not either,
	// and their heartbeats must not be judged by a clock that kept running.
	graceUntil time.Time
	graceWhy   string
	// degraded says why the last pass found the database unreachable or
	// slow; "" when it was fine.
	degraded string
}

// New fills the defaults and validates cfg.
func New(cfg Config) (*Sweeper, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Store == nil {
		return nil, errors.New("sweeper: a store is required")
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
	return &Sweeper{cfg: cfg, log: cfg.Logger, clock: cfg.Clock, m: cfg.Metrics}, nil
}

// Run sweeps every interval until ctx ends (leadership lost or shutdown) or
// the fence says another coordinator leads. The grace period counts from
// the start of Run.
func (s *Sweeper) Run(ctx context.Context) error {
	s.begin()
	s.log.Info("sweeping", "epoch", s.cfg.Epoch, "interval", s.cfg.Interval,
		"stale_threshold", s.cfg.StaleThreshold, "grace_until", s.graceUntil)
	t := s.clock.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C():
		}
		r := s.Pass(ctx)
		if r.NotLeader {
			return store.ErrNotLeader
		}
		t.Reset(s.cfg.Interval)
	}
}

// begin starts the leadership's grace period: a new leader has watched no
// heartbeats, and runners keep working across coordinator restarts.
func (s *Sweeper) begin() {
	s.graceUntil, s.graceWhy = s.clock.Now().Add(s.cfg.StaleThreshold), "new leadership: no heartbeats watched yet"
}

// Pass runs both rules once and returns what it did. A failing pass is
// logged and counted; the loop carries on.
func (s *Sweeper) Pass(ctx context.Context) Result {
	r := Result{Started: s.clock.Now()}
	r.Err = s.sweep(ctx, &r)
	r.Duration = s.clock.Now().Sub(r.Started)
	switch {
	case errors.Is(r.Err, store.ErrNotLeader):
		r.NotLeader = true
		s.log.Warn("the coordinator fence holds a newer leader; stopping", "epoch", s.cfg.Epoch)
	case r.Err != nil && ctx.Err() == nil:
		s.degraded = "the sweeper could not reach the database"
		s.m.Errors.Inc()
		s.log.Error("sweep pass failed", "error", r.Err, "duration", r.Duration)
	case r.Err == nil:
		s.m.Passes.Inc()
		s.m.Duration.Observe(r.Duration.Seconds())
		s.m.DeadlineFailed.Add(float64(r.DeadlineFailed))
		s.m.Released.Add(float64(r.Requeued))
		s.m.Dead.Add(float64(r.Dead))
		if r.DeadlineFailed+r.Requeued+r.Dead > 0 {
			s.log.Info("swept", "deadline_failed", r.DeadlineFailed, "requeued", r.Requeued, "dead", r.Dead,
				"statements", r.Statements, "duration", r.Duration, "in_grace", r.InGrace)
		} else {
			s.log.Debug("swept nothing", "duration", r.Duration, "in_grace", r.InGrace)
		}
	}
	s.cfg.Passes.Emit(r)
	return r
}

func (s *Sweeper) sweep(ctx context.Context, r *Result) error {
	limit := s.cfg.BatchSize
	runningGrace := s.cfg.StaleThreshold
	if why := s.grace(ctx, r); why != "" {
		r.InGrace, r.Grace = true, why
		// A running task's outcome may be in flight as long as its
		// heartbeats may be: only ready tasks fail their deadline now.
		runningGrace = store.SkipRunning
	}
	for {
		start := s.clock.Now()
		n, err := s.cfg.Store.SweepDeadlines(ctx, s.cfg.Epoch, runningGrace, limit)
		r.Statements++
		if err != nil {
			return err
		}
		s.timed(start)
		r.DeadlineFailed += n
		if n < int64(limit) {
			break
		}
	}
	if !r.InGrace && s.degraded != "" {
		r.InGrace, r.Grace = true, s.degraded
	}
	if r.InGrace {
		return nil
	}
	for {
		start := s.clock.Now()
		requeued, dead, err := s.cfg.Store.SweepStale(ctx, s.cfg.Epoch, s.cfg.StaleThreshold, limit, s.cfg.Backoff)
		r.Statements++
		if err != nil {
			return err
		}
		s.timed(start)
		r.Requeued += requeued
		r.Dead += dead
		if requeued+dead < int64(limit) {
			return nil
		}
	}
}

// timed notes a statement that took longer than the runners' heartbeat
// interval: the database is slow enough that heartbeats may be late, so
// the next pass starts a grace period.
func (s *Sweeper) timed(start time.Time) {
	if d := s.clock.Now().Sub(start); d > s.cfg.HeartbeatInterval {
		s.degraded = fmt.Sprintf("a sweep statement took %s, longer than the heartbeat interval", d.Round(time.Millisecond))
		s.log.Warn("the database is slow; stale claims are judged again after a grace period", "statement", d, "heartbeat_interval", s.cfg.HeartbeatInterval)
	}
}

// grace says why running tasks must not be judged now, or "" when they
// may be.
func (s *Sweeper) grace(ctx context.Context, r *Result) string {
	now := s.clock.Now()
	if s.degraded != "" {
		// The first pass after a failed or slow one: heartbeats could not
		// be written in time either.
		s.graceUntil, s.graceWhy = now.Add(s.cfg.StaleThreshold), s.degraded+" until "+now.UTC().Format(time.RFC3339)
		s.degraded = ""
		s.log.Info("running tasks are judged again after a grace period", "why", s.graceWhy, "grace_until", s.graceUntil)
	}
	if now.Before(s.graceUntil) {
		return s.graceWhy
	}
	up, err := s.cfg.Store.Uptime(ctx)
	r.Statements++
	if err != nil {
		return "the database's uptime is unknown: " + err.Error()
	}
	if up < s.cfg.StaleThreshold {
		return fmt.Sprintf("the database restarted %s ago: no heartbeat could be written while it was down", up.Round(time.Millisecond))
	}
	return ""
}

// Metrics are the sweeper's metrics.
type Metrics struct {
	Passes         prometheus.Counter
	Duration       prometheus.Histogram
	Released       prometheus.Counter
	DeadlineFailed prometheus.Counter
	Dead           prometheus.Counter
	Errors         prometheus.Counter
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	f := promauto.With(reg) // With(nil) creates them without registering
	return &Metrics{
		Passes: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_sweeps_total",
			Help: "Completed sweep passes."}),
		Duration: f.NewHistogram(prometheus.HistogramOpts{Name: "shardrun_sweep_duration_seconds",
			Help: "Duration of sweep passes.", Buckets: prometheus.ExponentialBuckets(0.001, 4, 9)}),
		Released: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_sweep_released_total",
			Help: "Stale claims put back to ready."}),
		DeadlineFailed: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_sweep_deadline_failed_total",
			Help: "Tasks failed because their deadline passed."}),
		Dead: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_sweep_dead_total",
			Help: "Stale claims whose attempts were used up."}),
		Errors: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_sweep_errors_total",
			Help: "Sweep passes that failed."}),
	}
}
