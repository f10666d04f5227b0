package store

// The leader coordinator's fence, and what its sweeps ask of the database
// (the sweeps themselves are moves: moves.go).

import (
	"context"
	"fmt"
	"time"
)

// RaiseLeaderFence records a new leadership epoch and reports whether the
// fence now holds it (false: a newer leader exists). It waits for sweeps
// under the old epoch that are under way.
func (s *Store) RaiseLeaderFence(ctx context.Context, leader string, epoch int64) (bool, error) {
	tag, err := s.pool.Exec(ctx, `
		INSERT INTO coordinator_fence AS f (id, epoch, leader) VALUES (1, $1, $2)
		ON CONFLICT (id) DO UPDATE SET epoch = excluded.epoch, leader = excluded.leader, raised_at = now()
		WHERE f.epoch <= excluded.epoch`, epoch, leader)
	if err != nil {
		return false, fmt.Errorf("raising the coordinator fence to %d: %w", epoch, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Uptime is how long the database server has been up, by its own clock: a
// heartbeat cannot have been written while it was down, so the stale rule
// waits until the server has been up for a whole stale threshold.
func (s *Store) Uptime(ctx context.Context) (time.Duration, error) {
	var ms float64
	if err := s.pool.QueryRow(ctx, `SELECT extract(epoch FROM now() - pg_postmaster_start_time()) * 1000`).Scan(&ms); err != nil {
		return 0, fmt.Errorf("reading the database's uptime: %w", err)
	}
	return time.Duration(ms * float64(time.Millisecond)), nil
}
