package executor

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/tasks"
)

// blocking is a handler that runs until release is closed (and succeeds)
// or its context ends (and fails with it), recording which tasks it ran.
type blocking struct {
	release chan struct{}
	ran     sync.Map // task id → true
}

func newBlocking() *blocking { return &blocking{release: make(chan struct{})} }

func (b *blocking) handle(ctx context.Context, t *tasks.Task) error {
	b.ran.Store(t.ID, true)
	select {
	case <-b.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (b *blocking) started(id int64) bool { _, ok := b.ran.Load(id); return ok }

// oneWorkerOneAhead starts an executor of one worker with task 1 running
// on shard 0 and task 2, of shard shard2, waiting ahead; the fake clock
// moves by less than aheadPatience on the way.
func oneWorkerOneAhead(t *testing.T, b *blocking, shard2, maxAttempts int) *env {
	t.Helper()
	e := newEnv(t, map[string]tasks.Handler{"block": b.handle},
		func(c *Config) { c.MaxWorkers, c.Queues = 1, map[string]int{tasks.DefaultQueue: 1} })
	e.store.add(1, "block", 0, maxAttempts)
	e.own.own(0, 1)
	e.own.own(shard2, 1)
	e.run()
	e.untilWithin("task 1 running", 50*time.Millisecond, func() bool { return b.started(1) && e.exec.InFlight() == 1 })
	e.store.add(2, "block", shard2, maxAttempts)
	e.exec.Wake(true, nil, nil)
	e.untilWithin("task 2 waiting ahead", 50*time.Millisecond, func() bool { return e.exec.ahead.size() == 1 })
	return e
}

// Issue 39, defect 3. A shard moves as the real manager moves it: its term
// goes releasing, its context stays alive (its begun work runs on), and it
// is released once its work is done. A task waiting ahead on it goes back
// at the next claim round, with its attempt unspent, so the release does
// not wait for a worker to free up (nor for the handoff timeout). The
// executor's tests modelled a move as a context cancel, and missed it.
func TestAheadTaskGoesBackWhenItsUnitMoves(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := oneWorkerOneAhead(t, b, 1, 3)
	e.own.move(1)
	e.untilWithin("the task ahead given back and shard 1 released", 50*time.Millisecond, func() bool {
		return e.state(2) == tasks.Ready && !e.own.held(1)
	})
	if task := e.store.get(2); task.Attempt != 1 || len(task.Errors) != 0 || b.started(2) {
		t.Fatalf("the task given back: attempt %d, errors %+v, started %v; want attempt 1 unspent, no history, never started",
			task.Attempt, task.Errors, b.started(2))
	}
	if e.exec.InFlight() != 1 {
		t.Fatal("the handler on shard 0 returned: the release should not have needed a free worker")
	}
	close(b.release)
	e.until("task 1 completed", func() bool { return e.state(1) == tasks.Completed })
}

// Issue 39, defect 4. The lease clock passes its detach point (a runner
// woken from a pause, before its keep-alive loop noticed): nothing is
// cancelled yet, but no work may start. A handler returning then frees its
// slot; the task waiting ahead must not start on it: it goes back.
func TestAheadTaskDoesNotStartPastTheDetachPoint(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := oneWorkerOneAhead(t, b, 0, 3)
	e.own.pause()
	close(b.release) // task 1's handler returns: its slot is free
	e.untilWithin("the task ahead given back or started", 50*time.Millisecond, func() bool { return e.state(2) == tasks.Ready || b.started(2) })
	if b.started(2) {
		t.Fatal("a task waiting ahead started past the lease clock's detach point")
	}
	if task := e.store.get(2); task.Attempt != 1 {
		t.Fatalf("the task given back is at attempt %d, want 1", task.Attempt)
	}
}

// Issue 39, defect 5. A give-back that fails while the database is away is
// retried like an outcome, and the task's hold on its term ends only once
// it is written: the term is not released, and its next owner's orphan
// requeue does not find the claim (which would end a single-attempt task
// dead although its handler never ran).
func TestAGiveBackIsRetriedUntilWritten(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := oneWorkerOneAhead(t, b, 1, 1)
	e.store.failNext("unclaim", 2)
	e.own.move(1)
	e.untilWithin("the first give-back failed", 20*time.Millisecond, func() bool { return e.store.count("unclaim") >= 1 })
	if !e.own.held(1) {
		t.Fatal("the term was released before its give-back was written")
	}
	e.until("the task ahead given back", func() bool { return e.state(2) == tasks.Ready })
	if n := e.store.count("unclaim"); n != 3 {
		t.Fatalf("%d give-back statements, want the 2 that failed and 1 that landed", n)
	}
	if task := e.store.get(2); task.Attempt != 1 || task.State != tasks.Ready {
		t.Fatalf("task %+v: want ready at attempt 1", task)
	}
	e.until("shard 1 released after the write", func() bool { return !e.own.held(1) })
	close(b.release)
}

// Issue 39, defect 5, the store's half: the store knows which claims never
// started (Claim's startNow). A give-back that cannot be written before
// the next owner raises the fence leaves the claim to that owner's orphan
// requeue, which gives it back with its attempt unspent: a single-attempt
// task is ready, not dead.
func TestANeverStartedTaskSurvivesTheNextOwnersOrphanRequeue(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := oneWorkerOneAhead(t, b, 1, 1)
	e.store.failNext("unclaim", 1_000_000)
	e.own.move(1)
	e.untilWithin("the give-back is failing", 20*time.Millisecond, func() bool { return e.store.count("unclaim") >= 1 })
	o, err := e.store.RaiseFences(context.Background(), "runner-b", "", []claims.ShardEpoch{{Shard: 1, Epoch: 2}})
	if err != nil || o.Requeued != 1 || o.Dead != 0 {
		t.Fatalf("the next owner's raise: %+v, %v; want the claim requeued", o, err)
	}
	if task := e.store.get(2); task.State != tasks.Ready || task.Attempt != 1 {
		t.Fatalf("task %+v after the next owner's orphan requeue: want ready at attempt 1", task)
	}
	e.store.failNext("unclaim", 0)
	e.until("the give-back answered, shard 1 released", func() bool { return !e.own.held(1) })
	if lost := e.own.lostTerms(); len(lost) != 1 || lost[0] != (claims.ShardEpoch{Shard: 1, Epoch: 1}) {
		t.Fatalf("lost terms %v: the give-back refused by the new fence must report shard 1 epoch 1 lost", lost)
	}
	close(b.release)
}

// A detach ends every term: the task waiting ahead goes back at once, with
// its attempt unspent.
func TestAheadTaskGoesBackOnDetach(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := oneWorkerOneAhead(t, b, 1, 1)
	e.own.detach()
	e.untilWithin("the task ahead given back", 50*time.Millisecond, func() bool { return e.state(2) == tasks.Ready })
	if b.started(2) || e.store.get(2).Attempt != 1 {
		t.Fatalf("started %v, task %+v: want never started, attempt 1", b.started(2), e.store.get(2))
	}
	e.until("the running task interrupted", func() bool { return e.state(1) == tasks.Ready })
}

// Issue 39, defect 6. Tasks claimed ahead are bounded by the workers that
// free up soon, not by the queues served: one worker serving ten queues
// holds at most one task ahead in all (it held nine, one per other queue,
// each kept from idle runners of another group sharing their lanes).
func TestAheadIsBoundedByWorkersNotQueues(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	queues := map[string]int{}
	for i := range 10 {
		queues[fmt.Sprint("q", i)] = 1
	}
	e := newEnv(t, map[string]tasks.Handler{"block": b.handle}, func(c *Config) { c.MaxWorkers, c.Queues = 1, queues })
	id := int64(0)
	for q := range queues {
		for range 2 {
			id++
			e.store.add(id, "block", 0, 3)
			e.store.mu.Lock()
			e.store.tasks[id].Queue = q
			e.store.mu.Unlock()
		}
	}
	e.own.own(0, 1)
	e.run()
	e.until("one running", func() bool { return e.exec.InFlight() == 1 })
	for range 3 {
		e.poll()
		if n := e.exec.ahead.size(); n > 1 {
			t.Fatalf("%d tasks waiting ahead for one worker serving ten queues, want at most 1", n)
		}
	}
	close(b.release)
	e.until("all completed", func() bool {
		for i := int64(1); i <= id; i++ {
			if e.state(i) != tasks.Completed {
				return false
			}
		}
		return true
	})
}

// Issue 39, defect 6. A task that waited ahead much longer than expected
// (its worker's handler overran its queue's mean) goes back to its lane,
// where an idle runner of another group can take it, and its queue claims
// nothing ahead until one of its handlers returns.
func TestATaskWaitingAheadTooLongGoesBack(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := oneWorkerOneAhead(t, b, 0, 3)
	e.clock.Advance(aheadPatience)
	e.until("the task ahead given back", func() bool { return e.state(2) == tasks.Ready })
	for range 3 {
		e.poll()
		if e.state(2) != tasks.Ready || e.exec.ahead.size() != 0 {
			t.Fatal("the task given back was claimed ahead again while the estimate stays wrong")
		}
	}
	if task := e.store.get(2); task.Attempt != 1 || b.started(2) {
		t.Fatalf("task %+v: want attempt 1, never started", task)
	}
	close(b.release)
	e.until("both completed", func() bool { return e.state(1) == tasks.Completed && e.state(2) == tasks.Completed })
}

// The budget of tasks ahead: one per running handler expected to return
// within aheadCover, and for each queue no more than its slots free then.
func TestAheadRoom(t *testing.T) {
	t.Parallel()
	now := clock.NewFake().Now()
	type running struct {
		queue string
		ran   time.Duration
	}
	for _, c := range []struct {
		name     string
		max      int
		limits   map[string]int
		took     map[string]time.Duration
		running  []running
		waiting  map[string]int
		queue    string
		now, ahd int
	}{
		{name: "20 ms tasks: a task per busy worker", max: 4, limits: map[string]int{"a": 4}, took: map[string]time.Duration{"a": 20 * time.Millisecond},
			running: []running{{"a", 0}, {"a", 5 * time.Millisecond}, {"a", 15 * time.Millisecond}, {"a", 30 * time.Millisecond}},
			queue:   "a", now: 0, ahd: 4},
		{name: "a free slot starts now", max: 4, limits: map[string]int{"a": 4}, took: map[string]time.Duration{"a": 20 * time.Millisecond},
			running: []running{{"a", 0}, {"a", 0}, {"a", 0}},
			queue:   "a", now: 1, ahd: 3},
		{name: "10 s tasks: only those in their last 40 ms", max: 4, limits: map[string]int{"a": 4}, took: map[string]time.Duration{"a": 10 * time.Second},
			running: []running{{"a", time.Second}, {"a", 5 * time.Second}, {"a", 9970 * time.Millisecond}, {"a", 11 * time.Second}},
			queue:   "a", now: 0, ahd: 2},
		{name: "unknown length: one in all", max: 4, limits: map[string]int{"a": 4},
			running: []running{{"a", 0}, {"a", 0}, {"a", 0}, {"a", 0}},
			queue:   "a", now: 0, ahd: 1},
		{name: "topped up at half", max: 4, limits: map[string]int{"a": 4}, took: map[string]time.Duration{"a": time.Millisecond},
			running: []running{{"a", 0}, {"a", 0}, {"a", 0}, {"a", 0}}, waiting: map[string]int{"a": 3},
			queue: "a", now: 0, ahd: 0},
		{name: "half left", max: 4, limits: map[string]int{"a": 4}, took: map[string]time.Duration{"a": time.Millisecond},
			running: []running{{"a", 0}, {"a", 0}, {"a", 0}, {"a", 0}}, waiting: map[string]int{"a": 2},
			queue: "a", now: 0, ahd: 2},
		{name: "one worker, ten queues: one ahead in all", max: 1, limits: map[string]int{"a": 1, "b": 1, "c": 1}, took: map[string]time.Duration{"a": time.Millisecond},
			running: []running{{"a", 0}}, queue: "b", now: 0, ahd: 1},
		{name: "one worker, ten queues: and no more", max: 1, limits: map[string]int{"a": 1, "b": 1, "c": 1}, took: map[string]time.Duration{"a": time.Millisecond},
			running: []running{{"a", 0}}, waiting: map[string]int{"b": 1}, queue: "c", now: 0, ahd: 0},
		{name: "a queue at its limit waits for its own workers only", max: 4, limits: map[string]int{"a": 1, "b": 4}, took: map[string]time.Duration{"a": time.Hour, "b": time.Millisecond},
			running: []running{{"a", 0}, {"b", 0}, {"b", 0}, {"b", 0}}, queue: "a", now: 0, ahd: 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPool(NewRegistry(), c.max, c.limits, nil, time.Second, clock.NewFake(), NewMetrics(nil), nil)
			for i, r := range c.running {
				ref := claims.Ref{ID: int64(i + 1)}
				a := &attempt{task: tasks.Task{ID: ref.ID, Queue: r.queue}, started: now.Add(-r.ran)}
				p.attempts[ref], p.live[ref] = a, a
				p.taken++
				p.byQueue[r.queue]++
				p.handlers[r.queue]++
			}
			for q, d := range c.took {
				p.took[q] = d
			}
			a := newAhead(p, func(int, int64) bool { return true }, func(...result) {}, clock.NewFake(), hclog.NewNullLogger())
			for q, n := range c.waiting {
				for range n {
					a.list = append(a.list, &waiting{task: tasks.Task{Queue: q}})
					a.byQueue[q]++
				}
			}
			gotNow, gotAhead := a.room(c.queue, p.soon(now, aheadCover))
			if gotNow != c.now || gotAhead != c.ahd {
				t.Fatalf("room(%s) = %d now, %d ahead; want %d, %d", c.queue, gotNow, gotAhead, c.now, c.ahd)
			}
		})
	}
}

// Review of issue 39: a claim whose term stopped taking work between the
// claim and the start (Begin refused) is given back through the writer;
// its term stays held until that give-back is written, so the next owner
// does not requeue (and spend) an attempt whose handler never ran. Before,
// the round's hold ended with the round, and a give-back that failed once
// left the term free: the next owner buried a single-attempt task unrun.
func TestAGiveBackOfAClaimThatCouldNotStartKeepsItsTerm(t *testing.T) {
	t.Parallel()
	b := newBlocking()
	e := newEnv(t, map[string]tasks.Handler{"block": b.handle})
	e.store.add(1, "block", 1, 1)
	e.own.own(1, 1)
	e.own.mu.Lock()
	e.own.refuseBegin = true
	e.own.mu.Unlock()
	e.store.failNext("unclaim", 3)
	e.run()
	e.untilWithin("the give-back failing", 50*time.Millisecond, func() bool { return e.store.count("unclaim") >= 1 })
	e.own.move(1)
	e.untilWithin("the give-back retried", 50*time.Millisecond, func() bool { return e.store.count("unclaim") >= 2 })
	if !e.own.held(1) && e.state(1) != tasks.Ready {
		t.Fatal("shard 1 was released while the give-back of its claim was still on the way")
	}
	e.until("the task given back, shard 1 released", func() bool { return e.state(1) == tasks.Ready && !e.own.held(1) })
	if task := e.store.get(1); task.Attempt != 1 || b.started(1) {
		t.Fatalf("task %+v, started %v: want ready at attempt 1, never started", task, b.started(1))
	}
	close(b.release)
}
