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
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/leadership"
	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/internal/slogbridge"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
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

// Config configures a Client. Every field is optional.
type Config struct {
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
	cfg       Config
	pool      *pgxpool.Pool
	etcd      *clientv3.Client
	st        *store.Store
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
// database and whose membership lives in etcd. It applies the database's
// migrations (idempotently, under a lock), reads the cluster's shard count
// (creating the cluster with Config.ShardCount, or DefaultShardCount, when
// it is new) and stores the declared periodic tasks. Close releases it.
//
// etcd may be nil: the client then enqueues (every form), reads, waits,
// cancels and retries on the database alone, as a producer or an
// operator's tool needs, with the shard count the database recorded when
// the cluster was created (Config.ShardCount, if set, must match it; it
// is required when no runner or coordinator has started yet). Start then
// fails: a runner needs etcd, and so does a leader (NewClient refuses
// Config.Leader without etcd). Such a client sets no Enqueued.Warnings,
// which need the fleet's membership; the coordinator's status page and
// GET /api/queues show work no runner can run.
//
// With etcd, NewClient waits at most Config.EtcdTimeout for it and then
// fails naming its endpoints. A pool given with workers added by
// AddWorkerTx must serve Config.MaxWorkers connections (its MaxConns): each
// running task holds one for its transaction.
func NewClient(ctx context.Context, pool *pgxpool.Pool, etcd *clientv3.Client, cfg Config) (*Client, error) {
	if pool == nil {
		return nil, errors.New("shardrun: NewClient needs a database pool")
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
		if have := int(pool.Config().MaxConns); have < workers {
			return nil, fmt.Errorf("shardrun: the pool given to NewClient serves %d connections (MaxConns) but Config.MaxWorkers is %d: "+
				"AddWorkerTx handlers would run %d at a time; raise the pool's pool_max_conns to %d or lower MaxWorkers", have, workers, have, workers)
		}
	}
	var leaderCfg leadership.Config
	if cfg.Leader != nil {
		var err error
		if leaderCfg, err = leaderSettings(cfg); err != nil {
			return nil, err
		}
		leaderCfg.Logger = cfg.Logger.Named("leader")
	}
	prefix := cfg.EtcdPrefix + cfg.Cluster + "/"
	st, err := store.OpenLike(ctx, pool, store.Options{MaxConns: cmp.Or(cfg.DBMaxConns, DefaultDBMaxConns),
		ApplicationName: "shardrun-client", Logger: cfg.Logger.Named("store"), HandlerTxTimeout: cfg.LeaseTTL})
	if err != nil {
		return nil, fmt.Errorf("shardrun: opening the database: %w", err)
	}
	c := &Client{cfg: cfg, pool: pool, etcd: etcd, st: st, log: cfg.Logger, leaderCfg: leaderCfg}
	if etcd != nil {
		c.caps = &shard.Capabilities{Client: etcd, Prefix: prefix}
	}
	if err := c.init(ctx, prefix); err != nil {
		st.Close()
		return nil, err
	}
	return c, nil
}

func (c *Client) init(ctx context.Context, prefix string) error {
	if err := c.st.Migrate(ctx); err != nil {
		return fmt.Errorf("shardrun: migrating the database: %w", err)
	}
	n, err := c.shardCount(ctx, prefix)
	if err != nil {
		return err
	}
	if _, err := c.st.EnsureShardCount(ctx, n); err != nil {
		return fmt.Errorf("shardrun: %w", err)
	}
	c.shards = n
	if c.cfg.Leader != nil {
		c.leaderCfg.ShardCount = n
		if err := c.leaderCfg.WithDefaults().Validate(); err != nil {
			return fmt.Errorf("shardrun: Config.Leader: %w", err)
		}
	}
	prep := client.Config{ShardCount: n, MaxAttempts: c.cfg.MaxAttempts, TracerProvider: c.cfg.TracerProvider}
	if c.tasks, err = client.New(c.st, prep); err != nil {
		return fmt.Errorf("shardrun: %w", err)
	}
	if c.schedules, err = schedule.NewCatalog(c.st, prep); err != nil {
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

// shardCount is the cluster's shard count: etcd's (bounded by
// EtcdTimeout), or without etcd the one the database recorded.
func (c *Client) shardCount(ctx context.Context, prefix string) (int, error) {
	if c.etcd == nil {
		n, ok, err := c.st.ShardCount(ctx)
		switch {
		case err != nil:
			return 0, fmt.Errorf("shardrun: %w", err)
		case !ok && c.cfg.ShardCount == 0:
			return 0, errors.New("shardrun: the database records no shard count yet (no runner or coordinator has started on it): " +
				"set Config.ShardCount to the cluster's, or give NewClient an etcd client")
		case !ok:
			return c.cfg.ShardCount, nil
		case c.cfg.ShardCount != 0 && c.cfg.ShardCount != n:
			return 0, fmt.Errorf("shardrun: Config.ShardCount is %d but the database's cluster has %d shards", c.cfg.ShardCount, n)
		}
		return n, nil
	}
	ectx, cancel := context.WithTimeout(ctx, c.cfg.EtcdTimeout)
	defer cancel()
	n, err := shard.ClusterShardCount(ectx, c.etcd, prefix, c.cfg.ShardCount)
	if err != nil && ectx.Err() != nil && ctx.Err() == nil {
		return 0, fmt.Errorf("shardrun: etcd at %s did not answer within %s (Config.EtcdTimeout): %w",
			strings.Join(c.etcd.Endpoints(), ","), c.cfg.EtcdTimeout, err)
	}
	if err != nil {
		return 0, fmt.Errorf("shardrun: %w", err)
	}
	return n, nil
}

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
		l, err := leadership.New(c.etcd, c.st, reg, c.leaderCfg)
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
	rc.Etcd, rc.Store, rc.Logger, rc.TracerProvider = c.etcd, c.st, c.log.Named("runner"), c.cfg.TracerProvider
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
// them) and closes the client's own connections. The pool and etcd client
// given to NewClient stay open: they are the caller's.
func (c *Client) Close() error {
	err := c.Stop(context.Background())
	c.st.Close()
	return err
}
