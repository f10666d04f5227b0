package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"pgregory.net/rapid"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// seqInsert is a task of sequence key on shard, which blocks its sequence
// when it ends dead or failed unless cont.
func seqInsert(key string, shard int, cont bool) store.Insert {
	in := insert("k", shard, 2)
	in.SequenceKey, in.SequenceContinue = key, cont
	return in
}

// TestSequencesRunOneAtATimeInOrder drives random histories of a few
// sequences on two shards — enqueues (some that let the sequence go on
// after a failure), claims, completions, failures, interruptions, cancels
// of any task, retries of a blocking task, shard moves with their orphan
// requeue — and checks after every step that no two tasks of a sequence
// are ever claimable or running at once, that the one running is the
// oldest the sequence has not finished, and that a sequence whose head is
// not blocked is never left without a claimable or running task.
func TestSequencesRunOneAtATimeInOrder(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	round := 0
	rapid.Check(t, func(rt *rapid.T) {
		round++
		keys := []string{fmt.Sprintf("r%d-a", round), fmt.Sprintf("r%d-b", round), fmt.Sprintf("r%d-c", round)}
		shardOf := map[string]int{keys[0]: 10, keys[1]: 10, keys[2]: 11}
		epoch := map[int]int64{10: int64(round * 100), 11: int64(round * 100)}
		owner := fmt.Sprintf("r%d", round)
		for _, sh := range []int{10, 11} {
			if _, _, _, err := raiseFences(s, ctx, owner, "", []claims.ShardEpoch{{Shard: sh, Epoch: epoch[sh]}}); err != nil {
				rt.Fatal(err)
			}
		}
		var ids []int64
		running := map[int64]tasks.Task{}
		// ran records, per sequence, the ids in the order their attempts
		// completed.
		ran := map[string][]int64{}
		claimAll := func() {
			for _, sh := range []int{10, 11} {
				got, err := s.Claim(ctx, owner, []claims.ShardEpoch{{Shard: sh, Epoch: epoch[sh]}}, tasks.DefaultQueue, []string{"k"}, 10, 10)
				if err != nil {
					rt.Fatal(err)
				}
				for _, task := range got {
					running[task.ID] = task
				}
			}
		}
		pickRunning := func(label string) (tasks.Task, bool) {
			if len(running) == 0 {
				return tasks.Task{}, false
			}
			keys := slices.Sorted(func(yield func(int64) bool) {
				for id := range running {
					if !yield(id) {
						return
					}
				}
			})
			id := rapid.SampledFrom(keys).Draw(rt, label)
			return running[id], true
		}
		steps := rapid.IntRange(5, 40).Draw(rt, "steps")
		for range steps {
			switch rapid.IntRange(0, 8).Draw(rt, "op") {
			case 0, 1: // enqueue
				k := rapid.SampledFrom(keys).Draw(rt, "key")
				e, err := s.EnqueueIn(ctx, nil, seqInsert(k, shardOf[k], rapid.Bool().Draw(rt, "continue")))
				if err != nil {
					rt.Fatal(err)
				}
				ids = append(ids, e.ID)
			case 2: // claim
				claimAll()
			case 3: // complete
				if task, ok := pickRunning("complete"); ok {
					if r := one(rt)(s.Complete(ctx, owner, []claims.Completion{{Ref: claims.RefOf(task)}})); r.Outcome == claims.Applied {
						ran[task.SequenceKey] = append(ran[task.SequenceKey], task.ID)
					}
					delete(running, task.ID)
				}
			case 4: // fail (retried, or dead once its attempts are used up)
				if task, ok := pickRunning("fail"); ok {
					one(rt)(s.Fail(ctx, owner, []claims.Failure{{Ref: claims.RefOf(task), Error: "boom"}}))
					delete(running, task.ID)
				}
			case 5: // interrupt
				if task, ok := pickRunning("interrupt"); ok {
					one(rt)(s.Interrupt(ctx, owner, []claims.Interruption{{Ref: claims.RefOf(task), Reason: "detached"}}))
					delete(running, task.ID)
				}
			case 6: // an operator cancels any task
				if len(ids) > 0 {
					if _, err := s.CancelTask(ctx, rapid.SampledFrom(ids).Draw(rt, "cancel")); err != nil && !isConflict(err) {
						rt.Fatal(err)
					}
				}
			case 7: // an operator retries a dead or failed task
				if len(ids) > 0 {
					if _, err := s.RetryTask(ctx, rapid.SampledFrom(ids).Draw(rt, "retry")); err != nil && !isConflict(err) {
						rt.Fatal(err)
					}
				}
			case 8: // a shard moves: a new epoch, its claims requeued
				sh := rapid.SampledFrom([]int{10, 11}).Draw(rt, "move")
				epoch[sh]++
				if _, _, _, err := raiseFences(s, ctx, owner, "", []claims.ShardEpoch{{Shard: sh, Epoch: epoch[sh]}}); err != nil {
					rt.Fatal(err)
				}
				for id, task := range running {
					if task.Shard == sh {
						delete(running, id)
					}
				}
			}
			checkSequences(rt, s, keys)
		}
		// Drained: everything claimable runs to completion; what remains
		// unfinished waits behind a blocked head.
		for range 100 {
			claimAll()
			if len(running) == 0 {
				break
			}
			for id, task := range running {
				if r := one(rt)(s.Complete(ctx, owner, []claims.Completion{{Ref: claims.RefOf(task)}})); r.Outcome == claims.Applied {
					ran[task.SequenceKey] = append(ran[task.SequenceKey], task.ID)
				}
				delete(running, id)
			}
			checkSequences(rt, s, keys)
		}
		var stuck int
		if err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM tasks t
			WHERE t.sequence_key = ANY ($1) AND t.state = 'ready'
			  AND NOT EXISTS (SELECT 1 FROM task_sequences q JOIN tasks h ON h.id = q.head_id
			                  WHERE q.key = t.sequence_key AND q.blocked_at IS NOT NULL AND h.state IN ('dead', 'failed'))`,
			keys).Scan(&stuck); err != nil {
			rt.Fatal(err)
		}
		if stuck != 0 {
			rt.Fatalf("%d unfinished tasks left in sequences that no failure blocks", stuck)
		}
		// Without retries an older task could not join behind a newer
		// one: completions follow enqueue order.
		for k, order := range ran {
			if !slices.IsSorted(order) && !retried(rt, s, k) {
				rt.Fatalf("sequence %s completed out of order: %v", k, order)
			}
		}
	})
}

// checkSequences asserts the sequence invariants over keys: at most one task
// of each sequence in a lane or claimed, it is the sequence's head and the
// oldest unfinished task that was not retried past it, and a sequence with
// unfinished tasks has a head that is claimable, running or blocked.
func checkSequences(rt *rapid.T, s *store.Store, keys []string) {
	rows, err := s.Pool().Query(context.Background(), `
		SELECT t.sequence_key,
			count(*) FILTER (WHERE EXISTS (SELECT 1 FROM task_ready r WHERE r.id = t.id AND r.shard = t.shard)
			                    OR EXISTS (SELECT 1 FROM task_claims c WHERE c.id = t.id)),
			count(*) FILTER (WHERE t.state = 'ready'),
			coalesce((SELECT q.head_id FROM task_sequences q WHERE q.key = t.sequence_key), 0),
			coalesce((SELECT q.blocked_at IS NOT NULL FROM task_sequences q WHERE q.key = t.sequence_key), false),
			coalesce(min(t.id) FILTER (WHERE EXISTS (SELECT 1 FROM task_ready r WHERE r.id = t.id AND r.shard = t.shard)
			                              OR EXISTS (SELECT 1 FROM task_claims c WHERE c.id = t.id)), 0)
		FROM tasks t WHERE t.sequence_key = ANY ($1) GROUP BY t.sequence_key`, keys)
	if err != nil {
		rt.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var key string
		var live, unfinished, head, active int64
		var blocked bool
		if err := rows.Scan(&key, &live, &unfinished, &head, &blocked, &active); err != nil {
			rt.Fatal(err)
		}
		switch {
		case live > 1:
			rt.Fatalf("sequence %s has %d tasks claimable or running at once", key, live)
		case live == 1 && active != head:
			rt.Fatalf("sequence %s runs task %d, but its head is %d", key, active, head)
		case unfinished > 0 && live == 0 && !blocked:
			rt.Fatalf("sequence %s has %d unfinished tasks, none claimable or running, and no blocked head (head %d)", key, unfinished, head)
		case unfinished == 0 && head != 0 && !blocked:
			rt.Fatalf("sequence %s has no unfinished task but still a head %d", key, head)
		}
	}
	if err := rows.Err(); err != nil {
		rt.Fatal(err)
	}
}

func isConflict(err error) bool {
	var ce *tasks.ConflictError
	return errors.As(err, &ce)
}

// retried reports whether a task of sequence key was ever retried.
func retried(rt *rapid.T, s *store.Store, key string) bool {
	var n int
	if err := s.Pool().QueryRow(context.Background(), `SELECT count(*) FROM tasks WHERE sequence_key = $1 AND attempt_budget IS NOT NULL`, key).Scan(&n); err != nil {
		rt.Fatal(err)
	}
	return n > 0
}

// TestSequenceEnqueueRacingItsRelease enqueues into one sequence from
// producers whose transactions stay open a moment after the insert (the
// order between producers is their commits'; each producer's tasks run in
// its order), while
// a runner completes each head as soon as it can claim it: a sequence
// moving on at the commit of a completion must see every task whose
// enqueue raced it, so that none is left waiting with no head (to run
// later, behind a newer task, or never).
func TestSequenceEnqueueRacingItsRelease(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "r", 12, 1)
	const producers, each = 4, 40
	var wg sync.WaitGroup
	var mu sync.Mutex
	producerOf := map[int64]int{}
	errs := make(chan error, producers)
	for p := range producers {
		wg.Go(func() {
			for range each {
				err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
					e, err := s.EnqueueIn(ctx, tx, seqInsert("race", 12, false))
					if err != nil {
						return err
					}
					mu.Lock()
					producerOf[e.ID] = p
					mu.Unlock()
					_, err = tx.Exec(ctx, `SELECT pg_sleep(0.002 * $1)`, p%3)
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	completed := 0
	last := map[int]int64{} // per producer: its enqueues did not overlap
	produced := make(chan struct{})
	go func() { wg.Wait(); close(produced) }()
	deadline := time.Now().Add(time.Minute)
	for completed < producers*each && time.Now().Before(deadline) {
		got, err := s.Claim(ctx, "r", []claims.ShardEpoch{{Shard: 12, Epoch: 1}}, tasks.DefaultQueue, []string{"k"}, 10, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) > 1 {
			t.Fatalf("claimed %d tasks of one sequence at once", len(got))
		}
		for _, task := range got {
			mu.Lock()
			p := producerOf[task.ID]
			mu.Unlock()
			if task.ID < last[p] {
				t.Fatalf("task %d ran after task %d, which its producer enqueued after it", task.ID, last[p])
			}
			last[p] = task.ID
			one(t)(s.Complete(ctx, "r", []claims.Completion{{Ref: claims.RefOf(task)}}))
			completed++
		}
		select {
		case err := <-errs:
			t.Fatal(err)
		default:
		}
	}
	<-produced
	if completed != producers*each {
		var waiting int
		_ = s.Pool().QueryRow(ctx, `SELECT count(*) FROM tasks WHERE sequence_key = 'race' AND state = 'ready'`).Scan(&waiting)
		t.Fatalf("completed %d of %d; %d left waiting", completed, producers*each, waiting)
	}
}

// A sequence's next task goes into its lane when the head finishes, not at
// an insert, so no insert notifies it: the release itself notifies its
// shard (marked urgent for an urgent task), or each step of a sequence
// waits for the runners' next poll.
func TestSequenceReleaseNotifiesTheNextTasksShard(t *testing.T) {
	t.Parallel()
	s, dsn := pgtest.NewStore(t, store.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	first := seqInsert("notified", 21, false)
	second := seqInsert("notified", 21, false)
	second.Priority = 1
	if _, err := s.EnqueueBatch(ctx, []store.Insert{first, second}); err != nil {
		t.Fatal(err)
	}
	raise(t, s, "a", 21, 1)
	head := claim(t, s, "a", 21, 1, 10)
	if len(head) != 1 {
		t.Fatalf("claimed %d tasks of a sequence of two, want its head only", len(head))
	}
	conn := listenConn(ctx, t, dsn)
	if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(head[0])}})); r.Outcome != claims.Applied {
		t.Fatalf("completing the head: %v", r.Outcome)
	}
	n, err := conn.WaitForNotification(ctx)
	if err != nil {
		t.Fatalf("no notification after the head completed: %v", err)
	}
	if n.Payload != "!21" {
		t.Fatalf("notification %q after the head completed, want the next task's shard marked urgent: !21", n.Payload)
	}
}
