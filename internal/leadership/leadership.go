// Package leadership is the cluster's leader, as one part a process runs:
// it campaigns in the coordinators' election (etcd's concurrency.Election
// under <prefix>coordinator/leader), raises the coordinator fence in
// each of the cluster's databases to each term's epoch, and while it
// leads runs the leader's services, one leader.Loop per database: the
// sweeps, retention and (with Unhandled.After) the unrunnable-work rule
// of that database, and in the first database (which holds the
// schedules) the schedules' ticks, each tick's task routed by its shard.
// A database that is down holds up only its own services: its fence is
// raised, and its loop started, once it answers.
//
// A coordinator process (internal/coordinator) runs one beside its API; a
// program using the library runs one with shardrun.Config.Leader. Both
// campaign in the same election, so at most one process of a cluster
// leads, and a deposed leader's statements apply nothing once the new
// leader has raised the fence.
package leadership

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/maintenance"
	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
	"github.com/shardrun/shardrun/tasks"
)

// DefaultElectionTTL is the default leader session TTL.
const DefaultElectionTTL = 10 * time.Second

// MaxElectionTTL bounds the election TTL: a leader that dies is replaced
// within about this long, and nobody sweeps meanwhile.
const MaxElectionTTL = time.Hour

// Key is the election's prefix under the cluster's prefix: every process
// that may lead a cluster campaigns under prefix+Key.
const Key = "coordinator/leader"

// Config is the leader's settings.
type Config struct {
	// ID names this process in the election and as the coordinator
	// fence's owner; required.
	ID string
	// Prefix is the cluster's key prefix, e.g. "/shardrun/default/".
	Prefix string
	// ShardCount is the cluster's: the schedules' ticks are enqueued on
	// its shards.
	ShardCount int
	// MaxAttempts for ticks of schedules that do not set one. Default
	// tasks.DefaultMaxAttempts.
	MaxAttempts int
	// ElectionTTL is the leader session's TTL, whole seconds: a leader
	// that dies is replaced within about this long. Default 10s.
	ElectionTTL time.Duration
	// Sweep is the settings of the leader's sweeps.
	Sweep sweeper.Config
	// Retention is the settings of the leader's deletion of finished
	// tasks; it runs unless both retentions are 0 (kept forever).
	Retention maintenance.RetentionConfig
	// Unhandled is the settings of the rule that fails ready tasks no
	// attached runner can run; it runs only when After is set.
	Unhandled maintenance.ReaperConfig
	Clock     clock.Clock
	Logger    hclog.Logger
}

// WithDefaults returns c with its zero settings (and its services')
// replaced by the defaults, as New does.
func (c Config) WithDefaults() Config {
	c.ElectionTTL = cmp.Or(c.ElectionTTL, DefaultElectionTTL)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, tasks.DefaultMaxAttempts)
	c.Sweep = c.Sweep.WithDefaults()
	c.Retention = c.Retention.WithDefaults()
	if c.Unhandled.After != 0 {
		c.Unhandled = c.Unhandled.WithDefaults()
	}
	return c
}

// Validate reports the first bad setting in one line naming its flag. It
// checks the settings as they are: a zero where New would put a default
// is an error (use WithDefaults for the defaults).
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
	if err := CheckElectionTTL("--election-ttl", c.ElectionTTL); err != nil {
		return err
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

// CheckElectionTTL checks an election TTL, naming it by name: whole
// seconds from 1s to MaxElectionTTL.
func CheckElectionTTL(name string, ttl time.Duration) error {
	if ttl < time.Second || ttl > MaxElectionTTL || ttl%time.Second != 0 {
		return fmt.Errorf("%s: must be a whole number of seconds from 1s to %s (nobody sweeps while a dead leader's session lives), got %s", name, MaxElectionTTL, ttl)
	}
	return nil
}

// Event is the start or end of one leadership term of one process, as
// tests see it.
type Event struct {
	ID     string
	Leader bool // true: the term started; false: it ended
	Epoch  int64
	At     time.Time
}

// Leader campaigns for the cluster's leadership and, in each term it
// wins, runs the leader's services under the term's epoch.
type Leader struct {
	// Terms and Passes, when set before Run, receive the start and end of
	// every term and every pass of every service; tests wait on them. Nil
	// in production.
	Terms  *testsignal.Signal[Event]
	Passes *testsignal.Signal[leader.Event]

	cfg       Config
	etcd      *clientv3.Client
	router    *store.Router
	databases []*database
	scheduler *schedule.Scheduler
	isLeader  prometheus.Gauge

	leader  atomic.Bool
	session atomic.Pointer[concurrency.Session]
}

// database is one database's part of the leader: its coordinator fence
// and its services, run by its own loop in each term.
type database struct {
	name  string
	store *store.Store
	loop  *leader.Loop
	log   hclog.Logger
	// raised is the epoch of the term whose fence is raised here (the
	// move driver waits for it at both of a move's databases).
	raised atomic.Int64
}

// New fills the defaults of cfg, validates it and builds the leader's
// services, each once, for every database of router (the cluster's, in
// its map's order), with their metrics registered with reg (nil: not
// registered) labelled with their database: the sweeper always,
// retention unless it keeps everything, the unrunnable rule when
// Unhandled.After is set, and the scheduler in the first database.
func New(etcd *clientv3.Client, router *store.Router, reg prometheus.Registerer, cfg Config) (*Leader, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if etcd == nil || router == nil {
		return nil, errors.New("leadership: an etcd client and the databases' router are required")
	}
	cfg.Clock = cmp.Or(cfg.Clock, clock.Real())
	cfg.Logger = cmp.Or(cfg.Logger, hclog.NewNullLogger())
	l := &Leader{cfg: cfg, etcd: etcd, router: router,
		isLeader: promauto.With(reg).NewGauge(prometheus.GaugeOpts{Name: "shardrun_coordinator_is_leader",
			Help: "1 while this process is the cluster's leader and sweeps."})}
	if cfg.Retention.Off() {
		cfg.Logger.Info("retention is off: finished tasks are kept forever")
	}
	for i, name := range router.Names() {
		st := router.Store(name)
		dreg := prometheus.WrapRegistererWith(prometheus.Labels{"database": name}, reg)
		services, err := l.services(st, i == 0, dreg)
		if err != nil {
			return nil, fmt.Errorf("the leader's services of database %s: %w", name, err)
		}
		log := cfg.Logger.With("database", name)
		l.databases = append(l.databases, &database{name: name, store: st, log: log,
			loop: leader.New(leader.Config{Clock: cfg.Clock, Logger: log, Registry: dreg}, services...)})
	}
	return l, nil
}

// services builds one database's services from their settings; the
// first database's include the scheduler, since it holds the schedules.
func (l *Leader) services(st *store.Store, first bool, reg prometheus.Registerer) ([]leader.Service, error) {
	cfg := l.cfg
	sw, err := sweeper.New(st, cfg.Sweep, reg)
	if err != nil {
		return nil, err
	}
	services := []leader.Service{sw}
	if first {
		// The schedules live in the first database; each tick's task is
		// enqueued in its shard's database through the router.
		prep := client.Config{ShardCount: cfg.ShardCount, MaxAttempts: cfg.MaxAttempts, Clock: cfg.Clock}
		if l.scheduler, err = schedule.NewScheduler(l.router, prep, reg); err != nil {
			return nil, err
		}
		services = append(services, l.scheduler)
	}
	if !cfg.Retention.Off() {
		ret, err := maintenance.NewRetainer(st, cfg.Retention, reg)
		if err != nil {
			return nil, err
		}
		services = append(services, ret)
	}
	if cfg.Unhandled.After > 0 {
		caps := &shard.Capabilities{Client: l.etcd, Prefix: cfg.Prefix, Clock: cfg.Clock}
		rp, err := maintenance.NewReaper(st, caps.Runnable, cfg.Unhandled, reg)
		if err != nil {
			return nil, err
		}
		services = append(services, rp)
	}
	return services, nil
}

// IsLeader reports whether this process leads now.
func (l *Leader) IsLeader() bool { return l.leader.Load() }

// Scheduler is the leader's schedule service: a schedule created or
// changed in this process wakes it (Notify).
func (l *Leader) Scheduler() *schedule.Scheduler { return l.scheduler }

// Session is the election session of the current campaign or term (nil
// between two), for tests that revoke it.
func (l *Leader) Session() *concurrency.Session { return l.session.Load() }

// Run campaigns until ctx ends, leading in every term it wins; the leader
// resigns on the way out. It returns when every goroutine it started has
// ended.
func (l *Leader) Run(ctx context.Context) {
	for _, db := range l.databases {
		db.loop.Events = l.Passes
	}
	l.campaign(ctx)
}
