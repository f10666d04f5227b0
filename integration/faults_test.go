package integration

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

// The scenarios here check that faults cost neither work nor availability:
// a routine etcd leader change detaches nobody, a database outage throws no
// finished work away and recovery does not grow with it, a runner waking
// from a pause starts nothing, and an interrupted attempt is not spent.

// ridable is the longest etcd election a runner must ride out with the
// scenarios' lease (TTL 2s, margin TTL/3, keep-alive interval TTL/8): the
// lease's slack (TTL − margin) less one keep-alive interval (the time since
// the last success when the leader dies) and about 150ms for the new leader
// to serve lease renewals.
const ridable = leaseTTL - leaseTTL/3 - leaseTTL/8 - 150*time.Millisecond

// TestEtcdLeaderKilledUnderLoad kills the leader of a 3-member etcd
// cluster of separate processes (heartbeat 50ms, election timeout 500ms)
// under load, several times, and requires that no runner detaches when the
// election was shorter than ridable: a keep-alive that fails or stalls
// during the election is retried within the lease's slack.
// SHARDRUN_LEADER_KILLS sets the number of kills (default 4).
func TestEtcdLeaderKilledUnderLoad(t *testing.T) {
	kills := 4
	if v, err := strconv.Atoi(os.Getenv("SHARDRUN_LEADER_KILLS")); err == nil && v > 0 {
		kills = v
	}
	ec := startEtcdCluster(t, 3)
	c := newClusterOn(t, ec.endpoints(), testutil.Client(t, ec.endpoints()...))
	coord := c.startCoordinator("coord-1")
	names := []string{"runner-1", "runner-2", "runner-3"}
	for _, n := range names {
		c.startRunner(n, false)
	}
	c.waitFor(20*time.Second, "balanced", func() bool { return c.balanced(names...) })
	var elections []time.Duration
	detaches, unexpected := 0, 0
	for i := range kills {
		load(c, coord, 400, 200)
		c.waitRunning(c.proc("runner-1"))
		leader := ec.leader()
		if leader == nil {
			t.Fatal("no etcd leader before the kill")
		}
		killed := time.Now()
		ec.kill(leader)
		election := c.waitFor(10*time.Second, "a new etcd leader", func() bool { return ec.leader() != nil })
		elections = append(elections, election)
		ec.restart(leader)
		c.waitFor(20*time.Second, "the killed member back", func() bool { return ec.healthy(leader) })
		var detached []string
		for _, n := range names {
			if at := c.proc(n).firstEventAfter("runner detached from cluster", killed); !at.IsZero() && at.Before(killed.Add(leaseTTL+election)) {
				detached = append(detached, n)
			}
		}
		detaches += len(detached)
		t.Logf("kill %d: %s was leader; new leader %s after the kill; detached: %v", i+1, leader.name, election.Round(time.Millisecond), detached)
		if len(detached) > 0 && election < ridable {
			unexpected += len(detached)
			t.Errorf("kill %d: %v detached although the election took %s, less than the %s a runner must ride out", i+1, detached, election.Round(time.Millisecond), ridable)
		}
		c.waitFor(20*time.Second, "balanced again", func() bool { return c.balanced(names...) })
	}
	retries := 0
	for _, n := range names {
		retries += len(c.proc(n).logEvents("lease keep-alive succeeded after retries"))
	}
	s := c.finish(90 * time.Second)
	var longest time.Duration
	for _, e := range elections {
		longest = max(longest, e)
	}
	c.report("etcd leader killed", s, fmt.Sprintf("%d leader kills under load: new leader within %s (longest); %d runner detaches (%d with an election under %s); %d keep-alive rounds needed retries",
		kills, longest.Round(time.Millisecond), detaches, unexpected, ridable, retries))
}

// TestPostgresOutageCostsNoWork restarts PostgreSQL with 4s down while
// tasks run and finish: no finished work is thrown away (no attempt is
// swept as stale, successes land even past their deadline), and the first
// task starts within half a second of the database accepting connections.
func TestPostgresOutageCostsNoWork(t *testing.T) {
	c, coord, _ := base(t, 3)
	srv := c.pgServer()
	// Tasks that finish during the outage, some with a deadline that
	// passes before the database is back.
	c.enqueue(coord, 90, "sleep", `{"ms": 1000}`, 5, tasks.Completed)
	deadline := time.Now().Add(3 * time.Second).UTC().Format(time.RFC3339Nano)
	c.enqueueWith(coord, 30, "sleep", `{"ms": 1000}`, map[string]any{"deadline": deadline}, tasks.Completed)
	// Every one of them running before the outage: a task that starts only
	// after it is rightly past its deadline.
	c.waitFor(10*time.Second, "the tasks running", func() bool { return c.counts()[tasks.Running] == 120 })
	down := time.Now()
	if err := srv.Restart(context.Background(), 4*time.Second); err != nil {
		t.Fatal(err)
	}
	outage := time.Since(down)
	// Work that waits for the database to come back.
	c.enqueue(coord, 300, "noop", "", 5, tasks.Completed)
	var firstClaim time.Duration
	c.waitFor(30*time.Second, "a task claimed after the restart", func() bool {
		var ms *float64
		err := c.store.Pool().QueryRow(context.Background(), `SELECT extract(epoch FROM min(claimed_at) - pg_postmaster_start_time()) * 1000
			FROM task_view WHERE claimed_at > pg_postmaster_start_time()`).Scan(&ms)
		if err != nil || ms == nil {
			return false
		}
		firstClaim = time.Duration(*ms * float64(time.Millisecond))
		return true
	})
	s := c.finish(90 * time.Second)
	var stale, lateDeadline int
	if err := c.store.Pool().QueryRow(context.Background(), `SELECT
		(SELECT count(*) FROM task_view, jsonb_array_elements(errors) e WHERE e->>'error' LIKE 'stale claim%'),
		(SELECT count(*) FROM task_view WHERE deadline IS NOT NULL AND state <> 'completed')`).Scan(&stale, &lateDeadline); err != nil {
		t.Fatal(err)
	}
	if stale > 0 {
		t.Errorf("%d attempts were swept as stale after the outage: finished work was thrown away", stale)
	}
	if lateDeadline > 0 {
		t.Errorf("%d tasks that succeeded before their deadline were not recorded completed", lateDeadline)
	}
	// The order of events, not their times (how soon the first task starts
	// is make bench's outage row): the outcomes of the tasks that finished
	// while the database was down were written once it was back, and the
	// first claim came after it was back.
	var early int
	if err := c.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM task_view
		WHERE kind = 'sleep' AND (finished_at IS NULL OR finished_at < pg_postmaster_start_time())`).Scan(&early); err != nil {
		t.Fatal(err)
	}
	if early > 0 {
		t.Errorf("%d outcomes of the tasks running through the outage were not written after the database was back", early)
	}
	if firstClaim < 0 {
		t.Errorf("a task was claimed %s before the database started", -firstClaim)
	}
	c.report("PostgreSQL down 4s", s, fmt.Sprintf("outage %s with 120 tasks finishing during it: none swept stale, all completed; first task claimed %s after the database started",
		outage.Round(time.Millisecond), firstClaim.Round(time.Millisecond)))
}

// TestPausedRunnerStartsNoWorkOnWaking stops a runner for longer than its
// lease's detach point (but about its TTL, so that nobody may have taken
// its shards yet) while ready work waits on its shards: on waking it must
// start nothing before it has re-attached, because claims check the lease
// clock, not only the detach flag.
func TestPausedRunnerStartsNoWorkOnWaking(t *testing.T) {
	t.Parallel()
	c, coord, _ := base(t, 3)
	zombie := c.proc("runner-2")
	zombie.signal(t, syscall.SIGSTOP)
	stopped := time.Now()
	c.enqueue(coord, 600, "noop", "", 5, tasks.Completed)
	if wait := 1500*time.Millisecond - time.Since(stopped); wait > 0 {
		time.Sleep(wait) // the pause itself: nothing to poll while the process is frozen
	}
	zombie.signal(t, syscall.SIGCONT)
	woke := time.Now()
	c.waitFor(10*time.Second, "the runner detached on waking", func() bool {
		return !zombie.firstEventAfter("runner detached from cluster", stopped).IsZero()
	})
	var back time.Time
	c.waitFor(30*time.Second, "the runner re-attached", func() bool {
		back = zombie.firstEventAfter("runner re-attached to cluster", woke)
		return !back.IsZero()
	})
	c.waitFor(30*time.Second, "balanced again", func() bool { return c.balanced("runner-1", "runner-2", "runner-3") })
	var started int
	if err := c.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM task_view
		WHERE claimed_by = 'runner-2' AND claimed_at > $1 AND claimed_at < $2`, woke, back).Scan(&started); err != nil {
		t.Fatal(err)
	}
	if started > 0 {
		t.Errorf("the runner claimed %d tasks between waking and re-attaching: claims must check the lease clock", started)
	}
	s := c.finish(60 * time.Second)
	c.report("SIGSTOP 1.5s", s, fmt.Sprintf("no task started between SIGCONT and re-attaching (%s later)", back.Sub(woke).Round(time.Millisecond)))
}

// TestDetachInterruptsWithoutSpendingAttempts detaches a runner while it
// runs tasks that have a single attempt: they are interrupted, go back to
// ready without spending the attempt, and complete elsewhere.
func TestDetachInterruptsWithoutSpendingAttempts(t *testing.T) {
	t.Parallel()
	c, coord, _ := base(t, 3)
	c.enqueue(coord, 150, "sleep", `{"ms": 3000}`, 1, tasks.Completed)
	r1 := c.proc("runner-1")
	c.waitRunning(r1)
	c.waitFor(10*time.Second, "runner-1 busy", func() bool { return c.metric(r1, "shardrun_tasks_in_flight") >= 20 })
	if code, body := testutil.HTTP(t, "POST", "http://"+r1.addr+"/admin/detach", adminToken, `{"reason": "interrupt test"}`); code != 200 {
		t.Fatalf("detach: %d %s", code, body)
	}
	c.waitFor(10*time.Second, "runner-1's attempts interrupted", func() bool {
		return c.metric(r1, `shardrun_tasks_finished_total{kind="sleep",outcome="interrupted"}`) > 0
	})
	interrupted := c.metric(r1, `shardrun_tasks_finished_total{kind="sleep",outcome="interrupted"}`)
	s := c.finish(60 * time.Second)
	var recorded int
	if err := c.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM task_view, jsonb_array_elements(errors) e
		WHERE (e->>'interrupted')::boolean AND state = 'completed'`).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if recorded == 0 || float64(recorded) < interrupted {
		t.Errorf("%v attempts interrupted, %d interruptions in completed tasks' histories", interrupted, recorded)
	}
	c.report("detach, max_attempts 1", s, fmt.Sprintf("%.0f running attempts interrupted by the detach; all completed elsewhere, none dead", interrupted))
}
