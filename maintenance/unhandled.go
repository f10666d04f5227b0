package maintenance

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/store"
)

// UnhandledStore is what the Reaper needs from the database (store.Store).
type UnhandledStore interface {
	ReadyKindsExcept(ctx context.Context, handled []string) ([]store.KindCount, error)
	FailUnhandled(ctx context.Context, epoch int64, kind string, dueFor time.Duration, limit int, reason string) (int64, error)
}

// Defaults of ReaperConfig.
const (
	DefaultReaperInterval = 30 * time.Second
	DefaultReaperBatch    = 1000
)

// ReaperConfig configures a Reaper.
type ReaperConfig struct {
	Store UnhandledStore
	// Epoch is the leadership epoch the writes are fenced with.
	Epoch int64
	// After is --unhandled-after: a ready task of a kind that no attached
	// runner has handled for this long, due for at least this long, is
	// failed. Required (the coordinator runs no Reaper without it).
	After time.Duration
	// Kinds returns the kinds the attached runners handle (from etcd).
	Kinds func(ctx context.Context) (map[string]bool, error)
	// Interval between passes. Default 30s, at most After/2.
	Interval         time.Duration
	BatchSize        int
	StatementTimeout time.Duration
	BatchPause       time.Duration
	Clock            clock.Clock
	Logger           hclog.Logger
	Metrics          *ReaperMetrics
	// Passes, when set, receives every pass's result; tests wait on it.
	Passes *testsignal.Signal[ReaperResult]
}

// WithDefaults returns c with its zero settings replaced by the defaults.
func (c ReaperConfig) WithDefaults() ReaperConfig {
	if c.Interval == 0 {
		c.Interval = min(DefaultReaperInterval, max(c.After/2, time.Millisecond))
	}
	c.BatchSize = cmp.Or(c.BatchSize, DefaultReaperBatch)
	c.StatementTimeout = cmp.Or(c.StatementTimeout, DefaultStatementTimeout)
	c.BatchPause = cmp.Or(c.BatchPause, DefaultBatchPause)
	return c
}

// Validate reports the first bad setting, by its flag. It checks the
// settings as they are (use WithDefaults first for the defaults).
func (c ReaperConfig) Validate() error {
	switch {
	case c.After <= 0:
		return fmt.Errorf("--unhandled-after: must be positive (or not given), got %s", c.After)
	case c.Interval < 0 || c.BatchSize < 0 || c.StatementTimeout < 0 || c.BatchPause < 0:
		return fmt.Errorf("reaper settings must not be negative (0: the default), got %+v", c)
	}
	return nil
}

// ReaperResult is what one pass did.
type ReaperResult struct {
	Started  time.Time
	Duration time.Duration
	// Unhandled are the ready tasks of kinds no attached runner handles,
	// as the pass found them (before failing any).
	Unhandled []store.KindCount
	// Failed by kind.
	Failed     map[string]int64
	Statements int
	NotLeader  bool
	Err        error
}

// Reaper fails ready tasks of kinds nobody handles, for one leadership
// term. A kind counts as unhandled from the first pass of the term that
// found it so, until a pass finds an attached runner handling it or no
// ready task of it: a rolling restart of every runner that handles a kind
// does not fail its tasks, unless it outlasts After.
type Reaper struct {
	cfg   ReaperConfig
	log   hclog.Logger
	clock clock.Clock
	m     *ReaperMetrics
	since map[string]time.Time
}

// NewReaper validates cfg and fills the defaults.
func NewReaper(cfg ReaperConfig) (*Reaper, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Store == nil || cfg.Kinds == nil {
		return nil, errors.New("reaper: a store and the runners' kinds are required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real()
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewReaperMetrics(nil)
	}
	return &Reaper{cfg: cfg, log: cfg.Logger, clock: cfg.Clock, m: cfg.Metrics, since: map[string]time.Time{}}, nil
}

// Run reaps every interval until ctx ends or the fence holds a newer
// leader (store.ErrNotLeader).
func (r *Reaper) Run(ctx context.Context) error {
	t := r.clock.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C():
		}
		if res := r.runOnce(ctx); res.NotLeader {
			return store.ErrNotLeader
		}
		t.Reset(r.cfg.Interval)
	}
}

func (r *Reaper) runOnce(ctx context.Context) ReaperResult {
	res := ReaperResult{Started: r.clock.Now(), Failed: map[string]int64{}}
	res.Err = r.reap(ctx, &res)
	res.Duration = r.clock.Now().Sub(res.Started)
	switch {
	case errors.Is(res.Err, store.ErrNotLeader):
		res.NotLeader = true
		r.log.Warn("the coordinator fence holds a newer leader; stopping", "epoch", r.cfg.Epoch)
	case res.Err != nil && ctx.Err() == nil:
		r.m.Errors.Inc()
		r.log.Error("failing unhandled tasks failed", "error", res.Err)
	}
	for kind, n := range res.Failed {
		r.m.Failed.Add(float64(n))
		r.log.Warn("failed ready tasks of a kind no attached runner handles", "kind", kind, "failed", n,
			"unhandled_after", r.cfg.After)
	}
	r.cfg.Passes.Emit(res)
	return res
}

func (r *Reaper) reap(ctx context.Context, res *ReaperResult) error {
	qctx, cancel := context.WithTimeout(ctx, r.cfg.StatementTimeout)
	defer cancel()
	handled, err := r.cfg.Kinds(qctx)
	if err != nil {
		// Without the runners' kinds nothing can be judged unhandled.
		return fmt.Errorf("reading the kinds the runners handle: %w", err)
	}
	res.Unhandled, err = r.cfg.Store.ReadyKindsExcept(qctx, slices.Sorted(maps.Keys(handled)))
	if err != nil {
		return err
	}
	now := r.clock.Now()
	seen := map[string]bool{}
	for _, kc := range res.Unhandled {
		seen[kc.Kind] = true
		if _, ok := r.since[kc.Kind]; !ok {
			r.since[kc.Kind] = now
		}
	}
	maps.DeleteFunc(r.since, func(kind string, _ time.Time) bool { return !seen[kind] })
	for _, kc := range res.Unhandled {
		if now.Sub(r.since[kc.Kind]) < r.cfg.After {
			continue
		}
		reason := fmt.Sprintf("no attached runner handles kind %q: none did for %s (--unhandled-after %s)",
			kc.Kind, now.Sub(r.since[kc.Kind]).Round(time.Second), r.cfg.After)
		for {
			sctx, cancel := context.WithTimeout(ctx, r.cfg.StatementTimeout)
			n, err := r.cfg.Store.FailUnhandled(sctx, r.cfg.Epoch, kc.Kind, r.cfg.After, r.cfg.BatchSize, reason)
			cancel()
			res.Statements++
			if err != nil {
				return err
			}
			if n > 0 {
				res.Failed[kc.Kind] += n
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

// ReaperMetrics are the reaper's metrics.
type ReaperMetrics struct {
	Failed prometheus.Counter
	Errors prometheus.Counter
}

// NewReaperMetrics creates the metrics and registers them with reg (nil:
// not registered).
func NewReaperMetrics(reg prometheus.Registerer) *ReaperMetrics {
	f := promauto.With(reg)
	return &ReaperMetrics{
		Failed: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_unhandled_failed_total",
			Help: "Ready tasks failed because no attached runner handled their kind for --unhandled-after."}),
		Errors: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_unhandled_errors_total",
			Help: "Unhandled-kind passes that failed."}),
	}
}
