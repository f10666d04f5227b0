// Package shardrun is the Go API of shardrun, a background task system on
// PostgreSQL and etcd: one Client enqueues typed tasks (in your own
// transaction when you give one), reads them and waits for their
// outcome, and, given workers, runs them as one runner of the cluster.
//
//	type Receipt struct{ Order string }
//
//	func (Receipt) Kind() string { return "send-receipt" }
//
//	workers := shardrun.NewWorkers()
//	err := shardrun.AddWorker(workers, func(ctx context.Context, t *shardrun.Task[Receipt]) error {
//		return mail.Send(ctx, t.Args.Order)
//	})
//	c, err := shardrun.NewClient(ctx, pool, etcd, shardrun.Config{Workers: workers})
//	err = c.Start(ctx)
//	defer c.Stop(ctx)
//	e, err := c.EnqueueTx(ctx, tx, Receipt{Order: "o-42"}, &shardrun.EnqueueOpts{UniqueKey: "receipt/o-42"})
//
// A handler that writes to the same database can commit its writes and its
// task's completion in one transaction (AddWorkerTx, or CompleteTx):
// the completion is fenced like every write of a runner, so a runner that
// lost the task's shard (paused, partitioned) cannot commit the effects a
// second time.
//
// One process of the cluster leads it: it sweeps the work of runners that
// stopped, deletes finished tasks after their retention and enqueues the
// ticks of periodic tasks. A client with Config.Leader takes part in that
// election, so a program with workers and a Leader needs no other
// process; the coordinator (cmd/coordinator) takes part in it too, and
// serves the HTTP API and status page.
//
// Task records and their vocabulary (states, filters, pages, errors) are in
// package tasks.
package shardrun

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/leadership"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/internal/slogbridge"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Defaults of Config.
const (
	// DefaultCluster and DefaultEtcdPrefix place the cluster's etcd keys
	// under /shardrun/default/, as the binaries' defaults do.
	DefaultCluster    = shard.DefaultCluster
	DefaultEtcdPrefix = shard.DefaultEtcdPrefix
	// DefaultShardCount is the shard count a new cluster gets.
	DefaultShardCount = shard.DefaultShardCount
	// DefaultDBMaxConns bounds the client's own connection pool.
	DefaultDBMaxConns = 8
	// DefaultEtcdTimeout bounds NewClient's calls to etcd.
	DefaultEtcdTimeout = 10 * time.Second
)

// Database is one of the cluster's databases: its name in the cluster's
// map of shards to databases and a pool on it (Config.Databases).
type Database struct {
	// Name is the database's name in the cluster (a lowercase letter, then
	// up to 62 lowercase letters, digits, - and _): what the binaries call
	// it with --database NAME=URL, and what DatabaseOf answers.
	Name string
	// Pool is a pool on the database: the client opens its own
	// connections with its settings, and AddWorkerTx handlers of tasks
	// whose shard lives there begin their transactions on it.
	Pool *pgxpool.Pool
}

// Config configures a Client. Every field is optional.
type Config struct {
	// Databases are the cluster's databases, by name, for a cluster of
	// several (the binaries' --database NAME=URL); the pool given to
	// NewClient is the database named main, listed first. A new cluster
	// spreads its shards over them in contiguous ranges, in this order;
	// a client given a database the cluster's map does not name, or
	// missing one it names, is refused naming it. Each task lives in the
	// database of its shard (DatabaseOf): enqueue in a transaction on
	// that database (EnqueueTx), complete in one there (CompleteTx).
	// Defaults to none: the pool is the cluster's one database.
	Databases []Database

	// Cluster and EtcdPrefix place the cluster's keys in etcd, under
	// EtcdPrefix+Cluster+"/" (the binaries' --etcd-prefix and --cluster).
	Cluster    string
	EtcdPrefix string
	// ShardCount, when set, must be the cluster's: the cluster's own count
	// (etcd's meta/shard-count, and the database's) is used otherwise, and
	// a new cluster gets DefaultShardCount. It decides every task's shard,
	// so every process of a cluster must agree on it.
	ShardCount int
	// MaxAttempts for tasks enqueued without one (default 5).
	MaxAttempts int
	// DBMaxConns bounds the connections the client opens for its own
	// statements (DefaultDBMaxConns), with the settings of the pool given
	// to NewClient: they need session settings of their own. Transactions
	// you pass in (EnqueueTx, CompleteTx) run on your pool.
	DBMaxConns int
	// Logger receives the client's and its runner's logs (default: hclog
	// at info on stderr). Slog, when set and Logger is not, receives them
	// instead: a program that logs with log/slog gets every record there,
	// the component as the attribute "logger".
	Logger hclog.Logger
	Slog   *slog.Logger
	// EtcdTimeout bounds how long NewClient waits for etcd (the cluster's
	// shard count): past it, NewClient fails with an error naming the
	// endpoints, whatever ctx says. Defaults to DefaultEtcdTimeout (10s).
	EtcdTimeout time.Duration
	// TracerProvider traces enqueues and the runner's claims, handler runs
	// and outcome writes (OpenTelemetry); nil: no tracing.
	TracerProvider trace.TracerProvider

	// Workers are the handlers of the kinds this program runs. With them,
	// Start makes the client a runner of the cluster.
	Workers *Workers
	// Queues are the queues the runner claims from, each with the most of
	// its tasks that may run at once (0: up to MaxWorkers). Default: the
	// default queue. Runners with the same queues and kinds form a
	// capability group, which owns its own shards: a task runs on any
	// attached runner that serves its queue and handles its kind.
	Queues map[string]int
	// MaxWorkers bounds the tasks running at once (default 64).
	MaxWorkers int
	// RunnerID names the runner in the cluster (default hostname-pid).
	RunnerID string
	// LeaseTTL (10s), HandoffTimeout (10s), PollInterval (1s),
	// HeartbeatInterval (5s), RetryBase (1s) and RetryCap (5m) are the
	// runner's timings, as the runner binary's flags of the same names.
	LeaseTTL, HandoffTimeout, PollInterval, HeartbeatInterval, RetryBase, RetryCap time.Duration
	// AdminAddr, when set, serves the runner's admin endpoint there
	// (health, status, metrics, detach and attach: the runner binary's
	// --admin-addr), protected by AdminToken (required off loopback). Its
	// metrics include the leader's, with Leader.
	AdminAddr, AdminToken string

	// Periodic are the periodic tasks this program declares: NewClient
	// stores each (an upsert by name: a restart with the same declarations
	// changes nothing, and a changed task keeps its next tick), and the
	// cluster's leader enqueues their ticks.
	Periodic []PeriodicTask

	// Leader, when set, makes the client take part in the election of the
	// cluster's leader (LeaderConfig): Start campaigns beside the runner,
	// or alone when the client has no Workers (a producer that wants
	// schedules and sweeps without running tasks), and while it leads the
	// client runs what a leading coordinator runs. With a Leader and
	// Workers a program needs no coordinator process; coordinators of the
	// same cluster may run too, and one process leads at a time. Its logs
	// are named "leader"; its metrics are served with the runner's
	// (AdminAddr), so a client that leads without Workers serves none. It
	// needs etcd. Defaults to nil: the client never leads.
	Leader *LeaderConfig
}

// Client enqueues, reads and waits for tasks, and runs them when it has
// workers (Start). It is safe for concurrent use.
type Client struct {
	cfg  Config
	etcd *clientv3.Client
	// dbs are the cluster's databases as given (the pool as main, first),
	// and pools each one's pool by name.
	dbs   []Database
	pools map[string]*pgxpool.Pool
	// router routes every statement by its task's shard to the store of
	// its database (the client's own connections).
	router *store.Router
	// watch follows the cluster's map in etcd (nil without etcd); Close
	// stops it.
	stopWatch context.CancelFunc
	watching  sync.WaitGroup
	tasks     *client.Tasks
	schedules *schedule.Catalog
	caps      *shard.Capabilities
	log       hclog.Logger
	shards    int
	// leaderCfg is the leader's settings, with Config.Leader.
	leaderCfg leadership.Config

	// mu serialises Start and Stop; run is what Start started (nil when
	// stopped).
	mu  sync.Mutex
	run atomic.Pointer[running]
}

// running is what one Start started: the runner, the leader or both.
type running struct {
	runner *runner.Runner     // nil without Workers
	leader *leadership.Leader // nil without Config.Leader
	stop   context.CancelFunc
	// done is closed when both have stopped; err is the runner's.
	done chan struct{}
	err  error
}

// NewClient connects a client to the cluster whose tasks live in pool's
// database (and, for a cluster of several databases, in those of
// Config.Databases) and whose membership lives in etcd. It applies the
// databases' migrations (idempotently, under a lock), reads the cluster's
// shard count and map of databases (creating the cluster with
// Config.ShardCount, or DefaultShardCount, over its databases when it is
// new) and stores the declared periodic tasks. Close releases it.
//
// pool is the database named main: NewClient(ctx, pool, etcd, cfg) is
// NewClient(ctx, nil, etcd, cfg) with Database{Name: "main", Pool: pool}
// first in cfg.Databases. It may be nil when cfg.Databases names every
// database; one of them is required.
//
// etcd may be nil: the client then enqueues (every form), reads, waits,
// cancels and retries on the databases alone, as a producer or an
// operator's tool needs, with the shard count the databases recorded when
// the cluster was created (Config.ShardCount, if set, must match it; it
// is required when no runner or coordinator has started yet) and the map
// of databases they record (each database knows the shards it holds).
// Start then fails: a runner needs etcd, and so does a leader (NewClient
// refuses Config.Leader without etcd). Such a client sets no
// Enqueued.Warnings, which need the fleet's membership; the coordinator's
// status page and GET /api/queues show work no runner can run.
//
// With etcd, NewClient waits at most Config.EtcdTimeout for it and then
// fails naming its endpoints. A pool given with workers added by
// AddWorkerTx must serve Config.MaxWorkers connections (its MaxConns): each
// running task holds one for its transaction.
func NewClient(ctx context.Context, pool *pgxpool.Pool, etcd *clientv3.Client, cfg Config) (*Client, error) {
	dbs, err := databases(pool, cfg.Databases)
	if err != nil {
		return nil, err
	}
	if cfg.Leader != nil && etcd == nil {
		return nil, errLeaderNeedsEtcd
	}
	cfg.Cluster = cmp.Or(cfg.Cluster, DefaultCluster)
	cfg.EtcdPrefix = cmp.Or(cfg.EtcdPrefix, DefaultEtcdPrefix)
	cfg.EtcdTimeout = cmp.Or(cfg.EtcdTimeout, DefaultEtcdTimeout)
	switch {
	case cfg.Logger != nil:
	case cfg.Slog != nil:
		cfg.Logger = slogbridge.New(cfg.Slog).Named("shardrun")
	default:
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "shardrun", Level: hclog.Info, Output: os.Stderr})
	}
	if w := cfg.Workers; w != nil && w.tx.Load() {
		workers := cmp.Or(cfg.MaxWorkers, runner.DefaultConfig().MaxWorkers)
		for _, d := range dbs {
			if have := int(d.Pool.Config().MaxConns); have < workers {
				return nil, fmt.Errorf("shardrun: the pool of database %s serves %d connections (MaxConns) but Config.MaxWorkers is %d: "+
					"AddWorkerTx handlers would run %d at a time; raise the pool's pool_max_conns to %d or lower MaxWorkers", d.Name, have, workers, have, workers)
			}
		}
	}
	var leaderCfg leadership.Config
	if cfg.Leader != nil {
		if leaderCfg, err = leaderSettings(cfg); err != nil {
			return nil, err
		}
		leaderCfg.Logger = cfg.Logger.Named("leader")
	}
	prefix := cfg.EtcdPrefix + cfg.Cluster + "/"
	c := &Client{cfg: cfg, etcd: etcd, dbs: dbs, pools: map[string]*pgxpool.Pool{}, log: cfg.Logger, leaderCfg: leaderCfg}
	stores := map[string]*store.Store{}
	closeStores := func() {
		for _, st := range stores {
			st.Close()
		}
	}
	for _, d := range dbs {
		st, err := store.OpenLike(ctx, d.Pool, store.Options{MaxConns: cmp.Or(cfg.DBMaxConns, DefaultDBMaxConns),
			ApplicationName: "shardrun-client", Logger: cfg.Logger.Named("store").With("database", d.Name), HandlerTxTimeout: cfg.LeaseTTL})
		if err != nil {
			closeStores()
			return nil, fmt.Errorf("shardrun: opening database %s: %w", d.Name, err)
		}
		stores[d.Name], c.pools[d.Name] = st, d.Pool
	}
	if etcd != nil {
		c.caps = &shard.Capabilities{Client: etcd, Prefix: prefix}
	}
	if err := c.init(ctx, prefix, stores); err != nil {
		if c.router != nil {
			_ = c.Close()
		}
		closeStores()
		return nil, err
	}
	return c, nil
}

// databases are the cluster's databases a client is given: pool as main
// first, then cfg's, each checked.
func databases(pool *pgxpool.Pool, given []Database) ([]Database, error) {
	var dbs []Database
	if pool != nil {
		dbs = append(dbs, Database{Name: store.MainDatabase, Pool: pool})
	}
	dbs = append(dbs, given...)
	if len(dbs) == 0 {
		return nil, errors.New("shardrun: NewClient needs a database pool, or Config.Databases")
	}
	for i, d := range dbs {
		switch {
		case d.Pool == nil:
			return nil, fmt.Errorf("shardrun: Config.Databases: database %s has no pool", d.Name)
		case slices.ContainsFunc(dbs[:i], func(o Database) bool { return o.Name == d.Name }):
			if d.Name == store.MainDatabase && pool != nil {
				return nil, errors.New("shardrun: Config.Databases names the database main, which is the pool given to NewClient: give it one way")
			}
			return nil, fmt.Errorf("shardrun: Config.Databases names the database %s twice", d.Name)
		}
		if err := cli.CheckDatabaseName(d.Name); err != nil {
			return nil, fmt.Errorf("shardrun: Config.Databases: %w", err)
		}
	}
	if len(dbs) > cli.MaxDatabases {
		return nil, fmt.Errorf("shardrun: Config.Databases: at most %d databases, got %d", cli.MaxDatabases, len(dbs))
	}
	return dbs, nil
}

func (c *Client) init(ctx context.Context, prefix string, stores map[string]*store.Store) error {
	names := make([]string, len(c.dbs))
	for i, d := range c.dbs {
		names[i] = d.Name
		if err := stores[d.Name].Migrate(ctx); err != nil {
			return fmt.Errorf("shardrun: migrating database %s: %w", d.Name, err)
		}
	}
	n, err := c.shardCount(ctx, prefix, names, stores)
	if err != nil {
		return err
	}
	for _, name := range names {
		if _, err := stores[name].EnsureShardCount(ctx, n); err != nil {
			return fmt.Errorf("shardrun: database %s: %w", name, err)
		}
	}
	c.shards = n
	if err := c.route(ctx, prefix, names, stores); err != nil {
		return err
	}
	if c.cfg.Leader != nil {
		c.leaderCfg.ShardCount = n
		if err := c.leaderCfg.WithDefaults().Validate(); err != nil {
			return fmt.Errorf("shardrun: Config.Leader: %w", err)
		}
	}
	prep := client.Config{ShardCount: n, MaxAttempts: c.cfg.MaxAttempts, TracerProvider: c.cfg.TracerProvider}
	if c.tasks, err = client.New(c.router, prep); err != nil {
		return fmt.Errorf("shardrun: %w", err)
	}
	if c.schedules, err = schedule.NewCatalog(c.router.Catalog(), prep); err != nil {
		return fmt.Errorf("shardrun: %w", err)
	}
	if c.cfg.Workers != nil {
		if err := c.cfg.Workers.bind(c); err != nil {
			return err
		}
	}
	for _, p := range c.cfg.Periodic {
		if err := c.declare(ctx, p); err != nil {
			return err
		}
	}
	return nil
}

// route joins the databases to the cluster's map: from etcd, where it
// follows the map until Close; without etcd, the map the databases
// record (store.ReadMap), which the router reads again when a database
// refuses an insert into a shard it no longer holds.
func (c *Client) route(ctx context.Context, prefix string, names []string, stores map[string]*store.Store) error {
	log := c.log.Named("databases")
	if c.etcd == nil {
		m, err := store.ReadMap(ctx, stores)
		if err != nil {
			return fmt.Errorf("shardrun: %w", err)
		}
		if err := shard.CheckDatabases(m, names); err != nil {
			return fmt.Errorf("shardrun: %w", err)
		}
		if c.router, err = store.NewRouter(stores, m, log.Named("router")); err != nil {
			return fmt.Errorf("shardrun: %w", err)
		}
		return nil
	}
	r, err := placement.Join(ctx, c.etcd, prefix, c.shards, names, stores, log)
	if err != nil {
		return fmt.Errorf("shardrun: %w", err)
	}
	c.router = r
	wctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	c.stopWatch = stop
	c.watching.Go(func() { placement.Watch(wctx, c.etcd, prefix, c.shards, r, log) })
	return nil
}

// shardCount is the cluster's shard count: etcd's (bounded by
// EtcdTimeout; creating the cluster over names when it is new), or
// without etcd the one the databases recorded.
func (c *Client) shardCount(ctx context.Context, prefix string, names []string, stores map[string]*store.Store) (int, error) {
	if c.etcd == nil {
		n := 0
		for _, name := range names {
			got, ok, err := stores[name].ShardCount(ctx)
			switch {
			case err != nil:
				return 0, fmt.Errorf("shardrun: database %s: %w", name, err)
			case ok && n != 0 && got != n:
				return 0, fmt.Errorf("shardrun: database %s records %d shards, another of the cluster's %d", name, got, n)
			case ok:
				n = got
			}
		}
		switch {
		case n == 0 && c.cfg.ShardCount == 0:
			return 0, errors.New("shardrun: the database records no shard count yet (no runner or coordinator has started on it): " +
				"set Config.ShardCount to the cluster's, or give NewClient an etcd client")
		case n == 0:
			return c.cfg.ShardCount, nil
		case c.cfg.ShardCount != 0 && c.cfg.ShardCount != n:
			return 0, fmt.Errorf("shardrun: Config.ShardCount is %d but the database's cluster has %d shards", c.cfg.ShardCount, n)
		}
		return n, nil
	}
	ectx, cancel := context.WithTimeout(ctx, c.cfg.EtcdTimeout)
	defer cancel()
	n, err := shard.ClusterShardCount(ectx, c.etcd, prefix, c.cfg.ShardCount, names)
	if err != nil && ectx.Err() != nil && ctx.Err() == nil {
		return 0, fmt.Errorf("shardrun: etcd at %s did not answer within %s (Config.EtcdTimeout): %w",
			strings.Join(c.etcd.Endpoints(), ","), c.cfg.EtcdTimeout, err)
	}
	if err != nil {
		return 0, fmt.Errorf("shardrun: %w", err)
	}
	return n, nil
}

// DatabaseOf names the database that holds the tasks of key, under the
// cluster's map now: the database of a task whose Key is key (of its
// SequenceKey when it has one, or of its UniqueKey when it has no Key, as
// the task's shard is). Enqueue a task in your own transaction
// (EnqueueTx) and complete it in one (CompleteTx) on that database: a
// transaction on another is refused naming both. To keep a task with
// your own data, give it a Key (or a SequenceKey) whose database is your
// data's, for example the key of the record the task is about, and keep
// that record in the database DatabaseOf names. A shard's move (an
// operator's) changes the answer.
func (c *Client) DatabaseOf(key string) string {
	name, _ := c.router.Of(tasks.ShardOf(key, c.shards))
	return name
}

// Databases lists the cluster's databases, in the map's order.
func (c *Client) Databases() []string { return c.router.Names() }

// ShardCount is the cluster's shard count.
func (c *Client) ShardCount() int { return c.shards }

// Start makes the client a runner of the cluster, running the tasks of
// its Workers, and with Config.Leader a candidate for the cluster's
// leadership. It returns once the runner has joined (or with the error
// that stopped it: a bad setting, etcd unreachable); the leader campaigns
// in the background. Stop drains the runner and resigns the leadership.
func (c *Client) Start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.etcd == nil {
		return errors.New("shardrun: Start needs an etcd client (NewClient was given none): a runner holds its shards in etcd; " +
			"a client without one enqueues, reads, cancels and retries only")
	}
	w := c.cfg.Workers
	working := w != nil && len(w.reg.Kinds()) > 0
	if !working && c.cfg.Leader == nil {
		return errors.New("shardrun: Start needs Config.Workers with at least one worker, or Config.Leader")
	}
	if c.run.Load() != nil {
		return errors.New("shardrun: the client is started already")
	}
	run := &running{done: make(chan struct{})}
	var reg prometheus.Registerer
	if working {
		r, err := c.newRunner(w)
		if err != nil {
			return err
		}
		run.runner, reg = r, r.Registry()
	}
	if c.cfg.Leader != nil {
		l, err := leadership.New(c.etcd, c.router, reg, c.leaderCfg)
		if err != nil {
			return fmt.Errorf("shardrun: Config.Leader: %w", err)
		}
		run.leader = l
	}
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	run.stop = stop
	var runnerDone chan error
	if r := run.runner; r != nil {
		runnerDone = make(chan error, 1)
		go func() { runnerDone <- r.Run(runCtx) }()
		select {
		case <-r.Started():
		case err := <-runnerDone:
			stop()
			return fmt.Errorf("shardrun: starting the runner: %w", err)
		case <-ctx.Done():
			stop()
			<-runnerDone
			return ctx.Err()
		}
	}
	var leaderDone chan struct{}
	if l := run.leader; l != nil {
		leaderDone = make(chan struct{})
		go func() {
			defer close(leaderDone)
			l.Run(runCtx)
		}()
	}
	go func() {
		if runnerDone != nil {
			run.err = <-runnerDone
		}
		if leaderDone != nil {
			<-leaderDone
		}
		close(run.done)
	}()
	c.run.Store(run)
	return nil
}

// newRunner builds the runner of the client's workers.
func (c *Client) newRunner(w *Workers) (*runner.Runner, error) {
	rc := runner.DefaultConfig()
	rc.Cluster, rc.EtcdPrefix, rc.ShardCount = c.cfg.Cluster, c.cfg.EtcdPrefix, c.shards
	rc.Etcd, rc.Router, rc.Logger, rc.TracerProvider = c.etcd, c.router, c.log.Named("runner"), c.cfg.TracerProvider
	rc.Queues, rc.RunnerID = c.cfg.Queues, cmp.Or(c.cfg.RunnerID, rc.RunnerID)
	rc.MaxWorkers = cmp.Or(c.cfg.MaxWorkers, rc.MaxWorkers)
	rc.LeaseTTL = cmp.Or(c.cfg.LeaseTTL, rc.LeaseTTL)
	rc.HandoffTimeout = cmp.Or(c.cfg.HandoffTimeout, rc.HandoffTimeout)
	rc.PollInterval = cmp.Or(c.cfg.PollInterval, rc.PollInterval)
	rc.HeartbeatInterval = cmp.Or(c.cfg.HeartbeatInterval, rc.HeartbeatInterval)
	rc.RetryBase = cmp.Or(c.cfg.RetryBase, rc.RetryBase)
	rc.RetryCap = cmp.Or(c.cfg.RetryCap, rc.RetryCap)
	rc.AdminAddr, rc.AdminToken, rc.NoAdmin = c.cfg.AdminAddr, c.cfg.AdminToken, c.cfg.AdminAddr == ""
	r, err := runner.New(rc)
	if err != nil {
		return nil, fmt.Errorf("shardrun: %w", err)
	}
	for _, kind := range w.reg.Kinds() {
		h, _ := w.reg.Lookup(kind)
		if err := r.Handle(kind, c.withRuntime(h)); err != nil {
			return nil, fmt.Errorf("shardrun: %w", err)
		}
	}
	return r, nil
}

// RunnerID is the id of the client's runner in the cluster (after Start;
// "" without Workers).
func (c *Client) RunnerID() string {
	if run := c.run.Load(); run != nil && run.runner != nil {
		return run.runner.ID()
	}
	return ""
}

// IsLeader reports whether the client leads the cluster now (with
// Config.Leader, after Start).
func (c *Client) IsLeader() bool {
	run := c.run.Load()
	return run != nil && run.leader != nil && run.leader.IsLeader()
}

// Stop stops what Start started: the leader resigns, so that another
// process of the cluster leads at once, and the runner drains: it stops
// claiming, lets running tasks finish (up to Config.HandoffTimeout, then
// cancels them), gives its shards to the other runners and leaves. It
// returns when that is done, or when ctx ends first.
func (c *Client) Stop(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	run := c.run.Load()
	if run == nil {
		return nil
	}
	run.stop()
	select {
	case <-run.done:
		c.run.Store(nil)
		return run.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close stops the runner and the leader if they run (as Stop, waiting for
// them) and closes the client's own connections. The pools and etcd client
// given to NewClient stay open: they are the caller's.
func (c *Client) Close() error {
	err := c.Stop(context.Background())
	if c.stopWatch != nil {
		c.stopWatch()
		c.watching.Wait()
	}
	c.router.Close()
	return err
}
