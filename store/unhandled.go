package store

// Ready tasks no attached runner can run (of a class, queue and kind, that
// no attached runner serves and handles): how many there are. The leader's
// optional rule that fails them after a while is FailUnrunnable (moves.go).

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// ClassCount is the ready tasks of one class (queue and kind).
type ClassCount struct {
	tasks.Class
	// Ready counts them up to UnrunnableCountCap; AtLeast says the count
	// stopped there.
	Ready   int64 `json:"ready"`
	AtLeast bool  `json:"ready_at_least,omitempty"`
	// Oldest is the earliest run_after among the most urgent of them.
	Oldest time.Time `json:"oldest_run_after"`
}

// UnrunnableCountCap is where ReadyUnrunnable stops counting a class: the
// report runs every few seconds on every coordinator, and while no runner
// is attached (a rolling deploy) every class is unrunnable.
const UnrunnableCountCap = 10_000

// readyLanes is a recursive CTE (lane: shard, queue, kind) of every lane of
// task_ready that holds a task, found by a loose scan of its primary key:
// one descent per lane, however many tasks each holds.
const readyLanes = `lane AS (
			(SELECT shard, queue, kind FROM task_ready ORDER BY shard, queue, kind LIMIT 1)
			UNION ALL
			SELECT n.shard, n.queue, n.kind FROM lane l CROSS JOIN LATERAL (
				SELECT r.shard, r.queue, r.kind FROM task_ready r
				WHERE (r.shard, r.queue, r.kind) > (l.shard, l.queue, l.kind)
				ORDER BY r.shard, r.queue, r.kind LIMIT 1) n
		)`

// ReadyUnrunnable returns the classes of ready tasks that are not in
// runnable (the classes some attached runner can run), each with its count
// (up to UnrunnableCountCap) and oldest run_after, in queue and kind order.
// The lanes of task_ready are found by a loose index scan and only the
// lanes of classes not runnable are counted, each count stopping at the
// cap. Tasks waiting in a sequence are not counted: their head is.
func (s *Store) ReadyUnrunnable(ctx context.Context, runnable []tasks.Class) ([]ClassCount, error) {
	queues, kinds := make([]string, len(runnable)), make([]string, len(runnable))
	for i, c := range runnable {
		queues[i], kinds[i] = c.Queue, c.Kind
	}
	return collect(ctx, s.pool, "counting ready tasks no attached runner can run", func(r pgx.CollectableRow) (ClassCount, error) {
		var cc ClassCount
		err := r.Scan(&cc.Queue, &cc.Kind, &cc.Ready, &cc.Oldest)
		cc.AtLeast = cc.Ready >= UnrunnableCountCap
		return cc, err
	}, `/* shardrun.ready_unrunnable */
		WITH RECURSIVE `+readyLanes+`, unrunnable AS MATERIALIZED (
			SELECT shard, queue, kind FROM lane
			WHERE (queue, kind) NOT IN (SELECT * FROM unnest($1::text[], $2::text[]))
		)
		SELECT u.queue, u.kind, c.n, o.oldest
		FROM (SELECT DISTINCT queue, kind FROM unrunnable) u
		CROSS JOIN LATERAL (
			SELECT count(*) AS n FROM (
				SELECT 1 FROM unrunnable l CROSS JOIN LATERAL (
					SELECT 1 FROM task_ready r WHERE r.shard = l.shard AND r.queue = l.queue AND r.kind = l.kind
					LIMIT $3) x
				WHERE l.queue = u.queue AND l.kind = u.kind
				LIMIT $3) y
		) c
		CROSS JOIN LATERAL (
			SELECT min((SELECT r.run_after FROM task_ready r WHERE r.shard = l.shard AND r.queue = l.queue AND r.kind = l.kind
				ORDER BY r.priority, r.run_after, r.id LIMIT 1)) AS oldest
			FROM unrunnable l WHERE l.queue = u.queue AND l.kind = u.kind
		) o
		WHERE c.n > 0
		ORDER BY u.queue, u.kind`, queues, kinds, UnrunnableCountCap)
}
