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
// database outage). A running task whose cancel was requested ends
// cancelled, as every other leader sweep ends it. Rows locked by a
// concurrent write are skipped for this pass; the statement re-checks
// the deadline on every row. A negative runningGrace (SkipRunning) leaves
// running tasks alone: the sweeper's outage grace, when their runners'
// writes may still be on the way.
func (s *Store) SweepDeadlines(ctx context.Context, epoch int64, runningGrace time.Duration, limit int) (int64, error) {
	var fenced bool
	var ready, running int64
	err := s.pool.QueryRow(ctx, `/* shardrun.sweep_deadlines_ready */
		WITH `+leaderFence+`, due AS (
			SELECT r.id FROM task_ready r
			WHERE r.deadline < now() AND EXISTS (SELECT 1 FROM lf)
			ORDER BY r.deadline
			LIMIT $2
		), `+lockLanes("SELECT id FROM due", "deadline < now()")+`, t AS (
			UPDATE tasks t SET state = 'failed', finished_at = now(),
				errors = t.errors || jsonb_build_array(jsonb_build_object(
					'attempt', t.attempt, 'at', now(), 'error', 'deadline exceeded'))
			WHERE t.id = ANY (ARRAY(SELECT id FROM taken ORDER BY id))
			RETURNING t.id, t.shard, t.queue, t.kind, t.priority, t.run_after, t.deadline, t.state, t.unique_key, t.finished_at
		)`+fileTail("t")+`
		SELECT EXISTS (SELECT 1 FROM lf), (SELECT count(*) FROM t)`, epoch, limit).Scan(&fenced, &ready)
	if err != nil {
		return 0, fmt.Errorf("sweeping deadlines of ready tasks: %w", err)
	}
	if !fenced {
		return 0, ErrNotLeader
	}
	if runningGrace < 0 || ready >= int64(limit) {
		return ready, nil
	}
	err = s.pool.QueryRow(ctx, `/* shardrun.sweep_deadlines_running */
		WITH `+leaderFence+`, due AS (
			SELECT id FROM task_claims
			WHERE deadline < now() - $3 * interval '1 millisecond' AND EXISTS (SELECT 1 FROM lf)
			ORDER BY id
			LIMIT $2
			FOR UPDATE SKIP LOCKED
		), k AS (
			DELETE FROM task_claims k WHERE k.id = ANY (ARRAY(SELECT id FROM due))
			  AND k.deadline < now() - $3 * interval '1 millisecond'
			RETURNING k.*
		)`+endClaims(`
			state = CASE WHEN t.cancel_requested_at IS NULL THEN 'failed' ELSE 'cancelled' END,
			finished_at = now(), `+claimEvidence+`,
			errors = t.errors || jsonb_build_array(jsonb_build_object(
				'attempt', t.attempt, 'at', now(), 'runner', k.owner, 'error',
				CASE WHEN t.cancel_requested_at IS NULL THEN 'deadline exceeded'
				     ELSE 'cancelled on request; its deadline passed while its runner was away' END))`)+`
		SELECT EXISTS (SELECT 1 FROM lf), (SELECT count(*) FROM t)`,
		epoch, limit-int(ready), runningGrace.Milliseconds()).Scan(&fenced, &running)
	if err != nil {
		return ready, fmt.Errorf("sweeping deadlines of running tasks: %w", err)
	}
	if !fenced {
		return ready, ErrNotLeader
	}
	return ready + running, nil
}

// SweepStale requeues up to limit running tasks whose last sign of life —
// the last heartbeat, or the claim when there was none — is older than
// threshold: to ready with attempt+1 after a backoff, or to dead when the
// attempts are used up. Tasks past their deadline are left to SweepDeadlines
// (deadline wins over staleness). It applies under the leadership epoch only
// (ErrNotLeader otherwise). A claim can be stale only if it was made a
// threshold ago, so the statement reads the old claims only, by the claim
// time's index.
func (s *Store) SweepStale(ctx context.Context, epoch int64, threshold time.Duration, limit int, b Backoff) (requeued, dead int64, err error) {
	var fenced bool
	err = s.pool.QueryRow(ctx, `/* shardrun.sweep_stale */
		WITH `+leaderFence+`, stale AS (
			SELECT id FROM task_claims
			WHERE claimed_at < now() - $2 * interval '1 millisecond'
			  AND coalesce(heartbeat_at, claimed_at) < now() - $2 * interval '1 millisecond'
			  AND (deadline IS NULL OR deadline >= now())
			  AND EXISTS (SELECT 1 FROM lf)
			ORDER BY claimed_at
			LIMIT $3
			FOR UPDATE SKIP LOCKED
		), k AS (
			DELETE FROM task_claims k WHERE k.id = ANY (ARRAY(SELECT id FROM stale ORDER BY id))
			  AND coalesce(k.heartbeat_at, k.claimed_at) < now() - $2 * interval '1 millisecond'
			  AND (k.deadline IS NULL OR k.deadline >= now())
			RETURNING k.*, format('stale claim: no sign of life since %s', coalesce(k.heartbeat_at, k.claimed_at)) AS msg
		)`+endClaims(retryOrBury("now() + shardrun_backoff("+budgetAttempt+", $4, $5)", "k.msg"))+`
		SELECT EXISTS (SELECT 1 FROM lf),
		       (SELECT count(*) FROM t WHERE state = 'ready'),
		       (SELECT count(*) FROM t WHERE state = 'dead')`,
		epoch, threshold.Milliseconds(), limit, b.Base.Milliseconds(), b.Cap.Milliseconds()).Scan(&fenced, &requeued, &dead)
	if err != nil {
		return 0, 0, fmt.Errorf("sweeping stale claims: %w", err)
	}
	if !fenced {
		return 0, 0, ErrNotLeader
	}
	return requeued, dead, nil
}

// lockLanes is the CTEs locked and taken that take tasks out of their
// lanes by id (ids: SQL yielding them, where: a further condition on the
// task record): the records are locked first, skipping those another
// statement holds, then their task_ready entries are deleted. A claim that
// holds an entry (it locks no record) makes the delete wait and then find
// the entry gone: that task is running now and is not taken. Records
// before lane entries, as an operator's cancel takes them, so the two
// cannot deadlock.
func lockLanes(ids, where string) string {
	return `locked AS MATERIALIZED (
			SELECT id, shard, queue, kind, priority, run_after FROM tasks
			WHERE id = ANY (ARRAY(` + ids + `)) AND state = 'ready' AND ` + where + `
			ORDER BY id
			FOR UPDATE SKIP LOCKED
		), taken AS (
			DELETE FROM task_ready r USING locked l
			WHERE r.shard = l.shard AND r.queue = l.queue AND r.kind = l.kind AND r.priority = l.priority
			  AND r.run_after = l.run_after AND r.id = l.id
			RETURNING r.id
		)`
}

// budgetAttempt is the number of the failing attempt within the task's
// current attempt budget (SQL over the task t): a retry grants a fresh
// budget, and the backoff counts from its start, not from the task's
// first attempt ever.
const budgetAttempt = `(t.attempt - (t.max_attempts - coalesce(t.attempt_budget, t.max_attempts)))`

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
