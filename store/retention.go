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
// first, and returns how many. It walks task_finished by (state,
// finished_at) from the oldest row of that state, so rows of other states
// kept longer are never visited. Rows locked by a concurrent statement (an
// operator's retry) are skipped for this batch. It applies under the
// leadership epoch only (ErrNotLeader otherwise).
func (s *Store) DeleteFinished(ctx context.Context, epoch int64, state string, olderThan time.Duration, limit int) (int64, error) {
	var fenced bool
	var n int64
	err := s.pool.QueryRow(ctx, `/* shardrun.delete_finished */
		WITH `+leaderFence+`, doomed AS (
			SELECT id FROM task_finished
			WHERE state = $2 AND finished_at < now() - $3 * interval '1 millisecond'
			  AND EXISTS (SELECT 1 FROM lf)
			ORDER BY finished_at
			LIMIT $4
		), locked AS (
			SELECT id FROM tasks
			WHERE id = ANY (ARRAY(SELECT id FROM doomed)) AND state = $2
			  AND finished_at < now() - $3 * interval '1 millisecond'
			ORDER BY id
			FOR UPDATE SKIP LOCKED
		), del AS (
			DELETE FROM tasks t WHERE t.id = ANY (ARRAY(SELECT id FROM locked))
			RETURNING t.id
		), gone AS (
			DELETE FROM task_finished f WHERE f.state = $2 AND f.id = ANY (ARRAY(SELECT id FROM del))
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
