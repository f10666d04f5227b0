package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// The producer side: inserting tasks, one by one or by COPY.

// Enqueue inserts one task and returns its id.
func (s *Store) Enqueue(ctx context.Context, in tasks.Insert) (int64, error) {
	var id int64
	err := s.pool.QueryRow(ctx, `
		INSERT INTO tasks (kind, shard, key, payload, max_attempts, run_after, deadline)
		VALUES ($1, $2, $3, $4::jsonb, $5, coalesce($6, now()), $7)
		RETURNING id`,
		in.Kind, in.Shard, in.Key, string(in.Payload), in.MaxAttempts, in.RunAfter, in.Deadline).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("enqueueing task of kind %q: %w", in.Kind, err)
	}
	return id, nil
}

// EnqueueBatch inserts many tasks with COPY in one transaction and returns
// how many it inserted. Tasks without RunAfter get the database's now().
func (s *Store) EnqueueBatch(ctx context.Context, ins []tasks.Insert) (int64, error) {
	if len(ins) == 0 {
		return 0, nil
	}
	var now, later [][]any
	for _, in := range ins {
		row := []any{in.Kind, int32(in.Shard), in.Key, string(in.Payload), int32(in.MaxAttempts), in.Deadline}
		if in.RunAfter == nil {
			now = append(now, row)
		} else {
			later = append(later, append(row, *in.RunAfter))
		}
	}
	cols := []string{"kind", "shard", "key", "payload", "max_attempts", "deadline"}
	var total int64
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if len(now) > 0 {
			n, err := tx.CopyFrom(ctx, pgx.Identifier{"tasks"}, cols, pgx.CopyFromRows(now))
			if err != nil {
				return err
			}
			total += n
		}
		if len(later) > 0 {
			n, err := tx.CopyFrom(ctx, pgx.Identifier{"tasks"}, append(cols, "run_after"), pgx.CopyFromRows(later))
			if err != nil {
				return err
			}
			total += n
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("enqueueing %d tasks with COPY: %w", len(ins), err)
	}
	return total, nil
}
