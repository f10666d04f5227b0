package store

// Shard fences: the newest ownership epoch of every shard, raised by each
// new owner together with the requeue of what earlier owners left running.

import (
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// RaiseFences records the runner's ownership of shards at the given epochs,
// returns those whose fence now holds that epoch, and in the same
// transaction requeues the claims earlier owners left on them (to ready
// with attempt+1, or dead when the attempts are used up: their owner is
// gone by construction). A shard whose fence is already newer is left
// alone and not returned: the caller no longer owns it. Raising the epoch
// the fence already holds is idempotent.
//
// One transaction makes the shard's move atomic for the old owner's
// writes, which match their claim row and take no fence lock: a write that
// locked its claim row before the requeue reached it commits before the
// raise does, and every later one finds its claim gone. Claims lock the
// fence rows of the shards they take from FOR SHARE, so the raise waits for
// a claim under the old epoch and the requeue then sees what it claimed.
func (s *Store) RaiseFences(ctx context.Context, owner string, owned []tasks.ShardEpoch) (raised []tasks.ShardEpoch, requeued, dead int64, err error) {
	if len(owned) == 0 {
		return nil, 0, 0, nil
	}
	shards, epochs := splitSorted(owned)
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `/* shardrun.raise_fences */
			INSERT INTO shard_fences AS f (shard, epoch, owner)
			SELECT shard, epoch, $3 FROM unnest($1::int[], $2::bigint[]) AS o(shard, epoch) ORDER BY shard
			ON CONFLICT (shard) DO UPDATE SET epoch = excluded.epoch, owner = excluded.owner, raised_at = now()
			WHERE f.epoch <= excluded.epoch
			RETURNING shard, epoch`, shards, epochs, owner)
		if err != nil {
			return err
		}
		raised, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (tasks.ShardEpoch, error) {
			var se tasks.ShardEpoch
			err := r.Scan(&se.Shard, &se.Epoch)
			return se, err
		})
		if err != nil || len(raised) == 0 {
			return err
		}
		rs, re := splitSorted(raised)
		rows, err = tx.Query(ctx, `/* shardrun.requeue_orphans */
			WITH k AS (
				DELETE FROM task_claims k
				WHERE k.shard = ANY ($1::int[]) AND k.epoch < ($2::bigint[])[array_position($1::int[], k.shard)]
				RETURNING k.*, format('orphaned: shard %s moved from epoch %s to %s', k.shard, k.epoch,
					($2::bigint[])[array_position($1::int[], k.shard)]) AS msg
			)`+endClaims(retryOrBury("now()", "k.msg"))+`
			SELECT t.state FROM t`, rs, re)
		if err != nil {
			return err
		}
		requeued, dead, err = countStates(rows, "requeueing orphans")
		return err
	})
	if err != nil {
		return nil, 0, 0, fmt.Errorf("raising fences of %d shards: %w", len(owned), err)
	}
	return raised, requeued, dead, nil
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
