package tasks

import (
	"errors"
	"fmt"
)

// ErrOwnershipLost is the cause of a handler's context ending because its
// runner stopped owning the task's shard: it detached, the shard moved and
// the handoff timed out, a newer owner's fence refused a write, or the
// runner shut down. An attempt cut short so is interrupted, not failed by
// its handler.
var ErrOwnershipLost = errors.New("shard ownership lost")

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
