package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// finished inserts n tasks in state, finished age ago.
func finished(t testing.TB, s *store.Store, state string, n int, age time.Duration) {
	t.Helper()
	exec(t, s, `INSERT INTO tasks (kind, shard, key, state, finished_at)
		SELECT 'k', g % 16, g::text, $1, now() - $2 * interval '1 millisecond' FROM generate_series(1, $3) g`,
		state, age.Milliseconds(), n)
}

func countState(t testing.TB, s *store.Store, state string) int {
	t.Helper()
	var n int
	if err := s.Pool().QueryRow(context.Background(), `SELECT count(*) FROM task_view WHERE state = $1`, state).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestDeleteFinishedByStateAgeAndBatch(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	finished(t, s, "completed", 25, 2*time.Hour)
	finished(t, s, "completed", 5, time.Minute) // younger than the horizon
	finished(t, s, "dead", 7, 2*time.Hour)      // another state, kept by this rule
	enqueue(t, s, insert("k", 1, 3))            // unfinished

	var total int64
	var batches []int64
	for {
		n, err := s.DeleteFinished(ctx, leaderEpoch, "completed", time.Hour, 10)
		if err != nil {
			t.Fatal(err)
		}
		batches = append(batches, n)
		total += n
		if n < 10 {
			break
		}
	}
	if total != 25 || len(batches) != 3 || batches[0] != 10 || batches[2] != 5 {
		t.Fatalf("batches %v (total %d), want 10, 10, 5", batches, total)
	}
	if got := countState(t, s, "completed"); got != 5 {
		t.Fatalf("%d completed tasks left, want the 5 younger than the horizon", got)
	}
	if got := countState(t, s, "dead"); got != 7 {
		t.Fatalf("%d dead tasks left, want 7", got)
	}
	if got := countState(t, s, "ready"); got != 1 {
		t.Fatalf("%d ready tasks left, want 1", got)
	}
}

func TestDeleteFinishedAppliesOnlyUnderTheLeaderFence(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	finished(t, s, "failed", 3, 2*time.Hour)
	if ok, err := s.RaiseLeaderFence(ctx, "new-leader", leaderEpoch+1); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if _, err := s.DeleteFinished(ctx, leaderEpoch, "failed", time.Hour, 10); !errors.Is(err, store.ErrNotLeader) {
		t.Fatalf("deposed leader's delete: %v, want ErrNotLeader", err)
	}
	if got := countState(t, s, "failed"); got != 3 {
		t.Fatalf("a deposed leader deleted rows: %d left", got)
	}
	if n, err := s.DeleteFinished(ctx, leaderEpoch+1, "failed", time.Hour, 10); err != nil || n != 3 {
		t.Fatalf("current leader's delete: %d %v", n, err)
	}
}

func TestDeleteFinishedUsesTheStateIndex(t *testing.T) {
	t.Parallel()
	s := setup(t)
	finished(t, s, "completed", 2000, 2*time.Hour)
	exec(t, s, "ANALYZE task_finished")
	rows, err := s.Pool().Query(context.Background(), `EXPLAIN SELECT id FROM task_finished
		WHERE state = 'completed' AND finished_at < now() - interval '1 hour'
		ORDER BY finished_at LIMIT 100`)
	if err != nil {
		t.Fatal(err)
	}
	var plan []string
	for rows.Next() {
		var l string
		_ = rows.Scan(&l)
		plan = append(plan, l)
	}
	if p := strings.Join(plan, "\n"); !strings.Contains(p, "task_finished_at_idx") {
		t.Fatalf("the retention scan does not walk task_finished_at_idx:\n%s", p)
	}
}

func TestShardCountIsRecordedAndEnforced(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	created, err := s.EnsureShardCount(ctx, 16)
	if err != nil || !created {
		t.Fatalf("first start: %v %v", created, err)
	}
	if created, err := s.EnsureShardCount(ctx, 16); err != nil || created {
		t.Fatalf("second start with the same count: %v %v", created, err)
	}
	_, err = s.EnsureShardCount(ctx, 32)
	if !errors.Is(err, store.ErrShardCountMismatch) || !strings.Contains(err.Error(), "--shard-count") ||
		!strings.Contains(err.Error(), "16") {
		t.Fatalf("start with another count: %v", err)
	}
	// Every producer: one insert, COPY, raw SQL.
	if _, err := s.Enqueue(ctx, insert("k", 16, 3)); err == nil || !strings.Contains(err.Error(), "tasks_shard_in_range") {
		t.Fatalf("enqueue into shard 16 of 16: %v", err)
	}
	if _, err := s.EnqueueBatch(ctx, []store.Insert{insert("k", 3, 3), insert("k", 99, 3)}); err == nil {
		t.Fatal("COPY into shard 99 of 16 was accepted")
	}
	if _, err := s.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key) VALUES ('k', 1000, 'x')`); err == nil {
		t.Fatal("raw insert into shard 1000 of 16 was accepted")
	}
	if _, err := s.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key) VALUES ('k', -1, 'x')`); err == nil {
		t.Fatal("raw insert into shard -1 was accepted")
	}
	enqueue(t, s, insert("k", 15, 3))
}

func TestShardCountRefusedOverExistingTasksOutsideTheRange(t *testing.T) {
	t.Parallel()
	s := setup(t)
	enqueue(t, s, insert("k", 40, 3))
	_, err := s.EnsureShardCount(context.Background(), 16)
	if !errors.Is(err, store.ErrShardCountMismatch) || !strings.Contains(err.Error(), "tasks in shards outside [0, 16)") {
		t.Fatalf("tasks outside the range: %v", err)
	}
	// New rows outside the range are refused at once, before validation.
	if _, err := s.Pool().Exec(context.Background(), `INSERT INTO tasks (kind, shard, key) VALUES ('k', 20, 'x')`); err == nil {
		t.Fatal("a task in shard 20 was inserted under a count of 16")
	}
	// Once the stray rows are gone the next start validates the constraint.
	exec(t, s, `WITH gone AS (DELETE FROM tasks WHERE shard >= 16 RETURNING id) DELETE FROM task_ready WHERE id IN (SELECT id FROM gone)`)
	if created, err := s.EnsureShardCount(context.Background(), 16); err != nil || created {
		t.Fatalf("the second start: created %v, %v", created, err)
	}
	var valid bool
	if err := s.Pool().QueryRow(context.Background(), `SELECT convalidated FROM pg_constraint WHERE conname = 'tasks_shard_in_range'`).Scan(&valid); err != nil || !valid {
		t.Fatalf("constraint validated %v, %v", valid, err)
	}
}

func TestReadyUnrunnableAndFailUnrunnable(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	exec(t, s, `INSERT INTO tasks (kind, shard, key, run_after, queue)
		SELECT CASE WHEN g <= 30 THEN 'orphan' WHEN g <= 35 THEN 'later' ELSE 'k' END, g % 16, g::text,
		       CASE WHEN g <= 20 THEN now() - interval '2 hours' ELSE now() END,
		       CASE WHEN g > 45 THEN 'mail' ELSE 'default' END
		FROM generate_series(1, 50) g`)
	// Runners run kind k in the default queue only: k in "mail" is
	// unrunnable too.
	got, err := s.ReadyUnrunnable(ctx, []tasks.Class{{Queue: "default", Kind: "k"}})
	if err != nil {
		t.Fatal(err)
	}
	want := []store.ClassCount{{Class: tasks.Class{Queue: "default", Kind: "later"}, Ready: 5},
		{Class: tasks.Class{Queue: "default", Kind: "orphan"}, Ready: 30}, {Class: tasks.Class{Queue: "mail", Kind: "k"}, Ready: 5}}
	if len(got) != len(want) {
		t.Fatalf("unrunnable %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i].Class != want[i].Class || got[i].Ready != want[i].Ready {
			t.Fatalf("unrunnable %+v, want %+v", got, want)
		}
	}
	if all, _ := s.ReadyUnrunnable(ctx, nil); len(all) != 4 {
		t.Fatalf("with nothing runnable: %+v", all)
	}
	// Only tasks due for longer than an hour, in batches, under the fence.
	orphan := tasks.Class{Queue: "default", Kind: "orphan"}
	if _, err := s.FailUnrunnable(ctx, leaderEpoch+1, orphan, time.Hour, 8, "why"); !errors.Is(err, store.ErrNotLeader) {
		t.Fatalf("under another epoch: %v", err)
	}
	var total int64
	for {
		n, err := s.FailUnrunnable(ctx, leaderEpoch, orphan, time.Hour, 8, `no attached runner serves queue "default" with a handler of kind "orphan"`)
		if err != nil {
			t.Fatal(err)
		}
		total += n
		if n < 8 {
			break
		}
	}
	if total != 20 {
		t.Fatalf("failed %d, want the 20 due for over an hour", total)
	}
	var errs json.RawMessage
	if err := s.Pool().QueryRow(ctx, `SELECT errors FROM tasks WHERE state = 'failed' LIMIT 1`).Scan(&errs); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(errs), `no attached runner serves queue`) {
		t.Fatalf("errors of a failed unrunnable task: %s", errs)
	}
}

// The status page's rates count one range of the finished index per state.
func TestFinishedRatesByState(t *testing.T) {
	t.Parallel()
	s := setup(t)
	finished(t, s, "completed", 20, time.Second)
	finished(t, s, "dead", 10, time.Second)
	finished(t, s, "completed", 50, time.Hour)
	rates, err := s.FinishedRates(context.Background(), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if rates[tasks.Completed] != 2 || rates[tasks.Dead] != 1 || rates[tasks.Failed] != 0 {
		t.Fatalf("rates %v, want completed 2/s, dead 1/s, failed 0", rates)
	}
}
