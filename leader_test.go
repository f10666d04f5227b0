package shardrun_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/internal/coordinator"
	"github.com/shardrun/shardrun/internal/maintenance"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
	"github.com/shardrun/shardrun/tasks"
)

// Tick is the periodic task of the leader tests.
type Tick struct{}

func (Tick) Kind() string { return "tick" }

// TestAPeriodicTaskRunsWithNoCoordinator: a program with workers and the
// in-process leader declares a periodic task; with no coordinator process
// anywhere, its leader enqueues the ticks and its runner completes them,
// and the runner's admin endpoint serves the leader's metrics.
func TestAPeriodicTaskRunsWithNoCoordinator(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorker(workers, func(ctx context.Context, task *shardrun.Task[Tick]) error { return nil }); err != nil {
		t.Fatal(err)
	}
	admin := testutil.FreeAddr(t)
	c := w.client(t, shardrun.Config{Workers: workers, AdminAddr: admin, Leader: &shardrun.LeaderConfig{ElectionTTL: 2 * time.Second},
		Periodic: []shardrun.PeriodicTask{{Name: "every-second", Every: time.Second, Args: Tick{}}}})
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the client leads", c.IsLeader)
	testutil.Until(t, 30*time.Second, "two ticks of the schedule completed", func() (bool, string) {
		var n int
		err := w.pool.QueryRow(ctx, `SELECT count(*) FROM tasks t JOIN schedules s ON s.id = t.schedule_id
			WHERE s.name = 'every-second' AND t.state = 'completed'`).Scan(&n)
		return err == nil && n >= 2, fmt.Sprintf("%d completed, %v", n, err)
	})
	code, body := testutil.HTTP(t, "GET", "http://"+admin+"/metrics", "", "")
	for _, want := range []string{"shardrun_coordinator_is_leader 1", `shardrun_schedule_errors_total{database="main"} 0`,
		"shardrun_sweeps_total", "shardrun_tasks_claimed_total"} {
		if code != 200 || !strings.Contains(body, want) {
			t.Errorf("the runner's /metrics (%d) lacks %q", code, want)
		}
	}
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if c.IsLeader() {
		t.Fatal("the client leads after Stop")
	}
}

// TestTheInProcessLeaderSweepsAndRetains: a client that leads without
// running tasks (no workers) requeues the claims of a runner that is gone
// once its grace period has passed, and deletes finished tasks after
// their retention.
func TestTheInProcessLeaderSweepsAndRetains(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	c := w.client(t, shardrun.Config{Leader: &shardrun.LeaderConfig{ElectionTTL: 2 * time.Second,
		SweepInterval: 50 * time.Millisecond, StaleThreshold: 2 * time.Second,
		RetainCompleted: shardrun.RetainForever, RetainFailed: time.Millisecond, RetentionInterval: 50 * time.Millisecond}})
	st, err := store.OpenLike(ctx, w.pool, store.Options{MaxConns: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	// Three tasks claimed an hour ago by a runner that never beat and is
	// gone; no runner runs, so only the leader's sweep can requeue them.
	pgtest.InsertClaimed(t, st, `INSERT INTO tasks (kind, shard, key) SELECT 'k', g, g::text FROM generate_series(1, $1) g RETURNING id`,
		"gone", 1, "now() - interval '1 hour'", 3)
	later, err := c.Enqueue(ctx, Greet{Name: "later"}, &shardrun.EnqueueOpts{RunAfter: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Cancel(ctx, later.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.Start(ctx); err != nil {
		t.Fatalf("a client with a leader and no workers: %v", err)
	}
	if c.RunnerID() != "" {
		t.Fatalf("a client without workers runs runner %q", c.RunnerID())
	}
	testutil.WaitFor(t, 10*time.Second, "the client leads", c.IsLeader)
	testutil.Until(t, 20*time.Second, "the gone runner's claims requeued", func() (bool, string) {
		page, err := c.List(ctx, tasks.ListRequest{Filter: tasks.Filter{Kind: "k"}})
		if err != nil {
			return false, err.Error()
		}
		states := map[tasks.State]int{}
		for _, task := range page.Tasks {
			states[task.State]++
		}
		return states[tasks.Ready] == 3, fmt.Sprint(states)
	})
	testutil.Until(t, 20*time.Second, "the cancelled task deleted after its retention", func() (bool, string) {
		task, err := c.Get(ctx, later.ID)
		return errors.Is(err, tasks.ErrNotFound), fmt.Sprintf("%v %v", task.State, err)
	})
}

// TestOneLeaderAmongClientsAndCoordinators: two clients with a leader (one
// with workers, one without) and a coordinator campaign in one election:
// exactly one of them leads at a time, and stopping the leader hands the
// leadership to another at once (it resigns).
func TestOneLeaderAmongClientsAndCoordinators(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorker(workers, func(ctx context.Context, task *shardrun.Task[Greet]) error { return nil }); err != nil {
		t.Fatal(err)
	}
	type candidate struct {
		id       string
		isLeader func() bool
		stop     func()
	}
	var all []*candidate
	for _, id := range []string{"client-a", "client-b"} {
		cfg := shardrun.Config{Leader: &shardrun.LeaderConfig{ID: id, ElectionTTL: 2 * time.Second}}
		if id == "client-a" {
			cfg.Workers = workers
		}
		c := w.client(t, cfg)
		if err := c.Start(ctx); err != nil {
			t.Fatal(err)
		}
		all = append(all, &candidate{id: id, isLeader: c.IsLeader, stop: func() {
			if err := c.Stop(ctx); err != nil {
				t.Errorf("stopping %s: %v", id, err)
			}
		}})
	}
	st, err := store.OpenLike(ctx, w.pool, store.Options{MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	coord, err := coordinator.New(coordinator.Config{ID: "coord", Client: w.etcd, Prefix: shardrun.DefaultEtcdPrefix + shardrun.DefaultCluster + "/",
		ShardCount: shardrun.DefaultShardCount, Store: st, ElectionTTL: 2 * time.Second, HTTPAddr: "127.0.0.1:0",
		Logger: hclog.New(&hclog.LoggerOptions{Name: "coord", Level: hclog.Warn, Output: testLog{t}})})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- coord.Run(cctx) }()
	stopCoord := func() {
		cancel()
		err := <-done
		if err != nil {
			t.Errorf("the coordinator stopped: %v", err)
		}
		done <- err // a second stop returns at once
	}
	defer stopCoord()
	all = append(all, &candidate{id: "coord", isLeader: coord.IsLeader, stop: stopCoord})

	leaders := func(cs []*candidate) []string {
		var ids []string
		for _, c := range cs {
			if c.isLeader() {
				ids = append(ids, c.id)
			}
		}
		return ids
	}
	running := all
	for len(running) > 0 {
		var leader *candidate
		testutil.Until(t, 10*time.Second, "one leader", func() (bool, string) {
			ids := leaders(all)
			for _, c := range running {
				if len(ids) == 1 && ids[0] == c.id {
					leader = c
				}
			}
			return leader != nil, fmt.Sprintf("leading: %q", ids)
		})
		for range 20 {
			if ids := leaders(all); len(ids) != 1 {
				t.Fatalf("leading at once: %q", ids)
			}
			time.Sleep(10 * time.Millisecond) // sampling a steady state over time
		}
		t.Logf("%s leads; stopping it", leader.id)
		leader.stop()
		var rest []*candidate
		for _, c := range running {
			if c != leader {
				rest = append(rest, c)
			}
		}
		running = rest
	}
}

// TestLeaderConfigIsChecked: the leader needs etcd, and each bad setting
// is refused by NewClient naming its field; the defaults are the
// coordinator binary's.
func TestLeaderConfigIsChecked(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	if _, err := shardrun.NewClient(ctx, w.pool, nil, quiet(t, shardrun.Config{Leader: &shardrun.LeaderConfig{}})); err == nil || !strings.Contains(err.Error(), "etcd") {
		t.Fatalf("a leader without etcd: %v, want an error naming etcd", err)
	}
	for field, lc := range map[string]shardrun.LeaderConfig{
		"Config.Leader.ID":                {ID: "a/b"},
		"Config.Leader.ElectionTTL":       {ElectionTTL: 1500 * time.Millisecond},
		"Config.Leader.SweepInterval":     {SweepInterval: time.Millisecond},
		"Config.Leader.StaleThreshold":    {StaleThreshold: time.Second}, // the heartbeat interval is 5s
		"Config.Leader.RetainCompleted":   {RetainCompleted: -time.Second},
		"Config.Leader.RetainFailed":      {RetainFailed: -time.Hour},
		"Config.Leader.RetentionInterval": {RetentionInterval: -time.Second},
		"Config.Leader.UnhandledAfter":    {UnhandledAfter: -time.Second},
	} {
		if _, err := shardrun.NewClient(ctx, w.pool, w.etcd, quiet(t, shardrun.Config{Leader: &lc})); err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%+v: %v, want an error naming %s", lc, err, field)
		}
	}
	c := w.client(t, shardrun.Config{})
	if err := c.Start(ctx); err == nil || !strings.Contains(err.Error(), "Config.Leader") {
		t.Errorf("Start with neither workers nor a leader: %v, want an error naming both", err)
	}
	for name, pair := range map[string][2]time.Duration{
		"election TTL":       {shardrun.DefaultElectionTTL, coordinator.DefaultElectionTTL},
		"sweep interval":     {shardrun.DefaultSweepInterval, sweeper.DefaultInterval},
		"stale threshold":    {shardrun.DefaultStaleThreshold, sweeper.DefaultStaleThreshold},
		"retain completed":   {shardrun.DefaultRetainCompleted, maintenance.DefaultRetainCompleted},
		"retain failed":      {shardrun.DefaultRetainFailed, maintenance.DefaultRetainFailed},
		"retention interval": {shardrun.DefaultRetentionInterval, maintenance.DefaultRetentionInterval},
	} {
		if pair[0] != pair[1] {
			t.Errorf("the library's default %s is %s, the coordinator's %s", name, pair[0], pair[1])
		}
	}
}
