package store_test

// Several databases (issue 40): the router sends each statement to the
// database of its shard, and each database refuses what it does not hold.

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// twoDatabases is a cluster of databases a and b over 8 shards (a holds
// 0-3, b 4-7) at map revision 1, with the coordinator fence raised at
// both.
func twoDatabases(t testing.TB) (*store.Router, *store.Store, *store.Store) {
	t.Helper()
	m := store.NewMap([]string{"a", "b"}, 8)
	m.Rev = 1
	r, st := pgtest.NewCluster(t, store.Options{MaxConns: 10}, m)
	if ok, err := r.RaiseLeaderFence(context.Background(), "test-coordinator", leaderEpoch); err != nil || !ok {
		t.Fatalf("raising the coordinator fence at both databases: %v %v", ok, err)
	}
	return r, st["a"], st["b"]
}

// has reports whether task id is in st's database.
func has(t testing.TB, st *store.Store, id int64) bool {
	t.Helper()
	var n int
	if err := st.Pool().QueryRow(context.Background(), `SELECT count(*) FROM tasks WHERE id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// rows counts the rows of a query's single count column in st.
func rows(t testing.TB, st *store.Store, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := st.Pool().QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// only checks that task id lives in want and not in other.
func only(t testing.TB, id int64, want, other *store.Store) {
	t.Helper()
	if !has(t, want, id) || has(t, other, id) {
		t.Fatalf("task %d: in the shard's database %v, in the other %v", id, has(t, want, id), has(t, other, id))
	}
}

// outcomes checks that a write succeeded and returns what it did to each
// task: outcomes(t)(r.Complete(...)).
func outcomes(t testing.TB) func([]claims.WriteResult, error) []claims.Outcome {
	return func(res []claims.WriteResult, err error) []claims.Outcome {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		out := make([]claims.Outcome, len(res))
		for i, r := range res {
			out[i] = r.Outcome
		}
		return out
	}
}

func TestRouterSendsEachStatementToItsShardsDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)

	// Enqueue: one task, a batch by COPY, a batch with a unique key (the
	// ordered insert, every id reported), one in a producer's transaction.
	idA, err := r.Enqueue(ctx, insert("k", 1, 3))
	if err != nil {
		t.Fatal(err)
	}
	idB, err := r.Enqueue(ctx, insert("k", 5, 3))
	if err != nil {
		t.Fatal(err)
	}
	only(t, idA, a, b)
	only(t, idB, b, a)
	if n, err := r.EnqueueBatch(ctx, []store.Insert{insert("k", 0, 3), insert("k", 4, 3), insert("k", 7, 3)}); err != nil || n != 3 {
		t.Fatalf("batch: %d %v", n, err)
	}
	uniq := insert("k", 6, 3)
	uniq.UniqueKey = "u-1"
	res, err := r.EnqueueBatchIn(ctx, nil, []store.Insert{insert("k", 2, 3), uniq})
	if err != nil || len(res.Tasks) != 2 || res.Inserted != 2 {
		t.Fatalf("batch with a unique key: %+v %v", res, err)
	}
	only(t, res.Tasks[0].ID, a, b)
	only(t, res.Tasks[1].ID, b, a)
	if dup, err := r.EnqueueBatchIn(ctx, nil, []store.Insert{uniq}); err != nil || !dup.Tasks[0].Duplicate || dup.Tasks[0].ID != res.Tasks[1].ID {
		t.Fatalf("the unique key again: %+v %v", dup, err)
	}
	var idTx int64
	if err := pgx.BeginFunc(ctx, a.Pool(), func(tx pgx.Tx) error {
		e, err := r.EnqueueIn(ctx, tx, insert("k", 3, 3))
		idTx = e.ID
		return err
	}); err != nil {
		t.Fatal(err)
	}
	only(t, idTx, a, b)
	for name, st := range map[string]*store.Store{"a": a, "b": b} {
		if n := rows(t, st, `SELECT count(*) FROM tasks`); n != 4 {
			t.Fatalf("database %s holds %d tasks, want the 4 of its shards", name, n)
		}
	}

	// Fences, claims and the runner's writes.
	terms := []claims.ShardEpoch{{Shard: 1, Epoch: 1}, {Shard: 5, Epoch: 1}}
	o, err := r.RaiseFences(ctx, "r1", "", terms)
	if err != nil || !slices.Equal(o.Raised, terms) {
		t.Fatalf("raise: %+v %v", o, err)
	}
	if rows(t, a, `SELECT count(*) FROM shard_fences WHERE shard <> 1`)+rows(t, b, `SELECT count(*) FROM shard_fences WHERE shard <> 5`) != 0 {
		t.Fatal("a fence raised at a database that does not hold its shard")
	}
	got, err := r.Claim(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, 10, 10)
	if err != nil || len(got) != 2 {
		t.Fatalf("claim over both databases: %d tasks, %v", len(got), err)
	}
	refs := []claims.Ref{claims.RefOf(got[0]), claims.RefOf(got[1])}
	slices.SortFunc(refs, func(x, y claims.Ref) int { return x.Shard - y.Shard })
	if refs[0].ID != idA || refs[1].ID != idB {
		t.Fatalf("claimed %+v, want tasks %d and %d", refs, idA, idB)
	}
	if rows(t, a, `SELECT count(*) FROM task_claims WHERE id = $1`, idA) != 1 || rows(t, b, `SELECT count(*) FROM task_claims WHERE id = $1`, idB) != 1 {
		t.Fatal("claims not in their shards' databases")
	}
	if got, err := r.Claimed(ctx, "r1", terms); err != nil || len(got) != 2 {
		t.Fatalf("claimed: %v %v", got, err)
	}
	if got := outcomes(t)(r.Heartbeat(ctx, "r1", refs)); !slices.Equal(got, []claims.Outcome{claims.Applied, claims.Applied}) {
		t.Fatalf("heartbeat: %v", got)
	}
	if got := outcomes(t)(r.Complete(ctx, "r1", []claims.Completion{{Ref: refs[0]}})); got[0] != claims.Applied {
		t.Fatalf("complete: %v", got)
	}
	if got := outcomes(t)(r.Fail(ctx, "r1", []claims.Failure{{Ref: refs[1], Error: "boom", Backoff: backoff}})); got[0] != claims.Applied {
		t.Fatalf("fail: %v", got)
	}
	if get(t, a, idA).State != tasks.Completed || get(t, b, idB).Attempt != 2 {
		t.Fatal("the writes did not land in their shards' databases")
	}

	// Claims ahead: started, interrupted, cancelled on request, given back.
	terms = []claims.ShardEpoch{{Shard: 0, Epoch: 1}, {Shard: 4, Epoch: 1}}
	if o, err := r.RaiseFences(ctx, "r1", "", terms); err != nil || len(o.Raised) != 2 {
		t.Fatalf("raise: %+v %v", o, err)
	}
	got, err = r.Claim(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, 10, 0)
	if err != nil || len(got) != 2 {
		t.Fatalf("claim ahead: %d %v", len(got), err)
	}
	refs = []claims.Ref{claims.RefOf(got[0]), claims.RefOf(got[1])}
	if got := outcomes(t)(r.Started(ctx, "r1", refs)); !slices.Equal(got, []claims.Outcome{claims.Applied, claims.Applied}) {
		t.Fatalf("started: %v", got)
	}
	cut := []claims.Interruption{{Ref: refs[0], Reason: "lost"}, {Ref: refs[1], Reason: "lost"}}
	if got := outcomes(t)(r.Interrupt(ctx, "r1", cut)); !slices.Equal(got, []claims.Outcome{claims.Applied, claims.Applied}) {
		t.Fatalf("interrupt: %v", got)
	}
	got, err = r.ClaimUrgent(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, 10, 10)
	if err != nil || len(got) != 0 {
		t.Fatalf("urgent claim of default-priority tasks: %d %v", len(got), err)
	}
	got, err = r.Claim(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, 10, 10)
	if err != nil || len(got) != 2 {
		t.Fatalf("claim: %d %v", len(got), err)
	}
	refs = []claims.Ref{claims.RefOf(got[0]), claims.RefOf(got[1])}
	if got := outcomes(t)(r.CancelAttempts(ctx, "r1", []claims.Cancellation{{Ref: refs[0]}})); got[0] != claims.Applied {
		t.Fatalf("cancel attempt: %v", got)
	}
	if got := outcomes(t)(r.Unclaim(ctx, "r1", refs[1:])); got[0] != claims.Applied {
		t.Fatalf("unclaim: %v", got)
	}

	// Orphans: a newer owner's raise requeues the claims left at each
	// database.
	got, err = r.Claim(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, 10, 10)
	if err != nil || len(got) != 1 {
		t.Fatalf("claim: %d %v", len(got), err)
	}
	newer := []claims.ShardEpoch{{Shard: 0, Epoch: 2}, {Shard: 4, Epoch: 2}}
	if o, err := r.RaiseFences(ctx, "r2", "", newer); err != nil || len(o.Raised) != 2 || o.Requeued != 1 {
		t.Fatalf("a newer owner's raise: %+v %v", o, err)
	}
	if o, err := r.RequeueOrphans(ctx, "r2", "", newer); err != nil || len(o.Pending) != 0 {
		t.Fatalf("requeue orphans: %+v %v", o, err)
	}

	// The leader's passes, under each database's coordinator fence.
	got, err = r.Claim(ctx, "r2", newer, tasks.DefaultQueue, []string{"k"}, 10, 10)
	if err != nil || len(got) != 1 {
		t.Fatalf("claim: %d %v", len(got), err)
	}
	retime(t, a, "claimed_at", "now() - interval '1 hour'")
	retime(t, b, "claimed_at", "now() - interval '1 hour'")
	if q, d, err := r.SweepStale(ctx, leaderEpoch, time.Minute, 100, backoff); err != nil || q+d != 1 {
		t.Fatalf("stale sweep: %d requeued, %d dead, %v", q, d, err)
	}
	late := []int64{}
	for _, shard := range []int{2, 6} {
		id, err := r.Enqueue(ctx, insert("late", shard, 3))
		if err != nil {
			t.Fatal(err)
		}
		late = append(late, id)
	}
	retime(t, a, "deadline", "now() - interval '1 minute'", late...)
	retime(t, b, "deadline", "now() - interval '1 minute'", late...)
	if n, err := r.SweepDeadlines(ctx, leaderEpoch, store.SkipRunning, 100); err != nil || n != 2 {
		t.Fatalf("deadline sweep: %d %v", n, err)
	}
	if n, err := r.DeleteFinished(ctx, leaderEpoch, string(tasks.Failed), 0, 100); err != nil || n != 2 {
		t.Fatalf("retention: %d %v", n, err)
	}
	for _, shard := range []int{2, 6} {
		if _, err := r.Enqueue(ctx, insert("nobody", shard, 3)); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := r.FailUnrunnable(ctx, leaderEpoch, tasks.Class{Queue: tasks.DefaultQueue, Kind: "nobody"}, 0, 100, "no runner"); err != nil || n != 2 {
		t.Fatalf("unrunnable rule: %d %v", n, err)
	}
	if _, _, err := r.SweepStale(ctx, leaderEpoch+1, time.Minute, 100, backoff); !errors.Is(err, store.ErrNotLeader) {
		t.Fatalf("a sweep under another epoch: %v, want ErrNotLeader", err)
	}

	// Operators: by id, and in bulk at every database.
	ready, err := r.Enqueue(ctx, insert("k", 7, 3))
	if err != nil {
		t.Fatal(err)
	}
	if task, err := r.CancelTask(ctx, ready); err != nil || task.State != tasks.Cancelled {
		t.Fatalf("cancel: %+v %v", task, err)
	}
	if task, err := r.RetryTask(ctx, ready); err != nil || task.State != tasks.Ready {
		t.Fatalf("retry: %+v %v", task, err)
	}
	if _, err := r.Get(ctx, 1<<40); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("get of a task no database has: %v", err)
	}
	bulk, err := r.CancelMatching(ctx, tasks.Filter{Kind: "k", States: []tasks.State{tasks.Ready}}, 0, time.Minute)
	if err != nil || !bulk.Done || bulk.Cancelled < 2 {
		t.Fatalf("bulk cancel: %+v %v", bulk, err)
	}
	if rows(t, a, `SELECT count(*) FROM task_finished WHERE state = 'cancelled'`) == 0 || rows(t, b, `SELECT count(*) FROM task_finished WHERE state = 'cancelled'`) == 0 {
		t.Fatal("the bulk cancel did not reach both databases")
	}
	back, err := r.RetryMatching(ctx, tasks.Filter{Kind: "k", States: []tasks.State{tasks.Cancelled}}, 0, time.Minute)
	if err != nil || !back.Done || back.Retried != bulk.Cancelled+1 {
		t.Fatalf("bulk retry of %d cancelled: %+v %v", bulk.Cancelled+1, back, err)
	}
}

// notHeld places shard at st as state (not held), as a move leaves it.
func notHeld(t testing.TB, st *store.Store, shard int, state, peer string) {
	t.Helper()
	exec(t, st, `INSERT INTO shardrun_placement (shard, state, map_rev, peer) VALUES ($1, $2, 2, nullif($3, ''))
		ON CONFLICT (shard) DO UPDATE SET state = excluded.state, map_rev = excluded.map_rev, peer = excluded.peer`, shard, state, peer)
}

// A database refuses an insert into a shard it does not hold, by any
// producer (raw SQL here), with SQLSTATE SR001 naming the database; a
// database of a one-database cluster checks nothing.
func TestADatabaseRefusesInsertsIntoShardsItDoesNotHold(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, a, _ := twoDatabases(t)
	raw := `INSERT INTO tasks (kind, shard, key, payload) VALUES ('k', $1, 'x', '{}')`
	for _, c := range []struct {
		shard int
		state string
		want  string
	}{
		{5, "", "shard 5 is not held by database a (state none, map revision 0)"},
		{1, store.PlacementLeaving, "shard 1 is not held by database a (state leaving, map revision 2)"},
		{2, store.PlacementGone, "shard 2 is not held by database a (state gone, map revision 2)"},
		{3, store.PlacementArriving, "shard 3 is not held by database a (state arriving, map revision 2)"},
	} {
		if c.state != "" {
			notHeld(t, a, c.shard, c.state, "b")
		}
		_, err := a.Pool().Exec(ctx, raw, c.shard)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != store.CodeNotHeld || pe.Message != c.want || !store.NotHeld(err) {
			t.Fatalf("insert into shard %d: %v, want SR001 %q", c.shard, err, c.want)
		}
		if !errors.Is(store.Classify(err), store.ErrUnavailable) {
			t.Fatalf("SR001 classified %v, want unavailable (sent again to the right database)", store.Classify(err))
		}
	}
	if _, err := a.Pool().Exec(ctx, raw, 0); err != nil {
		t.Fatalf("insert into a held shard: %v", err)
	}
	if _, err := a.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key, payload) VALUES ('k', 0, 'x', '{}'), ('k', 5, 'y', '{}')`); !store.NotHeld(err) {
		t.Fatalf("a statement of two shards, one not held: %v", err)
	}
	if rows(t, a, `SELECT count(*) FROM tasks`) != 1 {
		t.Fatal("a refused insert left rows")
	}

	// One database: no check.
	one := setup(t)
	if _, err := one.EnsureShardCount(ctx, 8); err != nil {
		t.Fatal(err)
	}
	notHeld(t, one, 4, store.PlacementLeaving, "")
	if _, err := one.Pool().Exec(ctx, raw, 4); err != nil {
		t.Fatalf("a database of one checked its placement: %v", err)
	}
	exec(t, one, `UPDATE shardrun_placement SET state = 'held' WHERE shard = 4`)
}

// A producer's REPEATABLE READ transaction whose snapshot predates a
// placement change fails with a serialization failure; one that holds its
// placement rows makes a move's leave (FOR UPDATE NOWAIT) give up at once.
func TestAProducerRacingAPlacementChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, a, _ := twoDatabases(t)
	tx, err := a.Pool().BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT count(*) FROM tasks`); err != nil { // the snapshot
		t.Fatal(err)
	}
	exec(t, a, `UPDATE shardrun_placement SET map_rev = 2 WHERE shard = 1`) // still held, but changed
	_, err = tx.Exec(ctx, `INSERT INTO tasks (kind, shard, key, payload) VALUES ('k', 1, 'x', '{}')`)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "40001" {
		t.Fatalf("a REPEATABLE READ insert after its placement row changed: %v, want a serialization failure", err)
	}
	_ = tx.Rollback(ctx)

	held, err := a.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = held.Rollback(ctx) }()
	if _, err := held.Exec(ctx, `INSERT INTO tasks (kind, shard, key, payload) VALUES ('k', 2, 'x', '{}')`); err != nil {
		t.Fatal(err)
	}
	_, err = a.Pool().Exec(ctx, `SELECT 1 FROM shardrun_placement WHERE shard = 2 FOR UPDATE NOWAIT`)
	if !errors.As(err, &pe) || pe.Code != "55P03" {
		t.Fatalf("a leave while a producer holds the placement row: %v, want 55P03 at once", err)
	}
	if err := held.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// A claim takes nothing from a fence row that says its shard is moving.
func TestAClaimAtAMovingFenceTakesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, _ := twoDatabases(t)
	if _, err := r.Enqueue(ctx, insert("k", 1, 3)); err != nil {
		t.Fatal(err)
	}
	term := []claims.ShardEpoch{{Shard: 1, Epoch: 1}}
	if o, err := r.RaiseFences(ctx, "r1", "", term); err != nil || len(o.Raised) != 1 {
		t.Fatalf("raise: %+v %v", o, err)
	}
	exec(t, a, `UPDATE shard_fences SET moving = true WHERE shard = 1`)
	if got, err := r.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"k"}, 10, 10); err != nil || len(got) != 0 {
		t.Fatalf("claimed %d tasks at a moving fence (%v)", len(got), err)
	}
	exec(t, a, `UPDATE shard_fences SET moving = false WHERE shard = 1`)
	if got, err := r.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"k"}, 10, 10); err != nil || len(got) != 1 {
		t.Fatalf("claimed %d tasks once the fence no longer moves (%v)", len(got), err)
	}
}

// moveRunning moves shard (holding the running attempt ref of task id
// only) from one database to another as a move's copy and commit leave
// it: the task, its claim and its fence at to, held there at revision 2;
// every row of the shard deleted at from, which records it gone to
// toName.
func moveRunning(t testing.TB, from, to *store.Store, toName string, shard int, id int64) {
	t.Helper()
	ctx := context.Background()
	task, err := from.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, to.Pool(), func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO shardrun_placement (shard, state, map_rev) VALUES ($1, 'arriving', 2)`, shard)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// The copy, as one transaction per side would make it (the placement
	// row arriving meanwhile lets the insert through only once held).
	exec(t, to, `UPDATE shardrun_placement SET state = 'held' WHERE shard = $1`, shard)
	exec(t, to, `INSERT INTO tasks (id, kind, shard, key, payload, max_attempts, run_after) OVERRIDING SYSTEM VALUE
		VALUES ($1, $2, $3, $4, $5, $6, now())`, id, task.Kind, shard, task.Key, string(task.Payload), task.MaxAttempts)
	exec(t, to, `DELETE FROM task_ready WHERE id = $1`, id)
	exec(t, to, `INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt, grp)
		SELECT id, shard, queue, $2, $3, attempt, '' FROM tasks WHERE id = $1`, id, task.Epoch, task.ClaimedBy)
	exec(t, to, `INSERT INTO shard_fences (grp, shard, epoch, owner) VALUES ('', $1, $2, $3)`, shard, task.Epoch, task.ClaimedBy)
	for _, table := range []string{"task_claims", "task_ready", "shard_fences"} {
		exec(t, from, `DELETE FROM `+table+` WHERE shard = $1`, shard)
	}
	exec(t, from, `DELETE FROM tasks WHERE shard = $1`, shard)
	notHeld(t, from, shard, store.PlacementGone, toName)
}

// A runner's write about a claim of a shard that moved to another
// database is Busy there (written again later, at the new database once
// the map says so), never FenceLost; CompleteTx there is refused with
// tasks.ErrShardMoved; and the attempt, interrupted at the new database,
// is not spent.
func TestWritesAtAShardThatMovedAreBusy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	id, err := r.Enqueue(ctx, insert("k", 1, 1))
	if err != nil {
		t.Fatal(err)
	}
	term := []claims.ShardEpoch{{Shard: 1, Epoch: 7}}
	if o, err := r.RaiseFences(ctx, "r1", "", term); err != nil || len(o.Raised) != 1 {
		t.Fatalf("raise: %+v %v", o, err)
	}
	got, err := r.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"k"}, 1, 1)
	if err != nil || len(got) != 1 {
		t.Fatalf("claim: %d %v", len(got), err)
	}
	ref := claims.RefOf(got[0])
	moveRunning(t, a, b, "b", 1, id)

	// The router still routes by revision 1: shard 1 at a.
	for name, write := range map[string]func() ([]claims.WriteResult, error){
		"heartbeat": func() ([]claims.WriteResult, error) { return r.Heartbeat(ctx, "r1", []claims.Ref{ref}) },
		"complete":  func() ([]claims.WriteResult, error) { return r.Complete(ctx, "r1", []claims.Completion{{Ref: ref}}) },
		"fail": func() ([]claims.WriteResult, error) {
			return r.Fail(ctx, "r1", []claims.Failure{{Ref: ref, Error: "x", Backoff: backoff}})
		},
	} {
		if got := outcomes(t)(write()); got[0] != claims.Busy {
			t.Fatalf("%s at the database the shard left: %v, want busy", name, got[0])
		}
	}
	if o, err := r.RaiseFences(ctx, "r2", "", []claims.ShardEpoch{{Shard: 1, Epoch: 8}}); err != nil || len(o.Raised) != 0 || len(o.Moved) != 1 {
		t.Fatalf("a raise at the database the shard left: %+v %v, want it moved", o, err)
	}
	if o, err := r.RequeueOrphans(ctx, "r1", "", term); err != nil || len(o.Moved) != 1 || len(o.Pending) != 1 {
		t.Fatalf("a requeue at the database the shard left: %+v %v, want it moved and pending", o, err)
	}
	tx, err := a.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = r.CompleteTx(ctx, tx, "r1", claims.Completion{Ref: ref})
	_ = tx.Rollback(ctx)
	if !errors.Is(err, tasks.ErrShardMoved) {
		t.Fatalf("CompleteTx at the database the shard left: %v, want tasks.ErrShardMoved", err)
	}

	// The map moves on; the runner's interruption lands at b and keeps
	// the attempt.
	m := r.Map()
	m.Shards = slices.Clone(m.Shards)
	m.Shards[1], m.Rev = "b", 2
	r.SetMap(m)
	if got := outcomes(t)(r.Interrupt(ctx, "r1", []claims.Interruption{{Ref: ref, Reason: "interrupted: " + tasks.ErrShardMoved.Error()}})); got[0] != claims.Applied {
		t.Fatalf("interrupt at the shard's new database: %v", got)
	}
	task := get(t, b, id)
	if task.State != tasks.Ready || task.Attempt != 1 || len(task.Errors) != 1 || !task.Errors[0].Interrupted {
		t.Fatalf("task %+v: want ready at its only attempt, unspent, with the interruption in its history", task)
	}
}

// A producer whose map is stale (its shard moved) is refused with SR001
// and inserts at the shard's database after re-reading the map: from
// OnStale (etcd), or, without it, from the databases' placement rows.
func TestAProducerRetriesAtTheShardsNewDatabase(t *testing.T) {
	t.Parallel()
	for _, withOnStale := range []bool{true, false} {
		t.Run(map[bool]string{true: "OnStale", false: "ReadMap"}[withOnStale], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			r, a, b := twoDatabases(t)
			notHeld(t, a, 1, store.PlacementGone, "b")
			exec(t, b, `INSERT INTO shardrun_placement (shard, state, map_rev) VALUES (1, 'held', 2)`)
			moved := r.Map()
			moved.Shards = slices.Clone(moved.Shards)
			moved.Shards[1], moved.Rev = "b", 2
			calls := 0
			if withOnStale {
				r.OnStale = func(context.Context) (store.Map, error) { calls++; return moved, nil }
			}
			id, err := r.Enqueue(ctx, insert("k", 1, 3))
			if err != nil {
				t.Fatal(err)
			}
			only(t, id, b, a)
			if withOnStale && calls != 1 {
				t.Fatalf("OnStale called %d times, want once", calls)
			}
			if got := r.Map(); got.Rev != 2 || got.Shards[1] != "b" {
				t.Fatalf("the router's map after the refusal: revision %d, shard 1 in %s", got.Rev, got.Shards[1])
			}
			// A batch with a stale map: only its part of the moved shard
			// goes again.
			stale := r.Map()
			stale.Shards = slices.Clone(stale.Shards)
			stale.Shards[2] = "b"
			exec(t, b, `INSERT INTO shardrun_placement (shard, state, map_rev) VALUES (2, 'held', 3)`)
			notHeld(t, a, 2, store.PlacementGone, "b")
			exec(t, a, `UPDATE shardrun_placement SET map_rev = 3 WHERE shard = 2`)
			moved = stale
			moved.Rev = 3
			res, err := r.EnqueueBatchIn(ctx, nil, []store.Insert{insert("k", 2, 3), insert("k", 0, 3), insert("k", 5, 3)})
			if err != nil || res.Inserted != 3 {
				t.Fatalf("batch: %+v %v", res, err)
			}
			if rows(t, b, `SELECT count(*) FROM tasks WHERE shard = 2`) != 1 || rows(t, a, `SELECT count(*) FROM tasks WHERE shard = 0`) != 1 {
				t.Fatal("the batch's tasks are not in their shards' databases")
			}
		})
	}
}

// A producer's transaction on another database than the task's shard is
// refused with an error naming both, and nothing is inserted there.
func TestEnqueueInATransactionOnTheWrongDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	err := pgx.BeginFunc(ctx, b.Pool(), func(tx pgx.Tx) error {
		_, err := r.EnqueueIn(ctx, tx, insert("k", 1, 3))
		return err
	})
	if !errors.Is(err, store.ErrWrongDatabase) || !strings.Contains(err.Error(), "shard 1 lives in database a, the transaction is on database b") {
		t.Fatalf("enqueue of a task of a in a transaction on b: %v", err)
	}
	err = pgx.BeginFunc(ctx, a.Pool(), func(tx pgx.Tx) error {
		_, err := r.EnqueueBatchIn(ctx, tx, []store.Insert{insert("k", 1, 3), insert("k", 6, 3)})
		return err
	})
	if !errors.Is(err, store.ErrWrongDatabase) || !strings.Contains(err.Error(), "database b") {
		t.Fatalf("a batch of both databases in a transaction on a: %v", err)
	}
	if rows(t, a, `SELECT count(*) FROM tasks`)+rows(t, b, `SELECT count(*) FROM tasks`) != 0 {
		t.Fatal("a refused enqueue inserted tasks")
	}
	// The database of a connection is read once, then known.
	conn, err := b.Pool().Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for range 2 {
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			_, err := r.EnqueueIn(ctx, tx, insert("k", 6, 3))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if rows(t, b, `SELECT count(*) FROM tasks`) != 2 {
		t.Fatal("the producer's tasks are not in its transaction's database")
	}
}

// Listings are merged across the databases in id order, in both
// directions, page by page with one id as the cursor; counts are summed
// and queues merged.
func TestListingsAndCountsSpanTheDatabases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	var ids []int64
	for i := range 23 {
		kind := "even"
		if i%3 == 0 {
			kind = "third"
		}
		in := insert(kind, (i*5)%8, 3)
		in.Queue = []string{"q1", "q2"}[i%2]
		id, err := r.Enqueue(ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if rows(t, a, `SELECT count(*) FROM tasks`) == 0 || rows(t, b, `SELECT count(*) FROM tasks`) == 0 {
		t.Fatal("the tasks did not spread over both databases")
	}
	slices.Sort(ids)
	for _, desc := range []bool{false, true} {
		for _, f := range []tasks.Filter{{}, {Kind: "third"}, {Queue: "q1"}, {States: []tasks.State{tasks.Ready}}} {
			want := wantIDs(t, r, ids, f, desc)
			var got []int64
			after := int64(0)
			for pages := 0; ; pages++ {
				if pages > 50 {
					t.Fatal("the listing does not end")
				}
				page, err := r.List(ctx, tasks.ListRequest{Filter: f, After: after, Desc: desc, Limit: 4})
				if err != nil {
					t.Fatal(err)
				}
				for _, s := range page.Tasks {
					got = append(got, s.ID)
				}
				if page.Next == 0 {
					break
				}
				if page.Next == after {
					t.Fatalf("the cursor did not move from %d", after)
				}
				after = page.Next
			}
			if !slices.Equal(got, want) {
				t.Fatalf("listing %+v desc=%v: %v, want %v", f, desc, got, want)
			}
		}
	}
	counts, err := r.CountByState(ctx)
	if err != nil || counts[tasks.Ready] != int64(len(ids)) {
		t.Fatalf("counts: %v %v", counts, err)
	}
	capped, err := r.CountByStateCapped(ctx, 1000)
	if err != nil || capped[tasks.Ready] != int64(len(ids)) {
		t.Fatalf("capped counts: %v %v", capped, err)
	}
	mc, err := r.CountMatching(ctx, tasks.Filter{Kind: "third"})
	if err != nil || mc.Count != 8 || mc.AtLeast {
		t.Fatalf("count matching: %+v %v", mc, err)
	}
	if _, err := r.SetQueuePaused(ctx, "q1", true); err != nil {
		t.Fatal(err)
	}
	qs, err := r.Queues(ctx, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]store.QueueStats{}
	for _, q := range qs {
		byName[q.Name] = q
	}
	if q := byName["q1"]; q.Ready != 12 || q.PausedAt == nil || byName["q2"].Ready != 11 || byName["q2"].PausedAt != nil {
		t.Fatalf("queues: %+v", qs)
	}
	for _, st := range []*store.Store{a, b} {
		if rows(t, st, `SELECT count(*) FROM queues WHERE name = 'q1' AND paused_at IS NOT NULL`) != 1 {
			t.Fatal("a pause did not reach every database")
		}
	}
	if _, err := r.DeleteQueue(ctx, "q2"); err == nil {
		t.Fatal("removed a queue with tasks")
	}
}

// wantIDs is what a listing of f should show: the ids of the tasks that
// match, by reading each one.
func wantIDs(t testing.TB, r *store.Router, ids []int64, f tasks.Filter, desc bool) []int64 {
	t.Helper()
	var out []int64
	for _, id := range ids {
		task, err := r.Get(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		if (f.Kind == "" || task.Kind == f.Kind) && (f.Queue == "" || task.Queue == f.Queue) &&
			(len(f.States) == 0 || slices.Contains(f.States, task.State)) {
			out = append(out, id)
		}
	}
	if desc {
		slices.Reverse(out)
	}
	return out
}

// Task ids are unique across the databases: each draws those of its own
// residue (its slot), by every insert path, and RaiseIDsAbove keeps it.
func TestIDsAreUniqueAcrossTheDatabases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	seen := map[int64]string{}
	note := func(id int64, db string) {
		t.Helper()
		if other, ok := seen[id]; ok {
			t.Fatalf("id %d drawn by %s and %s", id, other, db)
		}
		seen[id] = db
	}
	for i := range 8 {
		shard := i
		id, err := r.Enqueue(ctx, insert("k", shard, 3))
		if err != nil {
			t.Fatal(err)
		}
		note(id, r.Map().Shards[shard])
		u := insert("k", shard, 3)
		u.UniqueKey = "u" + string(rune('a'+i))
		e, err := r.EnqueueIn(ctx, nil, u)
		if err != nil {
			t.Fatal(err)
		}
		note(e.ID, r.Map().Shards[shard])
	}
	var batch []store.Insert
	for i := range 40 {
		batch = append(batch, insert("k", i%8, 3))
	}
	if _, err := r.EnqueueBatch(ctx, batch); err != nil {
		t.Fatal(err)
	}
	for slot, st := range []*store.Store{a, b} {
		if n := rows(t, st, `SELECT count(*) FROM tasks WHERE id % 1024 <> $1`, slot); n != 0 {
			t.Fatalf("%d ids of database %d are not of its residue", n, slot)
		}
	}
	if err := b.RaiseIDsAbove(ctx, 1_000_000); err != nil {
		t.Fatal(err)
	}
	id, err := r.Enqueue(ctx, insert("k", 4, 3))
	if err != nil || id <= 1_000_000 || id%store.IDStride != 1 {
		t.Fatalf("the id after RaiseIDsAbove(1000000): %d %v, want above it with residue 1", id, err)
	}
	if err := b.RaiseIDsAbove(ctx, 10); err != nil { // never lowers it
		t.Fatal(err)
	}
	if next, err := r.Enqueue(ctx, insert("k", 4, 3)); err != nil || next <= id {
		t.Fatalf("an id after raising below the current one: %d %v", next, err)
	}
}

// Register records a database's place once and refuses another: a name,
// slot or count that differs, or tasks of shards the map gives to others.
func TestRegisterRefusesAMismatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, _ := twoDatabases(t)
	if err := r.Register(ctx); err != nil {
		t.Fatalf("registering again: %v", err)
	}
	err := a.Register(ctx, store.RegisterOpts{Name: "a", Shards: []int{0, 1}, Databases: 2, Slot: 1})
	if !errors.Is(err, store.ErrRegistration) || !strings.Contains(err.Error(), "database a") {
		t.Fatalf("registering a at another slot: %v", err)
	}
	mem, err := a.Membership(ctx)
	if err != nil || mem != (store.Membership{Name: "a", Slot: 0, Databases: 2, ShardCount: 8, Registered: true}) {
		t.Fatalf("membership: %+v %v", mem, err)
	}
	fresh := setup(t)
	if _, err := fresh.EnsureShardCount(ctx, 8); err != nil {
		t.Fatal(err)
	}
	enqueue(t, fresh, insert("k", 6, 3))
	err = fresh.Register(ctx, store.RegisterOpts{Name: "c", Shards: []int{0, 1, 2, 3}, Databases: 2, Slot: 0})
	if !errors.Is(err, store.ErrRegistration) || !strings.Contains(err.Error(), "database c holds tasks of shard 6") {
		t.Fatalf("registering a database holding other shards' tasks: %v", err)
	}
	if p, err := fresh.Placement(ctx); err != nil || len(p) != 8 {
		t.Fatalf("a database of one holds every shard: %v %v", p, err)
	}
}

// ReadMap reads the map from the databases' placement rows: each shard in
// the database that holds it, one between a move's commit and its arrival
// in the database it went to.
func TestReadMapFromThePlacementRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	stores := map[string]*store.Store{"a": a, "b": b}
	m, err := store.ReadMap(ctx, stores)
	if err != nil || !slices.Equal(m.Databases, []string{"a", "b"}) || !slices.Equal(m.Shards, r.Map().Shards) || m.Rev != 1 {
		t.Fatalf("map: %+v %v, want %+v", m, err, r.Map())
	}
	notHeld(t, a, 3, store.PlacementGone, "b")
	exec(t, b, `INSERT INTO shardrun_placement (shard, state, map_rev) VALUES (3, 'arriving', 2)`)
	m, err = store.ReadMap(ctx, stores)
	if err != nil || m.Shards[3] != "b" || m.Rev != 2 {
		t.Fatalf("map mid-move: %+v %v", m, err)
	}
	exec(t, a, `DELETE FROM shardrun_placement WHERE shard = 3`)
	exec(t, b, `DELETE FROM shardrun_placement WHERE shard = 3`)
	if _, err := store.ReadMap(ctx, stores); err == nil || !strings.Contains(err.Error(), "no database holds shard 3") {
		t.Fatalf("a shard no database knows: %v", err)
	}
	if got := r.Map().Ranges("b"); got != "4-7" {
		t.Fatalf("ranges of b: %q", got)
	}
	if got := (store.Map{Shards: []string{"x", "y", "x", "x", "y", "x"}}).Ranges("x"); got != "0,2-3,5" {
		t.Fatalf("ranges: %q", got)
	}
}

// TestAClaimDrawsOnEveryDatabase: with a backlog at both databases, one
// claim takes from both at once (claimed one database after the other,
// the first filled the whole limit), and its answer keeps the store's
// rule for the caller's reserved slots: the first startNow tasks are the
// ones recorded as started, the others claimed ahead. A limit smaller
// than the databases reaches each in turn, and a database with too few
// tasks leaves its share to the other.
func TestAClaimDrawsOnEveryDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	var batch []store.Insert
	for i := range 40 {
		batch = append(batch, insert("k", []int{0, 4}[i%2], 3))
	}
	batch = append(batch, insert("k", 5, 3), insert("k", 5, 3))
	if _, err := r.EnqueueBatch(ctx, batch); err != nil {
		t.Fatal(err)
	}
	terms := []claims.ShardEpoch{{Shard: 0, Epoch: 1}, {Shard: 4, Epoch: 1}, {Shard: 5, Epoch: 1}}
	if _, err := r.RaiseFences(ctx, "r1", "", terms); err != nil {
		t.Fatal(err)
	}
	ahead := func(id int64) bool {
		t.Helper()
		var ahead bool
		for _, st := range []*store.Store{a, b} {
			if has(t, st, id) {
				if err := st.Pool().QueryRow(ctx, `SELECT ahead FROM task_claims WHERE id = $1`, id).Scan(&ahead); err != nil {
					t.Fatal(err)
				}
			}
		}
		return ahead
	}
	at := func(got []tasks.Task) (inA, inB int) {
		for _, task := range got {
			if has(t, a, task.ID) {
				inA++
			} else {
				inB++
			}
		}
		return inA, inB
	}
	for _, tc := range []struct{ limit, startNow int }{{10, 4}, {10, 10}, {6, 0}} {
		got, err := r.Claim(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, tc.limit, tc.startNow)
		if err != nil || len(got) != tc.limit {
			t.Fatalf("claim %d (start %d): %d tasks, %v", tc.limit, tc.startNow, len(got), err)
		}
		if inA, inB := at(got); inA != tc.limit/2 || inB != tc.limit/2 {
			t.Errorf("claim %d (start %d): %d tasks from a and %d from b, want half of the limit from each", tc.limit, tc.startNow, inA, inB)
		}
		for i, task := range got {
			if started := !ahead(task.ID); started != (i < tc.startNow) {
				t.Errorf("claim %d (start %d): task %d of the answer started %v, want the first %d started", tc.limit, tc.startNow, i, started, tc.startNow)
			}
		}
	}
	// a has 20-13=7 left at shard 0 and b 20-13+2=9: a limit of 16 takes
	// a's 7 and the rest from b, the started ones first.
	got, err := r.Claim(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, 16, 12)
	if err != nil || len(got) != 16 {
		t.Fatalf("claim 16 (start 12) with a short of its share: %d tasks, %v", len(got), err)
	}
	if inA, inB := at(got); inA != 7 || inB != 9 {
		t.Errorf("claim 16 with a short of its share: %d from a, %d from b, want 7 and 9", inA, inB)
	}
	for i, task := range got {
		if started := !ahead(task.ID); started != (i < 12) {
			t.Errorf("claim 16 (start 12): task %d of the answer started %v, want the first 12 started", i, started)
		}
	}
	// A limit of one reaches each database in turn.
	var firsts []string
	for range 2 {
		if _, err := r.EnqueueBatch(ctx, []store.Insert{insert("k", 0, 3), insert("k", 4, 3)}); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		got, err := r.Claim(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, 1, 1)
		if err != nil || len(got) != 1 {
			t.Fatalf("claim 1: %d tasks, %v", len(got), err)
		}
		if inA, _ := at(got); inA == 1 {
			firsts = append(firsts, "a")
		} else {
			firsts = append(firsts, "b")
		}
	}
	if firsts[0] == firsts[1] {
		t.Errorf("two claims of one task both took from %s, want each database in turn", firsts[0])
	}
}
