package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/tasks"
)

// groupsSettled reports whether every capability group with an attached
// member has each of its shards owned by one of its members.
func (c *cluster) groupsSettled() bool {
	cl, err := shard.ReadCluster(context.Background(), c.cli, prefix, shards)
	if err != nil {
		return false
	}
	for _, g := range cl.Groups {
		for _, o := range g.Owners {
			if len(g.Members) > 0 && !slices.Contains(g.Members, o) {
				return false
			}
		}
	}
	return true
}

// waiting counts the ready and running tasks that match the SQL condition.
func (c *cluster) waiting(where string) int64 {
	c.t.Helper()
	var n int64
	if err := c.store.Pool().QueryRow(context.Background(),
		`SELECT count(*) FROM task_view WHERE state IN ('ready', 'running') AND `+where).Scan(&n); err != nil {
		c.t.Fatal(err)
	}
	return n
}

// TestMixedFleetRunsEveryTaskWhereItCan runs a fleet of three kinds of
// runner: two that serve the emails queue, one that serves the default
// queue with the noop and fail handlers, one that serves it with the
// sleep handler only. Every task must run, and only on a runner that
// serves its queue and handles its kind (finish checks it), sequences
// that mix kinds keep their order across the runners that run them, and
// the loss of the only runner of a kind (kill -9, then a detach through
// the admin endpoint) stops that kind's work alone, reported as
// unrunnable by the coordinator, until a runner of its kind attaches.
func TestMixedFleetRunsEveryTaskWhereItCan(t *testing.T) {
	c := newCluster(t)
	coord := c.startCoordinator("coord-1")
	c.startRunnerServing("emails-1", false, []string{"emails"}, builtinKinds)
	c.startRunnerServing("emails-2", false, []string{"emails"}, builtinKinds)
	cpu := c.startRunnerServing("cpu-1", false, []string{tasks.DefaultQueue}, []string{"fail", "noop"})
	gpu := c.startRunnerServing("gpu-1", false, []string{tasks.DefaultQueue}, []string{"sleep"})
	settled := c.waitFor(20*time.Second, "every group owns its shards", c.groupsSettled)

	// Sequences that alternate kinds: each step runs on the other group.
	const sequences, each = 20, 6
	var batch []map[string]any
	for i := range each {
		for s := range sequences {
			task := map[string]any{"kind": "noop", "sequence_key": fmt.Sprintf("mix-%d", s), "key": fmt.Sprintf("mix-%d-%d", s, i), "max_attempts": 10}
			if i%2 == 1 {
				task["kind"], task["payload"] = "sleep", json.RawMessage(`{"ms": 20}`)
			}
			batch = append(batch, task)
		}
	}
	body, _ := json.Marshal(batch)
	if code, resp := testutil.HTTP(t, "POST", "http://"+coord.addr+"/api/tasks", apiToken, string(body)); code != 201 {
		t.Fatalf("enqueue the sequences: %d %s", code, resp)
	}
	c.expectAll(`sequence_key IS NOT NULL`, tasks.Completed)
	emails := map[string]any{"queue": "emails", "max_attempts": 3}
	c.enqueueWith(coord, 400, "noop", "", emails, tasks.Completed)
	c.enqueueWith(coord, 100, "fail", `{"times": 1}`, emails, tasks.Completed)
	c.enqueue(coord, 300, "noop", "", 3, tasks.Completed)
	c.enqueue(coord, 300, "sleep", `{"ms": 20}`, 5, tasks.Completed)

	// The only runner of sleep dies: the sleeps wait, reported, and the
	// rest of the work goes on.
	c.waitRunning(gpu)
	gpu.signal(t, syscall.SIGKILL)
	unrunnable := `shardrun_unrunnable_tasks{kind="sleep",queue="default"}`
	reported := c.waitFor(leaseTTL+15*time.Second, "the coordinator reports the sleeps unrunnable", func() bool {
		return c.metric(coord, unrunnable) > 0
	})
	c.waitFor(60*time.Second, "every task another runner can run done", func() bool {
		return c.waiting(`sequence_key IS NULL AND NOT (queue = 'default' AND kind = 'sleep')`) == 0
	})
	code, resp := testutil.HTTP(t, "POST", "http://"+coord.addr+"/api/tasks", apiToken, `{"kind": "sleep", "payload": {"ms": 1}}`)
	if code != 201 || !strings.Contains(resp, "warnings") || !strings.Contains(resp, `\"sleep\"`) {
		t.Errorf("enqueue of a sleep with no sleep runner: %d %s; want 201 with a warning naming the kind", code, resp)
	}
	c.expectAll(`kind = 'sleep' AND sequence_key IS NULL`, tasks.Completed)
	if n := c.waiting(`kind = 'sleep'`); n == 0 {
		t.Fatal("no sleep waiting without a runner that handles it")
	}

	// A runner with the sleep handler rolls out: the sleeps run on it.
	c.startRunnerServing("gpu-2", false, []string{tasks.DefaultQueue}, []string{"sleep"})
	resumed := c.waitFor(60*time.Second, "the sleeps done on the new runner", func() bool {
		return c.waiting(`kind = 'sleep' AND sequence_key IS NULL`) == 0
	})

	// The only runner of noop and fail is detached by an operator: its
	// kinds wait, reported, until it attaches again.
	if code, body := testutil.HTTP(t, "POST", "http://"+cpu.addr+"/admin/detach", adminToken, `{"reason": "integration"}`); code != 200 {
		t.Fatalf("detach: %d %s", code, body)
	}
	c.enqueue(coord, 100, "noop", "", 3, tasks.Completed)
	c.waitFor(leaseTTL+15*time.Second, "the coordinator reports the noops unrunnable", func() bool {
		return c.metric(coord, `shardrun_unrunnable_tasks{kind="noop",queue="default"}`) > 0
	})
	if code, body := testutil.HTTP(t, "POST", "http://"+cpu.addr+"/admin/attach", adminToken, ""); code != 200 {
		t.Fatalf("attach: %d %s", code, body)
	}
	s := c.finish(90 * time.Second)
	if c.metric(coord, unrunnable) != 0 {
		t.Errorf("the unrunnable gauge still counts sleeps after they ran")
	}
	checked := c.checkSequenceOrder()
	if checked < sequences*(each-1) {
		t.Errorf("only %d successive steps of the sequences checked, want %d", checked, sequences*(each-1))
	}
	c.report("mixed fleet", s, fmt.Sprintf("3 groups settled in %s; sleep runner killed: reported unrunnable after %s, done %s after a new one started; %d sequence steps across kinds in order",
		settled.Round(time.Millisecond), reported.Round(time.Millisecond), resumed.Round(time.Millisecond), checked))
}

// expectAll marks every task matching the SQL condition as expected to end
// in state.
func (c *cluster) expectAll(where string, state tasks.State) {
	c.t.Helper()
	rows, err := c.store.Pool().Query(context.Background(), `SELECT id FROM task_view WHERE `+where)
	if err != nil {
		c.t.Fatal(err)
	}
	defer rows.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			c.t.Fatal(err)
		}
		c.enqueued[id] = state
	}
}

// checkSequenceOrder checks, from the database's own clock, that each
// task of a sequence was claimed for its last attempt only after the
// task before it (in enqueue order) finished, and returns how many
// successive pairs it checked.
func (c *cluster) checkSequenceOrder() int {
	c.t.Helper()
	rows, err := c.store.Pool().Query(context.Background(), `SELECT sequence_key, id, kind, claimed_by, claimed_at, finished_at
		FROM task_view WHERE sequence_key IS NOT NULL ORDER BY sequence_key, id`)
	if err != nil {
		c.t.Fatal(err)
	}
	defer rows.Close()
	type step struct {
		key, kind, by     string
		id                int64
		claimed, finished time.Time
	}
	var prev step
	checked := 0
	for rows.Next() {
		var cur step
		if err := rows.Scan(&cur.key, &cur.id, &cur.kind, &cur.by, &cur.claimed, &cur.finished); err != nil {
			c.t.Fatal(err)
		}
		if cur.key == prev.key {
			if cur.claimed.Before(prev.finished) {
				c.t.Errorf("sequence %s: task %d (%s on %s) claimed at %s, before task %d (%s on %s) finished at %s",
					cur.key, cur.id, cur.kind, cur.by, cur.claimed.Format(time.StampMicro), prev.id, prev.kind, prev.by, prev.finished.Format(time.StampMicro))
			}
			checked++
		}
		prev = cur
	}
	return checked
}

// TestKindRolledOutToOneRunnerThenAll rolls a new handler (sleep) out to a
// fleet of three runners one restart at a time, under load: the sleeps
// wait, reported, while no runner has the handler, run on the first runner
// that has it, survive that runner being frozen past its lease (SIGSTOP:
// the only runner of the kind), and run everywhere once all have it. No
// other task waits while the fleet changes groups.
func TestKindRolledOutToOneRunnerThenAll(t *testing.T) {
	t.Parallel()
	c := newCluster(t)
	coord := c.startCoordinator("coord-1")
	old, all := []string{"fail", "noop"}, []string{"fail", "noop", "sleep"}
	for _, name := range []string{"r1", "r2", "r3"} {
		c.startRunnerServing(name, false, []string{tasks.DefaultQueue}, old)
	}
	c.waitFor(20*time.Second, "the group owns its shards", c.groupsSettled)
	c.enqueue(coord, 300, "noop", "", 3, tasks.Completed)
	c.enqueue(coord, 200, "sleep", `{"ms": 100}`, 10, tasks.Completed)
	c.waitFor(20*time.Second, "the coordinator reports the sleeps unrunnable", func() bool {
		return c.metric(coord, `shardrun_unrunnable_tasks{kind="sleep",queue="default"}`) > 0
	})

	// To one runner: it alone runs the sleeps, and is frozen past its
	// lease while it does.
	c.proc("r1").terminate(t, 30*time.Second)
	first := c.startRunnerServing("r1-v2", false, []string{tasks.DefaultQueue}, all)
	c.waitRunning(first)
	c.enqueue(coord, 200, "noop", "", 3, tasks.Completed)
	// It runs sleeps before it is frozen: frozen at once, under a busy
	// machine's scheduling it could run none before the others had the
	// handler too, and the test would show nothing of the rollout.
	c.waitFor(20*time.Second, "the first runner with the handler running sleeps", func() bool {
		var n int
		err := c.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM task_view WHERE kind = 'sleep' AND state = 'completed' AND claimed_by = 'r1-v2'`).Scan(&n)
		return err == nil && n > 0
	})
	stopped := time.Now()
	first.signal(t, syscall.SIGSTOP)
	c.waitFor(3*leaseTTL, "the frozen runner's units freed", func() bool {
		cl, err := shard.ReadCluster(context.Background(), c.cli, prefix, shards)
		if err != nil {
			return false
		}
		for _, g := range cl.Groups {
			if g.Name == shard.GroupOf([]string{tasks.DefaultQueue}, all) {
				return !slices.Contains(g.Owners, "r1-v2")
			}
		}
		return true
	})
	first.signal(t, syscall.SIGCONT)
	c.waitFor(10*time.Second, "the frozen runner detached on waking", func() bool {
		return !first.firstEventAfter("runner detached from cluster", stopped).IsZero()
	})
	c.waitFor(60*time.Second, "the noops done while only one runner has the sleep handler", func() bool {
		return c.waiting(`kind = 'noop'`) == 0
	})

	// To the others, one at a time.
	for _, name := range []string{"r2", "r3"} {
		c.proc(name).terminate(t, 30*time.Second)
		c.startRunnerServing(name+"-v2", false, []string{tasks.DefaultQueue}, all)
		c.enqueue(coord, 100, "noop", "", 3, tasks.Completed)
		c.enqueue(coord, 100, "sleep", `{"ms": 20}`, 10, tasks.Completed)
	}
	c.waitFor(20*time.Second, "one group of three", func() bool {
		cl, err := shard.ReadCluster(context.Background(), c.cli, prefix, shards)
		return err == nil && len(cl.Groups) == 1 && len(cl.Groups[0].Members) == 3 && c.groupsSettled()
	})
	s := c.finish(90 * time.Second)
	ran := map[string]int{}
	rows, err := c.store.Pool().Query(context.Background(), `SELECT claimed_by, count(*) FROM task_view WHERE kind = 'sleep' GROUP BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var by string
		var n int
		if err := rows.Scan(&by, &n); err != nil {
			t.Fatal(err)
		}
		ran[by] = n
	}
	rows.Close()
	if ran["r1-v2"] == 0 || ran["r2-v2"]+ran["r3-v2"] == 0 {
		t.Errorf("sleeps completed per runner %v; want some on the first runner with the handler and some on the later ones", ran)
	}
	c.report("kind rolled out one runner at a time", s, fmt.Sprintf("sleeps completed per runner %v; the only sleep runner frozen past its lease", ran))
}
