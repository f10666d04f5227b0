// Package runner is the shardrun runner as a library: it connects to
// PostgreSQL and etcd, joins the cluster, executes the tasks of the shards it
// owns with the handlers you register, and serves the admin endpoint.
//
//	r, err := runner.New(cfg)
//	err = r.Handle("resize-image", func(ctx context.Context, t *tasks.Task) error { ... })
//	err = r.Run(ctx) // until ctx ends, then drains
package runner

import (
	"cmp"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Config is every setting of a runner. Each field has a flag and an
// environment variable in cmd/runner (named in the comments).
type Config struct {
	// EtcdEndpoints: --etcd-endpoints, SHARDRUN_ETCD_ENDPOINTS.
	EtcdEndpoints []string
	// EtcdPrefix and Cluster make the key prefix EtcdPrefix+Cluster+"/":
	// --etcd-prefix, SHARDRUN_ETCD_PREFIX; --cluster, SHARDRUN_CLUSTER.
	EtcdPrefix string
	Cluster    string
	// ShardCount: --shard-count, SHARDRUN_SHARD_COUNT.
	ShardCount int
	// DatabaseURL: --database-url, DATABASE_URL (or --database-url-file,
	// DATABASE_URL_FILE): the database named main, the one-database form
	// of Databases (listed first when both are given).
	DatabaseURL string
	// Databases are the cluster's databases by name, in the order given
	// (--database NAME=URL, --database-file NAME=PATH, SHARDRUN_DATABASES,
	// SHARDRUN_DATABASES_FILE): a new cluster spreads its shards over them
	// in contiguous ranges in this order; a process given a database its
	// cluster's map does not name, or missing one it names, stops.
	Databases []cli.Database
	// DBMaxConns: --db-max-conns, SHARDRUN_DB_MAX_CONNS.
	DBMaxConns int
	// AdminAddr and AdminToken: --admin-addr, SHARDRUN_ADMIN_ADDR;
	// --admin-token, SHARDRUN_ADMIN_TOKEN (or --admin-token-file,
	// SHARDRUN_ADMIN_TOKEN_FILE).
	AdminAddr  string
	AdminToken string
	// NoAdmin serves no admin endpoint (a runner embedded in a program,
	// the shardrun package, which has its own health checks); AdminAddr is
	// then not used. No flag sets it.
	NoAdmin bool
	// RunnerID: --runner-id, SHARDRUN_RUNNER_ID; default hostname-pid.
	RunnerID string
	// Lease and detachment: --lease-ttl, --detach-margin (0: TTL/3),
	// --keepalive-failures, --recovery-window.
	LeaseTTL          time.Duration
	DetachMargin      time.Duration
	KeepaliveFailures int
	RecoveryWindow    time.Duration
	// Execution: --heartbeat-interval, --poll-interval, --max-workers,
	// --handoff-timeout, --retry-base, --retry-cap.
	HeartbeatInterval time.Duration
	PollInterval      time.Duration
	MaxWorkers        int
	// Queues are the queues claimed from, each with the most of its tasks
	// that may run at once (0: up to MaxWorkers) (--queues). Default: the
	// default queue.
	Queues map[string]int
	// Kinds are the kinds of the registered handlers this runner handles
	// (--kinds); empty: all of them. Runners that serve the same queues
	// and handle the same kinds form a capability group, which owns its
	// own shards; a kind only some runners handle runs on those.
	Kinds          []string
	HandoffTimeout time.Duration
	RetryBase      time.Duration
	RetryCap       time.Duration
	// EtcdCA, EtcdCert and EtcdKey are PEM: the CA the etcd servers'
	// certificates are checked with (the system's roots when only a
	// certificate is given), and the client certificate and key of etcd's
	// mutual TLS. --etcd-ca, --etcd-cert, --etcd-key, each also from a file
	// (--etcd-ca-file, …; SHARDRUN_ETCD_CA, SHARDRUN_ETCD_CA_FILE, …). With
	// any of them the endpoints must be https.
	EtcdCA, EtcdCert, EtcdKey string
	// AdminCert and AdminKey are PEM: with them the admin endpoint serves
	// HTTPS. --admin-cert, --admin-key (or --admin-cert-file, …;
	// SHARDRUN_ADMIN_CERT, …).
	AdminCert, AdminKey string
	// Version is published in the runner's etcd key and /status.
	Version string
	// Logger is the root logger; default hclog at info on stderr.
	Logger hclog.Logger
	// Etcd, when set, is the etcd client the runner uses (with the TLS and
	// dial settings of the program that embeds it), and EtcdEndpoints is
	// not used; the runner does not close it. Give it gRPC keep-alives
	// (DialKeepAliveTime), so that a dead connection is noticed.
	Etcd *clientv3.Client
	// Store, when set, is the database the runner uses as the cluster's
	// one database, main (opened with the pool settings of the program
	// that embeds it), and DatabaseURL, Databases and DBMaxConns are not
	// used; the runner migrates it and does not close it.
	Store *store.Store
	// Router, when set, is the cluster's databases, joined to its map
	// already (the library's client: it migrated and registered them and
	// follows the map): the runner routes every statement through it and
	// neither closes it nor watches the map. Store and the database
	// settings are then not used.
	Router *store.Router
	// TracerProvider, when set, traces every claim, handler run and
	// outcome write (docs/reference.md, Traces); the handler's context carries its
	// span. Nil: tracing off, at no cost. cmd/runner sets it from the
	// OTEL_* environment.
	TracerProvider trace.TracerProvider
}

// DefaultAdminAddr is the default admin endpoint address.
const DefaultAdminAddr = "127.0.0.1:9090"

// DefaultConfig returns the defaults of every setting.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		EtcdEndpoints:     []string{cli.DefaultEtcdEndpoints},
		EtcdPrefix:        shard.DefaultEtcdPrefix,
		Cluster:           shard.DefaultCluster,
		ShardCount:        shard.DefaultShardCount,
		DBMaxConns:        store.DefaultMaxConns,
		AdminAddr:         DefaultAdminAddr,
		RunnerID:          fmt.Sprintf("%s-%d", host, os.Getpid()),
		LeaseTTL:          shard.DefaultLeaseTTL,
		KeepaliveFailures: shard.DefaultFailureThreshold,
		RecoveryWindow:    detach.DefaultRecoveryWindow,
		HeartbeatInterval: executor.DefaultHeartbeatInterval,
		PollInterval:      executor.DefaultPollInterval,
		MaxWorkers:        executor.DefaultMaxWorkers,
		HandoffTimeout:    shard.DefaultHandoffTimeout,
		RetryBase:         tasks.DefaultRetryBase,
		RetryCap:          tasks.DefaultRetryCap,
		Version:           "dev",
	}
}

// Prefix is the cluster's etcd key prefix.
func (c Config) Prefix() string { return c.EtcdPrefix + c.Cluster + "/" }

func (c Config) margin() time.Duration {
	if c.DetachMargin == 0 {
		return c.LeaseTTL / 3
	}
	return c.DetachMargin
}

// shardConfig is the shard manager's part of the configuration (Run adds
// the etcd client, the detach machine and what it learns on start).
func (c Config) shardConfig() shard.Config {
	return shard.Config{Prefix: c.Prefix(), RunnerID: c.RunnerID, Version: c.Version, ShardCount: c.ShardCount,
		LeaseTTL: c.LeaseTTL, DetachMargin: c.margin(), FailureThreshold: c.KeepaliveFailures, HandoffTimeout: c.HandoffTimeout}
}

func (c Config) detachConfig() detach.Config { return detach.Config{RecoveryWindow: c.RecoveryWindow} }

func (c Config) storeOptions() store.Options {
	return store.Options{MaxConns: c.DBMaxConns, ApplicationName: "shardrun-runner " + c.RunnerID, HandlerTxTimeout: max(c.LeaseTTL, 0)}
}

func (c Config) retryPolicy() tasks.RetryPolicy {
	return tasks.RetryPolicy{MaxAttempts: tasks.DefaultMaxAttempts, Base: c.RetryBase, Cap: c.RetryCap}
}

// queues are the queues served, each with its limit (the default queue
// alone when none is configured; a limit of 0 is --max-workers).
func (c Config) queues() map[string]int {
	if len(c.Queues) == 0 {
		return map[string]int{tasks.DefaultQueue: c.MaxWorkers}
	}
	queues := make(map[string]int, len(c.Queues))
	for name, limit := range c.Queues {
		queues[name] = cmp.Or(limit, c.MaxWorkers)
	}
	return queues
}

// executorConfig is the executor's part (Run adds the store, the ownership
// and the handlers). Handlers get the handoff timeout to notice their
// cancellation before they are reported stuck, and five seconds more at
// shutdown.
func (c Config) executorConfig() executor.Config {
	return executor.Config{RunnerID: c.RunnerID, Retry: c.retryPolicy(), MaxWorkers: c.MaxWorkers, Queues: c.queues(),
		HeartbeatInterval: c.HeartbeatInterval, PollInterval: c.PollInterval,
		ShutdownTimeout: c.HandoffTimeout + 5*time.Second, StuckAfter: c.HandoffTimeout, TracerProvider: c.TracerProvider}
}

// ParseQueues reads --queues: comma-separated queue names, each with an
// optional worker limit (name=N); a name without one may use every worker.
// At most executor.MaxQueues names.
func ParseQueues(spec string) (map[string]int, error) {
	queues := map[string]int{}
	for _, part := range strings.Split(spec, ",") {
		part = strings.TrimSpace(part)
		name, limit, hasLimit := strings.Cut(part, "=")
		if err := tasks.CheckQueue(name); err != nil {
			return nil, fmt.Errorf("--queues: %q: %w", part, err)
		}
		if _, dup := queues[name]; dup {
			return nil, fmt.Errorf("--queues: queue %s given twice", name)
		}
		n := 0
		if hasLimit {
			var err error
			if n, err = strconv.Atoi(limit); err != nil || n < 1 {
				return nil, fmt.Errorf("--queues: %q: the worker limit must be a positive number", part)
			}
		}
		queues[name] = n
		if len(queues) > executor.MaxQueues {
			return nil, fmt.Errorf("--queues: more than %d queues: every served queue is claimed on its own and published in the runner's etcd key; run more runners, each serving some of them", executor.MaxQueues)
		}
	}
	return queues, nil
}

// Validate reports the first bad setting in one line naming its flag,
// before anything connects. Each part is checked by the package that owns
// it (store, shard, detach, executor with its retry policy); the runner
// checks only what is its own: the database URL and the admin address and
// token.
func (c Config) Validate() error {
	if c.Etcd == nil {
		if err := cli.CheckEndpoints(c.EtcdEndpoints); err != nil {
			return err
		}
		if err := cli.CheckEtcdTLS(c.EtcdEndpoints, c.etcdTLS()); err != nil {
			return err
		}
	}
	if err := shard.CheckKeyPrefix(c.EtcdPrefix, c.Cluster); err != nil {
		return err
	}
	if c.Store == nil && c.Router == nil {
		if err := c.checkDatabases(); err != nil {
			return err
		}
	}
	if c.DetachMargin < 0 {
		return fmt.Errorf("--detach-margin: must not be negative (0 means --lease-ttl/3), got %s", c.DetachMargin)
	}
	sc := c.shardConfig()
	for _, v := range []interface{ Validate() error }{&sc, c.detachConfig(), c.executorConfig()} {
		if err := v.Validate(); err != nil {
			return err
		}
	}
	if c.NoAdmin {
		return nil
	}
	return c.adminServer().Check()
}

// databases are the databases the runner opens itself: --database-url's
// (main) first, then the named ones.
func (c Config) databases() ([]cli.Database, error) {
	return cli.DatabaseList(c.DatabaseURL, c.Databases)
}

// checkDatabases checks the settings of the databases the runner opens
// itself.
func (c Config) checkDatabases() error {
	return placement.CheckDatabases(c.DatabaseURL, c.Databases, c.storeOptions())
}

func (c Config) etcdTLS() cli.TLS {
	return cli.TLS{Flag: "--etcd", CA: c.EtcdCA, Cert: c.EtcdCert, Key: c.EtcdKey}
}

func (c Config) adminServer() cli.Server {
	return cli.Server{AddrFlag: "--admin-addr", Addr: c.AdminAddr, TokenFlag: "--admin-token", TokenVar: "SHARDRUN_ADMIN_TOKEN",
		Token: c.AdminToken, TLS: cli.TLS{Flag: "--admin", Cert: c.AdminCert, Key: c.AdminKey}}
}
