package store

// Queues (pause, resume, what each holds) and sequences (which are blocked
// and by what).

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// QueueStats is one queue as operators see it.
type QueueStats struct {
	Name string `json:"name"`
	// Ready counts its ready tasks up to QueueCountCap (ReadyAtLeast: the
	// count stopped there), Running its running ones.
	Ready        int64 `json:"ready"`
	ReadyAtLeast bool  `json:"ready_at_least,omitempty"`
	Running      int64 `json:"running"`
	// PausedAt is when an operator paused it (nil: not paused).
	PausedAt *time.Time `json:"paused_at,omitempty"`
	// Rate is how many of its tasks completed per second over the last
	// window.
	Rate float64 `json:"completed_per_second"`
	// Idle: no unfinished task — none in its lanes, none in a sequence's
	// waiting line (ended ones included: they hold their sequence's place),
	// none running. An idle queue other than the default one can be
	// removed (DeleteQueue).
	Idle bool `json:"idle"`
}

// QueueCountCap is where Queues stops counting a queue's ready tasks.
const QueueCountCap = 100_000

// SetQueuePaused pauses (paused) or resumes the queue name, cluster-wide:
// no runner claims a paused queue's tasks (the claim statement checks it),
// running ones finish. A pause is a barrier: once it returns, no claim
// under way can still take a task of the queue. A queue no task was
// enqueued in yet can be paused ahead (which gives it a row); resuming a
// queue without a row changes nothing (a queue without a row is not
// paused), and gives it none. It returns when the queue was paused (zero:
// it is not).
func (s *Store) SetQueuePaused(ctx context.Context, name string, paused bool) (time.Time, error) {
	var at *time.Time
	// The row is locked FOR UPDATE first: claims lock it FOR KEY SHARE, so
	// a pause waits for the claims under way and every later claim sees it
	// (see Claim). A resumed queue's tasks may wait on any shard: every
	// runner looks.
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `/* shardrun.lock_queue */ SELECT 1 FROM queues WHERE name = $1 FOR UPDATE`, name); err != nil {
			return err
		}
		if !paused {
			_, err := tx.Exec(ctx, `/* shardrun.resume_queue */
				WITH q AS (UPDATE queues SET paused_at = NULL WHERE name = $1)
				SELECT shardrun_notify(NULL, NULL)`, name)
			return err
		}
		return tx.QueryRow(ctx, `/* shardrun.pause_queue */
			INSERT INTO queues AS q (name, paused_at) VALUES ($1, now())
			ON CONFLICT (name) DO UPDATE SET paused_at = coalesce(q.paused_at, now())
			RETURNING paused_at`, name).Scan(&at)
	})
	if err != nil {
		return time.Time{}, fmt.Errorf("setting queue %s paused=%v: %w", name, paused, err)
	}
	if at == nil {
		return time.Time{}, nil
	}
	return *at, nil
}

// Queues returns every queue with its counts, its completion rate over the
// last window and whether it is idle, in name order. Ready tasks are counted by lane (a loose scan
// of task_ready's primary key, then each lane of the queue up to the cap)
// and in the sequences' waiting lines, running ones in task_claims,
// completions in task_finished.
func (s *Store) Queues(ctx context.Context, window time.Duration) ([]QueueStats, error) {
	return collect(ctx, s.pool, "reading the queues", func(r pgx.CollectableRow) (QueueStats, error) {
		var q QueueStats
		var completed int64
		var waiting bool
		err := r.Scan(&q.Name, &q.Ready, &q.Running, &q.PausedAt, &completed, &waiting)
		q.ReadyAtLeast = q.Ready >= QueueCountCap
		q.Rate = float64(completed) / window.Seconds()
		q.Idle = q.Ready == 0 && q.Running == 0 && !waiting
		return q, err
	}, `/* shardrun.queues */
		WITH RECURSIVE `+readyLanes+`, lanes AS MATERIALIZED (SELECT * FROM lane WHERE kind IS NOT NULL)
		SELECT q.name, r.n + (SELECT count(*) FROM (SELECT 1 FROM task_waiting w WHERE w.queue = q.name AND NOT w.ended LIMIT $1) w),
			(SELECT count(*) FROM task_claims c WHERE c.queue = q.name), q.paused_at,
			(SELECT count(*) FROM task_finished f
			 WHERE f.state = 'completed' AND f.finished_at > now() - $2 * interval '1 millisecond' AND f.queue = q.name),
			EXISTS (SELECT 1 FROM task_waiting w WHERE w.queue = q.name)
		FROM queues q
		CROSS JOIN LATERAL (
			SELECT count(*) AS n FROM (
				SELECT 1 FROM lanes l CROSS JOIN LATERAL (
					SELECT 1 FROM task_ready r WHERE r.shard = l.shard AND r.queue = l.queue AND r.kind = l.kind LIMIT $1) x
				WHERE l.queue = q.name
				LIMIT $1) y
		) r
		ORDER BY q.name`, QueueCountCap, window.Milliseconds())
}

// RemovedQueue is the row DeleteQueue removed.
type RemovedQueue struct {
	Name      string     `json:"name"`
	CreatedAt time.Time  `json:"created_at"`
	PausedAt  *time.Time `json:"paused_at,omitempty"`
}

// QueueWork counts a queue's unfinished tasks, each up to QueueWorkCap:
// in its lanes (ready, due or not), waiting in a sequence's line (ended
// ones too: they hold their sequence's place), and running.
type QueueWork struct {
	Ready   int64 `json:"ready"`
	Waiting int64 `json:"waiting"`
	Running int64 `json:"running"`
}

// QueueWorkCap is where DeleteQueue stops counting each of a queue's
// unfinished tasks: one is enough to refuse.
const QueueWorkCap = 10_000

// ErrNoSuchQueue: DeleteQueue found no row for the queue.
var ErrNoSuchQueue = errors.New("no such queue")

// ErrDefaultQueue: DeleteQueue of the default queue, which every task
// enqueued without a queue goes to; it is never removed.
var ErrDefaultQueue = errors.New("the default queue cannot be removed: every task enqueued without a queue goes to it")

// QueueInUseError is DeleteQueue's refusal of a queue that has unfinished
// tasks (Work), or that a transaction is enqueueing into right now
// (Enqueueing: an enqueue, or a retry of one of its tasks, not yet
// committed — or one into a queue whose name shares its removal lock, one
// of 64: try again).
type QueueInUseError struct {
	Queue      string
	Work       QueueWork
	Enqueueing bool
}

func (e *QueueInUseError) Error() string {
	if e.Enqueueing {
		return fmt.Sprintf("queue %s is being enqueued into: a transaction that enqueues into it (or into a queue that shares its removal lock, one of 64) or retries one of its tasks is open; try again", e.Queue)
	}
	return fmt.Sprintf("queue %s has unfinished tasks (%d ready, %d waiting in a sequence, %d running; each counted up to %d): "+
		"let them finish, or cancel them, before removing it", e.Queue, e.Work.Ready, e.Work.Waiting, e.Work.Running, QueueWorkCap)
}

// DeleteQueue removes the row of the queue name — its pause, its place in
// the listing — when the queue holds no unfinished task. Rows come from
// every enqueue of a new queue name and from pausing one ahead, and stayed
// forever (finding 7 of the hostile-input review). A queue enqueued into
// again after its removal comes back: the insert trigger files its row.
// Finished tasks of the queue are kept (retention deletes them).
//
// Errors: ErrDefaultQueue, ErrNoSuchQueue, *QueueInUseError.
func (s *Store) DeleteQueue(ctx context.Context, name string) (RemovedQueue, error) {
	var outcome string
	var work QueueWork
	var created, paused *time.Time
	err := s.pool.QueryRow(ctx, `/* shardrun.remove_queue */ SELECT * FROM shardrun_remove_queue($1, $2)`, name, QueueWorkCap).
		Scan(&outcome, &work.Ready, &work.Waiting, &work.Running, &created, &paused)
	if err != nil {
		return RemovedQueue{}, fmt.Errorf("removing queue %s: %w", name, err)
	}
	switch outcome {
	case "removed":
		s.queues.Delete(name)
		return RemovedQueue{Name: name, CreatedAt: *created, PausedAt: paused}, nil
	case "work":
		return RemovedQueue{}, &QueueInUseError{Queue: name, Work: work}
	case "enqueueing":
		return RemovedQueue{}, &QueueInUseError{Queue: name, Enqueueing: true}
	case "missing":
		return RemovedQueue{}, fmt.Errorf("removing queue %s: %w", name, ErrNoSuchQueue)
	case "default":
		return RemovedQueue{}, ErrDefaultQueue
	}
	return RemovedQueue{}, fmt.Errorf("removing queue %s: unknown outcome %q", name, outcome)
}

// BlockedSequence is a sequence held back by its head: a task that ended
// dead or failed in a sequence that blocks on failure, until an operator
// retries it or cancels it.
type BlockedSequence struct {
	Key       string        `json:"sequence_key"`
	BlockedAt time.Time     `json:"blocked_at"`
	Task      tasks.Summary `json:"blocked_by"`
	// Waiting counts the tasks behind it, up to WaitingCountCap.
	Waiting int64 `json:"waiting"`
}

// WaitingCountCap is where BlockedSequences stops counting the tasks a
// blocked sequence holds back.
const WaitingCountCap = 10_000

// BlockedSequences returns up to limit blocked sequences after the key
// after, in key order, each with the task that blocks it.
func (s *Store) BlockedSequences(ctx context.Context, after string, limit int) ([]BlockedSequence, error) {
	return collect(ctx, s.pool, "listing blocked sequences", func(r pgx.CollectableRow) (BlockedSequence, error) {
		var b BlockedSequence
		var err error
		b.Task, err = scanSummaryAnd(r, &b.Key, &b.BlockedAt, &b.Waiting)
		return b, err
	}, `/* shardrun.blocked_sequences */
		SELECT `+summaryColumns+`, s.key, s.blocked_at,
			(SELECT count(*) FROM (SELECT 1 FROM task_waiting w WHERE w.sequence_key = s.key LIMIT $3) x)
		FROM task_sequences s
		CROSS JOIN LATERAL (SELECT * FROM task_view v WHERE v.id = s.head_id) t
		WHERE s.blocked_at IS NOT NULL AND s.key > $1
		ORDER BY s.key LIMIT $2`, after, limit, WaitingCountCap)
}
