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
//
// It is one of the cluster's protocol packages (shard, detach, sweeper,
// store): importable, so that the runner and coordinator libraries and
// tools can be built on it, but not the library API and under no
// compatibility promise to library users, as etcd's server packages are
// importable but are not its client API. Programs use package shardrun
// and package tasks.
package sweeper

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/leader"
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
// backoff default to claims.DefaultHeartbeatInterval, tasks.DefaultRetryBase
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

// Config is the sweeper's settings.
type Config struct {
	// Interval between passes. Default 5s.
	Interval time.Duration
	// StaleThreshold: a running task silent for longer is stale. Default
	// 30s; must exceed the runners' HeartbeatInterval.
	StaleThreshold time.Duration
	// HeartbeatInterval is the runners' task heartbeat interval, for
	// validation only. Default claims.DefaultHeartbeatInterval.
	HeartbeatInterval time.Duration
	// BatchSize bounds the rows one statement changes, so a pass over a
	// huge backlog never holds many row locks at once. Default 1000.
	BatchSize int
	// Backoff before a requeued stale task's next attempt. Default
	// tasks.DefaultRetryBase and tasks.DefaultRetryCap.
	Backoff store.Backoff
}

// WithDefaults returns c with its zero settings replaced by the defaults,
// as New does; a coordinator fills its sweeper configuration with it.
func (c Config) WithDefaults() Config {
	c.Interval = cmp.Or(c.Interval, DefaultInterval)
	c.StaleThreshold = cmp.Or(c.StaleThreshold, DefaultStaleThreshold)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, claims.DefaultHeartbeatInterval)
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

// Result is what one pass did (the Detail of its leader.Result).
type Result struct {
	DeadlineFailed int64
	Requeued       int64
	Dead           int64
	// InGrace: the stale rule was skipped, for Grace.
	InGrace bool
	// Grace says why the stale rule was skipped: the leadership is new,
	// the database restarted, or the sweeper could not reach it.
	Grace string
}

// Sweeper is the leader's sweep service (a leader.Service).
type Sweeper struct {
	cfg   Config
	store Store
	m     *metrics
	term  leader.Term
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

// New fills the defaults of cfg, validates it, and registers the sweeper's
// metrics with reg (nil: not registered).
func New(st Store, cfg Config, reg prometheus.Registerer) (*Sweeper, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if st == nil {
		return nil, errors.New("sweeper: a store is required")
	}
	return &Sweeper{cfg: cfg, store: st, m: newMetrics(reg)}, nil
}

// Name is "sweep" (shardrun_sweep_errors_total).
func (s *Sweeper) Name() string { return "sweep" }

// Begin starts the term's grace period: a new leader has watched no
// heartbeats, and runners keep working across coordinator restarts.
func (s *Sweeper) Begin(t leader.Term) {
	s.term, s.degraded = t, ""
	s.graceUntil, s.graceWhy = t.Start.Add(s.cfg.StaleThreshold), "new leadership: no heartbeats watched yet"
	t.Log.Info("sweeping", "epoch", t.Epoch, "interval", s.cfg.Interval,
		"stale_threshold", s.cfg.StaleThreshold, "grace_until", s.graceUntil)
}

// Pass runs both rules once.
func (s *Sweeper) Pass(ctx context.Context, p *leader.Pass) leader.Result {
	var r Result
	err := s.sweep(ctx, p, &r)
	took := s.term.Clock.Now().Sub(p.Started)
	switch {
	case err != nil && ctx.Err() == nil && !errors.Is(err, store.ErrNotLeader):
		s.degraded = "the sweeper could not reach the database"
	case err == nil:
		s.m.passes.Inc()
		s.m.duration.Observe(took.Seconds())
		s.m.deadlineFailed.Add(float64(r.DeadlineFailed))
		s.m.released.Add(float64(r.Requeued))
		s.m.dead.Add(float64(r.Dead))
		if r.DeadlineFailed+r.Requeued+r.Dead > 0 {
			s.term.Log.Info("swept", "deadline_failed", r.DeadlineFailed, "requeued", r.Requeued, "dead", r.Dead,
				"statements", p.Statements, "duration", took, "in_grace", r.InGrace)
		} else {
			s.term.Log.Debug("swept nothing", "duration", took, "in_grace", r.InGrace)
		}
	}
	return leader.Result{Next: s.cfg.Interval, Detail: r, Err: err}
}

func (s *Sweeper) sweep(ctx context.Context, p *leader.Pass, r *Result) error {
	batch := leader.Batch{Size: s.cfg.BatchSize}
	runningGrace := s.cfg.StaleThreshold
	if why := s.grace(ctx, p); why != "" {
		r.InGrace, r.Grace = true, why
		// A running task's outcome may be in flight as long as its
		// heartbeats may be: only ready tasks fail their deadline now.
		runningGrace = store.SkipRunning
	}
	var err error
	r.DeadlineFailed, err = p.Batches(ctx, batch, func(ctx context.Context, limit int) (int64, error) {
		return s.store.SweepDeadlines(ctx, s.term.Epoch, runningGrace, limit)
	}, s.timed)
	if err != nil {
		return err
	}
	if !r.InGrace && s.degraded != "" {
		r.InGrace, r.Grace = true, s.degraded
	}
	if r.InGrace {
		return nil
	}
	_, err = p.Batches(ctx, batch, func(ctx context.Context, limit int) (int64, error) {
		requeued, dead, err := s.store.SweepStale(ctx, s.term.Epoch, s.cfg.StaleThreshold, limit, s.cfg.Backoff)
		r.Requeued += requeued
		r.Dead += dead
		return requeued + dead, err
	}, s.timed)
	return err
}

// timed notes a statement that took longer than the runners' heartbeat
// interval: the database is slow enough that heartbeats may be late, so
// the next pass starts a grace period.
func (s *Sweeper) timed(start time.Time) {
	if d := s.term.Clock.Now().Sub(start); d > s.cfg.HeartbeatInterval {
		s.degraded = fmt.Sprintf("a sweep statement took %s, longer than the heartbeat interval", d.Round(time.Millisecond))
		s.term.Log.Warn("the database is slow; stale claims are judged again after a grace period", "statement", d, "heartbeat_interval", s.cfg.HeartbeatInterval)
	}
}

// grace says why running tasks must not be judged now, or "" when they
// may be.
func (s *Sweeper) grace(ctx context.Context, p *leader.Pass) string {
	now := s.term.Clock.Now()
	if s.degraded != "" {
		// The first pass after a failed or slow one: heartbeats could not
		// be written in time either.
		s.graceUntil, s.graceWhy = now.Add(s.cfg.StaleThreshold), s.degraded+" until "+now.UTC().Format(time.RFC3339)
		s.degraded = ""
		s.term.Log.Info("running tasks are judged again after a grace period", "why", s.graceWhy, "grace_until", s.graceUntil)
	}
	if now.Before(s.graceUntil) {
		return s.graceWhy
	}
	up, err := s.store.Uptime(ctx)
	p.Statements++
	if err != nil {
		return "the database's uptime is unknown: " + err.Error()
	}
	if up < s.cfg.StaleThreshold {
		return fmt.Sprintf("the database restarted %s ago: no heartbeat could be written while it was down", up.Round(time.Millisecond))
	}
	return ""
}

// metrics are the sweeper's own metrics; its errors counter is the
// loop's.
type metrics struct {
	passes, released, deadlineFailed, dead prometheus.Counter
	duration                               prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) *metrics {
	f := promauto.With(reg) // With(nil) creates them without registering
	counter := func(name, help string) prometheus.Counter {
		return f.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	return &metrics{
		passes: counter("shardrun_sweeps_total", "Completed sweep passes."),
		duration: f.NewHistogram(prometheus.HistogramOpts{Name: "shardrun_sweep_duration_seconds",
			Help: "Duration of sweep passes.", Buckets: prometheus.ExponentialBuckets(0.001, 4, 9)}),
		released:       counter("shardrun_sweep_released_total", "Stale claims put back to ready."),
		deadlineFailed: counter("shardrun_sweep_deadline_failed_total", "Tasks failed because their deadline passed."),
		dead:           counter("shardrun_sweep_dead_total", "Stale claims whose attempts were used up."),
	}
}
