package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func uniqueInsert(key string) store.Insert {
	in := insert("k", 1, 3)
	in.UniqueKey = key
	return in
}

// runningTask enqueues a task on shard 1 and claims it as runner "a" at
// epoch 5 (the fence already raised).
func runningTask(t *testing.T, s *store.Store, maxAttempts int) tasks.Task {
	t.Helper()
	id := enqueue(t, s, insert("k", 1, maxAttempts))
	for _, c := range claim(t, s, "a", 1, 5, 100) {
		if c.ID == id {
			return c
		}
	}
	t.Fatalf("task %d not claimed", id)
	return tasks.Task{}
}

func TestCancel(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 5)

	ready := enqueue(t, s, insert("k", 2, 3))
	got, err := s.CancelTask(ctx, ready)
	if err != nil || got.State != tasks.Cancelled || got.FinishedAt == nil {
		t.Fatalf("cancelling a ready task: %+v %v", got, err)
	}
	if c := claim(t, s, "a", 2, 5, 10); len(c) != 0 {
		t.Fatalf("a cancelled task was claimed: %+v", c)
	}

	run := runningTask(t, s, 3)
	got, err = s.CancelTask(ctx, run.ID)
	if err != nil || got.State != tasks.Running || got.CancelRequestedAt == nil {
		t.Fatalf("cancelling a running task must record the request: %+v %v", got, err)
	}
	first := *got.CancelRequestedAt
	if again, err := s.CancelTask(ctx, run.ID); err != nil || !again.CancelRequestedAt.Equal(first) {
		t.Fatalf("a second cancel of a running task: %+v %v", again, err)
	}
	if r := one(t)(s.Heartbeat(ctx, "a", []claims.Ref{claims.RefOf(run)})); r.Outcome != claims.Applied || !r.CancelRequested {
		t.Fatalf("the heartbeat must carry the cancel request: %+v", r)
	}
	r := one(t)(s.CancelAttempts(ctx, "a", []claims.Cancellation{{Ref: claims.RefOf(run), Error: "context canceled"}}))
	if r.Outcome != claims.Applied || r.State != tasks.Cancelled {
		t.Fatalf("recording the cancelled attempt: %+v", r)
	}
	got = get(t, s, run.ID)
	if got.State != tasks.Cancelled || len(got.Errors) != 1 || !strings.Contains(got.Errors[0].Error, "cancelled on request; the handler returned: context canceled") {
		t.Fatalf("cancelled task: %+v", got)
	}
	// Exactly one outcome: a completion arriving later changes nothing.
	if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(run)}})); r.Outcome != claims.TaskMoved {
		t.Fatalf("completion after the cancellation: %+v", r)
	}

	var ce *tasks.ConflictError
	if _, err := s.CancelTask(ctx, run.ID); !errors.As(err, &ce) || ce.State != tasks.Cancelled || !errors.Is(err, tasks.ErrConflict) {
		t.Fatalf("cancelling a finished task: %v", err)
	}
	if _, err := s.CancelTask(ctx, 999999); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("cancelling a missing task: %v", err)
	}
	// A heartbeat of a task nobody asked to cancel says so.
	other := runningTask(t, s, 3)
	if r := one(t)(s.Heartbeat(ctx, "a", []claims.Ref{claims.RefOf(other)})); r.Outcome != claims.Applied || r.CancelRequested {
		t.Fatalf("heartbeat without a request: %+v", r)
	}
}

// A task whose cancel was requested never goes back in line: every move
// that would requeue it cancels it instead.
func TestCancelRequestedTaskIsNeverRequeued(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 5)
	requested := func() tasks.Task {
		task := runningTask(t, s, 3)
		if _, err := s.CancelTask(ctx, task.ID); err != nil {
			t.Fatal(err)
		}
		return task
	}
	check := func(what string, id int64) {
		t.Helper()
		if got := get(t, s, id); got.State != tasks.Cancelled || got.FinishedAt == nil {
			t.Errorf("%s: task %s, want cancelled", what, got.State)
		}
	}

	failed := requested()
	if r := one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(failed), Error: "boom"}})); r.State != tasks.Cancelled {
		t.Errorf("a failure with attempts left: %+v", r)
	}
	check("failed", failed.ID)

	given := requested()
	if r := one(t)(s.Unclaim(ctx, "a", []claims.Ref{claims.RefOf(given)})); r.State != tasks.Cancelled {
		t.Errorf("unclaim: %+v", r)
	}
	check("unclaimed", given.ID)

	cut := requested()
	if r := one(t)(s.Interrupt(ctx, "a", []claims.Interruption{{Ref: claims.RefOf(cut), Reason: "interrupted: detached"}})); r.State != tasks.Cancelled {
		t.Errorf("interrupt: %+v", r)
	}
	check("interrupted", cut.ID)

	stale := requested()
	retime(t, s, "claimed_at", "now() - interval '1 hour'", stale.ID)
	if requeued, dead, err := s.SweepStale(ctx, leaderEpoch, time.Minute, 100, backoff); err != nil || requeued != 0 || dead != 0 {
		t.Errorf("stale sweep of a cancel-requested claim: requeued %d dead %d %v", requeued, dead, err)
	}
	check("stale", stale.ID)

	orphan := requested()
	if _, requeued, _, err := raiseFences(s, ctx, "b", "", []claims.ShardEpoch{{Shard: 1, Epoch: 9}}); err != nil || requeued != 0 {
		t.Errorf("orphan requeue of a cancel-requested claim: requeued %d %v", requeued, err)
	}
	check("orphaned", orphan.ID)
}

// A cancel racing a completion, for many tasks at once: each ends with
// exactly one outcome, and the write that lost applied nothing.
func TestCancelRacesCompletion(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 5)
	const n = 200
	for range n {
		enqueue(t, s, insert("k", 1, 3))
	}
	claimed := claim(t, s, "a", 1, 5, n)
	if len(claimed) != n {
		t.Fatalf("claimed %d", len(claimed))
	}
	var wg sync.WaitGroup
	completed := make([]claims.Outcome, n)
	cancelled := make([]claims.Outcome, n)
	start := make(chan struct{})
	for i, task := range claimed {
		// The completion starts with the request (i%3 == 0), once the
		// request is recorded (1), or once the heartbeat carried it (2).
		stages := []chan struct{}{start, make(chan struct{}), make(chan struct{})}
		wg.Go(func() {
			<-stages[i%3]
			completed[i] = outcome(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(task), Result: []byte(`{"ok": true}`)}}))
		})
		wg.Go(func() {
			<-start
			// The operator's request, then the runner's cancellation once
			// its heartbeat carried the request.
			_, err := s.CancelTask(ctx, task.ID)
			close(stages[1])
			if err != nil && !errors.Is(err, tasks.ErrConflict) {
				close(stages[2])
				t.Error(err)
				return
			}
			beat, err := s.Heartbeat(ctx, "a", []claims.Ref{claims.RefOf(task)})
			close(stages[2])
			if err != nil {
				t.Error(err)
				return
			}
			if beat[0].Outcome != claims.Applied || !beat[0].CancelRequested {
				cancelled[i] = claims.TaskMoved // the completion landed first
				return
			}
			cancelled[i] = outcome(t)(s.CancelAttempts(ctx, "a", []claims.Cancellation{{Ref: claims.RefOf(task)}}))
		})
	}
	close(start)
	wg.Wait()
	won := map[tasks.State]int{}
	for i, task := range claimed {
		got := get(t, s, task.ID)
		won[got.State]++
		switch {
		case (completed[i] == claims.Applied) == (cancelled[i] == claims.Applied):
			t.Fatalf("task %d: completion %s, cancellation %s: want exactly one applied", task.ID, completed[i], cancelled[i])
		case completed[i] == claims.Applied && (got.State != tasks.Completed || got.Result == nil):
			t.Fatalf("task %d: the completion applied but the task is %+v", task.ID, got)
		case cancelled[i] == claims.Applied && (got.State != tasks.Cancelled || got.Result != nil):
			t.Fatalf("task %d: the cancellation applied but the task is %+v", task.ID, got)
		}
	}
	t.Logf("outcomes of %d races: %v", n, won)
}

// outcome is one for goroutines: it reports an error without stopping the
// test and returns the single result's outcome.
func outcome(t *testing.T) func([]claims.WriteResult, error) claims.Outcome {
	return func(rs []claims.WriteResult, err error) claims.Outcome {
		if err != nil || len(rs) != 1 {
			t.Errorf("want one result: %v %v", rs, err)
			return claims.TaskGone
		}
		return rs[0].Outcome
	}
}

func TestRetry(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 5)
	task := runningTask(t, s, 2)
	one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(task), Error: "first"}}))
	task = claim(t, s, "a", 1, 5, 1)[0]
	if r := one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(task), Error: "second"}})); r.State != tasks.Dead {
		t.Fatalf("want dead after two attempts: %+v", r)
	}
	got, err := s.RetryTask(ctx, task.ID)
	if err != nil {
		t.Fatal(err)
	}
	// A fresh budget of two attempts: attempts 3 and 4.
	if got.State != tasks.Ready || got.Attempt != 3 || got.MaxAttempts != 4 || len(got.Errors) != 2 ||
		got.FinishedAt != nil || got.ClaimedBy != "" {
		t.Fatalf("retried task: %+v", got)
	}
	for _, msg := range []string{"third", "fourth"} {
		c := claim(t, s, "a", 1, 5, 1)
		if len(c) != 1 || c[0].ID != task.ID {
			t.Fatalf("the retried task was not claimed: %+v", c)
		}
		one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(c[0]), Error: msg}}))
	}
	if got = get(t, s, task.ID); got.State != tasks.Dead || got.Attempt != 4 || len(got.Errors) != 4 {
		t.Fatalf("after the second budget: %+v", got)
	}
	// The budget is the one the task was enqueued with, again.
	if got, err = s.RetryTask(ctx, task.ID); err != nil || got.Attempt != 5 || got.MaxAttempts != 6 {
		t.Fatalf("second retry: %+v %v", got, err)
	}
	var ce *tasks.ConflictError
	if _, err := s.RetryTask(ctx, task.ID); !errors.As(err, &ce) || ce.State != tasks.Ready {
		t.Fatalf("retrying a ready task: %v", err)
	}
	if _, err := s.RetryTask(ctx, 999999); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("retrying a missing task: %v", err)
	}

	// A deadline that has passed is dropped; a cancelled task can be retried.
	past := time.Now().Add(-time.Minute)
	in := insert("k", 2, 3)
	in.Deadline = past
	late := enqueue(t, s, in)
	if n, err := s.SweepDeadlines(ctx, leaderEpoch, 0, 100); err != nil || n != 1 {
		t.Fatalf("deadline sweep: %d %v", n, err)
	}
	if got, err := s.RetryTask(ctx, late); err != nil || got.Deadline != nil || got.State != tasks.Ready {
		t.Fatalf("retry of a failed task past its deadline: %+v %v", got, err)
	}
	if _, err := s.CancelTask(ctx, late); err != nil {
		t.Fatal(err)
	}
	if got, err := s.RetryTask(ctx, late); err != nil || got.State != tasks.Ready || got.CancelRequestedAt != nil {
		t.Fatalf("retry of a cancelled task: %+v %v", got, err)
	}

	// A unique key another unfinished task holds now refuses the retry.
	first, err := s.EnqueueIn(ctx, nil, uniqueInsert("order-7"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.CancelTask(ctx, first.ID); err != nil {
		t.Fatal(err)
	}
	second, err := s.EnqueueIn(ctx, nil, uniqueInsert("order-7"))
	if err != nil || second.Duplicate {
		t.Fatalf("the key of a cancelled task must be free: %+v %v", second, err)
	}
	_, err = s.RetryTask(ctx, first.ID)
	if !errors.As(err, &ce) || !strings.Contains(ce.Reason, fmt.Sprintf("held by unfinished task %d", second.ID)) {
		t.Fatalf("retry of a task whose unique key is held: %v", err)
	}
}

// 32 producers enqueue the same unique key at once, one by one and in
// batches: one task is created and every producer gets its id.
func TestUniqueKeyUnderConcurrentProducers(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	const producers = 32
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			key := fmt.Sprintf("invoice-%v", batch)
			ids := make([]int64, producers)
			created := make([]int, producers)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for p := range producers {
				wg.Go(func() {
					<-start
					if !batch {
						e, err := s.EnqueueIn(ctx, nil, uniqueInsert(key))
						if err != nil {
							t.Error(err)
							return
						}
						ids[p] = e.ID
						if !e.Duplicate {
							created[p]++
						}
						return
					}
					// The key twice in one batch, among tasks of their own.
					own := uniqueInsert(fmt.Sprintf("own-%d", p))
					res, err := s.EnqueueBatchIn(ctx, nil, []store.Insert{uniqueInsert(key), own, insert("k", 1, 3), uniqueInsert(key)})
					if err != nil {
						t.Error(err)
						return
					}
					if len(res.Tasks) != 4 || res.Tasks[0].ID != res.Tasks[3].ID || !res.Tasks[3].Duplicate || res.Tasks[1].Duplicate || res.Tasks[2].Duplicate {
						t.Errorf("batch result %+v", res)
					}
					ids[p] = res.Tasks[0].ID
					if !res.Tasks[0].Duplicate {
						created[p]++
					}
				})
			}
			close(start)
			wg.Wait()
			var n int
			if err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM tasks WHERE unique_key = $1`, key).Scan(&n); err != nil {
				t.Fatal(err)
			}
			total := 0
			for _, c := range created {
				total += c
			}
			if n != 1 || total != 1 {
				t.Fatalf("%d tasks with the key, %d producers told they created it; want 1 and 1", n, total)
			}
			for p, id := range ids {
				if id != ids[0] {
					t.Fatalf("producer %d got task %d, producer 0 task %d", p, id, ids[0])
				}
			}
		})
	}
}

// The unique key is held while the task is ready or running, and free
// again once it finished.
func TestUniqueKeyWindow(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 5)
	first, err := s.EnqueueIn(ctx, nil, uniqueInsert("u"))
	if err != nil || first.Duplicate {
		t.Fatal(first, err)
	}
	c := claim(t, s, "a", 1, 5, 1)
	if again, err := s.EnqueueIn(ctx, nil, uniqueInsert("u")); err != nil || !again.Duplicate || again.ID != first.ID {
		t.Fatalf("enqueue while running: %+v %v", again, err)
	}
	one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(c[0])}}))
	second, err := s.EnqueueIn(ctx, nil, uniqueInsert("u"))
	if err != nil || second.Duplicate || second.ID == first.ID {
		t.Fatalf("enqueue after completion: %+v %v", second, err)
	}
	if id, err := s.Enqueue(ctx, uniqueInsert("u")); err != nil || id != second.ID {
		t.Fatalf("Enqueue of a duplicate returned task %d (%v), want the holder %d", id, err, second.ID)
	}
	var n int
	if err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM tasks WHERE key = $1`, uniqueInsert("u").Key).Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d tasks enqueued (%v), want 2: the completed one and its successor", n, err)
	}
}

// A task enqueued in a transaction that rolls back leaves nothing and wakes
// nobody; one that commits is there and notifies.
func TestTransactionalEnqueue(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	notes := listen(t, s)
	exec(t, s, `CREATE TABLE orders (id bigint PRIMARY KEY, total int)`)
	produce := func(order int, commit bool, shard int) {
		t.Helper()
		err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES ($1, 10)`, order); err != nil {
				return err
			}
			if _, err := s.EnqueueIn(ctx, tx, insert("k", shard, 3)); err != nil {
				return err
			}
			if _, err := s.EnqueueBatchIn(ctx, tx, []store.Insert{insert("k", shard, 3), uniqueInsert(fmt.Sprint("order-", order))}); err != nil {
				return err
			}
			if !commit {
				return errors.New("the producer changed its mind")
			}
			return nil
		})
		if commit != (err == nil) {
			t.Fatalf("order %d: %v", order, err)
		}
	}
	produce(1, false, 7)
	produce(2, true, 9)
	var orders, queued int
	if err := s.Pool().QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM tasks)`).Scan(&orders, &queued); err != nil {
		t.Fatal(err)
	}
	if orders != 1 || queued != 3 {
		t.Fatalf("%d orders and %d tasks, want the committed order's 1 and 3", orders, queued)
	}
	// Notifications arrive in commit order: the first one is the
	// committed producer's, so the rolled-back one sent none.
	select {
	case n := <-notes:
		if n.All || !slices.Equal(n.Shards, []int{9}) {
			t.Fatalf("first notification %+v, want shard 9 only (the rolled-back transaction must wake nobody)", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no notification for the committed transaction")
	}
}

func TestCountByStateCapped(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	exec(t, s, `INSERT INTO tasks (kind, shard, key, state, finished_at)
		SELECT 'k', 0, g::text, CASE WHEN g <= 30 THEN 'dead' ELSE 'completed' END, now() FROM generate_series(1, 250) g`)
	enqueue(t, s, insert("k", 1, 3))
	got, err := s.CountByStateCapped(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	want := map[tasks.State]int64{tasks.Ready: 1, tasks.Running: 0, tasks.Completed: 100, tasks.Failed: 0, tasks.Dead: 30, tasks.Cancelled: 0}
	for _, st := range tasks.States {
		if got[st] != want[st] {
			t.Errorf("%s: %d, want %d", st, got[st], want[st])
		}
	}
}
