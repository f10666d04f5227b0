// Package placement joins the databases a process is given to its
// cluster's map of shards to databases (issue 40): what the runner, the
// coordinator and the library's client do at start, the same way. The
// map lives in etcd (shard.EnsureCluster creates it with the cluster);
// each database records its own name, slot and shards (store.Register),
// so that a write for a shard it does not hold is refused there; and a
// store.Router routes every statement by its task's shard.
package placement

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
)

// Open opens a store on each of dbs, in order, with opts (its
// application name and logger named after the database): each error
// names the flag that gave the database and the database, never its
// URL. close closes what it opened.
func Open(ctx context.Context, dbs []cli.Database, opts store.Options, log hclog.Logger) (stores map[string]*store.Store, close func(), err error) {
	stores = make(map[string]*store.Store, len(dbs))
	close = func() {
		for _, st := range stores {
			st.Close()
		}
	}
	for _, d := range dbs {
		o := opts
		o.Logger = log.Named("store").With("database", d.Name)
		st, err := store.Open(ctx, d.URL, o)
		if err != nil {
			close()
			return nil, nil, fmt.Errorf("%s: %w", d.Where(), err)
		}
		stores[d.Name] = st
	}
	return stores, close, nil
}

// CheckDatabases checks a process's databases (--database-url, the
// database main, and the named ones) and their pool settings before
// anything connects, each error one line naming the flag and the
// database, never its URL.
func CheckDatabases(url string, named []cli.Database, opts store.Options) error {
	dbs, err := cli.DatabaseList(url, named)
	if err != nil {
		return err
	}
	if len(dbs) == 0 {
		return fmt.Errorf("--database-url (DATABASE_URL or DATABASE_URL_FILE) or --database NAME=URL (SHARDRUN_DATABASES): required, e.g. postgres://user:pass@host:5432/db")
	}
	for _, d := range dbs {
		if err := cli.CheckDatabaseName(d.Name); err != nil {
			return fmt.Errorf("%s: %v", d.Where(), err)
		}
		if err := store.CheckDSN(d.URL); err != nil {
			return fmt.Errorf("%s: %s", d.Where(), cli.OneLine(err))
		}
	}
	if len(dbs) > cli.MaxDatabases {
		return fmt.Errorf("--database: at most %d databases, got %d", cli.MaxDatabases, len(dbs))
	}
	return opts.Validate()
}

// Precheck refuses, before anything is migrated or written, databases
// that are not those of the cluster under prefix when it exists (a
// *DatabasesError naming the database); a new cluster is created by Join
// once the databases are prepared.
func Precheck(ctx context.Context, etcd *clientv3.Client, prefix string, names []string) error {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := etcd.Get(cctx, prefix+"meta/shard-count")
	if err != nil {
		return fmt.Errorf("connecting to etcd %v (--etcd-endpoints) to read the cluster under %s: %w", etcd.Endpoints(), prefix, err)
	}
	if len(resp.Kvs) == 0 {
		return nil
	}
	// The shard count is checked later, by the flag; here, the names.
	m, err := shard.ReadDatabases(cctx, etcd, prefix, 0)
	if err != nil {
		return err
	}
	if err := shard.CheckDatabases(m, names); err != nil {
		return &DatabasesError{Err: err}
	}
	return nil
}

// Prepare migrates each database (under its lock, so that concurrent
// starts are safe) and records or checks its shard count. where names a
// database in errors (its flag).
func Prepare(ctx context.Context, names []string, stores map[string]*store.Store, shardCount int, where func(name string) string) error {
	for _, name := range names {
		st := stores[name]
		if err := st.Migrate(ctx); err != nil {
			return fmt.Errorf("%s: %w", where(name), err)
		}
		if _, err := st.EnsureShardCount(ctx, shardCount); err != nil {
			return fmt.Errorf("%s: %w", where(name), err)
		}
	}
	return nil
}

// NewRouter returns a router over stores with the map names would get
// if they created the cluster (their order): a provisional map, which
// Adopt replaces with the cluster's. It is for a process given one
// store (a coordinator's or a runner's Config.Store); Join builds the
// router of several from the cluster's map itself.
func NewRouter(names []string, stores map[string]*store.Store, shardCount int, log hclog.Logger) (*store.Router, error) {
	r, err := store.NewRouter(stores, store.NewMap(names, shardCount), log.Named("router"))
	if err != nil {
		return nil, fmt.Errorf("routing over the databases %s: %w", strings.Join(names, ", "), err)
	}
	return r, nil
}

// Join reads the cluster's map from etcd, creating the cluster with
// shardCount shards spread over names (in their order) when it is new,
// checks names against it (one line naming a database the map does not
// name, or one it names that is missing: a *DatabasesError), and returns
// the router over stores under the map, each database registered (its
// name, slot, shards and the map's revision). The router re-reads the
// map from etcd when a database refuses an insert for a shard it no
// longer holds (OnStale); Watch keeps it current.
func Join(ctx context.Context, etcd *clientv3.Client, prefix string, shardCount int, names []string, stores map[string]*store.Store, log hclog.Logger) (*store.Router, error) {
	m, err := ensure(ctx, etcd, prefix, shardCount, names, log)
	if err != nil {
		return nil, err
	}
	if err := shard.CheckDatabases(m, names); err != nil {
		return nil, &DatabasesError{Err: err}
	}
	r, err := store.NewRouter(stores, m, log.Named("router"))
	if err != nil {
		return nil, fmt.Errorf("routing by the cluster's map of databases: %w", err)
	}
	OnStale(r, etcd, prefix, shardCount)
	if err := register(ctx, r); err != nil {
		return nil, err
	}
	return r, nil
}

// Adopt is Join for a router NewRouter made: it gives the router the
// cluster's map (creating the cluster when it is new) after the same
// checks, and registers its databases.
func Adopt(ctx context.Context, etcd *clientv3.Client, prefix string, shardCount int, r *store.Router, log hclog.Logger) error {
	names := r.Names()
	m, err := ensure(ctx, etcd, prefix, shardCount, names, log)
	if err != nil {
		return err
	}
	if err := shard.CheckDatabases(m, names); err != nil {
		return &DatabasesError{Err: err}
	}
	if !slices.Equal(m.Databases, names) {
		return &DatabasesError{Err: fmt.Errorf("--database: the cluster's map lists its databases as %s, this process as %s: give them in the map's order",
			strings.Join(m.Databases, ", "), strings.Join(names, ", "))}
	}
	r.SetMap(m)
	OnStale(r, etcd, prefix, shardCount)
	return register(ctx, r)
}

// ensure is shard.EnsureCluster, bounded, logging the cluster's creation.
func ensure(ctx context.Context, etcd *clientv3.Client, prefix string, shardCount int, names []string, log hclog.Logger) (store.Map, error) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	m, created, err := shard.EnsureCluster(cctx, etcd, prefix, shardCount, names)
	cancel()
	if err != nil {
		return store.Map{}, err
	}
	if created {
		log.Info("created cluster", "prefix", prefix, "shard_count", shardCount, "databases", Describe(m))
	}
	return m, nil
}

// register records each database's place in the cluster under the
// router's map (store.Router.Register).
func register(ctx context.Context, r *store.Router) error {
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := r.Register(rctx); err != nil {
		return fmt.Errorf("registering the databases in the cluster's map (revision %d): %w", r.Map().Rev, err)
	}
	return nil
}

// OnStale makes the router read the map from etcd when a database refused
// an insert into a shard it no longer holds (its map was stale).
func OnStale(r *store.Router, etcd *clientv3.Client, prefix string, shardCount int) {
	r.OnStale = func(ctx context.Context) (store.Map, error) {
		return shard.ReadDatabases(ctx, etcd, prefix, shardCount)
	}
}

// DatabasesError is a process given databases that are not its
// cluster's: a setting to fix (exit status 2), not a failure.
type DatabasesError struct{ Err error }

func (e *DatabasesError) Error() string { return e.Err.Error() }
func (e *DatabasesError) Unwrap() error { return e.Err }

// Watch follows the cluster's map from m.Rev on and gives each new one
// to the router, until ctx ends.
func Watch(ctx context.Context, etcd *clientv3.Client, prefix string, shardCount int, r *store.Router, log hclog.Logger) {
	w := &shard.MapWatch{Client: etcd, Prefix: prefix, ShardCount: shardCount, Rev: r.Map().Rev, OnChange: r.SetMap, Logger: log}
	w.Run(ctx)
}

// Describe is the map in one short line: each database with its shards,
// "main 0-127, second 128-255".
func Describe(m store.Map) string {
	parts := make([]string, len(m.Databases))
	for i, name := range m.Databases {
		parts[i] = name + " " + cmpOr(m.Ranges(name), "none")
	}
	return strings.Join(parts, ", ")
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// Names are the names of dbs, in order.
func Names(dbs []cli.Database) []string {
	names := make([]string, len(dbs))
	for i, d := range dbs {
		names[i] = d.Name
	}
	return names
}

// Where returns the function naming a database of dbs by its flag.
func Where(dbs []cli.Database) func(name string) string {
	return func(name string) string {
		if i := slices.IndexFunc(dbs, func(d cli.Database) bool { return d.Name == name }); i >= 0 {
			return dbs[i].Where()
		}
		return "database " + name
	}
}
