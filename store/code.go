package store

// The layout's code: every function, trigger function and view, one file
// each under sql/, with its current body. Migrations hold tables, indexes,
// types and triggers; the code is applied after them, in one transaction,
// whenever the files changed since it was last applied (a hash of them is
// recorded in shardrun_code). TestLiveCodeIsTheFiles checks that the
// database runs exactly the files.

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

//go:embed sql/*.sql
var codeFS embed.FS

// codeFiles is the order the files are applied in: what a body names at
// creation (an SQL function's body, a view) before it. PL/pgSQL bodies are
// checked only when they run.
var codeFiles = []string{
	"shardrun_urgent.sql",
	"shardrun_backoff.sql",
	"shardrun_notify.sql",
	"shardrun_lock_sequences.sql",
	"shardrun_settle.sql",
	"shardrun_file.sql",
	"shardrun_settle_at_commit.sql",
	"shardrun_queue_lock.sql",
	"shardrun_register_queues.sql",
	"shardrun_file_tasks.sql",
	"shardrun_check_placement.sql",
	"shardrun_lock_records.sql",
	"shardrun_lock_tasks.sql",
	"shardrun_unplace.sql",
	"shardrun_cancel.sql",
	"shardrun_expire.sql",
	"shardrun_retry.sql",
	"shardrun_remove_queue.sql",
	"task_view.sql",
	"shardrun_layout_violations.sql",
}

// codeLock is the advisory lock key under which code is applied, so that
// runners starting together apply it once.
const codeLock = 0x73686172_64636f64 // "shardcod"

// code returns the files in codeFiles order and the hash of all of them.
func code() (files []string, hash string, err error) {
	h := sha256.New()
	for _, name := range codeFiles {
		b, err := codeFS.ReadFile("sql/" + name)
		if err != nil {
			return nil, "", fmt.Errorf("reading store code %s: %w", name, err)
		}
		files = append(files, string(b))
		fmt.Fprintf(h, "%s\x00%d\x00", name, len(b))
		h.Write(b)
	}
	return files, hex.EncodeToString(h.Sum(nil)), nil
}

// applyCode applies the code files when the database holds another
// version of them.
func (s *Store) applyCode(ctx context.Context) error {
	files, hash, err := code()
	if err != nil {
		return err
	}
	// Without the lock first: the code is current as a rule, and the
	// processes that start together need not take turns to read that.
	var current string
	if s.pool.QueryRow(ctx, `SELECT hash FROM shardrun_code WHERE id = 1`).Scan(&current) == nil && current == hash {
		return nil
	}
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(codeLock)); err != nil {
			return fmt.Errorf("locking the store's code: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS shardrun_code (
			id int PRIMARY KEY CHECK (id = 1), hash text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return fmt.Errorf("recording the store's code: %w", err)
		}
		var current string
		err := tx.QueryRow(ctx, `SELECT hash FROM shardrun_code WHERE id = 1`).Scan(&current)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("reading the store's code version: %w", err)
		}
		if current == hash {
			return nil
		}
		for i, body := range files {
			if _, err := tx.Exec(ctx, body); err != nil {
				return fmt.Errorf("applying store code %s: %w", codeFiles[i], err)
			}
		}
		_, err = tx.Exec(ctx, `INSERT INTO shardrun_code (id, hash) VALUES (1, $1)
			ON CONFLICT (id) DO UPDATE SET hash = excluded.hash, applied_at = now()`, hash)
		if err != nil {
			return fmt.Errorf("recording the store's code version: %w", err)
		}
		s.log.Info("applied store code", "files", len(files), "hash", hash[:12])
		return nil
	})
}
