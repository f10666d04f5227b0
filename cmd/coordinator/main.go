// Command coordinator runs a shardrun coordinator: leader election among
// coordinators; the leader's sweeps, retention, schedule ticks and
// unhandled-kind rule; the cluster API and the status page. --embed-etcd runs a single-node etcd inside it; --dev runs a whole
// cluster on one machine (what `make demo` does). See --help.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/coordinator"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/maintenance"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
	"github.com/shardrun/shardrun/tasks"
)

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// options are the coordinator's flags.
type options struct {
	endpoints, prefix, cluster, databaseURL, httpAddr, apiToken, id   string
	shardCount, dbMaxConns, sweepBatch, maxAttempts                   int
	electionTTL, sweepInterval, staleThreshold, heartbeatInterval     time.Duration
	retryBase, retryCap                                               time.Duration
	retainCompleted, retainFailed, retentionInterval, unhandledAfter  time.Duration
	retentionBatch                                                    int
	embedDir, embedAddr, logLevel, logFormat                          string
	etcdCA, etcdCert, etcdKey, httpCert, httpKey, embedCert, embedKey string
	dev                                                               bool
	devRunners, devRate                                               int
	runnerBin                                                         string
	// databases are the named databases (--database, --database-file,
	// SHARDRUN_DATABASES, SHARDRUN_DATABASES_FILE), after databaseURL's
	// main; devDatabases is --dev-databases.
	databases    []cli.Database
	devDatabases int
	// tracerProvider traces the API's enqueues; nil: tracing off.
	tracerProvider trace.TracerProvider
	// warnings name the secrets given on the command line.
	warnings []string
}

// parse reads the flags, their variables and secret files (through
// readFile, which reads at most limit+1 bytes of a file), and validates
// everything before anything connects. Errors are one line naming the
// flag (exit status 2); cli.ErrHelp after --help.
func parse(args []string, getenv func(string) string, readFile func(string, int) ([]byte, error), stdout io.Writer) (options, error) {
	host, _ := os.Hostname()
	var o options
	fs := cli.NewFlagSet("coordinator", "coordinator: the shardrun coordinator — leader election, the sweeper, the cluster API and status page.\n\n"+
		"Usage: coordinator [flags]\n"+
		"       coordinator --dev          (a whole cluster on this machine: embedded etcd, a throwaway\n"+
		"                                   PostgreSQL, this coordinator, three runner processes, demo tasks)\n\n"+
		"Several coordinators may run; one is leader: it sweeps stale claims and missed deadlines, deletes\n"+
		"finished tasks after their retention and enqueues the ticks of schedules.\n"+
		"SIGTERM/SIGINT shuts down gracefully (the leader resigns); a second signal exits at once.\n\n"+
		"Secrets (--database-url, --database, --api-token) are best given by file (--database-url-file,\n"+
		"--database-file NAME=PATH, DATABASE_URL_FILE, …) or by the environment: the command line is readable\n"+
		"by every local user.\n\n"+
		"Several databases: --database NAME=URL for each (repeat it; --database-url URL is --database main=URL).\n"+
		"A new cluster spreads its shards over them in contiguous ranges, in the order given; a coordinator\n"+
		"given a database the cluster's map does not name, or missing one it names, stops saying which.")
	fs.String(&o.endpoints, "etcd-endpoints", "SHARDRUN_ETCD_ENDPOINTS", cli.DefaultEtcdEndpoints, fmt.Sprintf("comma-separated etcd client URLs, at most %d (ignored with --embed-etcd)", cli.MaxEndpoints))
	fs.EtcdTLSFlags(&o.etcdCA, &o.etcdCert, &o.etcdKey)
	fs.String(&o.prefix, "etcd-prefix", "SHARDRUN_ETCD_PREFIX", shard.DefaultEtcdPrefix, "etcd key prefix; the cluster's keys live under <prefix><cluster>/")
	fs.String(&o.cluster, "cluster", "SHARDRUN_CLUSTER", shard.DefaultCluster, "cluster name")
	fs.Int(&o.shardCount, "shard-count", "SHARDRUN_SHARD_COUNT", shard.DefaultShardCount, fmt.Sprintf("number of shards, 1 to %d; must match the cluster's (meta/shard-count)", shard.MaxShardCount))
	fs.Secret(&o.databaseURL, "database-url", "DATABASE_URL", "PostgreSQL URL of the database named main (this or --database is required, except with --dev)")
	fs.Databases(&o.databases)
	fs.Int(&o.dbMaxConns, "db-max-conns", "SHARDRUN_DB_MAX_CONNS", store.DefaultMaxConns, fmt.Sprintf("PostgreSQL pool size, %d to %d", store.MinMaxConns, store.MaxMaxConns))
	fs.String(&o.httpAddr, "http-addr", "SHARDRUN_HTTP_ADDR", coordinator.DefaultHTTPAddr, "address of the API, status page and metrics")
	fs.PEM(&o.httpCert, "http-cert", "SHARDRUN_HTTP_CERT", "PEM certificate: the API and status page are served over HTTPS (with --http-key)")
	fs.Secret(&o.httpKey, "http-key", "SHARDRUN_HTTP_KEY", "PEM private key of --http-cert")
	fs.Secret(&o.apiToken, "api-token", "SHARDRUN_API_TOKEN", "bearer token for every /api/tasks, /api/schedules, /api/queues and /api/sequences endpoint (enqueue, list, get, cancel, retry, schedules, queues); required when --http-addr is not loopback")
	fs.String(&o.id, "coordinator-id", "SHARDRUN_COORDINATOR_ID", fmt.Sprintf("%s-%d", host, os.Getpid()), "this coordinator's name in the election (default: <hostname>-<pid>)")
	fs.DynamicDefault("coordinator-id")
	fs.Duration(&o.electionTTL, "election-ttl", "SHARDRUN_ELECTION_TTL", coordinator.DefaultElectionTTL, "leader session TTL, whole seconds, 1s to 1h: a dead leader is replaced within about this long")
	fs.Duration(&o.sweepInterval, "sweep-interval", "SHARDRUN_SWEEP_INTERVAL", sweeper.DefaultInterval, "time between sweep passes, 10ms to 1h")
	fs.Duration(&o.staleThreshold, "stale-threshold", "SHARDRUN_STALE_THRESHOLD", sweeper.DefaultStaleThreshold, "a running task silent for longer is requeued (must exceed --heartbeat-interval; at most 24h)")
	fs.Duration(&o.heartbeatInterval, "heartbeat-interval", "SHARDRUN_HEARTBEAT_INTERVAL", claims.DefaultHeartbeatInterval, "the runners' task heartbeat interval (to check --stale-threshold against)")
	fs.Int(&o.sweepBatch, "sweep-batch", "SHARDRUN_SWEEP_BATCH", sweeper.DefaultBatchSize, fmt.Sprintf("rows one sweep statement may change, 1 to %d", sweeper.MaxBatchSize))
	fs.Duration(&o.retryBase, "retry-base", "SHARDRUN_RETRY_BASE", tasks.DefaultRetryBase, "backoff before a swept task's next attempt (doubles per attempt, with jitter), 1ms to 24h")
	fs.Duration(&o.retryCap, "retry-cap", "SHARDRUN_RETRY_CAP", tasks.DefaultRetryCap, "longest backoff, --retry-base to 24h")
	fs.Duration(&o.retainCompleted, "retain-completed", "SHARDRUN_RETAIN_COMPLETED", maintenance.DefaultRetainCompleted, "the leader deletes completed tasks this long after they finished; 0 keeps them forever")
	fs.Duration(&o.retainFailed, "retain-failed", "SHARDRUN_RETAIN_FAILED", maintenance.DefaultRetainFailed, "the leader deletes failed, dead and cancelled tasks this long after they finished; 0 keeps them forever")
	fs.Duration(&o.retentionInterval, "retention-interval", "SHARDRUN_RETENTION_INTERVAL", maintenance.DefaultRetentionInterval, "time between retention passes")
	fs.Int(&o.retentionBatch, "retention-batch", "SHARDRUN_RETENTION_BATCH", maintenance.DefaultRetentionBatch, "rows one retention statement may delete")
	fs.Duration(&o.unhandledAfter, "unhandled-after", "SHARDRUN_UNHANDLED_AFTER", 0, "fail ready tasks of a kind no attached runner has handled for this long (and due for this long); 0: they wait forever")
	fs.Int(&o.maxAttempts, "max-attempts", "SHARDRUN_MAX_ATTEMPTS", tasks.DefaultMaxAttempts, fmt.Sprintf("attempts for tasks enqueued without max_attempts, 1 to %d", tasks.MaxAttemptsLimit))
	fs.String(&o.embedDir, "embed-etcd", "SHARDRUN_EMBED_ETCD", "", "run a single-node etcd inside the coordinator with its data in this directory")
	fs.String(&o.embedAddr, "embed-etcd-addr", "SHARDRUN_EMBED_ETCD_ADDR", cli.DefaultEtcdAddr, "client address of the embedded etcd")
	fs.PEM(&o.embedCert, "embed-etcd-cert", "SHARDRUN_EMBED_ETCD_CERT", "PEM certificate: the embedded etcd serves TLS (with --embed-etcd-key); with --etcd-ca it requires client certificates that CA signed")
	fs.Secret(&o.embedKey, "embed-etcd-key", "SHARDRUN_EMBED_ETCD_KEY", "PEM private key of --embed-etcd-cert")
	fs.Bool(&o.dev, "dev", "", false, "all-in-one demo cluster on this machine; Ctrl-C stops and removes everything")
	fs.Int(&o.devRunners, "dev-runners", "", 3, fmt.Sprintf("--dev: runner processes to start, 1 to %d", maxDevRunners))
	fs.Int(&o.devRate, "dev-rate", "", 40, fmt.Sprintf("--dev: demo tasks enqueued per second, 0 to %d", maxDevRate))
	fs.Int(&o.devDatabases, "dev-databases", "", 1, fmt.Sprintf("--dev: databases of the demo cluster, 1 to %d (each a database of the throwaway PostgreSQL; make demo DATABASES=2)", maxDevDatabases))
	fs.String(&o.runnerBin, "runner-bin", "", "", "--dev: the runner binary (default: runner next to this binary)")
	fs.LogFlags(&o.logLevel, &o.logFormat)
	fs.ReadFile = readFile
	if err := fs.Parse(args, getenv, stdout); err != nil {
		return o, err
	}
	if o.dev {
		o.devDefaults(fs.Given)
	}
	if err := o.validate(); err != nil {
		return o, err
	}
	for _, name := range fs.SecretsOnCommandLine() {
		if name != "database-url" || store.HasPassword(o.databaseURL) {
			o.warnings = append(o.warnings, name)
		}
	}
	for _, d := range fs.DatabasesOnCommandLine() {
		if store.HasPassword(d.URL) {
			o.warnings = append(o.warnings, cli.DatabaseFlag)
			break
		}
	}
	return o, nil
}

func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	o, err := parse(args, getenv, cli.ReadFileLimited, stdout)
	if errors.Is(err, cli.ErrHelp) {
		return 0
	}
	var log hclog.Logger
	if err == nil {
		log, err = cli.NewLogger("coordinator", o.logLevel, o.logFormat, stderr)
	}
	if err != nil {
		fmt.Fprintf(stderr, "coordinator: %s\n", cli.OneLine(err))
		return 2
	}
	for _, name := range o.warnings {
		log.Warn("a secret was given on the command line, where every local user can read it (/proc/<pid>/cmdline); give it by file or environment instead",
			"flag", "--"+name, "instead", "--"+name+"-file")
	}
	// Traces are off unless the OTEL_* environment asks for them; the
	// buffered spans are flushed on the way out. The --dev runners inherit
	// the environment, so they trace (or not) alike.
	tp, err := tracing.FromEnv(context.Background(), "shardrun-coordinator", getenv)
	if err != nil {
		fmt.Fprintf(stderr, "coordinator: %s\n", cli.OneLine(err))
		return 2
	}
	defer tp.Close(log)
	if tp != nil {
		tracing.LogErrors(log.Named("tracing"))
		log.Info("tracing on: exporting spans over OTLP (OTEL_* environment)")
	}
	o.tracerProvider = tp.TracerProvider()
	ctx, stop := cli.SignalContext(log)
	defer stop()
	if o.dev {
		if err = runDev(ctx, o, log, stdout); err == nil {
			fmt.Fprintln(stdout, "shardrun demo stopped cleanly")
		}
	} else {
		err = serve(ctx, o, log, nil)
	}
	if err != nil {
		fmt.Fprintf(stderr, "coordinator: %s\n", cli.OneLine(err))
		var dbErr *placement.DatabasesError
		if errors.As(err, &dbErr) {
			return 2 // the databases are not the cluster's: a setting
		}
		return 1
	}
	return 0
}

// Bounds of the --dev flags: a demo on one machine.
const (
	maxDevRunners   = 64
	maxDevRate      = 10_000
	maxDevDatabases = 8
)

// config is the coordinator's configuration from the flags; serve adds the
// etcd client and the store.
func (o *options) config() coordinator.Config {
	return coordinator.Config{
		ID: o.id, Prefix: o.prefix + o.cluster + "/", ShardCount: o.shardCount,
		ElectionTTL: o.electionTTL, HTTPAddr: o.httpAddr, APIToken: o.apiToken, MaxAttempts: o.maxAttempts,
		HTTPCert: o.httpCert, HTTPKey: o.httpKey,
		Sweep: sweeper.Config{Interval: o.sweepInterval, StaleThreshold: o.staleThreshold,
			HeartbeatInterval: o.heartbeatInterval, BatchSize: o.sweepBatch,
			Backoff: store.Backoff{Base: o.retryBase, Cap: o.retryCap}},
		Retention: maintenance.RetentionConfig{RetainCompleted: o.retainCompleted, RetainFailed: o.retainFailed,
			KeepCompleted: o.retainCompleted == 0, KeepFailed: o.retainFailed == 0,
			Interval: o.retentionInterval, BatchSize: o.retentionBatch},
		Unhandled: maintenance.ReaperConfig{After: o.unhandledAfter},
	}
}

func (o *options) storeOptions() store.Options {
	return store.Options{MaxConns: o.dbMaxConns, ApplicationName: "shardrun-coordinator " + o.id, PlanEachExecution: true}
}

// validate checks every setting, each by the package that owns it, before
// anything connects or writes.
func (o *options) validate() error {
	if err := cli.CheckLogFlags(o.logLevel, o.logFormat); err != nil {
		return err
	}
	if !o.dev || o.databaseURL != "" || len(o.databases) > 0 {
		if err := placement.CheckDatabases(o.databaseURL, o.databases, o.storeOptions()); err != nil {
			return err
		}
	}
	if o.embedDir == "" && !o.dev {
		if err := cli.CheckEndpoints(cli.SplitList(o.endpoints)); err != nil {
			return err
		}
		if err := cli.CheckEtcdTLS(cli.SplitList(o.endpoints), o.etcdTLS()); err != nil {
			return err
		}
	}
	if _, err := o.etcdTLS().Client(); err != nil {
		return err
	}
	if o.embedCert != "" || o.embedKey != "" {
		if _, err := o.embedTLS().Server(); err != nil {
			return err
		}
	}
	if o.embedDir != "" {
		if _, port, err := net.SplitHostPort(o.embedAddr); err != nil {
			return fmt.Errorf("--embed-etcd-addr: must be host:port, got %q", o.embedAddr)
		} else if _, err := cli.Port(port, false); err != nil {
			return fmt.Errorf("--embed-etcd-addr: %q: %v", o.embedAddr, err)
		}
	}
	if err := shard.CheckKeyPrefix(o.prefix, o.cluster); err != nil {
		return err
	}
	if err := o.storeOptions().Validate(); err != nil {
		return err
	}
	if err := o.config().Validate(); err != nil {
		return err
	}
	switch {
	case o.devRunners < 1 || o.devRunners > maxDevRunners:
		return fmt.Errorf("--dev-runners: must be 1 to %d (processes on this machine), got %d", maxDevRunners, o.devRunners)
	case o.devRate < 0 || o.devRate > maxDevRate:
		return fmt.Errorf("--dev-rate: must be 0 to %d tasks per second, got %d", maxDevRate, o.devRate)
	case o.devDatabases < 1 || o.devDatabases > maxDevDatabases:
		return fmt.Errorf("--dev-databases: must be 1 to %d, got %d", maxDevDatabases, o.devDatabases)
	case o.dev && o.devDatabases > 1 && (o.databaseURL != "" || len(o.databases) > 0):
		return fmt.Errorf("--dev-databases: the demo makes its databases in its throwaway PostgreSQL; give --dev-databases or your own databases (--database-url, --database), not both")
	}
	return nil
}

func (o *options) etcdTLS() cli.TLS {
	return cli.TLS{Flag: "--etcd", CA: o.etcdCA, Cert: o.etcdCert, Key: o.etcdKey}
}

// embedTLS is the embedded etcd's server side: its certificate, and the
// CA its clients' certificates must be signed by (--etcd-ca).
func (o *options) embedTLS() cli.TLS {
	return cli.TLS{Flag: "--embed-etcd", CA: o.etcdCA, Cert: o.embedCert, Key: o.embedKey}
}

// serve runs the coordinator until ctx ends. ready, if not nil, receives
// the coordinator once it serves (the --dev mode uses it).
func serve(ctx context.Context, o options, log hclog.Logger, ready chan<- *coordinator.Coordinator) error {
	endpoints := cli.SplitList(o.endpoints)
	if o.embedDir != "" {
		srv, err := o.startEmbedded(ctx, log)
		if err != nil {
			return err
		}
		defer srv.Close()
		endpoints = srv.Endpoints()
	}
	tlsConfig, err := o.etcdTLS().Client()
	if err != nil {
		return err
	}
	etcd, err := cli.NewEtcdClient(endpoints, tlsConfig)
	if err != nil {
		return err
	}
	defer etcd.Close()
	prefix := o.prefix + o.cluster + "/"
	dbs, err := cli.DatabaseList(o.databaseURL, o.databases)
	if err != nil {
		return err
	}
	names := placement.Names(dbs)
	if err := placement.Precheck(ctx, etcd, prefix, names); err != nil {
		return err
	}
	stores, closeStores, err := placement.Open(ctx, dbs, o.storeOptions(), log)
	if err != nil {
		return err
	}
	defer closeStores()
	if err := placement.Prepare(ctx, names, stores, o.shardCount, placement.Where(dbs)); err != nil {
		return err
	}
	router, err := placement.Join(ctx, etcd, prefix, o.shardCount, names, stores, log)
	if err != nil {
		return err
	}
	defer router.Close() // its pings of a database that is down, and the stores
	cfg := o.config()
	cfg.Client, cfg.Router, cfg.Logger, cfg.TracerProvider = etcd, router, log, o.tracerProvider
	c, err := coordinator.New(cfg)
	if err != nil {
		return err
	}
	if ready != nil {
		go func() {
			select {
			case <-c.Started():
				ready <- c
			case <-ctx.Done():
			}
		}()
	}
	return c.Run(ctx)
}

// startEmbedded starts the --embed-etcd server, serving TLS with
// --embed-etcd-cert (and requiring client certificates signed by
// --etcd-ca when given). etcd reads its certificates from files: they are
// written into its data directory, readable by this user only.
func (o *options) startEmbedded(ctx context.Context, log hclog.Logger) (*embedetcd.Server, error) {
	if err := os.MkdirAll(o.embedDir, 0o700); err != nil {
		return nil, fmt.Errorf("--embed-etcd: creating %s: %w", o.embedDir, err)
	}
	dir, _ := filepath.Abs(o.embedDir)
	ec := embedetcd.Config{Dir: dir, ClientAddr: o.embedAddr, Logger: log.Named("etcd")}
	if o.embedCert != "" {
		files := map[string]string{"server.crt": o.embedCert, "server.key": o.embedKey, "client-ca.crt": o.etcdCA}
		for name, pem := range files {
			if pem == "" {
				continue
			}
			if err := os.WriteFile(filepath.Join(dir, name), []byte(pem), 0o600); err != nil {
				return nil, fmt.Errorf("--embed-etcd: writing %s: %w", name, err)
			}
		}
		ec.CertFile, ec.KeyFile = filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")
		if o.etcdCA != "" {
			ec.ClientCAFile = filepath.Join(dir, "client-ca.crt")
		}
	}
	srv, err := embedetcd.Start(ctx, ec)
	if err != nil {
		return nil, fmt.Errorf("--embed-etcd: %w", err)
	}
	log.Info("embedded etcd serving", "dir", dir, "endpoints", srv.Endpoints(), "tls", o.embedCert != "")
	return srv, nil
}
