package store_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// queueRow reports whether queue name has its row.
func queueRow(t *testing.T, s *store.Store, name string) bool {
	t.Helper()
	var ok bool
	if err := s.Pool().QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM queues WHERE name = $1)`, name).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

func claimQueue(t *testing.T, s *store.Store, shard int, queue string) []tasks.Task {
	t.Helper()
	got, err := s.Claim(context.Background(), "a", []claims.ShardEpoch{{Shard: shard, Epoch: 1}}, queue, []string{"k"}, 10, 10)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// A queue is removed only when it holds no unfinished task, and comes back
// when a task is enqueued in it again; the default queue and a queue
// without a row are refused.
func TestDeleteQueue(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 4, 1)
	if _, err := s.DeleteQueue(ctx, tasks.DefaultQueue); !errors.Is(err, store.ErrDefaultQueue) {
		t.Fatalf("removing the default queue: %v, want ErrDefaultQueue", err)
	}
	if _, err := s.DeleteQueue(ctx, "never"); !errors.Is(err, store.ErrNoSuchQueue) {
		t.Fatalf("removing a queue that never existed: %v, want ErrNoSuchQueue", err)
	}
	inUse := func(want store.QueueWork) {
		t.Helper()
		_, err := s.DeleteQueue(ctx, "mail")
		var e *store.QueueInUseError
		if !errors.As(err, &e) || e.Work != want {
			t.Fatalf("removing queue mail: %v, want it refused with %+v", err, want)
		}
	}
	in := insert("k", 4, 1)
	in.Queue = "mail"
	first := enqueue(t, s, in)
	in.Key, in.SequenceKey = "s", "seq"
	head := enqueue(t, s, in)
	enqueue(t, s, in)
	inUse(store.QueueWork{Ready: 2, Waiting: 1})
	got := claimQueue(t, s, 4, "mail")
	if len(got) != 2 {
		t.Fatalf("claimed %d tasks of mail, want 2", len(got))
	}
	inUse(store.QueueWork{Waiting: 1, Running: 2})
	for _, task := range got {
		one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(task)}}))
	}
	inUse(store.QueueWork{Ready: 1})
	last := claimQueue(t, s, 4, "mail")
	if len(last) != 1 || last[0].ID == first || last[0].ID == head {
		t.Fatalf("claimed %+v, want the sequence's second task", last)
	}
	one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(last[0])}}))
	if _, err := s.SetQueuePaused(ctx, "mail", true); err != nil {
		t.Fatal(err)
	}
	removed, err := s.DeleteQueue(ctx, "mail")
	if err != nil || removed.Name != "mail" || removed.PausedAt == nil || removed.CreatedAt.IsZero() {
		t.Fatalf("removing the finished queue mail: %+v %v", removed, err)
	}
	if queueRow(t, s, "mail") {
		t.Fatal("queue mail still has its row")
	}
	if _, err := s.DeleteQueue(ctx, "mail"); !errors.Is(err, store.ErrNoSuchQueue) {
		t.Fatalf("removing it twice: %v, want ErrNoSuchQueue", err)
	}
	if task := get(t, s, first); task.State != tasks.Completed || task.Queue != "mail" {
		t.Fatalf("a finished task of the removed queue: %+v", task)
	}
	// Enqueued into again, it comes back, not paused.
	in = insert("k", 4, 1)
	in.Queue = "mail"
	again := enqueue(t, s, in)
	if !queueRow(t, s, "mail") {
		t.Fatal("queue mail has no row after an enqueue")
	}
	if got := claimQueue(t, s, 4, "mail"); len(got) != 1 || got[0].ID != again {
		t.Fatalf("claimed %+v after the queue came back, want task %d", got, again)
	}
}

// A queue removed while a producer's transaction that enqueues into it is
// open, in both orders. Its trigger found the queue's row before the
// removal (an INSERT … ON CONFLICT DO NOTHING that takes no lock), and the
// removal could not see its tasks, not yet committed: the removal committed,
// then the task, and the claim, which read the queue's row to check the
// pause, never took it. Now the claim does not need the row (a missing row
// is a queue not paused) and a removal cannot overlap an enqueue into the
// queue (an advisory lock, shared by producers, taken by the removal): the
// queue keeps its row whenever it has tasks, and its tasks run.
func TestRemovingAQueueRacingAnEnqueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	produce := func(t *testing.T, dsn string) (pgx.Tx, func()) {
		t.Helper()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return tx, func() { _ = conn.Close(ctx) }
	}
	insertMail := `INSERT INTO tasks (kind, shard, key, queue) VALUES ('k', 3, 'x', 'mail')`
	check := func(t *testing.T, s *store.Store) {
		t.Helper()
		if got := claimQueue(t, s, 3, "mail"); len(got) != 1 {
			t.Fatalf("the enqueued task of queue mail was not claimed (%d claimed): its queue was removed under it", len(got))
		}
		if !queueRow(t, s, "mail") {
			t.Fatal("queue mail has a task and no row: the listing does not show it")
		}
	}

	t.Run("enqueue first", func(t *testing.T) {
		t.Parallel()
		s, dsn := setupDSN(t)
		raise(t, s, "a", 3, 1)
		exec(t, s, `INSERT INTO queues (name) VALUES ('mail')`)
		tx, done := produce(t, dsn)
		defer done()
		if _, err := tx.Exec(ctx, insertMail); err != nil {
			t.Fatal(err)
		}
		removal := async(func() error { _, err := s.DeleteQueue(ctx, "mail"); return err })
		err, answered := awaitDoneOrWaiting(t, s, removal, 1)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if !answered {
			err = result(t, removal)
		}
		if e := (*store.QueueInUseError)(nil); !errors.As(err, &e) {
			t.Errorf("the removal of a queue a transaction was enqueueing into answered %v, want it refused", err)
		}
		check(t, s)
	})

	t.Run("removal first", func(t *testing.T) {
		t.Parallel()
		s, dsn := setupDSN(t)
		raise(t, s, "a", 3, 1)
		exec(t, s, `INSERT INTO queues (name) VALUES ('mail')`)
		// The removal stops at its commit, its row deleted, until the gate
		// opens: a deferred trigger waits for an advisory lock the test
		// holds.
		gate, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer gate.Close(ctx)
		const key = 8642
		if _, err := gate.Exec(ctx, `SELECT pg_advisory_lock($1)`, key); err != nil {
			t.Fatal(err)
		}
		exec(t, s, `CREATE FUNCTION test_queue_gate() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN PERFORM pg_advisory_xact_lock_shared(8642); RETURN NULL; END $$`)
		exec(t, s, `CREATE CONSTRAINT TRIGGER zz_test_queue_gate AFTER DELETE ON queues
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_queue_gate()`)
		removal := async(func() error { _, err := s.DeleteQueue(ctx, "mail"); return err })
		awaitWaiting(t, s, 1)
		tx, done := produce(t, dsn)
		defer done()
		enqueued := async(func() error { _, err := tx.Exec(ctx, insertMail); return err })
		if err, answered := awaitDoneOrWaiting(t, s, enqueued, 2); answered && err != nil {
			t.Fatal(err)
		}
		if _, err := gate.Exec(ctx, `SELECT pg_advisory_unlock($1)`, key); err != nil {
			t.Fatal(err)
		}
		if err := result(t, removal); err != nil {
			t.Fatalf("the removal of an idle queue: %v", err)
		}
		if err := result(t, enqueued); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		check(t, s)
	})
}

// A task of a removed queue that an operator retries is claimed, and its
// queue is back.
func TestRetryingATaskOfARemovedQueue(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 5, 1)
	in := insert("k", 5, 1)
	in.Queue = "mail"
	id := enqueue(t, s, in)
	if _, err := s.CancelTask(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := s.DeleteQueue(ctx, "mail"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.RetryTask(ctx, id); err != nil {
		t.Fatal(err)
	}
	if !queueRow(t, s, "mail") {
		t.Error("queue mail has a retried task and no row")
	}
	if got := claimQueue(t, s, 5, "mail"); len(got) != 1 || got[0].ID != id {
		t.Fatalf("claimed %+v, want the retried task %d", got, id)
	}
}

// A claim does not need its queue's row: a queue whose row is gone (deleted
// by hand) is not paused, and its tasks are claimed.
func TestClaimsDoNotNeedTheQueueRow(t *testing.T) {
	t.Parallel()
	s := setup(t)
	raise(t, s, "a", 6, 1)
	in := insert("k", 6, 1)
	in.Queue = "mail"
	id := enqueue(t, s, in)
	exec(t, s, `DELETE FROM queues WHERE name = 'mail'`)
	got := claimQueue(t, s, 6, "mail")
	if len(got) != 1 || got[0].ID != id {
		t.Fatalf("claimed %+v from a queue without its row, want task %d", got, id)
	}
	// The layout check at the test's end would report the queue.
	one(t)(s.Complete(context.Background(), "a", []claims.Completion{{Ref: claims.RefOf(got[0])}}))
}

// The layout's check reports a queue with unfinished tasks and no row.
func TestLayoutViolationOfAQueueWithoutItsRow(t *testing.T) {
	t.Parallel()
	s := setup(t)
	in := insert("k", 6, 1)
	in.Queue = "mail"
	id := enqueue(t, s, in)
	exec(t, s, `DELETE FROM queues WHERE name = 'mail'`)
	var problem string
	if err := s.Pool().QueryRow(context.Background(), `SELECT problem FROM shardrun_layout_violations()`).Scan(&problem); err != nil ||
		problem != "1 tasks of queue mail, which has no row" {
		t.Fatalf("violations: %q %v", problem, err)
	}
	if _, err := s.CancelTask(context.Background(), id); err != nil {
		t.Fatal(err)
	}
}

// A producer's transaction that enqueues into many queues takes few
// removal locks: the locks are shared by the queue names that hash alike,
// 64 in all, so a batch (or a COPY) over thousands of queue names cannot
// fill the server's lock table, which every session's locks share
// (max_locks_per_transaction × max_connections entries).
func TestEnqueueIntoManyQueuesTakesFewLocks(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	tx, err := s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO tasks (kind, shard, key, queue) SELECT 'k', 0, g::text, 'q' || g FROM generate_series(1, 1000) g`); err != nil {
		t.Fatal(err)
	}
	var locks int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`).Scan(&locks); err != nil {
		t.Fatal(err)
	}
	if locks > 64 {
		t.Fatalf("an insert into 1,000 queues holds %d advisory locks, want at most 64", locks)
	}
}
