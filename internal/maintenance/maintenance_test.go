package maintenance

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	dto "github.com/prometheus/client_model/go"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
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

// pass is one pass of a service outside the loop.
type pass[T any] struct {
	res        T
	err        error
	statements int
	took       time.Duration
}

func termOn(c clock.Clock) leader.Term {
	return leader.Term{Epoch: epoch, Start: c.Now(), Clock: c, Log: hclog.NewNullLogger()}
}

// once begins a term of s on c (when begin is set) and runs one pass.
func once[T any](s leader.Service, c clock.Clock, begin bool) pass[T] {
	t := termOn(c)
	if begin {
		s.Begin(t)
	}
	r, p := leader.Once(context.Background(), s, t)
	return pass[T]{res: r.Detail.(T), err: r.Err, statements: p.Statements, took: c.Now().Sub(p.Started)}
}

func TestRetainerDeletesInBatchesPerState(t *testing.T) {
	st := setup(t)
	finished(t, st, "completed", 25, 3*time.Hour)
	finished(t, st, "completed", 4, 30*time.Minute) // younger than its horizon
	finished(t, st, "failed", 3, 3*time.Hour)       // younger than its horizon
	finished(t, st, "dead", 6, 5*time.Hour)
	exec(t, st, `INSERT INTO tasks (kind, shard, key) VALUES ('k', 1, 'ready')`)
	fc := clock.NewFake()
	r, err := NewRetainer(st, RetentionConfig{RetainCompleted: time.Hour, RetainFailed: 4 * time.Hour,
		BatchSize: 10}, nil)
	if err != nil {
		t.Fatal(err)
	}
	res := drive(t, fc, func() pass[RetentionResult] { return once[RetentionResult](r, fc, true) })
	if res.err != nil {
		t.Fatal(res.err)
	}
	if res.res.Deleted["completed"] != 25 || res.res.Deleted["dead"] != 6 || res.res.Deleted["failed"] != 0 {
		t.Fatalf("deleted %v, want completed 25 and dead 6", res.res.Deleted)
	}
	// completed: 10, 10, 5; failed: 0; dead: 6; cancelled: 0.
	if res.statements != 6 {
		t.Fatalf("%d statements, want 6 (batches of 10)", res.statements)
	}
	// Two pauses between the three completed batches, on the fake clock.
	if res.took < 2*time.Second {
		t.Fatalf("pass took %s on the fake clock, want the two pauses between full batches", res.took)
	}
	var metric dto.Metric
	if err := r.deleted.WithLabelValues("completed").Write(&metric); err != nil {
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
	r, err := NewRetainer(st, RetentionConfig{KeepCompleted: true, RetainFailed: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	res := once[RetentionResult](r, clock.Real(), true)
	if res.err != nil || res.res.Deleted["completed"] != 0 || res.res.Deleted["dead"] != 5 {
		t.Fatalf("%+v", res)
	}
	if count(t, st, "completed") != 5 {
		t.Fatal("a retention of 0 deleted tasks")
	}
	if !(RetentionConfig{KeepCompleted: true, KeepFailed: true}).WithDefaults().Off() {
		t.Fatal("both retentions 0 is not off: the coordinator would run a retainer for nothing")
	}
}

func TestRetainerStopsWhenDeposed(t *testing.T) {
	st := setup(t)
	finished(t, st, "completed", 5, 48*time.Hour)
	if ok, _ := st.RaiseLeaderFence(context.Background(), "next", epoch+1); !ok {
		t.Fatal("fence")
	}
	r, _ := NewRetainer(st, RetentionConfig{}, nil)
	if res := once[RetentionResult](r, clock.NewFake(), true); !errors.Is(res.err, store.ErrNotLeader) {
		t.Fatalf("a pass under a moved fence: %v", res.err)
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
		if _, err := NewRetainer(&store.Store{}, tc.cfg, nil); err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("%+v: %v, want an error naming %s", tc.cfg, err, tc.flag)
		}
	}
	if _, err := NewReaper(&store.Store{}, (&kindsOf{}).get, ReaperConfig{After: -time.Second}, nil); err == nil || !strings.Contains(err.Error(), "--unhandled-after") {
		t.Errorf("negative --unhandled-after: %v", err)
	}
}

// kindsOf is what the runners run (in the default queue), changed by the
// test.
type kindsOf struct {
	mu sync.Mutex
	m  map[tasks.Class]bool
}

func (k *kindsOf) set(kinds ...string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.m = map[tasks.Class]bool{}
	for _, x := range kinds {
		k.m[tasks.Class{Queue: tasks.DefaultQueue, Kind: x}] = true
	}
}

func (k *kindsOf) get(context.Context) (map[tasks.Class]bool, error) {
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
	r, err := NewReaper(st, kinds.get, ReaperConfig{After: time.Hour, BatchSize: 5}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// First seen unhandled now: nothing fails yet.
	p := once[ReaperResult](r, fc, true)
	if res := p.res; p.err != nil || len(res.Unrunnable) != 1 || res.Unrunnable[0].Kind != "orphan" || res.Unrunnable[0].Ready != 13 || len(res.Failed) != 0 {
		t.Fatalf("first pass: %+v", p)
	}
	// A runner handling it attaches for a moment: the clock starts over.
	fc.Advance(50 * time.Minute)
	kinds.set("noop", "orphan")
	if p := once[ReaperResult](r, fc, false); len(p.res.Unrunnable) != 0 || len(p.res.Failed) != 0 {
		t.Fatalf("while handled: %+v", p)
	}
	kinds.set("noop")
	fc.Advance(50 * time.Minute)
	if p := once[ReaperResult](r, fc, false); len(p.res.Failed) != 0 {
		t.Fatalf("unhandled again for only a moment: %+v", p)
	}
	fc.Advance(time.Hour)
	p = drive(t, fc, func() pass[ReaperResult] { return once[ReaperResult](r, fc, false) })
	// The statements: the read of the ready kinds and three batches.
	if res := p.res; p.err != nil || res.Failed[tasks.Class{Queue: tasks.DefaultQueue, Kind: "orphan"}] != 12 || p.statements != 4 {
		t.Fatalf("after an hour unhandled: %+v; want the 12 due for over an hour failed in 3 batches", p)
	}
	if count(t, st, "failed") != 12 || count(t, st, "ready") != 9 {
		t.Fatalf("failed %d, ready %d", count(t, st, "failed"), count(t, st, "ready"))
	}
	var msg string
	if err := st.Pool().QueryRow(ctx, `SELECT errors->0->>'error' FROM task_view WHERE state = 'failed' LIMIT 1`).Scan(&msg); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(msg, `no attached runner serves queue "default" with a handler of kind "orphan"`) || !strings.Contains(msg, "--unhandled-after 1h0m0s") {
		t.Fatalf("error of a failed task: %q", msg)
	}
}
