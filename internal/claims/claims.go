// Package claims is the protocol between a runner's executor and the
// store: what a runner writes about the attempts it claimed (completions,
// failures, interruptions, cancellations) and what the store answers for
// each (WriteResult). Both sides import it, so that the executor needs
// neither the store nor the shard manager, and the public task vocabulary
// (package tasks) holds only what producers and handlers use.
package claims

import (
	"encoding/json"
	"time"

	"github.com/shardrun/shardrun/internal/enum"
	"github.com/shardrun/shardrun/tasks"
)

// Ref identifies a claimed attempt: the task, its shard, the attempt number
// and the epoch under which it was claimed. Every write about the attempt
// is fenced on all four.
type Ref struct {
	ID      int64
	Shard   int
	Attempt int
	Epoch   int64
}

// RefOf is the attempt of t, a claimed task, that a write names.
func RefOf(t tasks.Task) Ref {
	return Ref{ID: t.ID, Shard: t.Shard, Attempt: t.Attempt, Epoch: t.Epoch}
}

// ShardEpoch is one owned shard (of the runner's group) and the epoch of
// its ownership.
type ShardEpoch struct {
	Shard int
	Epoch int64
}

// DefaultHeartbeatInterval is the runners' default task heartbeat
// interval. The leader's sweeper checks its stale threshold against the
// same default, so it is defined once, here, on the protocol between them.
const DefaultHeartbeatInterval = 5 * time.Second

// Outcome says what a fenced write did to one task.
type Outcome int

const (
	// Applied: the row changed as asked.
	Applied Outcome = iota
	// FenceLost: the shard's fence is no longer the writer's epoch (or was
	// never raised by it). The writer has lost the shard and must stop all
	// its work on it.
	FenceLost
	// TaskMoved: the fence is still the writer's, but the task is no longer
	// this running attempt of this claim (a sweep requeued it, or it already
	// finished). Nothing changed; the attempt's result is dropped.
	TaskMoved
	// TaskGone: no such task.
	TaskGone
	// Completed: this attempt's completion is recorded already, by the
	// handler in its own transaction (shardrun.CompleteTx); the write
	// changed nothing and the attempt counts as completed.
	Completed
	// Busy: the claim row is locked by another transaction that has not
	// ended (a handler's transaction after CompleteTx, or another write of
	// the same claim at that instant). The write skipped it and changed
	// nothing; the claim is still the writer's. Write again later: no
	// write waits for a transaction it does not control.
	Busy
)

var outcomeNames = []string{Applied: "applied", FenceLost: "fence_lost", TaskMoved: "task_moved", TaskGone: "task_gone",
	Completed: "completed", Busy: "busy"}

func (o Outcome) String() string { return enum.Name(o, outcomeNames, "outcome") }

// WriteResult is the outcome of a fenced write for one task. State is the
// task's state after the write when it applied. CancelRequested, when it
// applied, says that an operator asked to cancel the task: a heartbeat that
// sees it cancels the attempt.
type WriteResult struct {
	Ref             Ref
	Outcome         Outcome
	State           tasks.State
	CancelRequested bool
}

// Orphans is what a fence raise (Raised set) or a later requeue of the
// claims earlier owners of a unit left did.
type Orphans struct {
	// Raised are the terms whose fence now holds their epoch (RaiseFences
	// only): work may be claimed there.
	Raised []ShardEpoch
	// Requeued claims went back to ready (attempt+1, or the same attempt
	// when their handler never started), Dead ones had used up their
	// attempts, and Completed ones had their completion recorded by their
	// handler's own transaction (CompleteTx) and were completed.
	Requeued, Dead, Completed int64
	// Pending are the raised terms where some earlier claims were locked by
	// a transaction still open and were skipped: requeue them again later
	// (RequeueOrphans) until none is pending.
	Pending []ShardEpoch
	// Moved are terms the database does not hold (its placement row of the
	// shard is not held: the shard moved, or is moving, to another
	// database): neither raised nor lost. Raise them again once the shard
	// → database map has changed (the router sends the raise to the
	// shard's new database). RequeueOrphans names such terms Pending too.
	Moved []ShardEpoch
	// Unreached are terms whose database could not be reached (a cluster
	// of several databases, one of them down): neither raised nor lost.
	// Raise them again later.
	Unreached []ShardEpoch
}

// PartialError is the error of a statement that spans several databases
// (a claim of terms whose shards live in two of them) and failed at some
// of them: what the others answered is returned with it. Terms are the
// terms sent to the databases that failed: a claim sent there may have
// committed without its answer arriving, so only their claims need the
// "unsure" recovery (Claimed, then Unclaim of what nobody runs).
type PartialError struct {
	Terms []ShardEpoch
	// Err names each database that failed and why.
	Err error
}

func (e *PartialError) Error() string { return "partly failed: " + e.Err.Error() }

func (e *PartialError) Unwrap() error { return e.Err }

// Completion is a successful attempt to record.
type Completion struct {
	Ref    Ref
	Result json.RawMessage // nil for no result
}

// Interruption is an attempt cut short because its runner lost the shard,
// to record without spending the attempt. Reason says what ended it.
type Interruption struct {
	Ref    Ref
	Reason string
}

// Backoff is the retry policy's backoff between attempts: the store waits
// shardrun_backoff(attempt, Base, Cap) (sql/shardrun_backoff.sql, the one
// formula) after a failed attempt and after a stale claim alike.
type Backoff struct {
	Base time.Duration
	Cap  time.Duration
}

// Failure is a failed attempt to record. Backoff decides the wait before the
// next attempt when attempts are left. Final buries the task (dead) whatever
// attempts are left: the handler said no retry can succeed. Expired ends it
// failed, as the sweeper's deadline rule does: the task's deadline passed,
// so no attempt may follow.
type Failure struct {
	Ref     Ref
	Error   string
	Backoff Backoff
	Final   bool
	Expired bool
}

// Cancellation is an attempt cancelled on request, to record: Error is what
// the handler returned after its context was cancelled ("" for nil).
type Cancellation struct {
	Ref   Ref
	Error string
}
