package tasks

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Outcome says what a fenced write did to one task.
type Outcome int

const (
	// Applied: the row changed as asked.
	Applied Outcome = iota
	// FenceLost: the shard's fence is no longer the writer's epoch (or was
	// never raised by it). The writer has lost the shard and must stop all
	// its work on it.
	FenceLost
	// TaskMoved: the fence is still the writer's, but the task is no longer
	// this running attempt of this claim (a sweep requeued it, or it already
	// finished). Nothing changed; the attempt's result is dropped.
	TaskMoved
	// TaskGone: no such task.
	TaskGone
)

func (o Outcome) String() string {
	switch o {
	case Applied:
		return "applied"
	case FenceLost:
		return "fence_lost"
	case TaskMoved:
		return "task_moved"
	case TaskGone:
		return "task_gone"
	}
	return fmt.Sprintf("outcome(%d)", int(o))
}

// ErrOwnershipLost is the cause of a handler's context ending because its
// runner stopped owning the task's shard: it detached, the shard moved and
// the handoff timed out, a newer owner's fence refused a write, or the
// runner shut down. An attempt cut short so is interrupted, not failed by
// its handler.
var ErrOwnershipLost = errors.New("shard ownership lost")

// Sentinel errors for the outcomes that did not apply.
var (
	ErrFenceLost = errors.New("shard fence lost")
	ErrTaskMoved = errors.New("task no longer in the expected state, attempt or claim")
	ErrTaskGone  = errors.New("task not found")
)

// Err returns nil for Applied and the matching sentinel otherwise.
func (o Outcome) Err() error {
	switch o {
	case Applied:
		return nil
	case FenceLost:
		return ErrFenceLost
	case TaskMoved:
		return ErrTaskMoved
	default:
		return ErrTaskGone
	}
}

// WriteResult is the outcome of a fenced write for one task. State is the
// task's state after the write when it applied. CancelRequested, when it
// applied, says that an operator asked to cancel the task: a heartbeat that
// sees it cancels the attempt.
type WriteResult struct {
	Ref             Ref
	Outcome         Outcome
	State           State
	CancelRequested bool
}

// Completion is a successful attempt to record.
type Completion struct {
	Ref    Ref
	Result json.RawMessage // nil for no result
}

// Interruption is an attempt cut short because its runner lost the shard,
// to record without spending the attempt. Reason says what ended it.
type Interruption struct {
	Ref    Ref
	Reason string
}

// Failure is a failed attempt to record. RetryAfter is the backoff before the
// next attempt when attempts are left. Final buries the task (dead) whatever
// attempts are left: the handler said no retry can succeed. Expired ends it
// failed, as the sweeper's deadline rule does: the task's deadline passed,
// so no attempt may follow.
type Failure struct {
	Ref        Ref
	Error      string
	RetryAfter time.Duration
	Final      bool
	Expired    bool
}

// ErrPermanent marks a handler error no retry can fix (a payload that does
// not decode, input the handler refuses): the task goes dead at once
// instead of spending its remaining attempts. Wrap it with Permanent.
var ErrPermanent = errors.New("permanent failure")

// Permanent marks err as a failure no retry can fix.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrPermanent, err)
}
