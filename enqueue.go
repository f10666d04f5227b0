package shardrun

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/tasks"
)

// EnqueueOpts are a task's options (tasks.Options, the one shape of them:
// the same fields in a tasks.NewTask, a PeriodicTask's Opts and the JSON
// of POST /api/tasks); the zero value of each is its default. Key decides
// the task's shard (default: a random one); UniqueKey makes the enqueue
// idempotent while an unfinished task holds it (Duplicate); Queue
// (default "default") and Priority (1 most urgent to 5, default 3);
// MaxAttempts (default Config.MaxAttempts, 5); RunAfter delays the task
// and Deadline fails it when it has not finished by then; SequenceKey runs
// the tasks of one key one at a time, in enqueue order, a task of it that
// ends dead or failed holding the rest back until an operator retries or
// cancels it, unless SequenceContinue.
type EnqueueOpts = tasks.Options

// Enqueued is what an enqueue did: the task's id (an existing one when
// Duplicate), and Warnings when no attached runner can run the task yet
// (no runner serves its queue with a handler of its kind): it stays ready
// until one attaches.
type Enqueued struct {
	tasks.Enqueued
	Warnings []string
}

// EnqueueParams is one task of EnqueueMany.
type EnqueueParams struct {
	Args Args
	Opts *EnqueueOpts
}

// EnqueuedMany is what EnqueueMany did (tasks.BatchEnqueued), with the
// warnings of Enqueued.
type EnqueuedMany struct {
	tasks.BatchEnqueued
	Warnings []string
}

// newTask is the untyped task of args.
func newTask(args Args, opts *EnqueueOpts) (tasks.NewTask, error) {
	if args == nil {
		return tasks.NewTask{}, &tasks.FieldError{Field: "args", Problem: "nil"}
	}
	payload, err := json.Marshal(args)
	if err != nil {
		return tasks.NewTask{}, &tasks.FieldError{Field: "payload", Problem: fmt.Sprintf("encoding %T: %v", args, err)}
	}
	return tasks.NewTask{Kind: args.Kind(), Payload: payload, Options: *cmp.Or(opts, &EnqueueOpts{})}, nil
}

// Enqueue enqueues a task of args's kind with args as its payload.
func (c *Client) Enqueue(ctx context.Context, args Args, opts *EnqueueOpts) (Enqueued, error) {
	return c.EnqueueTx(ctx, nil, args, opts)
}

// EnqueueTx is Enqueue inside tx, the program's own transaction on the
// cluster's database: the task exists once tx commits, not at all if it
// rolls back, and runners are woken by the commit. Keep tx READ COMMITTED
// (the default) for tasks with a unique key or a sequence key. A nil tx
// enqueues on its own.
func (c *Client) EnqueueTx(ctx context.Context, tx pgx.Tx, args Args, opts *EnqueueOpts) (Enqueued, error) {
	n, err := newTask(args, opts)
	if err != nil {
		return Enqueued{}, err
	}
	return c.EnqueueTaskTx(ctx, tx, n)
}

// EnqueueTask enqueues an untyped task: for kinds known only at run time.
func (c *Client) EnqueueTask(ctx context.Context, n tasks.NewTask) (Enqueued, error) {
	return c.EnqueueTaskTx(ctx, nil, n)
}

// EnqueueTaskTx is EnqueueTask inside tx (see EnqueueTx).
func (c *Client) EnqueueTaskTx(ctx context.Context, tx pgx.Tx, n tasks.NewTask) (Enqueued, error) {
	e, err := c.tasks.EnqueueTx(ctx, tx, n)
	if err != nil {
		return Enqueued{}, err
	}
	return Enqueued{Enqueued: e, Warnings: c.warnings(ctx, n)}, nil
}

// BatchError names the task of a batch that is invalid; nothing of the
// batch was enqueued.
type BatchError = tasks.BatchError

// EnqueueMany enqueues a batch in one transaction: all of it or, when one
// is invalid, none (a *BatchError naming it).
func (c *Client) EnqueueMany(ctx context.Context, batch []EnqueueParams) (EnqueuedMany, error) {
	return c.EnqueueManyTx(ctx, nil, batch)
}

// EnqueueManyTx is EnqueueMany inside tx (see EnqueueTx).
func (c *Client) EnqueueManyTx(ctx context.Context, tx pgx.Tx, batch []EnqueueParams) (EnqueuedMany, error) {
	ns := make([]tasks.NewTask, len(batch))
	for i, p := range batch {
		n, err := newTask(p.Args, p.Opts)
		if err != nil {
			return EnqueuedMany{}, &tasks.BatchError{Index: i, Len: len(batch), Err: err}
		}
		ns[i] = n
	}
	res, err := c.tasks.EnqueueBatchTx(ctx, tx, ns)
	if err != nil {
		return EnqueuedMany{}, err
	}
	return EnqueuedMany{BatchEnqueued: res, Warnings: c.warnings(ctx, ns...)}, nil
}

// warnings says which of the tasks no attached runner can run. It is
// advice: when etcd does not answer, it says nothing.
func (c *Client) warnings(ctx context.Context, ns ...tasks.NewTask) []string {
	if c.caps == nil {
		return nil // no etcd: the fleet's membership is not known here
	}
	runnable, err := c.caps.Runnable(ctx)
	if err != nil {
		return nil
	}
	classes := make([]tasks.Class, len(ns))
	for i, n := range ns {
		classes[i] = n.Class()
	}
	return client.Warnings(runnable, classes)
}
