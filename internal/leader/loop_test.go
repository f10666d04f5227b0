package leader

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/store"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fake is a service whose passes return what the test says.
type fake struct {
	name   string
	begun  atomic.Int64 // the epoch of the last Begin
	passes atomic.Int32
	result func(n int32) Result
	wake   wake.Signal
}

func (f *fake) Name() string          { return f.name }
func (f *fake) Begin(t Term)          { f.begun.Store(t.Epoch) }
func (f *fake) Wake() <-chan struct{} { return f.wake.C() }
func (f *fake) Pass(context.Context, *Pass) Result {
	return f.result(f.passes.Add(1))
}

// One service finding the fence moved ends the term of all of them; a
// failed pass is counted and the loop carries on; Wake runs a pass before
// its time; each term begins every service again.
func TestLoopRunsEveryServiceForOneTerm(t *testing.T) {
	fc := clock.NewFake()
	reg := prometheus.NewRegistry()
	var deposed atomic.Bool
	a := &fake{name: "a", wake: wake.New(), result: func(n int32) Result {
		if n == 2 {
			return Result{Next: time.Hour, Err: errors.New("database away")}
		}
		return Result{Next: time.Hour, Detail: n}
	}}
	b := &fake{name: "b", wake: wake.New(), result: func(int32) Result {
		if deposed.Load() {
			return Result{Next: time.Hour, Err: fmt.Errorf("sweeping: %w", store.ErrNotLeader)}
		}
		return Result{Next: time.Hour}
	}}
	l := New(Config{Clock: fc, Registry: reg}, a, b)
	events := testsignal.New[Event]()
	l.Events = events
	done := make(chan error, 1)
	go func() { done <- l.Run(context.Background(), 7) }()
	wait := func(what string, match func(Event) bool) {
		t.Helper()
		if _, ok := events.Wait(5*time.Second, match); !ok {
			t.Fatalf("%s: %+v", what, events.Events())
		}
	}
	wait("a's first pass", func(e Event) bool { return e.Service == "a" && e.Epoch == 7 })
	a.wake.Notify()
	wait("a's second pass, woken, failed", func(e Event) bool { return e.Service == "a" && e.Err != nil })
	if got := testutil.ToFloat64(l.services[0].errors); got != 1 {
		t.Fatalf("shardrun_a_errors_total = %v, want 1", got)
	}
	deposed.Store(true)
	b.wake.Notify()
	if err := <-done; !errors.Is(err, store.ErrNotLeader) {
		t.Fatalf("Run returned %v, want ErrNotLeader", err)
	}
	wait("b's pass saw the fence moved", func(e Event) bool { return e.Service == "b" && e.NotLeader })

	deposed.Store(false) // a new term, under a fence that holds it
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- l.Run(ctx, 8) }()
	wait("a term of epoch 8", func(e Event) bool { return e.Epoch == 8 })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run returned %v when its term ended", err)
	}
	if a.begun.Load() != 8 || b.begun.Load() != 8 {
		t.Fatalf("services begun at epochs %d and %d, want 8", a.begun.Load(), b.begun.Load())
	}
}
