package maintenance

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/leader"
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

// ReaperConfig is the Reaper's settings.
type ReaperConfig struct {
	// After is --unhandled-after: a ready task of a kind that no attached
	// runner has handled for this long, due for at least this long, is
	// failed. Required (the coordinator runs no Reaper without it).
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
	// Unhandled are the ready tasks of kinds no attached runner handles,
	// as the pass found them (before failing any).
	Unhandled []store.KindCount
	// Failed by kind.
	Failed map[string]int64
}

// Reaper fails ready tasks of kinds nobody handles (a leader.Service). A
// kind counts as unhandled from the first pass of the term that found it
// so, until a pass finds an attached runner handling it or no ready task
// of it: a rolling restart of every runner that handles a kind does not
// fail its tasks, unless it outlasts After.
type Reaper struct {
	cfg   ReaperConfig
	store UnhandledStore
	// kinds returns the kinds the attached runners handle (from etcd).
	kinds  func(ctx context.Context) (map[string]bool, error)
	failed prometheus.Counter
	term   leader.Term
	since  map[string]time.Time
}

// NewReaper fills the defaults of cfg, validates it, and registers the
// reaper's metrics with reg (nil: not registered). kinds returns the kinds
// the attached runners handle.
func NewReaper(st UnhandledStore, kinds func(ctx context.Context) (map[string]bool, error), cfg ReaperConfig, reg prometheus.Registerer) (*Reaper, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if st == nil || kinds == nil {
		return nil, errors.New("reaper: a store and the runners' kinds are required")
	}
	return &Reaper{cfg: cfg, store: st, kinds: kinds, failed: promauto.With(reg).NewCounter(prometheus.CounterOpts{
		Name: "shardrun_unhandled_failed_total",
		Help: "Ready tasks failed because no attached runner handled their kind for --unhandled-after."})}, nil
}

// Name is "unhandled" (shardrun_unhandled_errors_total).
func (r *Reaper) Name() string { return "unhandled" }

// Begin starts a term: kinds count as unhandled from this term's passes.
func (r *Reaper) Begin(t leader.Term) { r.term, r.since = t, map[string]time.Time{} }

// Pass fails the ready tasks of the kinds unhandled for long enough.
func (r *Reaper) Pass(ctx context.Context, p *leader.Pass) leader.Result {
	res := ReaperResult{Failed: map[string]int64{}}
	err := r.reap(ctx, p, &res)
	for kind, n := range res.Failed {
		r.failed.Add(float64(n))
		r.term.Log.Warn("failed ready tasks of a kind no attached runner handles", "kind", kind, "failed", n,
			"unhandled_after", r.cfg.After)
	}
	return leader.Result{Next: r.cfg.Interval, Detail: res, Err: err}
}

func (r *Reaper) reap(ctx context.Context, p *leader.Pass, res *ReaperResult) error {
	qctx, cancel := context.WithTimeout(ctx, batching.Timeout)
	defer cancel()
	handled, err := r.kinds(qctx)
	if err != nil {
		// Without the runners' kinds nothing can be judged unhandled.
		return fmt.Errorf("reading the kinds the runners handle: %w", err)
	}
	res.Unhandled, err = r.store.ReadyKindsExcept(qctx, slices.Sorted(maps.Keys(handled)))
	p.Statements++
	if err != nil {
		return fmt.Errorf("reading the kinds of ready tasks: %w", err)
	}
	now := r.term.Clock.Now()
	seen := map[string]bool{}
	for _, kc := range res.Unhandled {
		seen[kc.Kind] = true
		if _, ok := r.since[kc.Kind]; !ok {
			r.since[kc.Kind] = now
		}
	}
	maps.DeleteFunc(r.since, func(kind string, _ time.Time) bool { return !seen[kind] })
	batch := batching
	batch.Size = r.cfg.BatchSize
	for _, kc := range res.Unhandled {
		if now.Sub(r.since[kc.Kind]) < r.cfg.After {
			continue
		}
		reason := fmt.Sprintf("no attached runner handles kind %q: none did for %s (--unhandled-after %s)",
			kc.Kind, now.Sub(r.since[kc.Kind]).Round(time.Second), r.cfg.After)
		n, err := p.Batches(ctx, batch, func(ctx context.Context, limit int) (int64, error) {
			return r.store.FailUnhandled(ctx, r.term.Epoch, kc.Kind, r.cfg.After, limit, reason)
		}, nil)
		if n > 0 {
			res.Failed[kc.Kind] = n
		}
		if err != nil || ctx.Err() != nil {
			return err
		}
	}
	return nil
}
