package executortest

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/tasks"
)

// OwnershipHarness is one runner's ownership under test (shard.Manager as
// the runner adapts it, or the executor's fake), opened for one test, with
// the means to drive what the runner does not decide: where its units go,
// and detaches.
type OwnershipHarness interface {
	// Ownership is the ownership under test.
	Ownership() executor.Ownership
	// Acquire makes the runner own at least two units and returns their
	// terms once Unfenced lists them (their fences not raised yet).
	Acquire(t *testing.T) []claims.ShardEpoch
	// Move assigns one of held, fenced terms, to another runner as a
	// rebalance does (a runner joining the group) and returns it once the
	// ownership has begun to release it: the term is releasing, not
	// cancelled.
	Move(t *testing.T, held []claims.ShardEpoch) claims.ShardEpoch
	// Detach detaches the runner, as an operator's manual detach does.
	Detach(t *testing.T)
	// Pause moves the runner's lease clock past its detach point without
	// the runner being told (a process paused and woken before its
	// keep-alive loop noticed): nothing may start then, whether or not
	// the terms' work has been cancelled yet.
	Pause(t *testing.T)
}

// OwnershipContract runs the contract of executor.Ownership (and its Hold)
// against the ownerships open returns, one per test.
func OwnershipContract(t *testing.T, open func(t *testing.T) OwnershipHarness) {
	t.Run("NewTermsWaitForTheirFence", func(t *testing.T) { newTerms(t, open(t)) })
	t.Run("HoldAndBegin", func(t *testing.T) { holdAndBegin(t, open(t)) })
	t.Run("AMoveLeavesBegunWorkRunningUntilItIsDone", func(t *testing.T) { move(t, open(t)) })
	t.Run("DetachEndsEveryTerm", func(t *testing.T) { detach(t, open(t)) })
	t.Run("FenceLostEndsTheTerm", func(t *testing.T) { fenceLostTerm(t, open(t)) })
	t.Run("NothingStartsPastTheDetachPoint", func(t *testing.T) { paused(t, open(t)) })
}

// drain takes a pending change signal, if any.
func drain(ch <-chan struct{}) {
	select {
	case <-ch:
	default:
	}
}

// changed waits for a change signal.
func changed(t *testing.T, ch <-chan struct{}, why string) {
	t.Helper()
	select {
	case <-ch:
	case <-bounded(t).Done():
		t.Fatalf("Changes was not signalled: %s", why)
	}
}

// fenced acquires terms and fences them.
func fenced(t *testing.T, h OwnershipHarness) []claims.ShardEpoch {
	t.Helper()
	terms := h.Acquire(t)
	if len(terms) < 2 {
		t.Fatalf("the harness acquired %v, want at least two terms", terms)
	}
	h.Ownership().Fenced(terms)
	eventually(t, "every acquired term held once fenced", func() bool { return heldAll(h.Ownership(), terms) })
	return terms
}

// heldAll reports whether a hold taken now holds every one of terms.
func heldAll(own executor.Ownership, terms []claims.ShardEpoch) bool {
	hold := own.Hold()
	defer hold.Release()
	got := hold.Terms()
	for _, term := range terms {
		if !slices.Contains(got, term) {
			return false
		}
	}
	return true
}

// held is what a hold taken now holds.
func held(own executor.Ownership) []claims.ShardEpoch {
	hold := own.Hold()
	defer hold.Release()
	return hold.Terms()
}

// fencedHold returns the harness's ownership, its fenced terms (fenced)
// and a hold taken on them.
func fencedHold(t *testing.T, h OwnershipHarness) (executor.Ownership, []claims.ShardEpoch, executor.Hold) {
	t.Helper()
	own := h.Ownership()
	terms := fenced(t, h)
	return own, terms, own.Hold()
}

// work is work begun on one term.
type work struct {
	ctx  context.Context
	done func()
}

// beginAll begins work on every one of terms under hold.
func beginAll(t *testing.T, hold executor.Hold, terms []claims.ShardEpoch) map[claims.ShardEpoch]work {
	t.Helper()
	out := make(map[claims.ShardEpoch]work, len(terms))
	for _, term := range terms {
		ctx, done, ok := hold.Begin(term.Shard, term.Epoch)
		if !ok {
			t.Fatalf("Begin refused work on held term %+v", term)
		}
		out[term] = work{ctx, done}
	}
	return out
}

// finish ends the work begun on every term.
func finish(works map[claims.ShardEpoch]work) {
	for _, w := range works {
		w.done()
	}
}

// ended waits until ctx ends with a cause wrapping tasks.ErrOwnershipLost.
func ended(t *testing.T, ctx context.Context, why string) {
	t.Helper()
	eventually(t, why, func() bool { return ctx.Err() != nil })
	if cause := context.Cause(ctx); !errors.Is(cause, tasks.ErrOwnershipLost) {
		t.Fatalf("%s: the term's context ended with %v, want a cause wrapping tasks.ErrOwnershipLost", why, cause)
	}
}

// Acquired terms are listed by Unfenced and neither held nor workable;
// once fenced they are held (in shard order) and workable, and Changes is
// signalled.
func newTerms(t *testing.T, h OwnershipHarness) {
	own := h.Ownership()
	terms := h.Acquire(t)
	if len(terms) < 2 {
		t.Fatalf("the harness acquired %v, want at least two terms", terms)
	}
	unfenced := own.Unfenced()
	for _, term := range terms {
		if !slices.Contains(unfenced, term) {
			t.Fatalf("Unfenced %v lacks the acquired term %+v", unfenced, term)
		}
		if own.Workable(term.Shard, term.Epoch) {
			t.Fatalf("term %+v is workable before its fence is raised", term)
		}
		if slices.Contains(held(own), term) {
			t.Fatalf("term %+v is held before its fence is raised", term)
		}
	}
	drain(own.Changes())
	own.Fenced(terms)
	changed(t, own.Changes(), "terms became claimable")
	got := held(own)
	if !slices.IsSortedFunc(got, func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard }) {
		t.Fatalf("Hold().Terms() %v is not ordered by shard", got)
	}
	for _, term := range terms {
		if !slices.Contains(got, term) || !own.Workable(term.Shard, term.Epoch) {
			t.Fatalf("fenced term %+v: held %v, workable %v; want both", term, got, own.Workable(term.Shard, term.Epoch))
		}
		if slices.Contains(own.Unfenced(), term) {
			t.Fatalf("fenced term %+v still listed by Unfenced", term)
		}
		if own.Workable(term.Shard, term.Epoch+1) {
			t.Fatalf("shard %d workable at an epoch it is not owned at", term.Shard)
		}
	}
}

// Begin admits work only on a held term at its epoch; the work's context
// is the term's, alive while the term is; done may be called twice.
func holdAndBegin(t *testing.T, h OwnershipHarness) {
	_, terms, hold := fencedHold(t, h)
	defer hold.Release()
	term := terms[0]
	ctx, done, ok := hold.Begin(term.Shard, term.Epoch)
	if !ok || ctx.Err() != nil {
		t.Fatalf("Begin on held term %+v: ok %v, context %v", term, ok, ctx.Err())
	}
	done()
	done()
	if _, _, ok := hold.Begin(term.Shard, term.Epoch+1); ok {
		t.Fatal("Begin admitted work at an epoch the term does not have")
	}
	maxShard := 0
	for _, x := range terms {
		maxShard = max(maxShard, x.Shard)
	}
	if _, _, ok := hold.Begin(maxShard+1_000_000, 1); ok {
		t.Fatal("Begin admitted work on a shard the hold does not hold")
	}
}

// A unit moves as a rebalance moves it: the term leaves the claimable terms
// at once (Changes signalled, not in a new Hold, not Workable), its work
// goes on under a live context, a claim made under a hold taken before the
// move may still begin, and the term is released — its context ended —
// only once all that work is done. No work is cancelled, on any term.
func move(t *testing.T, h OwnershipHarness) {
	own, terms, hold := fencedHold(t, h)
	works := beginAll(t, hold, terms)
	hold.Release()
	before := own.Hold() // a claim under way when the unit moves
	drain(own.Changes())
	moved := h.Move(t, terms)
	if !slices.Contains(terms, moved) {
		t.Fatalf("the harness moved %+v, not one of %v", moved, terms)
	}
	changed(t, own.Changes(), "a term began its release")
	if slices.Contains(held(own), moved) {
		t.Fatalf("the moving term %+v is held for new claims", moved)
	}
	if own.Workable(moved.Shard, moved.Epoch) {
		t.Fatalf("the moving term %+v is workable", moved)
	}
	if slices.Contains(own.Unfenced(), moved) {
		t.Fatalf("the moving term %+v is listed unfenced", moved)
	}
	if err := works[moved].ctx.Err(); err != nil {
		t.Fatalf("the moving term's context ended (%v, %v) while its work runs: a move is not a cancel", err, context.Cause(works[moved].ctx))
	}
	late, lateDone, ok := before.Begin(moved.Shard, moved.Epoch)
	if !ok || late.Err() != nil {
		t.Fatal("a claim made under a hold taken before the move could not begin: its tasks would be left to the next owner's requeue")
	}
	before.Release()
	for _, term := range terms {
		if term == moved {
			continue
		}
		// The same rebalance may move other units too: their work runs on
		// all the same.
		if err := works[term].ctx.Err(); err != nil {
			t.Fatalf("the work of term %+v ended (%v) in a rebalance", term, context.Cause(works[term].ctx))
		}
		works[term].done()
	}
	works[moved].done()
	if err := late.Err(); err != nil {
		t.Fatalf("the moving term was released (%v) with work still begun on it", context.Cause(late))
	}
	lateDone()
	ended(t, late, "the moved term released once its work was done")
}

// A detach ends every term at once: every term's context ends, nothing is
// workable, held or unfenced, and a hold taken before admits nothing.
func detach(t *testing.T, h OwnershipHarness) {
	own, terms, hold := fencedHold(t, h)
	defer hold.Release()
	works := beginAll(t, hold, terms)
	h.Detach(t)
	for _, term := range terms {
		ended(t, works[term].ctx, "a detach ends every term's work")
		if own.Workable(term.Shard, term.Epoch) {
			t.Fatalf("term %+v workable while detached", term)
		}
		if _, _, ok := hold.Begin(term.Shard, term.Epoch); ok {
			t.Fatalf("a hold taken before the detach admitted work on %+v", term)
		}
	}
	if got := held(own); len(got) != 0 {
		t.Fatalf("a hold taken while detached holds %v", got)
	}
	if got := own.Unfenced(); len(got) != 0 {
		t.Fatalf("Unfenced lists %v while detached: nothing may be fenced", got)
	}
	finish(works)
}

// A write refused by a newer owner's fence ends that term at once (its
// context, its hold, its workability), and only that term.
func fenceLostTerm(t *testing.T, h OwnershipHarness) {
	own, terms, hold := fencedHold(t, h)
	works := beginAll(t, hold, terms)
	hold.Release()
	lost := terms[0]
	own.FenceLost(lost.Shard, lost.Epoch)
	ended(t, works[lost].ctx, "a lost fence ends the term's work")
	if own.Workable(lost.Shard, lost.Epoch) || slices.Contains(held(own), lost) {
		t.Fatalf("term %+v, whose fence was lost, is still workable or held", lost)
	}
	for _, term := range terms[1:] {
		if !own.Workable(term.Shard, term.Epoch) || works[term].ctx.Err() != nil {
			t.Fatalf("term %+v stopped with another term's fence", term)
		}
	}
	finish(works)
}

// Past the lease clock's detach point nothing may start — no term is
// workable or held, and a hold taken before admits nothing — although no
// term has been cancelled yet.
func paused(t *testing.T, h OwnershipHarness) {
	own, terms, hold := fencedHold(t, h)
	defer hold.Release()
	works := beginAll(t, hold, terms)
	h.Pause(t)
	for _, term := range terms {
		if own.Workable(term.Shard, term.Epoch) {
			t.Fatalf("term %+v workable past the detach point", term)
		}
		if _, _, ok := hold.Begin(term.Shard, term.Epoch); ok {
			t.Fatalf("work began on %+v past the detach point", term)
		}
	}
	if got := held(own); len(got) != 0 {
		t.Fatalf("a hold taken past the detach point holds %v", got)
	}
	finish(works)
}
