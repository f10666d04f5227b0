package runner

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

func TestCancelAReadyTask(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start("a")
	c := e.client
	ctx := context.Background()
	later, err := c.Enqueue(ctx, tasks.NewTask{Kind: "noop", Options: tasks.Options{RunAfter: time.Now().Add(time.Hour)}})
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Cancel(ctx, later.ID)
	if err != nil || got.State != tasks.Cancelled {
		t.Fatalf("cancel: %+v %v", got, err)
	}
	// A task enqueued after it runs; the cancelled one never does.
	after := e.enqueue("noop", `{}`, 1)[0]
	testutil.Until(t, 10*time.Second, "the later task completed", func() (bool, string) {
		return e.task(after).State == tasks.Completed, string(e.task(after).State)
	})
	if got := e.task(later.ID); got.State != tasks.Cancelled || got.ClaimedBy != "" {
		t.Fatalf("the cancelled task: %+v", got)
	}
}

// An operator cancels a running task: its handler's context ends (at its
// runner's next heartbeat) with tasks.ErrCancelled, and the outcome is
// cancelled when the handler then returns that cause.
func TestCancelARunningTask(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	type end struct {
		at    time.Time
		cause error
	}
	started := make(chan int64, 1)
	ended := make(chan end, 1)
	a := e.start("a", withHandler("stubborn", func(ctx context.Context, task *tasks.Task) error {
		started <- task.ID
		<-ctx.Done()
		ended <- end{time.Now(), context.Cause(ctx)}
		return context.Cause(ctx)
	}))
	c := e.client
	ctx := context.Background()
	e.enqueue("stubborn", `{}`, 1)
	id := <-started
	requested := time.Now()
	got, err := c.Cancel(ctx, id)
	if err != nil || got.State != tasks.Running || got.CancelRequestedAt == nil {
		t.Fatalf("cancel of a running task: %+v %v", got, err)
	}
	var ctxEnded end
	select {
	case ctxEnded = <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler's context did not end")
	}
	// How soon (about one heartbeat interval) is not asserted: a bound on
	// the wall clock fails on a loaded machine. What is: the context ended
	// after the request, because of it.
	t.Logf("the handler's context ended %s after the cancel request (heartbeat interval %s)",
		ctxEnded.at.Sub(requested), e.config("a").HeartbeatInterval)
	if cause := ctxEnded.cause; !errors.Is(cause, tasks.ErrCancelled) {
		t.Fatalf("cause %v, want tasks.ErrCancelled", cause)
	}
	testutil.Until(t, 5*time.Second, "the outcome recorded", func() (bool, string) {
		return e.task(id).State == tasks.Cancelled, string(e.task(id).State)
	})
	if got := e.task(id); got.Result != nil || len(got.Errors) != 1 || !strings.Contains(got.Errors[0].Error, "cancelled on request") {
		t.Fatalf("cancelled task: %+v", got)
	}
	if n := metric(t, a, "shardrun_tasks_finished_total", "stubborn", "cancelled"); n != 1 {
		t.Fatalf("tasks_finished_total{outcome=cancelled} = %v", n)
	}
	if n := metric(t, a, "shardrun_tasks_finished_total", "stubborn", "completed"); n != 0 {
		t.Fatalf("a cancelled attempt was counted completed")
	}
}

// Cancels race completions: tasks that sleep for up to two heartbeat
// intervals are cancelled as they run. Each ends with exactly one
// outcome, completed or cancelled, counted once.
func TestCancelRacesCompletionOnARunner(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start("a")
	c := e.client
	ctx := context.Background()
	const n = 60
	ids := make([]int64, n)
	for i := range ids {
		ms := (i * 600) / n // 0 to 600ms: two heartbeat intervals
		e, err := c.Enqueue(ctx, tasks.NewTask{Kind: "sleep", Payload: fmt.Appendf(nil, `{"ms": %d}`, ms)})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = e.ID
	}
	for _, id := range ids {
		testutil.Until(t, 10*time.Second, "the task started", func() (bool, string) {
			st := e.task(id).State
			return st != tasks.Ready, string(st)
		})
		if _, err := c.Cancel(ctx, id); err != nil && !errors.Is(err, tasks.ErrConflict) {
			t.Fatal(err)
		}
	}
	outcomes := map[tasks.State]int{}
	testutil.Until(t, 15*time.Second, "every task finished", func() (bool, string) {
		outcomes = map[tasks.State]int{}
		for _, id := range ids {
			outcomes[e.task(id).State]++
		}
		return outcomes[tasks.Completed]+outcomes[tasks.Cancelled] == n, fmt.Sprint(outcomes)
	})
	t.Logf("outcomes: %v", outcomes)
	for _, id := range ids {
		got := e.task(id)
		if got.State == tasks.Cancelled && (len(got.Errors) != 1 || got.Attempt != 1) {
			t.Fatalf("cancelled task %d: %+v", id, got)
		}
		if got.State == tasks.Completed && len(got.Errors) != 0 {
			t.Fatalf("completed task %d carries a cancellation: %+v", id, got)
		}
	}
	completed := metric(t, a, "shardrun_tasks_finished_total", "sleep", "completed")
	cancelled := metric(t, a, "shardrun_tasks_finished_total", "sleep", "cancelled")
	if int(completed) != outcomes[tasks.Completed] || int(cancelled) != outcomes[tasks.Cancelled] {
		t.Fatalf("outcomes counted: %v completed, %v cancelled; recorded %v", completed, cancelled, outcomes)
	}
}

func TestRetryADeadTaskAndSeeItComplete(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start("a")
	c := e.client
	ctx := context.Background()
	enq, err := c.Enqueue(ctx, tasks.NewTask{Kind: "fail", Payload: []byte(`{"times": 2}`), Options: tasks.Options{MaxAttempts: 2}})
	if err != nil {
		t.Fatal(err)
	}
	testutil.Until(t, 10*time.Second, "dead after two attempts", func() (bool, string) {
		return e.task(enq.ID).State == tasks.Dead, string(e.task(enq.ID).State)
	})
	got, err := c.Retry(ctx, enq.ID)
	if err != nil || got.State != tasks.Ready || got.Attempt != 3 || got.MaxAttempts != 4 {
		t.Fatalf("retry: %+v %v", got, err)
	}
	testutil.Until(t, 10*time.Second, "completed after the retry", func() (bool, string) {
		return e.task(enq.ID).State == tasks.Completed, string(e.task(enq.ID).State)
	})
	if got := e.task(enq.ID); got.Attempt != 3 || len(got.Errors) != 2 {
		t.Fatalf("the retried task: %+v (its two failures must be kept)", got)
	}
}

// 32 producers enqueue the same unique key at once: one task is created,
// and it runs once. Its handler returns only once every producer has
// returned: the key is free again when the task finishes, and on a busy
// machine a producer scheduled late would rightly create a second task.
func TestConcurrentProducersOfOneUniqueKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs counting
	produced := make(chan struct{})
	e.start("a", withHandler("count", func(ctx context.Context, task *tasks.Task) error {
		select {
		case <-produced:
		case <-ctx.Done():
			return ctx.Err()
		}
		return runs.handle(ctx, task)
	}))
	c := e.client
	const producers = 32
	ids := make(chan tasks.Enqueued, producers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range producers {
		wg.Go(func() {
			<-start
			got, err := c.Enqueue(context.Background(), tasks.NewTask{Kind: "count", Options: tasks.Options{UniqueKey: "invoice-7"}})
			if err != nil {
				t.Error(err)
				return
			}
			ids <- got
		})
	}
	close(start)
	wg.Wait()
	close(produced)
	close(ids)
	created := 0
	var id int64
	for got := range ids {
		if !got.Duplicate {
			created++
		}
		if id != 0 && got.ID != id {
			t.Fatalf("producers got tasks %d and %d", id, got.ID)
		}
		id = got.ID
	}
	if created != 1 {
		t.Fatalf("%d producers created a task, want 1", created)
	}
	testutil.Until(t, 10*time.Second, "the task completed", func() (bool, string) {
		return e.task(id).State == tasks.Completed, string(e.task(id).State)
	})
	runs.mu.Lock()
	defer runs.mu.Unlock()
	if len(runs.runs) != 1 || runs.runs[id] != 1 {
		t.Fatalf("runs %v, want task %d once", runs.runs, id)
	}
}
