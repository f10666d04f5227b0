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
	Kind  string `json:"kind"`
	Ready int64  `json:"ready"`
	// Oldest is the earliest run_after among them.
	Oldest time.Time `json:"oldest_run_after"`
}

// ReadyKindsExcept returns the kinds of ready tasks that are not in
// handled, each with its count and oldest run_after, in kind order. The
// distinct kinds are found by one descent of tasks_ready_idx per kind (a
// loose index scan), and only the kinds not handled are counted.
func (s *Store) ReadyKindsExcept(ctx context.Context, handled []string) ([]KindCount, error) {
	if handled == nil {
		handled = []string{}
	}
	rows, err := s.pool.Query(ctx, `
		WITH RECURSIVE kinds AS (
			(SELECT kind FROM tasks WHERE state = 'ready' ORDER BY kind LIMIT 1)
			UNION ALL
			SELECT (SELECT t.kind FROM tasks t WHERE t.state = 'ready' AND t.kind > k.kind ORDER BY t.kind LIMIT 1)
			FROM kinds k WHERE k.kind IS NOT NULL
		)
		SELECT k.kind, c.n, c.oldest
		FROM kinds k
		CROSS JOIN LATERAL (
			SELECT count(*) AS n, min(t.run_after) AS oldest FROM tasks t WHERE t.state = 'ready' AND t.kind = k.kind
		) c
		WHERE k.kind IS NOT NULL AND k.kind <> ALL ($1::text[]) AND c.n > 0
		ORDER BY k.kind`, handled)
	if err != nil {
		return nil, fmt.Errorf("counting ready tasks of unhandled kinds: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (KindCount, error) {
		var kc KindCount
		err := r.Scan(&kc.Kind, &kc.Ready, &kc.Oldest)
		return kc, err
	})
	if err != nil {
		return nil, fmt.Errorf("counting ready tasks of unhandled kinds: %w", err)
	}
	return out, nil
}

// FailUnhandled fails up to limit ready tasks of kind that have been due
// (run_after) for longer than dueFor, oldest first, recording reason as
// the attempt's error, and returns how many. It applies under the
// leadership epoch only (ErrNotLeader otherwise).
func (s *Store) FailUnhandled(ctx context.Context, epoch int64, kind string, dueFor time.Duration, limit int, reason string) (int64, error) {
	var fenced bool
	var n int64
	err := s.pool.QueryRow(ctx, `
		WITH `+leaderFence+`, due AS (
			SELECT id FROM tasks
			WHERE state = 'ready' AND kind = $2 AND run_after < now() - $3 * interval '1 millisecond'
			  AND EXISTS (SELECT 1 FROM lf)
			ORDER BY run_after, id
			LIMIT $4
			FOR UPDATE SKIP LOCKED
		), upd AS (
			UPDATE tasks t SET state = 'failed', finished_at = now(),
				errors = t.errors || jsonb_build_array(jsonb_build_object(
					'attempt', t.attempt, 'at', now(), 'error', $5::text))
			WHERE t.id = ANY (ARRAY(SELECT id FROM due)) AND t.state = 'ready' AND t.kind = $2
			RETURNING 1
		)
		SELECT EXISTS (SELECT 1 FROM lf), (SELECT count(*) FROM upd)`,
		epoch, kind, dueFor.Milliseconds(), limit, reason).Scan(&fenced, &n)
	if err != nil {
		return 0, fmt.Errorf("failing ready tasks of unhandled kind %q: %w", kind, err)
	}
	if !fenced {
		return 0, ErrNotLeader
	}
	return n, nil
}
