package shardrun

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/tasks"
)

// Get returns one task with its payload, history and result
// (tasks.ErrNotFound when there is none).
func (c *Client) Get(ctx context.Context, id int64) (tasks.Task, error) { return c.tasks.Get(ctx, id) }

// List returns one page of tasks that match the request's filter.
func (c *Client) List(ctx context.Context, req tasks.ListRequest) (tasks.Page, error) {
	return c.tasks.List(ctx, req)
}

// Cancel cancels a task: a ready or waiting one at once, a running one by
// a request its runner acts on within a heartbeat interval. A finished task
// gives a *tasks.ConflictError naming its state.
func (c *Client) Cancel(ctx context.Context, id int64) (tasks.Task, error) {
	return c.tasks.Cancel(ctx, id)
}

// Retry puts a dead, failed or cancelled task back to ready with a fresh
// budget of attempts.
func (c *Client) Retry(ctx context.Context, id int64) (tasks.Task, error) {
	return c.tasks.Retry(ctx, id)
}

// CancelMatching cancels every task the filter selects (at least one field
// set), in batches.
func (c *Client) CancelMatching(ctx context.Context, f tasks.Filter) (tasks.BulkResult, error) {
	return c.tasks.CancelMatching(ctx, f)
}

// RetryMatching retries every dead, failed or cancelled task the filter
// selects.
func (c *Client) RetryMatching(ctx context.Context, f tasks.Filter) (tasks.BulkResult, error) {
	return c.tasks.RetryMatching(ctx, f)
}

// Wait returns task id once it has finished (completed, failed, dead or
// cancelled), or ctx's error. It reads the task at growing intervals, from
// 10ms to 1s: fine for a caller waiting on a few tasks, not a way to
// follow thousands.
func (c *Client) Wait(ctx context.Context, id int64) (tasks.Task, error) {
	backoff := clock.Backoff{Min: 10 * time.Millisecond, Max: time.Second}
	for {
		t, err := c.tasks.Get(ctx, id)
		if err != nil {
			return tasks.Task{}, fmt.Errorf("waiting for task %d: %w", id, err)
		}
		if slices.Contains(tasks.FinalStates, t.State) {
			return t, nil
		}
		if !clock.Sleep(clock.Real(), backoff.Next(), ctx.Done()) {
			return t, fmt.Errorf("waiting for task %d (still %s): %w", id, t.State, ctx.Err())
		}
	}
}
