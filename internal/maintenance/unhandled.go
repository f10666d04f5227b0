package maintenance

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// UnhandledStore is what the Reaper needs from the database (store.Store).
type UnhandledStore interface {
	ReadyUnrunnable(ctx context.Context, runnable []tasks.Class) ([]store.ClassCount, error)
	FailUnrunnable(ctx context.Context, epoch int64, c tasks.Class, dueFor time.Duration, limit int, reason string) (int64, error)
}

// Defaults of ReaperConfig.
const (
	DefaultReaperInterval = 30 * time.Second
	DefaultReaperBatch    = 1000
)

// ReaperConfig is the Reaper's settings.
type ReaperConfig struct {
	// After is --unhandled-after: a ready task of a queue and kind that no
	// attached runner has served and handled for this long, due for at
	// least this long, is failed. Required (the coordinator runs no Reaper
	// without it).
	After time.Duration
	// Interval between passes. Default 30s, at most After/2.
	Interval time.Duration
	// BatchSize bounds the rows one statement fails. Default 1000.
	BatchSize int
}

// WithDefaults returns c with its zero settings replaced by the defaults.
func (c ReaperConfig) WithDefaults() ReaperConfig {
	if c.Interval == 0 {
		c.Interval = min(DefaultReaperInterval, max(c.After/2, time.Millisecond))
	}
	c.BatchSize = cmp.Or(c.BatchSize, DefaultReaperBatch)
	return c
}

// Validate reports the first bad setting, by its flag. It checks the
// settings as they are (use WithDefaults first for the defaults).
func (c ReaperConfig) Validate() error {
	switch {
	case c.After <= 0:
		return fmt.Errorf("--unhandled-after: must be positive (or not given), got %s", c.After)
	case c.Interval < 0 || c.BatchSize < 0:
		return fmt.Errorf("reaper settings must not be negative (0: the default), got %+v", c)
	}
	return nil
}

// ReaperResult is what one pass did (the Detail of its leader.Result).
type ReaperResult struct {
	// Unrunnable are the ready tasks no attached runner can run, by queue
	// and kind, as the pass found them (before failing any).
	Unrunnable []store.ClassCount
	// Failed by queue and kind.
	Failed map[tasks.Class]int64
}

// Reaper fails ready tasks that no attached runner can run (a
// leader.Service): of a queue no attached runner serves, or a kind none of
// the runners serving the queue handles. A class counts as unrunnable from
// the first pass of the term that found it so, until a pass finds an
// attached runner that can run it or no ready task of it: a rolling
// restart of every runner that can run a class does not fail its tasks,
// unless it outlasts After.
type Reaper struct {
	cfg   ReaperConfig
	store UnhandledStore
	// runnable returns the classes the attached runners can run (from etcd).
	runnable func(ctx context.Context) (map[tasks.Class]bool, error)
	failed   prometheus.Counter
	term     leader.Term
	since    map[tasks.Class]time.Time
}

// NewReaper fills the defaults of cfg, validates it, and registers the
// reaper's metrics with reg (nil: not registered). runnable returns the
// classes the attached runners can run.
func NewReaper(st UnhandledStore, runnable func(ctx context.Context) (map[tasks.Class]bool, error), cfg ReaperConfig, reg prometheus.Registerer) (*Reaper, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if st == nil || runnable == nil {
		return nil, errors.New("reaper: a store and the runners' capabilities are required")
	}
	return &Reaper{cfg: cfg, store: st, runnable: runnable, failed: promauto.With(reg).NewCounter(prometheus.CounterOpts{
		Name: "shardrun_unrunnable_failed_total",
		Help: "Ready tasks failed because no attached runner could run them (served their queue and handled their kind) for --unhandled-after."})}, nil
}

// Name is "unhandled" (shardrun_unhandled_errors_total).
func (r *Reaper) Name() string { return "unhandled" }

// Begin starts a term: classes count as unrunnable from this term's passes.
func (r *Reaper) Begin(t leader.Term) { r.term, r.since = t, map[tasks.Class]time.Time{} }

// Pass fails the ready tasks of the classes unrunnable for long enough.
func (r *Reaper) Pass(ctx context.Context, p *leader.Pass) leader.Result {
	res := ReaperResult{Failed: map[tasks.Class]int64{}}
	err := r.reap(ctx, p, &res)
	for c, n := range res.Failed {
		r.failed.Add(float64(n))
		r.term.Log.Warn("failed ready tasks no attached runner can run", "queue", c.Queue, "kind", c.Kind, "failed", n,
			"unhandled_after", r.cfg.After)
	}
	return leader.Result{Next: r.cfg.Interval, Detail: res, Err: err}
}

func (r *Reaper) reap(ctx context.Context, p *leader.Pass, res *ReaperResult) error {
	qctx, cancel := context.WithTimeout(ctx, batching.Timeout)
	defer cancel()
	runnable, err := r.runnable(qctx)
	if err != nil {
		// Without the runners' capabilities nothing can be judged unrunnable.
		return fmt.Errorf("reading what the runners can run: %w", err)
	}
	res.Unrunnable, err = r.store.ReadyUnrunnable(qctx, sortedClasses(runnable))
	p.Statements++
	if err != nil {
		return fmt.Errorf("reading the classes of ready tasks: %w", err)
	}
	now := r.term.Clock.Now()
	seen := map[tasks.Class]bool{}
	for _, cc := range res.Unrunnable {
		seen[cc.Class] = true
		if _, ok := r.since[cc.Class]; !ok {
			r.since[cc.Class] = now
		}
	}
	maps.DeleteFunc(r.since, func(c tasks.Class, _ time.Time) bool { return !seen[c] })
	batch := batching
	batch.Size = r.cfg.BatchSize
	for _, cc := range res.Unrunnable {
		if now.Sub(r.since[cc.Class]) < r.cfg.After {
			continue
		}
		reason := fmt.Sprintf("no attached runner serves queue %q with a handler of kind %q: none did for %s (--unhandled-after %s)",
			cc.Queue, cc.Kind, now.Sub(r.since[cc.Class]).Round(time.Second), r.cfg.After)
		n, err := p.Batches(ctx, batch, func(ctx context.Context, limit int) (int64, error) {
			return r.store.FailUnrunnable(ctx, r.term.Epoch, cc.Class, r.cfg.After, limit, reason)
		}, nil)
		if n > 0 {
			res.Failed[cc.Class] = n
		}
		if err != nil || ctx.Err() != nil {
			return err
		}
	}
	return nil
}

// sortedClasses lists the classes of set in queue and kind order.
func sortedClasses(set map[tasks.Class]bool) []tasks.Class {
	out := slices.Collect(maps.Keys(set))
	slices.SortFunc(out, func(a, b tasks.Class) int {
		return cmp.Or(strings.Compare(a.Queue, b.Queue), strings.Compare(a.Kind, b.Kind))
	})
	return out
}
