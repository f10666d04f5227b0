// Package pgtest gives each test binary one throwaway PostgreSQL server and
// each test its own database on it. TEST_DATABASE_URL points the tests at an
// existing server instead (its user needs CREATEDB).
//
// Tests never skip for lack of a database: when no server can be started the
// binary fails with a message that says what to install.
//
// Each test binary also runs under a temporary root of its own: Main points
// TMPDIR at a fresh directory before the tests start and removes it when
// they end, so that every temporary file the tests and the processes they
// start make is theirs, and what another program left in the machine's
// temporary directory is none of theirs.
package pgtest

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/shardrun/shardrun/internal/pgtmp"
	"github.com/shardrun/shardrun/internal/tempdir"
	"github.com/shardrun/shardrun/store"
)

// rootPrefix names the test binaries' temporary roots, so that the root of
// a binary that was killed is removed by the next one.
const rootPrefix = "shardrun-test-"

var (
	adminDSN string
	server   *pgtmp.Server
	seq      atomic.Int64
	root     string
	outerTmp string

	atExitMu sync.Mutex
	atExit   []func()
)

// AtExit registers fn to run once the package's tests have ended (or the
// test binary is interrupted), before the server stops: for what a package
// shares between its tests, such as binaries built once, so that a test run
// leaves nothing behind.
func AtExit(fn func()) {
	atExitMu.Lock()
	defer atExitMu.Unlock()
	atExit = append(atExit, fn)
}

func runAtExit() {
	atExitMu.Lock()
	fns := atExit
	atExit = nil
	atExitMu.Unlock()
	for _, fn := range fns {
		fn()
	}
}

// Main runs the package's tests against a throwaway server, then checks that
// no goroutine was left behind. Call it from TestMain.
func Main(m *testing.M, leakOpts ...goleak.Option) {
	os.Exit(run(m, leakOpts))
}

func run(m *testing.M, leakOpts []goleak.Option) int {
	flag.Parse()
	if err := useOwnTempRoot(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
		return 1
	}
	if err := start(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: cannot get a PostgreSQL server for the tests: %v\n", err)
		removeTempRoot()
		return 1
	}
	stopSignals := stopOnSignal()
	code := m.Run()
	stopSignals()
	shutdown()
	if code == 0 {
		if err := goleak.Find(leakOpts...); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: goroutines left behind after the tests: %v\n", err)
			return 1
		}
	}
	return code
}

// shutdown runs what the tests registered, stops the server and removes the
// temporary root, in that order: the registered functions and the server
// still use files under the root.
func shutdown() {
	runAtExit()
	if server != nil {
		if err := server.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
		}
	}
	removeTempRoot()
}

// useOwnTempRoot points TMPDIR at a fresh directory for this test binary:
// os.TempDir, t.TempDir and every process the tests start use it.
func useOwnTempRoot() error {
	outerTmp = os.TempDir()
	dir, err := tempdir.New(rootPrefix)
	if err != nil {
		return fmt.Errorf("making the tests' temporary root: %w", err)
	}
	// When the tests run as root, PostgreSQL runs as nobody and must reach
	// its data directory below this one.
	if err := os.Chmod(dir, 0o755); err != nil {
		_ = os.RemoveAll(dir)
		return fmt.Errorf("opening the tests' temporary root %s to other users: %w", dir, err)
	}
	root = dir
	return os.Setenv("TMPDIR", root)
}

func removeTempRoot() {
	if root == "" {
		return
	}
	_ = os.Setenv("TMPDIR", outerTmp)
	if err := os.RemoveAll(root); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: removing the tests' temporary root: %v\n", err)
	}
	root = ""
}

// OuterTempDir is the temporary directory the test binary was started
// with, outside its own root: where other programs leave their files.
func OuterTempDir() string { return outerTmp }

// sharedServerEnv passes a fuzzing test binary's server to its fuzz
// workers (child processes of the same binary, each of which runs TestMain),
// so that each worker does not start a server of its own for the few
// seconds it fuzzes.
const sharedServerEnv = "SHARDRUN_PGTEST_SHARED_DSN"

func start() error {
	for _, env := range []string{"TEST_DATABASE_URL", sharedServerEnv} {
		if url := os.Getenv(env); url != "" {
			adminDSN = url
			return nil
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, err := pgtmp.Start(ctx, pgtmp.Options{})
	if err != nil {
		return err
	}
	server = s
	adminDSN = s.DSN("postgres")
	if f := flag.Lookup("test.fuzz"); f != nil && f.Value.String() != "" {
		os.Setenv(sharedServerEnv, adminDSN)
	}
	return nil
}

// stopOnSignal removes the server and the temporary root when the test
// binary is interrupted, since deferred cleanups do not run on a signal.
func stopOnSignal() (stop func()) {
	ch := make(chan os.Signal, 1)
	done := make(chan struct{})
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		select {
		case <-ch:
			shutdown()
			os.Exit(130)
		case <-done:
		}
	}()
	return func() {
		signal.Stop(ch)
		close(done)
	}
}

// Server returns the throwaway server, or nil when TEST_DATABASE_URL is used.
func Server() *pgtmp.Server { return server }

// NewDatabase creates an empty database for t, dropped when t ends, and
// returns its DSN.
func NewDatabase(t testing.TB) string {
	t.Helper()
	if adminDSN == "" {
		t.Fatal("pgtest: no server; call pgtest.Main(m) from TestMain")
	}
	return newDatabase(t, adminDSN)
}

// NewServer starts a throwaway PostgreSQL server of t's own, beside the
// test binary's, stopped and removed when t ends: for tests that stop one
// database of a cluster of several while the other serves. Create its
// databases with NewDatabaseOn (after NewServer, so that they are
// checked and dropped before the server stops).
func NewServer(t testing.TB) *pgtmp.Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	srv, err := pgtmp.Start(ctx, pgtmp.Options{})
	if err != nil {
		t.Fatalf("pgtest: starting a second server: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Stop(); err != nil {
			t.Logf("pgtest: stopping the second server: %v", err)
		}
	})
	return srv
}

// NewDatabaseOn is NewDatabase on srv (NewServer): the database's layout
// is checked when t ends, as every test database's is, so srv must serve
// then.
func NewDatabaseOn(t testing.TB, srv *pgtmp.Server) string {
	t.Helper()
	return newDatabase(t, srv.DSN("postgres"))
}

func newDatabase(t testing.TB, admin string) string {
	t.Helper()
	name := fmt.Sprintf("t%d_%d_%s", os.Getpid(), seq.Add(1), sanitize(t.Name()))
	if len(name) > 60 {
		name = name[:60]
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dsn, err := pgtmp.CreateDatabase(ctx, admin, name)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		checkLayout(ctx, t, dsn)
		conn, err := pgx.Connect(ctx, admin)
		if err != nil {
			t.Logf("pgtest: dropping %s: %v", name, err)
			return
		}
		defer conn.Close(context.Background())
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Logf("pgtest: dropping %s: %v", name, err)
		}
	})
	return dsn
}

// ExampleDatabase creates an empty database that lives until the tests
// end, for runnable examples, which get no testing.TB.
func ExampleDatabase() (string, error) {
	if adminDSN == "" {
		return "", errors.New("pgtest: no server; call pgtest.Main(m) from TestMain")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return pgtmp.CreateDatabase(ctx, adminDSN, fmt.Sprintf("example%d_%d", os.Getpid(), seq.Add(1)))
}

// checkLayout fails t when the task layout of the database behind dsn
// breaks one of its invariants (store/sql/shardrun_layout_violations.sql),
// listing each violation. Every test database is checked when its test
// ends, once everything the test started has stopped; a database without
// the layout (never migrated, or migrated to an earlier version) is not.
func checkLayout(ctx context.Context, t testing.TB, dsn string) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Errorf("pgtest: checking the task layout: %v", err)
		return
	}
	defer conn.Close(context.Background())
	var present bool
	if err := conn.QueryRow(ctx, `SELECT to_regproc('shardrun_layout_violations') IS NOT NULL
		AND EXISTS (SELECT 1 FROM pg_class WHERE relname = 'task_waiting')`).Scan(&present); err != nil || !present {
		return
	}
	rows, err := conn.Query(ctx, `SELECT coalesce(task_id::text, '-'), coalesce(sequence_key, '-'), problem
		FROM shardrun_layout_violations() ORDER BY 1, 2, 3`)
	if err != nil {
		t.Errorf("pgtest: checking the task layout: %v", err)
		return
	}
	var found []string
	var id, key, problem string
	_, err = pgx.ForEachRow(rows, []any{&id, &key, &problem}, func() error {
		found = append(found, fmt.Sprintf("task %s, sequence %s: %s", id, key, problem))
		return nil
	})
	if err != nil {
		t.Errorf("pgtest: checking the task layout: %v", err)
	}
	if len(found) > 0 {
		if len(found) > 20 {
			found = append(found[:20], fmt.Sprintf("… and %d more", len(found)-20))
		}
		t.Errorf("pgtest: the task layout breaks its invariants at the end of the test:\n\t%s", strings.Join(found, "\n\t"))
	}
}

func sanitize(s string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(s) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	return b.String()
}

// NewStore opens a store on a fresh database with the schema migrated, closed
// when the test ends, and returns it with the database's URL.
func NewStore(t testing.TB, opts store.Options) (*store.Store, string) {
	t.Helper()
	ctx := context.Background()
	dsn := NewDatabase(t)
	st, err := store.Open(ctx, dsn, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return st, dsn
}

// ScheduleTicks returns the ticks of the tasks of schedule name, oldest
// first: what the scheduler tests count to check each tick is enqueued once.
func ScheduleTicks(t testing.TB, st *store.Store, name string) []time.Time {
	t.Helper()
	rows, err := st.Pool().Query(context.Background(), `SELECT t.schedule_tick FROM tasks t
		JOIN schedules s ON s.id = t.schedule_id WHERE s.name = $1 ORDER BY t.schedule_tick`, name)
	if err != nil {
		t.Fatalf("reading the ticks of schedule %q: %v", name, err)
	}
	ticks, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	if err != nil {
		t.Fatalf("reading the ticks of schedule %q: %v", name, err)
	}
	return ticks
}

// Exec runs a statement for a test's set-up, failing the test on error.
func Exec(t testing.TB, st *store.Store, sql string, args ...any) {
	t.Helper()
	if _, err := st.Pool().Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// Retime sets a time of tasks (all of them without ids) where the layout
// keeps it: run_after in the task and its task_ready entry; deadline in
// the task, its task_ready or task_waiting entry and its claim; claimed_at and heartbeat_at
// in its claim. expr is SQL: what tests that age a task or a claim set.
func Retime(t testing.TB, st *store.Store, col, expr string, ids ...int64) {
	t.Helper()
	var sql string
	switch col {
	case "run_after":
		sql = `WITH u AS (UPDATE tasks SET run_after = ` + expr + ` WHERE $1::bigint[] IS NULL OR id = ANY ($1) RETURNING id, run_after)
			UPDATE task_ready r SET run_after = u.run_after FROM u WHERE r.id = u.id`
	case "deadline":
		sql = `WITH u AS (UPDATE tasks SET deadline = ` + expr + ` WHERE $1::bigint[] IS NULL OR id = ANY ($1) RETURNING id, deadline),
			r AS (UPDATE task_ready r SET deadline = u.deadline FROM u WHERE r.id = u.id),
			w AS (UPDATE task_waiting w SET deadline = u.deadline FROM u WHERE w.id = u.id)
			UPDATE task_claims c SET deadline = u.deadline FROM u WHERE c.id = u.id`
	case "claimed_at", "heartbeat_at":
		sql = `UPDATE task_claims SET ` + col + ` = ` + expr + ` WHERE $1::bigint[] IS NULL OR id = ANY ($1)`
	default:
		t.Fatalf("pgtest.Retime: no column %s", col)
	}
	var arg []int64
	if len(ids) > 0 {
		arg = ids
	}
	Exec(t, st, sql, arg)
}

// InsertClaimed runs insert (an INSERT INTO tasks … RETURNING id) and
// turns the tasks it inserted into running tasks, claimed by owner at
// epoch at the time claimedAt (SQL), as a runner's claim leaves them, in
// one transaction (no runner can claim them first): for tests of what
// happens to claims whose runner is gone.
func InsertClaimed(t testing.TB, st *store.Store, insert, owner string, epoch int64, claimedAt string, args ...any) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, st.Pool(), func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, insert, args...)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `
			WITH r AS (
				DELETE FROM task_ready r USING tasks t
				WHERE t.id = ANY ($3) AND r.shard = t.shard AND r.queue = t.queue AND r.kind = t.kind
				  AND r.priority = t.priority AND r.run_after = t.run_after AND r.id = t.id
				RETURNING r.id, r.shard, r.queue, r.deadline, t.attempt
			)
			INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt, claimed_at, deadline)
			SELECT id, shard, queue, $2, $1, attempt, `+claimedAt+`, deadline FROM r`, owner, epoch, ids)
		return err
	})
	if err != nil {
		t.Fatalf("inserting claimed tasks: %v", err)
	}
}
