package integration

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

// base starts a coordinator and n runners and waits until they share the
// shards evenly.
func base(t *testing.T, n int, proxied ...string) (*cluster, *proc, []string) {
	c := newCluster(t)
	coord := c.startCoordinator("coord-1")
	var names []string
	for i := range n {
		name := fmt.Sprintf("runner-%d", i+1)
		withProxy := false
		for _, p := range proxied {
			withProxy = withProxy || p == name
		}
		c.startRunner(name, withProxy)
		names = append(names, name)
	}
	c.waitFor(20*time.Second, "balanced", func() bool { return c.balanced(names...) })
	return c, coord, names
}

// load enqueues a mix: sleeps and no-ops that must complete, and tasks that
// always fail and must end dead.
func load(c *cluster, coord *proc, sleeps int, ms int) {
	c.enqueue(coord, sleeps, "sleep", fmt.Sprintf(`{"ms": %d}`, ms), 5, tasks.Completed)
	c.enqueue(coord, sleeps/2, "noop", "", 5, tasks.Completed)
	c.enqueue(coord, 10, "fail", `{"times": 99}`, 2, tasks.Dead)
}

// pending counts the tasks not finished yet.
func (c *cluster) pending() int64 {
	counts := c.counts()
	return counts[tasks.Ready] + counts[tasks.Running]
}

func (c *cluster) waitRunning(p *proc) {
	c.waitFor(10*time.Second, p.name+" running tasks", func() bool { return c.metric(p, "shardrun_tasks_in_flight") > 0 })
}

func TestKill9RunnerMidLoad(t *testing.T) {
	c, coord, _ := base(t, 3)
	load(c, coord, 1500, 300)
	victim := c.proc("runner-2")
	c.waitRunning(victim)
	moved := c.shardsOf("runner-2")
	pending := c.pending()
	killed := time.Now()
	victim.signal(t, syscall.SIGKILL)
	failover := c.waitFor(15*time.Second, "runner-2's shards owned again", func() bool { return c.ownedElsewhere(moved, "runner-2") })
	var firstDone time.Duration
	c.waitFor(15*time.Second, "a task of a moved shard completed elsewhere", func() bool {
		var at time.Time
		shardList := keys(moved)
		err := c.store.Pool().QueryRow(context.Background(), `SELECT coalesce(min(finished_at), 'epoch') FROM task_view
			WHERE shard = ANY($1) AND state = 'completed' AND claimed_by <> 'runner-2' AND finished_at > $2`, shardList, killed).Scan(&at)
		if err == nil && at.After(killed) {
			firstDone = at.Sub(killed)
			return true
		}
		return false
	})
	if failover > leaseTTL+time.Second {
		t.Errorf("failover took %s, want at most lease TTL + 1s (%s)", failover, leaseTTL+time.Second)
	}
	s := c.finish(60 * time.Second)
	c.report("kill -9 runner", s, fmt.Sprintf("%d tasks pending at the kill; failover %s (%d shards), first moved-shard task done %s after the kill",
		pending, failover.Round(time.Millisecond), len(moved), firstDone.Round(time.Millisecond)))
}

func TestSIGSTOPZombieIsFencedOut(t *testing.T) {
	t.Parallel()
	c, coord, _ := base(t, 3)
	load(c, coord, 1200, 400)
	zombie := c.proc("runner-2")
	c.waitRunning(zombie)
	moved := c.shardsOf("runner-2")
	stopped := time.Now()
	zombie.signal(t, syscall.SIGSTOP)
	takeover := c.waitFor(15*time.Second, "the zombie's shards owned by others", func() bool { return c.ownedElsewhere(moved, "runner-2") })
	time.Sleep(time.Second) // the zombie stays frozen past its lease; nothing to poll while it sleeps
	zombie.signal(t, syscall.SIGCONT)
	woke := time.Now()
	c.waitFor(10*time.Second, "the zombie detached after waking", func() bool {
		return !zombie.firstEventAfter("runner detached from cluster", stopped).IsZero()
	})
	c.waitFor(10*time.Second, "the zombie's late writes rejected", func() bool {
		return c.metric(zombie, "shardrun_fence_rejections_total") > 0 ||
			len(zombie.logEvents("outcome refused: shard fence moved on")) > 0
	})
	c.waitFor(20*time.Second, "the zombie re-attached and the cluster rebalanced", func() bool {
		return c.balanced("runner-1", "runner-2", "runner-3")
	})
	attached := zombie.firstEventAfter("runner re-attached to cluster", woke)
	if attached.IsZero() || attached.Sub(woke) < recoveryWindow {
		t.Errorf("the zombie re-attached %s after waking, want at least the recovery window %s", attached.Sub(woke), recoveryWindow)
	}
	s := c.finish(60 * time.Second)
	c.report("SIGSTOP zombie", s, fmt.Sprintf("takeover %s after SIGSTOP; zombie detached on wake, re-attached %s after SIGCONT",
		takeover.Round(time.Millisecond), attached.Sub(woke).Round(time.Millisecond)))
	if s.fenceRejections == 0 {
		t.Error("no fence rejection counted: the zombie's late completions were not refused")
	}
}

func TestBlackholedEtcdLinkDetachesBeforeTakeover(t *testing.T) {
	c, coord, _ := base(t, 3, "runner-2")
	load(c, coord, 1200, 300)
	victim := c.proc("runner-2")
	c.waitRunning(victim)
	moved := c.shardsOf("runner-2")
	cut := time.Now()
	victim.proxy.Blackhole()
	c.waitFor(15*time.Second, "runner-2's shards owned by others", func() bool { return c.ownedElsewhere(moved, "runner-2") })
	detached := victim.firstEventAfter("runner detached from cluster", cut)
	// The takeover's etcd event reaches the recording watch a moment after
	// the key is readable.
	var first etcdEvent
	c.waitFor(5*time.Second, "the takeover recorded", func() bool {
		var ok bool
		first, ok = c.firstAcquisitionAfter(cut, moved, "runner-2")
		return ok
	})
	if detached.IsZero() {
		t.Fatal("runner-2 never detached")
	}
	gap := first.at.Sub(detached)
	if gap <= 0 {
		t.Fatalf("runner-2 detached at %s, not before %s acquired shard %s at %s", detached.Format(time.StampMicro),
			first.value, fmt.Sprintf("%s/%d", first.group, first.shard), first.at.Format(time.StampMicro))
	}
	healed := time.Now()
	victim.proxy.Pass()
	c.waitFor(20*time.Second, "runner-2 back and balanced", func() bool { return c.balanced("runner-1", "runner-2", "runner-3") })
	attached := victim.firstEventAfter("runner re-attached to cluster", healed)
	if attached.IsZero() || attached.Sub(healed) < recoveryWindow {
		t.Errorf("re-attached %s after the heal, want at least the recovery window %s", attached.Sub(healed), recoveryWindow)
	}
	s := c.finish(60 * time.Second)
	c.report("blackholed etcd link", s, fmt.Sprintf("detached %s after the cut, first takeover %s later; re-attached %s after the heal",
		detached.Sub(cut).Round(time.Millisecond), gap.Round(time.Millisecond), attached.Sub(healed).Round(time.Millisecond)))
}

func TestScaleOutThenInWithSIGTERM(t *testing.T) {
	c, coord, names := base(t, 3)
	load(c, coord, 3000, 200)
	start := time.Now()
	for i := 4; i <= 6; i++ {
		name := fmt.Sprintf("runner-%d", i)
		c.startRunner(name, false)
		names = append(names, name)
	}
	out := c.waitFor(20*time.Second, "6-way balance", func() bool { return c.balanced(names...) })
	scaleOut := time.Since(start)
	pendingIn := c.pending()
	// Two at once, then one more.
	gone := []*proc{c.proc("runner-2"), c.proc("runner-5")}
	done := make(chan time.Duration, 2)
	for _, p := range gone {
		go func() { done <- p.terminateQuiet() }()
	}
	handoff := c.waitFor(10*time.Second, "4-way balance after two SIGTERMs", func() bool {
		return c.balanced("runner-1", "runner-3", "runner-4", "runner-6")
	})
	for range gone {
		if d := <-done; d < 0 {
			t.Fatal("a runner did not exit cleanly on SIGTERM")
		}
	}
	last := c.proc("runner-6")
	go func() { done <- last.terminateQuiet() }()
	handoff3 := c.waitFor(10*time.Second, "3-way balance", func() bool { return c.balanced("runner-1", "runner-3", "runner-4") })
	if d := <-done; d < 0 {
		t.Fatal("runner-6 did not exit cleanly on SIGTERM")
	}
	if handoff > 2*time.Second || handoff3 > 2*time.Second {
		t.Errorf("graceful handoffs took %s and %s; a drain hands over within the in-flight work's time", handoff, handoff3)
	}
	s := c.finish(60 * time.Second)
	c.report("scale 3->6->3", s, fmt.Sprintf("scale-out balanced in %s (%s after the last join); %d tasks pending at scale-in; 2 SIGTERMs handed over in %s, the 3rd in %s",
		scaleOut.Round(time.Millisecond), out.Round(time.Millisecond), pendingIn, handoff.Round(time.Millisecond), handoff3.Round(time.Millisecond)))
}

// terminateQuiet sends SIGTERM and returns how long the exit took, or -1 if
// the process did not exit cleanly within 30s.
func (p *proc) terminateQuiet() time.Duration {
	start := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return -1
	}
	select {
	case err := <-p.done:
		p.done <- err
		if err != nil {
			return -1
		}
		return time.Since(start)
	case <-time.After(30 * time.Second):
		return -1
	}
}

func TestManualDetachAndAttachThroughTheAdminEndpoint(t *testing.T) {
	t.Parallel()
	c, coord, _ := base(t, 3)
	load(c, coord, 1200, 300)
	r1 := c.proc("runner-1")
	c.waitRunning(r1)
	if code := httpCode(t, "POST", "http://"+r1.addr+"/admin/detach", ""); code != 401 {
		t.Fatalf("detach without the token: %d", code)
	}
	if code, body := testutil.HTTP(t, "POST", "http://"+r1.addr+"/admin/detach", adminToken, `{"reason": "integration"}`); code != 200 {
		t.Fatalf("detach: %d %s", code, body)
	}
	handoff := c.waitFor(10*time.Second, "others own every shard", func() bool { return c.balanced("runner-2", "runner-3") })
	c.waitFor(5*time.Second, "runner-1 idle", func() bool { return c.metric(r1, "shardrun_tasks_in_flight") == 0 })
	if code, body := testutil.HTTP(t, "POST", "http://"+r1.addr+"/admin/attach", adminToken, ""); code != 200 {
		t.Fatalf("attach: %d %s", code, body)
	}
	back := c.waitFor(15*time.Second, "runner-1 back", func() bool { return c.balanced("runner-1", "runner-2", "runner-3") })
	if back < recoveryWindow {
		t.Errorf("runner-1 was back %s after attach, inside its recovery window", back)
	}
	s := c.finish(60 * time.Second)
	c.report("manual detach/attach", s, fmt.Sprintf("others owned all shards %s after detach; back and balanced %s after attach",
		handoff.Round(time.Millisecond), back.Round(time.Millisecond)))
}

func TestKillTheLeaderCoordinator(t *testing.T) {
	c, coord1, _ := base(t, 3)
	c.waitFor(10*time.Second, "coord-1 leads", func() bool { return leads(t, coord1) })
	coord2 := c.startCoordinator("coord-2")
	load(c, coord1, 100, 50)
	// Stale claims of a runner that is gone: only a sweeping leader frees them.
	pgtest.InsertClaimed(t, c.store, `INSERT INTO tasks (kind, shard, key, max_attempts)
		SELECT 'noop', g % 64, 'orphan-' || g, 5 FROM generate_series(1, 50) g RETURNING id`, "ghost", 1, "now() - interval '1 minute'")
	rows, _ := c.store.Pool().Query(context.Background(), `SELECT id FROM task_view WHERE claimed_by = 'ghost'`)
	for rows.Next() {
		var id int64
		_ = rows.Scan(&id)
		c.mu.Lock()
		c.enqueued[id] = tasks.Completed
		c.mu.Unlock()
	}
	rows.Close()
	coord1.signal(t, syscall.SIGKILL)
	takeover := c.waitFor(3*electionTTL, "coord-2 leads", func() bool { return leads(t, coord2) })
	swept := c.waitFor(staleThreshold+10*time.Second, "coord-2 swept the stale claims", func() bool {
		return c.metric(coord2, "shardrun_sweep_released_total") >= 50
	})
	if takeover > electionTTL+time.Second {
		t.Errorf("the standby led %s after the leader died, want within the election TTL (%s) plus expiry slop", takeover, electionTTL)
	}
	s := c.finish(60 * time.Second)
	c.report("kill leader coordinator", s, fmt.Sprintf("standby led %s after kill -9 (election TTL %s); swept 50 stale claims %s later (grace %s)",
		takeover.Round(time.Millisecond), electionTTL, swept.Round(time.Millisecond), staleThreshold))
}

func leads(t *testing.T, coord *proc) bool {
	_, body := testutil.HTTP(t, "GET", "http://"+coord.addr+"/healthz", "", "")
	return strings.Contains(body, `"leader":true`)
}

func TestRestartPostgresMidLoad(t *testing.T) {
	c, coord, _ := base(t, 3)
	load(c, coord, 3000, 300)
	c.waitRunning(c.proc("runner-1"))
	srv := c.pgServer()
	pending := c.pending()
	restarted := time.Now()
	if err := srv.Restart(context.Background(), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	down := time.Since(restarted)
	recovered := c.waitFor(30*time.Second, "work resumes after the restart", func() bool {
		var n int
		err := c.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM task_view WHERE finished_at > $1`, time.Now().Add(-500*time.Millisecond)).Scan(&n)
		return err == nil && n > 0
	})
	s := c.finish(90 * time.Second)
	c.report("restart PostgreSQL", s, fmt.Sprintf("%d tasks pending at the restart; database down %s; tasks completing again %s after it was back",
		pending, down.Round(time.Millisecond), recovered.Round(time.Millisecond)))
}

func keys(m map[int]bool) []int32 {
	out := make([]int32, 0, len(m))
	for k := range m {
		out = append(out, int32(k))
	}
	return out
}
