package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// ErrNotFound is returned by Get for a missing task.
var ErrNotFound = tasks.ErrTaskGone

// Backoff parameterises the SQL backoff function used by sweeps; it mirrors
// tasks.RetryPolicy.
type Backoff struct {
	Base time.Duration
	Cap  time.Duration
}

// Enqueue inserts one task and returns its id.
func (s *Store) Enqueue(ctx context.Context, in tasks.Insert) (int64, error) {
	var id int64
	err := s.pool.QueryRow(ctx, `
		INSERT INTO tasks (kind, shard, key, payload, max_attempts, run_after, deadline)
		VALUES ($1, $2, $3, $4::jsonb, $5, coalesce($6, now()), $7)
		RETURNING id`,
		in.Kind, in.Shard, in.Key, string(in.Payload), in.MaxAttempts, in.RunAfter, in.Deadline).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("enqueueing task of kind %q: %w", in.Kind, err)
	}
	return id, nil
}

// EnqueueBatch inserts many tasks with COPY in one transaction and returns
// how many it inserted. Tasks without RunAfter get the database's now().
func (s *Store) EnqueueBatch(ctx context.Context, ins []tasks.Insert) (int64, error) {
	if len(ins) == 0 {
		return 0, nil
	}
	var now, later [][]any
	for _, in := range ins {
		row := []any{in.Kind, int32(in.Shard), in.Key, string(in.Payload), int32(in.MaxAttempts), in.Deadline}
		if in.RunAfter == nil {
			now = append(now, row)
		} else {
			later = append(later, append(row, *in.RunAfter))
		}
	}
	cols := []string{"kind", "shard", "key", "payload", "max_attempts", "deadline"}
	var total int64
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if len(now) > 0 {
			n, err := tx.CopyFrom(ctx, pgx.Identifier{"tasks"}, cols, pgx.CopyFromRows(now))
			if err != nil {
				return err
			}
			total += n
		}
		if len(later) > 0 {
			n, err := tx.CopyFrom(ctx, pgx.Identifier{"tasks"}, append(cols, "run_after"), pgx.CopyFromRows(later))
			if err != nil {
				return err
			}
			total += n
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("enqueueing %d tasks with COPY: %w", len(ins), err)
	}
	return total, nil
}

// RaiseFences records the runner's ownership of shards at the given epochs
// and returns those whose fence now holds that epoch. A shard whose fence is
// already newer is left alone and not returned: the caller no longer owns it.
// Raising the epoch the fence already holds is idempotent.
func (s *Store) RaiseFences(ctx context.Context, owner string, owned []tasks.ShardEpoch) ([]tasks.ShardEpoch, error) {
	if len(owned) == 0 {
		return nil, nil
	}
	shards, epochs := splitSorted(owned)
	rows, err := s.pool.Query(ctx, `
		INSERT INTO shard_fences AS f (shard, epoch, owner)
		SELECT shard, epoch, $3 FROM unnest($1::int[], $2::bigint[]) AS o(shard, epoch) ORDER BY shard
		ON CONFLICT (shard) DO UPDATE SET epoch = excluded.epoch, owner = excluded.owner, raised_at = now()
		WHERE f.epoch <= excluded.epoch
		RETURNING shard, epoch`, shards, epochs, owner)
	if err != nil {
		return nil, fmt.Errorf("raising fences of %d shards: %w", len(owned), err)
	}
	raised, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (tasks.ShardEpoch, error) {
		var se tasks.ShardEpoch
		err := r.Scan(&se.Shard, &se.Epoch)
		return se, err
	})
	if err != nil {
		return nil, fmt.Errorf("raising fences of %d shards: %w", len(owned), err)
	}
	return raised, nil
}

// RequeueOrphans moves the running tasks of the given shards whose claim
// epoch is older than the shard's epoch back to ready (attempt+1), or to dead
// when their attempts are used up. Their owner is gone by construction: the
// shard changed hands. It applies only to shards whose fence the caller holds.
func (s *Store) RequeueOrphans(ctx context.Context, owner string, owned []tasks.ShardEpoch) (requeued, dead int64, err error) {
	if len(owned) == 0 {
		return 0, 0, nil
	}
	shards, epochs := splitSorted(owned)
	rows, err := s.pool.Query(ctx, `
		WITH fence AS (
			SELECT f.shard FROM shard_fences f
			JOIN unnest($1::int[], $2::bigint[]) AS o(shard, epoch) ON o.shard = f.shard AND o.epoch = f.epoch
			WHERE f.owner = $3
			ORDER BY f.shard
			FOR SHARE OF f
		)
		UPDATE tasks t SET
		`+retryOrBury("now()", "t.claimed_by", `format('orphaned: shard %s moved from epoch %s to %s', t.shard, t.claim_epoch,
			($2::bigint[])[array_position($1::int[], t.shard)])`)+`
		WHERE t.shard = ANY (ARRAY(SELECT shard FROM fence)) AND t.state = 'running'
		  AND t.claim_epoch < ($2::bigint[])[array_position($1::int[], t.shard)]
		RETURNING t.state`, shards, epochs, owner)
	if err != nil {
		return 0, 0, fmt.Errorf("requeueing orphans of %d shards: %w", len(owned), err)
	}
	return countStates(rows, "requeueing orphans")
}

// claimColumns are the fields a handler needs.
const claimColumns = `t.id, t.kind, t.shard, t.key, t.payload, t.state, t.attempt, t.max_attempts,
	t.run_after, t.deadline, t.claimed_by, t.claim_epoch, t.claimed_at, t.created_at`

// Plans must not depend on fresh statistics: a queue table is often
// bulk-loaded and churned faster than autovacuum analyses it, and the
// planner then estimates its CTEs and scans at a row or two. So rows of
// tasks are found only by primary key from input arrays (unnest, or
// id = ANY(ARRAY(...))) or by an index scan whose filter is an array
// (shard = ANY(ARRAY(SELECT shard FROM fence)), the epoch looked up in the
// input arrays), never by joining a scan of tasks to a CTE.
// docs/architecture.md has what the join cost.

// Claim moves up to limit ready tasks of the given kinds, in run_after order,
// from the shards the runner holds the fence of, to running under that
// shard's epoch. Shards whose fence is not (owner, epoch) yield nothing.
func (s *Store) Claim(ctx context.Context, owner string, owned []tasks.ShardEpoch, kinds []string, limit int) ([]tasks.Task, error) {
	if len(owned) == 0 || len(kinds) == 0 || limit <= 0 {
		return nil, nil
	}
	shards, epochs := splitSorted(owned)
	rows, err := s.pool.Query(ctx, `
		WITH fence AS (
			SELECT f.shard FROM shard_fences f
			JOIN unnest($2::int[], $3::bigint[]) AS o(shard, epoch) ON o.shard = f.shard AND o.epoch = f.epoch
			WHERE f.owner = $1
			ORDER BY f.shard
			FOR SHARE OF f
		), picked AS (
			SELECT t.id, ($3::bigint[])[array_position($2::int[], t.shard)] AS epoch
			FROM tasks t
			WHERE t.state = 'ready' AND t.run_after <= now() AND t.kind = ANY($4::text[])
			  AND (t.deadline IS NULL OR t.deadline > now())
			  AND t.shard = ANY (ARRAY(SELECT shard FROM fence))
			ORDER BY t.run_after, t.id
			LIMIT $5
			FOR UPDATE OF t SKIP LOCKED
		)
		UPDATE tasks t SET state = 'running', claimed_by = $1, claim_epoch = p.epoch,
			claimed_at = now(), heartbeat_at = NULL
		FROM unnest(ARRAY(SELECT id FROM picked ORDER BY id), ARRAY(SELECT epoch FROM picked ORDER BY id)) AS p(id, epoch)
		WHERE t.id = p.id
		RETURNING `+claimColumns, owner, shards, epochs, kinds, limit)
	if err != nil {
		return nil, fmt.Errorf("claiming tasks on %d shards: %w", len(owned), err)
	}
	claimed, err := pgx.CollectRows(rows, scanClaimed)
	if err != nil {
		return nil, fmt.Errorf("claiming tasks on %d shards: %w", len(owned), err)
	}
	return claimed, nil
}

func scanClaimed(r pgx.CollectableRow) (tasks.Task, error) {
	var t tasks.Task
	var state string
	var claimedBy *string
	var epoch *int64
	err := r.Scan(&t.ID, &t.Kind, &t.Shard, &t.Key, &t.Payload, &state, &t.Attempt, &t.MaxAttempts,
		&t.RunAfter, &t.Deadline, &claimedBy, &epoch, &t.ClaimedAt, &t.CreatedAt)
	t.State = tasks.State(state)
	if claimedBy != nil {
		t.ClaimedBy = *claimedBy
	}
	if epoch != nil {
		t.Epoch = *epoch
	}
	return t, err
}

// inputCol is an extra per-task column of a fenced write, visible to its SET
// list as c.<name>.
type inputCol struct {
	name, sqlType string
	values        any
}

// fencedWrite is the common shape of heartbeat, complete and fail: an input
// table of refs (plus extra columns), the caller's fence rows locked FOR
// SHARE, and an UPDATE that applies only to rows still running under exactly
// that claim.
func (s *Store) fencedWrite(ctx context.Context, what, owner string, refs []tasks.Ref,
	set string, extra ...inputCol) ([]tasks.WriteResult, error) {
	if len(refs) == 0 {
		return nil, nil
	}
	ids := make([]int64, len(refs))
	shards := make([]int32, len(refs))
	attempts := make([]int32, len(refs))
	epochs := make([]int64, len(refs))
	for i, r := range refs {
		ids[i], shards[i], attempts[i], epochs[i] = r.ID, int32(r.Shard), int32(r.Attempt), r.Epoch
	}
	args := []any{owner, ids, shards, attempts, epochs}
	arrays := "$2::bigint[], $3::int[], $4::int[], $5::bigint[]"
	names := "id, shard, attempt, epoch"
	for _, col := range extra {
		args = append(args, col.values)
		arrays += fmt.Sprintf(", $%d::%s[]", len(args), col.sqlType)
		names += ", " + col.name
	}
	sql := `
		WITH c AS (
			SELECT * FROM unnest(` + arrays + `) AS u(` + names + `)
		), fence AS (
			SELECT f.shard, f.epoch FROM shard_fences f
			WHERE f.owner = $1 AND (f.shard, f.epoch) IN (SELECT DISTINCT shard, epoch FROM c)
			ORDER BY f.shard
			FOR SHARE OF f
		)
		UPDATE tasks t SET ` + set + `
		FROM c JOIN fence ON fence.shard = c.shard AND fence.epoch = c.epoch
		WHERE t.id = c.id AND t.shard = c.shard AND t.state = 'running'
		  AND t.claimed_by = $1 AND t.claim_epoch = c.epoch AND t.attempt = c.attempt
		RETURNING t.id, c.attempt, c.epoch, t.state`
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("%s %d tasks: %w", what, len(refs), err)
	}
	// Keyed by the whole claim: a batch may hold a stale attempt and the
	// current one of the same task, and only the current one can apply.
	type claim struct {
		id      int64
		attempt int32
		epoch   int64
	}
	applied := make(map[claim]tasks.State, len(refs))
	var c claim
	var state string
	_, err = pgx.ForEachRow(rows, []any{&c.id, &c.attempt, &c.epoch, &state}, func() error {
		applied[c] = tasks.State(state)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%s %d tasks: %w", what, len(refs), err)
	}
	results := make([]tasks.WriteResult, len(refs))
	var missed []int
	for i, r := range refs {
		results[i].Ref = r
		if st, ok := applied[claim{r.ID, int32(r.Attempt), r.Epoch}]; ok {
			results[i].State = st
		} else {
			missed = append(missed, i)
		}
	}
	if len(missed) > 0 {
		if err := s.classify(ctx, owner, results, missed); err != nil {
			return nil, fmt.Errorf("%s %d tasks: %w", what, len(refs), err)
		}
	}
	return results, nil
}

// classify explains why writes did not apply: the fence moved (or was never
// ours), the task is gone, or the task moved on.
func (s *Store) classify(ctx context.Context, owner string, results []tasks.WriteResult, missed []int) error {
	ids := make([]int64, len(missed))
	shards := make([]int32, len(missed))
	for i, m := range missed {
		ids[i], shards[i] = results[m].Ref.ID, int32(results[m].Ref.Shard)
	}
	rows, err := s.pool.Query(ctx, `
		SELECT c.id, t.id IS NOT NULL, coalesce(f.epoch, 0), coalesce(f.owner, '')
		FROM unnest($1::bigint[], $2::int[]) WITH ORDINALITY AS c(id, shard, n)
		LEFT JOIN tasks t ON t.id = c.id
		LEFT JOIN shard_fences f ON f.shard = c.shard
		ORDER BY c.n`, ids, shards)
	if err != nil {
		return fmt.Errorf("classifying rejected writes: %w", err)
	}
	i := 0
	var id, fenceEpoch int64
	var exists bool
	var fenceOwner string
	_, err = pgx.ForEachRow(rows, []any{&id, &exists, &fenceEpoch, &fenceOwner}, func() error {
		res := &results[missed[i]]
		i++
		switch {
		case fenceEpoch != res.Ref.Epoch || fenceOwner != owner:
			res.Outcome = tasks.FenceLost
		case !exists:
			res.Outcome = tasks.TaskGone
		default:
			res.Outcome = tasks.TaskMoved
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("classifying rejected writes: %w", err)
	}
	return nil
}

// Heartbeat records that the runner is still working on these attempts, in
// one statement.
func (s *Store) Heartbeat(ctx context.Context, owner string, refs []tasks.Ref) ([]tasks.WriteResult, error) {
	return s.fencedWrite(ctx, "heartbeating", owner, refs, `heartbeat_at = now()`)
}

// Unclaim gives back claims whose handler never started (the shard began
// to move between the claim and the start): running -> ready with the same
// attempt, since no attempt was made.
func (s *Store) Unclaim(ctx context.Context, owner string, refs []tasks.Ref) ([]tasks.WriteResult, error) {
	return s.fencedWrite(ctx, "unclaiming", owner, refs,
		`state = 'ready', claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL, heartbeat_at = NULL`)
}

// Complete records successful attempts, in one statement.
func (s *Store) Complete(ctx context.Context, owner string, done []tasks.Completion) ([]tasks.WriteResult, error) {
	refs := make([]tasks.Ref, len(done))
	results := make([]*string, len(done))
	for i, d := range done {
		refs[i] = d.Ref
		if d.Result != nil {
			r := string(d.Result)
			results[i] = &r
		}
	}
	return s.fencedWrite(ctx, "completing", owner, refs,
		`state = 'completed', result = c.result::jsonb, finished_at = now(), heartbeat_at = now()`,
		inputCol{"result", "text", results})
}

// Fail records failed attempts, in one statement: each task goes back to
// ready with attempt+1 after its RetryAfter, or to dead when its attempts are
// used up. The error text is appended to the task's errors.
func (s *Store) Fail(ctx context.Context, owner string, failed []tasks.Failure) ([]tasks.WriteResult, error) {
	refs := make([]tasks.Ref, len(failed))
	msgs := make([]string, len(failed))
	delays := make([]int64, len(failed))
	for i, f := range failed {
		refs[i], msgs[i], delays[i] = f.Ref, f.Error, f.RetryAfter.Milliseconds()
	}
	return s.fencedWrite(ctx, "failing", owner, refs,
		retryOrBury("now() + c.delay_ms * interval '1 millisecond'", "$1::text", "c.msg"),
		inputCol{"msg", "text", msgs}, inputCol{"delay_ms", "bigint", delays})
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

// SweepDeadlines fails up to limit unfinished tasks whose deadline passed
// and returns how many, under the leadership epoch (ErrNotLeader if it is
// not the fence's). Rows locked by a concurrent write are skipped for this
// pass; the statement re-checks state and deadline on every row.
func (s *Store) SweepDeadlines(ctx context.Context, epoch int64, limit int) (int64, error) {
	var fenced bool
	var n int64
	err := s.pool.QueryRow(ctx, `
		WITH `+leaderFence+`, due AS (
			SELECT id FROM tasks
			WHERE deadline < now() AND state IN ('ready', 'running') AND EXISTS (SELECT 1 FROM lf)
			ORDER BY deadline
			LIMIT $2
			FOR UPDATE SKIP LOCKED
		), upd AS (
			UPDATE tasks t SET state = 'failed', finished_at = now(),
				errors = t.errors || jsonb_build_array(jsonb_build_object(
					'attempt', t.attempt, 'at', now(), 'runner', t.claimed_by, 'error', 'deadline exceeded'))
			WHERE t.id = ANY (ARRAY(SELECT id FROM due)) AND t.state IN ('ready', 'running') AND t.deadline < now()
			RETURNING 1
		)
		SELECT EXISTS (SELECT 1 FROM lf), (SELECT count(*) FROM upd)`, epoch, limit).Scan(&fenced, &n)
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

func countStates(rows pgx.Rows, what string) (ready, dead int64, err error) {
	var state string
	_, err = pgx.ForEachRow(rows, []any{&state}, func() error {
		if tasks.State(state) == tasks.Dead {
			dead++
		} else {
			ready++
		}
		return nil
	})
	if err != nil {
		return 0, 0, fmt.Errorf("%s: %w", what, err)
	}
	return ready, dead, nil
}

// CountByState returns the number of tasks in each state (all five present).
func (s *Store) CountByState(ctx context.Context) (map[tasks.State]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT state, count(*) FROM tasks GROUP BY state`)
	if err != nil {
		return nil, fmt.Errorf("counting tasks by state: %w", err)
	}
	counts := make(map[tasks.State]int64, len(tasks.States))
	for _, st := range tasks.States {
		counts[st] = 0
	}
	var state string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&state, &n}, func() error {
		counts[tasks.State(state)] = n
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("counting tasks by state: %w", err)
	}
	return counts, nil
}

// FinishedRates returns how many tasks per second reached each final state
// (completed, failed, dead; all three present) over the last window, from
// the finished_at index: a rate that counts deltas of CountByState would go
// negative when retention deletes old tasks.
func (s *Store) FinishedRates(ctx context.Context, window time.Duration) (map[tasks.State]float64, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT state, count(*) FROM tasks
		WHERE finished_at > now() - $1 * interval '1 millisecond'
		GROUP BY state`, window.Milliseconds())
	if err != nil {
		return nil, fmt.Errorf("counting recently finished tasks: %w", err)
	}
	rates := map[tasks.State]float64{tasks.Completed: 0, tasks.Failed: 0, tasks.Dead: 0}
	var state string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&state, &n}, func() error {
		rates[tasks.State(state)] = float64(n) / window.Seconds()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("counting recently finished tasks: %w", err)
	}
	return rates, nil
}

// Get returns one task, or ErrNotFound.
func (s *Store) Get(ctx context.Context, id int64) (tasks.Task, error) {
	var t tasks.Task
	var state string
	var claimedBy *string
	var epoch *int64
	var result []byte
	err := s.pool.QueryRow(ctx, `
		SELECT id, kind, shard, key, payload, state, attempt, max_attempts, run_after, deadline,
		       claimed_by, claim_epoch, claimed_at, heartbeat_at, errors, result, created_at, finished_at
		FROM tasks WHERE id = $1`, id).Scan(
		&t.ID, &t.Kind, &t.Shard, &t.Key, &t.Payload, &state, &t.Attempt, &t.MaxAttempts, &t.RunAfter, &t.Deadline,
		&claimedBy, &epoch, &t.ClaimedAt, &t.HeartbeatAt, &t.Errors, &result, &t.CreatedAt, &t.FinishedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return tasks.Task{}, fmt.Errorf("getting task %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return tasks.Task{}, fmt.Errorf("getting task %d: %w", id, err)
	}
	t.State = tasks.State(state)
	if claimedBy != nil {
		t.ClaimedBy = *claimedBy
	}
	if epoch != nil {
		t.Epoch = *epoch
	}
	if result != nil {
		t.Result = result
	}
	return t, nil
}

// splitSorted returns the shards and epochs of owned ordered by shard, so
// that every statement locks fence rows in the same order.
func splitSorted(owned []tasks.ShardEpoch) ([]int32, []int64) {
	sorted := slices.Clone(owned)
	slices.SortFunc(sorted, func(a, b tasks.ShardEpoch) int { return a.Shard - b.Shard })
	shards := make([]int32, len(sorted))
	epochs := make([]int64, len(sorted))
	for i, se := range sorted {
		shards[i], epochs[i] = int32(se.Shard), se.Epoch
	}
	return shards, epochs
}

// retryOrBury is the SET list of every statement that ends an attempt in
// failure: back to ready with attempt+1 at runAfter and the claim cleared, or
// to dead when the attempts are used up, keeping the claim as evidence. The
// error (an SQL expression, as is runner) is appended to the task's errors
// under the attempt that failed.
func retryOrBury(runAfter, runner, errExpr string) string {
	return `
		state        = CASE WHEN t.attempt < t.max_attempts THEN 'ready' ELSE 'dead' END,
		attempt      = CASE WHEN t.attempt < t.max_attempts THEN t.attempt + 1 ELSE t.attempt END,
		run_after    = CASE WHEN t.attempt < t.max_attempts THEN ` + runAfter + ` ELSE t.run_after END,
		finished_at  = CASE WHEN t.attempt < t.max_attempts THEN NULL ELSE now() END,
		claimed_by   = CASE WHEN t.attempt < t.max_attempts THEN NULL ELSE t.claimed_by END,
		claim_epoch  = CASE WHEN t.attempt < t.max_attempts THEN NULL ELSE t.claim_epoch END,
		claimed_at   = CASE WHEN t.attempt < t.max_attempts THEN NULL ELSE t.claimed_at END,
		heartbeat_at = CASE WHEN t.attempt < t.max_attempts THEN NULL ELSE t.heartbeat_at END,
		errors       = t.errors || jsonb_build_array(jsonb_build_object(
			'attempt', t.attempt, 'at', now(), 'runner', ` + runner + `, 'error', ` + errExpr + `))`
}
