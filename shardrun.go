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
//	shardrun.AddWorker(workers, func(ctx context.Context, t *shardrun.Task[Receipt]) error {
//		return mail.Send(ctx, t.Args.Order)
//	})
//	c, err := shardrun.NewClient(ctx, pool, etcd, shardrun.Config{Workers: workers})
//	err = c.Start(ctx)
//	defer c.Stop(ctx)
//	e, err := c.EnqueueTx(ctx, tx, Receipt{Order: "o-42"}, &shardrun.EnqueueOpts{UniqueKey: "receipt/o-42"})
//
// A handler that writes to the same database can commit its writes and its
// task's completion in one transaction (AddWorkerTx, or Client.CompleteTx):
// the completion is fenced like every write of a runner, so a runner that
// lost the task's shard (paused, partitioned) cannot commit the effects a
// second time. The sweeps, retention, schedules and the HTTP API run in the
// coordinator process (cmd/coordinator), which every cluster needs.
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
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/client"
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
	// --admin-addr), protected by AdminToken (required off loopback).
	AdminAddr, AdminToken string

	// Periodic are the periodic tasks this program declares: NewClient
	// stores each (an upsert by name: a restart with the same declarations
	// changes nothing, and a changed task keeps its next tick), and the
	// coordinators' leader enqueues their ticks.
	Periodic []PeriodicTask
}

// Client enqueues, reads and waits for tasks, and runs them when it has
// workers (Start). It is safe for concurrent use.
type Client struct {
	cfg       Config
	pool      *pgxpool.Pool
	etcd      *clientv3.Client
	st        *store.Store
	tasks     *client.Client
	schedules *schedule.Client
	caps      *shard.Capabilities
	log       hclog.Logger
	shards    int

	runner *runner.Runner
	stop   context.CancelFunc
	done   chan error
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
// fails: a runner needs etcd. Such a client sets no Enqueued.Warnings,
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
	prefix := cfg.EtcdPrefix + cfg.Cluster + "/"
	st, err := store.OpenLike(ctx, pool, store.Options{MaxConns: cmp.Or(cfg.DBMaxConns, DefaultDBMaxConns),
		ApplicationName: "shardrun-client", Logger: cfg.Logger.Named("store"), HandlerTxTimeout: cfg.LeaseTTL})
	if err != nil {
		return nil, fmt.Errorf("shardrun: opening the database: %w", err)
	}
	c := &Client{cfg: cfg, pool: pool, etcd: etcd, st: st, log: cfg.Logger}
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
	prep := client.Config{ShardCount: n, MaxAttempts: c.cfg.MaxAttempts, TracerProvider: c.cfg.TracerProvider}
	if c.tasks, err = client.New(c.st, prep); err != nil {
		return fmt.Errorf("shardrun: %w", err)
	}
	if c.schedules, err = schedule.NewClient(c.st, prep); err != nil {
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
// its Workers, and returns once it has joined (or with the error that
// stopped it: a bad setting, etcd unreachable). Stop drains it.
func (c *Client) Start(ctx context.Context) error {
	if c.etcd == nil {
		return errors.New("shardrun: Start needs an etcd client (NewClient was given none): a runner holds its shards in etcd; " +
			"a client without one enqueues, reads, cancels and retries only")
	}
	w := c.cfg.Workers
	if w == nil || len(w.reg.Kinds()) == 0 {
		return errors.New("shardrun: Start needs Config.Workers with at least one worker")
	}
	if c.runner != nil {
		return errors.New("shardrun: the client is started already")
	}
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
		return fmt.Errorf("shardrun: %w", err)
	}
	for _, kind := range w.reg.Kinds() {
		h, _ := w.reg.Lookup(kind)
		if err := r.Handle(kind, c.withRuntime(h)); err != nil {
			return fmt.Errorf("shardrun: %w", err)
		}
	}
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	select {
	case <-r.Started():
	case err := <-done:
		stop()
		return fmt.Errorf("shardrun: starting the runner: %w", err)
	case <-ctx.Done():
		stop()
		<-done
		return ctx.Err()
	}
	c.runner, c.stop, c.done = r, stop, done
	return nil
}

// RunnerID is the id of the client's runner in the cluster (after Start).
func (c *Client) RunnerID() string {
	if c.runner == nil {
		return ""
	}
	return c.runner.ID()
}

// Stop drains the runner Start started: it stops claiming, lets running
// tasks finish (up to Config.HandoffTimeout, then cancels them), gives its
// shards to the other runners and leaves. It returns when that is done, or
// when ctx ends first.
func (c *Client) Stop(ctx context.Context) error {
	if c.runner == nil {
		return nil
	}
	c.stop()
	select {
	case err := <-c.done:
		c.runner = nil
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close stops the runner if it runs (as Stop, waiting for it) and closes
// the client's own connections. The pool and etcd client given to
// NewClient stay open: they are the caller's.
func (c *Client) Close() error {
	err := c.Stop(context.Background())
	c.st.Close()
	return err
}
