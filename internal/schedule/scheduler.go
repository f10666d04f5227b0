package schedule

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/store"
)

// TickStore is what the Scheduler needs from the database (store.Store).
type TickStore interface {
	EnqueueTicks(ctx context.Context, epoch int64, limit int,
		plan func(d store.Due, now, termStart time.Time) (store.TickPlan, error)) (store.TickResult, error)
}

// How the scheduler works; no flag changes these.
const (
	// maxWait bounds the sleep between passes: schedules created on
	// another coordinator are seen within it (their ticks are enqueued
	// late, never skipped, since they come due during the term).
	maxWait = 5 * time.Second
	// batchSize is the schedules one transaction handles.
	batchSize = 100
	// batchTimeout bounds one batch's transaction.
	batchTimeout = 10 * time.Second
	// batchPause is the longest jittered pause between full batches.
	batchPause = 50 * time.Millisecond
)

// Result is what one pass did (the Detail of its leader.Result).
type Result struct {
	// TermStart is the database time the leader raised the coordinator
	// fence (zero until a pass succeeded): ticks before it were missed
	// while no leader ran.
	TermStart time.Time
	// Due schedules handled, tasks Enqueued, ticks Skipped (by the
	// missed-tick policy, and SkippedUnfinished of them while the last
	// tick's task was unfinished), Duplicates refused by the unique index
	// (never expected).
	Due, Enqueued, Skipped, SkippedUnfinished, Duplicates int
	// NextIn is how long until the earliest next tick (0: none, or due).
	NextIn time.Duration
}

// Scheduler enqueues the due ticks of every schedule (a leader.Service).
// It sleeps until the earliest next tick, at most MaxWait, or until woken
// (Wake: a schedule was created on this coordinator).
type Scheduler struct {
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

// NewScheduler returns the scheduler and registers its metrics with reg
// (nil: not registered). prep is the task client's configuration: every
// tick's task is prepared as every enqueued task is.
func NewScheduler(st TickStore, prep client.Config, reg prometheus.Registerer) (*Scheduler, error) {
	prep = prep.WithDefaults()
	if err := prep.Validate(); err != nil {
		return nil, fmt.Errorf("scheduler: %w", err)
	}
	if st == nil {
		return nil, errors.New("scheduler: a store is required")
	}
	return &Scheduler{store: st, prep: prep, wake: wake.New(), m: newMetrics(reg)}, nil
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
	next := maxWait
	if err == nil {
		s.m.enqueued.Add(float64(r.Enqueued))
		s.m.skipped.WithLabelValues(skippedMissed).Add(float64(r.Skipped - r.SkippedUnfinished))
		s.m.skipped.WithLabelValues(skippedUnfinished).Add(float64(r.SkippedUnfinished))
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
		bctx, cancel := context.WithTimeout(ctx, batchTimeout)
		res, err := s.store.EnqueueTicks(bctx, s.term.Epoch, batchSize, s.plan)
		cancel()
		p.Statements++
		if err != nil {
			return err
		}
		s.termStart = res.TermStart
		r.Due += res.Schedules
		r.Enqueued += res.Enqueued
		r.Skipped += res.Skipped
		r.SkippedUnfinished += res.SkippedUnfinished
		r.Duplicates += res.Duplicates
		r.NextIn = 0
		if !res.NextDue.IsZero() && res.NextDue.After(res.Now) {
			r.NextIn = res.NextDue.Sub(res.Now)
		}
		if res.Schedules < batchSize && r.NextIn > 0 || res.Schedules == 0 {
			return nil
		}
		// More are due: a jittered pause lets other statements through.
		if !clock.Pause(s.term.Clock, batchPause, ctx.Done()) {
			return ctx.Err()
		}
	}
}

// plan is the missed-tick policy applied to one due schedule (see the
// package comment), then its skip while unfinished. The term starts when
// the leader raised the coordinator fence, whenever its first pass
// succeeds: ticks that came due while its passes failed (the database was
// down) came due in its term.
func (s *Scheduler) plan(d store.Due, now, termStart time.Time) (store.TickPlan, error) {
	sc := d.Schedule
	timer, err := TimerOf(sc)
	if err != nil {
		// A stored schedule that no longer compiles (its time zone left the
		// zone database) must not block the others: it stops ticking.
		s.errors()
		s.term.Log.Error("schedule does not compile; it stops ticking", "schedule", sc.Name, "error", err)
		return store.TickPlan{Next: Never}, nil
	}
	ticks, next, skipped := Plan(timer, sc.NextTick, now, termStart)
	if skipped > 0 {
		s.term.Log.Warn("ticks missed while no leader ran were skipped; enqueued the latest", "schedule", sc.Name,
			"skipped", skipped, "from", sc.NextTick, "term_start", termStart)
	}
	p := store.TickPlan{Next: next, Skipped: skipped}
	if sc.SkipWhileUnfinished {
		ticks, p.SkippedUnfinished = SkipWhileUnfinished(ticks, d.LastTaskUnfinished)
		p.Skipped += p.SkippedUnfinished
		if p.SkippedUnfinished > 0 {
			s.term.Log.Debug("ticks skipped while the last tick's task is unfinished", "schedule", sc.Name,
				"skipped", p.SkippedUnfinished, "task_id", sc.LastTaskID, "enqueued", len(ticks))
		}
	}
	for _, at := range ticks {
		in, err := s.prep.Prepare(sc.Task, now)
		if err != nil {
			s.errors()
			s.term.Log.Error("the task of a schedule is invalid; it stops ticking", "schedule", sc.Name, "error", err)
			return store.TickPlan{Next: Never}, nil
		}
		p.Ticks = append(p.Ticks, store.Tick{At: at, Task: in})
	}
	return p, nil
}

// SkipWhileUnfinished applies a schedule's skip while unfinished to the
// ticks Plan would enqueue: none while the last tick's task is unfinished,
// and otherwise the first only, whose task is then unfinished when the
// later ones come due. It returns the ticks to enqueue and how many it
// skipped.
func SkipWhileUnfinished(ticks []time.Time, lastUnfinished bool) ([]time.Time, int64) {
	keep := min(len(ticks), 1)
	if lastUnfinished {
		keep = 0
	}
	return ticks[:keep], int64(len(ticks) - keep)
}

// metrics are the scheduler's own metrics; its errors counter is the
// loop's.
type metrics struct {
	enqueued prometheus.Counter
	skipped  *prometheus.CounterVec
}

// The reasons of shardrun_schedule_ticks_skipped_total.
const (
	// skippedMissed: missed while no leader ran (the latest is enqueued).
	skippedMissed = "missed"
	// skippedUnfinished: skipped while the last tick's task was unfinished.
	skippedUnfinished = "unfinished"
)

func newMetrics(reg prometheus.Registerer) *metrics {
	f := promauto.With(reg)
	m := &metrics{
		enqueued: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_schedule_ticks_enqueued_total",
			Help: "Schedule ticks whose task was enqueued."}),
		skipped: f.NewCounterVec(prometheus.CounterOpts{Name: "shardrun_schedule_ticks_skipped_total",
			Help: "Schedule ticks not enqueued, by reason: missed while no leader ran (only the latest missed tick is enqueued), " +
				"or unfinished (the schedule skips ticks while its last tick's task is unfinished)."}, []string{"reason"}),
	}
	for _, reason := range []string{skippedMissed, skippedUnfinished} {
		m.skipped.WithLabelValues(reason)
	}
	return m
}
