package store_test

import (
	"context"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// layoutMigration is the migration that split the task record from its
// work queues (00007_task_layout.sql).
const layoutMigration = 7

// The previous build's claim and completion, as its store sent them
// (store/claim.go, as it was, before the layout migration): a runner of that build that
// was not stopped before the upgrade sends exactly these.
const (
	previousClaim = `
		WITH fence AS (
			SELECT f.shard, f.epoch FROM shard_fences f
			JOIN (SELECT * FROM unnest($2::int[], $3::bigint[])) AS o(shard, epoch) ON o.shard = f.shard AND o.epoch = f.epoch
			WHERE f.owner = $1 ORDER BY f.shard FOR SHARE OF f
		), candidates AS (
			SELECT c.id FROM unnest($4::text[]) AS k(kind)
			CROSS JOIN LATERAL (
				SELECT t.id, t.run_after FROM tasks t
				WHERE t.state = 'ready' AND t.kind = k.kind AND t.run_after <= now()
				  AND (t.deadline IS NULL OR t.deadline > now())
				  AND t.shard = ANY (ARRAY(SELECT shard FROM fence))
				ORDER BY t.run_after, t.id LIMIT $5) c
			ORDER BY c.run_after, c.id LIMIT $5
		), picked AS (
			SELECT t.id, ($3::bigint[])[array_position($2::int[], t.shard)] AS epoch
			FROM tasks t
			WHERE t.id = ANY (ARRAY(SELECT id FROM candidates)) AND t.state = 'ready' AND t.run_after <= now()
			  AND (t.deadline IS NULL OR t.deadline > now())
			  AND t.shard = ANY (ARRAY(SELECT shard FROM fence))
			FOR UPDATE OF t SKIP LOCKED
		)
		UPDATE tasks t SET state = 'running', claimed_by = $1, claim_epoch = p.epoch, claimed_at = now(), heartbeat_at = NULL
		FROM unnest(ARRAY(SELECT id FROM picked ORDER BY id), ARRAY(SELECT epoch FROM picked ORDER BY id)) AS p(id, epoch)
		WHERE t.id = p.id
		RETURNING t.id`
	previousComplete = `
		WITH c AS (SELECT * FROM unnest($2::bigint[], $3::int[], $4::int[], $5::bigint[]) AS u(id, shard, attempt, epoch)),
		fence AS (
			SELECT f.shard, f.epoch FROM shard_fences f
			JOIN (SELECT DISTINCT shard, epoch FROM c) AS o(shard, epoch) ON o.shard = f.shard AND o.epoch = f.epoch
			WHERE f.owner = $1 ORDER BY f.shard FOR SHARE OF f
		)
		UPDATE tasks t SET state = 'completed', finished_at = now(), heartbeat_at = now()
		FROM c JOIN fence ON fence.shard = c.shard AND fence.epoch = c.epoch
		WHERE t.id = c.id AND t.shard = c.shard AND t.state = 'running'
		  AND t.claimed_by = $1 AND t.claim_epoch = c.epoch AND t.attempt = c.attempt`
)

// TestUpgradeToTheTaskLayout fills a database of the previous layout with
// about a million tasks in every state — running ones with live claims,
// ready ones due now and later, unique keys, deadlines, cancel requests —
// migrates it, and checks that nothing is lost, run twice or left stuck:
// every task is where its state says and nowhere else, a runner of the
// previous build can neither claim nor finish anything, and a runner of
// this build that takes the shards over runs every due task exactly once.
// SHARDRUN_UPGRADE_ROWS sets the row count: 200,000 by default, a million
// in `make upgrade-test` (.ci/run runs it).
func TestUpgradeToTheTaskLayout(t *testing.T) {
	t.Parallel()
	rows := 200_000
	if v := os.Getenv("SHARDRUN_UPGRADE_ROWS"); v != "" {
		var err error
		if rows, err = strconv.Atoi(v); err != nil || rows < 1000 {
			t.Fatalf("SHARDRUN_UPGRADE_ROWS=%q: want a number of at least 1000", v)
		}
	}
	ctx := context.Background()
	s, err := store.Open(ctx, pgtest.NewDatabase(t), store.Options{MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.MigrateTo(ctx, layoutMigration-1); err != nil {
		t.Fatal(err)
	}
	const shards = 256
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := s.Pool().Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%v\n%s", err, sql)
		}
	}
	exec(`INSERT INTO shard_fences (shard, epoch, owner) SELECT g, 7, 'old-runner' FROM generate_series(0, $1 - 1) g`, shards)
	// g mod 100: 0-14 ready now, 15-19 ready in an hour, 20 running, 21-79
	// completed, 80-86 failed, 87-93 dead, 94-99 cancelled. Every tenth
	// task has a unique key; every 7th a deadline an hour away; every 3rd
	// running one a cancel request; running ones are claimed by the old
	// runner at the shard's epoch.
	start := time.Now()
	exec(`
		INSERT INTO tasks (kind, shard, key, payload, state, attempt, max_attempts, run_after, deadline,
			claimed_by, claim_epoch, claimed_at, heartbeat_at, errors, result, created_at, finished_at,
			cancel_requested_at, unique_key)
		SELECT 'k', g % $2, 'key-' || g, jsonb_build_object('n', g), st, 1 + (g % 3), 5,
			CASE WHEN g % 100 BETWEEN 15 AND 19 THEN now() + interval '1 hour' ELSE now() - interval '1 minute' END,
			CASE WHEN g % 7 = 0 THEN now() + interval '1 hour' END,
			CASE WHEN st <> 'ready' THEN 'old-runner' END, CASE WHEN st <> 'ready' THEN 7 END,
			CASE WHEN st <> 'ready' THEN now() - interval '10 seconds' END,
			CASE WHEN st = 'running' THEN now() - interval '1 second' END,
			CASE WHEN st IN ('failed', 'dead') THEN '[{"attempt": 1, "error": "boom"}]'::jsonb ELSE '[]'::jsonb END,
			CASE WHEN st = 'completed' THEN '{"ok": true}'::jsonb END,
			now() - interval '1 hour',
			CASE WHEN st NOT IN ('ready', 'running') THEN now() - interval '5 minutes' END,
			CASE WHEN st = 'running' AND g % 3 = 0 THEN now() END,
			CASE WHEN g % 10 = 0 THEN 'unique-' || g END
		FROM generate_series(1, $1) g,
		LATERAL (SELECT CASE WHEN g % 100 < 20 THEN 'ready' WHEN g % 100 = 20 THEN 'running'
			WHEN g % 100 < 80 THEN 'completed' WHEN g % 100 < 87 THEN 'failed'
			WHEN g % 100 < 94 THEN 'dead' ELSE 'cancelled' END AS st) x`, rows, shards)
	t.Logf("%d tasks of the previous layout inserted in %s", rows, time.Since(start).Round(time.Millisecond))
	before := stateCounts(t, s, `SELECT state, count(*) FROM tasks GROUP BY state`)
	var keysHeld, dueBefore, laterBefore int64
	if err := s.Pool().QueryRow(ctx, `SELECT
		count(*) FILTER (WHERE unique_key IS NOT NULL AND state IN ('ready', 'running') AND cancel_requested_at IS NULL),
		count(*) FILTER (WHERE state IN ('ready', 'running') AND run_after <= now()),
		count(*) FILTER (WHERE state = 'ready' AND run_after > now())
		FROM tasks`).Scan(&keysHeld, &dueBefore, &laterBefore); err != nil {
		t.Fatal(err)
	}

	start = time.Now()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("migrated %d tasks in %s", rows, time.Since(start).Round(time.Millisecond))

	// Every task where its state says, and nowhere else.
	after := stateCounts(t, s, `SELECT state, count(*) FROM task_view GROUP BY state`)
	for _, st := range tasks.States {
		if before[st] != after[st] {
			t.Errorf("%s: %d before the migration, %d after", st, before[st], after[st])
		}
	}
	var misfiled int64
	if err := s.Pool().QueryRow(ctx, `
		WITH r AS (SELECT id, shard, kind, run_after, count(*) OVER (PARTITION BY id) AS n FROM task_ready),
		c AS (SELECT id FROM task_claims),
		f AS (SELECT id, state FROM task_finished)
		SELECT count(*) FROM tasks t
		LEFT JOIN r ON r.id = t.id AND r.shard = t.shard AND r.kind = t.kind AND r.run_after = t.run_after AND r.n = 1
		LEFT JOIN c ON c.id = t.id
		LEFT JOIN f ON f.id = t.id
		WHERE (t.state = 'ready' AND ((r.id IS NULL) = (c.id IS NULL) OR f.id IS NOT NULL))
		   OR (t.state <> 'ready' AND (r.id IS NOT NULL OR c.id IS NOT NULL OR f.state IS DISTINCT FROM t.state))`).Scan(&misfiled); err != nil {
		t.Fatal(err)
	}
	if misfiled != 0 {
		t.Fatalf("%d tasks are not exactly where their state says", misfiled)
	}
	var claimsKept, keys int64
	if err := s.Pool().QueryRow(ctx, `SELECT
		(SELECT count(*) FROM task_claims c JOIN tasks t ON t.id = c.id
		 WHERE c.owner = 'old-runner' AND c.epoch = 7 AND c.attempt = t.attempt),
		(SELECT count(*) FROM task_unique_keys)`).Scan(&claimsKept, &keys); err != nil {
		t.Fatal(err)
	}
	if claimsKept != before[tasks.Running] || keys != keysHeld {
		t.Fatalf("claims kept %d of %d, unique keys held %d of %d", claimsKept, before[tasks.Running], keys, keysHeld)
	}

	// A runner of the previous build, still running, changes nothing.
	allShards := make([]int32, shards)
	epochs := make([]int64, shards)
	for i := range allShards {
		allShards[i], epochs[i] = int32(i), 7
	}
	if _, err := s.Pool().Exec(ctx, previousClaim, "old-runner", allShards, epochs, []string{"k"}, 100); err == nil {
		t.Fatal("a claim of the previous build succeeded on the new layout")
	}
	var runningID, runningShard, runningAttempt int64
	if err := s.Pool().QueryRow(ctx, `SELECT c.id, c.shard, c.attempt FROM task_claims c LIMIT 1`).Scan(&runningID, &runningShard, &runningAttempt); err != nil {
		t.Fatal(err)
	}
	if tag, err := s.Pool().Exec(ctx, previousComplete, "old-runner", []int64{runningID}, []int32{int32(runningShard)},
		[]int32{int32(runningAttempt)}, []int64{7}); err != nil || tag.RowsAffected() != 0 {
		t.Fatalf("a completion of the previous build: %v rows, %v", tag.RowsAffected(), err)
	}

	// Nor can a runner of the build before capability groups (migrations
	// up to 00009): its fence raise names the shard alone, which is no
	// longer a key of shard_fences, so it never holds a fence to claim under.
	if _, err := s.Pool().Exec(ctx, `INSERT INTO shard_fences AS f (shard, epoch, owner)
		SELECT shard, epoch, $3 FROM unnest($1::int[], $2::bigint[]) AS o(shard, epoch) ORDER BY shard
		ON CONFLICT (shard) DO UPDATE SET epoch = excluded.epoch, owner = excluded.owner, raised_at = now()
		WHERE f.epoch <= excluded.epoch
		RETURNING shard, epoch`, allShards, epochs, "old-runner"); err == nil {
		t.Fatal("a fence raise of the build before capability groups succeeded")
	}

	// A runner of this build takes every shard of its group over; the
	// claims of the previous build belong to no group of this one (their
	// units are the group ''), so the leader's stale sweep requeues them,
	// and the runner runs what is due.
	terms := make([]claims.ShardEpoch, shards)
	for i := range terms {
		terms[i] = claims.ShardEpoch{Shard: i, Epoch: 8}
	}
	raised, requeued, dead, err := raiseFences(s, ctx, "new-runner", "gnew", terms)
	if err != nil || len(raised) != shards || requeued+dead != 0 {
		t.Fatalf("raising the fences: %d raised, %d requeued, %d dead, %v", len(raised), requeued, dead, err)
	}
	if ok, err := s.RaiseLeaderFence(ctx, "new-coordinator", 1); err != nil || !ok {
		t.Fatalf("raising the leader fence: %v %v", ok, err)
	}
	for {
		r, d, err := s.SweepStale(ctx, 1, time.Millisecond, 10_000, store.Backoff{Base: time.Millisecond, Cap: time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		requeued, dead = requeued+r, dead+d
		if r+d == 0 {
			break
		}
	}
	var requested int64
	if err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM tasks WHERE state = 'cancelled' AND cancel_requested_at IS NOT NULL
		AND claimed_by = 'old-runner' AND finished_at > now() - interval '1 minute'`).Scan(&requested); err != nil {
		t.Fatal(err)
	}
	if requeued+dead+requested != before[tasks.Running] {
		t.Fatalf("the orphans of the old runner: %d requeued, %d dead, %d cancelled of %d", requeued, dead, requested, before[tasks.Running])
	}
	seen := map[int64]bool{}
	for {
		got, err := s.Claim(ctx, "new-runner", terms, tasks.DefaultQueue, []string{"k"}, 5000, 5000)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) == 0 {
			break
		}
		done := make([]claims.Completion, len(got))
		for i, task := range got {
			if seen[task.ID] {
				t.Fatalf("task %d claimed twice", task.ID)
			}
			seen[task.ID] = true
			done[i] = claims.Completion{Ref: claims.RefOf(task)}
		}
		res, err := s.Complete(ctx, "new-runner", done)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range res {
			if r.Outcome != claims.Applied {
				t.Fatalf("completing task %d: %s", r.Ref.ID, r.Outcome)
			}
		}
	}
	if int64(len(seen))+dead+requested != dueBefore {
		t.Fatalf("ran %d tasks, %d went dead and %d were cancelled of %d due", len(seen), dead, requested, dueBefore)
	}
	final := stateCounts(t, s, `SELECT state, count(*) FROM task_view GROUP BY state`)
	if final[tasks.Ready] != laterBefore || final[tasks.Running] != 0 ||
		final[tasks.Completed] != before[tasks.Completed]+int64(len(seen)) {
		t.Fatalf("after the takeover: %v (before the migration %v)", final, before)
	}
}

func stateCounts(t *testing.T, s *store.Store, sql string) map[tasks.State]int64 {
	t.Helper()
	rows, err := s.Pool().Query(context.Background(), sql)
	if err != nil {
		t.Fatal(err)
	}
	counts := map[tasks.State]int64{}
	var st string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&st, &n}, func() error {
		counts[tasks.State(st)] = n
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return counts
}

// TestUpgradeRepairsSequences migrates a database of the previous layout
// (migration 9) whose sequences the defects of that layout left in every
// shape — waiting in no place, a head retention deleted, a cancelled head,
// a blocked head — and checks that each comes out as the new layout keeps
// it: the tasks behind a gone or finished head move on, a blocked one
// stays blocked, the waiting ones wait in task_waiting in their order (the
// test database's invariants are checked when the test ends).
func TestUpgradeRepairsSequences(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, err := store.Open(ctx, pgtest.NewDatabase(t), store.Options{MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.MigrateTo(ctx, 9); err != nil {
		t.Fatal(err)
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := s.Pool().Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%v\n%s", err, sql)
		}
	}
	// Four sequences of three tasks each, inserted through the previous
	// layout's trigger: each head in its lane, the rest in no place.
	exec(`INSERT INTO tasks (kind, shard, key, sequence_key, sequence_blocks)
		SELECT 'k', 1, 'k', s, true FROM unnest(ARRAY['ok', 'gone', 'cancelled', 'blocked']) s, generate_series(1, 3) g
		ORDER BY s, g`)
	head := func(key string) int64 {
		var id int64
		if err := s.Pool().QueryRow(ctx, `SELECT head_id FROM task_sequences WHERE key = $1`, key).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	// "gone": retention deleted its head. "cancelled": its head was
	// cancelled and the sequence never moved. "blocked": its head died.
	gone, cancelled, blocked := head("gone"), head("cancelled"), head("blocked")
	exec(`DELETE FROM task_ready WHERE id = ANY ($1)`, []int64{gone, cancelled, blocked})
	exec(`DELETE FROM tasks WHERE id = $1`, gone)
	exec(`UPDATE tasks SET state = 'cancelled', finished_at = now() WHERE id = $1`, cancelled)
	exec(`UPDATE tasks SET state = 'dead', finished_at = now() WHERE id = $1`, blocked)
	exec(`INSERT INTO task_finished (state, id, finished_at, queue) SELECT state, id, finished_at, queue FROM tasks WHERE id = ANY ($1)`,
		[]int64{cancelled, blocked})
	exec(`UPDATE task_sequences SET blocked_at = now() WHERE key = 'blocked'`)
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	raise(t, s, "a", 1, 1)
	got, err := s.Claim(ctx, "a", []claims.ShardEpoch{{Shard: 1, Epoch: 1}}, tasks.DefaultQueue, []string{"k"}, 100, 100)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, task := range got {
		keys = append(keys, task.SequenceKey)
	}
	slices.Sort(keys)
	if !slices.Equal(keys, []string{"cancelled", "gone", "ok"}) {
		t.Fatalf("after the upgrade the claimable heads are of %v, want one each of cancelled, gone and ok (blocked stays blocked)", keys)
	}
	var waiting int
	if err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM task_waiting`).Scan(&waiting); err != nil || waiting != 1+1+2+2 {
		t.Fatalf("%d tasks wait in task_waiting (%v), want 6", waiting, err)
	}
}
