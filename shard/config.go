// Package shard is runner membership and shard ownership on etcd: one lease
// per runner kept alive by its own loop, registration under runners/, a
// deterministic assignment of shards to attached runners, acquisition and
// release of shard keys, and the epoch (fencing token) of every owned shard.
//
// A runner may execute a shard's tasks only while it owns the shard key and
// is attached. When the lease can no longer be proven (keep-alives fail, or
// the deadline computed from their send times comes within the margin) the
// detach machine is tripped, every shard's context is cancelled at once, and
// the shard keys are released as soon as etcd can be reached again.
package shard

import (
	"cmp"
	"fmt"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
)

// Defaults of Config.
const (
	DefaultShardCount       = 256
	DefaultLeaseTTL         = 10 * time.Second
	DefaultFailureThreshold = 2
	DefaultHandoffTimeout   = 10 * time.Second
	// DefaultAcquireBatch is the largest batch a stock etcd accepts: each
	// shard is a nested one-operation Txn, and etcd checks nested Txns
	// against max-txn-ops (128) minus the outer Txn's operation count, so
	// N nested Txns need 1 <= 128 - N.
	DefaultAcquireBatch = 127
	// DefaultJoinSettle: see Config.JoinSettle.
	DefaultJoinSettle = 250 * time.Millisecond
	// cancelGrace is how long a released shard waits, after cancelling its
	// work, for handlers to return and their results to be written before
	// the key is deleted anyway (later writes are fenced out).
	cancelGrace = time.Second
)

// Config configures a Manager. Zero fields take the defaults above.
type Config struct {
	// Client talks to etcd; required. Give it gRPC keep-alives
	// (DialKeepAliveTime) so a dead connection is noticed.
	Client *clientv3.Client
	// Prefix is the cluster's key prefix, e.g. "/shardrun/default/"; required.
	Prefix string
	// RunnerID names this runner; required, unique in the cluster.
	RunnerID string
	// AdminAddr, Version and Kinds (the task kinds it handles) are
	// published in the runner's key.
	AdminAddr string
	Version   string
	Kinds     []string
	// ShardCount is written once to meta/shard-count; a runner configured
	// with another count refuses to start.
	ShardCount int
	// LeaseTTL is the runner lease's TTL, whole seconds. Default 10s.
	LeaseTTL time.Duration
	// DetachMargin: detach at lease deadline - margin. Default TTL/3.
	DetachMargin time.Duration
	// KeepAliveInterval between keep-alive rounds. Default TTL/8: a lease
	// survives an etcd leader election only if a keep-alive lands within
	// TTL − margin of the last successful one, and the time since that
	// one, up to an interval, is lost from the budget when the election
	// starts (docs/architecture.md has the measurement).
	KeepAliveInterval time.Duration
	// FailureThreshold consecutive keep-alive rounds without a success
	// detach. Default 2.
	FailureThreshold int
	// HandoffTimeout bounds how long a shard being released waits for its
	// in-flight work before cancelling it. Default 10s.
	HandoffTimeout time.Duration
	// AcquireBatch shard keys per Txn, at most the server's --max-txn-ops
	// minus one. Default 127; halved automatically when etcd says too many.
	AcquireBatch int
	// JoinSettle: when a runner joins, members wait until no other runner
	// has joined for this long before moving shards, so that many runners
	// starting together rebalance once instead of once per join. Leaves and
	// failovers are acted on at once. Default 250ms; negative disables it.
	JoinSettle time.Duration
	// Detach is the runner's detach machine; required.
	Detach *detach.Machine
	// Clock defaults to the real clock.
	Clock clock.Clock
	// Logger defaults to a null logger.
	Logger hclog.Logger
	// Metrics defaults to unregistered metrics.
	Metrics *Metrics
	// Events, when set, receives every ownership event as it happens; tests
	// share one among members to check invariants on one timeline. Nil in
	// production.
	Events *testsignal.Signal[Event]
}

// EventKind is what happened to a shard or to the runner.
type EventKind int

// Event kinds given to Config.Events.
const (
	Acquired EventKind = iota + 1 // Sent: when the acquiring Txn was sent
	Released                      // the key was deleted after the work stopped; At is when the delete was sent
	Lost                          // ownership ended without release (lease gone, fence lost)
	Detached
	Attached
)

func (k EventKind) String() string {
	switch k {
	case Acquired:
		return "acquired"
	case Released:
		return "released"
	case Lost:
		return "lost"
	case Detached:
		return "detached"
	case Attached:
		return "attached"
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Event is an ownership event.
type Event struct {
	Kind   EventKind
	Runner string
	Shard  int
	Epoch  int64
	At     time.Time
	Sent   time.Time
}

func (c *Config) fill() {
	c.LeaseTTL = cmp.Or(c.LeaseTTL, DefaultLeaseTTL)
	c.DetachMargin = cmp.Or(c.DetachMargin, c.LeaseTTL/3)
	c.KeepAliveInterval = cmp.Or(c.KeepAliveInterval, c.LeaseTTL/8)
	c.FailureThreshold = cmp.Or(c.FailureThreshold, DefaultFailureThreshold)
	c.HandoffTimeout = cmp.Or(c.HandoffTimeout, DefaultHandoffTimeout)
	c.AcquireBatch = cmp.Or(c.AcquireBatch, DefaultAcquireBatch)
	c.JoinSettle = cmp.Or(c.JoinSettle, DefaultJoinSettle)
	if c.Clock == nil {
		c.Clock = clock.Real()
	}
	if c.Logger == nil {
		c.Logger = hclog.NewNullLogger()
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(nil)
	}
}

// Validate reports the first bad field, by its flag name.
func (c *Config) Validate() error {
	switch {
	case c.Client == nil:
		return fmt.Errorf("shard: an etcd client is required")
	case c.Detach == nil:
		return fmt.Errorf("shard: a detach machine is required")
	case c.Prefix == "" || !strings.HasSuffix(c.Prefix, "/"):
		return fmt.Errorf("--etcd-prefix: must be non-empty and end with /, got %q", c.Prefix)
	case c.RunnerID == "" || strings.ContainsAny(c.RunnerID, "/ \t\n"):
		return fmt.Errorf("--runner-id: must be non-empty without slashes or spaces, got %q", c.RunnerID)
	case c.ShardCount < 1:
		return fmt.Errorf("--shard-count: must be at least 1, got %d", c.ShardCount)
	case c.LeaseTTL < time.Second || c.LeaseTTL%time.Second != 0:
		return fmt.Errorf("--lease-ttl: must be a whole number of seconds, at least 1s, got %s", c.LeaseTTL)
	case c.DetachMargin <= 0 || c.DetachMargin >= c.LeaseTTL:
		return fmt.Errorf("--detach-margin: must be positive and less than --lease-ttl (%s), got %s", c.LeaseTTL, c.DetachMargin)
	case c.KeepAliveInterval <= 0 || c.KeepAliveInterval >= c.LeaseTTL-c.DetachMargin:
		return fmt.Errorf("keep-alive interval %s must be positive and less than --lease-ttl minus --detach-margin (%s), or no keep-alive can land before the runner detaches",
			c.KeepAliveInterval, c.LeaseTTL-c.DetachMargin)
	case c.FailureThreshold < 1:
		return fmt.Errorf("--keepalive-failures: must be at least 1, got %d", c.FailureThreshold)
	case c.HandoffTimeout < 0:
		return fmt.Errorf("--handoff-timeout: must not be negative, got %s", c.HandoffTimeout)
	case c.AcquireBatch < 1:
		return fmt.Errorf("acquire batch: must be at least 1, got %d", c.AcquireBatch)
	}
	return nil
}

// keys names the cluster's etcd keys.
type keys struct{ prefix string }

func (k keys) meta() string            { return k.prefix + "meta/shard-count" }
func (k keys) runners() string         { return k.prefix + "runners/" }
func (k keys) runner(id string) string { return k.prefix + "runners/" + id }
func (k keys) shards() string          { return k.prefix + "shards/" }
func (k keys) shard(s int) string      { return fmt.Sprintf("%sshards/%d", k.prefix, s) }
