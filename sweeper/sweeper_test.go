package sweeper

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const epoch = 7

type fixture struct {
	t     testing.TB
	dsn   string
	store *store.Store
	clock *clock.Fake
	// uptime is the database uptime the sweeper sees: the test server
	// started seconds ago, while the fake clock moves by hours.
	uptime atomic.Int64
}

// reopen replaces the fixture's store by a new one on the same database.
func (f *fixture) reopen() *store.Store {
	f.t.Helper()
	st, err := store.Open(context.Background(), f.dsn, store.Options{MaxConns: 10})
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(st.Close)
	f.store = st
	return st
}

// uptimeStore is the store with the database's uptime under the test's
// control.
type uptimeStore struct {
	*store.Store
	f *fixture
}

func (u uptimeStore) Uptime(context.Context) (time.Duration, error) {
	return time.Duration(u.f.uptime.Load()), nil
}

func setup(t testing.TB) *fixture {
	t.Helper()
	ctx := context.Background()
	st, dsn := pgtest.NewStore(t, store.Options{MaxConns: 10})
	if ok, err := st.RaiseLeaderFence(ctx, "test", epoch); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if _, err := st.RaiseFences(ctx, "r", "", []claims.ShardEpoch{{Shard: 0, Epoch: 1}}); err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, store: st, dsn: dsn, clock: clock.NewFake()}
	f.uptime.Store(int64(24 * time.Hour))
	return f
}

// testSweeper is a sweeper in a term of its own, whose passes the test
// runs one at a time.
type testSweeper struct {
	*Sweeper
	term leader.Term
}

// passResult is one pass: the sweeper's result, its error and statements.
type passResult struct {
	Result
	Err        error
	Statements int
}

func (s testSweeper) Pass(ctx context.Context) passResult {
	r, p := leader.Once(ctx, s.Sweeper, s.term)
	return passResult{Result: r.Detail.(Result), Err: r.Err, Statements: p.Statements}
}

func (f *fixture) sweeper(mut ...func(*Config)) testSweeper {
	f.t.Helper()
	cfg := Config{Interval: time.Second, StaleThreshold: 30 * time.Second,
		HeartbeatInterval: 5 * time.Second, Backoff: store.Backoff{Base: time.Second, Cap: time.Minute}}
	for _, m := range mut {
		m(&cfg)
	}
	s, err := New(uptimeStore{f.store, f}, cfg, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	term := leader.Term{Epoch: epoch, Start: f.clock.Now(), Clock: f.clock, Log: hclog.NewNullLogger()}
	s.Begin(term)
	return testSweeper{Sweeper: s, term: term}
}

// running enqueues n tasks on shard 0 and claims them; age backdates their
// claim (and heartbeat, if beat is set) in the database.
func (f *fixture) running(n, maxAttempts int) []tasks.Task {
	f.t.Helper()
	ctx := context.Background()
	for i := range n {
		if _, err := f.store.Enqueue(ctx, store.Insert{NewTask: tasks.NewTask{Kind: "k", Payload: json.RawMessage(`{}`), Options: tasks.Options{Key: fmt.Sprint(i), MaxAttempts: maxAttempts}.WithDefaults(0)}, Shard: 0}); err != nil {
			f.t.Fatal(err)
		}
	}
	got, err := f.store.Claim(ctx, "r", []claims.ShardEpoch{{Shard: 0, Epoch: 1}}, tasks.DefaultQueue, []string{"k"}, n, n)
	if err != nil || len(got) != n {
		f.t.Fatalf("claimed %d of %d: %v", len(got), n, err)
	}
	return got
}

func (f *fixture) exec(sql string, args ...any) {
	f.t.Helper()
	if _, err := f.store.Pool().Exec(context.Background(), sql, args...); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fixture) state(id int64) tasks.Task {
	f.t.Helper()
	t, err := f.store.Get(context.Background(), id)
	if err != nil {
		f.t.Fatal(err)
	}
	return t
}

func TestStaleRuleAfterGracePeriod(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.sweeper()
	task := f.running(1, 3)[0]
	pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'")

	r := s.Pass(context.Background())
	if !r.InGrace || r.Requeued != 0 || r.Err != nil {
		t.Fatalf("a new leader swept stale claims inside its grace period: %+v", r)
	}
	f.clock.Advance(29 * time.Second)
	if r := s.Pass(context.Background()); !r.InGrace || r.Requeued != 0 {
		t.Fatalf("swept 1s before the grace period ended: %+v", r)
	}
	f.clock.Advance(time.Second)
	r = s.Pass(context.Background())
	if r.InGrace || r.Requeued != 1 || r.Err != nil {
		t.Fatalf("after the grace period: %+v", r)
	}
	got := f.state(task.ID)
	if got.State != tasks.Ready || got.Attempt != 2 || len(got.Errors) != 1 || !got.RunAfter.After(got.Errors[0].At) {
		t.Fatalf("requeued with backoff (run_after after the requeue): %+v", got)
	}
}

func TestDeadlineRuleNeedsNoGraceAndWinsOverStaleness(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.sweeper()
	ts := f.running(2, 3)
	both, recent := ts[0], ts[1]
	pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'", both.ID)
	pgtest.Retime(f.t, f.store, "deadline", "now() - interval '1 minute'", both.ID)
	// A running task just past its deadline is its runner's to finish: the
	// sweep waits one stale threshold, so a success returned before the
	// deadline but written late (a database outage) still lands.
	pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'", recent.ID)
	pgtest.Retime(f.t, f.store, "deadline", "now() - interval '1 second'", recent.ID)
	f.clock.Advance(time.Hour) // out of grace, so both rules run
	r := s.Pass(context.Background())
	if r.DeadlineFailed != 1 || r.Requeued != 0 {
		t.Fatalf("a task past its deadline and stale: %+v", r)
	}
	if rs, err := f.store.Complete(context.Background(), "r", []claims.Completion{{Ref: claims.RefOf(recent)}}); err != nil || rs[0].Outcome != claims.Applied {
		t.Fatalf("the late completion of a task within the deadline grace: %v %v", rs, err)
	}
	if got := f.state(both.ID); got.State != tasks.Failed || got.Errors[len(got.Errors)-1].Error != "deadline exceeded" {
		t.Fatalf("row: %+v", got)
	}
	// Ready tasks past their deadline fail even inside the grace period.
	f2 := setup(t)
	s2 := f2.sweeper()
	id, err := f2.store.Enqueue(context.Background(), store.Insert{NewTask: tasks.NewTask{Kind: "k", Payload: json.RawMessage(`{}`), Options: tasks.Options{Key: "x", MaxAttempts: 1}.WithDefaults(0)}, Shard: 0})
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Retime(f2.t, f2.store, "deadline", "now() - interval '1 second'")
	if r := s2.Pass(context.Background()); !r.InGrace || r.DeadlineFailed != 1 {
		t.Fatalf("deadline rule inside the grace period: %+v", r)
	}
	if got := f2.state(id); got.State != tasks.Failed {
		t.Fatalf("ready task past its deadline: %+v", got)
	}
}

// The stale rule waits while the database has been up for less than the
// threshold (no heartbeat could be written while it was down) and for one
// threshold after the sweeper itself could reach it again.
func TestStaleRuleWaitsAfterOutages(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.sweeper()
	ts := f.running(2, 3)
	task, late := ts[0], ts[1]
	pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'")
	// Its runner's outcome may still be on the way after the outage: the
	// deadline rule leaves running tasks alone during the grace too.
	pgtest.Retime(f.t, f.store, "deadline", "now() - interval '5 minutes'", late.ID)
	f.clock.Advance(time.Hour)
	f.uptime.Store(int64(10 * time.Second))
	if r := s.Pass(context.Background()); !r.InGrace || r.Requeued != 0 || r.DeadlineFailed != 0 || !strings.Contains(r.Grace, "database restarted") {
		t.Fatalf("swept right after a database restart: %+v", r)
	}
	f.uptime.Store(int64(time.Hour))
	f.store.Close() // the sweeper loses the database
	if r := s.Pass(context.Background()); r.Err == nil {
		t.Fatal("a pass on a closed pool succeeded")
	}
	s.store = uptimeStore{f.reopen(), f}
	if r := s.Pass(context.Background()); !r.InGrace || r.DeadlineFailed != 0 || !strings.Contains(r.Grace, "could not reach the database") {
		t.Fatalf("first pass after the sweeper's outage: %+v", r)
	}
	f.clock.Advance(30 * time.Second)
	if r := s.Pass(context.Background()); r.InGrace || r.Requeued != 1 || r.DeadlineFailed != 1 {
		t.Fatalf("a threshold after the outage: %+v", r)
	}
	if got := f.state(task.ID); got.State != tasks.Ready {
		t.Fatalf("task %+v", got)
	}
}

// slowStore makes every statement take longer than the heartbeat interval
// on the fake clock while slow is set.
type slowStore struct {
	uptimeStore
	slow *atomic.Bool
}

func (s slowStore) SweepDeadlines(ctx context.Context, epoch int64, grace time.Duration, limit int) (int64, error) {
	if s.slow.Load() {
		s.f.clock.Advance(6 * time.Second)
	}
	return s.Store.SweepDeadlines(ctx, epoch, grace, limit)
}

// A statement slower than the runners' heartbeat interval means their
// heartbeats may be late too: running tasks wait a grace period.
func TestStaleRuleWaitsAfterASlowStatement(t *testing.T) {
	t.Parallel()
	f := setup(t)
	var slow atomic.Bool
	s := f.sweeper()
	s.store = slowStore{uptimeStore{f.store, f}, &slow}
	task := f.running(1, 3)[0]
	pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'")
	f.clock.Advance(time.Hour)
	slow.Store(true)
	if r := s.Pass(context.Background()); !r.InGrace || r.Requeued != 0 || !strings.Contains(r.Grace, "longer than the heartbeat interval") {
		t.Fatalf("the pass with a slow statement: %+v", r)
	}
	slow.Store(false)
	if r := s.Pass(context.Background()); !r.InGrace || r.Requeued != 0 {
		t.Fatalf("the pass after a slow one: %+v", r)
	}
	f.clock.Advance(30 * time.Second)
	if r := s.Pass(context.Background()); r.InGrace || r.Requeued != 1 {
		t.Fatalf("a threshold after the slow pass: %+v", r)
	}
	if got := f.state(task.ID); got.State != tasks.Ready {
		t.Fatalf("task %+v", got)
	}
}

// The one place we do better than the seed sweepers: a claim that never
// heartbeated is judged from its claim time, not skipped forever.
func TestNeverBeatenClaimIsJudgedFromItsClaimTime(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.sweeper()
	ts := f.running(3, 3)
	pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'", ts[0].ID)
	pgtest.Retime(f.t, f.store, "heartbeat_at", "NULL", ts[0].ID)
	pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'", ts[1].ID)
	pgtest.Retime(f.t, f.store, "heartbeat_at", "now()", ts[1].ID)
	pgtest.Retime(f.t, f.store, "claimed_at", "now()", ts[2].ID)
	f.clock.Advance(time.Hour)
	if r := s.Pass(context.Background()); r.Requeued != 1 {
		t.Fatalf("want only the never-beaten old claim: %+v", r)
	}
	if f.state(ts[0].ID).State != tasks.Ready || f.state(ts[1].ID).State != tasks.Running || f.state(ts[2].ID).State != tasks.Running {
		t.Fatal("wrong tasks swept")
	}
}

func TestExhaustedAttemptsEndDead(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.sweeper()
	task := f.running(1, 1)[0]
	pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'")
	f.clock.Advance(time.Hour)
	if r := s.Pass(context.Background()); r.Dead != 1 || r.Requeued != 0 {
		t.Fatalf("%+v", r)
	}
	if got := f.state(task.ID); got.State != tasks.Dead || got.FinishedAt == nil || !strings.HasPrefix(got.Errors[0].Error, "stale claim") {
		t.Fatalf("row: %+v", got)
	}
}

func TestSweepRacingCompletionHasOneWinner(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.sweeper()
	f.clock.Advance(time.Hour)
	for range 30 {
		task := f.running(1, 3)[0]
		pgtest.Retime(f.t, f.store, "claimed_at", "now() - interval '10 minutes'", task.ID)
		var wg sync.WaitGroup
		var r passResult
		var res []claims.WriteResult
		var err error
		wg.Go(func() { r = s.Pass(context.Background()) })
		wg.Go(func() {
			res, err = f.store.Complete(context.Background(), "r", []claims.Completion{{Ref: claims.RefOf(task)}})
		})
		wg.Wait()
		if err != nil || r.Err != nil {
			t.Fatal(err, r.Err)
		}
		got := f.state(task.ID)
		completed := res[0].Outcome == claims.Applied
		if completed == (r.Requeued == 1) || (completed && got.State != tasks.Completed) || (!completed && got.State != tasks.Ready) {
			t.Fatalf("completion %v, sweep requeued %d, row %s: want exactly one winner", res[0].Outcome, r.Requeued, got.State)
		}
		if got.State == tasks.Ready { // out of the next round's claim
			if _, err := f.store.CancelTask(context.Background(), task.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// A pass over 100,000 stale claims works in bounded statements.
func TestPassOverAHugeBacklogIsBatched(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.sweeper(func(c *Config) { c.BatchSize = 1000 })
	pgtest.InsertClaimed(t, f.store, `INSERT INTO tasks (kind, shard, key) SELECT 'k', 0, g::text FROM generate_series(1, 100000) g RETURNING id`,
		"r", 1, "now() - interval '1 hour'")
	f.clock.Advance(time.Hour)
	start := time.Now()
	r := s.Pass(context.Background())
	took := time.Since(start)
	if r.Err != nil || r.Requeued != 100000 {
		t.Fatalf("%+v", r)
	}
	// 1 deadline statement, the uptime check, 100 full stale batches and 1
	// that finds none.
	if r.Statements != 103 {
		t.Fatalf("%d statements, want 103: batches of at most 1000 rows", r.Statements)
	}
	t.Logf("pass over 100,000 stale claims: %s in %d statements", took, r.Statements)
}

// In the leader's loop, the sweeper stops the term when the fence moves
// to a newer leader, and with the loop's context.
func TestLoopStopsWhenDeposed(t *testing.T) {
	t.Parallel()
	f := setup(t)
	passes := testsignal.New[leader.Event]()
	s := f.sweeper()
	loop := leader.New(leader.Config{Clock: f.clock}, s.Sweeper)
	loop.Events = passes
	done := make(chan error, 1)
	go func() { done <- loop.Run(context.Background(), epoch) }()
	if _, ok := passes.Wait(10*time.Second, func(leader.Event) bool { return true }); !ok {
		t.Fatal("no first pass") // it runs at once
	}
	testutil.WaitFor(t, 10*time.Second, "the loop waits on the clock", func() bool { return f.clock.Timers() > 0 })
	if ok, err := f.store.RaiseLeaderFence(context.Background(), "usurper", epoch+1); err != nil || !ok {
		t.Fatal(ok, err)
	}
	f.clock.Advance(time.Second)
	if r, ok := passes.Wait(10*time.Second, func(r leader.Event) bool { return r.NotLeader }); !ok {
		t.Fatalf("no pass saw the fence move: %+v", passes.Events())
	} else if !errors.Is(r.Err, store.ErrNotLeader) || r.Service != "sweep" {
		t.Fatalf("pass after the fence moved: %+v", r)
	}
	if err := <-done; err != store.ErrNotLeader {
		t.Fatalf("Run returned %v", err)
	}

	// A term that ended (its context cancelled before Run began, so that
	// no pass can see the fence first and end it as deposed) returns nil.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	go func() { done <- loop.Run(ctx, epoch+2) }()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	valid := Config{}.WithDefaults()
	if err := valid.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if valid.HeartbeatInterval != claims.DefaultHeartbeatInterval || valid.Backoff.Base != tasks.DefaultRetryBase {
		t.Fatalf("defaults are not the runners': %+v", valid)
	}
	for _, tc := range []struct {
		flag string
		mut  func(*Config)
	}{
		{"--sweep-interval", func(c *Config) { c.Interval = -1 }},
		{"--sweep-interval", func(c *Config) { c.Interval = 0 }}, // a given 0 is not the default
		{"--sweep-interval", func(c *Config) { c.Interval = time.Millisecond }},
		{"--sweep-interval", func(c *Config) { c.Interval = 2 * time.Hour }},
		{"--stale-threshold", func(c *Config) { c.StaleThreshold = c.HeartbeatInterval }},
		{"--stale-threshold", func(c *Config) { c.StaleThreshold = 25 * time.Hour }},
		{"--heartbeat-interval", func(c *Config) { c.HeartbeatInterval = 0 }},
		{"--sweep-batch", func(c *Config) { c.BatchSize = 0 }},
		{"--sweep-batch", func(c *Config) { c.BatchSize = MaxBatchSize + 1 }},
		{"--retry-base", func(c *Config) { c.Backoff.Base = time.Microsecond }},
		{"--retry-cap", func(c *Config) { c.Backoff.Cap = c.Backoff.Base / 2 }},
	} {
		cfg := valid
		tc.mut(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("%s: %v", tc.flag, err)
		}
	}
}
