// Package coordinator is the shardrun coordinator as a library: leader
// election among coordinators; the leader's sweeps, retention, schedule
// ticks and (with --unhandled-after) unhandled-kind rule; and the cluster
// API and status page. cmd/coordinator wraps it with flags, the
// embedded etcd and the --dev all-in-one mode.
package coordinator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promauto"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/httpauth"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/maintenance"
	"github.com/shardrun/shardrun/schedule"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
	"github.com/shardrun/shardrun/tasks"
)

// Defaults of Config.
const (
	// DefaultElectionTTL is the default leader session TTL.
	DefaultElectionTTL = 10 * time.Second
	// DefaultHTTPAddr serves the API and the status page.
	DefaultHTTPAddr = "127.0.0.1:8080"
)

// MaxElectionTTL bounds the election TTL: a leader that dies is replaced
// within about this long, and nobody sweeps meanwhile.
const MaxElectionTTL = time.Hour

// Config configures a Coordinator.
type Config struct {
	// ID names this coordinator in the election; required.
	ID string
	// Client talks to etcd; required.
	Client *clientv3.Client
	// Prefix is the cluster's key prefix, e.g. "/shardrun/default/".
	Prefix string
	// ShardCount must match the cluster's (meta/shard-count).
	ShardCount int
	// Store is the database; required.
	Store *store.Store
	// ElectionTTL is the leader session's TTL, whole seconds: a leader that
	// dies is replaced within about this long. Default 10s.
	ElectionTTL time.Duration
	// Sweep configures the sweeper run by the leader (Store, Epoch and
	// Clock are filled in).
	Sweep sweeper.Config
	// Retention configures the leader's deletion of finished tasks (Store,
	// Epoch, Clock and Metrics are filled in).
	Retention maintenance.RetentionConfig
	// Unhandled configures the rule that fails ready tasks of kinds no
	// attached runner handles; it runs only when After (--unhandled-after)
	// is set. Store, Epoch, Kinds, Clock and Metrics are filled in.
	Unhandled maintenance.ReaperConfig
	// Scheduler configures the leader's enqueueing of schedule ticks
	// (Store, Epoch, ShardCount, MaxAttempts, Clock, Metrics and Wake are
	// filled in).
	Scheduler schedule.SchedulerConfig
	// HTTPAddr serves the API and status page. Default DefaultHTTPAddr.
	HTTPAddr string
	// APIToken, when set, is required as a bearer token on every call that
	// reads task data or changes anything; required when HTTPAddr is not a
	// loopback address.
	APIToken string
	// MaxAttempts for enqueued tasks that do not set one. Default
	// tasks.DefaultMaxAttempts.
	MaxAttempts int
	Clock       clock.Clock
	Logger      hclog.Logger
	// Registry receives the coordinator's metrics; default a new one.
	Registry *prometheus.Registry
	// Leadership, when set, receives every leadership term's start (fence
	// raised, before the first sweep) and end (sweeping stopped); tests
	// wait on it. Nil in production.
	Leadership *testsignal.Signal[Leadership]
}

// Leadership is the start or end of one leadership term of one coordinator.
type Leadership struct {
	ID     string
	Leader bool // true: the term started; false: it ended
	Epoch  int64
	At     time.Time
}

// Coordinator elects a leader among coordinators; the leader runs the
// maintenance (sweeps, retention, schedules, the unhandled-kind rule).
// Every coordinator serves the API and status page.
type Coordinator struct {
	cfg     Config
	log     hclog.Logger
	clock   clock.Clock
	reg     *prometheus.Registry
	client  *tasks.Client
	sweepM  *sweeper.Metrics
	roster  *roster
	addr    string
	started chan struct{}

	counter   *counter
	elector   *elector
	unhandled *unhandledWatch

	retentionM *maintenance.RetentionMetrics
	reaperM    *maintenance.ReaperMetrics
	schedM     *schedule.Metrics
	schedules  *schedule.Client
	// schedWake wakes the leader's scheduler when this coordinator
	// creates a schedule.
	schedWake wake.Signal

	kindsMu sync.Mutex
	kinds   map[string]bool
	kindsAt time.Time
}

// WithDefaults returns c with its zero settings (and its sweeper's)
// replaced by the defaults, as New does.
func (c Config) WithDefaults() Config {
	c.ElectionTTL = cmp.Or(c.ElectionTTL, DefaultElectionTTL)
	c.HTTPAddr = cmp.Or(c.HTTPAddr, DefaultHTTPAddr)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, tasks.DefaultMaxAttempts)
	c.Sweep = c.Sweep.WithDefaults()
	c.Retention = c.Retention.WithDefaults()
	if c.Unhandled.After != 0 {
		c.Unhandled = c.Unhandled.WithDefaults()
	}
	return c
}

// Validate reports the first bad setting in one line naming its flag,
// before anything connects. It checks the settings as they are: a zero
// where New would put a default is an error, so that a flag given as 0 is
// refused rather than replaced (use WithDefaults for library defaults).
// Client and Store are New's business.
func (c Config) Validate() error {
	if err := shard.CheckName("--coordinator-id", c.ID); err != nil {
		return err
	}
	if !strings.HasPrefix(c.Prefix, "/") || !strings.HasSuffix(c.Prefix, "/") {
		return fmt.Errorf("--etcd-prefix: the key prefix must start and end with /, got %q", c.Prefix)
	}
	if err := shard.ValidateShardCount(c.ShardCount); err != nil {
		return err
	}
	if c.ElectionTTL < time.Second || c.ElectionTTL > MaxElectionTTL || c.ElectionTTL%time.Second != 0 {
		return fmt.Errorf("--election-ttl: must be a whole number of seconds from 1s to %s (nobody sweeps while a dead leader's session lives), got %s", MaxElectionTTL, c.ElectionTTL)
	}
	host, err := cli.CheckListenAddr("--http-addr", c.HTTPAddr)
	if err != nil {
		return err
	}
	if c.APIToken == "" && !cli.IsLoopback(host) {
		return fmt.Errorf("--api-token (SHARDRUN_API_TOKEN or SHARDRUN_API_TOKEN_FILE): required when --http-addr (%s) is not a loopback address", c.HTTPAddr)
	}
	if c.APIToken != "" {
		if err := httpauth.CheckToken(c.APIToken); err != nil {
			return fmt.Errorf("--api-token: %w", err)
		}
	}
	if err := tasks.ValidateMaxAttempts(c.MaxAttempts); err != nil {
		return err
	}
	if err := c.Retention.Validate(); err != nil {
		return err
	}
	if c.Unhandled.After != 0 {
		if err := c.Unhandled.Validate(); err != nil {
			return err
		}
	}
	return c.Sweep.Validate()
}

// New fills the defaults and validates cfg.
func New(cfg Config) (*Coordinator, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Client == nil || cfg.Store == nil {
		return nil, errors.New("coordinator: an etcd client and a store are required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real()
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
		cfg.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	client, err := tasks.NewClient(cfg.Store, tasks.ClientConfig{ShardCount: cfg.ShardCount, MaxAttempts: cfg.MaxAttempts, Clock: cfg.Clock})
	if err != nil {
		return nil, err
	}
	c := &Coordinator{cfg: cfg, log: cfg.Logger, clock: cfg.Clock, reg: cfg.Registry, client: client, started: make(chan struct{}),
		roster: newRoster(cfg.Client, cfg.Prefix, cfg.Clock, cfg.Logger.Named("roster"))}
	f := promauto.With(c.reg)
	c.counter = &counter{store: cfg.Store, clock: cfg.Clock, log: cfg.Logger,
		gauge: f.NewGaugeVec(prometheus.GaugeOpts{Name: "shardrun_tasks",
			Help: "Tasks by state (refreshed every few seconds)."}, []string{"state"})}
	c.elector = &elector{client: cfg.Client, key: cfg.Prefix + "coordinator/leader", id: cfg.ID, ttl: cfg.ElectionTTL,
		store: cfg.Store, clock: cfg.Clock, log: cfg.Logger, leadership: cfg.Leadership, lead: c.lead,
		isLeader: f.NewGauge(prometheus.GaugeOpts{Name: "shardrun_coordinator_is_leader",
			Help: "1 while this coordinator is the leader and sweeps."})}
	c.sweepM = sweeper.NewMetrics(c.reg)
	if err := c.maintenanceSetup(f); err != nil {
		return nil, err
	}
	return c, nil
}

// maintenanceSetup validates the maintenance settings now, not at the
// first leadership, and creates what every term shares.
func (c *Coordinator) maintenanceSetup(f promauto.Factory) error {
	rc := c.cfg.Retention
	rc.Store = c.cfg.Store
	if _, err := maintenance.NewRetainer(rc); err != nil {
		return err
	}
	if c.cfg.Unhandled.After != 0 {
		uc := c.cfg.Unhandled
		uc.Store, uc.Kinds = c.cfg.Store, c.handledKinds
		if _, err := maintenance.NewReaper(uc); err != nil {
			return err
		}
	}
	schc := c.cfg.Scheduler
	schc.Store, schc.ShardCount = c.cfg.Store, c.cfg.ShardCount
	if _, err := schedule.NewScheduler(schc); err != nil {
		return err
	}
	var err error
	c.schedules, err = schedule.NewClient(c.cfg.Store, schedule.ClientConfig{ShardCount: c.cfg.ShardCount,
		MaxAttempts: c.cfg.MaxAttempts})
	if err != nil {
		return err
	}
	c.schedWake = wake.New()
	c.retentionM = maintenance.NewRetentionMetrics(c.reg)
	c.reaperM = maintenance.NewReaperMetrics(c.reg)
	c.schedM = schedule.NewMetrics(c.reg)
	c.unhandled = &unhandledWatch{store: c.cfg.Store, kinds: c.handledKinds, clock: c.clock, log: c.log.Named("unhandled"),
		gauge: f.NewGaugeVec(prometheus.GaugeOpts{Name: "shardrun_unhandled_tasks",
			Help: "Ready tasks of kinds no attached runner handles, by kind (refreshed every few seconds)."}, []string{"kind"})}
	return nil
}

// IsLeader reports whether this coordinator leads now.
func (c *Coordinator) IsLeader() bool { return c.elector.leader.Load() }

// Counts returns the tasks by state, at most a second old.
func (c *Coordinator) Counts(ctx context.Context) (map[tasks.State]int64, error) {
	return c.counter.Counts(ctx)
}

// lead is the leader's work for one leadership term: the sweeper and the
// maintenance loops (retention, schedules, and the unhandled-kind rule
// when --unhandled-after is set), each fenced by epoch, until ctx ends
// (the term ends) or one of them finds the fence moved to a newer leader,
// which ends the others too.
func (c *Coordinator) lead(ctx context.Context, epoch int64) error {
	loops, err := c.leaderLoops(epoch)
	if err != nil {
		return err
	}
	lctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	for _, run := range loops {
		wg.Go(func() {
			if err := run(lctx); err != nil {
				cancel(err)
			}
		})
	}
	wg.Wait()
	if err := context.Cause(lctx); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// leaderLoops builds the leader's loops for one term.
func (c *Coordinator) leaderLoops(epoch int64) ([]func(context.Context) error, error) {
	sc := c.cfg.Sweep
	sc.Store, sc.Epoch, sc.Clock, sc.Metrics = c.cfg.Store, epoch, c.clock, c.sweepM
	if sc.Logger == nil {
		sc.Logger = c.log.Named("sweeper")
	}
	sw, err := sweeper.New(sc)
	if err != nil {
		return nil, err
	}
	rc := c.cfg.Retention
	rc.Store, rc.Epoch, rc.Clock, rc.Metrics = c.cfg.Store, epoch, c.clock, c.retentionM
	if rc.Logger == nil {
		rc.Logger = c.log.Named("retention")
	}
	ret, err := maintenance.NewRetainer(rc)
	if err != nil {
		return nil, err
	}
	schc := c.cfg.Scheduler
	schc.Store, schc.Epoch, schc.ShardCount, schc.MaxAttempts = c.cfg.Store, epoch, c.cfg.ShardCount, c.cfg.MaxAttempts
	schc.Clock, schc.Metrics, schc.Wake = c.clock, c.schedM, c.schedWake
	if schc.Logger == nil {
		schc.Logger = c.log.Named("scheduler")
	}
	sch, err := schedule.NewScheduler(schc)
	if err != nil {
		return nil, err
	}
	loops := []func(context.Context) error{sw.Run, ret.Run, sch.Run}
	if c.cfg.Unhandled.After > 0 {
		uc := c.cfg.Unhandled
		uc.Store, uc.Epoch, uc.Kinds, uc.Clock, uc.Metrics = c.cfg.Store, epoch, c.handledKinds, c.clock, c.reaperM
		if uc.Logger == nil {
			uc.Logger = c.log.Named("unhandled")
		}
		rp, err := maintenance.NewReaper(uc)
		if err != nil {
			return nil, err
		}
		loops = append(loops, rp.Run)
	}
	return loops, nil
}

// Addr is the bound HTTP address (after Started).
func (c *Coordinator) Addr() string { return c.addr }

// Started is closed once the HTTP server listens.
func (c *Coordinator) Started() <-chan struct{} { return c.started }

// Run serves HTTP and takes part in the election until ctx ends; the
// leader resigns on the way out.
func (c *Coordinator) Run(ctx context.Context) error {
	// The database first: a process with the wrong count must not create
	// the cluster's meta/shard-count in a fresh etcd.
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	created, err := c.cfg.Store.EnsureShardCount(cctx, c.cfg.ShardCount)
	cancel()
	if err != nil {
		return err
	}
	if created {
		c.log.Info("recorded the shard count in the database", "shard_count", c.cfg.ShardCount)
	}
	cctx, cancel = context.WithTimeout(ctx, 5*time.Second)
	created, err = shard.EnsureShardCount(cctx, c.cfg.Client, c.cfg.Prefix, c.cfg.ShardCount)
	cancel()
	if err != nil {
		return err
	}
	if created {
		c.log.Info("created cluster", "prefix", c.cfg.Prefix, "shard_count", c.cfg.ShardCount)
	}
	ln, err := net.Listen("tcp", c.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("--http-addr: listening on %s: %w", c.cfg.HTTPAddr, err)
	}
	c.addr = ln.Addr().String()
	srv := &http.Server{Handler: c.Handler(), ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: time.Minute}
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			c.log.Error("HTTP server stopped", "error", err)
		}
	})
	wg.Go(func() { c.counter.Run(ctx) })
	wg.Go(func() { c.roster.Run(ctx) })
	wg.Go(func() { c.unhandled.Run(ctx) })
	c.log.Info("coordinator started", "http", c.addr, "prefix", c.cfg.Prefix, "election_ttl", c.cfg.ElectionTTL)
	close(c.started)

	c.elector.Run(ctx)

	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	_ = srv.Shutdown(sctx)
	scancel()
	wg.Wait()
	c.log.Info("coordinator stopped")
	return nil
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
