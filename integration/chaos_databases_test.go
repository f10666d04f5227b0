package integration

// Chaos on three databases (issue 40): one database's server stopped
// while shards move, producers enqueue into every database and a runner
// is killed; then the server comes back and the move that needed it ends.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/coordinator"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/internal/testutil"
)

// firstShard is the first shard of a database's ranges ("0-20,40").
func firstShard(t *testing.T, ranges string) int {
	t.Helper()
	first, _, _ := strings.Cut(strings.Split(ranges, ",")[0], "-")
	n, err := strconv.Atoi(first)
	if err != nil {
		t.Fatalf("shard ranges %q: %v", ranges, err)
	}
	return n
}

// TestChaosOneDatabaseStoppedWhileShardsMove runs three databases, the
// third on a server of its own, two coordinators and three runners, with
// producers enqueueing into a shard of every database and into the shards
// that move. It stops the third's server, asks for a move that does not
// need it (main to second) and one that does (second to third), and kills
// a runner: the first move ends while the third is down and the other
// runners take the killed one's shards, the second move ends once the
// third is back and a new runner joins, and in the end every task accepted completed exactly once
// in its shard's database (the invariants, checked at every database), no
// batch refused was stored, and nothing of a moved shard is left at its
// source.
func TestChaosOneDatabaseStoppedWhileShardsMove(t *testing.T) {
	t.Parallel()
	srv := pgtest.NewServer(t)
	c := newClusterOnDatabases(t, clusterDB{name: "second", dsn: pgtest.NewDatabase(t)}, clusterDB{name: "third", dsn: pgtest.NewDatabaseOn(t, srv)})
	coords := []*proc{c.startCoordinator("coord-1"), c.startCoordinator("coord-2")}
	names := []string{"runner-1", "runner-2", "runner-3"}
	for _, n := range names {
		c.startRunner(n, false)
	}
	c.waitFor(30*time.Second, "balanced", func() bool { return c.balanced(names...) })
	v, body := c.databases(coords[0])
	if len(v.Databases) != 3 {
		t.Fatalf("GET /api/databases: %s", body)
	}
	sMain, sSecond, sThird := firstShard(t, v.Databases[0].Shards), firstShard(t, v.Databases[1].Shards), firstShard(t, v.Databases[2].Shards)
	toSecond, toThird := sMain+1, sSecond+1

	ctx, stop := context.WithCancel(context.Background())
	var ps []*producer
	var wg sync.WaitGroup
	for i, s := range []int{sMain, sSecond, sThird, toSecond, toThird} {
		p := &producer{c: c, coord: coords[i%2], shard: s}
		ps = append(ps, p)
		wg.Go(func() { p.Run(ctx) })
	}
	defer func() { stop(); wg.Wait() }()
	c.waitFor(30*time.Second, "tasks completing in every database", func() bool {
		return c.countIn("main", `SELECT count(*) FROM task_view WHERE state = 'completed'`) >= 30 &&
			c.countIn("second", `SELECT count(*) FROM task_view WHERE state = 'completed'`) >= 30 &&
			c.countIn("third", `SELECT count(*) FROM task_view WHERE state = 'completed'`) >= 30
	})

	if err := srv.Halt(); err != nil {
		t.Fatal(err)
	}
	halted := time.Now()
	c.waitFor(20*time.Second, "third reported unavailable", func() bool {
		return c.healthOf(coords[0], "third") == placement.HealthUnavailable
	})
	move := func(shard int, to string) {
		code, body := testutil.HTTP(t, "POST", fmt.Sprintf("http://%s/api/shards/%d/move", coords[0].addr, shard), apiToken, fmt.Sprintf(`{"to": %q}`, to))
		if code != 202 {
			t.Fatalf("POST /api/shards/%d/move to %s: %d %s", shard, to, code, body)
		}
	}
	move(toSecond, "second")
	move(toThird, "third")
	c.proc("runner-1").signal(t, syscall.SIGKILL)

	placed := func(v coordinator.DatabasesView, shard int, db string) bool {
		for _, d := range v.Databases {
			if d.Name == db {
				for _, r := range strings.Split(d.Shards, ",") {
					lo, hi, _ := strings.Cut(r, "-")
					a, _ := strconv.Atoi(lo)
					b := a
					if hi != "" {
						b, _ = strconv.Atoi(hi)
					}
					if shard >= a && shard <= b {
						return true
					}
				}
			}
		}
		return false
	}
	firstDone := c.waitFor(90*time.Second, fmt.Sprintf("shard %d moved to second while third is down", toSecond), func() bool {
		v, _ = c.databases(coords[1])
		return placed(v, toSecond, "second")
	})
	if placed(v, toThird, "third") {
		t.Errorf("shard %d reached third while its server was stopped", toThird)
	}
	c.waitFor(30*time.Second, "runner-2 and runner-3 holding runner-1's shards", func() bool { return c.balanced("runner-2", "runner-3") })

	if err := srv.Resume(context.Background()); err != nil {
		t.Fatal(err)
	}
	down := time.Since(halted)
	// A process starts only with every database reachable (it migrates
	// and registers each): a runner replacing the killed one joins now.
	c.startRunner("runner-4", false)
	c.waitFor(30*time.Second, "runner-2, runner-3 and runner-4 balanced", func() bool { return c.balanced("runner-2", "runner-3", "runner-4") })
	c.waitFor(90*time.Second, fmt.Sprintf("shard %d moved to third once it is back", toThird), func() bool {
		v, _ = c.databases(coords[1])
		return len(v.Moves) == 0 && placed(v, toThird, "third")
	})
	c.waitFor(30*time.Second, "tasks of the moved shards completing at their new databases", func() bool {
		return c.countIn("second", `SELECT count(*) FROM task_view WHERE shard = $1 AND state = 'completed'`, toSecond) > 0 &&
			c.countIn("third", `SELECT count(*) FROM task_view WHERE shard = $1 AND state = 'completed'`, toThird) > 0
	})
	stop()
	wg.Wait()

	var accepted, refused int
	for _, p := range ps {
		p.mu.Lock()
		if n := c.expectSent(p.accepted); n != len(p.accepted) {
			t.Errorf("shard %d: %d tasks accepted, %d found", p.shard, len(p.accepted), n)
		}
		for _, db := range []string{"main", "second", "third"} {
			if n := c.countIn(db, `SELECT count(*) FROM tasks WHERE key = ANY ($1)`, p.unsent); n != 0 {
				t.Errorf("%d tasks of a batch refused until the producer stopped were stored in %s", n, db)
			}
		}
		accepted, refused = accepted+len(p.accepted), refused+p.refused
		p.mu.Unlock()
	}
	if left := c.countIn("main", `SELECT count(*) FROM tasks WHERE shard = $1`, toSecond) +
		c.countIn("second", `SELECT count(*) FROM tasks WHERE shard = $1`, toThird); left != 0 {
		t.Errorf("%d tasks of the moved shards left at their sources", left)
	}
	s := c.finish(90 * time.Second)
	c.report("chaos on three databases", s, fmt.Sprintf("%d tasks accepted (%d batches refused and sent again); third down %s; the move not needing it done %s after it was asked",
		accepted, refused, down.Round(100*time.Millisecond), firstDone.Round(100*time.Millisecond)))
}
