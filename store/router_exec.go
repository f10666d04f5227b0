package store

// The executor's statements through the router (executor.Store): each
// splits its refs or terms by their shard's database, runs each
// database's part (concurrently when there are several) and merges the
// answers in the caller's order. A database that cannot be reached does
// not fail the others: its writes are answered claims.Busy, its claims
// claim nothing (a *claims.PartialError names its terms when the claim
// was sent), its fences are Unreached.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// Unavailable reports whether err means that the database (or, for an
// error joined from several, one of them) could not serve the statement
// now: the same statement may succeed later.
func (r *Router) Unavailable(err error) bool { return errors.Is(Classify(err), ErrUnavailable) }

// writeRefs runs a write about claims (one result per item, in order) by
// database. The items of a database that cannot be reached are answered
// claims.Busy, even when it is the only one the write names: the
// executor writes them again later, while its writes for the other
// databases go on (an error would hold its writer up retrying this one).
// Any other error fails the write.
func writeRefs[T any](r *Router, ctx context.Context, items []T, refOf func(T) claims.Ref,
	write func(st *Store, ctx context.Context, items []T) ([]claims.WriteResult, error)) ([]claims.WriteResult, error) {
	parts, err := r.split(len(items), func(i int) int { return refOf(items[i]).Shard })
	if err != nil {
		return nil, err
	}
	results := make([]claims.WriteResult, len(items))
	errs := make([]error, len(parts))
	parallel(len(parts), func(k int) {
		p := parts[k]
		if !r.usable(p.name) {
			errs[k] = r.downError(p.name)
			return
		}
		mine := items
		if len(parts) > 1 {
			mine = pick(items, p.idx)
		}
		res, err := write(p.st, ctx, mine)
		r.observe(ctx, p.name, err)
		if err != nil {
			errs[k] = fmt.Errorf("database %s: %w", p.name, err)
			return
		}
		for j, i := range p.idx {
			results[i] = res[j]
		}
	})
	for k, err := range errs {
		if err == nil {
			continue
		}
		if !r.Unavailable(err) {
			return nil, err
		}
		r.log.Debug("writes for an unreachable database answered busy", "tasks", len(parts[k].idx), "error", err)
		for _, i := range parts[k].idx {
			results[i] = claims.WriteResult{Ref: refOf(items[i]), Outcome: claims.Busy}
		}
	}
	return results, nil
}

func refSelf(r claims.Ref) claims.Ref                 { return r }
func refOfCompletion(c claims.Completion) claims.Ref  { return c.Ref }
func refOfFailure(f claims.Failure) claims.Ref        { return f.Ref }
func refOfCut(c claims.Interruption) claims.Ref       { return c.Ref }
func refOfCancelled(c claims.Cancellation) claims.Ref { return c.Ref }

// Heartbeat is Store.Heartbeat, by database.
func (r *Router) Heartbeat(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	if r.one != nil {
		return r.one.Heartbeat(ctx, owner, refs)
	}
	return writeRefs(r, ctx, refs, refSelf, func(st *Store, ctx context.Context, refs []claims.Ref) ([]claims.WriteResult, error) {
		return st.Heartbeat(ctx, owner, refs)
	})
}

// Started is Store.Started, by database.
func (r *Router) Started(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	if r.one != nil {
		return r.one.Started(ctx, owner, refs)
	}
	return writeRefs(r, ctx, refs, refSelf, func(st *Store, ctx context.Context, refs []claims.Ref) ([]claims.WriteResult, error) {
		return st.Started(ctx, owner, refs)
	})
}

// Unclaim is Store.Unclaim, by database.
func (r *Router) Unclaim(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	if r.one != nil {
		return r.one.Unclaim(ctx, owner, refs)
	}
	return writeRefs(r, ctx, refs, refSelf, func(st *Store, ctx context.Context, refs []claims.Ref) ([]claims.WriteResult, error) {
		return st.Unclaim(ctx, owner, refs)
	})
}

// Complete is Store.Complete, by database.
func (r *Router) Complete(ctx context.Context, owner string, done []claims.Completion) ([]claims.WriteResult, error) {
	if r.one != nil {
		return r.one.Complete(ctx, owner, done)
	}
	return writeRefs(r, ctx, done, refOfCompletion, func(st *Store, ctx context.Context, done []claims.Completion) ([]claims.WriteResult, error) {
		return st.Complete(ctx, owner, done)
	})
}

// Fail is Store.Fail, by database.
func (r *Router) Fail(ctx context.Context, owner string, failed []claims.Failure) ([]claims.WriteResult, error) {
	if r.one != nil {
		return r.one.Fail(ctx, owner, failed)
	}
	return writeRefs(r, ctx, failed, refOfFailure, func(st *Store, ctx context.Context, failed []claims.Failure) ([]claims.WriteResult, error) {
		return st.Fail(ctx, owner, failed)
	})
}

// Interrupt is Store.Interrupt, by database.
func (r *Router) Interrupt(ctx context.Context, owner string, cut []claims.Interruption) ([]claims.WriteResult, error) {
	if r.one != nil {
		return r.one.Interrupt(ctx, owner, cut)
	}
	return writeRefs(r, ctx, cut, refOfCut, func(st *Store, ctx context.Context, cut []claims.Interruption) ([]claims.WriteResult, error) {
		return st.Interrupt(ctx, owner, cut)
	})
}

// CancelAttempts is Store.CancelAttempts, by database.
func (r *Router) CancelAttempts(ctx context.Context, owner string, cancelled []claims.Cancellation) ([]claims.WriteResult, error) {
	if r.one != nil {
		return r.one.CancelAttempts(ctx, owner, cancelled)
	}
	return writeRefs(r, ctx, cancelled, refOfCancelled, func(st *Store, ctx context.Context, cs []claims.Cancellation) ([]claims.WriteResult, error) {
		return st.CancelAttempts(ctx, owner, cs)
	})
}

// CompleteTx is Store.CompleteTx at the database tx is on (a handler's
// transaction on the task's database). A transaction on a database that
// no longer holds the task's shard is refused there with
// tasks.ErrShardMoved.
func (r *Router) CompleteTx(ctx context.Context, tx pgx.Tx, owner string, done claims.Completion) (claims.WriteResult, error) {
	if r.one != nil {
		return r.one.CompleteTx(ctx, tx, owner, done)
	}
	name, err := r.databaseOf(ctx, tx)
	if err != nil {
		return claims.WriteResult{}, fmt.Errorf("completing task %d in a transaction: %w", done.Ref.ID, err)
	}
	st := r.stores[name]
	if st == nil {
		return claims.WriteResult{}, fmt.Errorf("completing task %d in a transaction: the transaction is on database %s, which is not in the map", done.Ref.ID, name)
	}
	return st.CompleteTx(ctx, tx, owner, done)
}

// Claim is Store.Claim over the terms of every database, one statement
// per database, in the order of each database's first term: each takes
// what the databases before it left of limit (and of startNow), so the
// first startNow tasks of the answer start at once, as the store's. A
// database that cannot be reached claims nothing; when the claim was
// sent to it (it may have committed), the answer comes with a
// *claims.PartialError naming its terms. When terms are all of one
// database, its error is the store's.
func (r *Router) Claim(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error) {
	if r.one != nil {
		return r.one.Claim(ctx, owner, terms, queue, kinds, limit, startNow)
	}
	return r.claim(ctx, terms, limit, startNow, func(st *Store, terms []claims.ShardEpoch, limit, startNow int) ([]tasks.Task, error) {
		return st.Claim(ctx, owner, terms, queue, kinds, limit, startNow)
	})
}

// ClaimUrgent is Store.ClaimUrgent over the terms of every database, as
// Claim.
func (r *Router) ClaimUrgent(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error) {
	if r.one != nil {
		return r.one.ClaimUrgent(ctx, owner, terms, queue, kinds, limit, startNow)
	}
	return r.claim(ctx, terms, limit, startNow, func(st *Store, terms []claims.ShardEpoch, limit, startNow int) ([]tasks.Task, error) {
		return st.ClaimUrgent(ctx, owner, terms, queue, kinds, limit, startNow)
	})
}

// claim runs a claim over the terms of every database at once, the limit
// split between them, so that a runner with terms at several databases
// draws on all of them: claimed one database after another, the first
// filled the whole limit while it had a backlog, and the others' servers
// idled (bench section databases: 1.18× one database with two).
//
// The caller starts the first startNow tasks of the answer on slots it
// reserved, so the answer keeps the store's rule: the started tasks come
// first, and there are min(startNow, len(answer)) of them. Three phases
// keep it: the tasks to start now, split between the databases; then, if
// they were all found, the tasks claimed ahead, split likewise; then, for
// what is left of the limit, one database after another as before (each
// claim's first tasks started while starts are left), at the databases
// that gave all they were asked and may have more.
func (r *Router) claim(ctx context.Context, terms []claims.ShardEpoch, limit, startNow int,
	claim func(st *Store, terms []claims.ShardEpoch, limit, startNow int) ([]tasks.Task, error)) ([]tasks.Task, error) {
	parts, err := r.split(len(terms), func(i int) int { return terms[i].Shard })
	if err != nil {
		return nil, fmt.Errorf("claiming tasks: %w", err)
	}
	startNow = min(max(startNow, 0), limit)
	var live []int // the parts still asked: usable, no error
	for k, p := range parts {
		if r.usable(p.name) {
			live = append(live, k)
		}
	}
	// Rotated, so that a limit smaller than the databases reaches each in
	// turn.
	if n := len(live); n > 1 {
		off := int(r.claims.Add(1) % uint64(n))
		live = append(live[off:], live[:off]...)
	}
	var errs []error
	var unsure []claims.ShardEpoch
	failed := map[int]bool{}
	// more: the parts that may have more, those not asked yet or that
	// gave all they were asked.
	more := map[int]bool{}
	for _, k := range live {
		more[k] = true
	}
	var mu sync.Mutex // the claims of a spread record their answers at once
	send := func(k, n, start int) []tasks.Task {
		p := parts[k]
		got, err := claim(p.st, pick(terms, p.idx), n, start)
		r.observe(ctx, p.name, err)
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			errs = append(errs, fmt.Errorf("database %s: %w", p.name, err))
			unsure = append(unsure, pick(terms, p.idx)...)
			failed[k] = true
			return nil
		}
		more[k] = len(got) == n
		return got
	}
	// spread claims n tasks, start of them started, split between the
	// live parts at once.
	spread := func(n, start int) []tasks.Task {
		var ks []int
		for _, k := range live {
			if !failed[k] {
				ks = append(ks, k)
			}
		}
		if len(ks) == 0 || n <= 0 {
			return nil
		}
		got := make([][]tasks.Task, len(ks))
		parallel(len(ks), func(j int) {
			share := n/len(ks) + btoi(j < n%len(ks))
			if share == 0 {
				return
			}
			got[j] = send(ks[j], share, min(share, start))
		})
		var out []tasks.Task
		for _, g := range got {
			out = append(out, g...)
		}
		return out
	}
	var out []tasks.Task
	if startNow == limit || startNow == 0 {
		out = spread(limit, startNow)
	} else {
		out = spread(startNow, startNow)
		if len(out) == startNow {
			out = append(out, spread(limit-startNow, 0)...)
		}
	}
	started := min(len(out), startNow)
	for _, k := range live {
		if len(out) >= limit {
			break
		}
		if failed[k] || !more[k] {
			continue
		}
		got := send(k, limit-len(out), max(startNow-started, 0))
		started = min(started+len(got), startNow)
		out = append(out, got...)
	}
	switch {
	case len(errs) == 0:
		return out, nil
	case len(parts) == 1:
		return nil, errs[0]
	}
	return out, &claims.PartialError{Terms: unsure, Err: errors.Join(errs...)}
}

// PartOf is the slot of the database that holds shard under the current
// map (0 in a cluster of one database): a claim (claim) visits each
// database's shards on its own, and the executor judges per database
// which shards a full claim drained.
func (r *Router) PartOf(shard int) int {
	if r.one != nil {
		return 0
	}
	rt := r.cur.Load()
	if shard < 0 || shard >= len(rt.m.Shards) {
		return -1
	}
	return slices.Index(r.names, rt.m.Shards[shard])
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Claimed is Store.Claimed at every database of terms. A database that
// cannot be reached answers nothing, and a *claims.PartialError names its
// terms (when terms are all of one database, the error is the store's).
func (r *Router) Claimed(ctx context.Context, owner string, terms []claims.ShardEpoch) ([]claims.Ref, error) {
	if r.one != nil {
		return r.one.Claimed(ctx, owner, terms)
	}
	parts, err := r.split(len(terms), func(i int) int { return terms[i].Shard })
	if err != nil {
		return nil, fmt.Errorf("listing claims: %w", err)
	}
	got := make([][]claims.Ref, len(parts))
	errs := make([]error, len(parts))
	parallel(len(parts), func(k int) {
		p := parts[k]
		if !r.usable(p.name) {
			errs[k] = r.downError(p.name)
			return
		}
		got[k], errs[k] = p.st.Claimed(ctx, owner, pick(terms, p.idx))
		r.observe(ctx, p.name, errs[k])
		if errs[k] != nil {
			errs[k] = fmt.Errorf("database %s: %w", p.name, errs[k])
		}
	})
	var out []claims.Ref
	var failed []claims.ShardEpoch
	for k, p := range parts {
		if errs[k] != nil {
			failed = append(failed, pick(terms, p.idx)...)
			continue
		}
		out = append(out, got[k]...)
	}
	switch {
	case len(failed) == 0:
		return out, nil
	case len(parts) == 1:
		return nil, errs[0]
	}
	return out, &claims.PartialError{Terms: failed, Err: errors.Join(errs...)}
}

// ReadyQueues is Store.ReadyQueues at every database of shards, merged.
// The shards of a database that cannot be reached are reported unread
// (truncatedFrom at the least of them, at most): a hint errs towards
// claiming.
func (r *Router) ReadyQueues(ctx context.Context, shards []int, queues, kinds []string) (map[string][]int, int, error) {
	if r.one != nil {
		return r.one.ReadyQueues(ctx, shards, queues, kinds)
	}
	parts, err := r.split(len(shards), func(i int) int { return shards[i] })
	if err != nil {
		return nil, -1, fmt.Errorf("probing lanes: %w", err)
	}
	founds := make([]map[string][]int, len(parts))
	truncs := make([]int, len(parts))
	errs := make([]error, len(parts))
	parallel(len(parts), func(k int) {
		p := parts[k]
		if !r.usable(p.name) {
			errs[k] = r.downError(p.name)
			return
		}
		founds[k], truncs[k], errs[k] = p.st.ReadyQueues(ctx, pick(shards, p.idx), queues, kinds)
		r.observe(ctx, p.name, errs[k])
	})
	found := map[string][]int{}
	truncatedFrom := -1
	lower := func(s int) {
		if truncatedFrom < 0 || s < truncatedFrom {
			truncatedFrom = s
		}
	}
	failed := 0
	for k, p := range parts {
		if errs[k] != nil {
			if !r.Unavailable(errs[k]) {
				return nil, -1, fmt.Errorf("database %s: %w", p.name, errs[k])
			}
			failed++
			lower(slices.Min(pick(shards, p.idx)))
			continue
		}
		for q, ss := range founds[k] {
			found[q] = append(found[q], ss...)
		}
		if truncs[k] >= 0 {
			lower(truncs[k])
		}
	}
	if failed > 0 && len(parts) == 1 {
		return nil, -1, fmt.Errorf("database %s: %w", parts[0].name, errs[0])
	}
	for _, ss := range found {
		slices.Sort(ss)
	}
	return found, truncatedFrom, nil
}

// RaiseFences is Store.RaiseFences at every database of terms, merged:
// the raised terms of the databases that answered; the terms of those
// that could not be reached are Unreached (neither raised nor lost: raise
// them again later). Any other failure fails the raise, as does the
// failure of the only database of terms.
func (r *Router) RaiseFences(ctx context.Context, owner, group string, terms []claims.ShardEpoch) (claims.Orphans, error) {
	if r.one != nil {
		return r.one.RaiseFences(ctx, owner, group, terms)
	}
	return r.orphans(ctx, "raising fences", terms, false, func(st *Store, terms []claims.ShardEpoch) (claims.Orphans, error) {
		return st.RaiseFences(ctx, owner, group, terms)
	})
}

// RequeueOrphans is Store.RequeueOrphans at every database of terms,
// merged; the terms of a database that could not be reached stay Pending.
func (r *Router) RequeueOrphans(ctx context.Context, owner, group string, terms []claims.ShardEpoch) (claims.Orphans, error) {
	if r.one != nil {
		return r.one.RequeueOrphans(ctx, owner, group, terms)
	}
	return r.orphans(ctx, "requeueing orphans", terms, true, func(st *Store, terms []claims.ShardEpoch) (claims.Orphans, error) {
		return st.RequeueOrphans(ctx, owner, group, terms)
	})
}

func (r *Router) orphans(ctx context.Context, what string, terms []claims.ShardEpoch, pendingIfDown bool,
	call func(st *Store, terms []claims.ShardEpoch) (claims.Orphans, error)) (claims.Orphans, error) {
	parts, err := r.split(len(terms), func(i int) int { return terms[i].Shard })
	if err != nil {
		return claims.Orphans{}, fmt.Errorf("%s: %w", what, err)
	}
	got := make([]claims.Orphans, len(parts))
	errs := make([]error, len(parts))
	parallel(len(parts), func(k int) {
		p := parts[k]
		if !r.usable(p.name) {
			errs[k] = r.downError(p.name)
			return
		}
		got[k], errs[k] = call(p.st, pick(terms, p.idx))
		r.observe(ctx, p.name, errs[k])
		if errs[k] != nil {
			errs[k] = fmt.Errorf("database %s: %w", p.name, errs[k])
		}
	})
	var out claims.Orphans
	failed := 0
	for k, p := range parts {
		if err := errs[k]; err != nil {
			if !r.Unavailable(err) {
				return claims.Orphans{}, fmt.Errorf("%s: %w", what, err)
			}
			failed++
			if pendingIfDown {
				out.Pending = append(out.Pending, pick(terms, p.idx)...)
			} else {
				out.Unreached = append(out.Unreached, pick(terms, p.idx)...)
			}
			continue
		}
		o := got[k]
		out.Raised = append(out.Raised, o.Raised...)
		out.Requeued += o.Requeued
		out.Dead += o.Dead
		out.Completed += o.Completed
		out.Pending = append(out.Pending, o.Pending...)
		out.Moved = append(out.Moved, o.Moved...)
		out.Unreached = append(out.Unreached, o.Unreached...)
	}
	if failed > 0 && len(parts) == 1 {
		return claims.Orphans{}, fmt.Errorf("%s: %w", what, errs[0])
	}
	if failed > 0 {
		r.log.Warn(what+" skipped unreachable databases; trying again later", "error", errors.Join(errs...))
	}
	bySh := func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard }
	for _, l := range []*[]claims.ShardEpoch{&out.Raised, &out.Pending, &out.Moved, &out.Unreached} {
		slices.SortFunc(*l, bySh)
	}
	return out, nil
}
