package integration

// A shard's online move between two databases under load (issue 40):
// the real binaries, two databases, producers enqueueing into the shard
// while it moves.

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/coordinator"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

// keysOfShard returns n task keys of shard s.
func keysOfShard(s, n int, tag string) []string {
	var out []string
	for i := 0; len(out) < n; i++ {
		k := fmt.Sprintf("%s-%d", tag, i)
		if tasks.ShardOf(k, shards) == s {
			out = append(out, k)
		}
	}
	return out
}

// producer posts batches of sleep tasks into one shard through the API
// until stopped, each batch again after a 503 (the shard's database
// refused it while the shard left: SR001), and remembers the keys of the
// batches accepted, and of the one it was still sending when stopped.
type producer struct {
	c     *cluster
	coord *proc
	shard int

	mu       sync.Mutex
	accepted []string
	unsent   []string
	refused  int
}

// Run produces until ctx ends.
func (p *producer) Run(ctx context.Context) {
	for round := 0; ctx.Err() == nil; round++ {
		keys := keysOfShard(p.shard, 10, fmt.Sprintf("load-%d-%d", p.shard, round))
		batch := make([]map[string]any, len(keys))
		for i, k := range keys {
			batch[i] = map[string]any{"kind": "sleep", "key": k, "payload": json.RawMessage(`{"ms": 20}`), "max_attempts": 3}
		}
		body, _ := json.Marshal(batch)
		for {
			if ctx.Err() != nil {
				p.mu.Lock()
				p.unsent = keys
				p.mu.Unlock()
				return
			}
			code, _ := testutil.HTTP(p.c.t, "POST", "http://"+p.coord.addr+"/api/tasks", apiToken, string(body))
			p.mu.Lock()
			if code == 201 {
				p.accepted = append(p.accepted, keys...)
				p.mu.Unlock()
				break
			}
			p.refused++
			p.mu.Unlock()
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// expectSent records every task of the keys sent, in whichever database
// it is, as one that must complete.
func (c *cluster) expectSent(keys []string) int {
	c.t.Helper()
	return c.expectKeys(keys, tasks.Completed)
}

// TestMoveAShardUnderLoad moves one shard of main to second while
// producers enqueue into it and the runners run its tasks: the move ends
// (GET /api/databases shows the shard in second), no task is lost and none
// runs twice (the invariants, and every task of the shard completed at its
// first attempt with no error), nothing of the shard is left in main, and
// the shard's tasks enqueued after the move complete in second.
func TestMoveAShardUnderLoad(t *testing.T) {
	t.Parallel()
	c := newClusterOnDatabases(t, clusterDB{name: "second", dsn: pgtest.NewDatabase(t)})
	coord := c.startCoordinator("coord-1")
	names := []string{"runner-1", "runner-2"}
	for _, n := range names {
		c.startRunner(n, false)
	}
	c.waitFor(20*time.Second, "balanced", func() bool { return c.balanced(names...) })
	const moved = 5 // main holds 0-31

	ctx, stop := context.WithCancel(context.Background())
	p := &producer{c: c, coord: coord, shard: moved}
	var wg sync.WaitGroup
	wg.Go(func() { p.Run(ctx) })
	defer func() { stop(); wg.Wait() }()
	c.waitFor(20*time.Second, "the shard's tasks running in main", func() bool {
		return c.countIn("main", `SELECT count(*) FROM task_view WHERE shard = $1 AND state = 'completed'`, moved) >= 50
	})

	code, body := testutil.HTTP(t, "POST", fmt.Sprintf("http://%s/api/shards/%d/move", coord.addr, moved), apiToken, `{"to": "second"}`)
	if code != 202 {
		t.Fatalf("POST /api/shards/%d/move: %d %s", moved, code, body)
	}
	start := time.Now()
	var v coordinator.DatabasesView
	c.waitFor(60*time.Second, "the move done", func() bool {
		v, _ = c.databases(coord)
		return len(v.Moves) == 0 && v.Databases[1].Shards == fmt.Sprintf("%d,32-63", moved)
	})
	took := time.Since(start)
	c.waitFor(20*time.Second, "the shard's tasks completing in second", func() bool {
		return c.countIn("second", `SELECT count(*) FROM task_view WHERE shard = $1 AND state = 'completed'`, moved) >= 50
	})
	stop()
	wg.Wait()

	after := keysOfShard(moved, 30, "after")
	c.enqueueKeys(coord, after)
	c.waitFor(30*time.Second, "the shard's tasks enqueued after the move completed in second", func() bool {
		return c.completedIn("second", after) == len(after)
	})
	p.mu.Lock()
	accepted, unsent, refused := p.accepted, p.unsent, p.refused
	p.mu.Unlock()
	if n := c.countIn("main", `SELECT count(*) FROM tasks WHERE key = ANY ($1)`, unsent) +
		c.countIn("second", `SELECT count(*) FROM tasks WHERE key = ANY ($1)`, unsent); n != 0 {
		t.Errorf("%d tasks of a batch refused until the producer stopped were stored", n)
	}
	n := c.expectSent(accepted)
	if n != len(accepted) {
		t.Errorf("%d tasks accepted, %d found: a batch stored twice after a refusal?", len(accepted), n)
	}
	if left := c.countIn("main", `SELECT count(*) FROM tasks WHERE shard = $1`, moved); left != 0 {
		t.Errorf("%d tasks of the moved shard left in main", left)
	}
	s := c.finish(60 * time.Second)
	if twice := c.countIn("second", `SELECT count(*) FROM task_view WHERE shard = $1 AND (attempt <> 1 OR jsonb_array_length(errors) <> 0)`, moved); twice != 0 {
		t.Errorf("%d tasks of the moved shard ran more than once (a later attempt, or an error in their history)", twice)
	}
	c.report("a shard moved under load", s, fmt.Sprintf("%d tasks of shard %d; the move took %s; producers refused %d times meanwhile",
		n, moved, took.Round(10*time.Millisecond), refused))
	if strings.Contains(body, "postgres://") {
		t.Errorf("the move's answer shows a URL: %s", body)
	}
}

// countIn runs a count query with args in database db.
func (c *cluster) countIn(db, q string, args ...any) int {
	c.t.Helper()
	var n int
	if err := c.db(db).store.Pool().QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		return -1
	}
	return n
}

// leaderOf returns the coordinator of coords that says it leads, or nil.
func (c *cluster) leaderOf(coords ...*proc) *proc {
	for _, p := range coords {
		code, body := testutil.HTTP(c.t, "GET", "http://"+p.addr+"/healthz", "", "")
		if code == 200 && strings.Contains(body, `"leader":true`) {
			return p
		}
	}
	return nil
}

// TestANewLeaderFinishesAMoveItsPredecessorLeft kills the leading
// coordinator while its move's copy waits for a claim of the shard (a
// transaction of the test holds the claim's row, as a handler's
// transaction holding a CompleteTx mark would): the other coordinator
// leads, raises its fence (which waits for the dead driver's transaction
// to end), and finishes the move; the running task completes, nothing is
// lost or run twice.
func TestANewLeaderFinishesAMoveItsPredecessorLeft(t *testing.T) {
	t.Parallel()
	c := newClusterOnDatabases(t, clusterDB{name: "second", dsn: pgtest.NewDatabase(t)})
	coords := []*proc{c.startCoordinator("coord-1"), c.startCoordinator("coord-2")}
	names := []string{"runner-1", "runner-2"}
	for _, n := range names {
		c.startRunner(n, false)
	}
	c.waitFor(20*time.Second, "balanced", func() bool { return c.balanced(names...) })
	const moved = 7
	var leader *proc
	c.waitFor(20*time.Second, "a leader", func() bool { leader = c.leaderOf(coords...); return leader != nil })
	other := coords[0]
	if other == leader {
		other = coords[1]
	}

	long := keysOfShard(moved, 1, "long")
	c.enqueueBatch(leader, []map[string]any{{"kind": "sleep", "key": long[0], "payload": json.RawMessage(`{"ms": 4000}`)}}, tasks.Completed)
	c.waitFor(20*time.Second, "the long task running", func() bool {
		return c.countIn("main", `SELECT count(*) FROM task_claims WHERE shard = $1`, moved) == 1
	})
	c.enqueueKeys(leader, keysOfShard(moved, 20, "before"))
	ctx := context.Background()
	hold, err := c.db("main").store.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = hold.Rollback(ctx) }()
	if _, err := hold.Exec(ctx, `SELECT 1 FROM task_claims WHERE shard = $1 FOR UPDATE`, moved); err != nil {
		t.Fatal(err)
	}

	code, body := testutil.HTTP(t, "POST", fmt.Sprintf("http://%s/api/shards/%d/move", leader.addr, moved), apiToken, `{"to": "second"}`)
	if code != 202 {
		t.Fatalf("POST /api/shards/%d/move: %d %s", moved, code, body)
	}
	c.waitFor(20*time.Second, "the copy waiting for the held claim", func() bool {
		return c.countIn("main", `SELECT count(*) FROM shardrun_placement WHERE shard = $1 AND state = 'leaving'`, moved) == 1 &&
			c.countIn("main", `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE '%shardrun.move_lock_claims%' AND wait_event_type = 'Lock'`) == 1
	})
	leader.signal(t, syscall.SIGKILL)
	c.waitFor(20*time.Second, other.name+" leading", func() bool { return c.leaderOf(other) != nil })
	if err := hold.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	c.waitFor(60*time.Second, "the move finished by the new leader", func() bool {
		v, _ := c.databases(other)
		return len(v.Moves) == 0 && v.Databases[1].Shards == fmt.Sprintf("%d,32-63", moved)
	})
	after := keysOfShard(moved, 20, "after")
	c.enqueueKeys(other, after)
	c.waitFor(30*time.Second, "the shard's tasks completed in second", func() bool {
		return c.completedIn("second", append(after, long...)) == len(after)+1
	})
	if left := c.countIn("main", `SELECT count(*) FROM tasks WHERE shard = $1`, moved); left != 0 {
		t.Errorf("%d tasks of the moved shard left in main", left)
	}
	s := c.finish(60 * time.Second)
	if twice := c.countIn("second", `SELECT count(*) FROM task_view WHERE shard = $1 AND (attempt <> 1 OR jsonb_array_length(errors) <> 0)`, moved); twice != 0 {
		t.Errorf("%d tasks of the moved shard ran more than once (a later attempt, or an error in their history)", twice)
	}
	c.report("a move's leader killed", s, fmt.Sprintf("shard %d moved by %s after %s was killed mid-copy", moved, other.name, leader.name))
}
