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

// ErrNotFound is returned by Get for a missing task.
var ErrNotFound = tasks.ErrTaskGone

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
	// One range of tasks_finished_idx (state, finished_at) per final state.
	rows, err := s.pool.Query(ctx, `
		SELECT f.state, (SELECT count(*) FROM tasks t
			WHERE t.state = f.state AND t.finished_at > now() - $1 * interval '1 millisecond')
		FROM unnest(ARRAY['completed', 'failed', 'dead', 'cancelled']) AS f(state)`, window.Milliseconds())
	if err != nil {
		return nil, fmt.Errorf("counting recently finished tasks: %w", err)
	}
	rates := map[tasks.State]float64{tasks.Completed: 0, tasks.Failed: 0, tasks.Dead: 0}
	var state string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&state, &n}, func() error {
		if _, known := rates[tasks.State(state)]; known || n > 0 {
			rates[tasks.State(state)] = float64(n) / window.Seconds()
		}
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
