package maintenance

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const epoch = 1

func setup(t *testing.T) *store.Store {
	t.Helper()
	st, _ := pgtest.NewStore(t, store.Options{})
	if ok, err := st.RaiseLeaderFence(context.Background(), "leader", epoch); err != nil || !ok {
		t.Fatal(ok, err)
	}
	return st
}

func exec(t *testing.T, st *store.Store, sql string, args ...any) {
	t.Helper()
	if _, err := st.Pool().Exec(context.Background(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

func finished(t *testing.T, st *store.Store, state string, n int, age time.Duration) {
	t.Helper()
	exec(t, st, `INSERT INTO tasks (kind, shard, key, state, finished_at)
		SELECT 'k', g % 16, g::text, $1, now() - $2 * interval '1 millisecond' FROM generate_series(1, $3) g`,
		state, age.Milliseconds(), n)
}

func count(t *testing.T, st *store.Store, state string) int {
	t.Helper()
	var n int
	if err := st.Pool().QueryRow(context.Background(), `SELECT count(*) FROM task_view WHERE state = $1`, state).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// drive runs fn while advancing the fake clock whenever fn waits on it,
// and returns fn's result.
func drive[T any](t *testing.T, fc *clock.Fake, fn func() T) T {
	t.Helper()
	done := make(chan T, 1)
	go func() { done <- fn() }()
	for {
		select {
		case v := <-done:
			return v
		default:
		}
		if fc.Timers() > 0 {
			fc.Advance(time.Second)
		}
		time.Sleep(time.Millisecond) // yielding to fn between checks, not waiting for a condition
	}
}

func TestRetainerDeletesInBatchesPerState(t *testing.T) {
	st := setup(t)
	finished(t, st, "completed", 25, 3*time.Hour)
	finished(t, st, "completed", 4, 30*time.Minute) // younger than its horizon
	finished(t, st, "failed", 3, 3*time.Hour)       // younger than its horizon
	finished(t, st, "dead", 6, 5*time.Hour)
	exec(t, st, `INSERT INTO tasks (kind, shard, key) VALUES ('k', 1, 'ready')`)
	fc := clock.NewFake()
	m := NewRetentionMetrics(nil)
	r, err := NewRetainer(RetentionConfig{Store: st, Epoch: epoch, RetainCompleted: time.Hour, RetainFailed: 4 * time.Hour,
		BatchSize: 10, BatchPause: 200 * time.Millisecond, Clock: fc, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	res := drive(t, fc, func() RetentionResult { return r.runOnce(context.Background()) })
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if res.Deleted["completed"] != 25 || res.Deleted["dead"] != 6 || res.Deleted["failed"] != 0 {
		t.Fatalf("deleted %v, want completed 25 and dead 6", res.Deleted)
	}
	// completed: 10, 10, 5; failed: 0; dead: 6; cancelled: 0.
	if res.Statements != 6 {
		t.Fatalf("%d statements, want 6 (batches of 10)", res.Statements)
	}
	// Two pauses between the three completed batches, on the fake clock.
	if res.Duration < 2*time.Second {
		t.Fatalf("pass took %s on the fake clock, want the two pauses between full batches", res.Duration)
	}
	var metric dto.Metric
	if err := m.Deleted.WithLabelValues("completed").Write(&metric); err != nil {
		t.Fatal(err)
	}
	if got := metric.GetCounter().GetValue(); got != 25 {
		t.Fatalf("shardrun_retention_deleted_total{state=completed} = %v", got)
	}
	for state, want := range map[string]int{"completed": 4, "failed": 3, "dead": 0, "ready": 1} {
		if got := count(t, st, state); got != want {
			t.Errorf("%d %s tasks left, want %d", got, state, want)
		}
	}
}

func TestRetentionZeroKeepsForever(t *testing.T) {
	st := setup(t)
	finished(t, st, "completed", 5, 48*time.Hour)
	finished(t, st, "dead", 5, 30*24*time.Hour)
	r, err := NewRetainer(RetentionConfig{Store: st, Epoch: epoch, KeepCompleted: true, RetainFailed: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	res := r.runOnce(context.Background())
	if res.Err != nil || res.Deleted["completed"] != 0 || res.Deleted["dead"] != 5 {
		t.Fatalf("%+v", res)
	}
	both, _ := NewRetainer(RetentionConfig{Store: st, Epoch: epoch, KeepCompleted: true, KeepFailed: true})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := both.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if count(t, st, "completed") != 5 {
		t.Fatal("retention off deleted tasks")
	}
}

func TestRetainerStopsWhenDeposed(t *testing.T) {
	st := setup(t)
	finished(t, st, "completed", 5, 48*time.Hour)
	if ok, _ := st.RaiseLeaderFence(context.Background(), "next", epoch+1); !ok {
		t.Fatal("fence")
	}
	r, _ := NewRetainer(RetentionConfig{Store: st, Epoch: epoch, Clock: clock.NewFake()})
	if err := r.Run(context.Background()); !errors.Is(err, store.ErrNotLeader) {
		t.Fatalf("Run under a moved fence: %v", err)
	}
	if count(t, st, "completed") != 5 {
		t.Fatal("a deposed leader deleted tasks")
	}
}

func TestConfigErrorsNameTheFlag(t *testing.T) {
	for _, tc := range []struct {
		cfg  RetentionConfig
		flag string
	}{
		{RetentionConfig{RetainCompleted: -time.Second}, "--retain-completed"},
		{RetentionConfig{RetainFailed: -time.Second}, "--retain-failed"},
		{RetentionConfig{BatchSize: -1}, "--retention-batch"},
	} {
		tc.cfg.Store = &store.Store{}
		if _, err := NewRetainer(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("%+v: %v, want an error naming %s", tc.cfg, err, tc.flag)
		}
	}
	if _, err := NewReaper(ReaperConfig{After: -time.Second, Store: &store.Store{}}); err == nil || !strings.Contains(err.Error(), "--unhandled-after") {
		t.Errorf("negative --unhandled-after: %v", err)
	}
}

// kindsOf is the runners' published kinds, changed by the test.
type kindsOf struct {
	mu sync.Mutex
	m  map[string]bool
}

func (k *kindsOf) set(kinds ...string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.m = map[string]bool{}
	for _, x := range kinds {
		k.m[x] = true
	}
}

func (k *kindsOf) get(context.Context) (map[string]bool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.m, nil
}

func TestReaperFailsKindsUnhandledForLongEnough(t *testing.T) {
	st := setup(t)
	exec(t, st, `INSERT INTO tasks (kind, shard, key, run_after)
		SELECT CASE WHEN g <= 12 THEN 'orphan' ELSE 'noop' END, g % 16, g::text, now() - interval '2 hours'
		FROM generate_series(1, 20) g`)
	exec(t, st, `INSERT INTO tasks (kind, shard, key) VALUES ('orphan', 1, 'fresh')`) // due just now
	fc := clock.NewFake()
	kinds := &kindsOf{}
	kinds.set("noop")
	r, err := NewReaper(ReaperConfig{Store: st, Epoch: epoch, After: time.Hour, Kinds: kinds.get, BatchSize: 5,
		BatchPause: time.Millisecond, Clock: fc})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// First seen unhandled now: nothing fails yet.
	res := r.runOnce(ctx)
	if res.Err != nil || len(res.Unhandled) != 1 || res.Unhandled[0].Kind != "orphan" || res.Unhandled[0].Ready != 13 || len(res.Failed) != 0 {
		t.Fatalf("first pass: %+v", res)
	}
	// A runner handling it attaches for a moment: the clock starts over.
	fc.Advance(50 * time.Minute)
	kinds.set("noop", "orphan")
	if res := r.runOnce(ctx); len(res.Unhandled) != 0 || len(res.Failed) != 0 {
		t.Fatalf("while handled: %+v", res)
	}
	kinds.set("noop")
	fc.Advance(50 * time.Minute)
	if res := r.runOnce(ctx); len(res.Failed) != 0 {
		t.Fatalf("unhandled again for only a moment: %+v", res)
	}
	fc.Advance(time.Hour)
	res = drive(t, fc, func() ReaperResult { return r.runOnce(ctx) })
	if res.Err != nil || res.Failed["orphan"] != 12 || res.Statements != 3 {
		t.Fatalf("after an hour unhandled: %+v; want the 12 due for over an hour failed in 3 batches", res)
	}
	if count(t, st, "failed") != 12 || count(t, st, "ready") != 9 {
		t.Fatalf("failed %d, ready %d", count(t, st, "failed"), count(t, st, "ready"))
	}
	var msg string
	if err := st.Pool().QueryRow(ctx, `SELECT errors->0->>'error' FROM task_view WHERE state = 'failed' LIMIT 1`).Scan(&msg); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(msg, `no attached runner handles kind "orphan"`) || !strings.Contains(msg, "--unhandled-after 1h0m0s") {
		t.Fatalf("error of a failed task: %q", msg)
	}
}
