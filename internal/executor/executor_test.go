package executor

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const me = "runner-a"

// env is one executor over a fake store and a fake ownership on a fake
// clock; no PostgreSQL, no etcd.
type env struct {
	t     *testing.T
	store *fakeStore
	own   *fakeOwnership
	clock *clock.Fake
	reg   *Registry
	exec  *Executor
	stop  context.CancelFunc
	done  chan error
}

func newEnv(t *testing.T, handlers map[string]tasks.Handler, mut ...func(*Config)) *env {
	t.Helper()
	e := &env{t: t, store: newFakeStore(), own: newFakeOwnership(), clock: clock.NewFake(), reg: NewRegistry()}
	for kind, h := range handlers {
		if err := e.reg.Register(kind, h); err != nil {
			t.Fatal(err)
		}
	}
	cfg := Config{RunnerID: me, Store: e.store, Ownership: e.own, Registry: e.reg, Clock: e.clock,
		MaxWorkers: 4, HeartbeatInterval: time.Second, PollInterval: 100 * time.Millisecond,
		Retry: tasks.RetryPolicy{MaxAttempts: 5, Base: 10 * time.Millisecond, Cap: 100 * time.Millisecond}}
	for _, m := range mut {
		m(&cfg)
	}
	exec, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.exec = exec
	return e
}

func (e *env) run() {
	ctx, cancel := context.WithCancel(context.Background())
	e.stop, e.done = cancel, make(chan error, 1)
	go func() { e.done <- e.exec.Run(ctx) }()
	e.t.Cleanup(func() { e.shutdown() })
}

// shutdown ends Run and waits for it, advancing the fake clock so that
// timers it waits on (the shutdown bound) can fire.
func (e *env) shutdown() {
	if e.stop == nil {
		return
	}
	e.stop()
	e.stop = nil
	if !settle(e.clock.Advance, func() bool {
		select {
		case err := <-e.done:
			if err != nil {
				e.t.Errorf("Run: %v", err)
			}
			return true
		default:
			return false
		}
	}) {
		e.t.Fatal("Run did not return after its context ended")
	}
}

func (e *env) until(what string, cond func() bool) {
	e.t.Helper()
	if !settle(e.clock.Advance, cond) {
		e.t.Fatalf("not within 10s: %s", what)
	}
}

// untilWithin is until, moving the fake clock by at most budget in all:
// what it waits for must come without a timer set further off (that a
// task waited ahead past aheadPatience, say).
func (e *env) untilWithin(what string, budget time.Duration, cond func() bool) {
	e.t.Helper()
	var moved time.Duration
	if !settle(func(time.Duration) {
		if moved < budget {
			step := min(time.Millisecond, budget-moved)
			e.clock.Advance(step)
			moved += step
		}
	}, cond) {
		e.t.Fatalf("not within 10s and %s of the fake clock: %s", budget, what)
	}
}

// completedUpTo is the condition that tasks 1 to n have all completed.
func (e *env) completedUpTo(n int64) func() bool {
	return func() bool {
		for id := int64(1); id <= n; id++ {
			if e.state(id) != tasks.Completed {
				return false
			}
		}
		return true
	}
}

// poll advances the fake clock by one poll interval and waits for the
// claim round it starts to complete.
func (e *env) poll() {
	e.t.Helper()
	at := e.clock.Now().Add(e.exec.cfg.PollInterval)
	e.clock.Advance(e.exec.cfg.PollInterval)
	// A round still under way when the clock moved sets its poll timer
	// from the new time, and it waits another interval: move the clock
	// again when no round came for half a second of real time (at most one
	// round more, within the bound below).
	waits := 0
	if !settle(func(time.Duration) {
		if waits++; waits%500 == 0 {
			e.clock.Advance(e.exec.cfg.PollInterval)
		}
	}, func() bool { return !e.exec.claimer.lastRound().Before(at) }) {
		e.t.Fatal("no claim round after a poll interval")
	}
}

func (e *env) state(id int64) tasks.State { return e.store.get(id).State }

// claimed counts the attempts the executor holds: started (until their
// outcome is written) and waiting ahead.
func (e *env) claimed() int { return len(e.exec.pool.refs()) + e.exec.ahead.size() }

func noop(context.Context, *tasks.Task) error { return nil }

func TestClaimRunComplete(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	for id := int64(1); id <= 6; id++ {
		e.store.add(id, "noop", int(id%2), 3)
	}
	e.store.add(7, "other", 0, 3) // no handler: never claimed
	e.own.own(0, 5)
	e.own.own(1, 9)
	e.run()
	e.until("six tasks completed", e.completedUpTo(6))
	if got := e.store.get(2); got.Epoch != 5 || got.ClaimedBy != me {
		t.Errorf("task 2 claimed under %d by %q, want epoch 5 by %s", got.Epoch, got.ClaimedBy, me)
	}
	if e.state(7) != tasks.Ready {
		t.Error("a task of a kind without handler was claimed")
	}
	if n := e.store.count("raise"); n != 1 {
		t.Errorf("fences raised %d times, want once for both new terms", n)
	}
	if n := e.store.count("probe"); n != 0 {
		t.Errorf("a runner of one queue asked %d times which queues have tasks, want never: it claims directly", n)
	}
	e.until("every hold and attempt ended", func() bool { return e.own.inflight(0) == 0 && e.own.inflight(1) == 0 })
}

func TestFailedAttemptIsRetriedThenCompletes(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	flaky := func(_ context.Context, task *tasks.Task) error {
		calls.Add(1)
		if task.Attempt < 3 {
			return fmt.Errorf("attempt %d fails", task.Attempt)
		}
		return nil
	}
	e := newEnv(t, map[string]tasks.Handler{"flaky": flaky})
	e.store.add(1, "flaky", 0, 5)
	e.own.own(0, 1)
	e.run()
	e.until("completed on the third attempt", func() bool { return e.state(1) == tasks.Completed })
	got := e.store.get(1)
	if got.Attempt != 3 || len(got.Errors) != 2 || !strings.Contains(got.Errors[1].Error, "attempt 2 fails") || calls.Load() != 3 {
		t.Fatalf("task %+v after %d calls", got, calls.Load())
	}
}

// A failure carries the runner's retry policy, which the store applies
// (shardrun_backoff, counting from the task's last retry:
// TestFailBackoffCountsFromTheLastRetry in store).
func TestFailureCarriesTheRetryPolicy(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"bad": func(context.Context, *tasks.Task) error { return errors.New("boom") }})
	e.store.add(1, "bad", 0, 6)
	e.own.own(0, 1)
	e.run()
	e.until("the attempt failed", func() bool {
		e.store.mu.Lock()
		defer e.store.mu.Unlock()
		return len(e.store.failed) > 0
	})
	e.store.mu.Lock()
	first := e.store.failed[0]
	e.store.mu.Unlock()
	if want := (claims.Backoff{Base: 10 * time.Millisecond, Cap: 100 * time.Millisecond}); first.Backoff != want {
		t.Fatalf("the failure's backoff is %+v, want the policy's %+v", first.Backoff, want)
	}
}

func TestAttemptsUsedUpGoDead(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"bad": func(context.Context, *tasks.Task) error { panic("boom") }})
	e.store.add(1, "bad", 0, 2)
	e.own.own(0, 1)
	e.run()
	e.until("dead after two attempts", func() bool { return e.state(1) == tasks.Dead })
	if errs := e.store.get(1).Errors; len(errs) != 2 || !strings.Contains(errs[0].Error, "panic: boom") {
		t.Fatalf("errors %+v: a panic must fail the attempt with its text", errs)
	}
}

// A handler's permanent failure buries the task at once.
func TestPermanentFailureGoesDeadAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"picky": func(context.Context, *tasks.Task) error {
		return tasks.Permanent(errors.New("this input can never work"))
	}})
	e.store.add(1, "picky", 0, 5)
	e.own.own(0, 1)
	e.run()
	e.until("dead", func() bool { return e.state(1) == tasks.Dead })
	if got := e.store.get(1); got.Attempt != 1 || len(got.Errors) != 1 {
		t.Fatalf("task %+v: a permanent failure must not spend the remaining attempts", got)
	}
}

func TestHeartbeatsBeatRunningAttempts(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	e := newEnv(t, map[string]tasks.Handler{"slow": func(ctx context.Context, _ *tasks.Task) error {
		<-release
		return nil
	}})
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.until("beaten twice", func() bool {
		e.store.mu.Lock()
		defer e.store.mu.Unlock()
		return len(e.store.beats) >= 2
	})
	close(release)
	e.until("completed", func() bool { return e.state(1) == tasks.Completed })
}

// A sweep requeued a running task: the next heartbeat finds it moved and
// cancels the handler; its late outcome is dropped.
func TestHeartbeatCancelsATaskTakenBack(t *testing.T) {
	t.Parallel()
	cause := make(chan error, 1)
	e := newEnv(t, map[string]tasks.Handler{"slow": func(ctx context.Context, task *tasks.Task) error {
		if task.Attempt > 1 {
			return nil // the requeued attempt, claimed again here
		}
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}})
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.store.mu.Lock()
	e.store.tasks[1].State, e.store.tasks[1].Attempt = tasks.Ready, 2 // swept
	e.store.mu.Unlock()
	var got error
	e.until("handler cancelled", func() bool {
		select {
		case got = <-cause:
			return true
		default:
			return false
		}
	})
	if !errors.Is(got, errTakenBack) {
		t.Fatalf("cancel cause %v, want errTakenBack", got)
	}
	e.until("the requeued attempt completed", func() bool { return e.state(1) == tasks.Completed })
	if st := e.store.get(1); st.Attempt != 2 || len(st.Errors) != 0 {
		t.Fatalf("the stale attempt's failure was recorded: %+v", st)
	}
}

// A claim whose term stops taking work before the attempt starts is given
// back with the same attempt.
func TestClaimsThatCannotStartAreGivenBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	e.store.add(1, "noop", 0, 3)
	e.own.refuseBegin = true
	e.own.own(0, 1)
	e.run()
	e.until("given back", func() bool { return e.store.count("unclaim") >= 1 })
	if got := e.store.get(1); got.State != tasks.Ready || got.Attempt != 1 {
		t.Fatalf("given-back task %+v, want ready at attempt 1", got)
	}
	e.own.mu.Lock()
	e.own.refuseBegin = false
	e.own.mu.Unlock()
	e.until("completed once the term takes work", func() bool { return e.state(1) == tasks.Completed })
}

// Losing the shard mid-run cancels the handler with the ownership cause,
// and the attempt is given back without spending it: a task with one
// attempt is not dead because its runner lost the shard.
func TestShardLossInterruptsWithoutSpendingTheAttempt(t *testing.T) {
	cause := make(chan error, 1)
	e := newEnv(t, map[string]tasks.Handler{"slow": func(ctx context.Context, _ *tasks.Task) error {
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}})
	e.store.add(1, "slow", 0, 1)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.own.lose(0)
	var got error
	e.until("handler cancelled", func() bool {
		select {
		case got = <-cause:
			return true
		default:
			return false
		}
	})
	if !errors.Is(got, tasks.ErrOwnershipLost) {
		t.Fatalf("cause %v, want tasks.ErrOwnershipLost", got)
	}
	e.until("interruption written", func() bool { return e.store.count("interrupt") == 1 })
	task := e.store.get(1)
	if task.State != tasks.Ready || task.Attempt != 1 || len(task.Errors) != 1 || !task.Errors[0].Interrupted {
		t.Fatalf("interrupted task %+v: want ready at attempt 1 with the interruption in its history", task)
	}
	if e.store.count("fail") != 0 {
		t.Fatal("an interruption was written as a failed attempt")
	}
}

// An attempt whose outcome waits for its write (the database is away) is
// still heartbeated, so the sweeper does not take it for stale.
func TestFinishedAttemptsAreBeatenUntilWritten(t *testing.T) {
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	e.store.add(1, "noop", 0, 3)
	e.store.failNext("complete", 1000)
	e.own.own(0, 1)
	e.run()
	e.until("the handler returned and the write is failing", func() bool {
		return e.exec.InFlight() == 0 && e.store.count("complete") >= 2
	})
	e.store.mu.Lock()
	e.store.beats = nil
	e.store.mu.Unlock()
	e.until("beaten while the write waits", func() bool {
		e.store.mu.Lock()
		defer e.store.mu.Unlock()
		return len(e.store.beats) >= 2
	})
	e.store.failNext("complete", 0)
	e.until("completed once the database is back", func() bool { return e.state(1) == tasks.Completed })
}

// A handler that ignores its cancellation is reported stuck after
// StuckAfter, and the claim loop's progress is visible to readiness.
func TestStuckHandlersAreReported(t *testing.T) {
	release := make(chan struct{})
	e := newEnv(t, map[string]tasks.Handler{"stubborn": func(context.Context, *tasks.Task) error {
		<-release // ignores ctx
		return nil
	}}, func(c *Config) { c.StuckAfter = 2 * time.Second })
	e.store.add(7, "stubborn", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	if stalled, why := e.exec.Stalled(); stalled {
		t.Fatalf("a working executor reports itself stalled: %s", why)
	}
	e.own.lose(0)
	e.until("reported stuck", func() bool { return len(e.exec.Stuck()) == 1 })
	if st := e.exec.Stuck()[0]; st.TaskID != 7 || st.Kind != "stubborn" {
		t.Fatalf("stuck %+v", st)
	}
	close(release)
	e.until("no longer stuck once it returns", func() bool { return len(e.exec.Stuck()) == 0 })
}

// The claim loop failing for several poll intervals while shards are held
// makes the executor report itself stalled, and it recovers. The database
// answers neither the poll's probe nor a claim (an idle runner's poll
// sends the probe, and claims only when it fails or finds tasks).
func TestClaimLoopWithoutProgressIsStalled(t *testing.T) {
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	e.own.own(0, 1)
	e.run()
	e.until("holding the shard", func() bool { return e.exec.claimer.heldCount() == 1 })
	e.store.failNext("probe", 1_000_000)
	e.store.failNext("claim", 1_000_000)
	e.until("stalled", func() bool { stalled, _ := e.exec.Stalled(); return stalled })
	e.store.failNext("probe", 0)
	e.store.failNext("claim", 0)
	e.until("progress again", func() bool { stalled, _ := e.exec.Stalled(); return !stalled })
}

// A newer owner raised the shard's fence while the attempt ran: the
// completion is refused and the term reported lost.
func TestFenceRefusalReportsTheTermLost(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	e := newEnv(t, map[string]tasks.Handler{"slow": func(context.Context, *tasks.Task) error { <-release; return nil }})
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 4)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.store.setFence(0, 7, "runner-b")
	close(release)
	e.until("term reported lost", func() bool { return len(e.own.lostTerms()) > 0 })
	if lost := e.own.lostTerms(); lost[0] != (claims.ShardEpoch{Shard: 0, Epoch: 4}) {
		t.Fatalf("lost %v, want shard 0 epoch 4", lost)
	}
	if e.state(1) != tasks.Running {
		t.Fatal("a refused completion changed the task")
	}
}

// A fence already raised by a newer owner: the term is reported lost and
// nothing is claimed from it.
func TestRaiseRefusedForANewerFence(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	e.store.add(1, "noop", 0, 3)
	e.store.setFence(0, 10, "runner-b")
	e.own.own(0, 4)
	e.run()
	e.until("term reported lost", func() bool { return len(e.own.lostTerms()) == 1 })
	if e.store.count("claim") != 0 && e.state(1) != tasks.Ready {
		t.Fatal("claimed from a shard whose fence is newer")
	}
}

// The database is unreachable when the outcome is written: the write is
// retried until it lands, and the term's hold ends only then.
func TestOutcomeWriteRetriedUntilItLands(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	e.store.add(1, "noop", 0, 3)
	e.store.failNext("complete", 3)
	e.own.own(0, 1)
	e.run()
	e.until("completed after three failed writes", func() bool { return e.state(1) == tasks.Completed })
	if n := e.store.count("complete"); n != 4 {
		t.Fatalf("%d complete calls, want 4", n)
	}
	e.until("hold ended after the write", func() bool { return e.own.inflight(0) == 0 })
}

// Claiming fails while the database is down, then recovers.
func TestClaimErrorsBackOffAndRecover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	e.store.add(1, "noop", 0, 3)
	e.store.failNext("claim", 3)
	e.own.own(0, 1)
	e.run()
	e.until("completed", func() bool { return e.state(1) == tasks.Completed })
	if n := e.store.count("claim"); n < 4 {
		t.Fatalf("%d claim calls, want the 3 failures and a success", n)
	}
}

// Shutdown stops claiming, lets the running attempt finish and writes its
// outcome before Run returns.
func TestShutdownDrainsRunningAttempts(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	e := newEnv(t, map[string]tasks.Handler{"slow": func(context.Context, *tasks.Task) error { <-release; return nil }})
	e.store.add(1, "slow", 0, 3)
	e.store.add(2, "slow", 1, 3)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.stop()
	e.own.own(1, 2) // a shard gained after shutdown began is not claimed from
	close(release)
	var err error
	e.until("Run returned", func() bool {
		select {
		case err = <-e.done:
			return true
		default:
			return false
		}
	})
	e.stop = nil
	if err != nil {
		t.Fatal(err)
	}
	if e.state(1) != tasks.Completed || e.state(2) != tasks.Ready {
		t.Fatalf("after shutdown task 1 is %s (want completed) and task 2 %s (want ready)", e.state(1), e.state(2))
	}
}

// An outcome being written when shutdown begins is not cut short: the
// statement runs to its end although Run's context ended meanwhile.
func TestShutdownDoesNotCancelAWriteUnderWay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	writing := make(chan struct{})
	var once atomic.Bool
	e.store.completing = func(ctx context.Context) error {
		if once.CompareAndSwap(false, true) {
			close(writing)
			// Shutdown proceeds meanwhile; a write whose context it
			// cancels fails here.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(200 * time.Millisecond):
			}
		}
		return nil
	}
	e.store.add(1, "noop", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("the completion is being written", func() bool {
		select {
		case <-writing:
			return true
		default:
			return false
		}
	})
	e.shutdown()
	if e.state(1) != tasks.Completed || e.store.count("complete") != 1 {
		t.Fatalf("task %s after %d complete calls: the write under way at shutdown must land once", e.state(1), e.store.count("complete"))
	}
}

func TestConfigNamesTheFlag(t *testing.T) {
	t.Parallel()
	for flag, c := range map[string]Config{
		"--max-workers":        {MaxWorkers: MaxMaxWorkers + 1},
		"--heartbeat-interval": {HeartbeatInterval: time.Millisecond},
		"--poll-interval":      {PollInterval: 2 * time.Hour},
		"--queues":             {Queues: manyQueues(MaxQueues + 1)},
	} {
		c.fill()
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s: %v", flag, err)
		}
	}
}

// manyQueues is n queues, each with a limit of one worker.
func manyQueues(n int) map[string]int {
	q := make(map[string]int, n)
	for i := range n {
		q[fmt.Sprint("q", i)] = 1
	}
	return q
}

// An operator cancels a running task: the next heartbeat carries the
// request, the handler's context ends with tasks.ErrCancelled, and the
// attempt is recorded as cancelled when the handler then returns an error.
func TestCancelRequestEndsTheHandlerAndRecordsCancelled(t *testing.T) {
	t.Parallel()
	ended := make(chan error, 1)
	e := newEnv(t, map[string]tasks.Handler{"slow": func(ctx context.Context, _ *tasks.Task) error {
		<-ctx.Done()
		ended <- context.Cause(ctx)
		return context.Cause(ctx)
	}})
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.store.requestCancel(1)
	// Every beat counted from here on read the request (a beat reads the
	// store under the lock that counts it). Once one has begun, the clock
	// stops: that beat alone, no later one, must end the handler. A bound
	// in fake time would also count the heartbeater's own start lag.
	before := e.store.count("heartbeat")
	e.until("a heartbeat after the request", func() bool { return e.store.count("heartbeat") > before })
	var cause error
	if !settle(func(time.Duration) {}, func() bool {
		select {
		case cause = <-ended:
			return true
		default:
			return false
		}
	}) {
		t.Fatal("the first heartbeat after the request did not end the handler")
	}
	if !errors.Is(cause, tasks.ErrCancelled) {
		t.Fatalf("cause %v, want tasks.ErrCancelled", cause)
	}
	// The metric is counted after the write that the state shows.
	cancelled := e.exec.cfg.Metrics.Finished.WithLabelValues("slow", "cancelled")
	e.until("recorded cancelled", func() bool { return e.state(1) == tasks.Cancelled && counterValue(cancelled) == 1 })
	if errs := e.store.get(1).Errors; len(errs) != 1 || !strings.Contains(errs[0].Error, "cancelled on request") {
		t.Fatalf("history %+v", errs)
	}
	if e.store.count("complete") != 0 || e.store.count("fail") != 0 {
		t.Fatal("a cancelled attempt was also completed or failed")
	}
}

// A handler that sees the cancel request (tasks.CancelRequested, the
// context's cause) but returns success has done its work: the attempt is
// recorded completed, with its result, so that a retry does not repeat its
// side effects.
func TestSuccessAfterACancelRequestIsRecordedCompleted(t *testing.T) {
	t.Parallel()
	saw := make(chan bool, 1)
	e := newEnv(t, map[string]tasks.Handler{"slow": func(ctx context.Context, task *tasks.Task) error {
		<-ctx.Done()
		saw <- tasks.CancelRequested(ctx)
		return task.SetResult(map[string]string{"sent": "invoice-7"})
	}})
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.store.requestCancel(1)
	e.until("recorded completed", func() bool { return e.state(1) == tasks.Completed })
	if !<-saw {
		t.Fatal("tasks.CancelRequested was false in the handler of a task cancelled on request")
	}
	if got := e.store.get(1); string(got.Result) != `{"sent":"invoice-7"}` || len(got.Errors) != 0 {
		t.Fatalf("task %+v, want its result and no error", got)
	}
	// Counted after the write the state shows: waited for, not read at once.
	completed := e.exec.cfg.Metrics.Finished.WithLabelValues("slow", "completed")
	e.until("tasks_finished_total{outcome=completed} = 1", func() bool { return counterValue(completed) == 1 })
	if e.store.count("cancel") != 0 {
		t.Fatal("a completed attempt was also recorded cancelled")
	}
	// Losing the shard is not a cancel request.
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(tasks.ErrOwnershipLost)
	if tasks.CancelRequested(ctx) || tasks.CancelRequested(context.Background()) {
		t.Fatal("CancelRequested without a cancel request")
	}
}

// A handler that returns an error once cancelled is not retried: its task
// is cancelled, with the handler's error in its history.
func TestCancelledAttemptIsNotRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"slow": func(ctx context.Context, _ *tasks.Task) error {
		<-ctx.Done()
		return fmt.Errorf("interrupted: %w", context.Cause(ctx))
	}})
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.store.requestCancel(1)
	e.until("recorded cancelled", func() bool { return e.state(1) == tasks.Cancelled })
	got := e.store.get(1)
	if got.Attempt != 1 || len(got.Errors) != 1 || !strings.Contains(got.Errors[0].Error, "interrupted: task cancelled on request") {
		t.Fatalf("task %+v", got)
	}
}

// A task whose cancel was requested but whose handler failed before the
// heartbeat told the runner is cancelled by the failure write, not retried.
func TestFailureOfACancelRequestedTaskCancelsIt(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	e := newEnv(t, map[string]tasks.Handler{"slow": func(context.Context, *tasks.Task) error {
		<-release
		return errors.New("boom")
	}}, func(c *Config) { c.HeartbeatInterval = time.Hour })
	e.store.add(1, "slow", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("running", func() bool { return e.exec.InFlight() == 1 })
	e.store.requestCancel(1)
	close(release)
	e.until("cancelled", func() bool { return e.state(1) == tasks.Cancelled })
	cancelled := e.exec.cfg.Metrics.Finished.WithLabelValues("slow", "cancelled")
	e.until("tasks_finished_total{outcome=cancelled} = 1", func() bool { return counterValue(cancelled) == 1 })
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

// An outcome the database refuses to store (not for being unavailable) is
// not retried forever: the batch is split, the others land, and the refused
// one is counted and left running for the sweeper to requeue.
func TestRefusedOutcomeDoesNotHoldBackItsBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop}, func(c *Config) { c.FlushDelay = time.Second })
	for id := int64(1); id <= 6; id++ {
		e.store.add(id, "noop", 0, 3)
	}
	e.store.refuse = map[int64]bool{3: true}
	e.own.own(0, 5)
	e.run()
	e.until("the five others completed", func() bool {
		for _, id := range []int64{1, 2, 4, 5, 6} {
			if e.state(id) != tasks.Completed {
				return false
			}
		}
		return true
	})
	e.until("the refusal counted", func() bool { return counterValue(e.exec.cfg.Metrics.WriteRefused) == 1 })
	if got := e.state(3); got != tasks.Running {
		t.Fatalf("the refused task is %s, want still running (the sweeper's to requeue)", got)
	}
	if n := e.store.count("complete"); n < 2 {
		t.Fatalf("%d completion statements: the batch was not split", n)
	}
}

// A claim statement that committed but whose answer was lost leaves claims
// nobody runs: the next round gives them back with their attempt unspent,
// and they run under the same attempt.
func TestClaimsOfALostAnswerAreGivenBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"noop": noop})
	for id := int64(1); id <= 3; id++ {
		e.store.add(id, "noop", 0, 1)
	}
	e.store.claimAnswersLost = 1
	e.own.own(0, 5)
	e.run()
	e.until("all three completed", e.completedUpTo(3))
	for id := int64(1); id <= 3; id++ {
		if got := e.store.get(id); got.Attempt != 1 {
			t.Errorf("task %d completed on attempt %d, want 1: the lost claim spent an attempt", id, got.Attempt)
		}
	}
	if e.store.count("claimed") == 0 || e.store.count("unclaim") == 0 {
		t.Fatalf("claims listed %d times, given back %d times", e.store.count("claimed"), e.store.count("unclaim"))
	}
}

// A handler still running at the task's deadline ends the task failed, as
// the sweeper's deadline rule would, without spending its other attempts:
// no attempt may start after the deadline.
func TestHandlerPastTheDeadlineEndsTheTaskFailed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"wait": func(ctx context.Context, _ *tasks.Task) error {
		<-ctx.Done()
		return ctx.Err()
	}})
	e.store.add(1, "wait", 0, 3)
	deadline := time.Now().Add(50 * time.Millisecond) // the handler's context runs on the real clock
	e.store.mu.Lock()
	e.store.tasks[1].Deadline = &deadline
	e.store.mu.Unlock()
	e.own.own(0, 5)
	e.run()
	e.until("the task failed", func() bool { return e.state(1) == tasks.Failed })
	if got := e.store.get(1); got.Attempt != 1 || len(got.Errors) != 1 {
		t.Fatalf("attempt %d, errors %+v: want one failed attempt", got.Attempt, got.Errors)
	}
	failed := e.exec.cfg.Metrics.Finished.WithLabelValues("wait", "failed")
	e.until("tasks_finished_total{outcome=failed} = 1", func() bool { return counterValue(failed) == 1 })
}

// Each queue runs at most its own limit of tasks at once, and all of them
// together at most MaxWorkers.
func TestQueueWorkerLimits(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var mu sync.Mutex
	running, most := map[string]int{}, map[string]int{}
	total, mostTotal := 0, 0
	block := func(_ context.Context, task *tasks.Task) error {
		mu.Lock()
		running[task.Queue]++
		total++
		most[task.Queue] = max(most[task.Queue], running[task.Queue])
		mostTotal = max(mostTotal, total)
		mu.Unlock()
		<-release
		mu.Lock()
		running[task.Queue]--
		total--
		mu.Unlock()
		return nil
	}
	e := newEnv(t, map[string]tasks.Handler{"block": block}, func(c *Config) {
		c.MaxWorkers, c.Queues = 4, map[string]int{tasks.DefaultQueue: 4, "mail": 1}
	})
	for id := int64(1); id <= 8; id++ {
		e.store.add(id, "block", 0, 3)
		if id%2 == 0 {
			e.store.mu.Lock()
			e.store.tasks[id].Queue = "mail"
			e.store.mu.Unlock()
		}
	}
	e.own.own(0, 1)
	e.run()
	e.until("four tasks running", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return total == 4
	})
	mu.Lock()
	if running["mail"] != 1 || running[tasks.DefaultQueue] != 3 {
		t.Errorf("running %v, want mail at its limit of 1 and the default queue filling the rest", running)
	}
	mu.Unlock()
	close(release)
	e.until("all completed", e.completedUpTo(8))
	mu.Lock()
	defer mu.Unlock()
	if most["mail"] != 1 || mostTotal > 4 {
		t.Fatalf("at most %d mail tasks and %d in all at once, want 1 and 4", most["mail"], mostTotal)
	}
}

// Urgent tasks in several shards all start in the next round, ahead of
// every shard's backlog: a claim of the whole rotation would fill its limit
// from the first shard's backlog and leave the other shards' urgent tasks
// behind it.
func TestUrgentTasksOfSeveralShardsGoFirst(t *testing.T) {
	t.Parallel()
	// One queue, claimed directly, and more than probeAbove, probed first.
	for _, n := range []int{1, probeAbove + 1} {
		t.Run(fmt.Sprint(n, " queues"), func(t *testing.T) {
			t.Parallel()
			urgentFirst(t, n)
		})
	}
}

func urgentFirst(t *testing.T, queues int) {
	release := make(chan struct{})
	var mu sync.Mutex
	var started []int64
	block := func(_ context.Context, task *tasks.Task) error {
		mu.Lock()
		started = append(started, task.ID)
		mu.Unlock()
		<-release
		return nil
	}
	e := newEnv(t, map[string]tasks.Handler{"block": block}, func(c *Config) {
		c.MaxWorkers, c.Queues = 2, map[string]int{tasks.DefaultQueue: 2}
		for i := 1; i < queues; i++ {
			c.Queues[fmt.Sprint("q", i)] = 2
		}
	})
	for id := int64(1); id <= 12; id++ {
		e.store.add(id, "block", int(id%4), 3)
	}
	for id, shard := range map[int64]int{13: 1, 14: 3} {
		e.store.add(id, "block", shard, 3)
		e.store.mu.Lock()
		e.store.tasks[id].Priority = tasks.MostUrgent
		e.store.mu.Unlock()
	}
	for s := range 4 {
		e.own.own(s, 1)
	}
	e.exec.Wake(false, []int{1, 3}, []int{1, 3})
	e.run()
	e.until("two tasks running", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(started) == 2
	})
	mu.Lock()
	got := slices.Sorted(slices.Values(started))
	mu.Unlock()
	close(release)
	if !slices.Equal(got, []int64{13, 14}) {
		t.Fatalf("the first two tasks started were %v, want the urgent ones of shards 1 and 3: [13 14]", got)
	}
	e.until("all completed", e.completedUpTo(14))
}

// Tasks are claimed ahead of need: when a handler returns, the next task
// starts on its slot without another claim statement.
func TestATaskClaimedAheadStartsWithoutAClaim(t *testing.T) {
	t.Parallel()
	release := make(chan struct{}, 16)
	var started atomic.Int32
	e := newEnv(t, map[string]tasks.Handler{"block": func(ctx context.Context, _ *tasks.Task) error {
		started.Add(1)
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}}, func(c *Config) { c.MaxWorkers, c.Queues = 4, map[string]int{tasks.DefaultQueue: 4} })
	for id := int64(1); id <= 5; id++ {
		e.store.add(id, "block", 0, 3)
	}
	e.own.own(0, 1)
	e.run()
	e.until("four running and one claimed ahead", func() bool {
		return started.Load() == 4 && e.claimed() == 5
	})
	// From now on every claim fails: the fifth task can start only from
	// what was claimed ahead.
	e.store.failNext("claim", 1_000_000)
	release <- struct{}{}
	e.until("the fifth started", func() bool { return started.Load() == 5 })
	e.store.failNext("claim", 0)
	for range 4 {
		release <- struct{}{}
	}
	e.until("all completed", e.completedUpTo(5))
}

// A task claimed ahead whose shard moves before a slot frees goes back to
// its lane without spending its attempt, and at once: the handoff does not
// wait for a slot.
func TestATaskClaimedAheadIsGivenBackWhenItsShardMoves(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]tasks.Handler{"block": func(ctx context.Context, _ *tasks.Task) error {
		<-ctx.Done()
		return ctx.Err()
	}}, func(c *Config) { c.MaxWorkers, c.Queues = 1, map[string]int{tasks.DefaultQueue: 1} })
	e.store.add(1, "block", 0, 3) // runs on shard 0 until it is lost
	e.store.add(2, "block", 1, 3) // claimed ahead from shard 1
	e.own.own(0, 1)
	e.own.own(1, 1)
	e.run()
	e.until("one running, one ahead", func() bool { return e.exec.InFlight() == 1 && e.claimed() == 2 })
	ahead := int64(2)
	if e.store.get(1).State == tasks.Ready {
		ahead = 1
	}
	e.own.lose(e.store.get(ahead).Shard)
	e.until("the task ahead given back", func() bool {
		return e.store.count("unclaim") == 1 && e.state(ahead) == tasks.Ready
	})
	if task := e.store.get(ahead); task.Attempt != 1 || len(task.Errors) != 0 {
		t.Fatalf("the task given back: attempt %d, errors %+v; want its attempt unspent and no history", task.Attempt, task.Errors)
	}
	e.own.lose(0) // ends the running handler
	e.own.lose(1)
}

// An operator's cancel reaches a task claimed ahead through the heartbeat:
// it never starts and ends cancelled.
func TestACancelReachesATaskClaimedAhead(t *testing.T) {
	t.Parallel()
	var ran sync.Map
	e := newEnv(t, map[string]tasks.Handler{"block": func(ctx context.Context, task *tasks.Task) error {
		ran.Store(task.ID, true)
		<-ctx.Done()
		return ctx.Err()
	}}, func(c *Config) {
		// Beaten well within aheadPatience: the cancel must come by the
		// heartbeat, not by a give-back of a task that waited too long.
		c.MaxWorkers, c.Queues, c.HeartbeatInterval = 1, map[string]int{tasks.DefaultQueue: 1}, 20*time.Millisecond
	})
	e.store.add(1, "block", 0, 3)
	e.store.add(2, "block", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("one running, one ahead", func() bool { return e.exec.InFlight() == 1 && e.claimed() == 2 })
	ahead := int64(2)
	if _, ok := ran.Load(int64(2)); ok {
		ahead = 1
	}
	e.store.requestCancel(ahead)
	e.until("the task ahead cancelled", func() bool { return e.state(ahead) == tasks.Cancelled })
	if _, ok := ran.Load(ahead); ok {
		t.Fatal("the cancelled task ran")
	}
	if n := e.store.count("cancel"); n != 1 {
		t.Fatalf("%d cancellations recorded, want the heartbeat's one", n)
	}
	e.own.lose(0) // ends the running handler
}

// Stopping gives back what was claimed ahead: nothing new starts during
// the drain.
func TestStoppingGivesBackTasksClaimedAhead(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	e := newEnv(t, map[string]tasks.Handler{"block": func(ctx context.Context, _ *tasks.Task) error {
		<-release
		return nil
	}}, func(c *Config) { c.MaxWorkers, c.Queues = 1, map[string]int{tasks.DefaultQueue: 1} })
	e.store.add(1, "block", 0, 3)
	e.store.add(2, "block", 0, 3)
	e.own.own(0, 1)
	e.run()
	e.until("one running, one ahead", func() bool { return e.exec.InFlight() == 1 && e.claimed() == 2 })
	e.stop()
	e.until("the task ahead given back", func() bool { return e.store.count("unclaim") == 1 })
	close(release)
	e.stop = func() {}
	e.until("Run returned", func() bool {
		select {
		case err := <-e.done:
			return err == nil
		default:
			return false
		}
	})
	e.stop = nil
	states := []tasks.State{e.state(1), e.state(2)}
	if !slices.Contains(states, tasks.Completed) || !slices.Contains(states, tasks.Ready) {
		t.Fatalf("states after the drain %v, want the running one completed and the one ahead ready", states)
	}
}

// An idle runner that serves 1,000 queues (MaxQueues) over 256 shards
// sends O(1) statements per poll, not one claim per queue (finding 5 of the
// hostile-input review: idle PostgreSQL CPU grew with the queues served, to
// 70% of a core at 2,000); and a task of one of its last queues still
// starts at once after its enqueue notification, and by the poll without
// one.
func TestIdleStatementsDoNotGrowWithTheQueuesServed(t *testing.T) {
	t.Parallel()
	const shards = 256
	queues := map[string]int{}
	for i := range MaxQueues {
		queues[fmt.Sprintf("q%04d", i)] = 4
	}
	e := newEnv(t, map[string]tasks.Handler{"noop": noop}, func(c *Config) { c.MaxWorkers, c.Queues = 4, queues })
	for s := range shards {
		e.own.own(s, 1)
	}
	e.run()
	e.until("holding every shard", func() bool { return e.exec.claimer.heldCount() == shards })
	statements := func() int { return e.store.count("claim") + e.store.count("probe") }
	poll := e.poll
	poll() // the first rounds of the newly held shards are behind
	before := statements()
	const polls = 5
	for range polls {
		poll()
	}
	if n := statements() - before; n > 2*polls {
		t.Fatalf("%d statements over %d idle polls with %d queues, want at most %d", n, polls, MaxQueues, 2*polls)
	}

	// A notified task of the 999th queue is claimed without the clock
	// moving: no poll needed.
	e.store.add(1, "noop", 17, 3)
	e.store.mu.Lock()
	e.store.tasks[1].Queue = "q0998"
	e.store.mu.Unlock()
	e.exec.Wake(false, []int{17}, nil)
	if !settle(func(time.Duration) {}, func() bool { return e.state(1) != tasks.Ready }) {
		t.Fatal("a notified task of queue q0998 was not claimed without a poll")
	}
	e.until("the notified task of q0998 completed", func() bool { return e.state(1) == tasks.Completed })
	// One nobody notified starts at the next poll.
	e.store.add(2, "noop", 200, 3)
	e.store.mu.Lock()
	e.store.tasks[2].Queue = "q0999"
	e.store.mu.Unlock()
	poll()
	if !settle(func(time.Duration) {}, func() bool { return e.state(2) != tasks.Ready }) {
		t.Fatal("a task of queue q0999 nobody notified was not claimed by the poll")
	}
	e.until("the unnotified task of q0999 completed", func() bool { return e.state(2) == tasks.Completed })
}

// An idle runner serving few queues (claimed from directly when notified)
// sends one probe per poll and no claim, whatever the shards it holds
// (issue 41: a claim per queue over every held shard each poll made an
// idle fleet's cost grow with runners × shards); a task nobody notified
// still starts at the next poll, and so does one when that poll's probe
// fails (every held shard is then claimed from, as before the probe).
func TestIdlePollSendsOneProbeWhateverTheShardsHeld(t *testing.T) {
	t.Parallel()
	const shards = 1024
	queues := map[string]int{tasks.DefaultQueue: 4}
	for i := range probeAbove - 1 {
		queues[fmt.Sprintf("q%d", i)] = 4
	}
	e := newEnv(t, map[string]tasks.Handler{"noop": noop}, func(c *Config) { c.MaxWorkers, c.Queues = 4, queues })
	for s := range shards {
		e.own.own(s, 1)
	}
	e.run()
	e.until("holding every shard", func() bool { return e.exec.claimer.heldCount() == shards })
	e.poll() // the first claims of the newly held shards are behind
	claims0, probes0 := e.store.count("claim"), e.store.count("probe")
	const polls = 5
	for range polls {
		e.poll()
	}
	if claims, probes := e.store.count("claim")-claims0, e.store.count("probe")-probes0; claims != 0 || probes < 1 || probes > 2*polls {
		t.Fatalf("%d claims and %d probes over %d idle polls of %d shards, want no claim and one probe a poll", claims, probes, polls, shards)
	}

	// Nobody notified this task: the next poll's probe finds it.
	e.store.add(1, "noop", 700, 3)
	e.poll()
	e.until("the unnotified task completed", func() bool { return e.state(1) == tasks.Completed })

	// Every probe fails: the polls claim from every held shard.
	e.store.mu.Lock()
	e.store.failures["probe"] = 1 << 30
	e.store.mu.Unlock()
	e.store.add(2, "noop", 900, 3)
	e.poll()
	e.until("the unnotified task completed while the probes fail", func() bool { return e.state(2) == tasks.Completed })
}

// A busy runner's poll sends no probe while every held shard is pending
// anyway (its claims read those lanes this round): under a backlog the
// probe only stepped over the lanes' dead entries (bench section mixed).
// Once the backlog drains, the polls probe again, and a task nobody
// notified still starts at the next poll.
func TestBusyPollProbesOnlyShardsNotPending(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	block := func(ctx context.Context, _ *tasks.Task) error {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}
	e := newEnv(t, map[string]tasks.Handler{"block": block, "noop": noop},
		func(c *Config) { c.MaxWorkers, c.Queues = 2, map[string]int{tasks.DefaultQueue: 2} })
	for id := int64(1); id <= 20; id++ {
		e.store.add(id, "block", int(id-1)/10, 3)
	}
	e.own.own(0, 1)
	e.own.own(1, 1)
	e.run()
	e.until("two running", func() bool { return e.exec.InFlight() == 2 })
	probes0 := e.store.count("probe")
	for range 3 {
		e.poll()
	}
	if n := e.store.count("probe") - probes0; n != 0 {
		t.Fatalf("%d probes over 3 polls while both held shards had a backlog, want none", n)
	}
	close(release)
	e.until("the backlog done", e.completedUpTo(20))
	probes1 := e.store.count("probe")
	e.poll()
	if e.store.count("probe") == probes1 {
		t.Fatal("no probe at the poll once the backlog drained")
	}
	e.store.add(21, "noop", 1, 3)
	e.poll()
	e.until("the unnotified task completed", func() bool { return e.state(21) == tasks.Completed })
}

// The tasks waiting ahead of a shard that moves go back in one statement,
// not one each: the buffer may hold a task per worker.
func TestTasksAheadOfAMovedShardGoBackTogether(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	e := newEnv(t, map[string]tasks.Handler{
		"noop": noop,
		"block": func(ctx context.Context, _ *tasks.Task) error {
			select {
			case <-release:
			case <-ctx.Done():
			}
			return nil
		}}, func(c *Config) { c.MaxWorkers, c.Queues = 4, map[string]int{tasks.DefaultQueue: 4} })
	// A first task measures the queue's handlers: the buffer then holds a
	// task per worker.
	e.store.add(1, "noop", 1, 3)
	e.own.own(0, 1)
	e.own.own(1, 1)
	e.run()
	e.until("the first task completed", func() bool { return e.state(1) == tasks.Completed })
	for id := int64(2); id <= 5; id++ {
		e.store.add(id, "block", 1, 3)
	}
	e.exec.Wake(true, nil, nil)
	e.until("four running on shard 1", func() bool { return e.exec.InFlight() == 4 })
	ahead := []int64{6, 7, 8, 9}
	for _, id := range ahead {
		e.store.add(id, "block", 0, 3)
	}
	e.exec.Wake(true, nil, nil)
	e.until("four claimed ahead from shard 0", func() bool { return e.claimed() == 8 })
	e.own.lose(0)
	e.until("the tasks ahead given back", func() bool {
		for _, id := range ahead {
			if e.state(id) != tasks.Ready {
				return false
			}
		}
		return true
	})
	if n := e.store.count("unclaim"); n != 1 {
		t.Fatalf("%d statements gave back the tasks ahead of the moved shard, want 1", n)
	}
	close(release)
}
