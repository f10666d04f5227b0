package store

// Shard fences: the newest ownership epoch of every shard, raised by each
// new owner, and the one condition every claim and write checks against it.

import (
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

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

// fenceCTE is the condition every claim and every write about a claimed task
// shares: the caller's fence rows for the (shard, epoch) pairs of terms (an
// SQL row source with columns shard, epoch), where the fence holds exactly
// that epoch and owner, locked FOR SHARE in shard order. A statement applies
// only to rows of shards it yields; raising a fence takes the row
// exclusively, so it waits for statements under way and every later one
// sees the new epoch.
func fenceCTE(owner, terms string) string {
	return `fence AS (
			SELECT f.shard, f.epoch FROM shard_fences f
			JOIN (` + terms + `) AS o(shard, epoch) ON o.shard = f.shard AND o.epoch = f.epoch
			WHERE f.owner = ` + owner + `
			ORDER BY f.shard
			FOR SHARE OF f
		)`
}
