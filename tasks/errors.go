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

// ErrShardMoved says that the task's shard moved to another database
// while its attempt ran (a cluster of several databases moves shards
// between them online): a write about the attempt in the database the
// shard left, such as CompleteTx in a handler's transaction, is refused
// there. A handler that returns an error wrapping it (or ErrOwnershipLost)
// is interrupted, not failed: the attempt is not spent, and the task runs
// again from the shard's new database.
var ErrShardMoved = errors.New("the task's shard moved to another database")

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
