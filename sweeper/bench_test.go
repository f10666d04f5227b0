package sweeper

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// BenchmarkSweepPass times one pass (both rules) over a table of completed
// tasks with 1,000 stale claims among them, at 100,000 and 1,000,000 rows,
// and logs the plans of the two rules' selecting scans. The pass must cost
// what the stale rows cost, not what the table costs.
func BenchmarkSweepPass(b *testing.B) {
	for _, rows := range []int{100_000, 1_000_000} {
		b.Run(fmt.Sprintf("rows=%d", rows), func(b *testing.B) {
			f := setup(b)
			ctx := context.Background()
			f.exec(`INSERT INTO tasks (kind, shard, key, state, attempt, max_attempts, claimed_by, claim_epoch, claimed_at, heartbeat_at, finished_at)
				SELECT 'k', g % 256, g::text, 'completed', 1, 5, 'r', 1, now() - interval '2 hours', now() - interval '2 hours', now() - interval '1 hour'
				FROM generate_series(1, $1) g`, rows)
			f.exec(`VACUUM ANALYZE tasks`)
			s := f.sweeper(func(c *Config) { c.BatchSize = 1000 })
			f.clock.Advance(time.Hour)
			// The first 1,000 tasks claimed an hour ago by a runner that
			// is gone (taken back from wherever the last pass left them).
			stale := func() {
				f.exec(`WITH fin AS (DELETE FROM task_finished WHERE id <= 1000),
					rdy AS (DELETE FROM task_ready WHERE id <= 1000),
					u AS (UPDATE tasks SET state = 'ready', attempt = 1, run_after = now(), finished_at = NULL
						WHERE id <= 1000 RETURNING id, shard)
					INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt, claimed_at, heartbeat_at)
					SELECT id, shard, 'default', 1, 'r', 1, now() - interval '1 hour', now() - interval '1 hour' FROM u`)
			}
			explain(b, f, "stale rule", `SELECT id FROM task_claims
				WHERE claimed_at < now() - interval '30 seconds'
				  AND coalesce(heartbeat_at, claimed_at) < now() - interval '30 seconds'
				ORDER BY claimed_at LIMIT 1000 FOR UPDATE SKIP LOCKED`, stale)
			explain(b, f, "deadline rule", `SELECT ctid FROM task_ready WHERE deadline < now()
				ORDER BY deadline LIMIT 1000 FOR UPDATE SKIP LOCKED`, nil)
			var total time.Duration
			for b.Loop() {
				b.StopTimer()
				stale()
				b.StartTimer()
				start := time.Now()
				r := s.Pass(ctx)
				total += time.Since(start)
				if r.Err != nil || r.Requeued != 1000 {
					b.Fatalf("%+v", r)
				}
			}
			b.ReportMetric(float64(total.Microseconds())/1000/float64(b.N), "ms/pass")
		})
	}
}

func explain(b *testing.B, f *fixture, what, query string, prepare func()) {
	b.Helper()
	if prepare != nil {
		prepare()
	}
	tx, err := f.store.Pool().Begin(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	rows, err := tx.Query(context.Background(), "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) "+query)
	if err != nil {
		b.Fatal(err)
	}
	var plan []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			b.Fatal(err)
		}
		plan = append(plan, line)
	}
	b.Logf("%s plan:\n%s", what, strings.Join(plan, "\n"))
	if !strings.Contains(strings.Join(plan, "\n"), "Index") {
		b.Fatalf("%s is not index-driven", what)
	}
}
