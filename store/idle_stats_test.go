package store_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// A cluster idles, autovacuum analyses the empty queue tables (reltuples 0,
// relpages 0: the planner then takes them for empty, not for "never
// measured"), the idle runners' polls run the claim statement a few times,
// and then a burst of tasks arrives. The claims of the burst must still find
// the claimed tasks' records by primary key. A plan made while the tables
// were empty and cached for the connection (PostgreSQL's generic plan of a
// prepared statement, chosen after five executions) found them through
// tasks_kind_id_idx (kind, id) instead, id being its second column: one walk
// of the whole index per claimed task, 4x slower in the bench's burn-down
// until autovacuum analysed the tables again.
func TestClaimAfterIdleAnalyze(t *testing.T) {
	ctx := context.Background()
	// Two connections: the idle claims and the burst's claims share the
	// sessions, as a runner's pooled connections do over time.
	const conns = 2
	s, _ := pgtest.NewStore(t, store.Options{MaxConns: conns})
	owned := []claims.ShardEpoch{{Shard: 0, Epoch: 1}, {Shard: 1, Epoch: 1}}
	if _, _, _, err := raiseFences(s, ctx, "r", "", owned); err != nil {
		t.Fatal(err)
	}
	kinds := []string{"noop", "sleep", "fail"}
	// No autovacuum during the test: its analysis of the burst would drop
	// the cached plan (which is how the bench's slow phase ended, a minute
	// in), and the test would pass by chance.
	for _, table := range []string{"tasks", "task_ready", "task_claims", "task_finished"} {
		exec(t, s, "ALTER TABLE "+table+" SET (autovacuum_enabled = off)")
	}
	exec(t, s, "VACUUM ANALYZE")
	// The idle polls, ten on each connection (PostgreSQL settles on a
	// generic plan after five executions): hold every connection but one.
	held := make([]*pgxpool.Conn, conns)
	for i := range held {
		c, err := s.Pool().Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held[i] = c
	}
	for i := range held {
		held[i].Release()
		for range 10 {
			if got, err := s.Claim(ctx, "r", owned, tasks.DefaultQueue, kinds, 500, 500); err != nil || len(got) != 0 {
				t.Fatalf("idle claim: %d tasks, %v", len(got), err)
			}
		}
		c, err := s.Pool().Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held[i] = c
	}
	for _, c := range held {
		c.Release()
	}
	exec(t, s, `INSERT INTO tasks (kind, shard, key) SELECT 'noop', g % 2, g::text FROM generate_series(1, 20000) g`)

	blocks := func() (kindIdx, pkey int64) {
		t.Helper()
		// Every session's counters, flushed: a session flushes them when it
		// goes idle, at most once a second unless forced.
		var held []*pgxpool.Conn
		for range conns {
			c, err := s.Pool().Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			held = append(held, c)
			if _, err := c.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Exec(ctx, "SELECT 1"); err != nil {
				t.Fatal(err)
			}
		}
		for _, c := range held {
			c.Release()
		}
		if err := s.Pool().QueryRow(ctx, `SELECT
			(SELECT idx_blks_hit + idx_blks_read FROM pg_statio_user_indexes WHERE indexrelname = 'tasks_kind_id_idx'),
			(SELECT idx_blks_hit + idx_blks_read FROM pg_statio_user_indexes WHERE indexrelname = 'tasks_pkey')`).Scan(&kindIdx, &pkey); err != nil {
			t.Fatal(err)
		}
		return kindIdx, pkey
	}
	kind0, pkey0 := blocks()
	claimed := 0
	for range 4 {
		got, err := s.Claim(ctx, "r", owned, tasks.DefaultQueue, kinds, 500, 500)
		if err != nil {
			t.Fatal(err)
		}
		claimed += len(got)
	}
	if claimed != 2000 {
		t.Fatalf("claimed %d tasks, want 2000", claimed)
	}
	kind1, pkey1 := blocks()
	t.Logf("claims of %d tasks read %d blocks of tasks_kind_id_idx and %d of tasks_pkey", claimed, kind1-kind0, pkey1-pkey0)
	// The planner reads the index's metapage (its height) when it plans a
	// claim; a walk of the index per task reads about 78 blocks per task.
	if kind1-kind0 > int64(claimed)/100 {
		t.Errorf("the claims read %d blocks of tasks_kind_id_idx (%.1f per claimed task): the records must be found by primary key",
			kind1-kind0, float64(kind1-kind0)/float64(claimed))
	}
	if pkey1-pkey0 < int64(claimed) {
		t.Errorf("the claims read %d blocks of tasks_pkey for %d tasks", pkey1-pkey0, claimed)
	}
}

// The coordinator's pool plans every statement at each execution (its
// leader passes run on idle tables, as the claim does); other pools keep
// PostgreSQL's plan cache, which the sequence trigger's statements need.
func TestPlanEachExecutionIsThePoolsPlanCacheMode(t *testing.T) {
	ctx := context.Background()
	for _, each := range []bool{false, true} {
		s, _ := pgtest.NewStore(t, store.Options{MaxConns: 2, PlanEachExecution: each})
		var mode string
		if err := s.Pool().QueryRow(ctx, "SHOW plan_cache_mode").Scan(&mode); err != nil {
			t.Fatal(err)
		}
		if want := map[bool]string{false: "auto", true: "force_custom_plan"}[each]; mode != want {
			t.Errorf("PlanEachExecution %v: plan_cache_mode %s, want %s", each, mode, want)
		}
	}
}
