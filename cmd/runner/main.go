// Command runner is a shardrun runner: it joins the cluster through etcd,
// executes the tasks of the shards it owns, and serves its admin endpoint.
// See --help for every flag and its environment variable.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// settings is what the command line and the environment say, validated.
type settings struct {
	cfg                 runner.Config
	logLevel, logFormat string
	// warnings are said once the logger exists (secrets on the command
	// line).
	warnings []string
}

// parse reads the flags, their variables and secret files (through
// readFile, which reads at most limit+1 bytes of a file), and validates
// everything before anything connects. Errors are one line naming the
// flag (exit status 2); cli.ErrHelp after --help.
func parse(args []string, getenv func(string) string, readFile func(string, int) ([]byte, error), stdout io.Writer) (settings, error) {
	s := settings{cfg: runner.DefaultConfig()}
	cfg := &s.cfg
	cfg.Version = version
	var endpoints, queues, kinds string
	fs := cli.NewFlagSet("runner", "runner: a shardrun runner — executes the tasks of the shards it owns.\n\n"+
		"Usage: runner [flags]\n\n"+
		"The runner holds an etcd lease, owns a balanced share of the cluster's shards, and runs\n"+
		"their tasks from PostgreSQL. It detaches (stops all work) when it cannot prove its lease,\n"+
		"and drains on SIGTERM/SIGINT (a second signal exits at once). Built-in task kinds:\n"+
		"noop, sleep {\"ms\": N}, fail {\"times\": N}.\n\n"+
		"Secrets (--database-url, --database, --admin-token) are best given by file (--database-url-file,\n"+
		"--database-file NAME=PATH, DATABASE_URL_FILE, …) or by the environment: the command line is readable\n"+
		"by every local user.\n\n"+
		"Several databases: --database NAME=URL for each (repeat it; --database-url URL is --database main=URL).\n"+
		"A new cluster spreads its shards over them in contiguous ranges, in the order given; a runner given a\n"+
		"database the cluster's map does not name, or missing one it names, stops saying which.")
	fs.String(&endpoints, "etcd-endpoints", "SHARDRUN_ETCD_ENDPOINTS", cli.DefaultEtcdEndpoints, fmt.Sprintf("comma-separated etcd client URLs (at most %d)", cli.MaxEndpoints))
	fs.EtcdTLSFlags(&cfg.EtcdCA, &cfg.EtcdCert, &cfg.EtcdKey)
	fs.PEM(&cfg.AdminCert, "admin-cert", "SHARDRUN_ADMIN_CERT", "PEM certificate: the admin endpoint serves HTTPS (with --admin-key)")
	fs.Secret(&cfg.AdminKey, "admin-key", "SHARDRUN_ADMIN_KEY", "PEM private key of --admin-cert")
	fs.String(&cfg.EtcdPrefix, "etcd-prefix", "SHARDRUN_ETCD_PREFIX", cfg.EtcdPrefix, "etcd key prefix; the cluster's keys live under <prefix><cluster>/")
	fs.String(&cfg.Cluster, "cluster", "SHARDRUN_CLUSTER", cfg.Cluster, "cluster name")
	fs.Int(&cfg.ShardCount, "shard-count", "SHARDRUN_SHARD_COUNT", cfg.ShardCount, "number of shards, 1 to 16384; must match the cluster's (written once to meta/shard-count)")
	fs.Secret(&cfg.DatabaseURL, "database-url", "DATABASE_URL", "PostgreSQL URL of the database named main, e.g. postgres://user:pass@host:5432/db (this or --database is required)")
	fs.Databases(&cfg.Databases)
	fs.Int(&cfg.DBMaxConns, "db-max-conns", "SHARDRUN_DB_MAX_CONNS", cfg.DBMaxConns, "PostgreSQL pool size, 2 to 1000")
	fs.String(&cfg.AdminAddr, "admin-addr", "SHARDRUN_ADMIN_ADDR", cfg.AdminAddr, "admin HTTP address (healthz, readyz, status, metrics, admin/detach, admin/attach)")
	fs.Secret(&cfg.AdminToken, "admin-token", "SHARDRUN_ADMIN_TOKEN", "bearer token for POST /admin/*; required when --admin-addr is not loopback")
	fs.String(&cfg.RunnerID, "runner-id", "SHARDRUN_RUNNER_ID", cfg.RunnerID, "unique runner id (default: <hostname>-<pid>)")
	fs.DynamicDefault("runner-id")
	fs.Duration(&cfg.LeaseTTL, "lease-ttl", "SHARDRUN_LEASE_TTL", cfg.LeaseTTL, "etcd lease TTL, whole seconds, 1s to 1h")
	fs.Duration(&cfg.DetachMargin, "detach-margin", "SHARDRUN_DETACH_MARGIN", 0, "detach this long before the lease deadline (default: lease-ttl/3)")
	fs.DynamicDefault("detach-margin")
	fs.Int(&cfg.KeepaliveFailures, "keepalive-failures", "SHARDRUN_KEEPALIVE_FAILURES", cfg.KeepaliveFailures, "detach when no keep-alive succeeded for this many periods of lease-ttl/3, 1 to 100")
	fs.Duration(&cfg.RecoveryWindow, "recovery-window", "SHARDRUN_RECOVERY_WINDOW", cfg.RecoveryWindow, "continuous health needed before re-attaching, 0 to 1h")
	fs.Duration(&cfg.HeartbeatInterval, "heartbeat-interval", "SHARDRUN_HEARTBEAT_INTERVAL", cfg.HeartbeatInterval, "interval between heartbeats of running tasks, 10ms to 1h (keep below the coordinator's --stale-threshold)")
	fs.Duration(&cfg.PollInterval, "poll-interval", "SHARDRUN_POLL_INTERVAL", cfg.PollInterval, "claim poll interval when no notification arrives, 10ms to 1h")
	fs.Int(&cfg.MaxWorkers, "max-workers", "SHARDRUN_MAX_WORKERS", cfg.MaxWorkers, fmt.Sprintf("tasks running at once, 1 to %d", executor.MaxMaxWorkers))
	fs.String(&queues, "queues", "SHARDRUN_QUEUES", tasks.DefaultQueue, "queues to claim from, comma-separated, each with an optional limit of its tasks running at once (emails=8), at most "+strconv.Itoa(executor.MaxQueues)+"; --max-workers bounds them all")
	fs.String(&kinds, "kinds", "SHARDRUN_KINDS", "", "task kinds to handle, comma-separated, of this binary's (noop, sleep, fail); default all")
	fs.Duration(&cfg.HandoffTimeout, "handoff-timeout", "SHARDRUN_HANDOFF_TIMEOUT", cfg.HandoffTimeout, "how long a moving shard's running tasks may finish before they are cancelled, up to 1h")
	fs.Duration(&cfg.RetryBase, "retry-base", "SHARDRUN_RETRY_BASE", cfg.RetryBase, "backoff after a task's first failed attempt (doubles per attempt, with jitter), 1ms to 24h")
	fs.Duration(&cfg.RetryCap, "retry-cap", "SHARDRUN_RETRY_CAP", cfg.RetryCap, "longest backoff between attempts, --retry-base to 24h")
	fs.LogFlags(&s.logLevel, &s.logFormat)
	fs.ReadFile = readFile
	if err := fs.Parse(args, getenv, stdout); err != nil {
		return s, err
	}
	cfg.EtcdEndpoints = cli.SplitList(endpoints)
	var err error
	if cfg.Queues, err = runner.ParseQueues(queues); err != nil {
		return s, err
	}
	if fs.Given("kinds") {
		if cfg.Kinds, err = parseKinds(kinds); err != nil {
			return s, err
		}
	}
	// 0 is not a margin: it would stop work at the very deadline. Left
	// out, the margin is lease-ttl/3.
	if fs.Given("detach-margin") && cfg.DetachMargin == 0 {
		return s, fmt.Errorf("--detach-margin: must be positive (leave it out for --lease-ttl/3), got 0s")
	}
	if err := cli.CheckLogFlags(s.logLevel, s.logFormat); err != nil {
		return s, err
	}
	if err := cfg.Validate(); err != nil {
		return s, err
	}
	s.warnings = secretWarnings(fs, cfg.DatabaseURL)
	return s, nil
}

// secretWarnings says which secrets were given on the command line: a
// database URL only when it holds a password.
func secretWarnings(fs *cli.FlagSet, databaseURL string) []string {
	var out []string
	for _, name := range fs.SecretsOnCommandLine() {
		if name == "database-url" && !store.HasPassword(databaseURL) {
			continue // a URL without a password is no secret
		}
		out = append(out, name)
	}
	for _, d := range fs.DatabasesOnCommandLine() {
		if store.HasPassword(d.URL) {
			out = append(out, cli.DatabaseFlag)
			break
		}
	}
	return out
}

func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	// Exit codes: 2 for bad flags or settings, 1 for a failure while running.
	fail := func(err error, code int) int {
		fmt.Fprintf(stderr, "runner: %s\n", cli.OneLine(err))
		return code
	}
	s, err := parse(args, getenv, cli.ReadFileLimited, stdout)
	if err != nil {
		if errors.Is(err, cli.ErrHelp) {
			return 0
		}
		return fail(err, 2)
	}
	log, err := cli.NewLogger("runner", s.logLevel, s.logFormat, stderr)
	if err != nil {
		return fail(err, 2)
	}
	warnSecrets(log, s.warnings)
	s.cfg.Logger = log
	// Traces are off unless the OTEL_* environment asks for them; the
	// buffered spans are flushed on the way out.
	tp, err := tracing.FromEnv(context.Background(), "shardrun-runner", getenv)
	if err != nil {
		return fail(err, 2)
	}
	defer tp.Close(log)
	if tp != nil {
		tracing.LogErrors(log.Named("tracing"))
		log.Info("tracing on: exporting spans over OTLP (OTEL_* environment)")
	}
	s.cfg.TracerProvider = tp.TracerProvider()
	r, err := runner.New(s.cfg)
	if err != nil {
		return fail(err, 2)
	}
	if err := r.HandleBuiltins(); err != nil {
		return fail(err, 2)
	}
	ctx, stop := cli.SignalContext(log)
	defer stop()
	if err := r.Run(ctx); err != nil {
		var dbErr *placement.DatabasesError
		if errors.As(err, &dbErr) {
			return fail(err, 2) // the databases are not the cluster's: a setting
		}
		return fail(err, 1)
	}
	return 0
}

func warnSecrets(log hclog.Logger, flags []string) {
	for _, name := range flags {
		log.Warn("a secret was given on the command line, where every local user can read it (/proc/<pid>/cmdline); give it by file or environment instead",
			"flag", "--"+name, "instead", "--"+name+"-file")
	}
}

// parseKinds reads --kinds: comma-separated kinds of this binary's built-in
// handlers.
func parseKinds(spec string) ([]string, error) {
	builtin := runner.Builtins(hclog.NewNullLogger())
	var out []string
	for _, k := range strings.Split(spec, ",") {
		k = strings.TrimSpace(k)
		if _, ok := builtin[k]; !ok {
			return nil, fmt.Errorf("--kinds: %q is not a kind of this binary (%s)", k, strings.Join(slices.Sorted(maps.Keys(builtin)), ", "))
		}
		if !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out, nil
}
