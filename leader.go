package shardrun

import (
	"cmp"
	"errors"
	"fmt"
	"time"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/leadership"
	"github.com/shardrun/shardrun/internal/maintenance"
	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
	"github.com/shardrun/shardrun/tasks"
)

// Defaults of LeaderConfig: the coordinator binary's defaults.
const (
	DefaultElectionTTL       = 10 * time.Second
	DefaultSweepInterval     = 5 * time.Second
	DefaultStaleThreshold    = 30 * time.Second
	DefaultRetainCompleted   = 24 * time.Hour
	DefaultRetainFailed      = 7 * 24 * time.Hour
	DefaultRetentionInterval = 30 * time.Second
)

// RetainForever, as LeaderConfig.RetainCompleted or RetainFailed, keeps
// those finished tasks forever.
const RetainForever time.Duration = -1

// LeaderConfig is the settings of a client that takes part in the
// election of the cluster's leader (Config.Leader). The leader is one
// process of the cluster, a coordinator or a client with a LeaderConfig:
// all of them campaign in one election, in etcd. While it leads, it sweeps
// the claims of runners that stopped beating (requeued, or dead when out
// of attempts) and the tasks past their deadline, deletes finished tasks
// after their retention, enqueues the ticks of periodic tasks and, with
// UnhandledAfter, fails work no attached runner can run. Each term raises
// a fence in PostgreSQL first, which every one of those statements
// checks: a leader that lost its election but has not noticed yet changes
// nothing once the next leader has begun.
//
// The zero value is the coordinator binary's defaults.
type LeaderConfig struct {
	// ID names this process in the election (the status page's leader).
	// Defaults to Config.RunnerID (hostname-pid).
	ID string
	// ElectionTTL is the leader's session TTL, whole seconds from 1s to
	// 1h: a leader that dies is replaced within about this long, and
	// nothing is swept meanwhile. Defaults to 10s.
	ElectionTTL time.Duration
	// SweepInterval is the time between sweeps, 10ms to 1h. Defaults to
	// 5s.
	SweepInterval time.Duration
	// StaleThreshold: a running task whose runner has not beaten its
	// heartbeat for longer is requeued. It must exceed the runners'
	// HeartbeatInterval and be at most 24h. A new leader judges no
	// heartbeat until it has led this long. Defaults to 30s.
	StaleThreshold time.Duration
	// RetainCompleted: completed tasks are deleted this long after they
	// finished. Defaults to 24h; RetainForever keeps them.
	RetainCompleted time.Duration
	// RetainFailed: failed, dead and cancelled tasks are deleted this long
	// after they finished. Defaults to 7 days; RetainForever keeps them.
	RetainFailed time.Duration
	// RetentionInterval is the time between retention passes. Defaults to
	// 30s.
	RetentionInterval time.Duration
	// UnhandledAfter, when set, fails a ready task that no attached runner
	// has been able to run (none serves its queue with a handler of its
	// kind) for this long, and that has been due for this long. Defaults
	// to 0: such tasks wait.
	UnhandledAfter time.Duration
}

// leaderSettings checks the client's LeaderConfig, each error naming its
// field, and returns the leader's settings (the shard count is set once
// it is known).
func leaderSettings(cfg Config) (leadership.Config, error) {
	lc := *cfg.Leader
	hb := cmp.Or(cfg.HeartbeatInterval, claims.DefaultHeartbeatInterval)
	l := leadership.Config{
		ID:          cmp.Or(lc.ID, cfg.RunnerID, runner.DefaultConfig().RunnerID),
		Prefix:      cfg.EtcdPrefix + cfg.Cluster + "/",
		MaxAttempts: cmp.Or(cfg.MaxAttempts, tasks.DefaultMaxAttempts),
		ElectionTTL: cmp.Or(lc.ElectionTTL, DefaultElectionTTL),
		Sweep: sweeper.Config{Interval: cmp.Or(lc.SweepInterval, DefaultSweepInterval),
			StaleThreshold: cmp.Or(lc.StaleThreshold, DefaultStaleThreshold), HeartbeatInterval: hb,
			Backoff: store.Backoff{Base: cmp.Or(cfg.RetryBase, tasks.DefaultRetryBase), Cap: cmp.Or(cfg.RetryCap, tasks.DefaultRetryCap)}},
		Retention: maintenance.RetentionConfig{
			RetainCompleted: max(cmp.Or(lc.RetainCompleted, DefaultRetainCompleted), 0), KeepCompleted: lc.RetainCompleted == RetainForever,
			RetainFailed: max(cmp.Or(lc.RetainFailed, DefaultRetainFailed), 0), KeepFailed: lc.RetainFailed == RetainForever,
			Interval: cmp.Or(lc.RetentionInterval, DefaultRetentionInterval)},
		Unhandled: maintenance.ReaperConfig{After: lc.UnhandledAfter},
	}
	if err := checkLeader(l, lc, hb); err != nil {
		return l, fmt.Errorf("shardrun: %w", err)
	}
	return l, nil
}

// checkLeader reports the first bad setting of lc (filled as l), by its
// field.
func checkLeader(l leadership.Config, lc LeaderConfig, heartbeat time.Duration) error {
	if err := shard.CheckName("Config.Leader.ID", l.ID); err != nil {
		return err
	}
	if err := leadership.CheckElectionTTL("Config.Leader.ElectionTTL", l.ElectionTTL); err != nil {
		return err
	}
	if iv := l.Sweep.Interval; iv < sweeper.MinInterval || iv > sweeper.MaxInterval {
		return fmt.Errorf("Config.Leader.SweepInterval: must be %s to %s, got %s", sweeper.MinInterval, sweeper.MaxInterval, iv)
	}
	if st := l.Sweep.StaleThreshold; st <= heartbeat || st > sweeper.MaxStaleThreshold {
		return fmt.Errorf("Config.Leader.StaleThreshold: must exceed the runners' heartbeat interval (Config.HeartbeatInterval, %s) and be at most %s, got %s",
			heartbeat, sweeper.MaxStaleThreshold, st)
	}
	for _, r := range []struct {
		field string
		d     time.Duration
	}{{"RetainCompleted", lc.RetainCompleted}, {"RetainFailed", lc.RetainFailed}} {
		if r.d < 0 && r.d != RetainForever {
			return fmt.Errorf("Config.Leader.%s: must not be negative (RetainForever keeps the tasks forever), got %s", r.field, r.d)
		}
	}
	if lc.RetentionInterval < 0 {
		return fmt.Errorf("Config.Leader.RetentionInterval: must not be negative, got %s", lc.RetentionInterval)
	}
	if lc.UnhandledAfter < 0 {
		return fmt.Errorf("Config.Leader.UnhandledAfter: must not be negative (0: tasks no runner can run wait), got %s", lc.UnhandledAfter)
	}
	return nil
}

// errLeaderNeedsEtcd: the leader is elected in etcd.
var errLeaderNeedsEtcd = errors.New("shardrun: Config.Leader needs an etcd client (NewClient was given none): " +
	"the cluster's leader is elected among its coordinators in etcd")
