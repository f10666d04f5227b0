package store

// The producers' and operators' statements through the router: enqueue
// by the task's shard (a batch split by database, one transaction each;
// a producer's transaction must be on the task's database), reads merged
// across databases (listings in id order with the id as the cursor,
// counts summed, queues merged), operations by the task's database.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// Enqueue is Store.Enqueue at the database of the task's shard.
func (r *Router) Enqueue(ctx context.Context, in Insert) (int64, error) {
	e, err := r.EnqueueIn(ctx, nil, in)
	return e.ID, err
}

// EnqueueIn is Store.EnqueueIn at the database of the task's shard. A
// database that refuses the insert because it no longer holds the shard
// (SQLSTATE SR001: the router's map was stale) makes the router re-read
// the map (OnStale) and insert at the shard's database, a few times at
// most.
//
// tx, a producer's transaction, must be on the task's database (which
// database a transaction is on is read from the database once per
// connection): on another database the task is refused with an error
// naming both (ErrWrongDatabase), and never inserted there. A refusal
// with SR001 inside tx re-reads the map and returns the error: retry the
// transaction at the shard's database.
func (r *Router) EnqueueIn(ctx context.Context, tx pgx.Tx, in Insert) (tasks.Enqueued, error) {
	if r.one != nil {
		return r.one.EnqueueIn(ctx, tx, in)
	}
	if tx != nil {
		name, st, err := r.txStore(ctx, tx, []Insert{in})
		if err != nil {
			return tasks.Enqueued{}, fmt.Errorf("enqueueing task of kind %q in a transaction: %w", in.Kind, err)
		}
		rev := r.cur.Load().m.Rev
		e, err := st.EnqueueIn(ctx, tx, in)
		if err != nil {
			return tasks.Enqueued{}, r.txError(ctx, rev, name, err)
		}
		return e, nil
	}
	for attempt := 0; ; attempt++ {
		rev := r.cur.Load().m.Rev
		name, st := r.Of(in.Shard)
		if st == nil {
			return tasks.Enqueued{}, fmt.Errorf("enqueueing task of kind %q: shard %d is outside the map of databases", in.Kind, in.Shard)
		}
		if !r.usable(name) {
			return tasks.Enqueued{}, fmt.Errorf("enqueueing task of kind %q: %w", in.Kind, r.downError(name))
		}
		e, err := st.EnqueueIn(ctx, nil, in)
		r.observe(ctx, name, err)
		if NotHeld(err) && attempt < staleRetries {
			if rerr := r.refresh(ctx, rev); rerr != nil {
				return tasks.Enqueued{}, fmt.Errorf("database %s: %w", name, errors.Join(err, rerr))
			}
			continue
		}
		if err != nil {
			return tasks.Enqueued{}, fmt.Errorf("database %s: %w", name, err)
		}
		return e, nil
	}
}

// txStore returns the database tx is on and its store, after checking
// that every task of ins has its shard there (re-reading the map once
// before refusing: a producer may know a newer map than the router).
func (r *Router) txStore(ctx context.Context, tx pgx.Tx, ins []Insert) (string, *Store, error) {
	name, err := r.databaseOf(ctx, tx)
	if err != nil {
		return "", nil, err
	}
	st := r.stores[name]
	if st == nil {
		return "", nil, fmt.Errorf("%w: the transaction is on database %s, which is not in the map of databases", ErrWrongDatabase, name)
	}
	for refreshed := false; ; refreshed = true {
		rev := r.cur.Load().m.Rev
		wrong := ""
		shard := 0
		for _, in := range ins {
			if db, _ := r.Of(in.Shard); db != name {
				wrong, shard = db, in.Shard
				break
			}
		}
		if wrong == "" {
			return name, st, nil
		}
		if refreshed {
			return "", nil, fmt.Errorf("%w: shard %d lives in database %s, the transaction is on database %s", ErrWrongDatabase, shard, cmp.Or(wrong, "(none)"), name)
		}
		if err := r.refresh(ctx, rev); err != nil {
			return "", nil, err
		}
	}
}

// EnqueueBatch is EnqueueBatchIn without a transaction.
func (r *Router) EnqueueBatch(ctx context.Context, ins []Insert) (int64, error) {
	res, err := r.EnqueueBatchIn(ctx, nil, ins)
	return res.Inserted, err
}

// txError is the error of an enqueue in a producer's transaction at
// database name. A refusal of a shard the database no longer holds
// (SR001) means the router's map (revision rev) was stale: it is read
// again, and the producer is told to retry its transaction at the
// shard's database, since the router cannot move a caller's transaction.
func (r *Router) txError(ctx context.Context, rev int64, name string, err error) error {
	if NotHeld(err) {
		if rerr := r.refresh(ctx, rev); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return fmt.Errorf("database %s (retry the transaction at the shard's database): %w", name, err)
	}
	return fmt.Errorf("database %s: %w", name, err)
}

// EnqueueBatchIn is Store.EnqueueBatchIn split by database: each
// database's part in a transaction of its own (concurrently), the answers
// merged in the batch's order. A batch that reports every task's id (one
// with a unique key, …) has every part inserted so. A part refused with
// SR001 is sent again after the map is re-read. When a part fails, the
// others may have committed: the error names the failed databases, and
// the result counts what was inserted.
//
// With tx, a producer's transaction, every task must have its shard in
// tx's database (else ErrWrongDatabase, naming both, and nothing is
// inserted).
func (r *Router) EnqueueBatchIn(ctx context.Context, tx pgx.Tx, ins []Insert) (tasks.BatchEnqueued, error) {
	if r.one != nil {
		return r.one.EnqueueBatchIn(ctx, tx, ins)
	}
	if len(ins) == 0 {
		return tasks.BatchEnqueued{}, nil
	}
	if tx != nil {
		name, st, err := r.txStore(ctx, tx, ins)
		if err != nil {
			return tasks.BatchEnqueued{}, fmt.Errorf("enqueueing %d tasks in a transaction: %w", len(ins), err)
		}
		rev := r.cur.Load().m.Rev
		res, err := st.EnqueueBatchIn(ctx, tx, ins)
		if err != nil {
			return tasks.BatchEnqueued{}, r.txError(ctx, rev, name, err)
		}
		return res, nil
	}
	ordered := insertsInOrder(ins)
	var res tasks.BatchEnqueued
	if ordered {
		res.Tasks = make([]tasks.Enqueued, len(ins))
	}
	todo := make([]int, len(ins))
	for i := range todo {
		todo[i] = i
	}
	var committed []string
	for attempt := 0; len(todo) > 0; attempt++ {
		rev := r.cur.Load().m.Rev
		parts, err := r.split(len(todo), func(j int) int { return ins[todo[j]].Shard })
		if err != nil {
			return res, fmt.Errorf("enqueueing %d tasks: %w", len(ins), err)
		}
		got := make([]tasks.BatchEnqueued, len(parts))
		errs := make([]error, len(parts))
		parallel(len(parts), func(k int) {
			p := parts[k]
			if !r.usable(p.name) {
				errs[k] = r.downError(p.name)
				return
			}
			batch := make([]Insert, len(p.idx))
			for j, i := range p.idx {
				batch[j] = ins[todo[i]]
			}
			got[k], errs[k] = p.st.enqueueBatchIn(ctx, nil, batch, ordered)
			r.observe(ctx, p.name, errs[k])
		})
		var stale []int
		var failed []error
		for k, p := range parts {
			if err := errs[k]; err != nil {
				if NotHeld(err) && attempt < staleRetries {
					for _, i := range p.idx {
						stale = append(stale, todo[i])
					}
					continue
				}
				failed = append(failed, fmt.Errorf("database %s: %w", p.name, err))
				continue
			}
			committed = append(committed, p.name)
			res.Inserted += got[k].Inserted
			res.Duplicates += got[k].Duplicates
			if ordered {
				for j, i := range p.idx {
					res.Tasks[todo[i]] = got[k].Tasks[j]
				}
			}
		}
		if len(failed) > 0 {
			err := errors.Join(failed...)
			if len(committed) > 0 {
				slices.Sort(committed)
				err = fmt.Errorf("%w (the tasks of database %s were committed: %d inserted)", err, strings.Join(slices.Compact(committed), ", "), res.Inserted)
			}
			if ordered {
				res.Tasks = nil // incomplete: the ids of the failed parts are unknown
			}
			return res, fmt.Errorf("enqueueing %d tasks: %w", len(ins), err)
		}
		if len(stale) > 0 {
			if err := r.refresh(ctx, rev); err != nil {
				return res, fmt.Errorf("enqueueing %d tasks: %w", len(ins), err)
			}
		}
		todo = stale
	}
	return res, nil
}

// ---- one task, by id ----

// idOrder is the order in which the databases are asked for task id: the
// database of its residue first (it drew the id; the task is there unless
// its shard moved), then the others.
func (r *Router) idOrder(id int64) []string {
	order := make([]string, 0, len(r.names))
	if slot := SlotOf(id); slot < len(r.names) {
		order = append(order, r.names[slot])
	}
	for _, name := range r.names {
		if !slices.Contains(order, name) {
			order = append(order, name)
		}
	}
	return order
}

// atTask runs op on task id's database: each database in idOrder until one
// does not answer ErrNotFound. A task no database has is ErrNotFound,
// unless a database could not answer (then its error).
func atTask[T any](r *Router, ctx context.Context, id int64, what string, op func(st *Store) (T, error)) (T, error) {
	var zero T
	var errs []error
	for _, name := range r.idOrder(id) {
		if !r.usable(name) {
			errs = append(errs, r.downError(name))
			continue
		}
		v, err := op(r.stores[name])
		r.observe(ctx, name, err)
		if err == nil {
			return v, nil
		}
		if errors.Is(err, ErrNotFound) {
			continue
		}
		var conflict *tasks.ConflictError
		if errors.As(err, &conflict) {
			return zero, err
		}
		errs = append(errs, fmt.Errorf("database %s: %w", name, err))
	}
	if len(errs) > 0 {
		return zero, fmt.Errorf("%s task %d: %w", what, id, errors.Join(errs...))
	}
	return zero, fmt.Errorf("%s task %d: %w", what, id, &tasks.NotFoundError{ID: id})
}

// Get is Store.Get at the task's database.
func (r *Router) Get(ctx context.Context, id int64) (tasks.Task, error) {
	if r.one != nil {
		return r.one.Get(ctx, id)
	}
	return atTask(r, ctx, id, "getting", func(st *Store) (tasks.Task, error) { return st.Get(ctx, id) })
}

// CancelTask is Store.CancelTask at the task's database.
func (r *Router) CancelTask(ctx context.Context, id int64) (tasks.Task, error) {
	if r.one != nil {
		return r.one.CancelTask(ctx, id)
	}
	return atTask(r, ctx, id, "cancelling", func(st *Store) (tasks.Task, error) { return st.CancelTask(ctx, id) })
}

// RetryTask is Store.RetryTask at the task's database.
func (r *Router) RetryTask(ctx context.Context, id int64) (tasks.Task, error) {
	if r.one != nil {
		return r.one.RetryTask(ctx, id)
	}
	return atTask(r, ctx, id, "retrying", func(st *Store) (tasks.Task, error) { return st.RetryTask(ctx, id) })
}

// ---- reads across databases ----

// targets are the databases a filter can match in: the database of its
// shard, or all of them.
func (r *Router) targets(f tasks.Filter) []string {
	if f.Shard != nil {
		if name, st := r.Of(*f.Shard); st != nil {
			return []string{name}
		}
	}
	return r.names
}

// gather runs f at each of names concurrently and returns the answers in
// names' order, or the errors joined, each naming its database.
func gather[T any](r *Router, ctx context.Context, names []string, f func(st *Store) (T, error)) ([]T, error) {
	out := make([]T, len(names))
	errs := make([]error, len(names))
	parallel(len(names), func(k int) {
		name := names[k]
		if !r.usable(name) {
			errs[k] = r.downError(name)
			return
		}
		var err error
		out[k], err = f(r.stores[name])
		r.observe(ctx, name, err)
		if err != nil {
			errs[k] = fmt.Errorf("database %s: %w", name, err)
		}
	})
	return out, errors.Join(errs...)
}

// List is Store.List merged across the databases, in id order (descending
// with Desc): the cursor is still one task id, since ids are unique across
// the databases. Each database lists a page after the cursor; the merged
// page holds the tasks up to the nearest point every database's page
// reached (its last task, or the last candidate its filter examined), at
// most Limit of them, and Next is where it stopped.
func (r *Router) List(ctx context.Context, req tasks.ListRequest) (tasks.Page, error) {
	if r.one != nil {
		return r.one.List(ctx, req)
	}
	if req.Limit <= 0 {
		req.Limit = tasks.DefaultListLimit
	}
	req.Limit = min(req.Limit, tasks.MaxListLimit)
	pages, err := gather(r, ctx, r.targets(req.Filter), func(st *Store) (tasks.Page, error) { return st.List(ctx, req) })
	if err != nil {
		return tasks.Page{}, fmt.Errorf("listing tasks: %w", err)
	}
	return mergePages(pages, req.Limit, req.Desc), nil
}

// mergePages merges pages of one listing from several databases: see List.
func mergePages(pages []tasks.Page, limit int, desc bool) tasks.Page {
	// before reports whether id a comes strictly before b in the
	// listing's order (a < b != desc would put an id before itself in a
	// descending listing, and drop the task at the horizon).
	before := func(a, b int64) bool {
		if desc {
			return a > b
		}
		return a < b
	}
	var horizon int64 // 0: every database's listing was exhausted
	for _, p := range pages {
		if p.Next != 0 && (horizon == 0 || before(p.Next, horizon)) {
			horizon = p.Next
		}
	}
	var all []tasks.Summary
	for _, p := range pages {
		for _, t := range p.Tasks {
			if horizon == 0 || !before(horizon, t.ID) {
				all = append(all, t)
			}
		}
	}
	slices.SortFunc(all, func(a, b tasks.Summary) int {
		if desc {
			return cmp.Compare(b.ID, a.ID)
		}
		return cmp.Compare(a.ID, b.ID)
	})
	out := tasks.Page{Tasks: all, Next: horizon}
	if len(all) >= limit {
		// A full page: more may follow, as a store's full page says.
		out.Tasks = all[:limit]
		out.Next = all[limit-1].ID
	}
	if out.Tasks == nil {
		out.Tasks = []tasks.Summary{}
	}
	return out
}

// CountMatching is Store.CountMatching summed across the databases (at
// most MatchCountCap, AtLeast when a database's count stopped early).
func (r *Router) CountMatching(ctx context.Context, f tasks.Filter) (MatchCount, error) {
	if r.one != nil {
		return r.one.CountMatching(ctx, f)
	}
	counts, err := gather(r, ctx, r.targets(f), func(st *Store) (MatchCount, error) { return st.CountMatching(ctx, f) })
	if err != nil {
		return MatchCount{}, fmt.Errorf("counting the tasks that match a filter: %w", err)
	}
	var mc MatchCount
	for _, c := range counts {
		mc.Count += c.Count
		mc.AtLeast = mc.AtLeast || c.AtLeast
		mc.Examined += c.Examined
	}
	if mc.Count >= MatchCountCap {
		mc.Count, mc.AtLeast, mc.Examined = MatchCountCap, true, 0
	}
	return mc, nil
}

// sumStates adds up maps of counts by state.
func sumStates[N int64 | float64](maps []map[tasks.State]N) map[tasks.State]N {
	out := make(map[tasks.State]N)
	for _, m := range maps {
		for st, n := range m {
			out[st] += n
		}
	}
	return out
}

// CountByState is Store.CountByState summed across the databases.
func (r *Router) CountByState(ctx context.Context) (map[tasks.State]int64, error) {
	if r.one != nil {
		return r.one.CountByState(ctx)
	}
	counts, err := gather(r, ctx, r.names, func(st *Store) (map[tasks.State]int64, error) { return st.CountByState(ctx) })
	if err != nil {
		return nil, fmt.Errorf("counting tasks by state: %w", err)
	}
	return sumStates(counts), nil
}

// CountByStateCapped is Store.CountByStateCapped summed across the
// databases (each capped at limit: a sum of limit or more means "at
// least").
func (r *Router) CountByStateCapped(ctx context.Context, limit int) (map[tasks.State]int64, error) {
	if r.one != nil {
		return r.one.CountByStateCapped(ctx, limit)
	}
	counts, err := gather(r, ctx, r.names, func(st *Store) (map[tasks.State]int64, error) { return st.CountByStateCapped(ctx, limit) })
	if err != nil {
		return nil, fmt.Errorf("counting tasks by state: %w", err)
	}
	return sumStates(counts), nil
}

// FinishedRates is Store.FinishedRates summed across the databases.
func (r *Router) FinishedRates(ctx context.Context, window time.Duration) (map[tasks.State]float64, error) {
	if r.one != nil {
		return r.one.FinishedRates(ctx, window)
	}
	rates, err := gather(r, ctx, r.names, func(st *Store) (map[tasks.State]float64, error) { return st.FinishedRates(ctx, window) })
	if err != nil {
		return nil, fmt.Errorf("counting recently finished tasks: %w", err)
	}
	return sumStates(rates), nil
}

// LongestRunning is Store.LongestRunning merged across the databases.
func (r *Router) LongestRunning(ctx context.Context, n int) ([]tasks.Summary, error) {
	if r.one != nil {
		return r.one.LongestRunning(ctx, n)
	}
	lists, err := gather(r, ctx, r.names, func(st *Store) ([]tasks.Summary, error) { return st.LongestRunning(ctx, n) })
	if err != nil {
		return nil, fmt.Errorf("listing the longest running tasks: %w", err)
	}
	all := slices.Concat(lists...)
	slices.SortFunc(all, func(a, b tasks.Summary) int {
		var at, bt time.Time
		if a.ClaimedAt != nil {
			at = *a.ClaimedAt
		}
		if b.ClaimedAt != nil {
			bt = *b.ClaimedAt
		}
		return cmp.Or(at.Compare(bt), cmp.Compare(a.ID, b.ID))
	})
	return all[:min(n, len(all))], nil
}

// Queues is Store.Queues merged across the databases by name: counts and
// rates summed, paused when paused in any (since the earliest), idle when
// idle in all.
func (r *Router) Queues(ctx context.Context, window time.Duration) ([]QueueStats, error) {
	if r.one != nil {
		return r.one.Queues(ctx, window)
	}
	lists, err := gather(r, ctx, r.names, func(st *Store) ([]QueueStats, error) { return st.Queues(ctx, window) })
	if err != nil {
		return nil, fmt.Errorf("reading the queues: %w", err)
	}
	at := map[string]int{}
	var out []QueueStats
	for _, l := range lists {
		for _, q := range l {
			i, ok := at[q.Name]
			if !ok {
				at[q.Name] = len(out)
				out = append(out, q)
				continue
			}
			m := &out[i]
			m.Ready += q.Ready
			m.ReadyAtLeast = m.ReadyAtLeast || q.ReadyAtLeast || m.Ready >= QueueCountCap
			m.Running += q.Running
			m.Rate += q.Rate
			m.Idle = m.Idle && q.Idle
			if q.PausedAt != nil && (m.PausedAt == nil || q.PausedAt.Before(*m.PausedAt)) {
				m.PausedAt = q.PausedAt
			}
		}
	}
	slices.SortFunc(out, func(a, b QueueStats) int { return cmp.Compare(a.Name, b.Name) })
	return out, nil
}

// SetQueuePaused is Store.SetQueuePaused at every database: the pause is a
// barrier at each. It returns the earliest pause time.
func (r *Router) SetQueuePaused(ctx context.Context, name string, paused bool) (time.Time, error) {
	if r.one != nil {
		return r.one.SetQueuePaused(ctx, name, paused)
	}
	ats, err := gather(r, ctx, r.names, func(st *Store) (time.Time, error) { return st.SetQueuePaused(ctx, name, paused) })
	if err != nil {
		return time.Time{}, fmt.Errorf("setting queue %s paused=%v: %w", name, paused, err)
	}
	var at time.Time
	for _, t := range ats {
		if !t.IsZero() && (at.IsZero() || t.Before(at)) {
			at = t
		}
	}
	return at, nil
}

// DeleteQueue is Store.DeleteQueue at every database. A queue with work
// in some database is refused with a *QueueInUseError summing the work of
// all (its row is removed where it had none); a queue no database has a
// row of is ErrNoSuchQueue.
func (r *Router) DeleteQueue(ctx context.Context, name string) (RemovedQueue, error) {
	if r.one != nil {
		return r.one.DeleteQueue(ctx, name)
	}
	type answer struct {
		q   RemovedQueue
		err error
	}
	answers, err := gather(r, ctx, r.names, func(st *Store) (answer, error) {
		q, err := st.DeleteQueue(ctx, name)
		var inUse *QueueInUseError
		if err == nil || errors.Is(err, ErrNoSuchQueue) || errors.Is(err, ErrDefaultQueue) || errors.As(err, &inUse) {
			return answer{q, err}, nil
		}
		return answer{}, err
	})
	if err != nil {
		return RemovedQueue{}, fmt.Errorf("removing queue %s: %w", name, err)
	}
	var removed *RemovedQueue
	var inUse *QueueInUseError
	for _, a := range answers {
		var e *QueueInUseError
		switch {
		case errors.Is(a.err, ErrDefaultQueue):
			return RemovedQueue{}, a.err
		case errors.As(a.err, &e):
			if inUse == nil {
				inUse = &QueueInUseError{Queue: name}
			}
			inUse.Enqueueing = inUse.Enqueueing || e.Enqueueing
			inUse.Work.Ready += e.Work.Ready
			inUse.Work.Waiting += e.Work.Waiting
			inUse.Work.Running += e.Work.Running
		case a.err == nil && removed == nil:
			q := a.q
			removed = &q
		}
	}
	switch {
	case inUse != nil:
		return RemovedQueue{}, inUse
	case removed == nil:
		return RemovedQueue{}, fmt.Errorf("removing queue %s: %w", name, ErrNoSuchQueue)
	}
	return *removed, nil
}

// BlockedSequences is Store.BlockedSequences merged across the databases
// in key order.
func (r *Router) BlockedSequences(ctx context.Context, after string, limit int) ([]BlockedSequence, error) {
	if r.one != nil {
		return r.one.BlockedSequences(ctx, after, limit)
	}
	lists, err := gather(r, ctx, r.names, func(st *Store) ([]BlockedSequence, error) { return st.BlockedSequences(ctx, after, limit) })
	if err != nil {
		return nil, fmt.Errorf("listing blocked sequences: %w", err)
	}
	all := slices.Concat(lists...)
	slices.SortFunc(all, func(a, b BlockedSequence) int { return cmp.Compare(a.Key, b.Key) })
	return all[:min(limit, len(all))], nil
}

// ReadyUnrunnable is Store.ReadyUnrunnable merged across the databases by
// class.
func (r *Router) ReadyUnrunnable(ctx context.Context, runnable []tasks.Class) ([]ClassCount, error) {
	if r.one != nil {
		return r.one.ReadyUnrunnable(ctx, runnable)
	}
	lists, err := gather(r, ctx, r.names, func(st *Store) ([]ClassCount, error) { return st.ReadyUnrunnable(ctx, runnable) })
	if err != nil {
		return nil, fmt.Errorf("counting ready tasks no attached runner can run: %w", err)
	}
	byClass := map[tasks.Class]ClassCount{}
	for _, l := range lists {
		for _, c := range l {
			m, ok := byClass[c.Class]
			if !ok {
				byClass[c.Class] = c
				continue
			}
			m.Ready += c.Ready
			m.AtLeast = m.AtLeast || c.AtLeast || m.Ready >= UnrunnableCountCap
			if c.Oldest.Before(m.Oldest) {
				m.Oldest = c.Oldest
			}
			byClass[c.Class] = m
		}
	}
	out := make([]ClassCount, 0, len(byClass))
	for _, c := range byClass {
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b ClassCount) int { return cmp.Or(cmp.Compare(a.Queue, b.Queue), cmp.Compare(a.Kind, b.Kind)) })
	return out, nil
}

// CancelMatching is Store.CancelMatching at each database the filter can
// match in, concurrently: counts summed, done when every database is,
// else Next is the least cursor of those that are not (a pass again over
// tasks another database went past finds them cancelled already).
func (r *Router) CancelMatching(ctx context.Context, f tasks.Filter, after int64, budget time.Duration) (tasks.BulkResult, error) {
	if r.one != nil {
		return r.one.CancelMatching(ctx, f, after, budget)
	}
	return r.bulk(ctx, f, "cancel", func(st *Store) (tasks.BulkResult, error) { return st.CancelMatching(ctx, f, after, budget) })
}

// RetryMatching is Store.RetryMatching at each database, as
// CancelMatching.
func (r *Router) RetryMatching(ctx context.Context, f tasks.Filter, after int64, budget time.Duration) (tasks.BulkResult, error) {
	if r.one != nil {
		return r.one.RetryMatching(ctx, f, after, budget)
	}
	return r.bulk(ctx, f, "retry", func(st *Store) (tasks.BulkResult, error) { return st.RetryMatching(ctx, f, after, budget) })
}

func (r *Router) bulk(ctx context.Context, f tasks.Filter, op string, run func(st *Store) (tasks.BulkResult, error)) (tasks.BulkResult, error) {
	names := r.targets(f)
	res := make([]tasks.BulkResult, len(names))
	errs := make([]error, len(names))
	parallel(len(names), func(k int) {
		name := names[k]
		if !r.usable(name) {
			errs[k] = r.downError(name)
			return
		}
		res[k], errs[k] = run(r.stores[name])
		r.observe(ctx, name, errs[k])
		if errs[k] != nil {
			errs[k] = fmt.Errorf("database %s: %w", name, errs[k])
		}
	})
	total := tasks.BulkResult{Done: true}
	for k := range names {
		total.Add(res[k])
		if errs[k] != nil || !res[k].Done {
			total.Done = false
		}
		if errs[k] == nil && !res[k].Done && (total.Next == 0 || res[k].Next < total.Next) {
			total.Next = res[k].Next
		}
	}
	if err := errors.Join(errs...); err != nil {
		var fe *tasks.FieldError
		if errors.As(err, &fe) {
			return tasks.BulkResult{}, fe
		}
		total.Done = false
		return total, fmt.Errorf("bulk %s: %w", op, err)
	}
	if total.Done {
		total.Next = 0
	}
	return total, nil
}

// ---- the cluster ----

// ShardCount is Store.ShardCount of the first database.
func (r *Router) ShardCount(ctx context.Context) (int, bool, error) {
	return r.Catalog().ShardCount(ctx)
}

// EnsureShardCount is Store.EnsureShardCount at every database; created
// says some database recorded the count now.
func (r *Router) EnsureShardCount(ctx context.Context, n int) (bool, error) {
	if r.one != nil {
		return r.one.EnsureShardCount(ctx, n)
	}
	created, err := gather(r, ctx, r.names, func(st *Store) (bool, error) { return st.EnsureShardCount(ctx, n) })
	return slices.Contains(created, true), err
}

// Migrate is Store.Migrate at every database.
func (r *Router) Migrate(ctx context.Context) error {
	if r.one != nil {
		return r.one.Migrate(ctx)
	}
	return r.Each(ctx, func(_ string, st *Store) error { return st.Migrate(ctx) })
}
