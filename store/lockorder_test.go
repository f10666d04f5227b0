package store_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// A retry locked its tasks' sequences in two rounds (those it retried, then
// every one whose record it locked), so a key of the second round that
// sorts before one of the first was taken out of key order, and a
// transaction taking the same two sequences in key order deadlocked with
// it. Found by TestLayoutUnderStress at 20,000 moves.
func TestRetryLocksItsSequencesInKeyOrder(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	raise(t, s, "a", 12, 1)
	// a2: cancelled, in sequence "k2" (retried); b1: ready, the head of
	// "k1" (refused: unfinished, but its record is locked).
	a2 := enqueue(t, s, seqInsert("k2", 12, false))
	if _, err := s.CancelTask(ctx, a2); err != nil {
		t.Fatal(err)
	}
	b1 := enqueue(t, s, seqInsert("k1", 12, false))
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after the commit below, a no-op
	if _, err := tx.Exec(ctx, `SELECT shardrun_lock_sequences(ARRAY['k1'])`); err != nil {
		t.Fatal(err)
	}
	retried := async(func() error {
		_, err := s.Pool().Exec(ctx, `SELECT * FROM shardrun_retry(ARRAY[$1::bigint, $2::bigint], false)`, a2, b1)
		return err
	})
	awaitWaiting(t, s, 1)
	// In key order, as every statement takes sequences: k2 now.
	_, errTx := tx.Exec(ctx, `SELECT shardrun_lock_sequences(ARRAY['k2'])`)
	if errTx == nil {
		errTx = tx.Commit(ctx)
	}
	errRetry := result(t, retried)
	if isDeadlock(errTx) || isDeadlock(errRetry) {
		t.Fatalf("deadlock: the other transaction %v, the retry %v", errTx, errRetry)
	}
	if errTx != nil || errRetry != nil {
		t.Fatalf("the other transaction %v, the retry %v", errTx, errRetry)
	}
	if got, err := s.Get(ctx, a2); err != nil || got.State != tasks.Ready {
		t.Fatalf("the retried task: %+v, %v", got, err)
	}
}

// A cancel took lane entries out through a join, in the join's order (task
// ids), while a claim deletes them by ctid, in ctid order: with a task
// requeued after a later one (its entry now after the other's), the two
// took the same two entries in opposite orders and deadlocked.
func TestCancelAndClaimTakeLaneEntriesInOneOrder(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	raise(t, s, "a", 13, 1)
	low := enqueue(t, s, insert("k", 13, 3))
	high := enqueue(t, s, insert("k", 13, 3))
	// low is claimed and handed back: its entry is now after high's.
	got := claim(t, s, "a", 13, 1, 1)
	if len(got) != 1 || got[0].ID != low {
		t.Fatalf("claim: %+v", got)
	}
	if _, err := s.Unclaim(ctx, "a", []claims.Ref{claims.RefOf(got[0])}); err != nil {
		t.Fatal(err)
	}
	// A third transaction holds high's entry, the first a claim deletes.
	release := holdRow(t, dsn, `SELECT 1 FROM task_ready WHERE id = $1 FOR UPDATE`, high)
	claimed := async(func() error {
		_, err := s.Claim(ctx, "a", []claims.ShardEpoch{{Shard: 13, Epoch: 1}}, tasks.DefaultQueue, []string{"k"}, 10, 10)
		return err
	})
	awaitWaiting(t, s, 1)
	cancelled := async(func() error {
		_, err := s.Pool().Exec(ctx, `SELECT * FROM shardrun_cancel(ARRAY[$1::bigint, $2::bigint], false)`, low, high)
		return err
	})
	if err, done := awaitDoneOrWaiting(t, s, cancelled, 2); done {
		t.Fatalf("the cancel did not wait for the held entry: %v", err)
	}
	release()
	errClaim, errCancel := result(t, claimed), result(t, cancelled)
	if isDeadlock(errClaim) || isDeadlock(errCancel) {
		t.Fatalf("deadlock: claim %v, cancel %v", errClaim, errCancel)
	}
	if errClaim != nil || errCancel != nil {
		t.Fatalf("claim %v, cancel %v", errClaim, errCancel)
	}
}
