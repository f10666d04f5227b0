package store_test

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// seedMix inserts n tasks: kinds a, b, c; keys k0..k9; shards 0..7; states
// spread over all six (the running ones claimed by runner r).
func seedMix(t testing.TB, s *store.Store, n int) {
	t.Helper()
	exec(t, s, `
		INSERT INTO tasks (kind, shard, key, state, created_at, finished_at, unique_key, payload)
		SELECT (ARRAY['a', 'b', 'c'])[g % 3 + 1], g % 8, 'k' || (g % 10),
		       (ARRAY['ready', 'ready', 'completed', 'completed', 'failed', 'dead', 'cancelled'])[g % 7 + 1],
		       now() - (($1 - g) * interval '1 second'),
		       CASE WHEN g % 7 >= 2 THEN now() END, NULL,
		       CASE WHEN g % 7 = 1 THEN '{"seed": "running"}' ELSE '{}' END::jsonb
		FROM generate_series(1, $1) g`, n)
	exec(t, s, `
		WITH r AS (
			DELETE FROM task_ready WHERE id IN (SELECT id FROM tasks WHERE payload = '{"seed": "running"}')
			RETURNING id, shard
		)
		INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt) SELECT id, shard, 'default', 1, 'r', 1 FROM r`)
}

// walk lists every page of req and returns the ids in order.
func walk(t testing.TB, s *store.Store, req tasks.ListRequest) []int64 {
	t.Helper()
	var ids []int64
	for pages := 0; ; pages++ {
		if pages > 10_000 {
			t.Fatal("the listing does not end")
		}
		page, err := s.List(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		for _, task := range page.Tasks {
			ids = append(ids, task.ID)
		}
		if page.Next == 0 {
			return ids
		}
		if page.Next == req.After {
			t.Fatalf("the cursor did not move: %d", page.Next)
		}
		req.After = page.Next
	}
}

func TestListFiltersAndPages(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	seedMix(t, s, 700)
	three := 3
	cutoff := time.Now().Add(-300 * time.Second)
	for _, tc := range []struct {
		name  string
		f     tasks.Filter
		where string
	}{
		{"everything", tasks.Filter{}, "true"},
		{"state", tasks.Filter{States: []tasks.State{tasks.Dead}}, "state = 'dead'"},
		{"two states", tasks.Filter{States: []tasks.State{tasks.Dead, tasks.Failed}}, "state IN ('dead', 'failed')"},
		{"running", tasks.Filter{States: []tasks.State{tasks.Running}}, "state = 'running'"},
		{"ready", tasks.Filter{States: []tasks.State{tasks.Ready}}, "state = 'ready'"},
		{"running and cancelled", tasks.Filter{States: []tasks.State{tasks.Running, tasks.Cancelled}}, "state IN ('running', 'cancelled')"},
		{"kind", tasks.Filter{Kind: "b"}, "kind = 'b'"},
		{"kind and state", tasks.Filter{Kind: "b", States: []tasks.State{tasks.Ready}}, "kind = 'b' AND state = 'ready'"},
		{"key", tasks.Filter{Key: "k4"}, "key = 'k4'"},
		{"key, kind and state", tasks.Filter{Key: "k4", Kind: "a", States: []tasks.State{tasks.Completed}}, "key = 'k4' AND kind = 'a' AND state = 'completed'"},
		{"shard", tasks.Filter{Shard: &three}, "shard = 3"},
		{"shard and state", tasks.Filter{Shard: &three, States: []tasks.State{tasks.Cancelled}}, "shard = 3 AND state = 'cancelled'"},
		{"created before", tasks.Filter{CreatedBefore: cutoff}, "created_at < '" + cutoff.Format(time.RFC3339Nano) + "'"},
		{"created since", tasks.Filter{CreatedSince: cutoff}, "created_at >= '" + cutoff.Format(time.RFC3339Nano) + "'"},
		{"created in a window", tasks.Filter{CreatedSince: cutoff.Add(-100 * time.Second), CreatedBefore: cutoff, Kind: "a"},
			"kind = 'a' AND created_at >= '" + cutoff.Add(-100*time.Second).Format(time.RFC3339Nano) + "' AND created_at < '" + cutoff.Format(time.RFC3339Nano) + "'"},
		{"nothing matches", tasks.Filter{Kind: "zzz"}, "false"},
	} {
		rows, err := s.Pool().Query(ctx, `SELECT id FROM task_view WHERE `+tc.where+` ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		want, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		for _, desc := range []bool{false, true} {
			got := walk(t, s, tasks.ListRequest{Filter: tc.f, Limit: 7, Desc: desc})
			exp := slices.Clone(want)
			if desc {
				slices.Reverse(exp)
			}
			if !slices.Equal(got, exp) {
				t.Errorf("%s (desc %v): got %d ids %v…, want %d", tc.name, desc, len(got), got[:min(len(got), 10)], len(exp))
			}
		}
	}
	page, err := s.List(ctx, tasks.ListRequest{Filter: tasks.Filter{States: []tasks.State{tasks.Dead}}, Limit: 1})
	if err != nil || len(page.Tasks) != 1 || page.Tasks[0].State != tasks.Dead || page.Tasks[0].Kind == "" || page.Next != page.Tasks[0].ID {
		t.Fatalf("one page: %+v %v", page, err)
	}
}

// A filter that matches none of the first ListScan candidates gives an
// empty page with a cursor beyond them, not a scan of the whole table.
func TestListShortPagesCarryTheCursor(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	n := store.ListScan + 2000
	exec(t, s, `INSERT INTO tasks (kind, shard, key) SELECT 'k', CASE WHEN g > $2 THEN 99 ELSE g % 8 END, g::text
		FROM generate_series(1, $1) g`, n, store.ListScan+1500)
	shard := 99
	req := tasks.ListRequest{Filter: tasks.Filter{Shard: &shard}, Limit: 100}
	page, err := s.List(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	var first int64
	_ = s.Pool().QueryRow(ctx, `SELECT min(id) FROM tasks`).Scan(&first)
	if len(page.Tasks) != 0 || page.Next != first+store.ListScan-1 {
		t.Fatalf("first page: %d tasks, next %d; want none and the cursor after %d candidates", len(page.Tasks), page.Next, store.ListScan)
	}
	if got := walk(t, s, req); len(got) != 500 {
		t.Fatalf("walking the whole listing found %d tasks, want 500", len(got))
	}
}

func TestBulkCancelAndRetry(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 5)
	for range 2500 {
		enqueue(t, s, insert("k", 1, 3))
	}
	exec(t, s, `WITH u AS (UPDATE tasks SET kind = 'other' WHERE id % 5 = 0 RETURNING id)
		UPDATE task_ready r SET kind = 'other' FROM u WHERE r.id = u.id`)
	running := claim(t, s, "a", 1, 5, 30)
	var runningK int64
	for _, r := range running {
		if r.Kind == "k" {
			runningK++
		}
	}
	if _, err := s.CancelMatching(ctx, tasks.Filter{}, 0, time.Minute); err == nil {
		t.Fatal("a bulk cancel without a filter must be refused")
	}
	if _, err := s.CancelMatching(ctx, tasks.Filter{States: []tasks.State{tasks.Dead}}, 0, time.Minute); err == nil {
		t.Fatal("a bulk cancel of dead tasks must be refused")
	}
	res, err := s.CancelMatching(ctx, tasks.Filter{Kind: "k"}, 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Done || res.Cancelled != 2000-runningK || res.CancelRequested != runningK {
		t.Fatalf("bulk cancel: %+v, want %d cancelled and %d requested", res, 2000-runningK, runningK)
	}
	// Running again changes and counts nothing.
	if again, err := s.CancelMatching(ctx, tasks.Filter{Kind: "k"}, 0, time.Minute); err != nil || again.Cancelled+again.CancelRequested != 0 {
		t.Fatalf("second bulk cancel: %+v %v", again, err)
	}
	// A budget of nothing stops after the first batch with a cursor.
	part, err := s.RetryMatching(ctx, tasks.Filter{Kind: "k"}, 0, 0)
	if err != nil || part.Done || part.Next == 0 || part.Retried == 0 {
		t.Fatalf("bulk retry with no time: %+v %v", part, err)
	}
	rest, err := s.RetryMatching(ctx, tasks.Filter{Kind: "k"}, part.Next, time.Minute)
	if err != nil || !rest.Done || part.Retried+rest.Retried != 2000-runningK {
		t.Fatalf("bulk retry: %+v then %+v %v", part, rest, err)
	}
	counts, _ := s.CountByState(ctx)
	if counts[tasks.Ready] != 2500-int64(len(running)) || counts[tasks.Cancelled] != 0 {
		t.Fatalf("after retrying: %v", counts)
	}

	// Unique keys: of two cancelled tasks with one key, one is retried;
	// a key an unfinished task holds is skipped.
	var ids []int64
	for _, key := range []string{"u1", "u1", "u2"} {
		e, err := s.EnqueueIn(ctx, nil, uniqueInsert(key))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.CancelTask(ctx, e.ID); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, e.ID)
	}
	holder, _ := s.EnqueueIn(ctx, nil, uniqueInsert("u2"))
	res, err = s.RetryMatching(ctx, tasks.Filter{States: []tasks.State{tasks.Cancelled}}, 0, time.Minute)
	if err != nil || res.Retried != 1 || res.Skipped != 2 {
		t.Fatalf("bulk retry with unique keys: %+v %v", res, err)
	}
	if got := get(t, s, ids[1]); got.State != tasks.Ready {
		t.Fatalf("the newest task of key u1 must be retried: %+v", got)
	}
	if got := get(t, s, holder.ID); got.State != tasks.Ready {
		t.Fatal(got)
	}
}

// planOf explains the listing of req, with a generic plan (what prepared
// statements settle on) when generic is set.
func planOf(t *testing.T, s *store.Store, sql string, args []any, generic bool) string {
	t.Helper()
	ctx := context.Background()
	conn, err := s.Pool().Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	mode := "force_custom_plan"
	if generic {
		mode = "force_generic_plan"
	}
	if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, "RESET plan_cache_mode") //nolint:errcheck
	if _, err := conn.Exec(ctx, "PREPARE listing AS "+sql); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, "DEALLOCATE listing") //nolint:errcheck
	params := make([]string, len(args))
	for i, a := range args {
		params[i] = literal(t, a)
	}
	execute := "EXECUTE listing"
	if len(params) > 0 {
		execute += "(" + strings.Join(params, ", ") + ")"
	}
	rows, err := conn.Query(ctx, "EXPLAIN (COSTS OFF) "+execute)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(lines, "\n")
}

// literal writes v as an SQL literal: EXECUTE takes no bound parameters.
func literal(t *testing.T, v any) string {
	t.Helper()
	quote := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	switch v := v.(type) {
	case string:
		return quote(v)
	case int, int32, int64:
		return fmt.Sprint(v)
	case time.Time:
		return quote(v.Format(time.RFC3339Nano)) + "::timestamptz"
	case []string:
		parts := make([]string, len(v))
		for i, s := range v {
			parts[i] = quote(s)
		}
		return "ARRAY[" + strings.Join(parts, ", ") + "]::text[]"
	}
	t.Fatalf("no literal for %T", v)
	return ""
}

var (
	seqScan = regexp.MustCompile(`Seq Scan on tasks`)
	// sortOfScan is a sort whose input is a scan of tasks: a sort of every
	// match. A sort of the union of the per-state streams is bounded by
	// their LIMITs and allowed.
	sortOfScan = regexp.MustCompile(`Sort\n(\s+Sort Key:[^\n]*\n)?\s+->  (Index|Index Only|Seq) Scan`)
)

// The listing plans walk the index their filter drives, in id order, with
// no scan of the table and no sort, whatever the statistics say: checked
// with statistics gathered when the table held only completed tasks, with
// custom and with generic plans. The benchmark shows the same plans with
// timings at 10 million rows.
func TestListPlansWalkTheirIndex(t *testing.T) {
	t.Parallel()
	s := setup(t)
	exec(t, s, `INSERT INTO tasks (kind, shard, key, state, finished_at)
		SELECT 'a', g % 8, 'k' || g, 'completed', now() FROM generate_series(1, 2000) g`)
	exec(t, s, `ANALYZE tasks`) // stale from here on
	exec(t, s, `ALTER TABLE tasks SET (autovacuum_enabled = false)`)
	seedMix(t, s, 60_000)
	three := 3
	for _, tc := range []struct {
		name  string
		req   tasks.ListRequest
		index []string
	}{
		{"everything", tasks.ListRequest{}, []string{"tasks_pkey"}},
		{"state", tasks.ListRequest{Filter: tasks.Filter{States: []tasks.State{tasks.Dead}}, After: 5}, []string{"task_finished_pkey"}},
		{"completed, newest first", tasks.ListRequest{Filter: tasks.Filter{States: []tasks.State{tasks.Completed}}, Desc: true}, []string{"task_finished_pkey"}},
		{"two states", tasks.ListRequest{Filter: tasks.Filter{States: []tasks.State{tasks.Dead, tasks.Failed}}}, []string{"task_finished_pkey"}},
		{"running", tasks.ListRequest{Filter: tasks.Filter{States: []tasks.State{tasks.Running, tasks.Dead}}}, []string{"task_claims_pkey", "task_finished_pkey"}},
		{"kind", tasks.ListRequest{Filter: tasks.Filter{Kind: "b"}, After: 100}, []string{"tasks_kind_id_idx"}},
		{"kind and state", tasks.ListRequest{Filter: tasks.Filter{Kind: "b", States: []tasks.State{tasks.Ready}}}, []string{"tasks_kind_id_idx"}},
		{"key and state", tasks.ListRequest{Filter: tasks.Filter{Key: "k4", States: []tasks.State{tasks.Dead}}}, []string{"tasks_key_id_idx", "tasks_pkey"}},
		{"shard and state", tasks.ListRequest{Filter: tasks.Filter{Shard: &three, States: []tasks.State{tasks.Dead}}}, []string{"task_finished_pkey", "tasks_pkey"}},
		{"shard", tasks.ListRequest{Filter: tasks.Filter{Shard: &three}}, []string{"tasks_pkey"}},
	} {
		tc.req.Limit = 100
		sql, args := store.ListQuery(tc.req)
		for _, generic := range []bool{false, true} {
			plan := planOf(t, s, sql, args, generic)
			for _, want := range tc.index {
				if !strings.Contains(plan, want) {
					t.Errorf("%s (generic %v): the plan does not use %s:\n%s", tc.name, generic, want, plan)
				}
			}
			if seqScan.MatchString(plan) || sortOfScan.MatchString(plan) {
				t.Errorf("%s (generic %v): the plan scans or sorts the table:\n%s", tc.name, generic, plan)
			}
		}
	}
	plan := planOf(t, s, `SELECT s.state, (SELECT count(*) FROM (
			SELECT 1 FROM task_finished f WHERE f.state = ANY (ARRAY[s.state]) ORDER BY f.state, f.id LIMIT $1) x)
		FROM unnest($2::text[]) AS s(state)`, []any{store.CountCap, []string{"dead", "completed"}}, true)
	if !strings.Contains(plan, "task_finished_pkey") || seqScan.MatchString(plan) {
		t.Errorf("capped counts must walk task_finished_pkey:\n%s", plan)
	}
}
