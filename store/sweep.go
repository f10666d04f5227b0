package store

// The leader coordinator's sweeps, fenced by the coordinator fence.

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Backoff parameterises the SQL backoff function used by sweeps; it mirrors
// tasks.RetryPolicy.
type Backoff struct {
	Base time.Duration
	Cap  time.Duration
}

// ErrNotLeader is returned by the sweeps when the coordinator fence holds
// another leadership epoch: the caller has been deposed.
var ErrNotLeader = errors.New("store: coordinator fence holds a newer leader")

// RaiseLeaderFence records a new leadership epoch and reports whether the
// fence now holds it (false: a newer leader exists). It waits for sweeps
// under the old epoch that are under way.
func (s *Store) RaiseLeaderFence(ctx context.Context, leader string, epoch int64) (bool, error) {
	tag, err := s.pool.Exec(ctx, `
		INSERT INTO coordinator_fence AS f (id, epoch, leader) VALUES (1, $1, $2)
		ON CONFLICT (id) DO UPDATE SET epoch = excluded.epoch, leader = excluded.leader, raised_at = now()
		WHERE f.epoch <= excluded.epoch`, epoch, leader)
	if err != nil {
		return false, fmt.Errorf("raising the coordinator fence to %d: %w", epoch, err)
	}
	return tag.RowsAffected() == 1, nil
}

// leaderFence is the CTE that locks the coordinator fence FOR SHARE when it
// holds epoch $1; sweeps apply only if it yields a row.
const leaderFence = `lf AS (SELECT epoch FROM coordinator_fence WHERE id = 1 AND epoch = $1 FOR SHARE)`

// SkipRunning as SweepDeadlines' runningGrace sweeps ready tasks only.
const SkipRunning time.Duration = -1

// SweepDeadlines fails up to limit unfinished tasks whose deadline passed
// and returns how many, under the leadership epoch (ErrNotLeader if it is
// not the fence's): ready tasks at once, running ones only runningGrace
// after their deadline. A running task's runner ends its handler at the
// deadline and records the outcome itself; the sweep is the backstop for a
// runner that is gone, and the grace lets the success of a handler that
// returned before its deadline land even when its write was delayed (a
// database outage). Rows locked by a concurrent write are skipped for this
// pass; the statement re-checks state and deadline on every row. A
// negative runningGrace (SkipRunning) leaves running tasks alone: the
// sweeper's outage grace, when their runners' writes may still be on the
// way.
func (s *Store) SweepDeadlines(ctx context.Context, epoch int64, runningGrace time.Duration, limit int) (int64, error) {
	var fenced bool
	var n int64
	graceMS := runningGrace.Milliseconds()
	if runningGrace < 0 {
		graceMS = -1 // SkipRunning would round to 0 ms
	}
	err := s.pool.QueryRow(ctx, `
		WITH `+leaderFence+`, due AS (
			SELECT id FROM tasks
			WHERE deadline < now() AND state IN ('ready', 'running') AND EXISTS (SELECT 1 FROM lf)
			  AND (state = 'ready' OR ($3 >= 0 AND deadline < now() - $3 * interval '1 millisecond'))
			ORDER BY deadline
			LIMIT $2
			FOR UPDATE SKIP LOCKED
		), upd AS (
			UPDATE tasks t SET state = 'failed', finished_at = now(),
				errors = t.errors || jsonb_build_array(jsonb_build_object(
					'attempt', t.attempt, 'at', now(), 'runner', t.claimed_by, 'error', 'deadline exceeded'))
			WHERE t.id = ANY (ARRAY(SELECT id FROM due)) AND t.state IN ('ready', 'running') AND t.deadline < now()
			  AND (t.state = 'ready' OR ($3 >= 0 AND t.deadline < now() - $3 * interval '1 millisecond'))
			RETURNING 1
		)
		SELECT EXISTS (SELECT 1 FROM lf), (SELECT count(*) FROM upd)`, epoch, limit, graceMS).Scan(&fenced, &n)
	if err != nil {
		return 0, fmt.Errorf("sweeping deadlines: %w", err)
	}
	if !fenced {
		return 0, ErrNotLeader
	}
	return n, nil
}

// SweepStale requeues up to limit running tasks whose last sign of life —
// the last heartbeat, or the claim when there was none — is older than
// threshold: to ready with attempt+1 after a backoff, or to dead when the
// attempts are used up. Tasks past their deadline are left to SweepDeadlines
// (deadline wins over staleness). It applies under the leadership epoch only
// (ErrNotLeader otherwise).
func (s *Store) SweepStale(ctx context.Context, epoch int64, threshold time.Duration, limit int, b Backoff) (requeued, dead int64, err error) {
	var fenced bool
	err = s.pool.QueryRow(ctx, `
		WITH `+leaderFence+`, stale AS (
			SELECT id FROM tasks
			WHERE state = 'running' AND coalesce(heartbeat_at, claimed_at) < now() - $2 * interval '1 millisecond'
			  AND EXISTS (SELECT 1 FROM lf)
			ORDER BY coalesce(heartbeat_at, claimed_at)
			LIMIT $3
			FOR UPDATE SKIP LOCKED
		), upd AS (
			UPDATE tasks t SET
			`+retryOrBury("now() + shardrun_backoff(t.attempt, $4, $5)", "t.claimed_by",
		"format('stale claim: no sign of life since %s', coalesce(t.heartbeat_at, t.claimed_at))")+`
			WHERE t.id = ANY (ARRAY(SELECT id FROM stale)) AND t.state = 'running'
			  AND coalesce(t.heartbeat_at, t.claimed_at) < now() - $2 * interval '1 millisecond'
			  AND (t.deadline IS NULL OR t.deadline >= now())
			RETURNING t.state
		)
		SELECT EXISTS (SELECT 1 FROM lf),
		       (SELECT count(*) FROM upd WHERE state = 'ready'),
		       (SELECT count(*) FROM upd WHERE state = 'dead')`,
		epoch, threshold.Milliseconds(), limit, b.Base.Milliseconds(), b.Cap.Milliseconds()).Scan(&fenced, &requeued, &dead)
	if err != nil {
		return 0, 0, fmt.Errorf("sweeping stale claims: %w", err)
	}
	if !fenced {
		return 0, 0, ErrNotLeader
	}
	return requeued, dead, nil
}

// Uptime is how long the database server has been up, by its own clock: a
// heartbeat cannot have been written while it was down, so the stale rule
// waits until the server has been up for a whole stale threshold.
func (s *Store) Uptime(ctx context.Context) (time.Duration, error) {
	var ms float64
	if err := s.pool.QueryRow(ctx, `SELECT extract(epoch FROM now() - pg_postmaster_start_time()) * 1000`).Scan(&ms); err != nil {
		return 0, fmt.Errorf("reading the database's uptime: %w", err)
	}
	return time.Duration(ms * float64(time.Millisecond)), nil
}
