package tasks

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/shardrun/shardrun/internal/jsonbody"
)

// Handler runs one attempt of a task. ctx is cancelled when the runner loses
// the task's shard, detaches or shuts down, and when an operator cancels
// the task (its cause is then ErrCancelled: CancelRequested(ctx)); a
// handler must return promptly then. A nil error completes the task, also
// after a cancel request: the handler says its work is done, and its result
// is kept. Any other error fails the attempt (retried with backoff while
// attempts are left), or, after a cancel request, ends the task cancelled.
type Handler func(ctx context.Context, t *Task) error

// ErrPayload wraps payload decoding errors from Typed handlers.
// A payload error is permanent: the same payload will not decode on the
// next attempt either.
var ErrPayload = fmt.Errorf("decoding payload (%w)", ErrPermanent)

// SetResult stores v, as JSON, as the task's result when the attempt
// completes. A result PostgreSQL's jsonb cannot store (a string holding
// NUL, which encoding/json writes as \u0000; nesting deeper than
// jsonbody.MaxDepth) is refused here, where the handler can still do
// something about it, rather than when the completion is written.
func (t *Task) SetResult(v any) error {
	b, err := json.Marshal(v)
	if err == nil {
		err = jsonbody.Check(b)
	}
	if err != nil {
		return fmt.Errorf("encoding result of task %d: %w", t.ID, err)
	}
	t.Result = b
	return nil
}
