// Package store is shardrun's only access to PostgreSQL: the schema
// migrations and every statement the system runs. Each write re-checks the
// state, attempt and fence it expects and reports whether it applied, so that
// a runner which lost its shard, a sweep and a late completion can race
// safely: exactly one of them changes the row.
//
// Fencing: shard_fences holds, per unit (a shard of a capability group),
// the newest ownership epoch (the etcd revision that started the term).
// Claims lock the fence rows of the shards they take from FOR SHARE and
// require epoch = the claimer's; every write about a claimed task matches
// its claim row (owner, epoch, attempt) and reads that the fence still
// holds the epoch. A raise moves the fence and requeues the older claims in
// one transaction, skipping those another transaction holds (moves.go): a
// paused runner that wakes up after its shard moved writes nothing.
//
// It is one of the cluster's protocol packages (shard, detach, sweeper,
// store): importable, so that the runner and coordinator libraries and
// tools can be built on it, but not the library API and under no
// compatibility promise to library users, as etcd's server packages are
// importable but are not its client API. Programs use package shardrun
// and package tasks.
package store

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed migrations/*.sql
var migrations embed.FS

// Defaults and bounds of Options.
const (
	// DefaultMaxConns: a runner's statements are batched, so it needs few
	// connections whatever its worker count.
	DefaultMaxConns = 8
	// MinMaxConns: a runner's listener holds one connection for LISTEN and
	// its statements need at least one more.
	MinMaxConns = 2
	// MaxMaxConns: PostgreSQL serves 100 connections by default for the
	// whole server (max_connections), and each costs it a process; no
	// server serves thousands from one client.
	MaxMaxConns = 1000
	// DefaultConnectTimeout bounds the first connection.
	DefaultConnectTimeout = 10 * time.Second
	// DefaultLockTimeout bounds how long one of the store's statements
	// waits for a row lock. Its statements wait only for each other's,
	// which take milliseconds; a lock held longer is a transaction nobody
	// controls (a frozen process's), and the statement gives up and is
	// retried rather than stall whatever waits behind it.
	DefaultLockTimeout = 5 * time.Second
	// DefaultIdleInTxTimeout ends a session of the store's that sits idle
	// inside a transaction this long: its process was frozen between two
	// statements of one transaction, and its locks would stall others.
	DefaultIdleInTxTimeout = 10 * time.Second
	// DefaultHandlerTxTimeout bounds a handler's transaction once it has
	// recorded its task's completion (CompleteTx): the runners' default
	// lease TTL, the time another runner may take over the task's shard.
	DefaultHandlerTxTimeout = 10 * time.Second
)

// Options configure Open.
type Options struct {
	// MaxConns bounds the pool (--db-max-conns), MinMaxConns to
	// MaxMaxConns. Zero means DefaultMaxConns.
	MaxConns int
	// ApplicationName shows up in pg_stat_activity.
	ApplicationName string
	// ConnectTimeout bounds the first connection. Zero means
	// DefaultConnectTimeout.
	ConnectTimeout time.Duration
	// Logger receives migration progress; nil discards it.
	Logger hclog.Logger
	// LockTimeout (DefaultLockTimeout) and IdleInTxTimeout
	// (DefaultIdleInTxTimeout) are the pool's lock_timeout and
	// idle_in_transaction_session_timeout: no statement of the store waits
	// without bound, and no session of it holds locks while its process
	// is frozen. Negative: none.
	LockTimeout, IdleInTxTimeout time.Duration
	// HandlerTxTimeout (DefaultHandlerTxTimeout) bounds what a handler's
	// transaction may still take once CompleteTx has marked its claim
	// (see CompleteTx).
	HandlerTxTimeout time.Duration
	// PlanEachExecution makes PostgreSQL plan every statement of the pool
	// at each execution (plan_cache_mode force_custom_plan) rather than
	// settle on a generic plan. The coordinator sets it: its leader passes
	// run on idle tables, and a generic plan made while autovacuum had
	// analysed them empty can look tasks up through the wrong index (see
	// claimExecMode). Runners leave it off: it replans the sequence
	// trigger's statements at every completion (sequences ran at half
	// their throughput), and their one statement that runs at idle, the
	// claim, is planned at each execution anyway.
	PlanEachExecution bool
}

// Validate reports a bad setting naming its flag. It checks the options as
// they are: a zero MaxConns, which Open takes as the default, is an error
// here, so that --db-max-conns 0 is refused rather than replaced.
func (o Options) Validate() error {
	switch {
	case o.MaxConns < MinMaxConns || o.MaxConns > MaxMaxConns:
		return fmt.Errorf("--db-max-conns: must be %d to %d (the LISTEN connection plus one for statements; PostgreSQL serves %d by default for everyone), got %d",
			MinMaxConns, MaxMaxConns, 100, o.MaxConns)
	case o.ConnectTimeout < 0:
		return fmt.Errorf("store: connect timeout must not be negative, got %s", o.ConnectTimeout)
	case o.HandlerTxTimeout < 0:
		return fmt.Errorf("store: the handler transaction timeout must not be negative, got %s", o.HandlerTxTimeout)
	}
	return nil
}

// CheckDSN reports whether dsn is a connection string pgx can parse. Its
// message never holds the password, even when the string is too mangled to
// tell where the password is.
func CheckDSN(dsn string) error {
	if _, err := pgxpool.ParseConfig(dsn); err != nil {
		return errors.New(scrubDSN(dsn, "malformed: "+err.Error()))
	}
	return nil
}

// HasPassword reports whether dsn holds a password (as far as it can be
// told), to warn when one is given on the command line.
func HasPassword(dsn string) bool { return len(passwordsIn(dsn)) > 0 }

// Store runs shardrun's statements on a pgx pool.
type Store struct {
	pool             *pgxpool.Pool
	log              hclog.Logger
	notify           *notifier
	handlerTxTimeout time.Duration
	// queues are the queues a row was filed for (registerQueues).
	queues sync.Map
}

// Open connects to the database behind dsn and checks that it answers.
func Open(ctx context.Context, dsn string, opts Options) (*Store, error) {
	masked := MaskDSN(dsn)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		// pgx's message may quote the string; its redaction is best effort.
		return nil, errors.New(scrubDSN(dsn, fmt.Sprintf("parsing database URL %s: %v", masked, err)))
	}
	return open(ctx, cfg, masked, opts)
}

// OpenLike opens a pool of the store's own on the database of pool, with
// its connection settings (host, credentials, TLS, hooks): the store's
// statements need session settings of their own (below), which a
// program's pool does not have.
func OpenLike(ctx context.Context, pool *pgxpool.Pool, opts Options) (*Store, error) {
	cfg := pool.Config()
	return open(ctx, cfg, fmt.Sprintf("%s@%s:%d/%s", cfg.ConnConfig.User, cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database), opts)
}

func open(ctx context.Context, cfg *pgxpool.Config, masked string, opts Options) (*Store, error) {
	opts.MaxConns = cmp.Or(opts.MaxConns, DefaultMaxConns)
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(opts.MaxConns)
	cfg.MinConns = 0
	if opts.ApplicationName != "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = opts.ApplicationName
	}
	// Every statement here is an ordered index walk with a LIMIT or a
	// primary-key lookup. With stale statistics (a queue table is
	// bulk-loaded and churned faster than autovacuum analyses it) the
	// planner estimates a few ready rows and prefers a bitmap scan of all of
	// them plus a sort: 37ms per claim from 50,000 fresh tasks instead of
	// 0.9ms. And the queue tables look small to it whenever statistics were
	// taken at a quiet moment, so it scanned task_claims whole, joined to
	// each batch of 256 writes in a nested loop (21ms a completion, against
	// 0.5ms by primary key). Only this pool's sessions are affected; the
	// statements that must read a table whole (the sweeps read task_claims)
	// still do, having no other way.
	cfg.ConnConfig.RuntimeParams["enable_bitmapscan"] = "off"
	cfg.ConnConfig.RuntimeParams["enable_seqscan"] = "off"
	// The penalty that turns a scan off counts as cost, and a statement
	// that costs that much gets compiled by JIT: 1.5s a sweep, for
	// statements that run in milliseconds. None of the store's statements
	// runs long enough to repay a compilation.
	cfg.ConnConfig.RuntimeParams["jit"] = "off"
	if opts.PlanEachExecution {
		cfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_custom_plan"
	}
	for param, d := range map[string]time.Duration{
		"lock_timeout":                        cmp.Or(opts.LockTimeout, DefaultLockTimeout),
		"idle_in_transaction_session_timeout": cmp.Or(opts.IdleInTxTimeout, DefaultIdleInTxTimeout),
	} {
		if d > 0 {
			cfg.ConnConfig.RuntimeParams[param] = strconv.FormatInt(max(d.Milliseconds(), 1), 10)
		}
	}
	timeout := cmp.Or(opts.ConnectTimeout, DefaultConnectTimeout)
	if cfg.ConnConfig.ConnectTimeout == 0 || cfg.ConnConfig.ConnectTimeout > timeout {
		cfg.ConnConfig.ConnectTimeout = timeout
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("opening database %s: %w", masked, err)
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connecting to database %s: %w", masked, dedupeAttempts(err))
	}
	log := opts.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	return &Store{pool: pool, log: log, notify: newNotifier(pool.Exec, log),
		handlerTxTimeout: cmp.Or(opts.HandlerTxTimeout, DefaultHandlerTxTimeout)}, nil
}

// Close sends the enqueue notifications still pending (waiting at most
// 5s for them), then closes the pool.
func (s *Store) Close() {
	s.notify.close()
	s.pool.Close()
}

// Pool exposes the pool to tests and benchmarks that inspect the database.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Migrate applies the embedded migrations that are not applied yet. A
// session-level advisory lock serialises concurrent starts of many runners.
func (s *Store) Migrate(ctx context.Context) error { return s.MigrateTo(ctx, 0) }

// MigrateTo applies the migrations up to version upTo (0: all of them, and
// then the layout's code, sql/, when it changed): the upgrade tests build a
// database of an earlier layout with it.
func (s *Store) MigrateTo(ctx context.Context, upTo int64) error {
	if upTo == 0 {
		if current, err := s.schemaCurrent(ctx); err == nil && current {
			return s.applyCode(ctx)
		}
	}
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockTimeout(1, 120))
	if err != nil {
		return fmt.Errorf("creating migration lock: %w", err)
	}
	// Migrations run on connections of their own without the pool's
	// lock_timeout: a schema change waits for the statements under way, as
	// it always did, rather than fail a runner's start under load.
	mcfg := s.pool.Config()
	mcfg.ConnConfig.RuntimeParams["lock_timeout"] = "0"
	mcfg.MaxConns = 2
	mpool, err := pgxpool.NewWithConfig(ctx, mcfg)
	if err != nil {
		return fmt.Errorf("opening connections for migrations: %w", err)
	}
	defer mpool.Close()
	db := stdlib.OpenDBFromPool(mpool)
	defer db.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, db, migrationFS(),
		goose.WithSessionLocker(locker), goose.WithTableName("shardrun_schema_migrations"),
		goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return fmt.Errorf("preparing migrations: %w", err)
	}
	var results []*goose.MigrationResult
	if upTo > 0 {
		results, err = provider.UpTo(ctx, upTo)
	} else {
		results, err = provider.Up(ctx)
	}
	if err != nil {
		return fmt.Errorf("applying migrations: %w", err)
	}
	for _, r := range results {
		s.log.Info("applied migration", "version", r.Source.Version, "file", r.Source.Path, "duration", r.Duration)
	}
	if upTo > 0 {
		return nil // an earlier schema: the code (sql/) is the latest schema's
	}
	return s.applyCode(ctx)
}

// schemaCurrent reports whether every migration is applied, read on the
// store's own pool without the migrations' session lock. It is the common
// case at a process's start, and goose's locker retries once a second:
// runners started together took turns a second apart, on connections
// opened for it (bench section startup, 16 runners spawned at once: the
// migrations and the shard count check were 0.6-1.1 s of a runner's 2 s
// before its first claim).
func (s *Store) schemaCurrent(ctx context.Context) (bool, error) {
	db := stdlib.OpenDBFromPool(s.pool) // closing it leaves the pool open
	defer db.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, db, migrationFS(),
		goose.WithTableName("shardrun_schema_migrations"), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return false, err
	}
	pending, err := provider.HasPending(ctx)
	return err == nil && !pending, err
}

// attemptsError is a connection error whose message names each distinct
// failure once.
type attemptsError struct {
	msg string
	err error
}

func (e *attemptsError) Error() string { return e.msg }
func (e *attemptsError) Unwrap() error { return e.err }

// dedupeAttempts shortens pgx's connection error, which lists one line per
// attempt: with the default sslmode=prefer it tries TLS and then plain text,
// so a refused connection read "dial error … connection refused" twice.
func dedupeAttempts(err error) error {
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		return err
	}
	joined, ok := ce.Unwrap().(interface{ Unwrap() []error })
	if !ok {
		return err
	}
	var parts []string
	for _, e := range joined.Unwrap() {
		if msg := e.Error(); !slices.Contains(parts, msg) {
			parts = append(parts, msg)
		}
	}
	return &attemptsError{err: err, msg: fmt.Sprintf("failed to connect as user %s to database %s: %s",
		ce.Config.User, ce.Config.Database, strings.Join(parts, "; "))}
}

var passwordKV = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// MaskDSN hides the password of a connection string (URL or key=value form)
// so that it can be logged.
func MaskDSN(dsn string) string {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "<unparseable database URL>"
		}
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		}
		q := u.Query()
		if q.Has("password") {
			q.Set("password", "xxxxx")
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return passwordKV.ReplaceAllString(dsn, "${1}xxxxx")
}

var urlPasswordParam = regexp.MustCompile(`(?i)[?&]password=([^&]*)`)

// passwordsIn lists what may be the password in dsn, however malformed:
// the part after the first colon of the user info up to the first or the
// last "@", a password= query parameter, a password=... key-value pair;
// each raw and unescaped, longest first.
func passwordsIn(dsn string) []string {
	var out []string
	add := func(s string) {
		for _, v := range []string{s, unescape(s)} {
			if v != "" && !slices.Contains(out, v) {
				out = append(out, v)
			}
		}
	}
	if _, rest, ok := strings.Cut(dsn, "://"); ok {
		for _, at := range []int{strings.Index(rest, "@"), strings.LastIndex(rest, "@")} {
			if at < 0 {
				continue
			}
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				add(pw)
			}
		}
		for _, m := range urlPasswordParam.FindAllStringSubmatch(dsn, -1) {
			add(m[1])
		}
	}
	for _, m := range passwordKV.FindAllStringSubmatch(dsn, -1) {
		add(strings.Trim(m[2], "'"))
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}

func unescape(s string) string {
	if u, err := url.PathUnescape(s); err == nil {
		return u
	}
	return s
}

// scrubDSN removes from msg every string that may be dsn's password.
func scrubDSN(dsn, msg string) string {
	for _, pw := range passwordsIn(dsn) {
		msg = strings.ReplaceAll(msg, pw, "xxxxx")
	}
	return msg
}

func migrationFS() fs.FS {
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		panic(err) // the directory is embedded at build time
	}
	return sub
}
