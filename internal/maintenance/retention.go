// Package maintenance holds services the leader coordinator runs besides
// the sweeps, each fenced by the coordinator fence like them: retention
// (Retainer deletes finished tasks after their state's retention period)
// and the unhandled-kind rule (Reaper fails ready tasks of kinds no
// attached runner handles, when --unhandled-after is set). Each is a
// leader.Service built from a Config of settings; its statements run in
// bounded batches with a timeout each and a jittered pause between full
// batches (leader.Pass.Batches).
package maintenance

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/tasks"
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
)

// The statements of both services: no flag changes these.
var batching = leader.Batch{
	// Timeout bounds one statement.
	Timeout: 30 * time.Second,
	// Pause is the longest pause between full batches; each pause is
	// uniform in [Pause/2, Pause).
	Pause: 100 * time.Millisecond,
}

// RetentionConfig is the Retainer's settings.
type RetentionConfig struct {
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
}

// Off reports whether c keeps every finished task forever: the
// coordinator then runs no Retainer.
func (c RetentionConfig) Off() bool { return c.RetainCompleted == 0 && c.RetainFailed == 0 }

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
	}
	return nil
}

// RetentionResult is what one pass did (the Detail of its leader.Result):
// the tasks deleted, by state.
type RetentionResult struct {
	Deleted map[string]int64
}

// Retainer deletes finished tasks after their retention period (a
// leader.Service).
type Retainer struct {
	cfg   RetentionConfig
	store RetentionStore
	term  leader.Term
	// deleted counts shardrun_retention_deleted_total{state}.
	deleted *prometheus.CounterVec
}

// NewRetainer fills the defaults of cfg, validates it, and registers the
// retainer's metrics with reg (nil: not registered).
func NewRetainer(st RetentionStore, cfg RetentionConfig, reg prometheus.Registerer) (*Retainer, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if st == nil {
		return nil, errors.New("retainer: a store is required")
	}
	r := &Retainer{cfg: cfg, store: st, deleted: promauto.With(reg).NewCounterVec(prometheus.CounterOpts{
		Name: "shardrun_retention_deleted_total",
		Help: "Finished tasks deleted after their retention period, by state."}, []string{"state"})}
	for _, st := range tasks.FinalStates {
		r.deleted.WithLabelValues(string(st))
	}
	return r, nil
}

// Name is "retention" (shardrun_retention_errors_total).
func (r *Retainer) Name() string { return "retention" }

// Begin starts a term.
func (r *Retainer) Begin(t leader.Term) {
	r.term = t
	t.Log.Info("retention", "epoch", t.Epoch, "completed", r.cfg.RetainCompleted, "failed", r.cfg.RetainFailed,
		"interval", r.cfg.Interval, "batch", r.cfg.BatchSize)
}

// Pass deletes, state by state, the finished tasks past their retention.
func (r *Retainer) Pass(ctx context.Context, p *leader.Pass) leader.Result {
	res := RetentionResult{Deleted: map[string]int64{}}
	batch := batching
	batch.Size = r.cfg.BatchSize
	var err error
	for _, st := range tasks.FinalStates {
		keep := r.cfg.RetainFailed
		if st == tasks.Completed {
			keep = r.cfg.RetainCompleted
		}
		if keep == 0 {
			continue
		}
		var n int64
		n, err = p.Batches(ctx, batch, func(ctx context.Context, limit int) (int64, error) {
			return r.store.DeleteFinished(ctx, r.term.Epoch, string(st), keep, limit)
		}, nil)
		if n > 0 {
			res.Deleted[string(st)] = n
			r.deleted.WithLabelValues(string(st)).Add(float64(n))
		}
		if err != nil || ctx.Err() != nil {
			break
		}
	}
	if len(res.Deleted) > 0 {
		r.term.Log.Info("deleted finished tasks", "deleted", res.Deleted, "statements", p.Statements,
			"duration", r.term.Clock.Now().Sub(p.Started))
	}
	return leader.Result{Next: r.cfg.Interval, Detail: res, Err: err}
}
