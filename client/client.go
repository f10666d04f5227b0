// Package client is shardrun's Go client for producers and operators, on
// the database: enqueue tasks (idempotently with a unique key, and inside
// the producer's own transaction so that a task commits or rolls back with
// the business rows it belongs to), and inspect, cancel and retry them.
//
//	c, err := client.New(st, tasks.ClientConfig{ShardCount: 256})
//	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		if _, err := tx.Exec(ctx, `INSERT INTO orders …`); err != nil {
//			return err
//		}
//		_, err := c.EnqueueTx(ctx, tx, tasks.NewTask{Kind: "send-receipt", Key: orderID, UniqueKey: "receipt/" + orderID})
//		return err
//	})
//
// Errors about one task are typed: errors.Is(err, tasks.ErrNotFound) for a
// task that does not exist, and a *tasks.ConflictError (errors.As) for
// an operation its state does not allow (cancelling a finished task,
// retrying one that is not dead, failed or cancelled), which names the
// state. Invalid tasks and filters give a *tasks.FieldError naming the
// field.
package client

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Client enqueues, inspects, cancels and retries tasks.
type Client struct {
	st         *store.Store
	prep       *tasks.Client
	shardCount int
}

// New returns a client on st. cfg gives the cluster's shard count, which
// decides every task's shard, and the default max_attempts.
func New(st *store.Store, cfg tasks.ClientConfig) (*Client, error) {
	prep, err := tasks.NewClient(st, cfg)
	if err != nil {
		return nil, err
	}
	return &Client{st: st, prep: prep, shardCount: cfg.ShardCount}, nil
}

// Enqueue validates and inserts one task. With a unique key that an
// unfinished task holds, nothing is inserted and that task's id comes back
// with Duplicate set.
func (c *Client) Enqueue(ctx context.Context, n tasks.NewTask) (tasks.Enqueued, error) {
	return c.EnqueueTx(ctx, nil, n)
}

// EnqueueTx is Enqueue inside tx, the producer's own transaction: the task
// exists once tx commits and not at all if it rolls back, and runners are
// woken only by the commit. tx should be READ COMMITTED (PostgreSQL's
// default) when the task has a unique key: a stricter isolation level
// cannot see a holder that committed after it began. A nil tx enqueues on
// its own.
func (c *Client) EnqueueTx(ctx context.Context, tx pgx.Tx, n tasks.NewTask) (tasks.Enqueued, error) {
	in, err := c.prep.Prepare(n)
	if err != nil {
		return tasks.Enqueued{}, err
	}
	return c.st.EnqueueIn(ctx, tx, in)
}

// EnqueueBatch validates every task first and inserts none if any is
// invalid (the error names the index of the first bad one). A batch with
// unique keys reports each task's id and whether it was a duplicate; one
// without goes by COPY and reports its count only.
func (c *Client) EnqueueBatch(ctx context.Context, ns []tasks.NewTask) (tasks.BatchEnqueued, error) {
	return c.EnqueueBatchTx(ctx, nil, ns)
}

// EnqueueBatchTx is EnqueueBatch inside tx, as EnqueueTx.
func (c *Client) EnqueueBatchTx(ctx context.Context, tx pgx.Tx, ns []tasks.NewTask) (tasks.BatchEnqueued, error) {
	ins := make([]tasks.Insert, len(ns))
	for i, n := range ns {
		in, err := c.prep.Prepare(n)
		if err != nil {
			return tasks.BatchEnqueued{}, fmt.Errorf("task %d of %d: %w", i, len(ns), err)
		}
		ins[i] = in
	}
	return c.st.EnqueueBatchIn(ctx, tx, ins)
}

// Get returns one task with its payload, history and result.
func (c *Client) Get(ctx context.Context, id int64) (tasks.Task, error) {
	return c.st.Get(ctx, id)
}

// List returns one page of tasks; follow Page.Next (as req.After) until it
// is 0. The filter is checked as a task's fields are (tasks.Filter.Check).
// Limit 0 is "not set", the default page of tasks.DefaultListLimit, as a
// request without limit is in the HTTP API (which refuses limit=0: a value
// that is given must be valid).
func (c *Client) List(ctx context.Context, req tasks.ListRequest) (tasks.Page, error) {
	if req.Limit < 0 || req.Limit > tasks.MaxListLimit {
		return tasks.Page{}, &tasks.FieldError{Field: "limit", Problem: fmt.Sprintf("must be 1 to %d (0 for the default, %d), got %d", tasks.MaxListLimit, tasks.DefaultListLimit, req.Limit)}
	}
	if err := req.Filter.Check(c.shardCount); err != nil {
		return tasks.Page{}, err
	}
	return c.st.List(ctx, req)
}

// Cancel cancels a task: a ready one at once (its state is then
// cancelled), a running one by a request its runner acts on within one
// heartbeat interval (its state is still running, with CancelRequestedAt
// set; it ends cancelled unless it completed or failed first).
func (c *Client) Cancel(ctx context.Context, id int64) (tasks.Task, error) {
	return c.st.CancelTask(ctx, id)
}

// Retry puts a dead, failed or cancelled task back to ready, with as many
// further attempts as it was enqueued with, its history kept.
func (c *Client) Retry(ctx context.Context, id int64) (tasks.Task, error) {
	return c.st.RetryTask(ctx, id)
}

// bulkBudget is how long one store call of a bulk operation runs before
// the client continues from its cursor: it bounds a transaction's time,
// not the operation's.
const bulkBudget = 10 * time.Second

// CancelMatching cancels every ready and running task matching f (f must
// filter on something), in bounded batches, and says how many it cancelled
// at once and how many running ones it asked to cancel.
func (c *Client) CancelMatching(ctx context.Context, f tasks.Filter) (tasks.BulkResult, error) {
	if err := f.Check(c.shardCount); err != nil {
		return tasks.BulkResult{}, err
	}
	return bulk(ctx, f, c.st.CancelMatching)
}

// RetryMatching retries every dead, failed and cancelled task matching f,
// as Retry, in bounded batches. Of tasks sharing a unique key only the
// newest is retried, and none whose key an unfinished task holds (Skipped).
func (c *Client) RetryMatching(ctx context.Context, f tasks.Filter) (tasks.BulkResult, error) {
	if err := f.Check(c.shardCount); err != nil {
		return tasks.BulkResult{}, err
	}
	return bulk(ctx, f, c.st.RetryMatching)
}

func bulk(ctx context.Context, f tasks.Filter,
	op func(context.Context, tasks.Filter, int64, time.Duration) (tasks.BulkResult, error)) (tasks.BulkResult, error) {
	var total tasks.BulkResult
	var after int64
	for {
		r, err := op(ctx, f, after, bulkBudget)
		total.Add(r)
		if err != nil {
			return total, err
		}
		if r.Done {
			total.Done = true
			return total, nil
		}
		after = r.Next
	}
}
