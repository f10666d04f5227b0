package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
)

// sweepResult is one table size's sweep pass timings.
type sweepResult struct {
	Rows       int       `json:"rows"`
	Stale      int       `json:"stale_claims"`
	PassMS     []float64 `json:"pass_ms"`
	MedianMS   float64   `json:"median_ms"`
	StalePlan  string    `json:"stale_rule_plan"`
	DeadlnPlan string    `json:"deadline_rule_plan"`
}

func (e *env) sweepSection(ctx context.Context, rep *Report, trials int) error {
	for _, rows := range []int{100_000, 1_000_000} {
		dsn, err := e.database(ctx, fmt.Sprintf("sweep_%d", rows))
		if err != nil {
			return err
		}
		st, err := store.Open(ctx, dsn, store.Options{MaxConns: 4})
		if err != nil {
			return err
		}
		if err := st.Migrate(ctx); err != nil {
			return err
		}
		if _, err := st.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key, state, attempt, max_attempts, claimed_by, claim_epoch, claimed_at, heartbeat_at, finished_at)
			SELECT 'noop', g % 256, g::text, s.state, 1, 5, r.by, r.epoch, r.at, r.at, r.at + interval '1 hour'
			FROM generate_series(1, $1) g,
			LATERAL (SELECT CASE WHEN g <= 1000 THEN 'ready' ELSE 'completed' END AS state) s,
			LATERAL (SELECT CASE WHEN s.state = 'completed' THEN 'r' END AS by, CASE WHEN s.state = 'completed' THEN 1 END AS epoch,
			                CASE WHEN s.state = 'completed' THEN now() - interval '2 hours' END AS at) r`, rows); err != nil {
			return err
		}
		if _, err := st.Pool().Exec(ctx, `VACUUM ANALYZE tasks`); err != nil {
			return err
		}
		if ok, err := st.RaiseLeaderFence(ctx, "bench", 1); err != nil || !ok {
			return fmt.Errorf("fence: %v %v", ok, err)
		}
		const threshold = 5 * time.Second
		sw, err := sweeper.New(st, sweeper.Config{StaleThreshold: threshold, HeartbeatInterval: time.Second}, nil)
		if err != nil {
			return err
		}
		// The sweeper judges nothing until the database has been up for
		// the stale threshold (no heartbeat could be written before): a
		// bench whose first section this is starts right after the server.
		if err := waitEvery(time.Minute, 100*time.Millisecond, func() bool {
			up, err := st.Uptime(ctx)
			return err == nil && up > threshold
		}); err != nil {
			return fmt.Errorf("waiting for the database's uptime to pass the stale threshold: %w", err)
		}
		// A term that began a stale threshold ago: Pass applies both rules,
		// as the leader's passes do once its grace has passed.
		term := leader.Term{Epoch: 1, Start: time.Now().Add(-time.Minute), Clock: clock.Real(), Log: hclog.NewNullLogger()}
		sw.Begin(term)
		res := sweepResult{Rows: rows, Stale: 1000}
		// Tasks 1 to 1,000 become running under claims an hour old, as a
		// runner that died an hour ago leaves them (a running task is ready
		// in tasks, out of task_ready, with a row in task_claims); again
		// after each pass requeued them.
		stale := `WITH r AS (
				DELETE FROM task_ready WHERE id <= 1000 RETURNING id, shard, queue
			), c AS (
				INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt, claimed_at, heartbeat_at)
				SELECT id, shard, queue, 1, 'r', 1, now() - interval '1 hour', now() - interval '1 hour' FROM r
			)
			UPDATE tasks SET attempt = 1, run_after = now() WHERE id <= 1000`
		res.StalePlan, _ = explain(ctx, st, stale, `SELECT id FROM task_claims
			WHERE claimed_at < now() - interval '30 seconds' AND coalesce(heartbeat_at, claimed_at) < now() - interval '30 seconds'
			  AND (deadline IS NULL OR deadline >= now())
			LIMIT 1000 FOR UPDATE SKIP LOCKED`)
		res.DeadlnPlan, _ = explain(ctx, st, "", `SELECT id FROM task_claims WHERE deadline < now() ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED`)
		for range max(trials, 3) {
			if _, err := st.Pool().Exec(ctx, stale); err != nil {
				return err
			}
			start := time.Now()
			r, _ := leader.Once(ctx, sw, term)
			d := time.Since(start)
			if r.Err != nil || r.Detail.(sweeper.Result).Requeued != 1000 {
				return fmt.Errorf("sweep pass: %+v", r)
			}
			res.PassMS = append(res.PassMS, float64(d.Microseconds())/1000)
		}
		res.MedianMS = median(res.PassMS)
		rep.Sweep = append(rep.Sweep, res)
		fmt.Fprintf(e.log, "  %d rows, 1,000 stale claims: pass %s ms\n", rows, fmtList(res.PassMS))
		st.Close()
	}
	return nil
}

func explain(ctx context.Context, st *store.Store, prepare, query string) (string, error) {
	if prepare != "" {
		if _, err := st.Pool().Exec(ctx, prepare); err != nil {
			return "", err
		}
	}
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) "+query)
	if err != nil {
		return "", err
	}
	var lines []string
	for rows.Next() {
		var l string
		_ = rows.Scan(&l)
		lines = append(lines, l)
	}
	return strings.Join(lines, "\n"), rows.Err()
}

// cost is what running shardrun costs.
type cost struct {
	EtcdMsgsPerRunnerPerS map[string]float64 `json:"etcd_msgs_per_runner_per_s_by_shard_count"`
	IdleRSSMiB            float64            `json:"idle_rss_mib_per_runner"`
	LoadRSSMiB            float64            `json:"peak_rss_mib_per_runner_under_load"`
	XactsPerTask          map[string]float64 `json:"pg_transactions_per_completed_task"`
	StmtsPerTask          map[string]float64 `json:"pg_statements_per_completed_task,omitempty"`
	Window                string             `json:"measurement_window"`
}

func (e *env) costSection(ctx context.Context, rep *Report) error {
	c := &cost{EtcdMsgsPerRunnerPerS: map[string]float64{}, XactsPerTask: map[string]float64{}, StmtsPerTask: map[string]float64{}, Window: "20s, 3 idle runners, lease TTL 10s"}
	for _, shards := range []int{256, 4096} {
		dsn, err := e.database(ctx, fmt.Sprintf("cost_%d", shards))
		if err != nil {
			return err
		}
		st, err := store.Open(ctx, dsn, store.Options{})
		if err != nil {
			return err
		}
		_ = st.Migrate(ctx)
		st.Close()
		cl := e.newCluster(fmt.Sprintf("cost-%d-%d", shards, time.Now().UnixNano()), dsn, shards)
		for i := 1; i <= 3; i++ {
			if _, err := cl.start(fmt.Sprintf("runner-%d", i), runnerOpts{leaseTTL: 10 * time.Second}); err != nil {
				cl.stop()
				return err
			}
		}
		if err := waitUntil(60*time.Second, func() bool { return cl.balanced(ctx, "runner-1", "runner-2", "runner-3") }); err != nil {
			cl.stop()
			return err
		}
		time.Sleep(2 * time.Second) // settle before measuring a steady rate
		before, _ := embedetcd.MessagesReceived()
		const window = 20 * time.Second
		time.Sleep(window) // a fixed measurement window, not a wait for a condition
		after, _ := embedetcd.MessagesReceived()
		rate := (after - before) / window.Seconds() / 3
		c.EtcdMsgsPerRunnerPerS[fmt.Sprint(shards)] = rate
		if shards == 256 {
			var rss float64
			for _, r := range cl.runners {
				rss += r.metric("process_resident_memory_bytes")
			}
			c.IdleRSSMiB = rss / 3 / (1 << 20)
		}
		cl.stop()
		fmt.Fprintf(e.log, "  %d shards: %.2f etcd messages/s per runner at steady state\n", shards, rate)
	}
	// Per-task database cost: the median over the one-process trials.
	xacts, stmts := map[string][]float64{}, map[string][]float64{}
	for _, t := range rep.Throughput {
		if t.Processes == 1 {
			xacts[t.System] = append(xacts[t.System], t.XactsPerTask)
			stmts[t.System] = append(stmts[t.System], t.StmtsPerTask)
			if t.System == "shardrun" {
				c.LoadRSSMiB = max(c.LoadRSSMiB, t.PeakRSSMiB)
			}
		}
	}
	for sys := range xacts {
		c.XactsPerTask[sys], c.StmtsPerTask[sys] = median(xacts[sys]), median(stmts[sys])
	}
	rep.Cost = c
	return nil
}
