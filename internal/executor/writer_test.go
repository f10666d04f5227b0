package executor

// The outcome writer with one database unreachable (issue 40; issue 39's
// class "one slow part must not stall the others"): the router answers
// every write of that database's claims Busy, and the writer keeps those
// outcomes to write again later. Their number must not make the writer's
// rounds dearer, nor hold back the other databases' outcomes.

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/tasks"
)

// downShard is the shard whose database downStore cannot reach.
const downShard = 1

// downStore answers completions as the router does with shard downShard's
// database unreachable: that shard's items Busy, the others' applied. It
// counts the statements that named the down shard and the writes of each
// task.
type downStore struct {
	*fakeStore
	mu         sync.Mutex
	down       bool
	downStmts  int             // statements naming an item of downShard
	downItems  int             // items of downShard answered Busy
	written    map[int64]int   // applied completions per task
	statements map[int64][]int // statement numbers that named each task
	n          int
}

func newDownStore() *downStore {
	return &downStore{fakeStore: newFakeStore(), down: true, written: map[int64]int{}, statements: map[int64][]int{}}
}

func (s *downStore) Complete(_ context.Context, _ string, done []claims.Completion) ([]claims.WriteResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	out := make([]claims.WriteResult, len(done))
	named := false
	for i, d := range done {
		out[i].Ref = d.Ref
		s.statements[d.Ref.ID] = append(s.statements[d.Ref.ID], s.n)
		if d.Ref.Shard == downShard && s.down {
			named = true
			s.downItems++
			out[i].Outcome = claims.Busy
			continue
		}
		s.written[d.Ref.ID]++
		out[i].Outcome, out[i].State = claims.Applied, tasks.Completed
	}
	if named {
		s.downStmts++
	}
	return out, nil
}

func (s *downStore) counts() (stmts, items int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.downStmts, s.downItems
}

func (s *downStore) timesWritten(id int64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.written[id]
}

// writerEnv is one writer running over a downStore on a fake clock.
type writerEnv struct {
	t     testing.TB
	store *downStore
	clock *clock.Fake
	w     *writer
	in    chan result
	mu    sync.Mutex
	done  map[int64]int // done calls per task
	stop  func()
}

func newWriterEnv(t testing.TB, delay time.Duration) *writerEnv {
	e := &writerEnv{t: t, store: newDownStore(), clock: clock.NewFake(), in: make(chan result), done: map[int64]int{}}
	e.w = &writer{store: e.store, owner: me, own: newFakeOwnership(), in: e.in, delay: delay, clock: e.clock,
		log: hclog.NewNullLogger(), m: NewMetrics(nil), wake: wake.New()}
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan struct{})
	go func() { defer close(ended); e.w.Run(ctx) }()
	e.stop = func() {
		cancel()
		e.store.mu.Lock()
		e.store.down = false
		e.store.mu.Unlock()
		if !settle(e.clock.Advance, func() bool {
			select {
			case <-ended:
				return true
			default:
				return false
			}
		}) {
			t.Fatal("the writer did not return after its context ended")
		}
	}
	t.Cleanup(e.stop)
	return e
}

// send hands the writer the completion of task id on shard; it returns
// once the writer has taken it.
func (e *writerEnv) send(id int64, shard int) {
	e.t.Helper()
	e.in <- result{task: tasks.Task{ID: id, Shard: shard, Epoch: 1, Attempt: 1, Kind: "noop"}, done: func() {
		e.mu.Lock()
		e.done[id]++
		e.mu.Unlock()
	}}
}

func (e *writerEnv) doneOf(id int64) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.done[id]
}

// sendDown sends the completion of task id on downShard and waits until
// the writer's round has written it (Busy) and ended.
func (e *writerEnv) sendDown(id int64) {
	e.t.Helper()
	_, before := e.store.counts()
	e.send(id, downShard)
	e.poll("the down database's outcome written", func() bool { _, n := e.store.counts(); return n > before })
	e.idle()
}

// sendHealthy sends the completion of task id on a healthy shard and
// waits, without moving the clock, until it is written and ended: in the
// round it arrived in.
func (e *writerEnv) sendHealthy(id int64) {
	e.t.Helper()
	e.send(id, 0)
	e.poll(fmt.Sprintf("healthy outcome %d written without a move of the clock", id), func() bool { return e.doneOf(id) > 0 })
	e.idle()
}

// poll waits for cond, polling with a real-time deadline.
func (e *writerEnv) poll(what string, cond func() bool) {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("not within 10s: %s", what)
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// idle waits until the writer is back at its select with its timer armed
// (it always is here: outcomes wait for a retry): the round the last clock
// move or outcome started is over. Callers make sure that round started
// (a fired timer leaves the clock's list at once; a received outcome is
// seen written).
func (e *writerEnv) idle() {
	e.t.Helper()
	e.poll("the writer's round ended", func() bool { return e.clock.Timers() > 0 })
}

// step moves the fake clock by d and waits for the round it starts.
func (e *writerEnv) step(d time.Duration) {
	e.clock.Advance(d)
	e.idle()
}

// With 2,000 outcomes of an unreachable database waiting, each answered
// Busy at a different time, the writer sends their retries in few rounds
// (at most one statement per busyRetry.Min of the clock, not one per
// outcome), the healthy database's outcomes are written in the round they
// arrive, and once the database is back each waiting outcome is written
// exactly once and ended once. Before, each waiting outcome was retried in
// a round of its own — some 2,000 statements a second of the clock, each
// round rescanning the whole retry list.
func TestADownDatabasesOutcomesDoNotHoldBackTheOthers(t *testing.T) {
	t.Parallel()
	const waiting = 2000
	e := newWriterEnv(t, 0)
	for i := range waiting {
		e.sendDown(int64(i + 1))
		e.step(time.Millisecond)
	}
	if _, items := e.store.counts(); items < waiting {
		t.Fatalf("%d busy answers for %d outcomes", items, waiting)
	}
	stmts0, items0 := e.store.counts()
	const window = 2 * time.Second
	healthy := int64(waiting + 1)
	for moved := time.Duration(0); moved < window; moved += time.Millisecond {
		if moved%(100*time.Millisecond) == 0 {
			e.sendHealthy(healthy)
			if n, d := e.store.timesWritten(healthy), e.doneOf(healthy); n != 1 || d != 1 {
				t.Fatalf("healthy outcome %d written %d times, ended %d times in its round; want 1, 1", healthy, n, d)
			}
			healthy++
		}
		e.step(time.Millisecond)
	}
	stmts, items := e.store.counts()
	stmts, items = stmts-stmts0, items-items0
	t.Logf("over %s of the clock: %d statements retried %d waiting outcomes", window, stmts, items)
	if limit := 2 * int(window/busyRetry.Min); stmts > limit {
		t.Fatalf("%d statements named the down database's outcomes over %s of the clock; want at most %d (retries grouped, one round per %s)",
			stmts, window, limit, busyRetry.Min)
	}
	for id := int64(1); id <= waiting; id++ {
		if d := e.doneOf(id); d != 0 {
			t.Fatalf("outcome %d ended while its database was down", id)
		}
	}

	// The database is back: every waiting outcome is written once.
	e.store.mu.Lock()
	e.store.down = false
	e.store.mu.Unlock()
	if !settle(e.clock.Advance, func() bool {
		for id := int64(1); id <= waiting; id++ {
			if e.doneOf(id) == 0 {
				return false
			}
		}
		return true
	}) {
		t.Fatal("waiting outcomes not all written within 10s of the database coming back")
	}
	for id := int64(1); id < healthy; id++ {
		if n, d := e.store.timesWritten(id), e.doneOf(id); n != 1 || d != 1 {
			t.Fatalf("outcome %d written %d times, ended %d times; want 1, 1", id, n, d)
		}
	}
}

// BenchmarkWriterRoundWithOutcomesWaiting is the cost of one writer round
// (one healthy outcome received and written) with N outcomes of an
// unreachable database waiting for their retry.
func BenchmarkWriterRoundWithOutcomesWaiting(b *testing.B) {
	for _, n := range []int{0, 100, 1000, 10000} {
		b.Run(fmt.Sprint("waiting=", n), func(b *testing.B) {
			e := newWriterEnv(b, 0)
			for i := range n {
				e.send(int64(i+1), downShard)
				e.clock.Advance(time.Microsecond)
			}
			id := int64(n + 1)
			for b.Loop() {
				e.send(id, 0)
				id++
			}
		})
	}
}

// BenchmarkSoonWithOutcomesWaiting is the cost of the claim round's count
// of handlers that return soon (pool.soon, with a queue of long handlers,
// so that attempts are looked at one by one) with N finished attempts
// whose outcomes wait for their write, as a down database's do.
func BenchmarkSoonWithOutcomesWaiting(b *testing.B) {
	for _, n := range []int{0, 1000, 10000} {
		b.Run(fmt.Sprint("waiting=", n), func(b *testing.B) {
			p := newPool(NewRegistry(), 8, nil, make(chan result), time.Minute, clock.NewFake(), NewMetrics(nil), nil)
			p.handlers["long"], p.took["long"] = 1, time.Second
			for i := range n {
				t := tasks.Task{ID: int64(i + 1), Shard: downShard, Epoch: 1, Attempt: 1, Queue: "long"}
				p.attempts[claims.RefOf(t)] = &attempt{task: t, finished: true}
			}
			for b.Loop() {
				p.soon(p.clock.Now(), aheadCover)
			}
		})
	}
}
