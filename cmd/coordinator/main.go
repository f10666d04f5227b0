// Command coordinator runs a shardrun coordinator: leader election among
// coordinators, the sweeper (leader only), the cluster API and the status
// page. --embed-etcd runs a single-node etcd inside it; --dev runs a whole
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
	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/coordinator"
	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
	"github.com/shardrun/shardrun/tasks"
)

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// options are the coordinator's flags.
type options struct {
	endpoints, prefix, cluster, databaseURL, httpAddr, apiToken, id string
	shardCount, dbMaxConns, sweepBatch, maxAttempts                 int
	electionTTL, sweepInterval, staleThreshold, heartbeatInterval   time.Duration
	retryBase, retryCap                                             time.Duration
	embedDir, embedAddr, logLevel, logFormat                        string
	dev                                                             bool
	devRunners, devRate                                             int
	runnerBin                                                       string
}

func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	host, _ := os.Hostname()
	var o options
	fs := cli.NewFlagSet("coordinator", "coordinator: the shardrun coordinator — leader election, the sweeper, the cluster API and status page.\n\n"+
		"Usage: coordinator [flags]\n"+
		"       coordinator --dev          (a whole cluster on this machine: embedded etcd, a throwaway\n"+
		"                                   PostgreSQL, this coordinator, three runner processes, demo tasks)\n\n"+
		"Several coordinators may run; one is leader and sweeps stale claims and missed deadlines.\n"+
		"SIGTERM/SIGINT shuts down gracefully (the leader resigns); a second signal exits at once.")
	fs.String(&o.endpoints, "etcd-endpoints", "SHARDRUN_ETCD_ENDPOINTS", "http://127.0.0.1:2379", "comma-separated etcd client URLs (ignored with --embed-etcd)")
	fs.String(&o.prefix, "etcd-prefix", "SHARDRUN_ETCD_PREFIX", "/shardrun/", "etcd key prefix; the cluster's keys live under <prefix><cluster>/")
	fs.String(&o.cluster, "cluster", "SHARDRUN_CLUSTER", "default", "cluster name")
	fs.Int(&o.shardCount, "shard-count", "SHARDRUN_SHARD_COUNT", 256, "number of shards; must match the cluster's (meta/shard-count)")
	fs.String(&o.databaseURL, "database-url", "DATABASE_URL", "", "PostgreSQL URL (required, except with --dev)")
	fs.Int(&o.dbMaxConns, "db-max-conns", "SHARDRUN_DB_MAX_CONNS", 8, "PostgreSQL pool size")
	fs.String(&o.httpAddr, "http-addr", "SHARDRUN_HTTP_ADDR", "127.0.0.1:8080", "address of the API, status page and metrics")
	fs.String(&o.apiToken, "api-token", "SHARDRUN_API_TOKEN", "", "bearer token for POST /api/tasks; required when --http-addr is not loopback")
	fs.String(&o.id, "coordinator-id", "SHARDRUN_COORDINATOR_ID", fmt.Sprintf("%s-%d", host, os.Getpid()), "this coordinator's name in the election (default: <hostname>-<pid>)")
	fs.DynamicDefault("coordinator-id")
	fs.Duration(&o.electionTTL, "election-ttl", "SHARDRUN_ELECTION_TTL", coordinator.DefaultElectionTTL, "leader session TTL, whole seconds: a dead leader is replaced within about this long")
	fs.Duration(&o.sweepInterval, "sweep-interval", "SHARDRUN_SWEEP_INTERVAL", sweeper.DefaultInterval, "time between sweep passes")
	fs.Duration(&o.staleThreshold, "stale-threshold", "SHARDRUN_STALE_THRESHOLD", sweeper.DefaultStaleThreshold, "a running task silent for longer is requeued (must exceed --heartbeat-interval)")
	fs.Duration(&o.heartbeatInterval, "heartbeat-interval", "SHARDRUN_HEARTBEAT_INTERVAL", sweeper.DefaultHeartbeatInterval, "the runners' task heartbeat interval (to check --stale-threshold against)")
	fs.Int(&o.sweepBatch, "sweep-batch", "SHARDRUN_SWEEP_BATCH", sweeper.DefaultBatchSize, "rows one sweep statement may change")
	fs.Duration(&o.retryBase, "retry-base", "SHARDRUN_RETRY_BASE", tasks.DefaultRetryBase, "backoff before a swept task's next attempt (doubles per attempt, with jitter)")
	fs.Duration(&o.retryCap, "retry-cap", "SHARDRUN_RETRY_CAP", tasks.DefaultRetryCap, "longest backoff")
	fs.Int(&o.maxAttempts, "max-attempts", "SHARDRUN_MAX_ATTEMPTS", tasks.DefaultMaxAttempts, "attempts for tasks enqueued without max_attempts")
	fs.String(&o.embedDir, "embed-etcd", "SHARDRUN_EMBED_ETCD", "", "run a single-node etcd inside the coordinator with its data in this directory")
	fs.String(&o.embedAddr, "embed-etcd-addr", "SHARDRUN_EMBED_ETCD_ADDR", "127.0.0.1:2379", "client address of the embedded etcd")
	fs.Bool(&o.dev, "dev", "", false, "all-in-one demo cluster on this machine; Ctrl-C stops and removes everything")
	fs.Int(&o.devRunners, "dev-runners", "", 3, "--dev: runner processes to start")
	fs.Int(&o.devRate, "dev-rate", "", 40, "--dev: demo tasks enqueued per second")
	fs.String(&o.runnerBin, "runner-bin", "", "", "--dev: the runner binary (default: runner next to this binary)")
	fs.LogFlags(&o.logLevel, &o.logFormat)
	if err := fs.Parse(args, getenv, stdout); err != nil {
		if errors.Is(err, cli.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "coordinator: %s\n", cli.OneLine(err))
		return 2
	}
	if o.dev {
		o.devDefaults(fs.Given)
	}
	log, err := cli.NewLogger("coordinator", o.logLevel, o.logFormat, stderr)
	if err == nil {
		err = o.validate()
	}
	if err != nil {
		fmt.Fprintf(stderr, "coordinator: %s\n", cli.OneLine(err))
		return 2
	}
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
		return 1
	}
	return 0
}

func (o *options) validate() error {
	if !o.dev && o.databaseURL == "" {
		return errors.New("--database-url (DATABASE_URL): required, e.g. postgres://user:pass@host:5432/db")
	}
	if o.databaseURL != "" {
		if _, err := pgx.ParseConfig(o.databaseURL); err != nil {
			return fmt.Errorf("--database-url (DATABASE_URL): malformed: %s", cli.OneLine(err))
		}
	}
	host, _, err := net.SplitHostPort(o.httpAddr)
	if err != nil {
		return fmt.Errorf("--http-addr: must be host:port, got %q", o.httpAddr)
	}
	if ip := net.ParseIP(host); o.apiToken == "" && host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return fmt.Errorf("--api-token (SHARDRUN_API_TOKEN): required when --http-addr (%s) is not a loopback address", o.httpAddr)
	}
	if o.embedDir == "" && !o.dev {
		if err := cli.CheckEndpoints(cli.SplitList(o.endpoints)); err != nil {
			return err
		}
	}
	switch {
	case o.devRunners < 1:
		return fmt.Errorf("--dev-runners: must be at least 1, got %d", o.devRunners)
	case o.devRate < 0:
		return fmt.Errorf("--dev-rate: must not be negative, got %d", o.devRate)
	}
	return nil
}

// serve runs the coordinator until ctx ends. ready, if not nil, receives
// the coordinator once it serves (the --dev mode uses it).
func serve(ctx context.Context, o options, log hclog.Logger, ready chan<- *coordinator.Coordinator) error {
	endpoints := cli.SplitList(o.endpoints)
	if o.embedDir != "" {
		if err := os.MkdirAll(o.embedDir, 0o700); err != nil {
			return fmt.Errorf("--embed-etcd: creating %s: %w", o.embedDir, err)
		}
		dir, _ := filepath.Abs(o.embedDir)
		srv, err := embedetcd.Start(ctx, embedetcd.Config{Dir: dir, ClientAddr: o.embedAddr, Logger: log.Named("etcd")})
		if err != nil {
			return fmt.Errorf("--embed-etcd: %w", err)
		}
		defer srv.Close()
		endpoints = srv.Endpoints()
		log.Info("embedded etcd serving", "dir", dir, "endpoints", endpoints)
	}
	st, err := store.Open(ctx, o.databaseURL, store.Options{MaxConns: int32(o.dbMaxConns),
		ApplicationName: "shardrun-coordinator " + o.id, Logger: log.Named("store")})
	if err != nil {
		return fmt.Errorf("--database-url (DATABASE_URL): %w", err)
	}
	defer st.Close()
	if err := st.Migrate(ctx); err != nil {
		return fmt.Errorf("--database-url (DATABASE_URL): %w", err)
	}
	etcd, err := cli.NewEtcdClient(endpoints)
	if err != nil {
		return err
	}
	defer etcd.Close()
	c, err := coordinator.New(coordinator.Config{
		ID: o.id, Client: etcd, Prefix: o.prefix + o.cluster + "/", ShardCount: o.shardCount, Store: st,
		ElectionTTL: o.electionTTL, HTTPAddr: o.httpAddr, APIToken: o.apiToken, MaxAttempts: o.maxAttempts,
		Sweep: sweeper.Config{Interval: o.sweepInterval, StaleThreshold: o.staleThreshold,
			HeartbeatInterval: o.heartbeatInterval, BatchSize: o.sweepBatch,
			Backoff: store.Backoff{Base: o.retryBase, Cap: o.retryCap}},
		Logger: log,
	})
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
