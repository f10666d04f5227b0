// Package shardruntest tests a program's shardrun workers and producers
// without a cluster: no etcd, no runner, and for Work no database.
//
// Work runs a typed worker on a task of given arguments, as a runner would
// (the payload goes through JSON; the context carries what
// shardrun.CompleteTx needs). WorkTx runs an AddWorkerTx-style worker
// inside the test's own transaction, so the test reads what the worker
// wrote, and its rollback undoes it. RequireEnqueuedTx checks that code
// under test enqueued a task in a transaction (it needs shardrun's tables:
// a database a shardrun client has opened once).
//
//	func TestChargeWorker(t *testing.T) {
//		tx, _ := pool.Begin(ctx) // the test's own transaction
//		defer tx.Rollback(ctx)
//		res := shardruntest.WorkTx(ctx, t, tx, chargeWorker, Charge{Order: "o-1", Cents: 500}, nil)
//		if res.Err != nil || !res.Completed {
//			t.Fatal(res.Err)
//		}
//		// read the charges table in tx…
//	}
package shardruntest

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/internal/argsjson"
	"github.com/shardrun/shardrun/internal/handlerctx"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Opts are the fields of the worked task a worker may read; zero fields
// take the values of a task's first attempt (ID 1, Attempt 1,
// MaxAttempts tasks.DefaultMaxAttempts, the default queue and priority,
// Epoch 1).
type Opts struct {
	ID          int64
	Attempt     int
	MaxAttempts int
	Queue       string
	Priority    int
	Key         string
	Shard       int
	Epoch       int64
}

// Result is what working one task did.
type Result struct {
	// Task is the task as the worker left it (Result set by SetResult).
	Task *tasks.Task
	// Err is what the worker returned.
	Err error
	// Completed: the worker's completion was recorded in its transaction,
	// by shardrun.CompleteTx, or by WorkTx as AddWorkerTx records it.
	Completed bool
}

// Work runs fn on a task of args as a runner would: args is encoded as
// the payload and decoded into the task's Args (an Args that does not
// survive JSON fails the test), and fn's context carries what
// shardrun.CompleteTx needs: called in fn, it records the completion in
// Result and writes nothing.
func Work[A shardrun.Args](ctx context.Context, tb testing.TB, fn func(ctx context.Context, t *shardrun.Task[A]) error, args A, opts *Opts) Result {
	tb.Helper()
	t := newTask(tb, args, opts)
	rt := &runtime{tb: tb}
	err := fn(handlerctx.With(ctx, rt), t)
	return Result{Task: t.Task, Err: err, Completed: rt.completed}
}

// WorkTx runs fn, a worker as AddWorkerTx registers it, inside tx, the
// test's own transaction, in a savepoint (a nested pgx transaction) that
// fn's error rolls back, as AddWorkerTx's transaction would be: what fn
// wrote stays in tx for the test to read, and goes with tx's rollback.
// The completion is recorded as AddWorkerTx records it.
func WorkTx[A shardrun.Args](ctx context.Context, tb testing.TB, tx pgx.Tx, fn func(ctx context.Context, tx pgx.Tx, t *shardrun.Task[A]) error, args A, opts *Opts) Result {
	tb.Helper()
	t := newTask(tb, args, opts)
	rt := &runtime{tb: tb, tx: tx}
	hctx := handlerctx.With(ctx, rt)
	err := pgx.BeginFunc(hctx, tx, func(sp pgx.Tx) error {
		if err := fn(hctx, sp, t); err != nil {
			return err
		}
		return shardrun.CompleteTx(hctx, sp, t.Task)
	})
	return Result{Task: t.Task, Err: err, Completed: err == nil && rt.completed}
}

// RequireEnqueuedTx fails tb unless tx sees a task of A's kind, and
// returns the newest one, its payload decoded into Args. tx is a
// transaction the code under test enqueued in (shardrun.Client.EnqueueTx),
// not committed yet, or any transaction after it committed.
func RequireEnqueuedTx[A shardrun.Args](ctx context.Context, tb testing.TB, tx pgx.Tx) *shardrun.Task[A] {
	tb.Helper()
	kind := argsjson.Zero[A]().Kind()
	found, err := store.EnqueuedIn(ctx, tx, kind, 1)
	if err != nil {
		tb.Fatalf("shardruntest: %v", err)
	}
	if len(found) == 0 {
		tb.Fatalf("shardruntest: no task of kind %q was enqueued in the transaction", kind)
	}
	t := found[0]
	args, err := argsjson.Decode[A](t.Payload)
	if err != nil {
		tb.Fatalf("shardruntest: the payload of task %d does not decode into %T: %v", t.ID, args, err)
	}
	return &shardrun.Task[A]{Task: &t, Args: args}
}

// newTask is the task a runner would hand fn for args.
func newTask[A shardrun.Args](tb testing.TB, args A, opts *Opts) *shardrun.Task[A] {
	tb.Helper()
	payload, err := json.Marshal(args)
	if err != nil {
		tb.Fatalf("shardruntest: encoding %T: %v", args, err)
	}
	decoded, err := argsjson.Decode[A](payload)
	if err != nil {
		tb.Fatalf("shardruntest: the payload of %T does not decode back: %v", args, err)
	}
	o := cmp.Or(opts, &Opts{})
	now := time.Now()
	filled := tasks.Options{Queue: o.Queue, Priority: o.Priority, MaxAttempts: o.MaxAttempts}.WithDefaults(tasks.DefaultMaxAttempts)
	t := &tasks.Task{ID: cmp.Or(o.ID, 1), Kind: args.Kind(), Shard: o.Shard, Key: cmp.Or(o.Key, "shardruntest"),
		Queue: filled.Queue, Priority: filled.Priority, Payload: payload,
		State: tasks.Running, Attempt: cmp.Or(o.Attempt, 1), MaxAttempts: filled.MaxAttempts,
		Epoch: cmp.Or(o.Epoch, 1), ClaimedBy: "shardruntest", RunAfter: now, CreatedAt: now, ClaimedAt: &now}
	return &shardrun.Task[A]{Task: t, Args: decoded}
}

// runtime stands in for the runner in a worker's context.
type runtime struct {
	tb        testing.TB
	tx        pgx.Tx // WorkTx's transaction; nil for Work
	completed bool
}

// CompleteTx records the completion; it writes nothing.
func (r *runtime) CompleteTx(_ context.Context, tx pgx.Tx, t *tasks.Task) error {
	if tx == nil {
		return fmt.Errorf("shardruntest: CompleteTx of task %d without a transaction", t.ID)
	}
	r.completed = true
	return nil
}

// Begin opens a savepoint in WorkTx's transaction, where an AddWorkerTx
// handler's own transaction would begin.
func (r *runtime) Begin(ctx context.Context) (pgx.Tx, error) {
	if r.tx == nil {
		return nil, fmt.Errorf("shardruntest: the worker began a transaction: work it with WorkTx")
	}
	return r.tx.Begin(ctx)
}
