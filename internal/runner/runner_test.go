package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/tasks"
)

// counting is a handler that records how many times each task ran.
type counting struct {
	mu   sync.Mutex
	runs map[int64]int
}

func (c *counting) handle(_ context.Context, t *tasks.Task) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs == nil {
		c.runs = map[int64]int{}
	}
	c.runs[t.ID]++
	return nil
}

func TestThousandTasksCompleteExactlyOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs counting
	var rs []*testRunner
	for _, id := range []string{"r1", "r2", "r3"} {
		rs = append(rs, e.start(id, withHandler("count", runs.handle)))
	}
	testutil.Until(t, 10*time.Second, "shards spread over 3 runners", func() (bool, string) {
		owners := map[string]int{}
		for _, o := range e.etcdOwners() {
			owners[o]++
		}
		return len(owners) == 3 && owners["r1"]+owners["r2"]+owners["r3"] == testShards, "not balanced yet"
	})
	start := time.Now()
	ids := e.enqueue("count", `{}`, 1000)
	took := testutil.Until(t, 60*time.Second, "1,000 tasks completed", func() (bool, string) {
		c := e.counts()
		return c[tasks.Completed] == 1000, strings.TrimSpace(strings.ReplaceAll(jsonString(c), "\n", ""))
	})
	t.Logf("1,000 tasks on 3 runners: all completed %s after the last was enqueued, %s after the first", took, time.Since(start))
	runs.mu.Lock()
	defer runs.mu.Unlock()
	for _, id := range ids {
		if runs.runs[id] != 1 {
			t.Fatalf("task %d ran %d times", id, runs.runs[id])
		}
		if task := e.task(id); task.Attempt != 1 || len(task.Errors) != 0 || task.ClaimedBy == "" {
			t.Fatalf("task %d: %+v", id, task)
		}
	}
	// A runner counts a completion once its write has committed, so the
	// sum may trail the table for a moment.
	testutil.Until(t, 5*time.Second, "tasks_finished_total{kind=count,outcome=completed} summing to 1000", func() (bool, string) {
		var finished float64
		for _, r := range rs {
			finished += metric(t, r, "shardrun_tasks_finished_total", "count", "completed")
		}
		return finished == 1000, fmt.Sprintf("sums to %v", finished)
	})
}

// A runner that loses a shard mid-task cancels the handler, and the stale
// completion it then attempts is refused and counted.
func TestShardLossCancelsHandlerAndFencesItsCompletion(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	started := make(chan *tasks.Task, 1)
	cancelled := make(chan struct{})
	stubborn := func(ctx context.Context, task *tasks.Task) error {
		if task.Attempt > 1 {
			return nil // the re-run by the new epoch completes
		}
		started <- task
		<-ctx.Done()
		close(cancelled)
		// Return success anyway, but only once the new epoch's fence is up,
		// so the completion is provably stale.
		testutil.Until(t, 10*time.Second, "fence raised past the old epoch", func() (bool, string) {
			var epoch int64
			_ = e.store.Pool().QueryRow(context.Background(), `SELECT epoch FROM shard_fences WHERE shard = $1`, task.Shard).Scan(&epoch)
			return epoch > task.Epoch, "fence not raised yet"
		})
		return nil
	}
	a := e.start("a", withHandler("stubborn", stubborn))
	ids := e.enqueue("stubborn", `{}`, 1)
	task := <-started
	// Take the shards away: delete the owner keys (as an expired lease would).
	if _, err := e.admin.Delete(context.Background(), "/shardrun/test/owners/", clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the handler's context was not cancelled when its shard was lost")
	}
	testutil.Until(t, 15*time.Second, "task completed under the new epoch", func() (bool, string) {
		got := e.task(ids[0])
		return got.State == tasks.Completed && got.Epoch > task.Epoch, string(got.State)
	})
	testutil.Until(t, 5*time.Second, "the stale completion refused and counted", func() (bool, string) {
		n := metric(t, a, "shardrun_fence_rejections_total")
		return n >= 1, fmt.Sprintf("shardrun_fence_rejections_total = %v", n)
	})
	got := e.task(ids[0])
	if got.Attempt != 2 || len(got.Errors) != 1 || !strings.Contains(got.Errors[0].Error, "orphaned") {
		t.Fatalf("task after failover: %+v", got)
	}
}

func TestManualDetachOverHTTPAndAttach(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start("a", withToken("s3cret"))
	b := e.start("b", withToken("s3cret"))
	testutil.Until(t, 10*time.Second, "both runners own shards", func() (bool, string) {
		return len(a.Status().Owned) > 0 && len(b.Status().Owned) > 0, "not yet"
	})
	// Work in flight on a: long sleeps.
	e.enqueue("sleep", `{"ms": 60000}`, 8)
	testutil.Until(t, 10*time.Second, "a is running tasks", func() (bool, string) { return a.exec.InFlight() > 0, "idle" })

	code, body := testutil.HTTP(t, "POST", a.url("/admin/detach"), "s3cret", `{"reason": "maintenance window"}`)
	if code != 200 || !strings.Contains(body, `"state": "detached"`) || !strings.Contains(body, "maintenance window") {
		t.Fatalf("detach: %d %s", code, body)
	}
	took := testutil.Until(t, 5*time.Second, "b owns every shard and a runs nothing", func() (bool, string) {
		for s := range testShards {
			if e.etcdOwners()[s] != "b" {
				return false, "a shard is not b's yet"
			}
		}
		return a.exec.InFlight() == 0, "a still has work in flight"
	})
	t.Logf("manual detach: b owned every shard %s later", took)
	if code, _ := testutil.HTTP(t, "GET", a.url("/readyz"), "", ""); code != 503 {
		t.Fatalf("readyz of a detached runner: %d", code)
	}
	// Sticky: health does not bring it back; only attach does.
	time.Sleep(3 * e.config("x").RecoveryWindow) // proving an absence: nothing to poll for
	if st := a.Status(); st.State != shard.StateDetached || !st.Sticky {
		t.Fatalf("a re-attached without an operator: %+v", st)
	}
	attachedAt := time.Now()
	if code, body := testutil.HTTP(t, "POST", a.url("/admin/attach"), "s3cret", ""); code != 200 {
		t.Fatalf("attach: %d %s", code, body)
	}
	testutil.Until(t, 10*time.Second, "a back with its share", func() (bool, string) {
		st := a.Status()
		return st.State == shard.StateAttached && len(st.Owned) == testShards/2, st.State
	})
	if since := time.Since(attachedAt); since < 300*time.Millisecond {
		t.Fatalf("a re-attached %s after attach, inside its recovery window", since)
	}
	if code, _ := testutil.HTTP(t, "GET", a.url("/readyz"), "", ""); code != 200 {
		t.Fatalf("readyz of an attached runner: %d", code)
	}
}

// A drained runner hands its shards over by releasing them, not by
// letting its lease expire: a's lease (30s) outlives the wait, so b owning
// everything within it proves the release.
func TestDrainHandsShardsOverWithoutWaitingForTheLease(t *testing.T) {
	e := newEnv(t)
	a := e.start("a", func(c *Config, _ *Runner) { c.LeaseTTL = 30 * time.Second })
	b := e.start("b")
	testutil.Until(t, 10*time.Second, "both own shards", func() (bool, string) {
		return len(a.Status().Owned) == testShards/2 && len(b.Status().Owned) == testShards/2, "not balanced"
	})
	ids := e.enqueue("sleep", `{"ms": 200}`, 20)
	testutil.Until(t, 10*time.Second, "a is running tasks", func() (bool, string) { return a.exec.InFlight() > 0, "idle" })
	go a.stop()
	took := testutil.Until(t, 15*time.Second, "b owns everything, before a's lease could expire", func() (bool, string) {
		owners := e.etcdOwners()
		for s := range testShards {
			if owners[s] != "b" {
				return false, "not yet"
			}
		}
		return true, ""
	})
	t.Logf("drain: b owned every shard %s after a was told to stop (in-flight sleeps of 200ms finished first)", took)
	testutil.Until(t, 15*time.Second, "all tasks completed", func() (bool, string) {
		return e.counts()[tasks.Completed] == int64(len(ids)), jsonString(e.counts())
	})
	for _, id := range ids {
		if task := e.task(id); task.Attempt != 1 {
			t.Fatalf("task %d needed %d attempts: a drain must let in-flight work finish; errors: %+v", id, task.Attempt, task.Errors)
		}
	}
}

func TestHandlerPanicFailsTheAttemptOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start("a", withHandler("explode", func(context.Context, *tasks.Task) error { panic("kaboom") }))
	bad := e.enqueue("explode", `{}`, 1)[0]
	good := e.enqueue("noop", `{}`, 5)
	testutil.Until(t, 10*time.Second, "noops done and the panicking task failed once", func() (bool, string) {
		task := e.task(bad)
		return e.counts()[tasks.Completed] == int64(len(good)) && len(task.Errors) >= 1, jsonString(e.counts())
	})
	task := e.task(bad)
	msg := task.Errors[0].Error
	if !strings.Contains(msg, "panic: kaboom") || !strings.Contains(msg, "goroutine") || !strings.Contains(msg, "runner_test.go") {
		t.Fatalf("the attempt's error must carry the panic text and stack, got %q", msg)
	}
}

func TestUndecodablePayloadFailsWithTheDecodeError(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start("a")
	id := e.enqueue("sleep", `{"ms": "soon"}`, 1)[0]
	testutil.Until(t, 10*time.Second, "first attempt failed", func() (bool, string) {
		return len(e.task(id).Errors) > 0, "no error yet"
	})
	if msg := e.task(id).Errors[0].Error; !strings.Contains(msg, "decoding payload") || !strings.Contains(msg, "ms: must be an integer") {
		t.Fatalf("error %q", msg)
	}
}

func TestFailBuiltinRetriesThenCompletes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start("a")
	retried := e.enqueue("fail", `{"times": 2}`, 1)[0]
	doomed, err := e.client.Enqueue(context.Background(), tasks.NewTask{Kind: "fail", Payload: []byte(`{"times": 9}`), Options: tasks.Options{MaxAttempts: 3}})
	if err != nil {
		t.Fatal(err)
	}
	testutil.Until(t, 15*time.Second, "retried task completed and doomed task dead", func() (bool, string) {
		return e.task(retried).State == tasks.Completed && e.task(doomed.ID).State == tasks.Dead, jsonString(e.counts())
	})
	if got := e.task(retried); got.Attempt != 3 || len(got.Errors) != 2 {
		t.Fatalf("retried task: %+v", got)
	}
	if got := e.task(doomed.ID); got.Attempt != 3 || len(got.Errors) != 3 {
		t.Fatalf("dead task: %+v", got)
	}
}

func TestAdminRejectsBadRequests(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start("a", withToken("s3cret"))
	for _, tc := range []struct {
		name, method, path, token, body string
		code                            int
	}{
		{"no token", "POST", "/admin/detach", "", "", 401},
		{"wrong token", "POST", "/admin/detach", "nope", "", 401},
		{"wrong token on attach", "POST", "/admin/attach", "s3cret!", "", 401},
		{"malformed JSON", "POST", "/admin/detach", "s3cret", `{"reason":`, 400},
		{"unknown field", "POST", "/admin/detach", "s3cret", `{"why": "x"}`, 400},
		{"body too large", "POST", "/admin/detach", "s3cret", `{"reason": "` + strings.Repeat("x", 20000) + `"}`, 413},
		{"trailing data", "POST", "/admin/detach", "s3cret", `{"reason": "x"}}`, 400},
		{"field in another case", "POST", "/admin/detach", "s3cret", `{"REASON": "x"}`, 400},
		{"duplicate field", "POST", "/admin/detach", "s3cret", `{"reason": "x", "reason": "y"}`, 400},
		{"attach with a body", "POST", "/admin/attach", "s3cret", `{"force": true}`, 400},
		{"attach with trailing data", "POST", "/admin/attach", "s3cret", `{}]`, 400},
		{"wrong method", "GET", "/admin/detach", "s3cret", "", 405},
		{"wrong method on status", "POST", "/status", "", "", 405},
		{"unknown path", "GET", "/admin", "", "", 404},
	} {
		code, body := testutil.HTTP(t, tc.method, a.url(tc.path), tc.token, tc.body)
		var e map[string]any
		if code != tc.code || json.Unmarshal([]byte(body), &e) != nil || e["error"] == nil {
			t.Errorf("%s: %d %s, want %d with a JSON error", tc.name, code, body, tc.code)
		}
	}
	if st := a.Status(); st.State != shard.StateAttached {
		t.Fatalf("a rejected request changed the runner: %+v", st)
	}
	// The scheme is case-insensitive (RFC 9110).
	req, _ := http.NewRequest("POST", a.url("/admin/attach"), nil)
	req.Header.Set("Authorization", "bearer s3cret")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 200 {
		t.Fatalf("lower-case bearer scheme: %v %v", err, resp)
	} else {
		resp.Body.Close()
	}
}

func TestStatusAndEveryMetric(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start("a")
	e.enqueue("noop", `{}`, 20)
	e.enqueue("sleep", `{"ms": 1500}`, 2)
	testutil.Until(t, 10*time.Second, "noops done and sleeps running", func() (bool, string) {
		// The metrics count a completion after its write commits.
		return e.counts()[tasks.Completed] == 20 && a.exec.InFlight() == 2 &&
			metric(t, a, "shardrun_tasks_finished_total", "noop", "completed") == 20 &&
			metric(t, a, "shardrun_task_duration_seconds") == 20, jsonString(e.counts())
	})
	testutil.Until(t, 5*time.Second, "a keep-alive recorded", func() (bool, string) {
		return metric(t, a, "shardrun_lease_deadline_seconds") > 0, "no keep-alive yet"
	})
	code, body := testutil.HTTP(t, "GET", a.url("/status"), "", "")
	var st Status
	if code != 200 || json.Unmarshal([]byte(body), &st) != nil {
		t.Fatalf("status: %d %s", code, body)
	}
	if st.RunnerID != "a" || st.State != "attached" || len(st.Owned) != testShards || len(st.Assigned) != testShards ||
		st.InFlight != 2 || st.LeaseTimeLeft <= 0 || st.Owned[0].Epoch == 0 {
		t.Fatalf("status: %s", body)
	}
	_, metrics := testutil.HTTP(t, "GET", a.url("/metrics"), "", "")
	for _, name := range []string{
		"shardrun_detached", "shardrun_lease_keepalive_failures_total", "shardrun_lease_keepalive_failure_streak",
		"shardrun_lease_deadline_seconds", "shardrun_shards_owned", "shardrun_shard_acquisitions_total",
		"shardrun_shard_releases_total", "shardrun_acquire_retry_attempts_total", "shardrun_fence_rejections_total",
		"shardrun_tasks_claimed_total", "shardrun_tasks_finished_total", "shardrun_task_duration_seconds",
		"shardrun_tasks_in_flight", "shardrun_shards_assigned",
	} {
		if !strings.Contains(metrics, "\n"+name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	for name, want := range map[string]float64{
		"shardrun_shards_owned": testShards, "shardrun_shard_acquisitions_total": testShards,
		"shardrun_tasks_claimed_total": 22, "shardrun_tasks_in_flight": 2,
	} {
		if got := metric(t, a, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	if got := metric(t, a, "shardrun_lease_deadline_seconds"); got <= 0 || got > 2 {
		t.Errorf("shardrun_lease_deadline_seconds = %v, want within the 2s TTL", got)
	}
	if !strings.Contains(metrics, `shardrun_tasks_finished_total{kind="noop",outcome="completed"} 20`) ||
		!strings.Contains(metrics, "shardrun_task_duration_seconds_count 20") {
		t.Errorf("task metrics did not move:\n%s", grep(metrics, "shardrun_task"))
	}
	// detached moves with a detach; releases with the release it causes.
	testutil.HTTP(t, "POST", a.url("/admin/detach"), "", "")
	testutil.Until(t, 5*time.Second, "detached and released", func() (bool, string) {
		return metric(t, a, "shardrun_detached") == 1 &&
			metric(t, a, "shardrun_shard_releases_total") == testShards, "not yet"
	})
}

func TestConfigErrorsNameTheFlag(t *testing.T) {
	t.Parallel()
	base := DefaultConfig()
	base.DatabaseURL = "postgres://u@127.0.0.1/db"
	for flag, mutate := range map[string]func(*Config){
		"--etcd-endpoints":     func(c *Config) { c.EtcdEndpoints = []string{"127.0.0.1:2379"} },
		"--etcd-prefix":        func(c *Config) { c.EtcdPrefix = "shardrun" },
		"--cluster":            func(c *Config) { c.Cluster = "a/b" },
		"--shard-count":        func(c *Config) { c.ShardCount = 0 },
		"--database-url":       func(c *Config) { c.DatabaseURL = "postgres://u@host:port/db" },
		"--lease-ttl":          func(c *Config) { c.LeaseTTL = 1500 * time.Millisecond },
		"--detach-margin":      func(c *Config) { c.DetachMargin = c.LeaseTTL },
		"--keepalive-failures": func(c *Config) { c.KeepaliveFailures = 0 },
		"--heartbeat-interval": func(c *Config) { c.HeartbeatInterval = 0 },
		"--max-workers":        func(c *Config) { c.MaxWorkers = 0 },
		"--retry-cap":          func(c *Config) { c.RetryCap = time.Millisecond },
		"--admin-token":        func(c *Config) { c.AdminAddr = "0.0.0.0:9090" },
		"--admin-addr":         func(c *Config) { c.AdminAddr = "nonsense" },
		"--db-max-conns":       func(c *Config) { c.DBMaxConns = 1 << 32 },
		"--recovery-window":    func(c *Config) { c.RecoveryWindow = -time.Second },
		"--poll-interval":      func(c *Config) { c.PollInterval = 0 },
		"--handoff-timeout":    func(c *Config) { c.HandoffTimeout = 0 },
		"--runner-id":          func(c *Config) { c.RunnerID = "a\x00b" },
	} {
		cfg := base
		mutate(&cfg)
		err := cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), flag) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: got %v", flag, err)
		}
	}
	ok := base
	ok.AdminAddr, ok.AdminToken = "0.0.0.0:9090", "t"
	if err := ok.Validate(); err != nil {
		t.Fatalf("a non-loopback address with a token: %v", err)
	}
	// The parts are each package's: the runner's Validate names the same
	// flags they do.
	bad := base
	bad.ShardCount = shard.MaxShardCount + 1
	if err := bad.Validate(); err == nil || err.Error() != shard.ValidateShardCount(bad.ShardCount).Error() {
		t.Errorf("shard count: %v", err)
	}
}

func TestUnreachableEtcdAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := e.config("a")
	cfg.EtcdEndpoints = []string{"http://127.0.0.1:1"}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_ = r.HandleBuiltins()
	err = r.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "--etcd-endpoints") {
		t.Fatalf("start with no etcd: %v", err)
	}
}

// metric sums the values of the runner's metric name whose label values
// include all of labels (counters and gauges; histograms give their count).
func metric(t testing.TB, r *testRunner, name string, labels ...string) float64 {
	t.Helper()
	families, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			for _, want := range labels {
				found := false
				for _, lp := range m.GetLabel() {
					found = found || lp.GetValue() == want
				}
				if !found {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

func jsonString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func grep(text, substr string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// A runner given an etcd client and a store uses them (no endpoints, no
// database URL) and leaves them open when it stops: the embedding program
// owns their TLS and pool settings.
func TestRunnerUsesTheGivenEtcdClientAndStore(t *testing.T) {
	e := newEnv(t)
	r := e.start("injected", func(c *Config, _ *Runner) {
		c.EtcdEndpoints, c.DatabaseURL, c.Etcd, c.Store = nil, "", e.admin, e.store
	})
	ids := e.enqueue("noop", `{}`, 5)
	testutil.Until(t, 15*time.Second, "tasks completed by the runner on the given clients", func() (bool, string) {
		return e.task(ids[4]).State == tasks.Completed, jsonString(e.counts())
	})
	r.stop()
	if _, err := e.admin.Get(context.Background(), "/"); err != nil {
		t.Fatalf("the runner closed the etcd client it was given: %v", err)
	}
	if err := e.store.Pool().Ping(context.Background()); err != nil {
		t.Fatalf("the runner closed the store it was given: %v", err)
	}
}

// A runner serving the most queues it may (1,000) claims a task of its last
// queue when its enqueue is notified, with no poll to help (the poll
// interval an hour), and one nobody notified (a quiet insert) by the next
// poll of a runner that polls: with more than four queues it asks which
// have tasks instead of claiming each (finding 5 of the hostile-input
// review), and must miss neither.
func TestManyQueuesClaimOnNotificationAndPoll(t *testing.T) {
	t.Parallel()
	queues := map[string]int{}
	for i := range executor.MaxQueues {
		queues[fmt.Sprintf("q%04d", i)] = 0
	}
	last := fmt.Sprintf("q%04d", executor.MaxQueues-1)
	for _, tc := range []struct {
		name  string
		poll  time.Duration
		quiet bool
	}{{"notified, no poll", time.Hour, false}, {"by the poll, not notified", 200 * time.Millisecond, true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			r := e.start("r", func(c *Config, _ *Runner) { c.Queues, c.PollInterval = queues, tc.poll })
			testutil.Until(t, 10*time.Second, "every shard owned", func() (bool, string) {
				return len(r.Status().Owned) == testShards, fmt.Sprintf("%d owned", len(r.Status().Owned))
			})
			ctx := context.Background()
			var id int64
			insert := `INSERT INTO tasks (kind, shard, key, queue) VALUES ('noop', 5, 'k', $1) RETURNING id`
			if tc.quiet {
				insert = `WITH q AS (SELECT set_config('shardrun.notify', 'off', true))
					INSERT INTO tasks (kind, shard, key, queue) SELECT 'noop', 5, 'k', $1 FROM q RETURNING id`
			}
			if err := e.store.Pool().QueryRow(ctx, insert, last).Scan(&id); err != nil {
				t.Fatal(err)
			}
			took := testutil.Until(t, 10*time.Second, "the task of queue "+last+" completed", func() (bool, string) {
				got := e.task(id)
				return got.State == tasks.Completed, string(got.State)
			})
			t.Logf("completed %s after the insert", took)
		})
	}
}
