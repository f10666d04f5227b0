package store

// The cluster a database belongs to: its shard count, recorded at the
// first start and enforced on every task row by a CHECK constraint, so
// that no producer (raw SQL included) can insert a task into a shard no
// runner will ever own; and, until Register records the database's place
// among several (databases.go), that it holds every shard.

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrShardCountMismatch is returned by EnsureShardCount when the database
// was created for another shard count.
var ErrShardCountMismatch = errors.New("store: the database belongs to a cluster with another shard count")

// EnsureShardCount records n as the database's shard count when none is
// recorded yet, or checks n against the recorded count
// (ErrShardCountMismatch, naming --shard-count), and makes sure the
// constraint tasks_shard_in_range (shard < count) exists and holds.
//
// The constraint is added NOT VALID (enforced for new rows at once, a
// lock held for an instant) and then validated under a lock that lets
// claims, heartbeats and completions go on: validating in the same step
// would scan the whole table under an exclusive lock, stalling every
// heartbeat on a large table. Concurrent first starts are serialised by
// the row lock on shardrun_cluster; existing tasks outside the range make
// the start fail.
func (s *Store) EnsureShardCount(ctx context.Context, n int) (created bool, err error) {
	have := n
	// Read without the row lock first: a cluster's every process checks
	// the count at its start, and in the locking transaction they took
	// turns, a commit each (bench section startup: 0.35-0.7 s of a
	// runner's start, 16 runners spawned at once).
	var placed bool
	if s.pool.QueryRow(ctx, `SELECT shard_count, registered_at IS NOT NULL OR EXISTS (SELECT 1 FROM shardrun_placement)
		FROM shardrun_cluster WHERE id = 1`).Scan(&have, &placed) != nil || !placed {
		have = n
		err = s.recordShardCount(ctx, n, &have, &created)
	}
	if err != nil {
		return false, fmt.Errorf("recording the shard count %d in the database: %w", n, err)
	}
	if have != n {
		return false, fmt.Errorf("--shard-count: %w: the database's tasks are spread over %d shards (table shardrun_cluster), this process is configured with %d",
			ErrShardCountMismatch, have, n)
	}
	if err := s.ensureShardRange(ctx, n); err != nil {
		return created, err
	}
	return created, nil
}

// recordShardCount records n as the cluster's shard count unless one is
// recorded (have), placing every shard here when the database is not
// registered with a cluster of several.
func (s *Store) recordShardCount(ctx context.Context, n int, have *int, created *bool) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO shardrun_cluster (id, shard_count) VALUES (1, $1) ON CONFLICT (id) DO NOTHING`, n)
		if err != nil {
			return err
		}
		*created = tag.RowsAffected() == 1
		var registered bool
		if err := tx.QueryRow(ctx, `SELECT shard_count, registered_at IS NOT NULL FROM shardrun_cluster WHERE id = 1 FOR UPDATE`).
			Scan(have, &registered); err != nil {
			return err
		}
		if *have != n || registered {
			return nil
		}
		// A database of a cluster of one database (until Register says
		// otherwise) holds every shard.
		_, err = tx.Exec(ctx, `/* shardrun.place_all */
			INSERT INTO shardrun_placement (shard, state)
			SELECT s, 'held' FROM generate_series(0, $1 - 1) AS s
			WHERE NOT EXISTS (SELECT 1 FROM shardrun_placement)
			ON CONFLICT (shard) DO NOTHING`, n)
		return err
	})
}

// ShardCount is the shard count the database recorded at its cluster's
// first start (EnsureShardCount); ok is false when none is recorded yet.
// A producer without etcd takes its shards from it.
func (s *Store) ShardCount(ctx context.Context) (n int, ok bool, err error) {
	err = s.pool.QueryRow(ctx, `SELECT shard_count FROM shardrun_cluster WHERE id = 1`).Scan(&n)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("reading the database's shard count: %w", err)
	}
	return n, true, nil
}

// ensureShardRange adds tasks_shard_in_range if it is missing and validates
// it if it is not yet.
func (s *Store) ensureShardRange(ctx context.Context, n int) error {
	var exists, valid bool
	err := s.pool.QueryRow(ctx, `SELECT count(*) > 0, coalesce(bool_and(convalidated), false) FROM pg_constraint
		WHERE conrelid = 'tasks'::regclass AND conname = 'tasks_shard_in_range'`).Scan(&exists, &valid)
	if err != nil {
		return fmt.Errorf("reading the shard range constraint: %w", err)
	}
	if !exists {
		// A CHECK constraint cannot read another table, so the count goes
		// into the constraint itself; n is an int, formatted, not quoted.
		_, err := s.pool.Exec(ctx, fmt.Sprintf(`ALTER TABLE tasks ADD CONSTRAINT tasks_shard_in_range CHECK (shard < %d) NOT VALID`, n))
		var pgErr *pgconn.PgError
		if err != nil && !(errors.As(err, &pgErr) && pgErr.Code == "42710") { // added by a concurrent start
			return fmt.Errorf("adding the shard range constraint (shard < %d): %w", n, err)
		}
	}
	if valid {
		return nil
	}
	if _, err := s.pool.Exec(ctx, `ALTER TABLE tasks VALIDATE CONSTRAINT tasks_shard_in_range`); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23514" {
			return fmt.Errorf("--shard-count: the database holds tasks in shards outside [0, %d) (SELECT id, shard FROM tasks WHERE shard >= %d): %w", n, n, ErrShardCountMismatch)
		}
		return fmt.Errorf("validating the shard range constraint (shard < %d): %w", n, err)
	}
	return nil
}
