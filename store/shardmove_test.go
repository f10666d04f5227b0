package store_test

// A shard's online move between databases (issue 40): the database steps
// of the move driver, as model/moves.pml has them.

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// movedShard is the shard the tests move, from a to b (twoDatabases).
const movedShard = 1

// shardRows is every row of shard at st, table by table, each row as
// JSON (every column), in a stable order; claims without heartbeat_at
// (the arrival sets it).
func shardRows(t testing.TB, st *store.Store, shard int) map[string][]string {
	t.Helper()
	ctx := context.Background()
	queries := map[string]string{
		"tasks":            `SELECT to_jsonb(t)::text FROM tasks t WHERE shard = $1 ORDER BY id`,
		"task_ready":       `SELECT to_jsonb(r)::text FROM task_ready r WHERE shard = $1 ORDER BY id`,
		"task_claims":      `SELECT (to_jsonb(c) - 'heartbeat_at')::text FROM task_claims c WHERE shard = $1 ORDER BY id`,
		"task_waiting":     `SELECT to_jsonb(w)::text FROM task_waiting w WHERE id IN (SELECT id FROM tasks WHERE shard = $1) ORDER BY id`,
		"task_finished":    `SELECT to_jsonb(f)::text FROM task_finished f WHERE id IN (SELECT id FROM tasks WHERE shard = $1) ORDER BY id`,
		"task_unique_keys": `SELECT to_jsonb(k)::text FROM task_unique_keys k WHERE id IN (SELECT id FROM tasks WHERE shard = $1) ORDER BY id`,
		"task_sequences": `SELECT to_jsonb(s)::text FROM task_sequences s
			WHERE key IN (SELECT sequence_key FROM tasks WHERE shard = $1) ORDER BY key`,
		"shard_fences": `SELECT (to_jsonb(f) - 'moving')::text FROM shard_fences f WHERE shard = $1 ORDER BY grp`,
	}
	out := map[string][]string{}
	for table, q := range queries {
		rows, err := st.Pool().Query(ctx, q, shard)
		if err != nil {
			t.Fatalf("%s: %v", table, err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatalf("%s: %v", table, err)
		}
		out[table] = got
	}
	return out
}

// fillShard puts a task of every kind of row into shard at r: a ready one
// with a unique key, a sequence of two (the head ready, the second
// waiting), a running one (claimed by runner r1 under epoch 1) and a
// completed one; it returns the running task's ref and the ids by name.
func fillShard(t testing.TB, r *store.Router, shard int) (claims.Ref, map[string]int64) {
	t.Helper()
	ctx := context.Background()
	ids := map[string]int64{}
	term := []claims.ShardEpoch{{Shard: shard, Epoch: 1}}
	if o, err := r.RaiseFences(ctx, "r1", "", term); err != nil || len(o.Raised) != 1 {
		t.Fatalf("raise: %+v %v", o, err)
	}
	var err error
	if ids["done"], err = r.Enqueue(ctx, insert("k", shard, 3)); err != nil {
		t.Fatal(err)
	}
	got, err := r.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"k"}, 1, 1)
	if err != nil || len(got) != 1 {
		t.Fatalf("claim: %d %v", len(got), err)
	}
	if res := outcomes(t)(r.Complete(ctx, "r1", []claims.Completion{{Ref: claims.RefOf(got[0])}})); res[0] != claims.Applied {
		t.Fatalf("complete: %v", res)
	}
	if ids["running"], err = r.Enqueue(ctx, insert("k", shard, 3)); err != nil {
		t.Fatal(err)
	}
	got, err = r.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"k"}, 1, 1)
	if err != nil || len(got) != 1 || got[0].ID != ids["running"] {
		t.Fatalf("claim: %+v %v", got, err)
	}
	unique := insert("other", shard, 3)
	unique.UniqueKey = "u-moved"
	if ids["unique"], err = r.Enqueue(ctx, unique); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"head", "second"} {
		in := insert("other", shard, 3)
		in.SequenceKey = "s-moved"
		if ids[name], err = r.Enqueue(ctx, in); err != nil {
			t.Fatal(err)
		}
	}
	return claims.RefOf(got[0]), ids
}

// moveTo is r's map with shard in database name, at revision rev.
func moveTo(r *store.Router, shard int, name string, rev int64) store.Map {
	m := r.Map()
	m.Shards = slices.Clone(m.Shards)
	m.Shards[shard], m.Rev = name, rev
	return m
}

func placementOf(t testing.TB, st *store.Store, shard int) string {
	t.Helper()
	p, ok, err := st.PlacementOf(context.Background(), shard)
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		return "none"
	}
	return p.State
}

func TestAMoveTakesEveryRowOfTheShardIntact(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	ref, ids := fillShard(t, r, movedShard)
	other, err := r.Enqueue(ctx, insert("k", 2, 3)) // another shard of a stays
	if err != nil {
		t.Fatal(err)
	}
	before := shardRows(t, a, movedShard)
	for _, table := range []string{"tasks", "task_ready", "task_claims", "task_waiting", "task_finished", "task_unique_keys", "task_sequences", "shard_fences"} {
		if len(before[table]) == 0 {
			t.Fatalf("the shard has no %s to move", table)
		}
	}

	mv := store.ShardMove{Shard: movedShard, From: "a", To: "b", MapRev: 2, Epoch: leaderEpoch}
	if err := a.LeaveShard(ctx, mv); err != nil {
		t.Fatal(err)
	}
	if err := a.LeaveShard(ctx, mv); err != nil {
		t.Fatalf("the leave again: %v", err)
	}
	if got := rows(t, a, `SELECT count(*) FROM shard_fences WHERE shard = $1 AND moving`, movedShard); got != 1 {
		t.Fatalf("%d moving fence rows after the leave, want 1", got)
	}
	c, err := store.CopyShard(ctx, a, b, mv)
	if err != nil {
		t.Fatal(err)
	}
	if c.Tasks != int64(len(ids)) {
		t.Fatalf("copied %d tasks, want %d", c.Tasks, len(ids))
	}
	if after := shardRows(t, b, movedShard); !mapsEqual(before, after) {
		t.Fatalf("the shard's rows at b differ from a's:\nbefore %v\nafter  %v", before, after)
	}
	for table, got := range shardRows(t, a, movedShard) {
		if len(got) != 0 {
			t.Fatalf("%d rows of %s left at a after the commit", len(got), table)
		}
	}
	if p := placementOf(t, a, movedShard); p != store.PlacementGone {
		t.Fatalf("a's placement %s, want gone", p)
	}
	if p := placementOf(t, b, movedShard); p != store.PlacementArriving {
		t.Fatalf("b's placement %s, want arriving", p)
	}
	if _, err := store.CopyShard(ctx, a, b, mv); !errors.Is(err, store.ErrShardGone) {
		t.Fatalf("the copy again after the commit: %v, want ErrShardGone", err)
	}
	only(t, other, a, b)

	// Nothing is claimable at a; the map switches; b's copy arrives.
	term := []claims.ShardEpoch{{Shard: movedShard, Epoch: 1}}
	if got, err := a.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"k", "other"}, 10, 10); err != nil || len(got) != 0 {
		t.Fatalf("claimed %d at a after the commit (%v)", len(got), err)
	}
	r.SetMap(moveTo(r, movedShard, "b", 3))
	if got, err := r.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"other"}, 10, 10); err != nil || len(got) != 0 {
		t.Fatalf("claimed %d at b before the arrival (%v)", len(got), err)
	}
	mv.MapRev = 3
	if err := b.ArriveShard(ctx, mv); err != nil {
		t.Fatal(err)
	}
	if err := b.ArriveShard(ctx, mv); err != nil {
		t.Fatalf("the arrival again: %v", err)
	}
	if p := placementOf(t, b, movedShard); p != store.PlacementHeld {
		t.Fatalf("b's placement %s, want held", p)
	}

	// At b: the running task's runner heartbeats and completes it; the
	// unique key is still held; the sequence goes on in its order; ids
	// drawn there are new.
	if got := outcomes(t)(r.Heartbeat(ctx, "r1", []claims.Ref{ref})); got[0] != claims.Applied {
		t.Fatalf("heartbeat at b: %v", got)
	}
	if got := outcomes(t)(r.Complete(ctx, "r1", []claims.Completion{{Ref: ref}})); got[0] != claims.Applied {
		t.Fatalf("complete at b: %v", got)
	}
	unique := insert("other", movedShard, 3)
	unique.UniqueKey = "u-moved"
	if e, err := r.EnqueueIn(ctx, nil, unique); err != nil || !e.Duplicate || e.ID != ids["unique"] {
		t.Fatalf("the unique key again at b: %+v %v, want the duplicate of %d", e, err, ids["unique"])
	}
	third := insert("other", movedShard, 3)
	third.SequenceKey = "s-moved"
	thirdID, err := r.Enqueue(ctx, third)
	if err != nil {
		t.Fatal(err)
	}
	if thirdID <= c.MaxID || store.SlotOf(thirdID) != 1 {
		t.Fatalf("a new id at b: %d, want above %d with b's residue", thirdID, c.MaxID)
	}
	var order []int64
	for range 3 {
		got, err := r.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"other"}, 10, 10)
		if err != nil {
			t.Fatal(err)
		}
		for _, task := range got {
			if task.SequenceKey == "" {
				continue
			}
			order = append(order, task.ID)
			if res := outcomes(t)(r.Complete(ctx, "r1", []claims.Completion{{Ref: claims.RefOf(task)}})); res[0] != claims.Applied {
				t.Fatalf("complete: %v", res)
			}
		}
	}
	if want := []int64{ids["head"], ids["second"], thirdID}; !slices.Equal(order, want) {
		t.Fatalf("the sequence ran %v at b, want %v", order, want)
	}
}

func mapsEqual(x, y map[string][]string) bool {
	if len(x) != len(y) {
		return false
	}
	for k, v := range x {
		if !slices.Equal(v, y[k]) {
			return false
		}
	}
	return true
}

// A producer whose transaction holds the shard's placement row makes the
// leave give up at once (ErrPlacementBusy), never wait; once the shard
// leaves, the producer is refused with SR001, and after the move its task
// lands at the new database.
func TestAProducerRacingALeaveLandsAtTheNewDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	mv := store.ShardMove{Shard: movedShard, From: "a", To: "b", MapRev: 2, Epoch: leaderEpoch}
	tx, err := a.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	first, err := r.EnqueueIn(ctx, tx, insert("k", movedShard, 3))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.LeaveShard(ctx, mv); !errors.Is(err, store.ErrPlacementBusy) {
		t.Fatalf("a leave while a producer holds the placement row: %v, want ErrPlacementBusy", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.LeaveShard(ctx, mv); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Enqueue(ctx, insert("k", movedShard, 3)); !store.NotHeld(err) {
		t.Fatalf("a producer after the leave: %v, want SR001", err)
	}
	if _, err := store.CopyShard(ctx, a, b, mv); err != nil {
		t.Fatal(err)
	}
	moved := moveTo(r, movedShard, "b", 3)
	r.OnStale = func(context.Context) (store.Map, error) { return moved, nil }
	mv.MapRev = 3
	if err := b.ArriveShard(ctx, mv); err != nil {
		t.Fatal(err)
	}
	id, err := r.Enqueue(ctx, insert("k", movedShard, 3))
	if err != nil {
		t.Fatalf("the producer again after the move: %v", err)
	}
	only(t, id, b, a)
	only(t, first.ID, b, a)
}

// A driver that stops after any step of the move, and a new leader's
// recovery (the coordinator fence raised at both databases first), leave
// exactly one copy of every task, held by one database: where a's shard
// is gone the move finishes, otherwise b's copy is deleted and the move
// is resumed at the leave or rolled back. The stopped driver's steps
// apply nothing once the fence moved on.
func TestARecoveredMoveLeavesOneCopy(t *testing.T) {
	t.Parallel()
	steps := []string{"leave", "copied", "committed", "arrived"}
	for _, crashAfter := range steps {
		for _, resume := range []bool{true, false} {
			name := crashAfter + map[bool]string{true: "/resume", false: "/rollback"}[resume]
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				r, a, b := twoDatabases(t)
				_, ids := fillShard(t, r, movedShard)
				mv := store.ShardMove{Shard: movedShard, From: "a", To: "b", MapRev: 2, Epoch: leaderEpoch}
				if err := a.LeaveShard(ctx, mv); err != nil {
					t.Fatal(err)
				}
				switch crashAfter {
				case "copied":
					if _, err := store.CopyShard(ctx, a, b, store.Abandoning(mv)); err == nil {
						t.Fatal("an abandoned copy committed")
					}
					if p := placementOf(t, b, movedShard); p != store.PlacementArriving {
						t.Fatalf("b's placement %s after an abandoned copy, want arriving", p)
					}
				case "committed", "arrived":
					if _, err := store.CopyShard(ctx, a, b, mv); err != nil {
						t.Fatal(err)
					}
					if crashAfter == "arrived" {
						if err := b.ArriveShard(ctx, mv); err != nil {
							t.Fatal(err)
						}
					}
				}

				// The new leader: its fence at a, then b.
				next := mv
				next.Epoch = leaderEpoch + 1
				if ok, err := r.RaiseLeaderFence(ctx, "next", next.Epoch); err != nil || !ok {
					t.Fatalf("raising the fence: %v %v", ok, err)
				}
				if err := a.LeaveShard(ctx, mv); !errors.Is(err, store.ErrNotLeader) && !errors.Is(err, store.ErrShardGone) {
					t.Fatalf("the old driver's leave: %v, want refused", err)
				}
				if _, err := store.CopyShard(ctx, a, b, mv); !errors.Is(err, store.ErrNotLeader) {
					t.Fatalf("the old driver's copy: %v, want ErrNotLeader", err)
				}
				src, _, err := a.PlacementOf(ctx, movedShard)
				if err != nil {
					t.Fatal(err)
				}
				home := a
				if src.State == store.PlacementGone {
					// Committed: finish (the switch is etcd's).
					if err := b.ArriveShard(ctx, next); err != nil {
						t.Fatal(err)
					}
					home = b
				} else {
					if err := b.DropArriving(ctx, next); err != nil {
						t.Fatal(err)
					}
					if resume {
						if err := a.LeaveShard(ctx, next); err != nil {
							t.Fatal(err)
						}
						if _, err := store.CopyShard(ctx, a, b, next); err != nil {
							t.Fatal(err)
						}
						if err := b.ArriveShard(ctx, next); err != nil {
							t.Fatal(err)
						}
						home = b
					} else if err := a.RollbackShard(ctx, next); err != nil {
						t.Fatal(err)
					}
				}
				away := map[*store.Store]*store.Store{a: b, b: a}[home]
				if p := placementOf(t, home, movedShard); p != store.PlacementHeld {
					t.Fatalf("the shard's database: %s, want held", p)
				}
				if p := placementOf(t, away, movedShard); p != store.PlacementGone && p != "none" {
					t.Fatalf("the other database: %s, want gone or none", p)
				}
				for _, id := range ids {
					only(t, id, home, away)
				}
				if n := rows(t, home, `SELECT count(*) FROM shard_fences WHERE shard = $1 AND moving`, movedShard); n != 0 {
					t.Fatalf("%d fence rows still moving", n)
				}
				for table, got := range shardRows(t, away, movedShard) {
					if len(got) != 0 {
						t.Fatalf("%d rows of %s left at the other database", len(got), table)
					}
				}
				// The shard works where it is: its ready task is claimed.
				m := moveTo(r, movedShard, map[*store.Store]string{a: "a", b: "b"}[home], 5)
				r.SetMap(m)
				got, err := r.Claim(ctx, "r1", []claims.ShardEpoch{{Shard: movedShard, Epoch: 1}}, tasks.DefaultQueue, []string{"other"}, 10, 10)
				if err != nil || len(got) != 2 {
					t.Fatalf("claimed %d of the 2 ready tasks where the shard is (%v)", len(got), err)
				}
			})
		}
	}
}

// A handler's transaction that recorded its task's completion (CompleteTx:
// a mark on the claim row, the row locked until it commits) holds the
// copy back until it commits, while a producer is refused at once; the
// mark moves with the claim, and the runner's completion written at the
// new database finds the task completed there, once.
func TestACopyWaitsForAHandlersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	id, err := r.Enqueue(ctx, insert("k", movedShard, 3))
	if err != nil {
		t.Fatal(err)
	}
	term := []claims.ShardEpoch{{Shard: movedShard, Epoch: 1}}
	if o, err := r.RaiseFences(ctx, "r1", "", term); err != nil || len(o.Raised) != 1 {
		t.Fatalf("raise: %+v %v", o, err)
	}
	got, err := r.Claim(ctx, "r1", term, tasks.DefaultQueue, []string{"k"}, 1, 1)
	if err != nil || len(got) != 1 {
		t.Fatalf("claim: %d %v", len(got), err)
	}
	ref := claims.RefOf(got[0])
	handler, err := a.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = handler.Rollback(ctx) }()
	if res, err := r.CompleteTx(ctx, handler, "r1", claims.Completion{Ref: ref}); err != nil || res.Outcome != claims.Applied {
		t.Fatalf("CompleteTx: %+v %v", res, err)
	}
	mv := store.ShardMove{Shard: movedShard, From: "a", To: "b", MapRev: 2, Epoch: leaderEpoch}
	if err := a.LeaveShard(ctx, mv); err != nil {
		t.Fatal(err)
	}
	copied := make(chan error, 1)
	go func() {
		_, err := store.CopyShard(ctx, a, b, mv)
		copied <- err
	}()
	deadline := time.Now().Add(20 * time.Second)
	for rows(t, a, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
		AND query LIKE '%shardrun.move_lock_claims%' AND wait_event_type = 'Lock'`) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the copy never waited for the handler's transaction")
		}
		select {
		case err := <-copied:
			t.Fatalf("the copy ended while the handler's transaction held the claim: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	// A producer meanwhile is refused at once, not held back by the copy.
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = r.Enqueue(pctx, insert("k", movedShard, 3))
	cancel()
	if !store.NotHeld(err) {
		t.Fatalf("a producer during the copy: %v, want SR001 at once", err)
	}
	select {
	case err := <-copied:
		t.Fatalf("the copy ended while the handler's transaction held the claim: %v", err)
	default:
	}
	if err := handler.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-copied; err != nil {
		t.Fatal(err)
	}
	r.SetMap(moveTo(r, movedShard, "b", 3))
	mv.MapRev = 3
	if err := b.ArriveShard(ctx, mv); err != nil {
		t.Fatal(err)
	}
	if res := outcomes(t)(r.Complete(ctx, "r1", []claims.Completion{{Ref: ref}})); res[0] != claims.Completed && res[0] != claims.Applied {
		t.Fatalf("the runner's completion at b: %v", res)
	}
	if task := get(t, b, id); task.State != tasks.Completed || task.Attempt != 1 {
		t.Fatalf("task at b: %s at attempt %d, want completed at its first", task.State, task.Attempt)
	}
	only(t, id, b, a)
}

// A transaction that holds the shard's placement row (a producer's, whose
// insert was refused and which has not ended yet) makes the copy's commit
// give up without waiting (ErrPlacementBusy): nothing committed at the
// source, the copy at the destination arriving; once it ends, the copy
// is made again and commits.
func TestACopyNeverWaitsForTheProducersPlacementLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, a, b := twoDatabases(t)
	id, err := r.Enqueue(ctx, insert("k", movedShard, 3))
	if err != nil {
		t.Fatal(err)
	}
	mv := store.ShardMove{Shard: movedShard, From: "a", To: "b", MapRev: 2, Epoch: leaderEpoch}
	if err := a.LeaveShard(ctx, mv); err != nil {
		t.Fatal(err)
	}
	producer, err := a.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = producer.Rollback(ctx) }()
	if _, err := producer.Exec(ctx, `SELECT 1 FROM shardrun_placement WHERE shard = $1 FOR SHARE`, movedShard); err != nil {
		t.Fatal(err)
	}
	if _, err := store.CopyShard(ctx, a, b, mv); !errors.Is(err, store.ErrPlacementBusy) {
		t.Fatalf("a copy while a producer holds the placement row: %v, want ErrPlacementBusy", err)
	}
	if p := placementOf(t, a, movedShard); p != store.PlacementLeaving {
		t.Fatalf("a's placement %s after the copy gave up, want leaving", p)
	}
	if p := placementOf(t, b, movedShard); p != store.PlacementArriving {
		t.Fatalf("b's placement %s after the copy gave up, want arriving", p)
	}
	if !has(t, a, id) || !has(t, b, id) {
		t.Fatalf("task %d: at a %v, its copy at b %v; want both (nothing committed at a)", id, has(t, a, id), has(t, b, id))
	}
	if err := producer.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.DropArriving(ctx, mv); err != nil {
		t.Fatal(err)
	}
	if _, err := store.CopyShard(ctx, a, b, mv); err != nil {
		t.Fatal(err)
	}
	only(t, id, b, a)
}

// The copy's transaction at the source sits idle while the destination's
// transaction runs; a slow destination (here its placement row held by
// another transaction) does not get it ended by the pool's
// idle_in_transaction_session_timeout.
func TestASlowDestinationDoesNotEndTheCopy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m := store.NewMap([]string{"a", "b"}, 8)
	m.Rev = 1
	r, st := pgtest.NewCluster(t, store.Options{MaxConns: 10, IdleInTxTimeout: 300 * time.Millisecond}, m)
	a, b := st["a"], st["b"]
	if ok, err := r.RaiseLeaderFence(ctx, "test-coordinator", leaderEpoch); err != nil || !ok {
		t.Fatalf("raising the coordinator fence: %v %v", ok, err)
	}
	id, err := r.Enqueue(ctx, insert("k", movedShard, 3))
	if err != nil {
		t.Fatal(err)
	}
	mv := store.ShardMove{Shard: movedShard, From: "a", To: "b", MapRev: 2, Epoch: leaderEpoch}
	if err := a.LeaveShard(ctx, mv); err != nil {
		t.Fatal(err)
	}
	notHeld(t, b, movedShard, store.PlacementGone, "a")
	hold, err := b.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = hold.Rollback(ctx) }()
	if _, err := hold.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', '0', true)`); err != nil {
		t.Fatal(err)
	}
	if _, err := hold.Exec(ctx, `SELECT 1 FROM shardrun_placement WHERE shard = $1 FOR UPDATE`, movedShard); err != nil {
		t.Fatal(err)
	}
	copied := make(chan error, 1)
	go func() {
		_, err := store.CopyShard(ctx, a, b, mv)
		copied <- err
	}()
	// The source's transaction idle for twice the pool's timeout.
	deadline := time.Now().Add(20 * time.Second)
	for rows(t, a, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
		AND state = 'idle in transaction' AND now() - state_change > interval '600 milliseconds'`) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the copy's transaction at the source never sat idle")
		}
		select {
		case err := <-copied:
			t.Fatalf("the copy ended while the destination's placement row was held: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := hold.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-copied; err != nil {
		t.Fatal(err)
	}
	only(t, id, b, a)
}
