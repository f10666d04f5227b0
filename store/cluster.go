package store

// The cluster a database belongs to: its shard count, recorded at the
// first start and enforced on every task row by a CHECK constraint, so
// that no producer (raw SQL included) can insert a task into a shard no
// runner will ever own.

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// ErrShardCountMismatch is returned by EnsureShardCount when the database
// was created for another shard count.
var ErrShardCountMismatch = errors.New("store: the database belongs to a cluster with another shard count")

// EnsureShardCount records n as the database's shard count when none is
// recorded yet and adds the constraint tasks_shard_in_range (shard < n),
// or checks n against the recorded count (ErrShardCountMismatch, naming
// --shard-count). Concurrent first starts are serialised by the row lock
// on shardrun_cluster. Existing tasks outside the range make the first
// start fail and name how many there are.
func (s *Store) EnsureShardCount(ctx context.Context, n int) (created bool, err error) {
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO shardrun_cluster (id, shard_count) VALUES (1, $1) ON CONFLICT (id) DO NOTHING`, n)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			var have int
			if err := tx.QueryRow(ctx, `SELECT shard_count FROM shardrun_cluster WHERE id = 1`).Scan(&have); err != nil {
				return err
			}
			if have != n {
				return fmt.Errorf("--shard-count: %w: the database's tasks are spread over %d shards (table shardrun_cluster), this process is configured with %d",
					ErrShardCountMismatch, have, n)
			}
			return nil
		}
		created = true
		var outside int64
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE shard >= $1`, n).Scan(&outside); err != nil {
			return err
		}
		if outside > 0 {
			return fmt.Errorf("--shard-count: the database holds %d tasks in shards outside [0, %d): %w", outside, n, ErrShardCountMismatch)
		}
		// A CHECK constraint cannot read another table, so the count goes
		// into the constraint itself; n is an int, formatted, not quoted.
		_, err = tx.Exec(ctx, fmt.Sprintf(`ALTER TABLE tasks ADD CONSTRAINT tasks_shard_in_range CHECK (shard < %d)`, n))
		return err
	})
	if err != nil {
		if errors.Is(err, ErrShardCountMismatch) {
			return false, err
		}
		return false, fmt.Errorf("recording the shard count %d in the database: %w", n, err)
	}
	return created, nil
}
