package shardrun

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/argsjson"
	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/handlerctx"
	"github.com/shardrun/shardrun/tasks"
)

// Args is the payload of a typed task: its Kind names the handler that
// runs it (and must not depend on the value: it is called on the zero
// value too), and it travels as JSON.
type Args interface {
	Kind() string
}

// Task is one attempt of a typed task as its handler sees it: the task's
// record (ID, Attempt, Epoch, …; its SetResult stores a result) and its
// payload decoded into Args.
type Task[A Args] struct {
	*tasks.Task
	Args A
}

// Workers holds the handlers a client runs, one per kind.
type Workers struct {
	reg    *executor.Registry
	client atomic.Pointer[Client]
	// tx: some handler runs in a transaction of the client's pool
	// (AddWorkerTx), so the pool must serve one per worker.
	tx atomic.Bool
}

// NewWorkers returns an empty set of workers.
func NewWorkers() *Workers { return &Workers{reg: executor.NewRegistry()} }

// AddWorker registers fn as the handler of A's kind. fn's error fails the
// attempt (retried with backoff while attempts are left); wrap it with
// tasks.Permanent to end the task at once. A payload that does not decode
// into A fails the task at once (tasks.ErrPayload): no retry would decode
// it either. fn's context is cancelled when the runner loses the task's
// shard, detaches or stops, and when an operator cancels the task.
func AddWorker[A Args](w *Workers, fn func(ctx context.Context, t *Task[A]) error) error {
	return w.reg.Register(kindOf[A](), typed(fn))
}

// AddWorkerTx registers fn as the handler of A's kind, run in a
// transaction of the client's pool that also records the task's
// completion (CompleteTx): fn's writes and the completion commit together,
// or neither does. The completion is fenced: when the runner lost the
// task's shard meanwhile (it was paused or cut off past its lease, and
// another runner took the task over), the transaction is rolled back and
// fn's writes are not committed a second time. An error from fn rolls the
// transaction back and fails the attempt, as AddWorker's does.
//
// Each running task holds one connection of the pool given to NewClient
// for its transaction, so NewClient refuses a pool whose MaxConns is below
// Config.MaxWorkers when some worker is added with AddWorkerTx.
func AddWorkerTx[A Args](w *Workers, fn func(ctx context.Context, tx pgx.Tx, t *Task[A]) error) error {
	if err := w.reg.Register(kindOf[A](), typed(func(ctx context.Context, t *Task[A]) error {
		rt, ok := handlerctx.From(ctx)
		if !ok {
			return errNoRuntime
		}
		tx, err := rt.Begin(ctx)
		if err != nil {
			return fmt.Errorf("beginning the transaction of %s task %d: %w", t.Kind, t.ID, err)
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		if err := fn(ctx, tx, t); err != nil {
			return err
		}
		if err := rt.CompleteTx(ctx, tx, t.Task); err != nil {
			return err
		}
		return tx.Commit(ctx)
	})); err != nil {
		return err
	}
	w.tx.Store(true)
	return nil
}

// errNoRuntime: a handler's context that no runner (and no test package)
// gave it.
var errNoRuntime = errors.New("shardrun: the context is not the one the runner gives a task's handler (run it with Client.Start, or shardruntest in tests)")

// Handle registers an untyped handler for kind: for kinds known only at
// run time, or payloads a program decodes itself.
func (w *Workers) Handle(kind string, h tasks.Handler) error { return w.reg.Register(kind, h) }

// bind gives the workers the client that runs them.
func (w *Workers) bind(c *Client) error {
	if !w.client.CompareAndSwap(nil, c) && w.client.Load() != c {
		return errors.New("shardrun: these Workers belong to another client already")
	}
	return nil
}

// kindOf is A's kind, from its zero value (a new one, for a pointer
// type).
func kindOf[A Args]() string { return argsjson.Zero[A]().Kind() }

// typed adapts a typed handler: it decodes the payload into A, a payload
// that does not decode failing the task at once.
func typed[A Args](fn func(ctx context.Context, t *Task[A]) error) tasks.Handler {
	return func(ctx context.Context, t *tasks.Task) error {
		args, err := argsjson.Decode[A](t.Payload)
		if err != nil {
			return fmt.Errorf("%w of %s task %d: %w", tasks.ErrPayload, t.Kind, t.ID, err)
		}
		return fn(ctx, &Task[A]{Task: t, Args: args})
	}
}

// ErrTaskMovedOn says that a task's attempt no longer holds its claim
// though its runner still owns the shard: the leader's stale-claim sweep
// requeued it, an operator's move ended it, or its completion was
// committed already by another transaction. A write for the attempt
// changes nothing.
var ErrTaskMovedOn = errors.New("the task moved on: this attempt no longer holds it")

// CompleteTx records the completion of t, the attempt a handler runs,
// inside tx, a transaction of the program's own on the cluster's database:
// the program's writes in tx and the completion commit together or not at
// all. ctx must be the handler's context (or one derived from it): it
// carries what runs the task. Call it last, right before committing, and
// return the commit's error from the handler: nil tells the runner the
// task is done. AddWorkerTx does all of this for you.
//
// It locks one row in tx, the attempt's claim, and nothing else waits for
// it but this task's own end: the runner's heartbeats and writes, other
// runners and the sweeps skip it while tx is open. From this call on, tx
// must end within the runner's lease TTL (Config.LeaseTTL): PostgreSQL
// cancels a later statement that runs longer and ends the transaction if
// it sits idle longer (statement_timeout and
// idle_in_transaction_session_timeout, set for tx alone); the writes then
// roll back and the attempt is retried like any lost one.
//
// The completion is fenced: when the runner has lost the task's shard (a
// new owner requeued the attempt) it fails with tasks.ErrOwnershipLost,
// and with ErrTaskMovedOn when the attempt was swept or ended meanwhile,
// or its completion was committed already by another transaction; roll tx
// back then, and the program's writes are not committed twice. What the
// handler did outside the database is not covered: it may have happened
// in an attempt whose completion was refused, and happen again in the
// next.
func CompleteTx(ctx context.Context, tx pgx.Tx, t *tasks.Task) error {
	rt, ok := handlerctx.From(ctx)
	if !ok {
		return errNoRuntime
	}
	return rt.CompleteTx(ctx, tx, t)
}

// runtime is what the client's runner puts in a handler's context: the
// client, and the shard of the task the handler runs.
type runtime struct {
	c     *Client
	shard int
}

// CompleteTx records the attempt's completion in its shard's database,
// under the claim's owner: a tx on another database is refused, naming
// both, and nothing is committed there.
func (r runtime) CompleteTx(ctx context.Context, tx pgx.Tx, t *tasks.Task) error {
	res, err := r.c.router.CompleteTx(ctx, tx, t.ClaimedBy, claims.Completion{Ref: claims.RefOf(*t), Result: t.Result})
	if err != nil {
		return fmt.Errorf("shardrun: completing task %d: %w", t.ID, err)
	}
	switch res.Outcome {
	case claims.Applied:
		return nil
	case claims.FenceLost:
		return fmt.Errorf("shardrun: completing task %d (shard %d, epoch %d): %w", t.ID, t.Shard, t.Epoch, tasks.ErrOwnershipLost)
	default:
		return fmt.Errorf("shardrun: completing task %d attempt %d (%s): %w", t.ID, t.Attempt, res.Outcome, ErrTaskMovedOn)
	}
}

// Begin starts an AddWorkerTx handler's transaction on the pool of its
// task's database.
func (r runtime) Begin(ctx context.Context) (pgx.Tx, error) {
	name, _ := r.c.router.Of(r.shard)
	pool := r.c.pools[name]
	if pool == nil {
		return nil, fmt.Errorf("shardrun: shard %d's database %q has no pool in this client", r.shard, name)
	}
	return pool.Begin(ctx)
}

// withRuntime wraps h so that its context carries the client's runtime.
func (c *Client) withRuntime(h tasks.Handler) tasks.Handler {
	return func(ctx context.Context, t *tasks.Task) error {
		return h(handlerctx.With(ctx, runtime{c: c, shard: t.Shard}), t)
	}
}
