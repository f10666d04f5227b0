package store

// Retention: the leader deletes finished tasks older than their state's
// horizon, in bounded batches, fenced by the coordinator fence.

import (
	"context"
	"fmt"
	"time"
)

// DeleteFinished deletes up to limit tasks in the given final state whose
// finished_at is older than olderThan (by the database clock), oldest
// first, and returns how many. It walks tasks_finished_state_idx (state,
// finished_at) from the oldest row of that state, so rows of other states
// kept longer are never visited. Rows locked by a concurrent statement are
// skipped for this batch. It applies under the leadership epoch only
// (ErrNotLeader otherwise).
func (s *Store) DeleteFinished(ctx context.Context, epoch int64, state string, olderThan time.Duration, limit int) (int64, error) {
	var fenced bool
	var n int64
	err := s.pool.QueryRow(ctx, `
		WITH `+leaderFence+`, doomed AS (
			SELECT id FROM tasks
			WHERE state = $2 AND finished_at IS NOT NULL AND finished_at < now() - $3 * interval '1 millisecond'
			  AND EXISTS (SELECT 1 FROM lf)
			ORDER BY finished_at
			LIMIT $4
			FOR UPDATE SKIP LOCKED
		), del AS (
			DELETE FROM tasks t
			WHERE t.id = ANY (ARRAY(SELECT id FROM doomed)) AND t.state = $2
			  AND t.finished_at < now() - $3 * interval '1 millisecond'
			RETURNING 1
		)
		SELECT EXISTS (SELECT 1 FROM lf), (SELECT count(*) FROM del)`,
		epoch, state, olderThan.Milliseconds(), limit).Scan(&fenced, &n)
	if err != nil {
		return 0, fmt.Errorf("deleting %s tasks finished over %s ago: %w", state, olderThan, err)
	}
	if !fenced {
		return 0, ErrNotLeader
	}
	return n, nil
}
