package store

// Reads for the API and the status page.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// ErrNotFound is matched (errors.Is) by the error of Get and of every
// operation on a task id that does not exist (a *tasks.NotFoundError).
var ErrNotFound = tasks.ErrNotFound

// CountByState returns the exact number of tasks in each state (every state
// present), counted in the places of moves.go: ready in the lanes and the
// sequences' waiting lines, running in the claims, each final state in
// task_finished. It reads every entry: seconds at tens of millions of
// tasks. The status page uses CountByStateCapped instead.
func (s *Store) CountByState(ctx context.Context) (map[tasks.State]int64, error) {
	return s.countByState(ctx, "counting tasks by state", `/* shardrun.count */
		SELECT 'ready', (SELECT count(*) FROM task_ready) + (SELECT count(*) FROM task_waiting WHERE NOT ended)
		UNION ALL
		SELECT 'running', count(*) FROM task_claims
		UNION ALL
		SELECT state, count(*) FROM task_finished GROUP BY state`)
}

// FinishedRates returns how many tasks per second reached each final state
// (completed, failed, dead, cancelled; all present) over the last window, from
// task_finished's (state, finished_at) index: a rate that counts deltas of
// CountByState would go negative when retention deletes old tasks.
func (s *Store) FinishedRates(ctx context.Context, window time.Duration) (map[tasks.State]float64, error) {
	rows, err := s.pool.Query(ctx, `/* shardrun.finished_rates */
		SELECT f.state, (SELECT count(*) FROM task_finished t
			WHERE t.state = f.state AND t.finished_at > now() - $1 * interval '1 millisecond')
		FROM unnest($2::text[]) AS f(state)`, window.Milliseconds(), stateStrings(tasks.FinalStates))
	if err != nil {
		return nil, fmt.Errorf("counting recently finished tasks: %w", err)
	}
	rates := make(map[tasks.State]float64, len(tasks.FinalStates))
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

// Get returns one task, or an error matching ErrNotFound.
func (s *Store) Get(ctx context.Context, id int64) (tasks.Task, error) {
	t, err := scanTask(s.pool.QueryRow(ctx, `/* shardrun.get */ SELECT `+taskColumns+` FROM task_view t WHERE t.id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return tasks.Task{}, fmt.Errorf("getting task %d: %w", id, &tasks.NotFoundError{ID: id})
	}
	if err != nil {
		return tasks.Task{}, fmt.Errorf("getting task %d: %w", id, err)
	}
	return t, nil
}

// EnqueuedIn returns the tasks of kind that tx sees, newest first (at most
// limit): for tests of producers that enqueue inside their own
// transaction (shardruntest.RequireEnqueuedTx), which see its tasks
// before it commits.
func EnqueuedIn(ctx context.Context, tx pgx.Tx, kind string, limit int) ([]tasks.Task, error) {
	return collect(ctx, tx, fmt.Sprintf("reading the tasks of kind %q", kind), func(r pgx.CollectableRow) (tasks.Task, error) { return scanTask(r) },
		`/* shardrun.enqueued_in */ SELECT `+taskColumns+` FROM task_view t
		WHERE t.id = ANY (ARRAY(SELECT id FROM tasks WHERE kind = $1 ORDER BY kind, id DESC LIMIT $2)) ORDER BY t.id DESC`, kind, limit)
}

// collect runs a query on q and scans its rows with scan; what says what
// it reads in its errors ("listing schedules: …").
func collect[T any](ctx context.Context, q querier, what string, scan pgx.RowToFunc[T], sql string, args ...any) ([]T, error) {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	out, err := pgx.CollectRows(rows, scan)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return out, nil
}

// taskColumns are the columns of a whole task, as scanTask reads them, over
// a row t of task_view.
const taskColumns = `t.id, t.kind, t.shard, t.key, t.queue, t.priority, coalesce(t.sequence_key, ''), coalesce(t.sequence_blocks, false), t.payload, t.state, t.attempt, t.max_attempts, coalesce(t.attempt_budget, 0), t.run_after, t.deadline,
	t.claimed_by, t.claim_epoch, t.claimed_at, t.heartbeat_at, t.cancel_requested_at, t.unique_key,
	t.errors, t.result, t.created_at, t.finished_at`

// scanTask reads one row of taskColumns.
func scanTask(row pgx.Row) (tasks.Task, error) {
	var t tasks.Task
	var state string
	var claimedBy, uniqueKey *string
	var epoch *int64
	var result []byte
	var priority int16
	err := row.Scan(&t.ID, &t.Kind, &t.Shard, &t.Key, &t.Queue, &priority, &t.SequenceKey, &t.SequenceBlocks, &t.Payload, &state, &t.Attempt, &t.MaxAttempts, &t.AttemptBudget, &t.RunAfter, &t.Deadline,
		&claimedBy, &epoch, &t.ClaimedAt, &t.HeartbeatAt, &t.CancelRequestedAt, &uniqueKey,
		&t.Errors, &result, &t.CreatedAt, &t.FinishedAt)
	if err != nil {
		return tasks.Task{}, err
	}
	t.State = tasks.State(state)
	t.Priority = int(priority)
	if claimedBy != nil {
		t.ClaimedBy = *claimedBy
	}
	if uniqueKey != nil {
		t.UniqueKey = *uniqueKey
	}
	if epoch != nil {
		t.Epoch = *epoch
	}
	if result != nil {
		t.Result = result
	}
	return t, nil
}
