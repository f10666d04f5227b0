package executortest

import (
	"encoding/json"
	"slices"
	"testing"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/tasks"
)

// StoreHarness is one store under test, empty (no tasks, no fences) when
// opened for a test, with the means to set up what no runner statement
// does. The contract uses shards 0 to 3 of Group, tasks of Kind in the
// default queue, and the runners Owner and Other.
type StoreHarness interface {
	// Store is the store under test.
	Store() executor.Store
	// Group is the capability group whose units the contract fences.
	Group() string
	// Add enqueues a ready task of kind in the default queue on shard,
	// due now, with maxAttempts attempts, and returns its id.
	Add(t *testing.T, kind string, shard, maxAttempts int) int64
	// Task reads task id.
	Task(t *testing.T, id int64) tasks.Task
	// LockClaim opens a transaction that holds the claim row of ref (as a
	// handler's transaction does after CompleteTx, or one a frozen process
	// left open) until unlock ends it (a rollback). The harness ends it at
	// the test's cleanup if the test did not.
	LockClaim(t *testing.T, ref claims.Ref) (unlock func())
	// CompleteInTx records the completion of attempt ref with result in a
	// transaction of its own, as a handler's CompleteTx does, and leaves it
	// open until commit commits it.
	CompleteInTx(t *testing.T, ref claims.Ref, result json.RawMessage) (commit func())
	// SweepStale makes the claims of refs stale (their heartbeats older
	// than the stale threshold) and runs the sweeper's stale rule: it must
	// spend only the attempts of claims whose handlers started.
	SweepStale(t *testing.T, refs []claims.Ref)
}

// StoreContract runs the contract of executor.Store against the stores
// open returns, one per test.
func StoreContract(t *testing.T, open func(t *testing.T) StoreHarness) {
	t.Run("ClaimsOnlyUnderItsFence", func(t *testing.T) { claimsUnderFence(t, open(t)) })
	t.Run("WritesAfterANewerRaiseAreFenceLost", func(t *testing.T) { fenceLost(t, open(t)) })
	t.Run("UnclaimKeepsTheAttempt", func(t *testing.T) { unclaimKeeps(t, open(t)) })
	t.Run("OrphanRequeueSpendsOnlyStartedAttempts", func(t *testing.T) { orphansSpendStarted(t, open(t)) })
	t.Run("StaleSweepSpendsOnlyStartedAttempts", func(t *testing.T) { staleSpendsStarted(t, open(t)) })
	for _, w := range claimWrites {
		t.Run("ABusyClaimIsSkippedBy"+w.name, func(t *testing.T) { busySkipped(t, open(t), w) })
	}
	t.Run("ARaiseSkipsHeldOrphansAndRequeueOrphansFinishes", func(t *testing.T) { pendingOrphans(t, open(t)) })
	t.Run("CompletedInTheHandlersTransaction", func(t *testing.T) { completedInTx(t, open(t)) })
	t.Run("OrphanRequeueCompletesWhatTheHandlerCompleted", func(t *testing.T) { orphanCompletedInTx(t, open(t)) })
}

// storeFixture is a harness with the calls the contract makes often.
type storeFixture struct {
	StoreHarness
	t *testing.T
}

// raise raises owner's fence of shard to epoch and returns what the raise
// did.
func (f storeFixture) raise(owner string, shard int, epoch int64) claims.Orphans {
	f.t.Helper()
	o, err := f.Store().RaiseFences(bounded(f.t), owner, f.Group(), []claims.ShardEpoch{{Shard: shard, Epoch: epoch}})
	if err != nil {
		f.t.Fatalf("%s raising shard %d to epoch %d: %v", owner, shard, epoch, err)
	}
	return o
}

// claim claims up to limit tasks of Kind on shard at epoch for owner, the
// first startNow recorded as started.
func (f storeFixture) claim(owner string, shard int, epoch int64, limit, startNow int) []tasks.Task {
	f.t.Helper()
	got, err := f.Store().Claim(bounded(f.t), owner, []claims.ShardEpoch{{Shard: shard, Epoch: epoch}}, tasks.DefaultQueue, []string{Kind}, limit, startNow)
	if err != nil {
		f.t.Fatalf("%s claiming on shard %d at epoch %d: %v", owner, shard, epoch, err)
	}
	return got
}

// claimed adds n tasks of Kind on shard 0 with maxAttempts each, raises
// Owner's fence of the shard to epoch 1 and claims them all, the first
// startNow recorded as started.
func (f storeFixture) claimed(n, maxAttempts, startNow int) []tasks.Task {
	f.t.Helper()
	for range n {
		f.Add(f.t, Kind, 0, maxAttempts)
	}
	f.raise(Owner, 0, 1)
	got := f.claim(Owner, 0, 1, n, startNow)
	if len(got) != n {
		f.t.Fatalf("claimed %d tasks, want %d", len(got), n)
	}
	return got
}

// expect checks task id's state and attempt.
func (f storeFixture) expect(id int64, state tasks.State, attempt int, why string) {
	f.t.Helper()
	if got := f.Task(f.t, id); got.State != state || got.Attempt != attempt {
		f.t.Fatalf("task %d is %s at attempt %d, want %s at attempt %d: %s", id, got.State, got.Attempt, state, attempt, why)
	}
}

// outcomes checks one write's results, in the order of its refs.
func outcomes(t *testing.T, what string, res []claims.WriteResult, err error, want ...claims.Outcome) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	got := make([]claims.Outcome, len(res))
	for i, r := range res {
		got[i] = r.Outcome
	}
	if !slices.Equal(got, want) {
		t.Fatalf("%s answered %v, want %v", what, got, want)
	}
}

func refsOf(ts []tasks.Task) []claims.Ref {
	refs := make([]claims.Ref, len(ts))
	for i, t := range ts {
		refs[i] = claims.RefOf(t)
	}
	return refs
}

// A claim takes tasks only of shards whose fence holds the claimer's term,
// records the claim's owner and epoch, and takes each task once.
func claimsUnderFence(t *testing.T, h StoreHarness) {
	f := storeFixture{h, t}
	a, b := f.Add(t, Kind, 0, 3), f.Add(t, Kind, 0, 3)
	if got := f.claim(Owner, 0, 1, 10, 10); len(got) != 0 {
		t.Fatalf("claimed %d tasks of a shard whose fence was never raised", len(got))
	}
	if o := f.raise(Owner, 0, 1); !slices.Equal(o.Raised, []claims.ShardEpoch{{Shard: 0, Epoch: 1}}) {
		t.Fatalf("raise answered %+v, want shard 0 epoch 1 raised", o)
	}
	got := f.claim(Owner, 0, 1, 10, 1)
	if len(got) != 2 || (got[0].ID != a || got[1].ID != b) && (got[0].ID != b || got[1].ID != a) {
		t.Fatalf("claimed %+v, want tasks %d and %d", got, a, b)
	}
	for _, task := range got {
		if task.State != tasks.Running || task.ClaimedBy != Owner || task.Epoch != 1 || task.Attempt != 1 || task.Shard != 0 {
			t.Fatalf("claimed task %+v: want running, claimed by %s at epoch 1, attempt 1, shard 0", task, Owner)
		}
	}
	if again := f.claim(Owner, 0, 1, 10, 10); len(again) != 0 {
		t.Fatalf("claimed %d running tasks again", len(again))
	}
}

// After a newer owner raised the fence, every write of the old owner's
// claims is refused with FenceLost, its claims take nothing, and its fence
// cannot be raised back.
func fenceLost(t *testing.T, h StoreHarness) {
	f := storeFixture{h, t}
	refs := refsOf(f.claimed(2, 3, 1))
	f.Add(t, Kind, 0, 3) // one left to claim
	if o := f.raise(Other, 0, 2); !slices.Equal(o.Raised, []claims.ShardEpoch{{Shard: 0, Epoch: 2}}) {
		t.Fatalf("the newer owner's raise answered %+v", o)
	}
	s, ctx := f.Store(), bounded(t)
	lost := []claims.Outcome{claims.FenceLost, claims.FenceLost}
	res, err := s.Heartbeat(ctx, Owner, refs)
	outcomes(t, "Heartbeat", res, err, lost...)
	res, err = s.Started(ctx, Owner, refs)
	outcomes(t, "Started", res, err, lost...)
	res, err = s.Complete(ctx, Owner, []claims.Completion{{Ref: refs[0]}, {Ref: refs[1]}})
	outcomes(t, "Complete", res, err, lost...)
	res, err = s.Fail(ctx, Owner, []claims.Failure{{Ref: refs[0], Error: "x"}, {Ref: refs[1], Error: "x"}})
	outcomes(t, "Fail", res, err, lost...)
	res, err = s.Interrupt(ctx, Owner, []claims.Interruption{{Ref: refs[0], Reason: "x"}, {Ref: refs[1], Reason: "x"}})
	outcomes(t, "Interrupt", res, err, lost...)
	res, err = s.CancelAttempts(ctx, Owner, []claims.Cancellation{{Ref: refs[0]}, {Ref: refs[1]}})
	outcomes(t, "CancelAttempts", res, err, lost...)
	res, err = s.Unclaim(ctx, Owner, refs)
	outcomes(t, "Unclaim", res, err, lost...)
	if more := f.claim(Owner, 0, 1, 10, 10); len(more) != 0 {
		t.Fatalf("the old owner claimed %d tasks after the newer raise", len(more))
	}
	if o := f.raise(Owner, 0, 1); len(o.Raised) != 0 {
		t.Fatalf("the old owner raised its fence back: %+v", o)
	}
}

// A claim given back (Unclaim) is ready again at the same attempt, whether
// it was claimed to start now or ahead of need: the executor gives back
// only claims whose handlers never ran.
func unclaimKeeps(t *testing.T, h StoreHarness) {
	f := storeFixture{h, t}
	got := f.claimed(2, 1, 1)
	res, err := f.Store().Unclaim(bounded(t), Owner, refsOf(got))
	outcomes(t, "Unclaim", res, err, claims.Applied, claims.Applied)
	for _, task := range got {
		f.expect(task.ID, tasks.Ready, 1, "a claim given back keeps its attempt")
	}
	if again := f.claim(Owner, 0, 1, 2, 2); len(again) != 2 || again[0].Attempt != 1 || again[1].Attempt != 1 {
		t.Fatalf("claimed again %+v: want both at attempt 1", again)
	}
}

// The next owner's orphan requeue spends the attempt of a claim recorded as
// started (claimed to start now, or Started later), and gives back a claim
// taken ahead of need whose handler never started with its attempt
// unspent: with one attempt each, the first are dead, the other ready.
func orphansSpendStarted(t *testing.T, h StoreHarness) {
	f := storeFixture{h, t}
	got := f.claimed(3, 1, 1) // got[0] starts now; got[1], got[2] wait ahead
	res, err := f.Store().Started(bounded(t), Owner, []claims.Ref{claims.RefOf(got[2])})
	outcomes(t, "Started", res, err, claims.Applied)
	o := f.raise(Other, 0, 2)
	if o.Requeued != 1 || o.Dead != 2 || len(o.Pending) != 0 {
		t.Fatalf("the orphan requeue answered %+v, want 1 requeued (never started) and 2 dead (started)", o)
	}
	f.expect(got[0].ID, tasks.Dead, 1, "claimed to start now: its attempt was spent")
	f.expect(got[1].ID, tasks.Ready, 1, "claimed ahead, never started: its attempt is unspent")
	f.expect(got[2].ID, tasks.Dead, 1, "claimed ahead, then Started: its attempt was spent")
}

// The stale sweep, likewise: it spends only the attempts of started claims.
func staleSpendsStarted(t *testing.T, h StoreHarness) {
	f := storeFixture{h, t}
	got := f.claimed(2, 1, 1)
	h.SweepStale(t, refsOf(got))
	f.expect(got[0].ID, tasks.Dead, 1, "a stale started claim spends its attempt")
	f.expect(got[1].ID, tasks.Ready, 1, "a stale claim taken ahead, never started, keeps its attempt")
}

// claimWrite is one write of a claim row, as the contract calls it.
type claimWrite struct {
	name  string
	write func(s executor.Store, t *testing.T, refs []claims.Ref) ([]claims.WriteResult, error)
	// ends: the write ends the claim (the task leaves running).
	ends bool
}

var claimWrites = []claimWrite{
	{name: "Heartbeat", write: func(s executor.Store, t *testing.T, refs []claims.Ref) ([]claims.WriteResult, error) {
		return s.Heartbeat(bounded(t), Owner, refs)
	}},
	{name: "Started", write: func(s executor.Store, t *testing.T, refs []claims.Ref) ([]claims.WriteResult, error) {
		return s.Started(bounded(t), Owner, refs)
	}},
	{name: "Complete", ends: true, write: func(s executor.Store, t *testing.T, refs []claims.Ref) ([]claims.WriteResult, error) {
		return s.Complete(bounded(t), Owner, each(refs, func(r claims.Ref) claims.Completion { return claims.Completion{Ref: r} }))
	}},
	{name: "Fail", ends: true, write: func(s executor.Store, t *testing.T, refs []claims.Ref) ([]claims.WriteResult, error) {
		return s.Fail(bounded(t), Owner, each(refs, func(r claims.Ref) claims.Failure { return claims.Failure{Ref: r, Error: "contract"} }))
	}},
	{name: "Interrupt", ends: true, write: func(s executor.Store, t *testing.T, refs []claims.Ref) ([]claims.WriteResult, error) {
		return s.Interrupt(bounded(t), Owner, each(refs, func(r claims.Ref) claims.Interruption {
			return claims.Interruption{Ref: r, Reason: "contract"}
		}))
	}},
	{name: "CancelAttempts", ends: true, write: func(s executor.Store, t *testing.T, refs []claims.Ref) ([]claims.WriteResult, error) {
		return s.CancelAttempts(bounded(t), Owner, each(refs, func(r claims.Ref) claims.Cancellation { return claims.Cancellation{Ref: r} }))
	}},
	{name: "Unclaim", ends: true, write: func(s executor.Store, t *testing.T, refs []claims.Ref) ([]claims.WriteResult, error) {
		return s.Unclaim(bounded(t), Owner, refs)
	}},
}

// each is one write's input per claim.
func each[T any](refs []claims.Ref, of func(claims.Ref) T) []T {
	in := make([]T, len(refs))
	for i, r := range refs {
		in[i] = of(r)
	}
	return in
}

// A write that names a claim another transaction holds does not wait for
// it: that claim is answered Busy and left as it was, the others of the
// same statement are written, and once the transaction ends the same
// write applies.
func busySkipped(t *testing.T, h StoreHarness, w claimWrite) {
	f := storeFixture{h, t}
	refs := refsOf(f.claimed(2, 3, 2))
	unlock := f.LockClaim(t, refs[0])
	res, err := w.write(f.Store(), t, refs)
	outcomes(t, w.name+" of a held claim and a free one", res, err, claims.Busy, claims.Applied)
	held := f.Task(t, refs[0].ID)
	if held.State != tasks.Running || held.Attempt != 1 || held.ClaimedBy != Owner || held.Epoch != 1 {
		t.Fatalf("the held claim's task changed: %+v", held)
	}
	if free := f.Task(t, refs[1].ID); w.ends == (free.State == tasks.Running) {
		t.Fatalf("the free claim's task is %s after %s", free.State, w.name)
	}
	unlock()
	res, err = w.write(f.Store(), t, refs[:1])
	outcomes(t, w.name+" once the transaction ended", res, err, claims.Applied)
}

// A raise skips the earlier owner's claims that a transaction holds and
// names their unit pending; claims on the unit go on meanwhile (the held
// claims are in no lane); RequeueOrphans keeps naming it while the
// transaction stays open and requeues the claim once it ended.
func pendingOrphans(t *testing.T, h StoreHarness) {
	f := storeFixture{h, t}
	orphan := f.Add(t, Kind, 0, 3)
	f.raise(Owner, 0, 1)
	got := f.claim(Owner, 0, 1, 1, 1)
	if len(got) != 1 || got[0].ID != orphan {
		t.Fatalf("claimed %+v, want task %d", got, orphan)
	}
	unlock := f.LockClaim(t, claims.RefOf(got[0]))
	next := f.Add(t, Kind, 0, 3)
	term := claims.ShardEpoch{Shard: 0, Epoch: 2}
	o := f.raise(Other, 0, 2)
	if !slices.Equal(o.Raised, []claims.ShardEpoch{term}) || !slices.Equal(o.Pending, []claims.ShardEpoch{term}) || o.Requeued+o.Dead != 0 {
		t.Fatalf("the raise answered %+v, want shard 0 raised to epoch 2 and pending", o)
	}
	if task := f.Task(t, orphan); task.State != tasks.Running || task.ClaimedBy != Owner || task.Epoch != 1 {
		t.Fatalf("the held orphan changed: %+v", task)
	}
	if claimed := f.claim(Other, 0, 2, 10, 10); len(claimed) != 1 || claimed[0].ID != next {
		t.Fatalf("the new owner claimed %+v meanwhile, want task %d", claimed, next)
	}
	s := f.Store()
	o, err := s.RequeueOrphans(bounded(t), Other, f.Group(), []claims.ShardEpoch{term})
	if err != nil || !slices.Equal(o.Pending, []claims.ShardEpoch{term}) || o.Requeued != 0 {
		t.Fatalf("RequeueOrphans with the claim still held: %+v, %v; want it pending still", o, err)
	}
	unlock()
	o, err = s.RequeueOrphans(bounded(t), Other, f.Group(), []claims.ShardEpoch{term})
	if err != nil || len(o.Pending) != 0 || o.Requeued != 1 {
		t.Fatalf("RequeueOrphans once the transaction ended: %+v, %v; want the orphan requeued, none pending", o, err)
	}
	f.expect(orphan, tasks.Ready, 2, "the orphan's started attempt was spent")
	o, err = s.RequeueOrphans(bounded(t), Other, f.Group(), []claims.ShardEpoch{term})
	if err != nil || len(o.Pending) != 0 || o.Requeued+o.Dead+o.Completed != 0 {
		t.Fatalf("RequeueOrphans with nothing left: %+v, %v", o, err)
	}
}

// A handler completes its task in its own transaction (CompleteTx): while
// that transaction is open the runner's completion is Busy and the task
// still running; once it committed, the runner's write is answered
// Completed and the task is completed with the handler's result.
func completedInTx(t *testing.T, h StoreHarness) {
	f := storeFixture{h, t}
	id := f.Add(t, Kind, 0, 3)
	f.raise(Owner, 0, 1)
	got := f.claim(Owner, 0, 1, 1, 1)
	ref := claims.RefOf(got[0])
	commit := f.CompleteInTx(t, ref, json.RawMessage(`{"by":"handler"}`))
	res, err := f.Store().Complete(bounded(t), Owner, []claims.Completion{{Ref: ref}})
	outcomes(t, "Complete while the handler's transaction is open", res, err, claims.Busy)
	f.expect(id, tasks.Running, 1, "the handler's transaction is open")
	commit()
	res, err = f.Store().Complete(bounded(t), Owner, []claims.Completion{{Ref: ref}})
	outcomes(t, "Complete once the handler's transaction committed", res, err, claims.Completed)
	task := f.Task(t, id)
	var result map[string]string
	if task.State != tasks.Completed || json.Unmarshal(task.Result, &result) != nil || result["by"] != "handler" {
		t.Fatalf("task %+v: want completed with the handler's result", task)
	}
}

// The runner is gone before it wrote the completion its handler recorded:
// the next owner's orphan requeue completes the task, and spends nothing.
func orphanCompletedInTx(t *testing.T, h StoreHarness) {
	f := storeFixture{h, t}
	id := f.Add(t, Kind, 0, 1)
	f.raise(Owner, 0, 1)
	got := f.claim(Owner, 0, 1, 1, 1)
	f.CompleteInTx(t, claims.RefOf(got[0]), json.RawMessage(`{"by":"handler"}`))()
	o := f.raise(Other, 0, 2)
	if o.Completed != 1 || o.Requeued+o.Dead != 0 || len(o.Pending) != 0 {
		t.Fatalf("the orphan requeue answered %+v, want 1 completed", o)
	}
	f.expect(id, tasks.Completed, 1, "completed by the handler's transaction")
}
