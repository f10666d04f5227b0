package main

// What every burn-down trial measures in PostgreSQL, for shardrun and River
// alike, and the checks that make a trial fail: a poll that errs, and a
// trial whose tasks did not all complete.

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shardrun/shardrun/store"
)

// benchTag starts every statement the bench sends to a trial's database
// during a measurement, so that the statement and page counts can leave
// them out (pg_stat_statements keeps a statement's first text, comment
// included).
const benchTag = "/* bench */ "

// claimStatementNames are the names shardrun's claim statements carry in
// their leading comment (/* shardrun.claim */). A claim split into more
// statements needs each name added here so that its pages count.
var claimStatementNames = []string{"shardrun.claim"}

// claimStatements is the pg_stat_statements condition that picks the claim
// statements: shardrun's by their comment when they have one, else by the
// claim's text before statements were named (its candidates CTE); River's
// by the name sqlc gives its fetch (JobGetAvailable), which is part of the
// query text River sends.
func claimStatements() string {
	var named []string
	for _, n := range claimStatementNames {
		named = append(named, fmt.Sprintf("query LIKE '%%/* %s */%%'", n))
	}
	return "(" + strings.Join(named, " OR ") +
		" OR (query NOT LIKE '%/* shardrun.%' AND query LIKE '%candidates AS (%')" +
		" OR query LIKE '%name: JobGetAvailable %')"
}

// pgCounters are a database's cumulative counts, and the server's WAL
// position, at one moment.
type pgCounters struct {
	xacts, deadlocks int64
	// stmts and blocks (shared_blks_hit + shared_blks_read) of every
	// statement but the bench's own; 0 without pg_stat_statements.
	stmts, blocks int64
	// claimBlocks and claimRows of the claim (fetch) statements.
	claimBlocks, claimRows int64
	// walBytes is the server's WAL insert position.
	walBytes int64
	// autovacuums and autoanalyzes of the database's tables so far.
	autovacuums, autoanalyzes int64
}

// counters reads the counters of the database pool is connected to. The
// statements counted are those clients sent (pg_stat_statements.track =
// top), read from the admin database so that reading them adds nothing to
// the count; the bench's own statements in the trial's database carry
// benchTag and are left out.
func (e *env) counters(ctx context.Context, pool *pgxpool.Pool) (pgCounters, error) {
	var c pgCounters
	if err := pool.QueryRow(ctx, benchTag+`SELECT xact_commit + xact_rollback, deadlocks,
			pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint
		FROM pg_stat_database WHERE datname = current_database()`).Scan(&c.xacts, &c.deadlocks, &c.walBytes); err != nil {
		return c, fmt.Errorf("reading the database's counters: %w", err)
	}
	if err := pool.QueryRow(ctx, benchTag+`SELECT coalesce(sum(autovacuum_count), 0)::bigint, coalesce(sum(autoanalyze_count), 0)::bigint
		FROM pg_stat_user_tables`).Scan(&c.autovacuums, &c.autoanalyzes); err != nil {
		return c, fmt.Errorf("reading the database's autovacuum counts: %w", err)
	}
	if !e.statStatements {
		return c, nil
	}
	conn, err := pgx.Connect(ctx, e.pg.DSN("postgres"))
	if err != nil {
		return c, fmt.Errorf("connecting to read pg_stat_statements: %w", err)
	}
	defer conn.Close(ctx)
	err = conn.QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(shared_blks_hit + shared_blks_read), 0)::bigint,
			coalesce(sum(shared_blks_hit + shared_blks_read) FILTER (WHERE `+claimStatements()+`), 0)::bigint,
			coalesce(sum(rows) FILTER (WHERE `+claimStatements()+`), 0)::bigint
		FROM pg_stat_statements
		WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1) AND query NOT LIKE '/* bench */%'`,
		pool.Config().ConnConfig.Database).Scan(&c.stmts, &c.blocks, &c.claimBlocks, &c.claimRows)
	if err != nil {
		return c, fmt.Errorf("reading pg_stat_statements: %w", err)
	}
	return c, nil
}

// setCosts records what the system cost per task between two readings:
// transactions (less the bench's polls and one reading of the counters,
// each its own transaction), statements, pages, pages per claimed task,
// WAL bytes, deadlocks, and the autovacuum and autoanalyze runs that
// changed the statistics the statements were planned with. Read after the system's connections closed: a
// backend may hold its transaction counts back for up to a second while
// it stays connected and idle, but flushes them when it exits;
// pg_stat_statements counts at once.
//
// The WAL is the whole server's: the trial's database is the only one in
// use (each trial drops its database when done, so autovacuum does not
// work on an earlier one meanwhile).
func (r *burnDown) setCosts(before, after pgCounters, polls, n int) {
	own := int64(polls + 1)
	r.XactsPerTask = float64(after.xacts-before.xacts-own) / float64(n)
	r.Deadlocks = after.deadlocks - before.deadlocks
	r.WALBytesPerTask = float64(after.walBytes-before.walBytes) / float64(n)
	r.Autovacuums, r.Autoanalyzes = after.autovacuums-before.autovacuums, after.autoanalyzes-before.autoanalyzes
	if after.stmts > 0 {
		r.StmtsPerTask = float64(after.stmts-before.stmts) / float64(n)
		r.PagesPerTask = float64(after.blocks-before.blocks) / float64(n)
		r.ClaimedTasks = after.claimRows - before.claimRows
		if r.ClaimedTasks > 0 {
			r.PagesPerClaimedTask = float64(after.claimBlocks-before.claimBlocks) / float64(r.ClaimedTasks)
		}
	}
}

// pollUntil calls done every interval until it reports true, and returns
// how many calls it made. A call that fails ends the wait with its error:
// a trial whose progress could not be read is not a measurement. So does
// ctx ending (Ctrl-C).
func pollUntil(ctx context.Context, timeout, interval time.Duration, done func() (bool, error)) (int, error) {
	start := time.Now()
	for polls := 1; ; polls++ {
		ok, err := done()
		if err != nil {
			return polls, fmt.Errorf("poll %d failed: %w", polls, err)
		}
		if ok {
			return polls, nil
		}
		if time.Since(start) > timeout {
			return polls, fmt.Errorf("not done within %s", timeout)
		}
		select {
		case <-ctx.Done():
			return polls, ctx.Err()
		case <-time.After(interval):
		}
	}
}

// finalStates counts the tasks of kind by state: table is tasks
// (shardrun) or river_job (River); both name the column state and call a
// successful end completed.
func finalStates(ctx context.Context, pool *pgxpool.Pool, table, kind string) (map[string]int, error) {
	rows, err := pool.Query(ctx, benchTag+`SELECT state::text, count(*)::int FROM `+table+` WHERE kind = $1 GROUP BY 1`, kind)
	if err != nil {
		return nil, fmt.Errorf("counting %s tasks by state: %w", kind, err)
	}
	out := map[string]int{}
	var state string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&state, &n}, func() error { out[state] = n; return nil }); err != nil {
		return nil, fmt.Errorf("counting %s tasks by state: %w", kind, err)
	}
	return out, nil
}

// checkCompleted fails a trial unless exactly n tasks of kind exist and
// every one of them completed.
func checkCompleted(ctx context.Context, pool *pgxpool.Pool, system, table, kind string, n int) error {
	states, err := finalStates(ctx, pool, table, kind)
	if err != nil {
		return err
	}
	if states["completed"] == n && len(states) == 1 {
		return nil
	}
	return fmt.Errorf("%s: %d of %d %s tasks completed (%s)", system, states["completed"], n, kind, describeStates(states))
}

// describeStates is "completed 199998, ready 2", in state order.
func describeStates(states map[string]int) string {
	var parts []string
	for _, s := range slices.Sorted(maps.Keys(states)) {
		parts = append(parts, fmt.Sprintf("%s %d", s, states[s]))
	}
	if len(parts) == 0 {
		return "none at all"
	}
	return strings.Join(parts, ", ")
}

// dropDatabase removes a trial's database once its figures are read, so
// that autovacuum does not work on it during a later trial (its CPU and
// WAL would count there).
func (e *env) dropDatabase(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, e.pg.DSN("postgres"))
	if err != nil {
		return fmt.Errorf("connecting to drop database %s: %w", name, err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("dropping database %s: %w", name, err)
	}
	return nil
}

// trialStore creates a fresh database named after name, opens a store on
// it with maxConns connections and migrates it. drop closes the store and
// drops the database; a trial defers it and keeps its first error.
func (e *env) trialStore(ctx context.Context, name string, maxConns int) (st *store.Store, dsn string, drop func() error, err error) {
	if dsn, err = e.database(ctx, name); err != nil {
		return nil, "", nil, err
	}
	if st, err = store.Open(ctx, dsn, store.Options{MaxConns: maxConns}); err != nil {
		return nil, "", nil, err
	}
	db := st.Pool().Config().ConnConfig.Database
	drop = func() error {
		st.Close()
		return e.dropDatabase(ctx, db)
	}
	if err := st.Migrate(ctx); err != nil {
		_ = drop()
		return nil, "", nil, err
	}
	return st, dsn, drop, nil
}
