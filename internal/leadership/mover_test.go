package leadership_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/leadership"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const prefix = "/shardrun/movetest/"

// cluster is a cluster of databases a (shards 0-3) and b (4-7) with its
// map in etcd, and a few ready tasks in each of shards 1, 2 and 3.
func cluster(t *testing.T) (*clientv3.Client, *store.Router, map[string]*store.Store, map[int][]int64) {
	t.Helper()
	ctx := context.Background()
	_, cli := testutil.Etcd(t)
	m, _, err := shard.EnsureCluster(ctx, cli, prefix, 8, []string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	r, stores := pgtest.NewCluster(t, store.Options{MaxConns: 10}, m)
	ids := map[int][]int64{}
	for _, sh := range []int{1, 2, 3} {
		for i := range 3 {
			id, err := r.Enqueue(ctx, store.Insert{NewTask: tasks.NewTask{Kind: "k", Payload: json.RawMessage(`{}`),
				Options: tasks.Options{Key: fmt.Sprint("k", sh, i), MaxAttempts: 3}.WithDefaults(0)}, Shard: sh})
			if err != nil {
				t.Fatal(err)
			}
			ids[sh] = append(ids[sh], id)
		}
	}
	return cli, r, stores, ids
}

// lead runs a leader over r until the test ends.
func lead(t *testing.T, cli *clientv3.Client, r *store.Router) {
	t.Helper()
	l, err := leadership.New(cli, r, nil, leadership.Config{ID: "mover-test", Prefix: prefix, ShardCount: 8})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { l.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
}

// moved waits until the map lists no move and places shard in db.
func moved(t *testing.T, cli *clientv3.Client, shardID int, db string) {
	t.Helper()
	testutil.Until(t, 30*time.Second, fmt.Sprintf("shard %d moved to %s", shardID, db), func() (bool, string) {
		m, err := shard.ReadDatabases(context.Background(), cli, prefix, 8)
		if err != nil {
			return false, err.Error()
		}
		return len(m.Moves) == 0 && m.Shards[shardID] == db, fmt.Sprintf("map %v, moves %+v", m.Shards, m.Moves)
	})
}

// at checks that the tasks ids are at want (whose placement holds the
// shard) and not at other (gone, or never held there).
func at(t *testing.T, want, other *store.Store, shardID int, ids []int64) {
	t.Helper()
	ctx := context.Background()
	for _, st := range []struct {
		st    *store.Store
		state string
		n     int
	}{{want, store.PlacementHeld, len(ids)}, {other, store.PlacementGone, 0}} {
		p, _, err := st.st.PlacementOf(ctx, shardID)
		if err != nil {
			t.Fatal(err)
		}
		var n int
		if err := st.st.Pool().QueryRow(ctx, `SELECT count(*) FROM tasks WHERE id = ANY ($1)`, ids).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if p.State == "" && st.state == store.PlacementGone {
			p.State = store.PlacementGone // never held there
		}
		if p.State != st.state || n != st.n {
			t.Fatalf("shard %d: %s with %d of its %d tasks, want %s with %d", shardID, p.State, n, len(ids), st.state, st.n)
		}
	}
}

func TestTheLeaderMovesAShard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cli, r, st, ids := cluster(t)
	for _, c := range []struct {
		shard int
		to    string
		want  string
	}{
		{9, "b", "invalid shard: 9 is not one of the cluster's 8 shards (0-7)"},
		{1, "c", `invalid to: the cluster has no database "c" (its databases: a, b)`},
		{1, "a", "invalid to: shard 1 is in database a already"},
	} {
		_, err := leadership.RequestMove(ctx, cli, prefix, 8, c.shard, c.to)
		var fe *tasks.FieldError
		if !errors.As(err, &fe) || err.Error() != c.want {
			t.Fatalf("moving shard %d to %s: %v, want %q", c.shard, c.to, err, c.want)
		}
	}
	m, err := leadership.RequestMove(ctx, cli, prefix, 8, 1, "b")
	if err != nil || len(m.Moves) != 1 || m.Moves[0] != (store.Move{Shard: 1, From: "a", To: "b", Phase: leadership.PhaseLeaving}) {
		t.Fatalf("the intent: %+v %v", m, err)
	}
	if _, err := leadership.RequestMove(ctx, cli, prefix, 8, 1, "b"); err == nil || err.Error() != "invalid shard: shard 1 is moving already (from a to b, leaving)" {
		t.Fatalf("a second move of the shard: %v", err)
	}
	lead(t, cli, r)
	moved(t, cli, 1, "b")
	at(t, st["b"], st["a"], 1, ids[1])
}

// A new leader finds a move an earlier driver left at each point: after
// the copy at b (not committed at a: b's copy goes, the move resumes) and
// after the commit at a (the map not switched yet: it finishes).
func TestANewLeaderFinishesAMoveLeftUnderWay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cli, r, st, ids := cluster(t)
	if ok, err := r.RaiseLeaderFence(ctx, "old", 1); err != nil || !ok {
		t.Fatalf("the old leader's fence: %v %v", ok, err)
	}
	for _, sh := range []int{2, 3} {
		m, err := leadership.RequestMove(ctx, cli, prefix, 8, sh, "b")
		if err != nil {
			t.Fatal(err)
		}
		mv := store.ShardMove{Shard: sh, From: "a", To: "b", MapRev: m.Rev, Epoch: 1}
		if err := st["a"].LeaveShard(ctx, mv); err != nil {
			t.Fatal(err)
		}
		if sh == 2 {
			halfCopy(t, st["a"], st["b"], sh)
			continue
		}
		if _, err := store.CopyShard(ctx, st["a"], st["b"], mv); err != nil {
			t.Fatalf("the old driver's copy of shard %d: %v", sh, err)
		}
	}
	lead(t, cli, r)
	moved(t, cli, 2, "b")
	moved(t, cli, 3, "b")
	at(t, st["b"], st["a"], 2, ids[2])
	at(t, st["b"], st["a"], 3, ids[3])
	at(t, st["a"], st["b"], 1, ids[1])
}

// halfCopy leaves at to what a copy that committed at to but not at from
// leaves: the shard's task records, arriving.
func halfCopy(t *testing.T, from, to *store.Store, shardID int) {
	t.Helper()
	ctx := context.Background()
	var rows string
	if err := from.Pool().QueryRow(ctx, `SELECT jsonb_agg(to_jsonb(t))::text FROM tasks t WHERE shard = $1`, shardID).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	tx, err := to.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for _, st := range []struct {
		q    string
		args []any
	}{
		{`SELECT set_config('shardrun.move_copy', 'on', true)`, nil},
		{`INSERT INTO tasks OVERRIDING SYSTEM VALUE SELECT * FROM jsonb_populate_recordset(NULL::tasks, $1::jsonb)`, []any{rows}},
		{`INSERT INTO task_ready (shard, queue, kind, priority, run_after, id)
			SELECT shard, queue, kind, priority, run_after, id FROM jsonb_populate_recordset(NULL::tasks, $1::jsonb)`, []any{rows}},
		{`INSERT INTO shardrun_placement (shard, state, peer) VALUES ($1, 'arriving', 'a')`, []any{shardID}},
	} {
		if _, err := tx.Exec(ctx, st.q, st.args...); err != nil {
			t.Fatalf("%s: %v", st.q, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// A move the databases refuse (here the destination says it holds the
// shard already) is rolled back: the source holds the shard again, its
// fences not moving, and the move leaves the map with the shard where it
// was.
func TestAMoveTheDatabasesRefuseIsRolledBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cli, r, st, ids := cluster(t)
	if _, err := st["b"].Pool().Exec(ctx, `INSERT INTO shardrun_placement (shard, state) VALUES (1, 'held')`); err != nil {
		t.Fatal(err)
	}
	if _, err := leadership.RequestMove(ctx, cli, prefix, 8, 1, "b"); err != nil {
		t.Fatal(err)
	}
	lead(t, cli, r)
	moved(t, cli, 1, "a")
	p, _, err := st["a"].PlacementOf(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	var moving, n int
	if err := st["a"].Pool().QueryRow(ctx, `SELECT (SELECT count(*) FROM shard_fences WHERE shard = 1 AND moving),
		(SELECT count(*) FROM tasks WHERE id = ANY ($1))`, ids[1]).Scan(&moving, &n); err != nil {
		t.Fatal(err)
	}
	if p.State != store.PlacementHeld || moving != 0 || n != len(ids[1]) {
		t.Fatalf("after the rollback a's shard 1 is %s, %d fence rows moving, %d of its %d tasks", p.State, moving, n, len(ids[1]))
	}
}
