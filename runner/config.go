// Package runner is the shardrun runner as a library: it connects to
// PostgreSQL and etcd, joins the cluster, executes the tasks of the shards it
// owns with the handlers you register, and serves the admin endpoint.
//
//	r, err := runner.New(cfg)
//	runner.HandleTyped(r, "resize-image", func(ctx context.Context, t *tasks.Task, p Resize) error { ... })
//	err = r.Run(ctx) // until ctx ends, then drains
package runner

import (
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/executor"
	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/shard"
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
	// DatabaseURL: --database-url, DATABASE_URL.
	DatabaseURL string
	// DBMaxConns: --db-max-conns, SHARDRUN_DB_MAX_CONNS.
	DBMaxConns int
	// AdminAddr and AdminToken: --admin-addr, SHARDRUN_ADMIN_ADDR;
	// --admin-token, SHARDRUN_ADMIN_TOKEN.
	AdminAddr  string
	AdminToken string
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
	HandoffTimeout    time.Duration
	RetryBase         time.Duration
	RetryCap          time.Duration
	// Version is published in the runner's etcd key and /status.
	Version string
	// Logger is the root logger; default hclog at info on stderr.
	Logger hclog.Logger
}

// DefaultConfig returns the defaults of every setting.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		EtcdEndpoints:     []string{"http://127.0.0.1:2379"},
		EtcdPrefix:        "/shardrun/",
		Cluster:           "default",
		ShardCount:        shard.DefaultShardCount,
		DBMaxConns:        8,
		AdminAddr:         "127.0.0.1:9090",
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

// Validate reports the first bad setting in one line naming its flag.
func (c Config) Validate() error {
	if err := cli.CheckEndpoints(c.EtcdEndpoints); err != nil {
		return err
	}
	switch {
	case !strings.HasPrefix(c.EtcdPrefix, "/") || !strings.HasSuffix(c.EtcdPrefix, "/"):
		return fmt.Errorf("--etcd-prefix: must start and end with /, got %q", c.EtcdPrefix)
	case c.Cluster == "" || strings.ContainsAny(c.Cluster, "/ "):
		return fmt.Errorf("--cluster: must be non-empty without slashes or spaces, got %q", c.Cluster)
	case c.ShardCount < 1:
		return fmt.Errorf("--shard-count: must be at least 1, got %d", c.ShardCount)
	case c.DatabaseURL == "":
		return fmt.Errorf("--database-url (DATABASE_URL): required, e.g. postgres://user:pass@host:5432/db")
	case c.DBMaxConns < 2:
		return fmt.Errorf("--db-max-conns: must be at least 2, got %d", c.DBMaxConns)
	case c.RunnerID == "" || strings.ContainsAny(c.RunnerID, "/ \t"):
		return fmt.Errorf("--runner-id: must be non-empty without slashes or spaces, got %q", c.RunnerID)
	case c.LeaseTTL < time.Second || c.LeaseTTL%time.Second != 0:
		return fmt.Errorf("--lease-ttl: must be a whole number of seconds, at least 1s, got %s", c.LeaseTTL)
	case c.DetachMargin < 0 || c.margin() >= c.LeaseTTL:
		return fmt.Errorf("--detach-margin: must be less than --lease-ttl (%s), got %s", c.LeaseTTL, c.margin())
	case c.KeepaliveFailures < 1:
		return fmt.Errorf("--keepalive-failures: must be at least 1, got %d", c.KeepaliveFailures)
	case c.RecoveryWindow < 0:
		return fmt.Errorf("--recovery-window: must not be negative, got %s", c.RecoveryWindow)
	case c.HeartbeatInterval <= 0:
		return fmt.Errorf("--heartbeat-interval: must be positive, got %s", c.HeartbeatInterval)
	case c.PollInterval <= 0:
		return fmt.Errorf("--poll-interval: must be positive, got %s", c.PollInterval)
	case c.MaxWorkers < 1:
		return fmt.Errorf("--max-workers: must be at least 1, got %d", c.MaxWorkers)
	case c.HandoffTimeout < 0:
		return fmt.Errorf("--handoff-timeout: must not be negative, got %s", c.HandoffTimeout)
	case c.RetryBase <= 0:
		return fmt.Errorf("--retry-base: must be positive, got %s", c.RetryBase)
	case c.RetryCap < c.RetryBase:
		return fmt.Errorf("--retry-cap: must be at least --retry-base (%s), got %s", c.RetryBase, c.RetryCap)
	}
	if _, err := pgx.ParseConfig(c.DatabaseURL); err != nil {
		return fmt.Errorf("--database-url (DATABASE_URL): malformed: %s", cli.OneLine(err))
	}
	host, _, err := net.SplitHostPort(c.AdminAddr)
	if err != nil {
		return fmt.Errorf("--admin-addr: must be host:port, got %q", c.AdminAddr)
	}
	if c.AdminToken == "" && !isLoopback(host) {
		return fmt.Errorf("--admin-token (SHARDRUN_ADMIN_TOKEN): required when --admin-addr (%s) is not a loopback address", c.AdminAddr)
	}
	return nil
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
