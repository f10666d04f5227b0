// Package maintenance holds loops the leader coordinator runs besides the
// sweeps, each fenced by the coordinator fence like them: retention
// (Retainer deletes finished tasks after their state's retention period)
// and the unhandled-kind rule (Reaper fails ready tasks of kinds no
// attached runner handles, when --unhandled-after is set). Each is one
// type with Run(ctx), a Config with exported defaults, and a runOnce that
// returns a result; statements run in bounded batches with a timeout each
// and a jittered pause between full batches.
package maintenance

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
	"github.com/shardrun/shardrun/store"
)

// RetentionStore is what the Retainer needs from the database (store.Store).
type RetentionStore interface {
	DeleteFinished(ctx context.Context, epoch int64, state string, olderThan time.Duration, limit int) (int64, error)
}

// Defaults of RetentionConfig.
const (
	DefaultRetainCompleted   = 24 * time.Hour
	DefaultRetainFailed      = 7 * 24 * time.Hour
	DefaultRetentionInterval = 30 * time.Second
	// DefaultRetentionBatch is the rows one DELETE removes (see
	// docs/architecture.md for the measurement behind it).
	DefaultRetentionBatch = 5000
	// DefaultStatementTimeout bounds one statement.
	DefaultStatementTimeout = 30 * time.Second
	// DefaultBatchPause is the longest pause between full batches; each
	// pause is uniform in [BatchPause/2, BatchPause).
	DefaultBatchPause = 100 * time.Millisecond
)

// RetentionConfig configures a Retainer.
type RetentionConfig struct {
	Store RetentionStore
	// Epoch is the leadership epoch the deletes are fenced with.
	Epoch int64
	// RetainCompleted keeps completed tasks this long after they finished;
	// 0 keeps them forever. Default 24h.
	RetainCompleted time.Duration
	// RetainFailed keeps failed, dead and cancelled tasks this long; 0
	// keeps them forever. Default 7 days.
	RetainFailed time.Duration
	// KeepCompleted and KeepFailed make a zero RetainCompleted or
	// RetainFailed mean "forever" rather than "the default" (the flags set
	// them when given 0).
	KeepCompleted, KeepFailed bool
	// Interval between passes. Default 30s.
	Interval time.Duration
	// BatchSize bounds the rows one statement deletes. Default 5000.
	BatchSize int
	// StatementTimeout bounds each statement. Default 30s.
	StatementTimeout time.Duration
	// BatchPause: the longest jittered pause between full batches.
	BatchPause time.Duration
	Clock      clock.Clock
	Logger     hclog.Logger
	Metrics    *RetentionMetrics
	// Passes, when set, receives every pass's result; tests wait on it.
	Passes *testsignal.Signal[RetentionResult]
}

// WithDefaults returns c with its zero settings replaced by the defaults
// (a zero retention only when KeepCompleted or KeepFailed is not set).
func (c RetentionConfig) WithDefaults() RetentionConfig {
	if !c.KeepCompleted {
		c.RetainCompleted = cmp.Or(c.RetainCompleted, DefaultRetainCompleted)
	}
	if !c.KeepFailed {
		c.RetainFailed = cmp.Or(c.RetainFailed, DefaultRetainFailed)
	}
	c.Interval = cmp.Or(c.Interval, DefaultRetentionInterval)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultRetentionBatch)
	c.StatementTimeout = cmp.Or(c.StatementTimeout, DefaultStatementTimeout)
	c.BatchPause = cmp.Or(c.BatchPause, DefaultBatchPause)
	return c
}

// Validate reports the first bad setting, by its flag. It checks the
// settings as they are (use WithDefaults first for the defaults).
func (c RetentionConfig) Validate() error {
	switch {
	case c.RetainCompleted < 0:
		return fmt.Errorf("--retain-completed: must not be negative (0 keeps completed tasks forever), got %s", c.RetainCompleted)
	case c.RetainFailed < 0:
		return fmt.Errorf("--retain-failed: must not be negative (0 keeps failed, dead and cancelled tasks forever), got %s", c.RetainFailed)
	case c.Interval <= 0:
		return fmt.Errorf("--retention-interval: must be positive, got %s", c.Interval)
	case c.BatchSize < 1:
		return fmt.Errorf("--retention-batch: must be at least 1, got %d", c.BatchSize)
	case c.StatementTimeout < 0:
		return fmt.Errorf("retention StatementTimeout: must not be negative (0: the default), got %s", c.StatementTimeout)
	case c.BatchPause < 0:
		return fmt.Errorf("retention BatchPause: must not be negative, got %s", c.BatchPause)
	}
	return nil
}

// RetentionResult is what one pass did.
type RetentionResult struct {
	Started  time.Time
	Duration time.Duration
	// Deleted by state.
	Deleted map[string]int64
	// Statements run (batches of every state).
	Statements int
	// NotLeader: the fence holds a newer leader; the retainer stops.
	NotLeader bool
	Err       error
}

// Retainer deletes finished tasks after their retention period, for one
// leadership term.
type Retainer struct {
	cfg   RetentionConfig
	log   hclog.Logger
	clock clock.Clock
	m     *RetentionMetrics
}

// NewRetainer validates cfg and fills the defaults.
func NewRetainer(cfg RetentionConfig) (*Retainer, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Store == nil {
		return nil, errors.New("retainer: a store is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real()
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewRetentionMetrics(nil)
	}
	return &Retainer{cfg: cfg, log: cfg.Logger, clock: cfg.Clock, m: cfg.Metrics}, nil
}

// rules are the final states with their retention, in the order a pass
// deletes them.
func (r *Retainer) rules() []struct {
	state string
	keep  time.Duration
} {
	return []struct {
		state string
		keep  time.Duration
	}{
		{"completed", r.cfg.RetainCompleted},
		{"failed", r.cfg.RetainFailed},
		{"dead", r.cfg.RetainFailed},
		{"cancelled", r.cfg.RetainFailed},
	}
}

// Run deletes every interval until ctx ends or the fence holds a newer
// leader (store.ErrNotLeader).
func (r *Retainer) Run(ctx context.Context) error {
	if r.cfg.RetainCompleted == 0 && r.cfg.RetainFailed == 0 {
		r.log.Info("retention is off: finished tasks are kept forever")
		<-ctx.Done()
		return nil
	}
	r.log.Info("retention", "epoch", r.cfg.Epoch, "completed", r.cfg.RetainCompleted, "failed", r.cfg.RetainFailed,
		"interval", r.cfg.Interval, "batch", r.cfg.BatchSize)
	t := r.clock.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C():
		}
		res := r.runOnce(ctx)
		if res.NotLeader {
			return store.ErrNotLeader
		}
		t.Reset(r.cfg.Interval)
	}
}

func (r *Retainer) runOnce(ctx context.Context) RetentionResult {
	res := RetentionResult{Started: r.clock.Now(), Deleted: map[string]int64{}}
	res.Err = r.deleteAll(ctx, &res)
	res.Duration = r.clock.Now().Sub(res.Started)
	switch {
	case errors.Is(res.Err, store.ErrNotLeader):
		res.NotLeader = true
		r.log.Warn("the coordinator fence holds a newer leader; stopping", "epoch", r.cfg.Epoch)
	case res.Err != nil && ctx.Err() == nil:
		r.m.Errors.Inc()
		r.log.Error("retention pass failed", "error", res.Err, "duration", res.Duration)
	}
	var total int64
	for state, n := range res.Deleted {
		total += n
		r.m.Deleted.WithLabelValues(state).Add(float64(n))
	}
	if total > 0 {
		r.log.Info("deleted finished tasks", "deleted", res.Deleted, "statements", res.Statements, "duration", res.Duration)
	}
	r.cfg.Passes.Emit(res)
	return res
}

func (r *Retainer) deleteAll(ctx context.Context, res *RetentionResult) error {
	for _, rule := range r.rules() {
		if rule.keep == 0 {
			continue
		}
		for {
			sctx, cancel := context.WithTimeout(ctx, r.cfg.StatementTimeout)
			n, err := r.cfg.Store.DeleteFinished(sctx, r.cfg.Epoch, rule.state, rule.keep, r.cfg.BatchSize)
			cancel()
			res.Statements++
			if err != nil {
				return err
			}
			if n > 0 {
				res.Deleted[rule.state] += n
			}
			if n < int64(r.cfg.BatchSize) {
				break
			}
			if !clock.Pause(r.clock, r.cfg.BatchPause, ctx.Done()) {
				return nil
			}
		}
	}
	return nil
}

// RetentionMetrics are the retainer's metrics.
type RetentionMetrics struct {
	Deleted *prometheus.CounterVec
	Errors  prometheus.Counter
}

// NewRetentionMetrics creates the metrics and registers them with reg
// (nil: not registered).
func NewRetentionMetrics(reg prometheus.Registerer) *RetentionMetrics {
	f := promauto.With(reg)
	m := &RetentionMetrics{
		Deleted: f.NewCounterVec(prometheus.CounterOpts{Name: "shardrun_retention_deleted_total",
			Help: "Finished tasks deleted after their retention period, by state."}, []string{"state"}),
		Errors: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_retention_errors_total",
			Help: "Retention passes that failed."}),
	}
	for _, st := range []string{"completed", "failed", "dead", "cancelled"} {
		m.Deleted.WithLabelValues(st)
	}
	return m
}
