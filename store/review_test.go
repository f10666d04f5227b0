package store_test

// Store-side defects of issue 24, each with the test that failed before its
// fix (against the one-table layout, or, for the listing, against a
// cursor read in a second snapshot).

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// A task whose cancel was requested no longer holds its unique key: the
// producer that enqueues the key again gets a new task, which runs.
func TestCancelRequestFreesTheUniqueKey(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	in := insert("k", 2, 3)
	in.UniqueKey = "invoice-7"
	old, err := s.EnqueueIn(ctx, nil, in)
	if err != nil {
		t.Fatal(err)
	}
	raise(t, s, "a", 2, 1)
	running := claim(t, s, "a", 2, 1, 1)
	if len(running) != 1 {
		t.Fatalf("claim: %+v", running)
	}
	if task, err := s.CancelTask(ctx, old.ID); err != nil || task.State != tasks.Running || task.CancelRequestedAt == nil {
		t.Fatalf("cancel of the running task: %+v %v", task, err)
	}
	again, err := s.EnqueueIn(ctx, nil, in)
	if err != nil || again.Duplicate || again.ID == old.ID {
		t.Fatalf("enqueueing the key again while its holder is being cancelled: %+v %v", again, err)
	}
	if r := one(t)(s.CancelAttempts(ctx, "a", []claims.Cancellation{{Ref: claims.RefOf(running[0]), Error: "context canceled"}})); r.State != tasks.Cancelled {
		t.Fatalf("the old task's attempt: %+v", r)
	}
	if got := claim(t, s, "a", 2, 1, 1); len(got) != 1 || got[0].ID != again.ID {
		t.Fatalf("the new task of the key is not claimable: %+v", got)
	}
	// While the new one is unfinished it holds the key.
	if dup, err := s.EnqueueIn(ctx, nil, in); err != nil || !dup.Duplicate || dup.ID != again.ID {
		t.Fatalf("a third enqueue: %+v %v", dup, err)
	}
}

// A listing's page and its cursor come from one snapshot: claims that end
// between the two statements cannot move the cursor past tasks the page
// never examined.
func TestListingCursorAndPageShareASnapshot(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	// ListScan running tasks on shard 1, then one on shard 5.
	pgtest.InsertClaimed(t, s, `INSERT INTO tasks (kind, shard, key)
		SELECT 'k', CASE WHEN g > $1 THEN 5 ELSE 1 END, g::text FROM generate_series(1, $1 + 1) g RETURNING id`,
		"r", 1, "now()", store.ListScan)
	var wanted int64
	if err := s.Pool().QueryRow(ctx, `SELECT id FROM tasks WHERE shard = 5`).Scan(&wanted); err != nil {
		t.Fatal(err)
	}
	five := 5
	req := tasks.ListRequest{Filter: tasks.Filter{States: []tasks.State{tasks.Running}, Shard: &five}, Limit: 10}
	// Between the page and the cursor, 500 claims of shard 1 end: in a
	// new snapshot the first ListScan running tasks reach past the
	// shard-5 task.
	restore := store.SetBetweenListStatements(func() {
		exec(t, s, `WITH k AS (DELETE FROM task_claims WHERE id IN (SELECT id FROM task_claims ORDER BY id LIMIT 500) RETURNING id),
			u AS (UPDATE tasks SET state = 'completed', finished_at = now() WHERE id IN (SELECT id FROM k) RETURNING id, finished_at)
			INSERT INTO task_finished (state, id, finished_at, queue) SELECT 'completed', id, finished_at, 'default' FROM u`)
	})
	first, err := s.List(ctx, req)
	restore()
	if err != nil {
		t.Fatal(err)
	}
	if len(first.Tasks) != 0 || first.Next == 0 || first.Next >= wanted {
		t.Fatalf("first page: %d tasks, next %d: the cursor passed task %d before any page listed it", len(first.Tasks), first.Next, wanted)
	}
	req.After = first.Next
	if got := walk(t, s, req); len(got) != 1 || got[0] != wanted {
		t.Fatalf("the rest of the listing: %v, want [%d]", got, wanted)
	}
}

// Of several matching tasks with one unique key, a bulk retry retries the
// newest, also when they fall into different batches.
func TestBulkRetryKeepsTheNewestAcrossBatches(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	exec(t, s, `INSERT INTO tasks (kind, shard, key, state, finished_at, unique_key)
		SELECT 'k', g % 8, g::text, 'dead', now(), CASE WHEN g IN (10, $1) THEN 'order-1' END
		FROM generate_series(1, $1 + 100) g`, store.BulkBatch+400)
	var oldest, newest int64
	if err := s.Pool().QueryRow(ctx, `SELECT min(id), max(id) FROM tasks WHERE unique_key = 'order-1'`).Scan(&oldest, &newest); err != nil {
		t.Fatal(err)
	}
	res, err := s.RetryMatching(ctx, tasks.Filter{States: []tasks.State{tasks.Dead}}, 0, time.Minute)
	if err != nil || !res.Done || res.Skipped != 1 {
		t.Fatalf("bulk retry: %+v %v", res, err)
	}
	if got := get(t, s, newest); got.State != tasks.Ready {
		t.Fatalf("the newest task of the key: %s, want ready", got.State)
	}
	if got := get(t, s, oldest); got.State != tasks.Dead {
		t.Fatalf("the oldest task of the key: %s, want dead (skipped)", got.State)
	}
}

// The deadline sweep turns a running task whose cancel was requested into
// cancelled, as every leader sweep does, not failed.
func TestDeadlineSweepCancelsARequestedCancel(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	id := enqueue(t, s, insert("k", 3, 3))
	raise(t, s, "a", 3, 1)
	claim(t, s, "a", 3, 1, 1)
	if _, err := s.CancelTask(ctx, id); err != nil {
		t.Fatal(err)
	}
	retime(t, s, "deadline", "now() - interval '1 hour'", id)
	if n, err := s.SweepDeadlines(ctx, leaderEpoch, 0, 10); err != nil || n != 1 {
		t.Fatalf("deadline sweep: %d %v", n, err)
	}
	if got := get(t, s, id); got.State != tasks.Cancelled {
		t.Fatalf("a cancel-requested task past its deadline ended %s, want cancelled", got.State)
	}
}

// The unhandled-kind report stops counting at its cap.
func TestUnhandledCountIsCapped(t *testing.T) {
	t.Parallel()
	s := setup(t)
	exec(t, s, `INSERT INTO tasks (kind, shard, key) SELECT 'nobody', g % 64, g::text FROM generate_series(1, $1) g`,
		store.UnrunnableCountCap+2000)
	got, err := s.ReadyUnrunnable(context.Background(), []tasks.Class{{Queue: tasks.DefaultQueue, Kind: "k"}})
	if err != nil || len(got) != 1 || got[0].Ready != store.UnrunnableCountCap || !got[0].AtLeast {
		t.Fatalf("unhandled kinds: %+v %v, want nobody at the cap %d", got, err, store.UnrunnableCountCap)
	}
}

// The stale sweep's backoff counts from the last operator's retry.
func TestStaleBackoffCountsFromTheLastRetry(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	id := enqueue(t, s, insert("k", 4, 2))
	raise(t, s, "a", 4, 1)
	for range 2 {
		got := claim(t, s, "a", 4, 1, 1)
		one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(got[0]), Error: "boom"}}))
	}
	if _, err := s.RetryTask(ctx, id); err != nil { // attempt 3 of 4
		t.Fatal(err)
	}
	claim(t, s, "a", 4, 1, 1)
	retime(t, s, "claimed_at", "now() - interval '1 hour'", id)
	hour := store.Backoff{Base: time.Minute, Cap: time.Hour}
	if requeued, _, err := s.SweepStale(ctx, leaderEpoch, time.Minute, 10, hour); err != nil || requeued != 1 {
		t.Fatalf("stale sweep: %d %v", requeued, err)
	}
	var wait time.Duration
	var secs float64
	if err := s.Pool().QueryRow(ctx, `SELECT extract(epoch FROM run_after - now()) FROM tasks WHERE id = $1`, id).Scan(&secs); err != nil {
		t.Fatal(err)
	}
	wait = time.Duration(secs * float64(time.Second))
	// The first attempt of a budget waits [30s, 60s) at base 1m; the
	// third attempt ever would wait [2m, 4m).
	if wait >= time.Minute {
		t.Fatalf("the first stale claim after a retry waits %s, want under the 1m base (%s)", wait, fmt.Sprint(hour))
	}
}

// A paused queue's tasks are claimed by nobody until it resumes; other
// queues go on.
func TestPausedQueueIsNotClaimed(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 6, 1)
	mail := insert("k", 6, 3)
	mail.Queue = "mail"
	id := enqueue(t, s, mail)
	other := enqueue(t, s, insert("k", 6, 3))
	if _, err := s.SetQueuePaused(ctx, "mail", true); err != nil {
		t.Fatal(err)
	}
	terms := []claims.ShardEpoch{{Shard: 6, Epoch: 1}}
	if got, err := s.Claim(ctx, "a", terms, "mail", []string{"k"}, 10, 10); err != nil || len(got) != 0 {
		t.Fatalf("claimed from a paused queue: %+v %v", got, err)
	}
	if got, err := s.Claim(ctx, "a", terms, tasks.DefaultQueue, []string{"k"}, 10, 10); err != nil || len(got) != 1 || got[0].ID != other {
		t.Fatalf("the default queue while mail is paused: %+v %v", got, err)
	}
	qs, err := s.Queues(ctx, time.Minute)
	if err != nil || len(qs) != 2 || qs[1].Name != "mail" || qs[1].PausedAt == nil || qs[1].Ready != 1 || qs[0].Running != 1 {
		t.Fatalf("queues: %+v %v", qs, err)
	}
	if _, err := s.SetQueuePaused(ctx, "mail", false); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Claim(ctx, "a", terms, "mail", []string{"k"}, 10, 10); err != nil || len(got) != 1 || got[0].ID != id || got[0].Queue != "mail" {
		t.Fatalf("claimed after the resume: %+v %v", got, err)
	}
}

// Within a shard and queue, a more urgent task is claimed first; among
// equals, the oldest; over several kinds' lanes alike.
func TestClaimsTakeTheMostUrgentFirst(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 7, 1)
	var want []int64
	add := func(kind string, priority int) int64 {
		in := insert(kind, 7, 3)
		in.Priority = priority
		return enqueue(t, s, in)
	}
	late := add("k", 5)
	mid1 := add("j", 3)
	mid2 := add("k", 3)
	first := add("j", 1)
	want = append(want, first, mid1, mid2, late)
	var ids []int64
	for range want {
		got, err := s.Claim(ctx, "a", []claims.ShardEpoch{{Shard: 7, Epoch: 1}}, tasks.DefaultQueue, []string{"j", "k"}, 1, 1)
		if err != nil || len(got) != 1 {
			t.Fatalf("claim: %+v %v", got, err)
		}
		ids = append(ids, got[0].ID)
	}
	if !slices.Equal(ids, want) {
		t.Fatalf("claimed in the order %v, want %v (priority, then age)", ids, want)
	}
}

// ClaimUrgent takes only the tasks more urgent than the default, across
// the shards it is given, and leaves the backlog of the first shard for
// Claim.
func TestClaimUrgentTakesOnlyUrgentTasks(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 3, 1)
	raise(t, s, "a", 4, 1)
	add := func(shard, priority int) int64 {
		in := insert("k", shard, 3)
		in.Priority = priority
		return enqueue(t, s, in)
	}
	backlog := []int64{add(3, 3), add(3, 3), add(4, 5)}
	urgent := []int64{add(3, 2), add(4, 1)}
	terms := []claims.ShardEpoch{{Shard: 3, Epoch: 1}, {Shard: 4, Epoch: 1}}
	got, err := s.ClaimUrgent(ctx, "a", terms, tasks.DefaultQueue, []string{"k"}, 10, 10)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]int64, len(got))
	for i, g := range got {
		ids[i] = g.ID
	}
	if slices.Sort(ids); !slices.Equal(ids, urgent) {
		t.Fatalf("ClaimUrgent took %v, want the urgent tasks %v only", ids, urgent)
	}
	if got, err = s.Claim(ctx, "a", terms, tasks.DefaultQueue, []string{"k"}, 10, 10); err != nil || len(got) != len(backlog) {
		t.Fatalf("Claim after ClaimUrgent: %+v %v, want the %d others", got, err, len(backlog))
	}
}
