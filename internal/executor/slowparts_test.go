package executor

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// beatsOf counts the heartbeats that landed for task id.
func (s *fakeStore) beatsOf(id int64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, r := range s.beats {
		if r.ID == id {
			n++
		}
	}
	return n
}

// Issue 39, defect 7. A handler completes its task in its own transaction
// (CompleteTx) and returns before that transaction commits: the runner's
// completion finds the claim held and is answered Busy. The other outcomes
// of the batch land at once; the busy one is written again later, its
// attempt stays in the heartbeat set meanwhile (beaten when it can be,
// never taken back), the heartbeats of the runner's other attempts go on,
// and the term's hold ends only once the completion is written. It was
// dropped as "moved on", its hold ended, and the claim was left to go
// stale.
func TestABusyOutcomeIsWrittenAgainLater(t *testing.T) {
	t.Parallel()
	commits := make(chan func(), 1)
	var e *env
	b := newBlocking()
	e = newEnv(t, map[string]tasks.Handler{
		"tx": func(_ context.Context, task *tasks.Task) error {
			commit, err := e.store.completeInTx(claims.RefOf(*task), json.RawMessage(`{"by":"tx"}`))
			if err != nil {
				return err
			}
			commits <- commit // left open: the test commits it
			return nil
		},
		"noop":  noop,
		"block": b.handle,
	}, func(c *Config) { c.HeartbeatInterval = 50 * time.Millisecond })
	e.store.add(1, "block", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("the blocking task running", func() bool { return e.exec.InFlight() == 1 })
	e.store.add(2, "tx", 0, 3)
	e.store.add(3, "noop", 0, 3)
	e.exec.Wake(true, nil, nil)
	var commit func()
	e.until("the handler's transaction open", func() bool {
		select {
		case commit = <-commits:
			return true
		default:
			return false
		}
	})
	e.until("the other outcome written, the busy one answered Busy", func() bool {
		return e.state(3) == tasks.Completed && e.store.count("complete busy") >= 1
	})
	ref := claims.RefOf(e.store.get(2))
	if !slices.Contains(e.exec.pool.refs(), ref) {
		t.Fatal("the attempt whose completion was Busy left the heartbeat set: its claim would go stale")
	}
	e.until("the busy completion written again", func() bool { return e.store.count("complete busy") >= 2 })
	if e.state(2) != tasks.Running {
		t.Fatalf("task 2 is %s while its handler's transaction is open, want running", e.state(2))
	}
	beats := e.store.beatsOf(1)
	e.until("the other attempts beaten meanwhile", func() bool { return e.store.beatsOf(1) >= beats+2 })
	if e.exec.InFlight() != 1 || e.state(1) != tasks.Running {
		t.Fatal("the blocking task's handler was cancelled")
	}
	commit()
	e.until("completed with the handler's own result", func() bool { return e.state(2) == tasks.Completed })
	if got := e.store.get(2); string(got.Result) != `{"by":"tx"}` || len(got.Errors) != 0 {
		t.Fatalf("task %+v: want the result of the handler's transaction", got)
	}
	e.until("the attempt left the heartbeat set once written", func() bool { return !slices.Contains(e.exec.pool.refs(), ref) })
	close(b.release)
}

// A heartbeat answered Busy (the claim held by a handler's transaction
// still open) neither beats nor takes back the attempt: its handler runs
// on and its outcome is written once the transaction ends.
func TestABusyHeartbeatTakesNothingBack(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := newEnv(t, map[string]tasks.Handler{"block": b.handle}, func(c *Config) { c.HeartbeatInterval = 20 * time.Millisecond })
	e.store.add(1, "block", 0, 3)
	e.store.add(2, "block", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("both running", func() bool { return e.exec.InFlight() == 2 })
	unlock := e.store.lockClaim(1)
	n := e.store.count("heartbeat")
	beats := e.store.beatsOf(2)
	e.until("beaten three times more", func() bool { return e.store.count("heartbeat") >= n+3 })
	if e.store.beatsOf(2) < beats+3 {
		t.Fatal("the other attempt was not beaten while one claim was held")
	}
	if e.exec.InFlight() != 2 {
		t.Fatal("a handler was cancelled: a Busy heartbeat was taken for a lost claim")
	}
	unlock()
	close(b.release)
	e.until("both completed", func() bool { return e.state(1) == tasks.Completed && e.state(2) == tasks.Completed })
}

// Issue 39, defect 7, second half. A sweep requeued a task whose handler
// still runs here (its heartbeats could not be written), and the same
// runner claims it again: the new attempt does not start until the old
// handler returned. It started at once, and the task ran twice at the same
// time on one runner.
func TestASweptTaskDoesNotStartTwiceOnOneRunner(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var mu sync.Mutex
	running, most := 0, 0
	var attempts []int
	e := newEnv(t, map[string]tasks.Handler{"slow": func(_ context.Context, task *tasks.Task) error {
		mu.Lock()
		running++
		most = max(most, running)
		attempts = append(attempts, task.Attempt)
		mu.Unlock()
		if task.Attempt == 1 {
			<-release // ignores its cancellation
		}
		mu.Lock()
		running--
		mu.Unlock()
		return nil
	}}, func(c *Config) { c.MaxWorkers, c.Queues = 2, map[string]int{tasks.DefaultQueue: 2} })
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("attempt 1 running", func() bool { return e.exec.InFlight() == 1 })
	if !e.store.sweepStale(1) {
		t.Fatal("the sweep did not requeue the task")
	}
	e.exec.Wake(true, nil, nil)
	e.until("attempt 2 claimed by the same runner", func() bool {
		task := e.store.get(1)
		return task.State == tasks.Running && task.Attempt == 2
	})
	mu.Lock()
	twice := most > 1
	mu.Unlock()
	if twice {
		t.Fatal("attempt 2 started while attempt 1's handler still ran on the same runner")
	}
	close(release)
	e.until("completed", func() bool { return e.state(1) == tasks.Completed })
	mu.Lock()
	defer mu.Unlock()
	if most != 1 || len(attempts) != 2 || attempts[1] != 2 {
		t.Fatalf("at most %d handlers of the task at once, attempts run %v; want 1 at a time, attempts [1 2]", most, attempts)
	}
}

// Issue 39, defect 8. A fence raise that fails (here: the database refuses
// it; before, it waited on a claim row a handler's transaction held, and
// timed out every 10 s) does not stop claims on the shards fenced already:
// the round goes on without the new shards, and the raise is tried again
// later.
func TestClaimsGoOnOnFencedShardsWhileARaiseFails(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	e.own.own(0, 1)
	e.run()
	e.until("shard 0 held", func() bool { return e.exec.claimer.heldCount() == 1 })
	e.store.failNext("raise", 1_000_000)
	e.own.own(1, 1)
	e.store.add(1, "noop", 0, 3)
	e.store.add(2, "noop", 1, 3)
	e.exec.Wake(true, nil, nil)
	e.until("the task of the fenced shard completed", func() bool { return e.state(1) == tasks.Completed })
	e.until("the raise tried again", func() bool { return e.store.count("raise") >= 4 })
	if e.state(2) != tasks.Ready {
		t.Fatal("claimed from a shard whose fence is not raised")
	}
	e.store.failNext("raise", 0)
	e.until("the other task completed once its fence is raised", func() bool { return e.state(2) == tasks.Completed })
}

// Issue 39, defect 8. An earlier owner's claim is held by its handler's
// transaction when the new owner raises the fence: the raise skips it and
// names the term pending. The new owner claims from the term meanwhile
// (the held claim is in no lane), requeues the pending orphans at most
// once per poll interval, and gets the orphan once the transaction ends.
func TestPendingOrphansAreRequeuedByLaterRounds(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	e.store.add(1, "noop", 0, 2)
	e.store.setFence(0, 1, "runner-b")
	e.store.mu.Lock()
	e.store.tasks[1].State, e.store.tasks[1].ClaimedBy, e.store.tasks[1].Epoch = tasks.Running, "runner-b", 1
	e.store.mu.Unlock()
	unlock := e.store.lockClaim(1)
	e.store.add(2, "noop", 0, 3)
	e.own.own(0, 2)
	e.run()
	e.until("the other task of the term completed meanwhile", func() bool { return e.state(2) == tasks.Completed })
	start, before := e.clock.Now(), e.store.count("requeue_orphans")
	for range 5 {
		e.poll()
	}
	// At most once per interval: a window of k whole intervals holds at
	// most k+1 (one at each end).
	polls := int(e.clock.Now().Sub(start) / e.exec.cfg.PollInterval)
	if n := e.store.count("requeue_orphans"); n < 1 || n-before > polls+1 {
		t.Fatalf("%d orphan requeues in all, %d over %d poll intervals, want 1 or more and at most %d", n, n-before, polls, polls+1)
	}
	if task := e.store.get(1); task.State != tasks.Running || task.ClaimedBy != "runner-b" {
		t.Fatalf("the held orphan changed: %+v", task)
	}
	unlock()
	e.until("the orphan requeued and run here", func() bool { return e.state(1) == tasks.Completed })
	if got := e.store.get(1); got.Epoch != 2 || got.Attempt != 2 {
		t.Fatalf("task %+v: want completed under epoch 2 at attempt 2 (the orphaned attempt spent)", got)
	}
	n := e.store.count("requeue_orphans")
	for range 3 {
		e.poll()
	}
	if e.store.count("requeue_orphans") != n {
		t.Fatal("orphans requeued again after none was pending")
	}
}

// A beat leaves out the attempts whose handler returned within the last
// heartbeat interval: their outcomes are on their way, and a busy
// runner's beat of them was mostly of claims completed by the time it
// ran (issue 41). An attempt whose outcome has waited longer (its claim
// held by another transaction, so its completion is answered Busy) is
// beaten again, so that its claim does not look stale.
func TestABeatLeavesOutOutcomesOnTheirWay(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop, "block": b.handle})
	e.store.add(2, "block", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("task 2's first beat", func() bool { return e.store.beatsOf(2) > 0 })
	// Task 1's handler returns within the interval before the next beat.
	e.clock.Advance(100 * time.Millisecond)
	e.store.add(1, "noop", 0, 3)
	unlock := e.store.lockClaim(1)
	e.exec.Wake(true, nil, nil)
	e.untilWithin("task 1's completion answered busy", 200*time.Millisecond, func() bool { return e.store.count("complete busy") > 0 })
	e.untilWithin("the next beat", time.Second, func() bool { return e.store.beatsOf(2) > 1 })
	if n := e.store.count("heartbeat busy"); n != 0 {
		t.Fatalf("the beat within an interval of task 1's return beat its claim (%d busy answers)", n)
	}
	e.until("a later beat of task 1's claim", func() bool { return e.store.count("heartbeat busy") > 0 })
	unlock()
	close(b.release)
	e.until("both completed", func() bool { return e.state(1) == tasks.Completed && e.state(2) == tasks.Completed })
}
