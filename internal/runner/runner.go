package runner

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Runner is one member of a shardrun cluster.
type Runner struct {
	cfg      Config
	log      hclog.Logger
	handlers *executor.Registry
	reg      *prometheus.Registry
	started  chan struct{}

	// Set by Run before started is closed.
	machine   *detach.Machine
	mgr       *shard.Manager
	exec      *executor.Executor
	router    *store.Router
	health    *placement.Health
	adminAddr string
}

// New validates cfg and returns a runner with no handlers.
func New(cfg Config) (*Runner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "runner", Level: hclog.Info, Output: os.Stderr})
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return &Runner{
		cfg:      cfg,
		log:      cfg.Logger.With("runner_id", cfg.RunnerID),
		handlers: executor.NewRegistry(),
		reg:      reg,
		started:  make(chan struct{}),
	}, nil
}

// Handle registers the handler for a task kind. The runner claims only the
// kinds it has handlers for.
func (r *Runner) Handle(kind string, h tasks.Handler) error { return r.handlers.Register(kind, h) }

// Started is closed once the runner has joined the cluster and serves.
func (r *Runner) Started() <-chan struct{} { return r.started }

// AdminAddr is the admin endpoint's bound address (after Started).
func (r *Runner) AdminAddr() string { return r.adminAddr }

// ID is the runner's id in the cluster (Config.RunnerID): the owner its
// claims and fenced writes carry.
func (r *Runner) ID() string { return r.cfg.RunnerID }

// Registry is the runner's metrics registry (what /metrics serves): a
// client that also leads the cluster (shardrun.Config.Leader) registers
// the leader's metrics there.
func (r *Runner) Registry() *prometheus.Registry { return r.reg }

// Run connects, joins the cluster and executes tasks until ctx ends. Then it
// drains: it leaves the membership, stops claiming, lets running tasks
// finish (up to the handoff timeout), releases its shards (deletes its
// owner key) and revokes its lease. Errors before joining (bad address,
// unreachable database or etcd, shard count mismatch) are returned at
// once, naming the flag.
func (r *Runner) Run(ctx context.Context) error {
	cfg := r.cfg
	if len(r.handlers.Kinds()) == 0 {
		return errors.New("no task handlers registered")
	}
	if len(cfg.Kinds) > 0 {
		only, err := r.handlers.Only(cfg.Kinds)
		if err != nil {
			return fmt.Errorf("--kinds: %w", err)
		}
		r.handlers = only
	}
	var ln net.Listener
	if !cfg.NoAdmin {
		var err error
		if ln, err = cfg.adminServer().Listen(); err != nil {
			return err
		}
		defer ln.Close()
		r.adminAddr = ln.Addr().String()
	}

	etcd := cfg.Etcd
	if etcd == nil {
		tlsConfig, err := cfg.etcdTLS().Client()
		if err != nil {
			return err
		}
		if etcd, err = cli.NewEtcdClient(cfg.EtcdEndpoints, tlsConfig); err != nil {
			return err
		}
		defer etcd.Close()
	}
	router, own, closeStores, err := r.openDatabases(ctx, etcd)
	if err != nil {
		return err
	}
	defer closeStores()
	r.router = router
	r.health = &placement.Health{Router: router, Logger: r.log.Named("databases")}

	dc := cfg.detachConfig()
	dc.Logger = r.log.Named("detach")
	r.machine = detach.New(dc)
	sc := cfg.shardConfig()
	sc.Client, sc.Detach, sc.AdminAddr, sc.Kinds = etcd, r.machine, advertised(r.adminAddr), r.handlers.Kinds()
	sc.Queues = slices.Sorted(maps.Keys(cfg.queues()))
	sc.Logger, sc.Metrics = r.log.Named("shard"), shard.NewMetrics(r.reg)
	r.mgr, err = shard.New(sc)
	if err != nil {
		return err
	}
	if err := r.mgr.Start(ctx); err != nil {
		return err
	}
	ec := cfg.executorConfig()
	ec.Store, ec.Ownership, ec.Registry = router, ownership{r.mgr}, r.handlers
	ec.Logger, ec.Metrics = r.log.Named("executor"), executor.NewMetrics(r.reg)
	r.exec, err = executor.New(ec)
	if err != nil {
		return err
	}
	support, stopSupport := context.WithCancel(context.WithoutCancel(ctx))
	defer stopSupport()
	var bg sync.WaitGroup
	// One listener per database: an enqueue wakes the claimer whichever
	// database it committed in, and a database that is down delays only
	// its own notifications.
	for _, name := range router.Names() {
		listener := router.Store(name).NewListener(r.log.Named("listener").With("database", name),
			func(n store.Notification) { r.exec.Wake(n.All, n.Shards, n.Urgent) })
		bg.Go(func() { _ = listener.Run(support) })
	}
	bg.Go(func() { r.health.Run(support) })
	if own {
		bg.Go(func() { placement.Watch(support, etcd, cfg.Prefix(), cfg.ShardCount, router, r.log.Named("databases")) })
	}
	var admin *http.Server
	if ln != nil {
		admin = r.serveAdmin(ln, &bg)
	}
	r.log.Info("runner started", "admin", r.adminAddr, "kinds", r.handlers.Kinds(), "shards", cfg.ShardCount,
		"databases", placement.Describe(router.Map()), "lease_ttl", cfg.LeaseTTL, "max_workers", cfg.MaxWorkers)
	close(r.started)

	var core sync.WaitGroup
	errs := make(chan error, 2)
	core.Go(func() { errs <- r.mgr.Run(ctx) })
	core.Go(func() { errs <- r.exec.Run(ctx) })
	core.Wait()
	close(errs)

	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	if admin != nil {
		_ = admin.Shutdown(sctx)
	}
	cancel()
	stopSupport()
	bg.Wait()
	var runErr error
	for err := range errs {
		runErr = errors.Join(runErr, err)
	}
	r.log.Info("runner stopped")
	return runErr
}

// serveAdmin serves the admin endpoint on ln (a TLS listener with
// --admin-cert) until it is shut down.
func (r *Runner) serveAdmin(ln net.Listener, bg *sync.WaitGroup) *http.Server {
	if w := r.cfg.adminServer().Warning(); w != "" {
		r.log.Warn(w)
	}
	admin := &http.Server{Handler: r.adminHandler(), ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout: 10 * time.Second, WriteTimeout: 30 * time.Second, IdleTimeout: time.Minute}
	bg.Go(func() {
		if err := admin.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			r.log.Error("admin endpoint stopped", "error", err)
		}
	})
	return admin
}

// openDatabases opens the cluster's databases (unless Config.Router or
// Config.Store gives them), migrates them, checks their shard count and
// joins them to the cluster's map in etcd (creating the cluster with them
// when it is new): the router over them, whether the runner built it (and
// follows the map), and what closes what it opened.
func (r *Runner) openDatabases(ctx context.Context, etcd *clientv3.Client) (router *store.Router, own bool, done func(), err error) {
	cfg := r.cfg
	if cfg.Router != nil {
		return cfg.Router, false, func() {}, nil
	}
	var dbs []cli.Database
	var stores map[string]*store.Store
	closeStores := func() {}
	if cfg.Store != nil {
		dbs = []cli.Database{{Name: shard.MainDatabase}}
		stores = map[string]*store.Store{shard.MainDatabase: cfg.Store}
	} else {
		if dbs, err = cfg.databases(); err != nil {
			return nil, false, nil, err
		}
		if err := placement.Precheck(ctx, etcd, cfg.Prefix(), placement.Names(dbs)); err != nil {
			return nil, false, nil, err
		}
		if stores, closeStores, err = placement.Open(ctx, dbs, cfg.storeOptions(), r.log); err != nil {
			return nil, false, nil, err
		}
	}
	names := placement.Names(dbs)
	if err := placement.Prepare(ctx, names, stores, cfg.ShardCount, placement.Where(dbs)); err != nil {
		closeStores()
		return nil, false, nil, err
	}
	if router, err = placement.Join(ctx, etcd, cfg.Prefix(), cfg.ShardCount, names, stores, r.log); err != nil {
		closeStores()
		return nil, false, nil, err
	}
	if cfg.Store != nil {
		// The caller's store stays open; a router of one database runs no
		// goroutine of its own to stop.
		return router, true, func() {}, nil
	}
	return router, true, router.Close, nil
}

// ownership is the shard manager as the executor sees it. Go interfaces
// match method signatures exactly, and shard (below the executor) cannot
// name executor.Hold, so Hold is adapted here.
type ownership struct{ *shard.Manager }

// Hold pins the claimable terms for one claim.
func (o ownership) Hold() executor.Hold { return o.Manager.Hold() }

// advertised is the admin address other hosts can use: a wildcard bind
// ("[::]:9090" in a container) names no host, so the host name stands in
// for it in the runner's etcd key and on the status page.
func advertised(bound string) string {
	host, port, err := net.SplitHostPort(bound)
	if err != nil {
		return bound
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsUnspecified() {
		return bound
	}
	name, err := os.Hostname()
	if err != nil || name == "" {
		return bound
	}
	return net.JoinHostPort(name, port)
}
