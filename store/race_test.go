package store_test

// Aids that force the races of the task layout, without sleeping: a gate
// that stops a transaction at its commit, after the project's own deferred
// triggers (a slow commit), and a second transaction holding a row lock.
// The tests observe what they wait for (a backend waiting on a lock) by
// polling pg_stat_activity with a deadline.

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/store"
)

// gate stops every transaction that changes or inserts one of the gated
// tasks at its commit, until open: a deferred trigger named after the
// project's own (so it fires after them) waits for a shared advisory lock
// that the gate's own connection holds exclusively.
type gate struct {
	t    testing.TB
	s    *store.Store
	conn *pgx.Conn
	key  int64
}

var gateKeys int64 = 4242

// newGate closes a gate on the tasks ids (more can be added with add).
func newGate(t testing.TB, s *store.Store, dsn string, ids ...int64) *gate {
	t.Helper()
	ctx := context.Background()
	gateKeys++
	g := &gate{t: t, s: s, key: gateKeys}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	g.conn = conn
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, g.key); err != nil {
		t.Fatal(err)
	}
	exec(t, s, `CREATE TABLE IF NOT EXISTS test_gated (id bigint PRIMARY KEY, gate bigint NOT NULL)`)
	exec(t, s, `CREATE OR REPLACE FUNCTION test_gate() RETURNS trigger LANGUAGE plpgsql AS $$
		DECLARE k bigint;
		BEGIN
			SELECT gate INTO k FROM test_gated WHERE id = NEW.id;
			IF k IS NOT NULL THEN PERFORM pg_advisory_xact_lock_shared(k); END IF;
			RETURN NULL;
		END $$`)
	exec(t, s, `DROP TRIGGER IF EXISTS zz_test_gate ON tasks`)
	exec(t, s, `CREATE CONSTRAINT TRIGGER zz_test_gate AFTER INSERT OR UPDATE ON tasks
		DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_gate()`)
	g.add(ids...)
	return g
}

// add gates tasks ids too.
func (g *gate) add(ids ...int64) {
	for _, id := range ids {
		exec(g.t, g.s, `INSERT INTO test_gated (id, gate) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET gate = excluded.gate`, id, g.key)
	}
}

// open lets the gated transactions commit.
func (g *gate) open() {
	g.t.Helper()
	if _, err := g.conn.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, g.key); err != nil {
		g.t.Fatal(err)
	}
}

// holdRow locks the rows sql selects (a SELECT … FOR UPDATE) in a
// transaction of its own until the returned release is called.
func holdRow(t testing.TB, dsn, sql string, args ...any) (release func()) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		t.Fatal(err)
	}
	rows.Close()
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	done := false
	release = func() {
		if done {
			return
		}
		done = true
		_ = tx.Commit(ctx)
		_ = conn.Close(ctx)
	}
	t.Cleanup(release)
	return release
}

// awaitWaiting waits until n backends of the test's database wait on a
// lock (a row, a transaction or an advisory lock), or fails the test after
// 30 seconds.
func awaitWaiting(t testing.TB, s *store.Store, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var got int
		if err := s.Pool().QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited 30s for %d backends to wait on a lock; %d do", n, got)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// async runs f in a goroutine; the returned channel yields its error.
func async(f func() error) <-chan error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	return done
}

// awaitDoneOrWaiting waits until done has an answer (which it returns,
// with true) or n backends wait on a lock (false).
func awaitDoneOrWaiting(t testing.TB, s *store.Store, done <-chan error, n int) (error, bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case err := <-done:
			return err, true
		default:
		}
		var got int
		if err := s.Pool().QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got >= n {
			return nil, false
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited 30s for an answer or %d lock waits; %d wait", n, got)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// result waits for done's answer (at most 30 seconds).
func result(t testing.TB, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("no answer within 30s")
		return nil
	}
}
