package schedule

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type bundle struct {
	st     *store.Store
	client *Catalog
}

func setup(t *testing.T) bundle {
	t.Helper()
	st, _ := pgtest.NewStore(t, store.Options{})
	if ok, err := st.RaiseLeaderFence(context.Background(), "leader", 1); err != nil || !ok {
		t.Fatal(ok, err)
	}
	c, err := NewCatalog(st, client.Config{ShardCount: 16})
	if err != nil {
		t.Fatal(err)
	}
	return bundle{st: st, client: c}
}

// testScheduler is a scheduler in a term of its own, whose passes the
// test runs one at a time.
type testScheduler struct {
	*Scheduler
	term leader.Term
}

// passResult is one pass: the scheduler's result and its error.
type passResult struct {
	Result
	Err error
}

func (s testScheduler) runOnce(ctx context.Context) passResult {
	r, _ := leader.Once(ctx, s.Scheduler, s.term)
	return passResult{Result: r.Detail.(Result), Err: r.Err}
}

func newScheduler(t *testing.T, st TickStore, epoch int64) testScheduler {
	t.Helper()
	s, err := NewScheduler(st, client.Config{ShardCount: 16}, nil)
	if err != nil {
		t.Fatal(err)
	}
	term := leader.Term{Epoch: epoch, Start: time.Now(), Clock: clock.NewFake(), Log: hclog.NewNullLogger()}
	s.Begin(term)
	return testScheduler{Scheduler: s, term: term}
}

// A schedule whose ticks came due before the term began enqueues the
// latest of them once; a second term (a new leader) enqueues nothing
// more for those ticks; a deposed leader enqueues nothing.
func TestSchedulerEnqueuesEachTickOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	sc, err := b.client.Create(ctx, Definition{Name: "nightly", Task: tasks.NewTask{Kind: "noop"}, Every: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	// Eleven ticks missed while no leader ran (the newest at creation); the
	// leader's term begins now.
	if _, err := b.st.Pool().Exec(ctx, `UPDATE schedules SET next_tick = next_tick - interval '11 hours',
		start_at = start_at - interval '11 hours'`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.st.Pool().Exec(ctx, `UPDATE coordinator_fence SET raised_at = now()`); err != nil {
		t.Fatal(err)
	}
	r := newScheduler(t, b.st, 1).runOnce(ctx)
	if r.Err != nil || r.Enqueued != 1 || r.Skipped != 10 || r.Due != 1 {
		t.Fatalf("first pass: %+v; want the latest missed tick enqueued and 10 skipped", r)
	}
	got := pgtest.ScheduleTicks(t, b.st, "nightly")
	if want := sc.NextTick.Add(-time.Hour); len(got) != 1 || !got[0].Equal(want) {
		t.Fatalf("ticks %v, want only %s", got, want)
	}
	if r.NextIn <= 0 || r.NextIn > time.Hour {
		t.Fatalf("next tick in %s, want within the hour", r.NextIn)
	}
	// A new leader (new epoch, new term) finds nothing due.
	if ok, _ := b.st.RaiseLeaderFence(ctx, "leader-2", 2); !ok {
		t.Fatal("fence")
	}
	if r := newScheduler(t, b.st, 2).runOnce(ctx); r.Err != nil || r.Enqueued != 0 {
		t.Fatalf("new leader's pass: %+v", r)
	}
	// The deposed leader enqueues nothing, even for a due tick.
	if _, err := b.st.Pool().Exec(ctx, `UPDATE schedules SET next_tick = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	old := newScheduler(t, b.st, 1)
	if r := old.runOnce(ctx); !errors.Is(r.Err, store.ErrNotLeader) || r.Enqueued != 0 {
		t.Fatalf("deposed leader's pass: %+v", r)
	}
	if n := len(pgtest.ScheduleTicks(t, b.st, "nightly")); n != 1 {
		t.Fatalf("%d tasks after the deposed leader's pass, want 1", n)
	}
}

// The unique (schedule, tick) index refuses a second task for a tick even
// when the schedule's cursor says otherwise (a restored backup, a manual
// edit): the scheduler counts it and moves on.
func TestUniqueTickIndexRefusesADuplicate(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	if _, err := b.client.Create(ctx, Definition{Name: "dup", Task: tasks.NewTask{Kind: "noop"}, Every: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.st.Pool().Exec(ctx, `UPDATE schedules SET next_tick = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.st.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key, schedule_id, schedule_tick)
		SELECT 'noop', 0, 'x', id, next_tick FROM schedules`); err != nil {
		t.Fatal(err)
	}
	r := newScheduler(t, b.st, 1).runOnce(ctx)
	if r.Err != nil || r.Duplicates != 1 || r.Enqueued != 0 {
		t.Fatalf("pass over an existing tick: %+v", r)
	}
	if n := len(pgtest.ScheduleTicks(t, b.st, "dup")); n != 1 {
		t.Fatalf("%d tasks for one tick", n)
	}
}

// Every tick that comes due during the term is enqueued, even when the
// scheduler looks late: nothing is skipped while a leader runs.
func TestTicksDueDuringTheTermAreAllEnqueued(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	if _, err := b.client.Create(ctx, Definition{Name: "fast", Task: tasks.NewTask{Kind: "noop",
		Payload: []byte(`{"n": 1}`), Options: tasks.Options{MaxAttempts: 2}}, Every: time.Second}); err != nil {
		t.Fatal(err)
	}
	s := newScheduler(t, b.st, 1)
	// The term starts now; then three ticks' worth of time pass before the
	// next pass (simulated by moving the schedule back, term start too).
	if r := s.runOnce(ctx); r.Err != nil {
		t.Fatal(r.Err)
	}
	if _, err := b.st.Pool().Exec(ctx, `UPDATE coordinator_fence SET raised_at = now() - interval '10 seconds'`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.st.Pool().Exec(ctx, `UPDATE schedules SET next_tick = now() - interval '3.5 seconds',
		start_at = now() - interval '3.5 seconds'`); err != nil {
		t.Fatal(err)
	}
	r := s.runOnce(ctx)
	if r.Err != nil || r.Enqueued != 4 || r.Skipped != 0 {
		t.Fatalf("late pass in the term: %+v; want 4 ticks, none skipped", r)
	}
	var payload string
	var maxAttempts int
	if err := b.st.Pool().QueryRow(ctx, `SELECT payload::text, max_attempts FROM tasks LIMIT 1`).Scan(&payload, &maxAttempts); err != nil {
		t.Fatal(err)
	}
	if payload != `{"n": 1}` || maxAttempts != 2 {
		t.Fatalf("tick task payload %s, max_attempts %d", payload, maxAttempts)
	}
}

func TestCatalogValidatesAndDeletes(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, d := range []Definition{
		{Name: "bad name!", Task: tasks.NewTask{Kind: "noop"}, Every: time.Minute},
		{Name: "x", Every: time.Minute},
		{Name: "x", Task: tasks.NewTask{Kind: "noop"}},
		{Name: "x", Task: tasks.NewTask{Kind: "noop"}, Cron: "61 * * * *"},
		{Name: "x", Task: tasks.NewTask{Kind: "noop"}, Cron: "0 9 * * *", Timezone: "Nowhere/Land"},
		{Name: "x", Task: tasks.NewTask{Kind: "noop", Payload: []byte(`{`)}, Every: time.Minute},
		// Not a schedule's: each tick's task runs at its tick and is its own.
		{Name: "x", Task: tasks.NewTask{Kind: "noop", Options: tasks.Options{RunAfter: time.Now().Add(time.Hour)}}, Every: time.Minute},
		{Name: "x", Task: tasks.NewTask{Kind: "noop", Options: tasks.Options{Deadline: time.Now().Add(time.Hour)}}, Every: time.Minute},
		{Name: "x", Task: tasks.NewTask{Kind: "noop", Options: tasks.Options{UniqueKey: "u"}}, Every: time.Minute},
	} {
		if _, err := b.client.Create(ctx, d); err == nil {
			t.Errorf("%+v was accepted", d)
		}
	}
	sc, err := b.client.Create(ctx, Definition{Name: "berlin", Task: tasks.NewTask{Kind: "noop"}, Cron: "0 9 * * *", Timezone: "Europe/Berlin"})
	if err != nil {
		t.Fatal(err)
	}
	if loc, _ := time.LoadLocation("Europe/Berlin"); sc.NextTick.In(loc).Hour() != 9 {
		t.Fatalf("first tick %s is not 09:00 in Berlin", sc.NextTick)
	}
	if _, err := b.client.Create(ctx, Definition{Name: "berlin", Task: tasks.NewTask{Kind: "noop"}, Every: time.Minute}); !errors.Is(err, store.ErrScheduleExists) {
		t.Fatalf("second schedule named berlin: %v", err)
	}
	if ok, err := b.client.Delete(ctx, "berlin"); !ok || err != nil {
		t.Fatalf("delete: %v %v", ok, err)
	}
	if ok, _ := b.client.Delete(ctx, "berlin"); ok {
		t.Fatal("deleted twice")
	}
}

// failFirst is a TickStore whose first pass fails, as with the database
// down when the term begins.
type failFirst struct {
	TickStore
	failed bool
}

func (f *failFirst) EnqueueTicks(ctx context.Context, epoch int64, limit int,
	plan func(d store.Due, now, termStart time.Time) (store.TickPlan, error)) (store.TickResult, error) {
	if !f.failed {
		f.failed = true
		return store.TickResult{}, errors.New("database down")
	}
	return f.TickStore.EnqueueTicks(ctx, epoch, limit, plan)
}

// The term begins when the leader raised the coordinator fence, not at
// its first successful pass: ticks that came due after the fence was
// raised, while the leader's first passes failed, are all enqueued.
func TestTermStartsWhenLeadershipStarted(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	if _, err := b.client.Create(ctx, Definition{Name: "fast", Task: tasks.NewTask{Kind: "noop"}, Every: time.Second}); err != nil {
		t.Fatal(err)
	}
	// Leadership began 10s ago; the schedule's ticks came due from 5.5s
	// ago on, while the leader's passes failed.
	if _, err := b.st.Pool().Exec(ctx, `UPDATE coordinator_fence SET raised_at = now() - interval '10 seconds'`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.st.Pool().Exec(ctx, `UPDATE schedules SET next_tick = now() - interval '5.5 seconds',
		start_at = now() - interval '5.5 seconds'`); err != nil {
		t.Fatal(err)
	}
	s := newScheduler(t, &failFirst{TickStore: b.st}, 1)
	if r := s.runOnce(ctx); r.Err == nil {
		t.Fatal("the first pass did not fail")
	}
	r := s.runOnce(ctx)
	if r.Err != nil || r.Enqueued < 6 || r.Skipped != 0 {
		t.Fatalf("pass after the failed one: %+v; want the (at least) 6 ticks of the term enqueued, none skipped", r)
	}
	var raised time.Time
	if err := b.st.Pool().QueryRow(ctx, `SELECT raised_at FROM coordinator_fence`).Scan(&raised); err != nil {
		t.Fatal(err)
	}
	if !r.TermStart.Equal(raised) {
		t.Fatalf("term start %s, want the fence's raise %s", r.TermStart, raised)
	}
}

// fixedNow is a Store whose database time is at: it prepares the schedule
// as the real store does and stores nothing.
type fixedNow struct {
	Store
	at time.Time
}

func (f fixedNow) CreateSchedule(_ context.Context, prepare func(now time.Time) (store.Schedule, error)) (store.Schedule, error) {
	return prepare(f.at)
}

// A schedule's first tick comes from the database's time, not the
// process's clock (one running ahead would skip ticks): the store gives
// its now() to the client, and the client computes the first tick from it.
func TestFirstTickComesFromTheDatabaseClock(t *testing.T) {
	dbNow := time.Date(2020, 5, 17, 10, 20, 30, 0, time.UTC)
	c, err := NewCatalog(fixedNow{at: dbNow}, client.Config{ShardCount: 16})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	iv, err := c.Create(ctx, Definition{Name: "iv", Task: tasks.NewTask{Kind: "noop"}, Every: time.Minute})
	if err != nil || !iv.Start.Equal(dbNow.Add(time.Minute)) || !iv.NextTick.Equal(iv.Start) {
		t.Fatalf("interval schedule: start %s, first tick %s (%v); want both one minute after the database's now %s", iv.Start, iv.NextTick, err, dbNow)
	}
	cr, err := c.Create(ctx, Definition{Name: "cr", Task: tasks.NewTask{Kind: "noop"}, Cron: "*/5 * * * *"})
	if want := time.Date(2020, 5, 17, 10, 25, 0, 0, time.UTC); err != nil || !cr.NextTick.Equal(want) {
		t.Fatalf("cron schedule: first tick %s (%v), want %s", cr.NextTick, err, want)
	}

	// The real store prepares with the now() of the transaction that
	// inserts the row: the row's created_at.
	b := setup(t)
	var got time.Time
	sc, err := b.st.CreateSchedule(ctx, func(now time.Time) (store.Schedule, error) {
		got = now
		return b.client.Prepare(Definition{Name: "db", Task: tasks.NewTask{Kind: "noop"}, Every: time.Minute}, now)
	})
	if err != nil || !got.Equal(sc.CreatedAt) {
		t.Fatalf("prepared at %s, created at %s (%v): want the transaction's now()", got, sc.CreatedAt, err)
	}
}

// A schedule declared at every start of a program (Upsert): the same
// declaration changes nothing, a changed task keeps the next tick, a
// changed timing moves it; each tick's task takes the schedule's queue,
// priority and sequence.
func TestUpsertKeepsTheNextTickAndTicksCarryTheTaskOptions(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	d := Definition{Name: "report", Task: tasks.NewTask{Kind: "report", Options: tasks.Options{Queue: "reports", Priority: 1, SequenceKey: "reports"}}, Every: time.Hour}
	first, what, err := b.client.Upsert(ctx, d)
	if err != nil || what != store.ScheduleCreated {
		t.Fatalf("first declaration: %v, %v", what, err)
	}
	if first.NextTick.Sub(first.NextTick.Truncate(time.Hour)) != 0 {
		t.Errorf("an interval declared without a start ticks at %s, not at a whole hour since the epoch", first.NextTick)
	}
	if _, what, err := b.client.Upsert(ctx, d); err != nil || what != store.ScheduleUnchanged {
		t.Fatalf("the same declaration again: %v, %v", what, err)
	}
	d.Task.Priority = 2
	again, what, err := b.client.Upsert(ctx, d)
	if err != nil || what != store.ScheduleUpdated || !again.NextTick.Equal(first.NextTick) || again.Task.Priority != 2 {
		t.Fatalf("a changed task: %v, %v, next %s (was %s), priority %d", what, err, again.NextTick, first.NextTick, again.Task.Priority)
	}
	d.Every = 2 * time.Hour
	if moved, what, err := b.client.Upsert(ctx, d); err != nil || what != store.ScheduleUpdated || moved.NextTick.Sub(moved.NextTick.Truncate(2*time.Hour)) != 0 {
		t.Fatalf("a changed interval: %v, %v, next %s", what, err, moved.NextTick)
	}
	if _, err := b.client.Create(ctx, d); !errors.Is(err, store.ErrScheduleExists) {
		t.Fatalf("Create of a declared schedule: %v", err)
	}
	// A tick's task is the schedule's.
	if _, err := b.st.Pool().Exec(ctx, `UPDATE schedules SET next_tick = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.st.Pool().Exec(ctx, `UPDATE coordinator_fence SET raised_at = now() - interval '1 minute'`); err != nil {
		t.Fatal(err)
	}
	if r := newScheduler(t, b.st, 1).runOnce(ctx); r.Err != nil || r.Enqueued != 1 {
		t.Fatalf("pass: %+v", r)
	}
	var queue, seq string
	var priority int
	var blocks bool
	if err := b.st.Pool().QueryRow(ctx, `SELECT queue, priority, sequence_key, sequence_blocks FROM tasks WHERE kind = 'report'`).
		Scan(&queue, &priority, &seq, &blocks); err != nil {
		t.Fatal(err)
	}
	if queue != "reports" || priority != 2 || seq != "reports" || !blocks {
		t.Fatalf("the tick's task: queue %q, priority %d, sequence %q (blocks %v)", queue, priority, seq, blocks)
	}
}

// A schedule that skips ticks while its last tick's task is unfinished
// enqueues one task, not one per tick, while no runner runs it (issue 42:
// 56 ready tasks after five minutes); the skipped ticks are counted and
// never enqueued later, and once the task finished the next tick is
// enqueued again. An hour passes by moving every time of the schedules and
// their ticks back an hour (the database's clock is the scheduler's); the
// scheduler's own clock is fake.
func TestSkipWhileUnfinishedEnqueuesOneTaskNotN(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, d := range []Definition{
		{Name: "guarded", Task: tasks.NewTask{Kind: "nobody-runs-this"}, SkipWhileUnfinished: true, Every: time.Hour},
		{Name: "plain", Task: tasks.NewTask{Kind: "nobody-runs-this"}, Every: time.Hour},
	} {
		if _, err := b.client.Create(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	// The term began a day ago: every tick below comes due during it.
	pgtest.Exec(t, b.st, `UPDATE coordinator_fence SET raised_at = now() - interval '1 day'`)
	s := newScheduler(t, b.st, 1)
	hourPasses := func() {
		pgtest.Exec(t, b.st, `UPDATE schedules SET next_tick = next_tick - interval '1 hour', start_at = start_at - interval '1 hour',
			last_tick = last_tick - interval '1 hour'`)
		pgtest.Exec(t, b.st, `UPDATE tasks SET schedule_tick = schedule_tick - interval '1 hour' WHERE schedule_id IS NOT NULL`)
	}
	const ticks = 6
	var skipped int
	for i := range ticks {
		hourPasses()
		r := s.runOnce(ctx)
		want := 1 // the plain schedule's tick
		if i == 0 {
			want = 2 // and the guarded one's first
		}
		if r.Err != nil || r.Due != 2 || r.Enqueued != want || r.Skipped != r.SkippedUnfinished {
			t.Fatalf("pass %d: %+v; want the plain schedule's tick and the guarded one's first only", i+1, r)
		}
		skipped += r.SkippedUnfinished
	}
	if got, plain := pgtest.ScheduleTicks(t, b.st, "guarded"), pgtest.ScheduleTicks(t, b.st, "plain"); len(got) != 1 || len(plain) != ticks {
		t.Fatalf("guarded schedule: %d tasks, plain: %d; want 1 and %d", len(got), len(plain), ticks)
	}
	page, err := b.client.List(ctx, ListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	guarded := page.Schedules[0]
	if guarded.Name != "guarded" || !guarded.SkipWhileUnfinished || guarded.Skipped != ticks-1 || skipped != ticks-1 ||
		guarded.LastTaskID == nil || !guarded.NextTick.After(time.Now()) {
		t.Fatalf("guarded schedule %+v after %d ticks (%d skipped in the passes); want %d skipped, its next tick ahead", guarded, ticks, skipped, ticks-1)
	}
	if v := testutil.ToFloat64(s.m.skipped.WithLabelValues(skippedUnfinished)); v != ticks-1 {
		t.Fatalf("shardrun_schedule_ticks_skipped_total{reason=\"unfinished\"} = %v, want %d", v, ticks-1)
	}
	// The task finishes (an operator cancels it): the next tick is
	// enqueued, and the skipped ones are not.
	if _, err := b.st.CancelTask(ctx, *guarded.LastTaskID); err != nil {
		t.Fatal(err)
	}
	hourPasses()
	if r := s.runOnce(ctx); r.Err != nil || r.Enqueued != 2 || r.SkippedUnfinished != 0 {
		t.Fatalf("pass after the task finished: %+v; want both schedules' ticks", r)
	}
	if got := pgtest.ScheduleTicks(t, b.st, "guarded"); len(got) != 2 || got[1].Sub(got[0]) != ticks*time.Hour {
		t.Fatalf("guarded ticks %v; want the first and the one %d hours later, after the task finished", got, ticks)
	}
}

// SkipWhileUnfinished keeps the first of the due ticks, whose task is
// unfinished when the later ones come due, and none while the last
// tick's task is unfinished.
func TestSkipWhileUnfinishedKeepsTheFirstDueTick(t *testing.T) {
	at := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	three := []time.Time{at, at.Add(time.Minute), at.Add(2 * time.Minute)}
	for _, tc := range []struct {
		ticks      []time.Time
		unfinished bool
		keep       int
	}{
		{nil, false, 0}, {nil, true, 0},
		{three[:1], false, 1}, {three[:1], true, 0},
		{three, false, 1}, {three, true, 0},
	} {
		got, skipped := SkipWhileUnfinished(tc.ticks, tc.unfinished)
		if len(got) != tc.keep || int(skipped) != len(tc.ticks)-tc.keep || tc.keep == 1 && !got[0].Equal(at) {
			t.Errorf("SkipWhileUnfinished(%d ticks, unfinished %v) = %v, %d; want %d kept, the first", len(tc.ticks), tc.unfinished, got, skipped, tc.keep)
		}
	}
}
