// Command runner is a shardrun runner: it joins the cluster through etcd,
// executes the tasks of the shards it owns, and serves its admin endpoint.
// See --help for every flag and its environment variable.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/runner"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	cfg := runner.DefaultConfig()
	cfg.Version = version
	var endpoints, logLevel, logFormat string
	fs := cli.NewFlagSet("runner", "runner: a shardrun runner — executes the tasks of the shards it owns.\n\n"+
		"Usage: runner [flags]\n\n"+
		"The runner holds an etcd lease, owns a balanced share of the cluster's shards, and runs\n"+
		"their tasks from PostgreSQL. It detaches (stops all work) when it cannot prove its lease,\n"+
		"and drains on SIGTERM/SIGINT (a second signal exits at once). Built-in task kinds:\n"+
		"noop, sleep {\"ms\": N}, fail {\"times\": N}.")
	fs.String(&endpoints, "etcd-endpoints", "SHARDRUN_ETCD_ENDPOINTS", "http://127.0.0.1:2379", "comma-separated etcd client URLs")
	fs.String(&cfg.EtcdPrefix, "etcd-prefix", "SHARDRUN_ETCD_PREFIX", cfg.EtcdPrefix, "etcd key prefix; the cluster's keys live under <prefix><cluster>/")
	fs.String(&cfg.Cluster, "cluster", "SHARDRUN_CLUSTER", cfg.Cluster, "cluster name")
	fs.Int(&cfg.ShardCount, "shard-count", "SHARDRUN_SHARD_COUNT", cfg.ShardCount, "number of shards; must match the cluster's (written once to meta/shard-count)")
	fs.String(&cfg.DatabaseURL, "database-url", "DATABASE_URL", "", "PostgreSQL URL, e.g. postgres://user:pass@host:5432/db (required)")
	fs.Int(&cfg.DBMaxConns, "db-max-conns", "SHARDRUN_DB_MAX_CONNS", cfg.DBMaxConns, "PostgreSQL pool size")
	fs.String(&cfg.AdminAddr, "admin-addr", "SHARDRUN_ADMIN_ADDR", cfg.AdminAddr, "admin HTTP address (healthz, readyz, status, metrics, admin/detach, admin/attach)")
	fs.String(&cfg.AdminToken, "admin-token", "SHARDRUN_ADMIN_TOKEN", "", "bearer token for POST /admin/*; required when --admin-addr is not loopback")
	fs.String(&cfg.RunnerID, "runner-id", "SHARDRUN_RUNNER_ID", cfg.RunnerID, "unique runner id (default: <hostname>-<pid>)")
	fs.DynamicDefault("runner-id")
	fs.Duration(&cfg.LeaseTTL, "lease-ttl", "SHARDRUN_LEASE_TTL", cfg.LeaseTTL, "etcd lease TTL, whole seconds")
	fs.Duration(&cfg.DetachMargin, "detach-margin", "SHARDRUN_DETACH_MARGIN", 0, "detach this long before the lease deadline (0 means lease-ttl/3)")
	fs.Int(&cfg.KeepaliveFailures, "keepalive-failures", "SHARDRUN_KEEPALIVE_FAILURES", cfg.KeepaliveFailures, "consecutive failed keep-alives that detach the runner")
	fs.Duration(&cfg.RecoveryWindow, "recovery-window", "SHARDRUN_RECOVERY_WINDOW", cfg.RecoveryWindow, "continuous health needed before re-attaching")
	fs.Duration(&cfg.HeartbeatInterval, "heartbeat-interval", "SHARDRUN_HEARTBEAT_INTERVAL", cfg.HeartbeatInterval, "interval between heartbeats of running tasks (keep below the coordinator's --stale-threshold)")
	fs.Duration(&cfg.PollInterval, "poll-interval", "SHARDRUN_POLL_INTERVAL", cfg.PollInterval, "claim poll interval when no notification arrives")
	fs.Int(&cfg.MaxWorkers, "max-workers", "SHARDRUN_MAX_WORKERS", cfg.MaxWorkers, "tasks running at once")
	fs.Duration(&cfg.HandoffTimeout, "handoff-timeout", "SHARDRUN_HANDOFF_TIMEOUT", cfg.HandoffTimeout, "how long a moving shard's running tasks may finish before they are cancelled")
	fs.Duration(&cfg.RetryBase, "retry-base", "SHARDRUN_RETRY_BASE", cfg.RetryBase, "backoff after a task's first failed attempt (doubles per attempt, with jitter)")
	fs.Duration(&cfg.RetryCap, "retry-cap", "SHARDRUN_RETRY_CAP", cfg.RetryCap, "longest backoff between attempts")
	fs.LogFlags(&logLevel, &logFormat)
	// Exit codes: 2 for bad flags or settings, 1 for a failure while running.
	fail := func(err error, code int) int {
		fmt.Fprintf(stderr, "runner: %s\n", cli.OneLine(err))
		return code
	}
	if err := fs.Parse(args, getenv, stdout); err != nil {
		if errors.Is(err, cli.ErrHelp) {
			return 0
		}
		return fail(err, 2)
	}
	cfg.EtcdEndpoints = cli.SplitList(endpoints)
	log, err := cli.NewLogger("runner", logLevel, logFormat, stderr)
	if err != nil {
		return fail(err, 2)
	}
	cfg.Logger = log
	r, err := runner.New(cfg)
	if err != nil {
		return fail(err, 2)
	}
	if err := r.HandleBuiltins(); err != nil {
		return fail(err, 2)
	}
	ctx, stop := cli.SignalContext(log)
	defer stop()
	if err := r.Run(ctx); err != nil {
		return fail(err, 1)
	}
	return 0
}
