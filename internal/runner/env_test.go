package runner

import (
	"context"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) {
	pgtest.Main(m, testutil.EtcdLeaks...)
}

const testShards = 16

// env is one PostgreSQL database, one embedded etcd, and runners started
// in this process.
type env struct {
	t      *testing.T
	dsn    string
	etcd   *embedetcd.Server
	admin  *clientv3.Client
	store  *store.Store
	client *client.Tasks
}

func newEnv(t *testing.T) *env {
	t.Helper()
	st, dsn := pgtest.NewStore(t, store.Options{})
	srv, admin := testutil.Etcd(t)
	c, err := client.New(st, client.Config{ShardCount: testShards})
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, dsn: dsn, etcd: srv, admin: admin, store: st, client: c}
}

// testRunner is a runner started by the test.
type testRunner struct {
	*Runner
	cancel context.CancelFunc
	done   chan error
	logs   *linewriter.Buffer
}

// runnerOpt adjusts a test runner: first with r == nil to change the
// config, then with the runner to register handlers.
type runnerOpt func(*Config, *Runner)

func withToken(token string) runnerOpt { return func(c *Config, _ *Runner) { c.AdminToken = token } }

func withHandler(kind string, h tasks.Handler) runnerOpt {
	return func(_ *Config, r *Runner) {
		if r == nil {
			return
		}
		if err := r.Handle(kind, h); err != nil {
			panic(err)
		}
	}
}

func (e *env) config(id string) Config {
	cfg := DefaultConfig()
	cfg.EtcdEndpoints = e.etcd.Endpoints()
	cfg.Cluster = "test"
	cfg.ShardCount = testShards
	cfg.DatabaseURL = e.dsn
	cfg.AdminAddr = "127.0.0.1:0"
	cfg.RunnerID = id
	cfg.LeaseTTL = 2 * time.Second
	cfg.RecoveryWindow = 300 * time.Millisecond
	cfg.HeartbeatInterval = 300 * time.Millisecond
	cfg.PollInterval = 200 * time.Millisecond
	cfg.HandoffTimeout = time.Second
	cfg.RetryBase = 50 * time.Millisecond
	cfg.RetryCap = 200 * time.Millisecond
	return cfg
}

// start runs a runner until the test ends (or stop is called).
func (e *env) start(id string, opts ...runnerOpt) *testRunner {
	e.t.Helper()
	cfg := e.config(id)
	logs := &linewriter.Buffer{}
	cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: id, Level: hclog.Info, Output: logs})
	for _, o := range opts {
		o(&cfg, nil)
	}
	r, err := New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := r.HandleBuiltins(); err != nil {
		e.t.Fatal(err)
	}
	for _, o := range opts {
		o(&cfg, r)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tr := &testRunner{Runner: r, cancel: cancel, done: make(chan error, 1), logs: logs}
	go func() { tr.done <- r.Run(ctx) }()
	select {
	case <-r.Started():
	case err := <-tr.done:
		e.t.Fatalf("runner %s did not start: %v", id, err)
	case <-time.After(30 * time.Second):
		e.t.Fatalf("runner %s did not start within 30s", id)
	}
	e.t.Cleanup(func() {
		tr.stop()
		if e.t.Failed() {
			e.t.Logf("log of %s:\n%s", id, logs.String())
		}
	})
	return tr
}

// stop drains the runner and waits for Run to return.
func (tr *testRunner) stop() {
	tr.cancel()
	<-tr.done
	tr.done <- nil // later stops return at once
}

func (e *env) enqueue(kind, payload string, n int) []int64 {
	e.t.Helper()
	ids := make([]int64, n)
	for i := range ids {
		id, err := e.client.Enqueue(context.Background(), tasks.NewTask{Kind: kind, Payload: []byte(payload), Options: tasks.Options{Key: fmt.Sprintf("%s-%d-%d", kind, i, time.Now().UnixNano())}})
		if err != nil {
			e.t.Fatal(err)
		}
		ids[i] = id.ID
	}
	return ids
}

func (e *env) counts() map[tasks.State]int64 {
	e.t.Helper()
	c, err := e.store.CountByState(context.Background())
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

func (e *env) task(id int64) tasks.Task {
	e.t.Helper()
	t, err := e.store.Get(context.Background(), id)
	if err != nil {
		e.t.Fatal(err)
	}
	return t
}

// etcdOwners reads the owners of the test cluster's shards (every group's).
func (e *env) etcdOwners() map[int]string {
	e.t.Helper()
	cl, err := shard.ReadCluster(context.Background(), e.admin, "/shardrun/test/", testShards)
	if err != nil {
		e.t.Fatal(err)
	}
	owners := map[int]string{}
	for _, g := range cl.Groups {
		for s, o := range g.Owners {
			if o != "" {
				owners[s] = o
			}
		}
	}
	return owners
}

func (tr *testRunner) url(path string) string { return "http://" + tr.AdminAddr() + path }

func TestAdvertisedAdminAddress(t *testing.T) {
	t.Parallel()
	host, _ := os.Hostname()
	for bound, want := range map[string]string{
		"127.0.0.1:9090": "127.0.0.1:9090",
		"[::]:9090":      net.JoinHostPort(host, "9090"),
		"0.0.0.0:9091":   net.JoinHostPort(host, "9091"),
		"10.1.2.3:9090":  "10.1.2.3:9090",
	} {
		if got := advertised(bound); got != want {
			t.Errorf("advertised(%q) = %q, want %q", bound, got, want)
		}
	}
}
