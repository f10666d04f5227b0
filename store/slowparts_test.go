package store_test

// The store under slow parts (issue 39): a transaction nobody controls — a
// handler's after CompleteTx, a producer's, one a frozen process left open
// — holds no lock that anything but its own task waits for. Each test
// forces the interleaving against a real PostgreSQL and observes waits in
// pg_stat_activity (race_test.go), never by time.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// mustNotWait runs f and fails the test if it waits on a lock before it
// answers: what must proceed while a transaction is open.
func mustNotWait(t *testing.T, s *store.Store, what string, f func() error) {
	t.Helper()
	err, done := awaitDoneOrWaiting(t, s, async(f), 1)
	if !done {
		t.Fatalf("%s waits for a lock the open transaction holds", what)
	}
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// openCompletion opens a handler's transaction that records task's
// completion (CompleteTx) with result and stays open; the caller commits
// or rolls it back.
func openCompletion(t *testing.T, s *store.Store, owner string, task tasks.Task, result string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	res, err := s.CompleteTx(ctx, tx, owner, claims.Completion{Ref: claims.RefOf(task), Result: json.RawMessage(result)})
	if err != nil || res.Outcome != claims.Applied {
		t.Fatalf("completing task %d in a transaction: %+v %v", task.ID, res, err)
	}
	return tx
}

// Defects 7 and 8: a handler's transaction that recorded its completion
// and has not committed stalled its runner's heartbeats (the heartbeat of
// every attempt waited on the claim row it held), producers of its
// sequence (at their commit) and the next owner's fence raise, hence its
// claims on every shard. Now everything but the task's own end proceeds,
// and the task is completed with the recorded result once the transaction
// commits, by whoever comes back to its claim.
func TestAnOpenHandlerTransactionStallsOnlyItsTask(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 1)
	raise(t, s, "a", 2, 1)
	seq := insert("k", 1, 3)
	seq.SequenceKey = "orders/42"
	held := get(t, s, enqueue(t, s, seq))
	other := enqueue(t, s, insert("k", 1, 3))
	elsewhere := enqueue(t, s, insert("k", 2, 3))
	got := append(claim(t, s, "a", 1, 1, 10), claim(t, s, "a", 2, 1, 10)...)
	if len(got) != 3 {
		t.Fatalf("claimed %d tasks, want 3", len(got))
	}
	byID := map[int64]tasks.Task{}
	var refs []claims.Ref
	for _, task := range got {
		byID[task.ID] = task
		refs = append(refs, claims.RefOf(task))
	}
	tx := openCompletion(t, s, "a", byID[held.ID], `{"charged":true}`)

	mustNotWait(t, s, "the runner's heartbeat", func() error {
		res, err := s.Heartbeat(ctx, "a", refs)
		for _, r := range res {
			want := claims.Applied
			if r.Ref.ID == held.ID {
				want = claims.Busy
			}
			if r.Outcome != want {
				return fmt.Errorf("heartbeat of task %d: %v, want %v", r.Ref.ID, r.Outcome, want)
			}
		}
		return err
	})
	mustNotWait(t, s, "a producer of the same sequence", func() error {
		return pgx.BeginFunc(ctx, s.Pool(), func(ptx pgx.Tx) error {
			_, err := s.EnqueueIn(ctx, ptx, seq)
			return err
		})
	})
	mustNotWait(t, s, "the runner's completion of another task", func() error {
		if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(byID[other])}})); r.Outcome != claims.Applied {
			return errors.New("completion of the other task: " + r.Outcome.String())
		}
		return nil
	})
	terms := []claims.ShardEpoch{{Shard: 1, Epoch: 2}, {Shard: 2, Epoch: 2}}
	var o claims.Orphans
	mustNotWait(t, s, "the next owner's fence raise", func() error {
		var err error
		o, err = s.RaiseFences(ctx, "b", "", terms)
		return err
	})
	if len(o.Raised) != 2 || o.Requeued != 1 || !slices.Equal(o.Pending, terms[:1]) {
		t.Fatalf("raise while the handler's transaction is open: %+v, want both raised, one requeued, shard 1 pending", o)
	}
	mustNotWait(t, s, "the next owner's claim", func() error {
		if got := claim(t, s, "b", 2, 2, 10); len(got) != 1 || got[0].ID != elsewhere {
			return errors.New("the next owner claimed nothing on the shard it took over")
		}
		return nil
	})
	mustNotWait(t, s, "the stale sweep", func() error {
		_, _, err := s.SweepStale(ctx, leaderEpoch, 0, 100, store.Backoff{Base: time.Millisecond, Cap: time.Second})
		return err
	})

	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	o, err := s.RequeueOrphans(ctx, "b", "", terms)
	if err != nil || o.Completed != 1 || len(o.Pending) != 0 {
		t.Fatalf("requeue after the commit: %+v %v, want the held task completed", o, err)
	}
	task := get(t, s, held.ID)
	if task.State != tasks.Completed || task.Attempt != 1 || string(task.Result) != `{"charged": true}` {
		t.Fatalf("the held task: %s attempt %d result %s, want completed at attempt 1 with the recorded result", task.State, task.Attempt, task.Result)
	}
}

// A handler's transaction that outlives its bound after CompleteTx, idle
// (a frozen process, a forgotten commit) or busy, is ended by PostgreSQL:
// its writes and the mark roll back, and the next owner's requeue, coming
// back to the claim, retries the attempt like any lost one.
func TestAHandlerTransactionIsEndedAfterItsBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, _ := pgtest.NewStore(t, store.Options{MaxConns: 8, HandlerTxTimeout: 200 * time.Millisecond})
	if ok, err := s.RaiseLeaderFence(ctx, "test-coordinator", leaderEpoch); err != nil || !ok {
		t.Fatalf("raising the coordinator fence: %v %v", ok, err)
	}
	raise(t, s, "a", 3, 1)
	idle := enqueue(t, s, insert("k", 3, 3))
	busy := enqueue(t, s, insert("k", 3, 3))
	got := claim(t, s, "a", 3, 1, 10)
	if len(got) != 2 {
		t.Fatalf("claimed %d tasks, want 2", len(got))
	}
	byID := map[int64]tasks.Task{got[0].ID: got[0], got[1].ID: got[1]}
	idleTx := openCompletion(t, s, "a", byID[idle], `{}`)
	busyTx := openCompletion(t, s, "a", byID[busy], `{}`)
	_, err := busyTx.Exec(ctx, `SELECT pg_sleep(30)`)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "57014" {
		t.Fatalf("a statement after CompleteTx past the bound: %v, want it cancelled (57014)", err)
	}
	term := []claims.ShardEpoch{{Shard: 3, Epoch: 2}}
	o, err := s.RaiseFences(ctx, "b", "", term)
	if err != nil || len(o.Raised) != 1 {
		t.Fatalf("raise: %+v %v", o, err)
	}
	requeued := o.Requeued
	testutil.Until(t, 10*time.Second, "the idle transaction ended by the server", func() (bool, string) {
		o, err := s.RequeueOrphans(ctx, "b", "", term)
		if err != nil {
			return false, err.Error()
		}
		requeued += o.Requeued
		return len(o.Pending) == 0, "orphans still held"
	})
	// The busy transaction, aborted by its cancelled statement, sat idle
	// holding the claim until the same bound ended it.
	if requeued != 2 {
		t.Fatalf("requeued %d, want both tasks once their transactions were ended", requeued)
	}
	if err := idleTx.Commit(ctx); err == nil {
		t.Fatal("the transaction ended by the server committed")
	}
	for _, id := range []int64{idle, busy} {
		if task := get(t, s, id); task.State != tasks.Ready || task.Attempt != 2 {
			t.Fatalf("task %d after its transaction was ended: %s attempt %d, want ready at attempt 2", id, task.State, task.Attempt)
		}
	}
}

// Defect 5's store side: a task claimed ahead of need whose handler never
// started keeps its attempt whoever ends its claim — the next owner's
// orphan requeue or the stale sweep — and one whose start was recorded
// spends it, as a task that started at its claim does.
func TestAClaimAheadKeepsItsAttemptUntilItStarts(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 4, 1)
	for range 4 {
		enqueue(t, s, insert("k", 4, 1))
	}
	// One starts at once, three wait ahead; then one of those starts.
	got, err := s.Claim(ctx, "a", []claims.ShardEpoch{{Shard: 4, Epoch: 1}}, tasks.DefaultQueue, []string{"k"}, 4, 1)
	if err != nil || len(got) != 4 {
		t.Fatalf("claim: %d tasks, %v", len(got), err)
	}
	if r := one(t)(s.Started(ctx, "a", []claims.Ref{claims.RefOf(got[1])})); r.Outcome != claims.Applied {
		t.Fatalf("recording the start of a task claimed ahead: %v", r.Outcome)
	}
	if _, _, err := s.SweepStale(ctx, leaderEpoch, 0, 1, store.Backoff{Base: time.Millisecond, Cap: time.Second}); err != nil {
		t.Fatal(err)
	}
	o, err := s.RaiseFences(ctx, "b", "", []claims.ShardEpoch{{Shard: 4, Epoch: 2}})
	if err != nil || len(o.Pending) != 0 {
		t.Fatalf("raise: %+v %v", o, err)
	}
	for i, task := range got {
		want := tasks.Ready
		if i < 2 { // started: its one attempt is spent
			want = tasks.Dead
		}
		if after := get(t, s, task.ID); after.State != want || after.Attempt != 1 {
			t.Fatalf("task %d (claimed %s) after the stale sweep and the requeue: %s attempt %d, want %s at attempt 1",
				i, map[bool]string{true: "to start", false: "ahead"}[i < 2], after.State, after.Attempt, want)
		}
	}
}

// CompleteTx marks its attempt once: again in the same transaction it
// applies; from another transaction, once the first committed, it is
// refused as recorded already (the second transaction must not commit its
// writes again); and the runner's own write of the attempt afterwards,
// whatever the handler returned, completes the task with the result
// recorded with the writes.
func TestCompleteTxMarksItsAttemptOnce(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 6, 1)
	id := enqueue(t, s, insert("k", 6, 3))
	task := claim(t, s, "a", 6, 1, 1)[0]
	tx := openCompletion(t, s, "a", task, `{"n":1}`)
	if res, err := s.CompleteTx(ctx, tx, "a", claims.Completion{Ref: claims.RefOf(task), Result: json.RawMessage(`{"n":2}`)}); err != nil || res.Outcome != claims.Applied {
		t.Fatalf("CompleteTx again in the same transaction: %+v %v", res, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
		res, err := s.CompleteTx(ctx, tx, "a", claims.Completion{Ref: claims.RefOf(task)})
		if err == nil && res.Outcome != claims.Completed {
			t.Errorf("CompleteTx in a second transaction: %v, want completed (recorded already)", res.Outcome)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	r := one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(task), Error: "the handler failed after its commit"}}))
	if r.Outcome != claims.Completed {
		t.Fatalf("the runner's failure of an attempt whose completion committed: %v, want completed", r.Outcome)
	}
	if after := get(t, s, id); after.State != tasks.Completed || string(after.Result) != `{"n": 2}` || len(after.Errors) != 0 {
		t.Fatalf("task: %s result %s errors %v, want completed with the recorded result", after.State, after.Result, after.Errors)
	}
}

// A producer's transaction that enqueues into a queue nobody used before
// and stays open does not hold up the other producers of that queue: the
// queue's row is filed before the transaction inserts, by a statement that
// commits at once.
func TestAProducerOfANewQueueStallsNoOtherProducer(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	in := insert("k", 7, 3)
	in.Queue = "brand-new"
	tx, err := s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := s.EnqueueIn(ctx, tx, in); err != nil {
		t.Fatal(err)
	}
	mustNotWait(t, s, "another producer of the new queue", func() error {
		_, err := s.Enqueue(ctx, in)
		return err
	})
	mustNotWait(t, s, "a producer's transaction into the new queue", func() error {
		return pgx.BeginFunc(ctx, s.Pool(), func(ptx pgx.Tx) error {
			_, err := s.EnqueueBatchIn(ctx, ptx, []store.Insert{in, in})
			return err
		})
	})
}

// A producer's transaction that filed a queue's row itself (raw SQL, or an
// operator removed the queue between the store's filing and the insert)
// enqueues into that queue again through the store: the store's own
// filing of the row must not wait for the row the transaction holds (it
// would wait for its own transaction: before, it failed after the pool's
// lock_timeout, and the stress test hit it).
func TestAProducerTransactionHoldingItsQueueRowEnqueuesAgain(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO tasks (kind, shard, key, queue) VALUES ('k', 1, 'raw', 'raw-queue')`); err != nil {
			return err
		}
		in := insert("k", 1, 3)
		in.Queue = "raw-queue"
		_, err := s.EnqueueIn(ctx, tx, in)
		return err
	})
	if err != nil {
		t.Fatalf("enqueueing into the queue whose row the transaction holds: %v", err)
	}
}
