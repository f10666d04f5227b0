package store

// The leader's statements through the router: each pass runs at every
// database, under that database's coordinator fence (raised at each by
// RaiseLeaderFence), its counts summed. A database that fails does not
// stop the pass at the others: its error is returned, joined and naming
// it, with the others' counts.
//
// The schedules live in the first database (the catalog); each tick's
// task is inserted at its shard's database.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/shardrun/shardrun/tasks"
)

// RaiseLeaderFence is Store.RaiseLeaderFence at every database: it
// reports whether every database's fence now holds epoch (false: a newer
// leader exists somewhere). A database that could not be reached is in
// the error; its fence is raised when the leader tries again.
func (r *Router) RaiseLeaderFence(ctx context.Context, leader string, epoch int64) (bool, error) {
	if r.one != nil {
		return r.one.RaiseLeaderFence(ctx, leader, epoch)
	}
	oks, err := gather(r, ctx, r.names, func(st *Store) (bool, error) { return st.RaiseLeaderFence(ctx, leader, epoch) })
	all := true
	for k, ok := range oks {
		if !ok && r.usable(r.names[k]) {
			all = false
		}
	}
	return all && err == nil, err
}

// Uptime is the least uptime of the databases that answered (the stale
// rule waits for the youngest server); an error only when none did.
func (r *Router) Uptime(ctx context.Context) (time.Duration, error) {
	if r.one != nil {
		return r.one.Uptime(ctx)
	}
	ups, err := gather(r, ctx, r.names, func(st *Store) (time.Duration, error) { return st.Uptime(ctx) })
	least := time.Duration(-1)
	for k, up := range ups {
		if r.usable(r.names[k]) && up > 0 && (least < 0 || up < least) {
			least = up
		}
	}
	if least < 0 {
		return 0, fmt.Errorf("reading the databases' uptime: %w", cmpErr(err, errors.New("no database answered")))
	}
	return least, nil
}

func cmpErr(err, otherwise error) error {
	if err != nil {
		return err
	}
	return otherwise
}

// leaderPass runs f at every database and sums what it returns.
func leaderPass(r *Router, ctx context.Context, f func(st *Store) (int64, error)) (int64, error) {
	ns, err := gather(r, ctx, r.names, f)
	var total int64
	for _, n := range ns {
		total += n
	}
	return total, err
}

// SweepDeadlines is Store.SweepDeadlines at every database, summed (each
// database's batch bounded by limit).
func (r *Router) SweepDeadlines(ctx context.Context, epoch int64, runningGrace time.Duration, limit int) (int64, error) {
	if r.one != nil {
		return r.one.SweepDeadlines(ctx, epoch, runningGrace, limit)
	}
	return leaderPass(r, ctx, func(st *Store) (int64, error) { return st.SweepDeadlines(ctx, epoch, runningGrace, limit) })
}

// SweepStale is Store.SweepStale at every database, summed.
func (r *Router) SweepStale(ctx context.Context, epoch int64, threshold time.Duration, limit int, b Backoff) (requeued, dead int64, err error) {
	if r.one != nil {
		return r.one.SweepStale(ctx, epoch, threshold, limit, b)
	}
	type counts struct{ requeued, dead int64 }
	cs, err := gather(r, ctx, r.names, func(st *Store) (counts, error) {
		q, d, err := st.SweepStale(ctx, epoch, threshold, limit, b)
		return counts{q, d}, err
	})
	for _, c := range cs {
		requeued += c.requeued
		dead += c.dead
	}
	return requeued, dead, err
}

// FailUnrunnable is Store.FailUnrunnable at every database, summed.
func (r *Router) FailUnrunnable(ctx context.Context, epoch int64, c tasks.Class, dueFor time.Duration, limit int, reason string) (int64, error) {
	if r.one != nil {
		return r.one.FailUnrunnable(ctx, epoch, c, dueFor, limit, reason)
	}
	return leaderPass(r, ctx, func(st *Store) (int64, error) { return st.FailUnrunnable(ctx, epoch, c, dueFor, limit, reason) })
}

// DeleteFinished is Store.DeleteFinished at every database, summed.
func (r *Router) DeleteFinished(ctx context.Context, epoch int64, state string, olderThan time.Duration, limit int) (int64, error) {
	if r.one != nil {
		return r.one.DeleteFinished(ctx, epoch, state, olderThan, limit)
	}
	return leaderPass(r, ctx, func(st *Store) (int64, error) { return st.DeleteFinished(ctx, epoch, state, olderThan, limit) })
}

// ---- schedules: the catalog in the first database ----

// CreateSchedule is Store.CreateSchedule at the catalog.
func (r *Router) CreateSchedule(ctx context.Context, prepare func(now time.Time) (Schedule, error)) (Schedule, error) {
	return r.Catalog().CreateSchedule(ctx, prepare)
}

// UpsertSchedule is Store.UpsertSchedule at the catalog.
func (r *Router) UpsertSchedule(ctx context.Context, prepare func(now time.Time) (Schedule, error)) (Schedule, Upserted, error) {
	return r.Catalog().UpsertSchedule(ctx, prepare)
}

// ListSchedules is Store.ListSchedules at the catalog.
func (r *Router) ListSchedules(ctx context.Context, after string, limit int) ([]Schedule, error) {
	return r.Catalog().ListSchedules(ctx, after, limit)
}

// DeleteSchedule is Store.DeleteSchedule at the catalog.
func (r *Router) DeleteSchedule(ctx context.Context, name string) (bool, error) {
	return r.Catalog().DeleteSchedule(ctx, name)
}

// EnqueueTicks is Store.EnqueueTicks at the catalog, each tick's task
// inserted at its shard's database: the ticks of other databases each in
// a transaction of that database under its coordinator fence, committed
// before the catalog's (a batch tried again is refused there by the
// unique (schedule, tick) index, as in the catalog, provided the tick's
// task has the same shard: a schedule's task with a Key). A schedule that
// skips ticks while its last tick's task is unfinished finds that task
// in any database.
func (r *Router) EnqueueTicks(ctx context.Context, epoch int64, limit int,
	plan func(d Due, now, termStart time.Time) (TickPlan, error)) (TickResult, error) {
	if r.one != nil {
		return r.one.EnqueueTicks(ctx, epoch, limit, plan)
	}
	catalog := r.Catalog()
	catalogSlot := 0
	wrapped := func(d Due, now, termStart time.Time) (TickPlan, error) {
		if d.SkipWhileUnfinished && !d.LastTaskUnfinished && d.LastTaskID != nil && SlotOf(*d.LastTaskID) != catalogSlot {
			t, err := r.Get(ctx, *d.LastTaskID)
			switch {
			case err == nil:
				d.LastTaskUnfinished = !t.State.Terminal()
			case !errors.Is(err, ErrNotFound):
				return TickPlan{}, err
			}
		}
		return plan(d, now, termStart)
	}
	return catalog.enqueueTicks(ctx, epoch, limit, wrapped, r.Of)
}
