// Package coordinator is the shardrun coordinator as a library: the
// cluster's leader (internal/leadership: the election, the coordinator
// fence, the leader's sweeps, retention, schedule ticks and, with
// --unhandled-after, the unrunnable rule) and the cluster API and status
// page. cmd/coordinator wraps it with flags, the embedded etcd and the
// --dev all-in-one mode.
package coordinator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leadership"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
)

// Coordinator takes part in the cluster's leader election
// (leadership.Leader); the leader runs the leader's services (sweeps,
// retention, schedules, the unrunnable rule). Every coordinator serves
// the API and status page.
type Coordinator struct {
	cfg     Config
	log     hclog.Logger
	clock   clock.Clock
	reg     *prometheus.Registry
	client  *client.Tasks
	roster  *roster
	addr    string
	started chan struct{}
	// tracer is nil with tracing off.
	tracer trace.Tracer

	// router routes every statement by its task's shard and merges the
	// reads of every database; health probes each database.
	router *store.Router
	health *placement.Health

	counter   *counter
	leader    *leadership.Leader
	unhandled *unrunnableWatch
	schedules *schedule.Catalog
	// scheduler is the leader's schedule service: a schedule created on
	// this coordinator wakes it.
	scheduler *schedule.Scheduler

	// capabilities caches the classes (queue, kind) the attached runners
	// can run, read from etcd at most once a second (runnableClasses).
	capabilities *shard.Capabilities

	// bulkBudget is how long one bulk cancel or retry request works
	// before it answers done false (defaultBulkBudget); the browser test
	// lowers it to see the status page continue from the cursor.
	bulkBudget atomic.Int64
}

// New fills the defaults, validates cfg and builds the coordinator's
// parts, each once: the leader (its election and services), the clients
// the API uses.
func New(cfg Config) (*Coordinator, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Client == nil || (cfg.Store == nil && cfg.Router == nil) {
		return nil, errors.New("coordinator: an etcd client and the databases (a router or a store) are required")
	}
	cfg.Clock = cmp.Or(cfg.Clock, clock.Real())
	cfg.Logger = cmp.Or(cfg.Logger, hclog.NewNullLogger())
	router := cfg.Router
	if router == nil {
		var err error
		router, err = placement.NewRouter([]string{shard.MainDatabase}, map[string]*store.Store{shard.MainDatabase: cfg.Store}, cfg.ShardCount, cfg.Logger)
		if err != nil {
			return nil, err
		}
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
		cfg.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	prep := client.Config{ShardCount: cfg.ShardCount, MaxAttempts: cfg.MaxAttempts, Clock: cfg.Clock}
	enq := prep
	enq.TracerProvider = cfg.TracerProvider // the API's enqueues are traced
	tc, err := client.New(router, enq)
	if err != nil {
		return nil, err
	}
	c := &Coordinator{cfg: cfg, log: cfg.Logger, clock: cfg.Clock, reg: cfg.Registry, client: tc, started: make(chan struct{}),
		router: router, health: &placement.Health{Router: router, Clock: cfg.Clock, Logger: cfg.Logger.Named("databases")},
		tracer:       tracing.Tracer(cfg.TracerProvider),
		roster:       newRoster(cfg.Client, cfg.Prefix, cfg.Clock, cfg.Logger.Named("roster")),
		capabilities: &shard.Capabilities{Client: cfg.Client, Prefix: cfg.Prefix, Clock: cfg.Clock}}
	c.bulkBudget.Store(int64(defaultBulkBudget))
	// The schedules live in the first database.
	if c.schedules, err = schedule.NewCatalog(router.Store(router.Names()[0]), prep); err != nil {
		return nil, err
	}
	if c.leader, err = leadership.New(cfg.Client, router, c.reg, cfg.leadership()); err != nil {
		return nil, err
	}
	c.scheduler = c.leader.Scheduler()
	f := promauto.With(c.reg)
	c.counter = &counter{router: router, clock: cfg.Clock, log: cfg.Logger,
		gauge: f.NewGaugeVec(prometheus.GaugeOpts{Name: "shardrun_tasks",
			Help: "Tasks by state (refreshed every few seconds)."}, []string{"state"})}
	c.unhandled = &unrunnableWatch{store: router, runnable: c.runnableClasses, clock: c.clock, log: c.log.Named("unrunnable"),
		gauge: f.NewGaugeVec(prometheus.GaugeOpts{Name: "shardrun_unrunnable_tasks",
			Help: "Ready tasks no attached runner can run (serves their queue and handles their kind), by queue and kind (refreshed every few seconds)."},
			[]string{"queue", "kind"})}
	return c, nil
}

// IsLeader reports whether this coordinator leads now.
func (c *Coordinator) IsLeader() bool { return c.leader.IsLeader() }

// Addr is the bound HTTP address (after Started).
func (c *Coordinator) Addr() string { return c.addr }

// Started is closed once the HTTP server listens.
func (c *Coordinator) Started() <-chan struct{} { return c.started }

// Run serves HTTP and takes part in the election until ctx ends; the
// leader resigns on the way out.
func (c *Coordinator) Run(ctx context.Context) error {
	// The databases first: a process with the wrong count must not create
	// the cluster's meta/shard-count in a fresh etcd.
	for _, name := range c.router.Names() {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		created, err := c.router.Store(name).EnsureShardCount(cctx, c.cfg.ShardCount)
		cancel()
		if err != nil {
			return fmt.Errorf("database %s: %w", name, err)
		}
		if created {
			c.log.Info("recorded the shard count in the database", "database", name, "shard_count", c.cfg.ShardCount)
		}
	}
	// A store given alone joins the cluster here: the cluster's map
	// (created with the cluster when it is new), the database checked
	// against it and registered. A router was joined by whoever made it.
	if c.cfg.Router == nil {
		if err := placement.Adopt(ctx, c.cfg.Client, c.cfg.Prefix, c.cfg.ShardCount, c.router, c.log); err != nil {
			return err
		}
	}
	ln, err := c.cfg.httpServer().Listen()
	if err != nil {
		return err
	}
	c.addr = ln.Addr().String()
	if w := c.cfg.httpServer().Warning(); w != "" {
		c.log.Warn(w)
	}
	srv := &http.Server{Handler: c.Handler(), ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: time.Minute}
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			c.log.Error("HTTP server stopped", "error", err)
		}
	})
	wg.Go(func() {
		placement.Watch(ctx, c.cfg.Client, c.cfg.Prefix, c.cfg.ShardCount, c.router, c.log.Named("databases"))
	})
	wg.Go(func() { c.health.Run(ctx) })
	wg.Go(func() { c.counter.Run(ctx) })
	wg.Go(func() { c.roster.Run(ctx) })
	wg.Go(func() { c.unhandled.Run(ctx) })
	c.log.Info("coordinator started", "http", c.addr, "prefix", c.cfg.Prefix, "election_ttl", c.cfg.ElectionTTL,
		"databases", placement.Describe(c.router.Map()))
	close(c.started)

	c.leader.Run(ctx)

	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	_ = srv.Shutdown(sctx)
	scancel()
	wg.Wait()
	c.log.Info("coordinator stopped")
	return nil
}
