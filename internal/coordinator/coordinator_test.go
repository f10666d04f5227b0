package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/leadership"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) {
	pgtest.Main(m, testutil.EtcdLeaks...)
}

const prefix = "/shardrun/test/"

type env struct {
	t     *testing.T
	dsn   string
	etcd  *embedetcd.Server
	admin *clientv3.Client
	store *store.Store
}

func newEnv(t *testing.T) *env {
	t.Helper()
	st, dsn := pgtest.NewStore(t, store.Options{})
	srv, admin := testutil.Etcd(t)
	return &env{t: t, dsn: dsn, etcd: srv, admin: admin, store: st}
}

// signals are what the coordinators of one test tell it: leadership terms
// on one timeline, and each coordinator's sweep passes.
type signals struct {
	leadership *testsignal.Signal[leadership.Event]
	// passes are every coordinator's leader passes, of every service.
	passes map[string]*testsignal.Signal[leader.Event]
}

func newSignals() *signals {
	return &signals{leadership: testsignal.New[leadership.Event](), passes: map[string]*testsignal.Signal[leader.Event]{}}
}

// sweeps are coordinator id's sweep passes.
func (s *signals) sweeps(id string) []leader.Event {
	return s.of(id, "sweep")
}

// of are coordinator id's passes of service.
func (s *signals) of(id, service string) []leader.Event {
	var out []leader.Event
	for _, r := range s.passes[id].Events() {
		if r.Service == service {
			out = append(out, r)
		}
	}
	return out
}

// swept reports whether coordinator id ran a sweep pass that applied.
func (s *signals) swept(id string) bool {
	for _, r := range s.sweeps(id) {
		if r.Err == nil {
			return true
		}
	}
	return false
}

type running struct {
	*Coordinator
	cancel context.CancelFunc
	done   chan error
}

func (e *env) start(id string, sig *signals, mut ...func(*Config)) *running {
	e.t.Helper()
	cfg := Config{
		ID: id, Client: testutil.Client(e.t, e.etcd.Endpoints()...), Prefix: prefix, ShardCount: 16, Store: e.store,
		ElectionTTL: 2 * time.Second, HTTPAddr: "127.0.0.1:0",
		Sweep:  sweeper.Config{Interval: 50 * time.Millisecond, StaleThreshold: time.Second, HeartbeatInterval: 200 * time.Millisecond},
		Logger: hclog.New(&hclog.LoggerOptions{Name: id, Level: hclog.Warn, Output: testWriter{e.t}}),
	}
	for _, m := range mut {
		m(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	if sig != nil {
		sig.passes[id] = testsignal.New[leader.Event]()
		c.leader.Terms, c.leader.Passes = sig.leadership, sig.passes[id]
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{Coordinator: c, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	select {
	case <-c.Started():
	case err := <-r.done:
		e.t.Fatalf("coordinator %s: %v", id, err)
	}
	e.t.Cleanup(r.stop)
	return r
}

func (r *running) stop() {
	r.cancel()
	if err := <-r.done; err != nil {
		panic(err)
	}
	r.done <- nil
}

func TestExactlyOneCoordinatorSweeps(t *testing.T) {
	e := newEnv(t)
	sig := newSignals()
	a := e.start("coord-a", sig)
	b := e.start("coord-b", sig)
	testutil.WaitFor(t, 10*time.Second, "a leader", func() bool { return a.IsLeader() || b.IsLeader() })
	leader, standby := a, b
	if b.IsLeader() {
		leader, standby = b, a
	}
	for range 20 {
		if a.IsLeader() == b.IsLeader() {
			t.Fatal("both or neither coordinator leads")
		}
		time.Sleep(10 * time.Millisecond) // sampling a steady state over time
	}
	passes := map[string]int{}
	for id := range sig.passes {
		passes[id] = len(sig.sweeps(id))
	}
	if passes[leader.cfg.ID] == 0 || passes[standby.cfg.ID] != 0 {
		t.Fatalf("sweep passes by coordinator: %v; only the leader (%s) may sweep", passes, leader.cfg.ID)
	}
	var v ClusterView
	getJSON(t, "http://"+standby.Addr()+"/api/cluster", &v)
	if v.Leader != leader.cfg.ID || v.Coordinator != standby.cfg.ID {
		t.Fatalf("cluster view from the standby names leader %q (want %q)", v.Leader, leader.cfg.ID)
	}
}

// Killing the leader's session hands leadership to the standby within the
// election TTL, and the deposed leader sweeps nothing after the new leader
// raised its fence.
func TestStandbyTakesOverWhenTheLeaderSessionDies(t *testing.T) {
	e := newEnv(t)
	sig := newSignals()
	a := e.start("coord-a", sig)
	testutil.WaitFor(t, 10*time.Second, "a leads", a.IsLeader)
	b := e.start("coord-b", sig)
	// Stale work for the sweeps to find throughout.
	seedStale(t, e.store, 200)

	sess := a.leader.Session()
	killed := time.Now()
	if _, err := e.admin.Revoke(context.Background(), sess.Lease()); err != nil {
		t.Fatal(err)
	}
	took := testutil.WaitFor(t, 2*a.cfg.ElectionTTL, "b leads", b.IsLeader)
	t.Logf("standby led %s after the leader's session was revoked (election TTL %s)", took, a.cfg.ElectionTTL)

	var aStopped, bStarted time.Time
	var bEpoch int64
	for _, ev := range sig.leadership.Events() {
		if ev.ID == "coord-a" && !ev.Leader && ev.At.After(killed) && aStopped.IsZero() {
			aStopped = ev.At
		}
		if ev.ID == "coord-b" && ev.Leader && bStarted.IsZero() {
			bStarted, bEpoch = ev.At, ev.Epoch
		}
	}
	testutil.WaitFor(t, 5*time.Second, "a stopped leading", func() bool { return !a.IsLeader() })
	t.Logf("a stopped sweeping %s after the kill; b raised fence %d and started %s after the kill",
		aStopped.Sub(killed), bEpoch, bStarted.Sub(killed))
	for _, pass := range sig.sweeps("coord-a") {
		if pass.Started.After(bStarted) && pass.Err == nil {
			t.Fatalf("a's pass started %s after b raised its fence and still applied: %+v", pass.Started.Sub(bStarted), pass)
		}
	}
	// b, not a, keeps sweeping.
	testutil.WaitFor(t, 5*time.Second, "b sweeps", func() bool { return sig.swept("coord-b") })
	// a campaigns again with a new session and stands by.
	testutil.WaitFor(t, 5*time.Second, "a has a new session", func() bool {
		s := a.leader.Session()
		return s != nil && s.Lease() != sess.Lease()
	})
	if a.IsLeader() {
		t.Fatal("a leads again although b holds the leadership")
	}
}

func seedStale(t *testing.T, st *store.Store, n int) {
	t.Helper()
	pgtest.InsertClaimed(t, st, `INSERT INTO tasks (kind, shard, key) SELECT 'k', g % 16, g::text FROM generate_series(1, $1) g RETURNING id`,
		"gone", 1, "now() - interval '1 hour'", n)
}

// The leader resigns on shutdown: a's election session (TTL 30s) would
// outlive the wait, so b leading within it proves the resignation.
func TestResignOnShutdownHandsOverAtOnce(t *testing.T) {
	e := newEnv(t)
	a := e.start("coord-a", nil, func(c *Config) { c.ElectionTTL = 30 * time.Second })
	testutil.WaitFor(t, 10*time.Second, "a leads", a.IsLeader)
	b := e.start("coord-b", nil)
	a.stop()
	took := testutil.WaitFor(t, 15*time.Second, "b leads, before a's session could expire", b.IsLeader)
	t.Logf("after a's shutdown b led in %s (a resigned; no TTL wait)", took)
}

func TestTasksAPI(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.start("coord", nil, func(c *Config) { c.APIToken = "tok" })
	base := "http://" + c.Addr()
	code, body := testutil.HTTP(t, "POST", base+"/api/tasks", "tok", `{"kind": "noop", "key": "user-42", "payload": {"n": 1}, "max_attempts": 3}`)
	if code != 201 {
		t.Fatalf("enqueue: %d %s", code, body)
	}
	var created struct {
		ID, Shard int64
		Warnings  []string
	}
	_ = json.Unmarshal([]byte(body), &created)
	if len(created.Warnings) != 1 || !strings.Contains(created.Warnings[0], `no attached runner serves queue "default" with a handler of kind "noop"`) {
		t.Fatalf("enqueueing a kind no runner handles must warn: %s", body)
	}
	if created.Shard != int64(tasks.ShardOf("user-42", 16)) {
		t.Fatalf("shard %d", created.Shard)
	}
	var task tasks.Task
	code, body = testutil.HTTP(t, "GET", fmt.Sprintf("%s/api/tasks/%d", base, created.ID), "tok", "")
	if code != 200 || json.Unmarshal([]byte(body), &task) != nil {
		t.Fatalf("reading the task back: %d %s", code, body)
	}
	if task.Kind != "noop" || task.State != tasks.Ready || task.MaxAttempts != 3 || string(task.Payload) != `{"n":1}` {
		t.Fatalf("task: %+v", task)
	}
	code, body = testutil.HTTP(t, "POST", base+"/api/tasks", "tok", `[{"kind": "noop"}, {"kind": "sleep", "payload": {"ms": 5}}]`)
	if code != 201 || !strings.Contains(body, `"enqueued":2`) {
		t.Fatalf("batch: %d %s", code, body)
	}
	past := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339)
	for _, tc := range []struct {
		name, token, body string
		code              int
		want              string
	}{
		{"no token", "", `{"kind": "noop"}`, 401, "bearer"},
		{"empty kind", "tok", `{"kind": ""}`, 400, `"field":"kind"`},
		{"payload not JSON", "tok", `{"kind": "k", "payload": nope}`, 400, "malformed JSON"},
		{"max attempts zero", "tok", `{"kind": "k", "max_attempts": 0}`, 400, `"field":"max_attempts"`},
		{"deadline in the past", "tok", `{"kind": "k", "deadline": "` + past + `"}`, 400, `"field":"deadline"`},
		{"unknown field", "tok", `{"kind": "k", "urgency": 3}`, 400, "unknown field"},
		{"priority out of range", "tok", `{"kind": "k", "priority": 0}`, 400, `"field":"priority"`},
		{"queue name", "tok", `{"kind": "k", "queue": "a b"}`, 400, `"field":"queue"`},
		{"bad task in a batch", "tok", `[{"kind": "a"}, {"kind": "b"}, {"kind": ""}]`, 400, `"index":2`},
		{"empty batch", "tok", `[]`, 400, "1 to 10000"},
		{"trailing data", "tok", `{"kind": "a"} {"kind": "b"}`, 400, "unexpected data"},
		{"trailing brace", "tok", `{"kind":"noop"}}`, 400, "unexpected data after the JSON value"},
		{"trailing bracket", "tok", `[{"kind":"noop"}]]`, 400, "unexpected data after the JSON value"},
		{"field name in another case", "tok", `{"KIND": "noop"}`, 400, `case-sensitive, did you mean \"kind\"`},
		{"duplicate field", "tok", `{"kind": "a", "kind": "b"}`, 400, `duplicate key \"kind\"`},
		{"NUL in kind", "tok", `{"kind": "a\u0000b"}`, 400, `"field":"kind"`},
		{"NUL in key", "tok", `{"kind": "k", "key": "\u0000"}`, 400, `"field":"key"`},
		{"invalid UTF-8 in kind", "tok", "{\"kind\": \"caf\xe9\"}", 400, `"field":"kind"`},
		{"invalid UTF-8 in key", "tok", "{\"kind\": \"k\", \"key\": \"user-\xff\"}", 400, `"field":"key"`},
		{"NUL in payload", "tok", `{"kind": "k", "payload": {"a": "\u0000"}}`, 400, `"field":"payload"`},
		{"lone surrogate in payload", "tok", `{"kind": "k", "payload": ["\ud800"]}`, 400, `"field":"payload"`},
		{"max attempts beyond int4", "tok", `{"kind": "k", "max_attempts": 2147483648}`, 400, `"field":"max_attempts"`},
		{"max attempts not an integer", "tok", `{"kind": "k", "max_attempts": 1e3}`, 400, `"field":"max_attempts"`},
		{"zero deadline", "tok", `{"kind": "k", "deadline": "0001-01-01T00:00:00Z"}`, 400, `"field":"deadline"`},
		{"zero run_after", "tok", `{"kind": "k", "run_after": "0001-01-01T00:00:00Z"}`, 400, `"field":"run_after"`},
		{"not a time", "tok", `{"kind": "k", "run_after": "tomorrow"}`, 400, `"field":"run_after"`},
		{"bad field deep in a batch", "tok", `[{"kind": "a"}, {"kind": "b", "payload": {"x": 1, "x": 2}}]`, 400, `"index":1`},
		{"batch with trailing data", "tok", `[{"kind": "a"}] x`, 400, "unexpected data"},
		{"null body", "tok", `null`, 400, "malformed JSON"},
		{"empty body", "tok", ``, 400, "no JSON value"},
		{"too large", "tok", `{"kind": "k", "payload": "` + strings.Repeat("x", MaxRequestBody) + `"}`, 413, "larger than"},
	} {
		code, body := testutil.HTTP(t, "POST", base+"/api/tasks", tc.token, tc.body)
		if code != tc.code || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %s, want %d with %q", tc.name, code, body, tc.code, tc.want)
		}
	}
	if code, _ := testutil.HTTP(t, "GET", base+"/api/tasks/999999", "tok", ""); code != 404 {
		t.Errorf("missing task: %d", code)
	}
	if code, _ := testutil.HTTP(t, "GET", fmt.Sprintf("%s/api/tasks/%d", base, created.ID), "", ""); code != 401 {
		t.Errorf("reading a task without the token: %d, want 401", code)
	}
	for _, id := range []string{"abc", "+1", "001", "0", "-1", "1.0", "1e3", "0x1", "9223372036854775808", "%201"} {
		if code, body := testutil.HTTP(t, "GET", base+"/api/tasks/"+id, "tok", ""); code != 400 || !strings.Contains(body, "without sign or leading zeros") {
			t.Errorf("id %q: %d %s, want 400", id, code, body)
		}
	}
	if code, _ := testutil.HTTP(t, "DELETE", base+"/api/tasks/1", "tok", ""); code != 405 {
		t.Errorf("wrong method: %d", code)
	}
	// The scheme is case-insensitive (RFC 9110).
	req, _ := http.NewRequest("POST", base+"/api/tasks", strings.NewReader(`{"kind": "noop"}`))
	req.Header.Set("Authorization", "bearer tok")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 201 {
		t.Fatalf("lower-case bearer scheme: %v %v", err, resp)
	} else {
		resp.Body.Close()
	}
	if counts, _ := e.store.CountByState(context.Background()); counts[tasks.Ready] != 4 {
		t.Fatalf("rejected requests enqueued something: %v", counts)
	}
}

// TestClusterShowsRunnerHealth: a runner whose keep-alives stopped is
// unresponsive while its key lives, a runner whose key vanished without a
// drain is lost and one that drained has left, and both stay listed; the
// rate counts recent completions; only attached runners handle kinds.
func TestClusterShowsRunnerHealth(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.start("coord", nil)
	ctx := context.Background()
	ghost := func(id, state string, kinds ...string) clientv3.LeaseID {
		lease, err := e.admin.Grant(ctx, 4)
		if err != nil {
			t.Fatal(err)
		}
		info, _ := json.Marshal(shard.RunnerInfo{ID: id, State: state, Kinds: kinds})
		if _, err := e.admin.Put(ctx, prefix+"runners/"+id, string(info), clientv3.WithLease(lease.ID)); err != nil {
			t.Fatal(err)
		}
		return lease.ID
	}
	ghost("paused", shard.StateDetached, "noop")
	lost := ghost("crashed", shard.StateAttached)
	left := ghost("drained", shard.StateDraining)
	if _, err := c.Cluster(ctx); err != nil { // the coordinator sees them all once
		t.Fatal(err)
	}
	for _, l := range []clientv3.LeaseID{lost, left} {
		if _, err := e.admin.Revoke(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	seedStale(t, e.store, 1)
	if _, err := e.store.Pool().Exec(ctx, `
		WITH k AS (DELETE FROM task_claims RETURNING id),
		u AS (UPDATE tasks SET state = 'completed', finished_at = now() WHERE id IN (SELECT id FROM k) RETURNING id, finished_at)
		INSERT INTO task_finished (state, id, finished_at, queue) SELECT 'completed', id, finished_at, 'default' FROM u`); err != nil {
		t.Fatal(err)
	}
	health := func(rs []RunnerView) map[string]string {
		m := map[string]string{}
		for _, r := range rs {
			m[r.ID] = r.Health
		}
		return m
	}
	var v ClusterView
	testutil.Until(t, 10*time.Second, "the paused runner's lease runs low", func() (bool, string) {
		var err error
		v, err = c.Cluster(ctx)
		return err == nil && health(v.Runners)["paused"] == HealthUnresponsive, fmt.Sprintf("%+v %v", v.Runners, err)
	})
	if got := health(v.Gone); got["crashed"] != HealthLost || got["drained"] != HealthLeft || len(got) != 2 {
		t.Errorf("gone runners %v, want crashed lost and drained left", got)
	}
	if v.Rates[tasks.Completed] != 1.0/rateWindow.Seconds() {
		t.Errorf("completion rate %v, want one task over the window", v.Rates)
	}
	code, body := testutil.HTTP(t, "POST", "http://"+c.Addr()+"/api/tasks", "", `{"kind": "noop"}`)
	if code != 201 || !strings.Contains(body, `no attached runner serves queue \"default\" with a handler of kind \"noop\"`) {
		t.Errorf("a kind only a detached runner handles must draw a warning: %d %s", code, body)
	}
}

func TestMetricsAndHealth(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.start("coord", nil)
	testutil.WaitFor(t, 10*time.Second, "leads", c.IsLeader)
	seedStale(t, e.store, 3)
	// The sweep counts what it released after its write commits: wait for
	// the count, not only for the tasks.
	var body string
	testutil.WaitFor(t, 10*time.Second, "stale claims swept after the grace period, and counted", func() bool {
		counts, _ := e.store.CountByState(context.Background())
		_, body = testutil.HTTP(t, "GET", "http://"+c.Addr()+"/metrics", "", "")
		return counts[tasks.Ready] == 3 && strings.Contains(body, `shardrun_sweep_released_total{database="main"} 3`)
	})
	for _, want := range []string{
		"shardrun_coordinator_is_leader 1", `shardrun_sweeps_total{database="main"}`, `shardrun_sweep_duration_seconds_count{database="main"}`,
		`shardrun_sweep_released_total{database="main"} 3`, `shardrun_sweep_deadline_failed_total{database="main"} 0`,
		`shardrun_sweep_dead_total{database="main"} 0`, `shardrun_sweep_errors_total{database="main"} 0`, `shardrun_tasks{state="running"}`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if code, body := testutil.HTTP(t, "GET", "http://"+c.Addr()+"/healthz", "", ""); code != 200 || !strings.Contains(body, `"leader":true`) {
		t.Errorf("healthz: %d %s", code, body)
	}
}

func TestConfigErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for flag, mut := range map[string]func(*Config){
		"--election-ttl":    func(c *Config) { c.ElectionTTL = 1500 * time.Millisecond },
		"--stale-threshold": func(c *Config) { c.Sweep.StaleThreshold = time.Second; c.Sweep.HeartbeatInterval = 2 * time.Second },
		"--shard-count":     func(c *Config) { c.ShardCount = -1 },
		"--http-addr":       func(c *Config) { c.HTTPAddr = "127.0.0.1:99999" },
		"--api-token":       func(c *Config) { c.HTTPAddr = ":8080" },
		"--coordinator-id":  func(c *Config) { c.ID = "" },
		"--max-attempts":    func(c *Config) { c.MaxAttempts = 1001 },
	} {
		cfg := Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: e.store}
		mut(&cfg)
		if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s: %v", flag, err)
		}
	}
	// New fills zero settings with the defaults; Validate, which a binary
	// calls on its flags, refuses a zero that would silently become one.
	cfg := Config{ID: "c", Prefix: prefix, ShardCount: 16}
	if err := cfg.WithDefaults().Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for flag, mut := range map[string]func(*Config){
		"--election-ttl":   func(c *Config) { c.ElectionTTL = 0 },
		"--max-attempts":   func(c *Config) { c.MaxAttempts = 0 },
		"--sweep-batch":    func(c *Config) { c.Sweep.BatchSize = 0 },
		"--sweep-interval": func(c *Config) { c.Sweep.Interval = 0 },
	} {
		c := cfg.WithDefaults()
		mut(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s given as 0: %v", flag, err)
		}
	}
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	code, body := testutil.HTTP(t, "GET", url, "", "")
	if code != 200 {
		t.Fatalf("GET %s: %d %s", url, code, body)
	}
	if err := json.Unmarshal([]byte(body), v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
