// Package shard is runner membership and shard ownership on etcd: one lease
// per runner kept alive by its own loop, registration under runners/, a
// deterministic assignment of its group's shards to the group's attached
// runners, acquisition and release of shards through the runner's owner
// key (owners/<group>/<runner>, which lists the shards it holds), and the
// epoch (fencing token) of every owned shard. It is protocol, not library
// API: the runner and the coordinator speak it.
//
// A runner may execute a shard's tasks only while its owner key names the
// shard and it is attached. When the lease can no longer be proven
// (keep-alives fail, or the deadline computed from their send times comes
// within the margin) the detach machine is tripped, every shard's context
// is cancelled at once, and the shards are released as soon as etcd can be
// reached again. Every write of the runner's own keys is conditioned on
// its lease, so that a process paused past its lease cannot touch those
// of a successor with the same runner id (conflict.go).
//
// It is one of the cluster's protocol packages (shard, detach, sweeper,
// store): importable, so that the runner and coordinator libraries and
// tools can be built on it, but not the library API and under no
// compatibility promise to library users, as etcd's server packages are
// importable but are not its client API. Programs use package shardrun
// and package tasks.
package shard

import (
	"cmp"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/enum"
)

// Defaults of Config, and of the flags that make it.
const (
	// DefaultEtcdPrefix and DefaultCluster make the default key prefix
	// /shardrun/default/ (--etcd-prefix, --cluster).
	DefaultEtcdPrefix       = "/shardrun/"
	DefaultCluster          = "default"
	DefaultShardCount       = 256
	DefaultLeaseTTL         = 10 * time.Second
	DefaultFailureThreshold = 2
	DefaultHandoffTimeout   = 10 * time.Second
	// DefaultJoinSettle: see Config.JoinSettle.
	DefaultJoinSettle = 250 * time.Millisecond
	// cancelGrace is how long a released shard waits, after cancelling its
	// work, for handlers to return and their results to be written before
	// the key is deleted anyway (later writes are fenced out).
	cancelGrace = time.Second
)

// Bounds of Config's settings. A bad value must stop a binary before it
// writes anything to etcd (meta/shard-count is permanent).
const (
	// MaxShardCount: on 2 cores against embedded etcd a cold cluster of 1
	// to 4 runners owns 16,384 shards in 2.5-3.1s and /api/cluster's shard
	// map is 250 KB; with 65,536 shards convergence took 68-76s and the map
	// 1 MB. Every runner's etcd watch, assignment and fence table grow with
	// the count.
	MaxShardCount = 16384
	// MaxLeaseTTL: a runner that dies keeps its shards until its lease
	// expires; beyond an hour nobody is waiting on purpose.
	MaxLeaseTTL = time.Hour
	// MaxFailureThreshold: the streak counts periods of TTL/3 without a
	// successful keep-alive, so after 3 the lease deadline has passed and
	// the runner detaches anyway; higher values only mean "detach on the
	// deadline alone".
	MaxFailureThreshold = 100
	// MaxHandoffTimeout bounds how long a moving shard waits for its
	// tasks.
	MaxHandoffTimeout = time.Hour
	// MaxNameLen bounds runner ids and cluster names (they are etcd key
	// segments and appear in every claimed row).
	MaxNameLen = 128
	// MaxEtcdPrefixLen bounds --etcd-prefix (part of every key).
	MaxEtcdPrefixLen = 256
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
	// AdminAddr and Version are published in the runner's key, and so are
	// Queues (those it serves) and Kinds (the task kinds it handles): the
	// runners that serve the same queues and handle the same kinds form a
	// group (GroupOf), which owns the shards of the work it can run.
	AdminAddr string
	Version   string
	Queues    []string
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
	// FailureThreshold: detach when no keep-alive succeeded for this many
	// periods of TTL/3 (detach.LeaseClock). Default 2.
	FailureThreshold int
	// HandoffTimeout bounds how long a shard being released waits for its
	// in-flight work before cancelling it. Default 10s.
	HandoffTimeout time.Duration
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
}

// EventKind is what happened to a shard or to the runner.
type EventKind int

// Event kinds of the ownership events tests follow.
const (
	Acquired EventKind = iota + 1 // Sent: when the acquiring Txn was sent
	Released                      // the key was deleted after the work stopped; At is when the delete was sent
	Lost                          // ownership ended without release (lease gone, fence lost)
	Detached
	Attached
)

var eventKindNames = []string{Acquired: "acquired", Released: "released", Lost: "lost", Detached: "detached", Attached: "attached"}

func (k EventKind) String() string { return enum.Name(k, eventKindNames, "EventKind") }

// Event is an ownership event.
type Event struct {
	Kind   EventKind
	Runner string
	Shard  int
	Epoch  int64
	At     time.Time
	Sent   time.Time
}

// fill gives zero fields their defaults; New calls it before Validate.
func (c *Config) fill() {
	c.LeaseTTL = cmp.Or(c.LeaseTTL, DefaultLeaseTTL)
	c.DetachMargin = cmp.Or(c.DetachMargin, c.LeaseTTL/3)
	c.KeepAliveInterval = cmp.Or(c.KeepAliveInterval, c.LeaseTTL/8)
	c.FailureThreshold = cmp.Or(c.FailureThreshold, DefaultFailureThreshold)
	c.HandoffTimeout = cmp.Or(c.HandoffTimeout, DefaultHandoffTimeout)
	c.JoinSettle = cmp.Or(c.JoinSettle, DefaultJoinSettle)
	c.Clock = cmp.Or(c.Clock, clock.Real())
	c.Logger = cmp.Or(c.Logger, hclog.NewNullLogger())
	c.Metrics = cmp.Or(c.Metrics, NewMetrics(nil))
}

// Validate reports the first bad setting in one line naming its flag. It
// checks the settings as they are, before anything connects: a zero where
// New would put a default is an error (a flag given as 0 must not silently
// become the default), except for the fields no flag sets (KeepAliveInterval,
// JoinSettle), which are checked with their defaults. It does
// not need Client and Detach, so that a binary validates its flags before it
// connects; New requires them.
func (c *Config) Validate() error {
	f := *c
	f.fill()
	switch {
	case !strings.HasPrefix(c.Prefix, "/") || !strings.HasSuffix(c.Prefix, "/"):
		return fmt.Errorf("--etcd-prefix: the key prefix must start and end with /, got %q", c.Prefix)
	}
	if err := CheckName("--runner-id", c.RunnerID); err != nil {
		return err
	}
	if err := ValidateShardCount(c.ShardCount); err != nil {
		return err
	}
	switch {
	case c.LeaseTTL < time.Second || c.LeaseTTL > MaxLeaseTTL || c.LeaseTTL%time.Second != 0:
		return fmt.Errorf("--lease-ttl: must be a whole number of seconds from 1s to %s (a dead runner keeps its shards this long), got %s", MaxLeaseTTL, c.LeaseTTL)
	case c.DetachMargin <= 0 || c.DetachMargin >= c.LeaseTTL:
		return fmt.Errorf("--detach-margin: must be positive and less than --lease-ttl (%s), got %s", c.LeaseTTL, c.DetachMargin)
	case f.KeepAliveInterval <= 0 || f.KeepAliveInterval >= c.LeaseTTL-c.DetachMargin:
		return fmt.Errorf("--detach-margin: must leave more than one keep-alive interval (%s) before the lease deadline, or no keep-alive can land before the runner detaches: at most %s with --lease-ttl %s, got %s",
			f.KeepAliveInterval, c.LeaseTTL-f.KeepAliveInterval-time.Millisecond, c.LeaseTTL, c.DetachMargin)
	case c.FailureThreshold < 1 || c.FailureThreshold > MaxFailureThreshold:
		return fmt.Errorf("--keepalive-failures: must be 1 to %d (the streak counts periods of lease-ttl/3 without a successful keep-alive, so a streak beyond 3 already outlasts the lease), got %d", MaxFailureThreshold, c.FailureThreshold)
	case c.HandoffTimeout <= 0 || c.HandoffTimeout > MaxHandoffTimeout:
		return fmt.Errorf("--handoff-timeout: must be positive and at most %s, got %s", MaxHandoffTimeout, c.HandoffTimeout)
	}
	return nil
}

// ValidateShardCount checks --shard-count for every binary that names one.
func ValidateShardCount(n int) error {
	if n < 1 || n > MaxShardCount {
		return fmt.Errorf("--shard-count: must be 1 to %d (beyond that ownership converges slowly and the cluster view grows past 250 KB; the count is permanent), got %d", MaxShardCount, n)
	}
	return nil
}

// CheckKeyPrefix checks the two flags that make a cluster's key prefix
// etcdPrefix + cluster + "/".
func CheckKeyPrefix(etcdPrefix, cluster string) error {
	if !strings.HasPrefix(etcdPrefix, "/") || !strings.HasSuffix(etcdPrefix, "/") || len(etcdPrefix) > MaxEtcdPrefixLen ||
		!utf8.ValidString(etcdPrefix) || strings.IndexFunc(etcdPrefix, notGraphic) >= 0 {
		return fmt.Errorf("--etcd-prefix: must start and end with /, without spaces or control characters, at most %d bytes, got %q", MaxEtcdPrefixLen, short(etcdPrefix))
	}
	return CheckName("--cluster", cluster)
}

// CheckName checks a name that becomes an etcd key segment or a value in
// every claimed row (--runner-id, --cluster, --coordinator-id): 1 to
// MaxNameLen bytes of valid UTF-8, no slash, space or control character.
func CheckName(flagName, name string) error {
	if name == "" || len(name) > MaxNameLen || !utf8.ValidString(name) ||
		strings.ContainsRune(name, '/') || strings.IndexFunc(name, notGraphic) >= 0 {
		return fmt.Errorf("%s: must be 1 to %d characters without slashes, spaces or control characters, got %q", flagName, MaxNameLen, short(name))
	}
	return nil
}

func notGraphic(r rune) bool { return !unicode.IsGraphic(r) || unicode.IsSpace(r) }

func short(s string) string {
	if len(s) > MaxNameLen+2 {
		return s[:MaxNameLen] + "…"
	}
	return s
}

// keys names the cluster's etcd keys.
type keys struct{ prefix string }

func (k keys) meta() string                  { return k.prefix + "meta/shard-count" }
func (k keys) runners() string               { return k.prefix + "runners/" }
func (k keys) runner(id string) string       { return k.prefix + "runners/" + id }
func (k keys) group(group string) string     { return k.prefix + "owners/" + group + "/" }
func (k keys) owner(group, id string) string { return k.prefix + "owners/" + group + "/" + id }
