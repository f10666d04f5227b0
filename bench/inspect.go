package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// inspectResult is the task-operations measurement at 10 million rows:
// listing latencies with their plans, counting, bulk operations, and what
// building the indexes costs.
type inspectResult struct {
	Rows          int                `json:"rows"`
	Distribution  string             `json:"distribution"`
	LoadS         float64            `json:"load_s"`
	IndexBuildS   map[string]float64 `json:"index_build_s"`
	Queries       []inspectQuery     `json:"queries"`
	CountFullMS   float64            `json:"count_by_state_full_ms"`
	CountCappedMS float64            `json:"count_by_state_capped_ms"`
	CountCap      int                `json:"count_cap"`
	CountPlan     string             `json:"count_capped_plan"`
	BulkCancel    bulkTiming         `json:"bulk_cancel"`
	BulkRetry     bulkTiming         `json:"bulk_retry"`
}

type inspectQuery struct {
	Name     string    `json:"name"`
	Request  string    `json:"request"`
	Returned int       `json:"returned"`
	Next     int64     `json:"next,omitempty"`
	MS       []float64 `json:"ms"`
	P50MS    float64   `json:"p50_ms"`
	MaxMS    float64   `json:"max_ms"`
	Plan     string    `json:"plan"`
}

type bulkTiming struct {
	Filter string  `json:"filter"`
	Tasks  int64   `json:"tasks"`
	S      float64 `json:"s"`
	PerS   float64 `json:"tasks_per_s"`
}

// inspectRows is the table size of the inspect section (-inspect-rows).
var inspectRows = 10_000_000

func (e *env) inspectSection(ctx context.Context, rep *Report, trials int) error {
	dsn, err := e.database(ctx, "inspect")
	if err != nil {
		return err
	}
	st, err := store.Open(ctx, dsn, store.Options{MaxConns: 4})
	if err != nil {
		return err
	}
	defer st.Close()
	if err := st.Migrate(ctx); err != nil {
		return err
	}
	res := inspectResult{Rows: inspectRows, IndexBuildS: map[string]float64{}, CountCap: store.CountCap,
		Distribution: "20 kinds, 256 shards, a distinct key per task; 96.4% completed, 2% ready, 1% dead, 0.5% failed, 0.1% cancelled, 0.02% running; created 10ms apart"}
	// Loading with the secondary indexes in place costs far more than
	// building them afterwards; the build times are what the migration's
	// concurrent builds cost on a table of this size (plain builds, which
	// take about half as long as concurrent ones).
	rows, err := st.Pool().Query(ctx, `SELECT indexname, indexdef FROM pg_indexes
		WHERE tablename = 'tasks' AND indexname <> 'tasks_pkey'`)
	if err != nil {
		return err
	}
	type index struct{ name, def string }
	indexes, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (index, error) {
		var i index
		err := r.Scan(&i.name, &i.def)
		return i, err
	})
	if err != nil {
		return err
	}
	for _, i := range indexes {
		if _, err := st.Pool().Exec(ctx, "DROP INDEX "+i.name); err != nil {
			return err
		}
	}
	fmt.Fprintf(e.log, "  loading %d rows…\n", inspectRows)
	start := time.Now()
	if _, err := st.Pool().Exec(ctx, `
		INSERT INTO tasks (kind, shard, key, state, attempt, max_attempts, claimed_by, claim_epoch, claimed_at, heartbeat_at,
		                   finished_at, created_at, errors)
		SELECT 'kind-' || (g % 20), g % 256, md5(g::text), CASE WHEN s.state = 'running' THEN 'ready' ELSE s.state END, 1, 5,
		       CASE WHEN s.state <> 'ready' THEN 'runner-' || (g % 3) END, CASE WHEN s.state <> 'ready' THEN 1 END,
		       CASE WHEN s.state <> 'ready' THEN now() END, CASE WHEN s.state <> 'ready' THEN now() END,
		       CASE WHEN s.state NOT IN ('ready', 'running') THEN now() END,
		       now() - ($1 - g) * interval '10 ms',
		       CASE WHEN s.state IN ('dead', 'failed') THEN '[{"attempt": 1, "error": "boom"}]'::jsonb ELSE '[]'::jsonb END
		FROM generate_series(1, $1) g,
		LATERAL (SELECT CASE WHEN g % 100 = 7 THEN 'dead' WHEN g % 200 = 3 THEN 'failed' WHEN g % 50 = 1 THEN 'ready'
		                     WHEN g % 5000 = 11 THEN 'running' WHEN g % 1000 = 5 THEN 'cancelled' ELSE 'completed' END AS state) s`,
		inspectRows); err != nil {
		return fmt.Errorf("loading: %w", err)
	}
	// A running task is ready in tasks, out of task_ready, with its claim
	// in task_claims: the loaded rows with a claimer and no finish become
	// so.
	if _, err := st.Pool().Exec(ctx, `
		WITH r AS (
			DELETE FROM task_ready r USING tasks t
			WHERE t.id = r.id AND t.state = 'ready' AND t.claimed_by IS NOT NULL
			RETURNING r.id, r.shard, r.queue, t.claimed_by
		), c AS (
			INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt, claimed_at, heartbeat_at)
			SELECT id, shard, queue, 1, claimed_by, 1, now(), now() FROM r
		)
		UPDATE tasks SET claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL, heartbeat_at = NULL
		WHERE id IN (SELECT id FROM r)`); err != nil {
		return fmt.Errorf("loading: claiming the running tasks: %w", err)
	}
	res.LoadS = time.Since(start).Seconds()
	for _, i := range indexes {
		start := time.Now()
		if _, err := st.Pool().Exec(ctx, i.def); err != nil {
			return fmt.Errorf("building %s: %w", i.name, err)
		}
		res.IndexBuildS[i.name] = time.Since(start).Seconds()
	}
	if _, err := st.Pool().Exec(ctx, `VACUUM ANALYZE tasks`); err != nil {
		return err
	}
	fmt.Fprintf(e.log, "  loaded in %.0fs, indexes built in %v\n", res.LoadS, res.IndexBuildS)

	var someKey string
	if err := st.Pool().QueryRow(ctx, `SELECT key FROM tasks WHERE id = (SELECT max(id) * 42 / 100 FROM tasks)`).Scan(&someKey); err != nil {
		return err
	}
	shard := 7
	states := func(s ...tasks.State) []tasks.State { return s }
	hourAgo := time.Now().Add(-time.Hour)
	for _, q := range []struct {
		name string
		req  tasks.ListRequest
	}{
		{"first page, no filter", tasks.ListRequest{}},
		{"dead", tasks.ListRequest{Filter: tasks.Filter{States: states(tasks.Dead)}}},
		{"dead, a page deep in the table", tasks.ListRequest{Filter: tasks.Filter{States: states(tasks.Dead)}, After: int64(inspectRows) * 9 / 10}},
		{"completed, newest first", tasks.ListRequest{Filter: tasks.Filter{States: states(tasks.Completed)}, Desc: true}},
		{"dead or failed", tasks.ListRequest{Filter: tasks.Filter{States: states(tasks.Dead, tasks.Failed)}}},
		{"one kind", tasks.ListRequest{Filter: tasks.Filter{Kind: "kind-7"}, After: int64(inspectRows) / 2}},
		{"one kind, dead", tasks.ListRequest{Filter: tasks.Filter{Kind: "kind-7", States: states(tasks.Dead)}}},
		{"one kind, dead: none match", tasks.ListRequest{Filter: tasks.Filter{Kind: "kind-3", States: states(tasks.Dead)}}},
		{"one key", tasks.ListRequest{Filter: tasks.Filter{Key: someKey}}},
		{"one key, completed", tasks.ListRequest{Filter: tasks.Filter{Key: someKey, States: states(tasks.Completed)}}},
		{"one shard", tasks.ListRequest{Filter: tasks.Filter{Shard: &shard}}},
		{"one shard, dead", tasks.ListRequest{Filter: tasks.Filter{Shard: &shard, States: states(tasks.Dead)}}},
		{"one shard, one kind, dead: none match (bounded scan)", tasks.ListRequest{Filter: tasks.Filter{Shard: &shard, Kind: "kind-3", States: states(tasks.Dead)}}},
		{"ready, created over an hour ago", tasks.ListRequest{Filter: tasks.Filter{States: states(tasks.Ready), CreatedBefore: hourAgo}}},
	} {
		q.req.Limit = 100
		r := inspectQuery{Name: q.name, Request: describe(q.req)}
		for range max(trials, 3) * 5 {
			start := time.Now()
			page, err := st.List(ctx, q.req)
			if err != nil {
				return fmt.Errorf("%s: %w", q.name, err)
			}
			r.MS = append(r.MS, float64(time.Since(start).Microseconds())/1000)
			r.Returned, r.Next = len(page.Tasks), page.Next
		}
		r.P50MS, r.MaxMS = median(r.MS), slices.Max(r.MS)
		sql, args := store.ListQuery(q.req)
		if r.Plan, err = explainArgs(ctx, st, sql, args); err != nil {
			return fmt.Errorf("explaining %s: %w", q.name, err)
		}
		res.Queries = append(res.Queries, r)
		fmt.Fprintf(e.log, "  %-55s %3d tasks  p50 %6.2f ms  max %6.2f ms\n", q.name, r.Returned, r.P50MS, r.MaxMS)
	}

	start = time.Now()
	if _, err := st.CountByState(ctx); err != nil {
		return err
	}
	res.CountFullMS = float64(time.Since(start).Microseconds()) / 1000
	var capped []float64
	for range 5 {
		start = time.Now()
		if _, err := st.CountByStateCapped(ctx, store.CountCap); err != nil {
			return err
		}
		capped = append(capped, float64(time.Since(start).Microseconds())/1000)
	}
	res.CountCappedMS = median(capped)
	res.CountPlan, _ = explainArgs(ctx, st, `SELECT s.state, (SELECT count(*) FROM (
			SELECT 1 FROM tasks t WHERE t.state = ANY (ARRAY[s.state]) ORDER BY t.state, t.id LIMIT $1) x)
		FROM unnest($2::text[]) AS s(state)`, []any{store.CountCap, []string{"ready", "running", "completed", "failed", "dead", "cancelled"}})
	fmt.Fprintf(e.log, "  count by state: full %.0f ms, capped at %d %.1f ms\n", res.CountFullMS, store.CountCap, res.CountCappedMS)

	// Bulk: cancel then retry the 100,000 ready tasks of one kind.
	f := tasks.Filter{Kind: "kind-1", States: states(tasks.Ready)}
	start = time.Now()
	var total tasks.BulkResult
	for after := int64(0); ; {
		r, err := st.CancelMatching(ctx, f, after, time.Minute)
		if err != nil {
			return err
		}
		total.Add(r)
		if r.Done {
			break
		}
		after = r.Next
	}
	s := time.Since(start).Seconds()
	res.BulkCancel = bulkTiming{Filter: "kind=kind-1&state=ready", Tasks: total.Cancelled, S: s, PerS: float64(total.Cancelled) / s}
	start = time.Now()
	total = tasks.BulkResult{}
	for after := int64(0); ; {
		r, err := st.RetryMatching(ctx, tasks.Filter{Kind: "kind-1", States: states(tasks.Cancelled)}, after, time.Minute)
		if err != nil {
			return err
		}
		total.Add(r)
		if r.Done {
			break
		}
		after = r.Next
	}
	s = time.Since(start).Seconds()
	res.BulkRetry = bulkTiming{Filter: "kind=kind-1&state=cancelled", Tasks: total.Retried, S: s, PerS: float64(total.Retried) / s}
	fmt.Fprintf(e.log, "  bulk cancel %d tasks in %.1fs, bulk retry %d in %.1fs\n", res.BulkCancel.Tasks, res.BulkCancel.S, res.BulkRetry.Tasks, res.BulkRetry.S)
	rep.Inspect = &res
	return nil
}

func describe(req tasks.ListRequest) string {
	var parts []string
	for _, s := range req.States {
		parts = append(parts, "state="+string(s))
	}
	if req.Kind != "" {
		parts = append(parts, "kind="+req.Kind)
	}
	if req.Key != "" {
		parts = append(parts, "key="+req.Key)
	}
	if req.Shard != nil {
		parts = append(parts, fmt.Sprint("shard=", *req.Shard))
	}
	if !req.CreatedBefore.IsZero() {
		parts = append(parts, "created_before=now-1h")
	}
	if req.After > 0 {
		parts = append(parts, fmt.Sprint("after=", req.After))
	}
	if req.Desc {
		parts = append(parts, "order=desc")
	}
	parts = append(parts, fmt.Sprint("limit=", req.Limit))
	return strings.Join(parts, "&")
}

// explainArgs explains a statement with its arguments, run on the store's
// pool (whose sessions have bitmap scans off).
func explainArgs(ctx context.Context, st *store.Store, sql string, args []any) (string, error) {
	rows, err := st.Pool().Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "+sql, args...)
	if err != nil {
		return "", err
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return strings.Join(lines, "\n"), err
}

// enqueueResult compares the enqueue paths, rows per second.
type enqueueResult struct {
	Batch  int                  `json:"batch_rows"`
	Rows   int                  `json:"rows_per_trial"`
	PerS   map[string][]float64 `json:"rows_per_s"`
	Median map[string]float64   `json:"median_rows_per_s"`
	Notes  string               `json:"notes"`
}

// enqueueSection measures the enqueue paths side by side in fresh
// databases, alternating: COPY (no unique keys); the unique-key path
// (INSERT … SELECT FROM unnest … ON CONFLICT DO NOTHING, ids drawn ahead)
// with every key new and with half of them duplicates; COPY into a
// temporary table and INSERT … SELECT … ON CONFLICT from it (the
// alternative the store does not use); and single-row enqueues with and
// without a unique key.
func (e *env) enqueueSection(ctx context.Context, rep *Report, trials int) error {
	const batch, batches = 1000, 100
	res := enqueueResult{Batch: batch, Rows: batch * batches, PerS: map[string][]float64{}, Median: map[string]float64{},
		Notes: "each trial in a fresh database with the full schema; the single-row paths insert 5,000 rows one statement each"}
	mk := func(n, trial int, unique string) []store.Insert {
		ins := make([]store.Insert, n)
		for i := range ins {
			ins[i] = store.Insert{NewTask: tasks.NewTask{Kind: "noop", Payload: []byte(`{}`), Options: tasks.Options{Key: fmt.Sprintf("k%d-%d", trial, i)}.WithDefaults(5)}, Shard: i % 256}
			switch unique {
			case "new":
				ins[i].UniqueKey = fmt.Sprintf("u%d-%d-%d", trial, i, rand.Int64())
			case "half":
				ins[i].UniqueKey = fmt.Sprintf("u%d-%d", trial, i%(n/2))
			}
		}
		return ins
	}
	paths := []struct {
		name string
		run  func(st *store.Store, trial int) (int, error)
	}{
		{"copy", func(st *store.Store, trial int) (int, error) {
			for b := range batches {
				if _, err := st.EnqueueBatch(ctx, mk(batch, trial*batches+b, "")); err != nil {
					return 0, err
				}
			}
			return batch * batches, nil
		}},
		{"unique keys, all new", func(st *store.Store, trial int) (int, error) {
			for b := range batches {
				if _, err := st.EnqueueBatch(ctx, mk(batch, trial*batches+b, "new")); err != nil {
					return 0, err
				}
			}
			return batch * batches, nil
		}},
		{"unique keys, half duplicates", func(st *store.Store, trial int) (int, error) {
			for b := range batches {
				if _, err := st.EnqueueBatch(ctx, mk(batch, trial*batches+b, "half")); err != nil {
					return 0, err
				}
			}
			return batch * batches, nil
		}},
		{"single rows", func(st *store.Store, trial int) (int, error) {
			for _, in := range mk(5000, trial, "") {
				if _, err := st.Enqueue(ctx, in); err != nil {
					return 0, err
				}
			}
			return 5000, nil
		}},
		{"single rows, unique keys", func(st *store.Store, trial int) (int, error) {
			for _, in := range mk(5000, trial, "new") {
				if _, err := st.Enqueue(ctx, in); err != nil {
					return 0, err
				}
			}
			return 5000, nil
		}},
	}
	for trial := range trials {
		for _, p := range paths {
			dsn, err := e.database(ctx, "enqueue")
			if err != nil {
				return err
			}
			st, err := store.Open(ctx, dsn, store.Options{MaxConns: 2})
			if err != nil {
				return err
			}
			if err := st.Migrate(ctx); err != nil {
				st.Close()
				return err
			}
			start := time.Now()
			n, err := p.run(st, trial)
			st.Close()
			if err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
			rate := float64(n) / time.Since(start).Seconds()
			res.PerS[p.name] = append(res.PerS[p.name], rate)
			fmt.Fprintf(e.log, "  trial %d, %-48s %8.0f rows/s\n", trial+1, p.name, rate)
		}
	}
	for name, rates := range res.PerS {
		res.Median[name] = median(rates)
	}
	rep.Enqueue = &res
	return nil
}
