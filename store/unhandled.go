package store

// Ready tasks of kinds no runner handles: how many there are, and the
// leader's optional rule that fails them after a while.

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// KindCount is the ready tasks of one kind.
type KindCount struct {
	Kind string `json:"kind"`
	// Ready counts them up to UnhandledCountCap; AtLeast says the count
	// stopped there.
	Ready   int64 `json:"ready"`
	AtLeast bool  `json:"ready_at_least,omitempty"`
	// Oldest is the earliest run_after among the most urgent of them.
	Oldest time.Time `json:"oldest_run_after"`
}

// UnhandledCountCap is where ReadyKindsExcept stops counting a kind: the
// report runs every few seconds on every coordinator, and while no runner
// is attached (a rolling deploy) every kind is unhandled.
const UnhandledCountCap = 10_000

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

// ReadyKindsExcept returns the kinds of ready tasks that are not in
// handled, each with its count (up to UnhandledCountCap) and oldest
// run_after, in kind order. The lanes of task_ready are found by a loose
// index scan and only the lanes of kinds not handled are counted, each
// count stopping at the cap.
func (s *Store) ReadyKindsExcept(ctx context.Context, handled []string) ([]KindCount, error) {
	if handled == nil {
		handled = []string{}
	}
	rows, err := s.pool.Query(ctx, `/* shardrun.ready_kinds_except */
		WITH RECURSIVE `+readyLanes+`, unhandled AS MATERIALIZED (
			SELECT shard, queue, kind FROM lane WHERE kind <> ALL ($1::text[])
		)
		SELECT u.kind, c.n, o.oldest
		FROM (SELECT DISTINCT kind FROM unhandled) u
		CROSS JOIN LATERAL (
			SELECT count(*) AS n FROM (
				SELECT 1 FROM unhandled l CROSS JOIN LATERAL (
					SELECT 1 FROM task_ready r WHERE r.shard = l.shard AND r.queue = l.queue AND r.kind = l.kind
					LIMIT $2) x
				WHERE l.kind = u.kind
				LIMIT $2) y
		) c
		CROSS JOIN LATERAL (
			SELECT min((SELECT r.run_after FROM task_ready r WHERE r.shard = l.shard AND r.queue = l.queue AND r.kind = l.kind
				ORDER BY r.priority, r.run_after, r.id LIMIT 1)) AS oldest
			FROM unhandled l WHERE l.kind = u.kind
		) o
		WHERE c.n > 0
		ORDER BY u.kind`, handled, UnhandledCountCap)
	if err != nil {
		return nil, fmt.Errorf("counting ready tasks of unhandled kinds: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (KindCount, error) {
		var kc KindCount
		err := r.Scan(&kc.Kind, &kc.Ready, &kc.Oldest)
		kc.AtLeast = kc.Ready >= UnhandledCountCap
		return kc, err
	})
	if err != nil {
		return nil, fmt.Errorf("counting ready tasks of unhandled kinds: %w", err)
	}
	return out, nil
}
