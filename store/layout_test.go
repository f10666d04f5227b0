package store_test

// The defects a review of the task layout and of sequences found (issue
// 32), each reproduced against a real PostgreSQL with the aids of
// race_test.go, and each fixed by the layout's one place for every move
// (moves.go) and its one lock order.

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// setupDSN is setup, with the database's URL for the race aids.
func setupDSN(t testing.TB) (*store.Store, string) {
	t.Helper()
	s, dsn := pgtest.NewStore(t, store.Options{MaxConns: 20})
	if ok, err := s.RaiseLeaderFence(context.Background(), "test-coordinator", leaderEpoch); err != nil || !ok {
		t.Fatalf("raising the coordinator fence: %v %v", ok, err)
	}
	return s, dsn
}

// sequenceOf enqueues n tasks of sequence key on shard (blocking on
// failure) and claims the head as runner "a" at epoch 1.
func sequenceOf(t *testing.T, s *store.Store, key string, shard, n, maxAttempts int) (head tasks.Task, waiting []int64) {
	t.Helper()
	raise(t, s, "a", shard, 1)
	var ids []int64
	for range n {
		in := seqInsert(key, shard, false)
		in.MaxAttempts = maxAttempts
		ids = append(ids, enqueue(t, s, in))
	}
	got := claim(t, s, "a", shard, 1, 10)
	if len(got) != 1 || got[0].ID != ids[0] {
		t.Fatalf("claim of a sequence of %d: %+v, want its head %d alone", n, got, ids[0])
	}
	return got[0], ids[1:]
}

// claimedIDs are the ids of what a claim of shard took.
func claimedIDs(t *testing.T, s *store.Store, shard int) []int64 {
	t.Helper()
	var ids []int64
	for _, c := range claim(t, s, "a", shard, 1, 100) {
		ids = append(ids, c.ID)
	}
	return ids
}

// Defect 1: retention deleted a blocked head. task_sequences then pointed
// at a deleted task; its waiting tasks, and every later enqueue of the
// key, waited forever.
func TestRetentionKeepsABlockedHead(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	head, waiting := sequenceOf(t, s, "blocked", 3, 2, 1)
	if r := one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(head), Error: "boom"}})); r.State != tasks.Dead {
		t.Fatalf("the head's last attempt failed: %v, want dead", r.State)
	}
	exec(t, s, `UPDATE tasks SET finished_at = now() - interval '1 day' WHERE id = $1`, head.ID)
	exec(t, s, `UPDATE task_finished SET finished_at = now() - interval '1 day' WHERE id = $1`, head.ID)
	if n, err := s.DeleteFinished(ctx, leaderEpoch, "dead", time.Hour, 100); err != nil || n != 0 {
		t.Fatalf("retention of dead tasks: deleted %d (%v), want the blocked head kept", n, err)
	}
	blocked, err := s.BlockedSequences(ctx, "", 10)
	if err != nil || len(blocked) != 1 || blocked[0].Task.ID != head.ID || blocked[0].Waiting != 1 {
		t.Fatalf("blocked sequences: %+v %v", blocked, err)
	}
	if got, err := s.CancelTask(ctx, head.ID); err != nil || got.State != tasks.Cancelled {
		t.Fatalf("cancelling the blocked head: %+v %v", got, err)
	}
	if ids := claimedIDs(t, s, 3); len(ids) != 1 || ids[0] != waiting[0] {
		t.Fatalf("after the blocked head was cancelled, claimed %v, want %v", ids, waiting)
	}
}

// Defect 2: an operator cancelled a waiting task while the head's
// completion committed. The cancel read the head without a lock, the
// completion made the cancelled task the next head, and the sequence
// never moved again.
func TestCancelOfAWaitingTaskWhileTheHeadCompletes(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	head, waiting := sequenceOf(t, s, "race2", 4, 2, 3)
	g := newGate(t, s, dsn, head.ID)
	completed := async(func() error {
		_, err := s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(head)}})
		return err
	})
	awaitWaiting(t, s, 1) // the completion waits at its commit
	cancelled := async(func() error {
		_, err := s.CancelTask(ctx, waiting[0])
		return err
	})
	if err, done := awaitDoneOrWaiting(t, s, cancelled, 2); done && err != nil {
		t.Fatal(err)
	} else if done {
		cancelled = nil
	}
	g.open()
	if err := result(t, completed); err != nil {
		t.Fatal(err)
	}
	if cancelled != nil {
		if err := result(t, cancelled); err != nil {
			t.Fatal(err)
		}
	}
	if st := get(t, s, waiting[0]).State; st != tasks.Cancelled {
		t.Fatalf("the waiting task is %s after its cancel, want cancelled", st)
	}
	next := enqueue(t, s, seqInsert("race2", 4, false))
	if ids := claimedIDs(t, s, 4); len(ids) != 1 || ids[0] != next {
		t.Fatalf("a task enqueued after the race: claimed %v, want %d (the sequence is stuck)", ids, next)
	}
}

// Defect 3: the cancel of a waiting task decided "waiting" from what it
// read before it locked the task; meanwhile the task became the head and
// was claimed. It ended cancelled while its handler ran, and the next task
// of its sequence was claimed beside it.
func TestCancelOfAWaitingTaskClaimedInBetween(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	head, waiting := sequenceOf(t, s, "race3", 5, 3, 3)
	w := waiting[0]
	release := holdRow(t, dsn, `SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE`, w)
	var answer tasks.Task
	cancelled := async(func() error {
		var err error
		answer, err = s.CancelTask(ctx, w)
		return err
	})
	awaitWaiting(t, s, 1)
	one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(head)}}))
	if ids := claimedIDs(t, s, 5); len(ids) != 1 || ids[0] != w {
		t.Fatalf("after the head completed, claimed %v, want %d", ids, w)
	}
	release()
	if err := result(t, cancelled); err != nil {
		t.Fatal(err)
	}
	if answer.State != tasks.Running || answer.CancelRequestedAt == nil {
		t.Fatalf("the cancel of a task claimed meanwhile answered %s (requested %v), want running with the request", answer.State, answer.CancelRequestedAt)
	}
	if st := get(t, s, w).State; st != tasks.Running {
		t.Fatalf("the claimed task is %s, want running until its runner ends it", st)
	}
	if ids := claimedIDs(t, s, 5); len(ids) != 0 {
		t.Fatalf("claimed %v while the sequence's task %d runs", ids, w)
	}
}

// Defect 4: a batch reordered a sequence. COPY inserted the tasks without
// run_after before those with one, and ids decide the order.
func TestABatchKeepsItsSequenceInOrder(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 6, 1)
	past := time.Now().Add(-time.Minute)
	first, second := seqInsert("batch", 6, false), seqInsert("batch", 6, false)
	first.RunAfter = past
	if _, err := s.EnqueueBatch(ctx, []store.Insert{first, second}); err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for range 2 {
		got := claim(t, s, "a", 6, 1, 10)
		if len(got) != 1 {
			t.Fatalf("claimed %d tasks of a sequence at once", len(got))
		}
		if got[0].RunAfter.After(past.Add(time.Second)) && len(ids) == 0 {
			t.Fatalf("the sequence's second task (no run_after) ran first: %+v", got[0])
		}
		ids = append(ids, got[0].ID)
		one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(got[0])}}))
	}
}

// Defect 5: an operator's cancel raced the runner's requeue of a failed
// attempt. It answered "running" (a request) while the task was back in
// its lane, and the next claim ran the task despite the cancel.
func TestCancelRacingARequeue(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	raise(t, s, "a", 7, 1)
	id := enqueue(t, s, insert("k", 7, 3))
	running := claim(t, s, "a", 7, 1, 1)
	g := newGate(t, s, dsn, id)
	failed := async(func() error {
		_, err := s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(running[0]), Error: "boom"}})
		return err
	})
	awaitWaiting(t, s, 1)
	var answer tasks.Task
	cancelled := async(func() error {
		var err error
		answer, err = s.CancelTask(ctx, id)
		return err
	})
	awaitWaiting(t, s, 2) // the cancel waits for the requeue's lock
	g.open()
	if err := result(t, failed); err != nil {
		t.Fatal(err)
	}
	if err := result(t, cancelled); err != nil {
		t.Fatal(err)
	}
	if answer.State != tasks.Cancelled {
		t.Fatalf("a cancel that found the task ready again answered %s, want cancelled", answer.State)
	}
	if got := claim(t, s, "a", 7, 1, 1); len(got) != 0 {
		t.Fatalf("claimed %+v after its cancel", got)
	}
}

// Defect 6: a producer's open transaction stalled the runners' outcome
// writes: its insert locked the sequence's row until it committed, and the
// completion of the sequence's head, with every other completion of its
// batch, waited for it. A fence raise that requeued such a head waited the
// same way.
func TestAnOpenProducerStallsNoOutcome(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	head, _ := sequenceOf(t, s, "stall", 8, 1, 1)
	other := enqueue(t, s, insert("k", 8, 3))
	otherRun := claim(t, s, "a", 8, 1, 10)
	if len(otherRun) != 1 || otherRun[0].ID != other {
		t.Fatalf("claim: %+v", otherRun)
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	produced, err := s.EnqueueIn(ctx, tx, seqInsert("stall", 8, false))
	if err != nil {
		t.Fatal(err)
	}
	// The raise requeues the head (its one attempt spent: dead) while the
	// producer's transaction is open.
	raiseDone := async(func() error {
		_, _, _, err := raiseFences(s, ctx, "b", "", []claims.ShardEpoch{{Shard: 8, Epoch: 2}})
		return err
	})
	if err, done := awaitDoneOrWaiting(t, s, raiseDone, 1); !done || err != nil {
		t.Fatalf("the fence raise waits for a producer's open transaction (done %v, %v)", done, err)
	}
	_ = head
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// The head was dead and blocks: the produced task waits behind it.
	if got := get(t, s, produced.ID); got.State != tasks.Ready {
		t.Fatalf("the produced task: %+v", got)
	}
	// Outcome writes: a second sequence and a producer holding it open.
	head2, _ := sequenceOf(t, s, "stall2", 9, 1, 3)
	tx2, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx2.Rollback(ctx)
	if _, err := s.EnqueueIn(ctx, tx2, seqInsert("stall2", 9, false)); err != nil {
		t.Fatal(err)
	}
	unrelated := enqueue(t, s, insert("k", 9, 3))
	run := claim(t, s, "a", 9, 1, 10)
	if len(run) != 1 || run[0].ID != unrelated {
		t.Fatalf("claim: %+v", run)
	}
	completed := async(func() error {
		_, err := s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(head2)}, {Ref: claims.RefOf(run[0])}})
		return err
	})
	if err, done := awaitDoneOrWaiting(t, s, completed, 1); !done || err != nil {
		t.Fatalf("a completion batch waits for a producer's open transaction (done %v, %v)", done, err)
	}
	if err := tx2.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if ids := claimedIDs(t, s, 9); len(ids) != 1 {
		t.Fatalf("the task produced while the head completed: claimed %v, want it", ids)
	}
}

// isDeadlock reports whether err is PostgreSQL's deadlock (40P01).
func isDeadlock(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "40P01"
}

// Defect 7: a completion and a producer locked sequence rows in opposite
// orders (the completion in task id order, the producer in key order) and
// deadlocked.
func TestCompletionAndProducerDoNotDeadlock(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	raise(t, s, "a", 10, 1)
	// Head of "b" first (the lower id), then head of "a".
	hb := enqueue(t, s, seqInsert("b", 10, false))
	ha := enqueue(t, s, seqInsert("a", 10, false))
	run := claim(t, s, "a", 10, 1, 10)
	if len(run) != 2 {
		t.Fatalf("claim: %+v", run)
	}
	// The completion stops after settling its first head.
	g := newGate(t, s, dsn, hb)
	completed := async(func() error {
		_, err := s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(run[0])}, {Ref: claims.RefOf(run[1])}})
		return err
	})
	awaitWaiting(t, s, 1)
	produced := async(func() error {
		_, err := s.EnqueueBatch(ctx, []store.Insert{seqInsert("a", 10, false), seqInsert("b", 10, false)})
		return err
	})
	if err, done := awaitDoneOrWaiting(t, s, produced, 2); done && err != nil {
		t.Fatal(err)
	} else if done {
		produced = nil
	}
	g.open()
	for what, done := range map[string]<-chan error{"completion": completed, "producer": produced} {
		if done == nil {
			continue
		}
		if err := result(t, done); err != nil {
			t.Fatalf("%s: %v (deadlock: %v)", what, err, isDeadlock(err))
		}
	}
	_, _ = ha, hb
	if ids := claimedIDs(t, s, 10); len(ids) != 2 {
		t.Fatalf("the produced tasks after the race: claimed %v, want one of each sequence", ids)
	}
}

// Defect 8 (issue 32): a fence raise deleted the old owner's claims in the
// table's physical order while the old owner's writes locked them in id
// order: the two deadlocked in the very takeover that fencing exists for.
// Since then neither waits for a claim another transaction holds (issue
// 39): the old owner's completion skips the held claim (Busy) and lands
// the other, the raise skips it too and reports the unit pending, and once
// it is free the requeue that comes back takes it and the old owner's
// write of it is refused.
func TestFenceRaiseAndOldOwnersWritesNeverWaitForAHeldClaim(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	// The new owner's store plans with sequential scans, which read claims
	// in physical order; the old owner's writes find them by primary key,
	// in id order. The order a statement locks rows in must not depend on
	// its plan.
	seqDSN := dsn + "&enable_indexscan=off"
	if !strings.Contains(dsn, "?") {
		seqDSN = dsn + "?enable_indexscan=off"
	}
	newOwner, err := store.Open(ctx, seqDSN, store.Options{MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer newOwner.Close()
	raise(t, s, "a", 11, 1)
	low := enqueue(t, s, insert("k", 11, 3))
	urgent := insert("k", 11, 3)
	urgent.Priority = 1
	high := enqueue(t, s, urgent)
	// The higher id is claimed first: its claim row comes first physically.
	first := claim(t, s, "a", 11, 1, 1)
	second := claim(t, s, "a", 11, 1, 1)
	if len(first) != 1 || first[0].ID != high || len(second) != 1 || second[0].ID != low {
		t.Fatalf("claims: %+v %+v", first, second)
	}
	release := holdRow(t, dsn, `SELECT 1 FROM task_claims WHERE id = $1 FOR UPDATE`, low)
	res, err := s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(second[0])}, {Ref: claims.RefOf(first[0])}})
	if err != nil || res[0].Outcome != claims.Busy || res[1].Outcome != claims.Applied {
		t.Fatalf("completion while one claim is held: %+v %v, want busy and applied", res, err)
	}
	term := []claims.ShardEpoch{{Shard: 11, Epoch: 2}}
	o, err := newOwner.RaiseFences(ctx, "b", "", term)
	if err != nil || len(o.Raised) != 1 || !slices.Equal(o.Pending, term) {
		t.Fatalf("raise while a claim is held: %+v %v, want raised with the unit pending", o, err)
	}
	release()
	if o, err := newOwner.RequeueOrphans(ctx, "b", "", term); err != nil || o.Requeued != 1 || len(o.Pending) != 0 {
		t.Fatalf("requeue once the claim is free: %+v %v, want the held claim requeued", o, err)
	}
	if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(second[0])}})); r.Outcome != claims.FenceLost {
		t.Fatalf("the old owner's completion after the requeue: %v, want fence lost", r.Outcome)
	}
	if task := get(t, s, low); task.State != tasks.Ready || task.Attempt != 2 {
		t.Fatalf("the held task: %+v, want ready at its second attempt", task)
	}
	if task := get(t, s, high); task.State != tasks.Completed {
		t.Fatalf("the other task: %+v, want completed", task)
	}
}

// Defect 9: counts of ready tasks left out the tasks waiting in sequences,
// so the bulk cancel's confirmation said 1 and then cancelled 3.
func TestReadyCountsIncludeWaitingTasks(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	for range 3 {
		enqueue(t, s, seqInsert("counted", 12, false))
	}
	byState, err := s.CountByState(ctx)
	if err != nil || byState[tasks.Ready] != 3 {
		t.Errorf("CountByState: ready %d (%v), want 3", byState[tasks.Ready], err)
	}
	capped, err := s.CountByStateCapped(ctx, 100)
	if err != nil || capped[tasks.Ready] != 3 {
		t.Errorf("CountByStateCapped: ready %d (%v), want 3", capped[tasks.Ready], err)
	}
	for _, f := range []tasks.Filter{{States: []tasks.State{tasks.Ready}}, {States: []tasks.State{tasks.Ready}, Kind: "k"}, {Queue: tasks.DefaultQueue}} {
		if mc, err := s.CountMatching(ctx, f); err != nil || mc.Count != 3 {
			t.Errorf("CountMatching(%+v): %+v (%v), want 3", f, mc, err)
		}
	}
	queues, err := s.Queues(ctx, time.Minute)
	if err != nil || len(queues) != 1 || queues[0].Ready != 3 {
		t.Errorf("Queues: %+v (%v), want default with 3 ready", queues, err)
	}
	res, err := s.CancelMatching(ctx, tasks.Filter{States: []tasks.State{tasks.Ready}}, 0, time.Minute)
	if err != nil || res.Cancelled != 3 {
		t.Errorf("bulk cancel: %+v (%v), want 3 cancelled", res, err)
	}
}

// Suspected and confirmed: a waiting task's deadline was not enforced
// until it became its sequence's head.
func TestAWaitingTasksDeadlineIsEnforced(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	head, waiting := sequenceOf(t, s, "late", 13, 2, 3)
	retime(t, s, "deadline", "now() - interval '1 second'", waiting[0])
	if n, err := s.SweepDeadlines(ctx, leaderEpoch, time.Hour, 100); err != nil || n != 1 {
		t.Fatalf("the deadline sweep failed %d tasks (%v), want the waiting one", n, err)
	}
	if st := get(t, s, waiting[0]).State; st != tasks.Failed {
		t.Fatalf("the waiting task past its deadline is %s, want failed", st)
	}
	one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(head)}}))
	if ids := claimedIDs(t, s, 13); len(ids) != 0 {
		t.Fatalf("claimed %v: the sequence had nothing left", ids)
	}
}

// Suspected and confirmed: resuming a queue woke no runner; its tasks
// waited for the next poll.
func TestResumingAQueueWakesItsRunners(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := s.SetQueuePaused(ctx, "held", true); err != nil {
		t.Fatal(err)
	}
	in := insert("k", 14, 3)
	in.Queue = "held"
	enqueue(t, s, in)
	conn := listenConn(ctx, t, dsn)
	if _, err := s.SetQueuePaused(ctx, "held", false); err != nil {
		t.Fatal(err)
	}
	n, err := conn.WaitForNotification(ctx)
	if err != nil {
		t.Fatalf("no notification after the resume: %v", err)
	}
	if n.Payload != "*" && n.Payload != "14" {
		t.Fatalf("notification %q after the resume, want the queue's shards", n.Payload)
	}
}

// Suspected and confirmed: a queue's pause was no barrier for a claim
// already under way, which went on to take the queue's tasks after the
// pause had returned.
func TestAPauseIsABarrierForClaimsUnderWay(t *testing.T) {
	t.Parallel()
	s, dsn := setupDSN(t)
	ctx := context.Background()
	raise(t, s, "a", 15, 1)
	in := insert("k", 15, 3)
	in.Queue = "barrier"
	enqueue(t, s, in)
	// The claim waits for the fence row, after it read its queue as open.
	release := holdRow(t, dsn, `SELECT 1 FROM shard_fences WHERE shard = 15 FOR UPDATE`)
	var got []tasks.Task
	claimed := async(func() error {
		var err error
		got, err = s.Claim(ctx, "a", []claims.ShardEpoch{{Shard: 15, Epoch: 1}}, "barrier", []string{"k"}, 10, 10)
		return err
	})
	awaitWaiting(t, s, 1)
	paused := async(func() error {
		_, err := s.SetQueuePaused(ctx, "barrier", true)
		return err
	})
	if err, done := awaitDoneOrWaiting(t, s, paused, 2); done {
		// The pause returned while the claim was under way: the claim
		// must take nothing.
		if err != nil {
			t.Fatal(err)
		}
		release()
		if err := result(t, claimed); err != nil {
			t.Fatal(err)
		}
		if len(got) != 0 {
			t.Fatalf("a claim under way when the pause returned took %d tasks of the paused queue", len(got))
		}
		return
	}
	release()
	if err := result(t, claimed); err != nil {
		t.Fatal(err)
	}
	if err := result(t, paused); err != nil {
		t.Fatal(err)
	}
	if again, err := s.Claim(ctx, "a", []claims.ShardEpoch{{Shard: 15, Epoch: 1}}, "barrier", []string{"k"}, 10, 10); err != nil || len(again) != 0 {
		t.Fatalf("claimed %+v after the pause (%v)", again, err)
	}
}

// A task that misses its deadline while it waits its turn ends failed at
// once, and holds its sequence back when its turn comes, as a failure of
// the head does: the tasks behind it never run out from under it. Its
// retry puts it back in its place; its cancel lets the sequence go on.
func TestAWaitingTaskPastItsDeadlineBlocksWhenItsTurnComes(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	head, waiting := sequenceOf(t, s, "lateblock", 15, 4, 3)
	retime(t, s, "deadline", "now() - interval '1 second'", waiting[0], waiting[1])
	if n, err := s.SweepDeadlines(ctx, leaderEpoch, time.Hour, 100); err != nil || n != 2 {
		t.Fatalf("the deadline sweep failed %d tasks (%v), want the two waiting ones", n, err)
	}
	if counts, err := s.CountByState(ctx); err != nil || counts[tasks.Ready] != 1 || counts[tasks.Failed] != 2 {
		t.Fatalf("counts %v (%v): want the last task ready, two failed (and the head running)", counts, err)
	}
	one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(head)}}))
	if ids := claimedIDs(t, s, 15); len(ids) != 0 {
		t.Fatalf("claimed %v behind a task that failed while it waited", ids)
	}
	blocked, err := s.BlockedSequences(ctx, "", 10)
	if err != nil || len(blocked) != 1 || blocked[0].Task.ID != waiting[0] {
		t.Fatalf("blocked sequences %+v (%v), want lateblock blocked by %d", blocked, err, waiting[0])
	}
	// Retried, the first runs in its place; the second, which failed
	// while waiting, holds the last back in its turn; cancelled, it
	// lets the last run.
	if _, err := s.RetryTask(ctx, waiting[0]); err != nil {
		t.Fatal(err)
	}
	if ids := claimedIDs(t, s, 15); len(ids) != 1 || ids[0] != waiting[0] {
		t.Fatalf("after the retry claimed %v, want %d", ids, waiting[0])
	}
	if _, err := s.CancelTask(ctx, waiting[1]); err != nil {
		t.Fatal(err)
	}
	one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.Ref{ID: waiting[0], Shard: 15, Epoch: 1, Attempt: 2}}}))
	if ids := claimedIDs(t, s, 15); len(ids) != 1 || ids[0] != waiting[2] {
		t.Fatalf("after the cancel of the second claimed %v, want the last, %d", ids, waiting[2])
	}
}
