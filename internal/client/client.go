// Package client is the one way tasks enter the database and are operated
// on, inside the module: Config.Prepare turns a tasks.NewTask into a
// store.Insert (checked, its options filled with their defaults, its key
// and shard drawn), and Tasks enqueues (idempotently with a unique key,
// and inside the producer's own transaction), gets, lists, cancels and
// retries. The library's shardrun.Client, the coordinator's HTTP API, the
// --dev demo stream and the leader's scheduler (Config.Prepare) all go
// through it. It is not the library's API: programs use shardrun.Client.
//
// Errors about one task are typed: errors.Is(err, tasks.ErrNotFound) for a
// task that does not exist, and a *tasks.ConflictError (errors.As) for
// an operation its state does not allow (cancelling a finished task,
// retrying one that is not dead, failed or cancelled), which names the
// state. Invalid tasks and filters give a *tasks.FieldError naming the
// field, and an invalid task of a batch a *tasks.BatchError.
package client

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Config configures the task operations (New) and the preparation of
// every enqueued task (Prepare).
type Config struct {
	// ShardCount is the cluster's shard count (etcd meta/shard-count);
	// required, since it decides every task's shard.
	ShardCount int
	// MaxAttempts for tasks that do not set one. Default
	// tasks.DefaultMaxAttempts.
	MaxAttempts int
	// Clock checks deadlines; default the real clock.
	Clock clock.Clock
	// TracerProvider, when set, traces every enqueue: a span that is a
	// child of the span in the caller's context, whose trace context is
	// stored with the task so that the runner's spans join its trace
	// (docs/reference.md, Traces). Pass otel.GetTracerProvider() to use the global
	// one. Nil: no span, and nothing extra stored.
	TracerProvider trace.TracerProvider
}

// WithDefaults returns c with its zero fields replaced by the defaults.
func (c Config) WithDefaults() Config {
	c.MaxAttempts = cmp.Or(c.MaxAttempts, tasks.DefaultMaxAttempts)
	c.Clock = cmp.Or(c.Clock, clock.Real())
	return c
}

// Validate reports a bad setting as a *tasks.FieldError.
func (c Config) Validate() error {
	if c.ShardCount < 1 {
		return &tasks.FieldError{Field: "shard_count", Problem: fmt.Sprintf("must be at least 1, got %d (unknown shard count)", c.ShardCount)}
	}
	if c.MaxAttempts < 1 || c.MaxAttempts > tasks.MaxAttemptsLimit {
		return &tasks.FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be 1 to %d, got %d", tasks.MaxAttemptsLimit, c.MaxAttempts)}
	}
	return nil
}

// Prepare validates n against now (tasks.NewTask.Check) and makes the
// insert every enqueue makes: the options with their defaults
// (tasks.Options.WithDefaults, with the configured max_attempts), the
// unique key as the key of a task that has one and no key (so that a
// unique key lives in one shard), else a random key when none is given,
// {} for no payload, and the shard of the
// key (of the sequence key, for a task of a sequence). c must be valid
// (WithDefaults, Validate). The leader's scheduler prepares the task of
// every schedule tick with it, with the database's time as now.
func (c Config) Prepare(n tasks.NewTask, now time.Time) (store.Insert, error) {
	if err := n.Check(now); err != nil {
		return store.Insert{}, err
	}
	n.Options = n.WithDefaults(c.MaxAttempts)
	// A task with a unique key and no key is sharded by its unique key:
	// every task of one unique key lives in one shard, and so in one
	// database of a cluster of several, where the key's uniqueness is kept.
	n.Key = cmp.Or(n.Key, n.UniqueKey, tasks.RandomKey())
	if len(n.Payload) == 0 {
		n.Payload = json.RawMessage("{}")
	}
	// A sequence's tasks share one shard, so one fenced owner runs it.
	return store.Insert{NewTask: n, Shard: tasks.ShardOf(cmp.Or(n.SequenceKey, n.Key), c.ShardCount)}, nil
}

// Store is what the task operations need from the cluster's databases:
// a *store.Router, which routes each statement by its task's shard and
// merges the reads of every database, or the *store.Store of a cluster
// of one.
type Store interface {
	EnqueueIn(ctx context.Context, tx pgx.Tx, in store.Insert) (tasks.Enqueued, error)
	EnqueueBatchIn(ctx context.Context, tx pgx.Tx, ins []store.Insert) (tasks.BatchEnqueued, error)
	Get(ctx context.Context, id int64) (tasks.Task, error)
	List(ctx context.Context, req tasks.ListRequest) (tasks.Page, error)
	CancelTask(ctx context.Context, id int64) (tasks.Task, error)
	RetryTask(ctx context.Context, id int64) (tasks.Task, error)
	CancelMatching(ctx context.Context, f tasks.Filter, after int64, budget time.Duration) (tasks.BulkResult, error)
	RetryMatching(ctx context.Context, f tasks.Filter, after int64, budget time.Duration) (tasks.BulkResult, error)
}

var (
	_ Store = (*store.Store)(nil)
	_ Store = (*store.Router)(nil)
)

// Tasks enqueues, inspects, cancels and retries tasks.
type Tasks struct {
	st  Store
	cfg Config
	// tracer is nil with tracing off.
	tracer trace.Tracer
}

// New returns the task operations on st (a *store.Router for a cluster
// of several databases). cfg gives the cluster's shard count, which
// decides every task's shard, and the default max_attempts.
func New(st Store, cfg Config) (*Tasks, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Tasks{st: st, cfg: cfg, tracer: tracing.Tracer(cfg.TracerProvider)}, nil
}

// Enqueue validates and inserts one task. With a unique key that an
// unfinished task holds, nothing is inserted and that task's id comes back
// with Duplicate set.
func (c *Tasks) Enqueue(ctx context.Context, n tasks.NewTask) (tasks.Enqueued, error) {
	return c.EnqueueTx(ctx, nil, n)
}

// EnqueueTx is Enqueue inside tx, the producer's own transaction: the task
// exists once tx commits and not at all if it rolls back, and runners are
// woken only by the commit. tx should be READ COMMITTED (PostgreSQL's
// default) when the task has a unique key or a sequence key: a stricter
// isolation level cannot see a unique key's holder that committed after it
// began, and the task joins its sequence at the commit, where a REPEATABLE
// READ or SERIALIZABLE transaction whose sequence moved since its snapshot
// fails with a serialization failure (SQLSTATE 40001; retry it, as any
// such failure). A nil tx enqueues on its own.
//
// With tracing on, the span "shardrun.enqueue" covers the insert (not the
// commit of tx) and its trace context is stored with the task.
func (c *Tasks) EnqueueTx(ctx context.Context, tx pgx.Tx, n tasks.NewTask) (e tasks.Enqueued, err error) {
	var span trace.Span
	if c.tracer != nil {
		ctx, span = c.tracer.Start(ctx, "shardrun.enqueue", trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(tracing.TaskKind.String(n.Kind)))
		defer func() {
			if err == nil {
				span.SetAttributes(tracing.TaskID.Int64(e.ID))
				if e.Duplicate {
					span.SetAttributes(tracing.TaskDuplicate.Bool(true))
				}
			}
			tracing.End(span, err)
		}()
	}
	in, err := c.cfg.Prepare(n, c.cfg.Clock.Now())
	if err != nil {
		return tasks.Enqueued{}, err
	}
	if span != nil {
		span.SetAttributes(tracing.TaskShard.Int(in.Shard), tracing.TaskQueue.String(in.Queue))
		in.TraceContext = tracing.Inject(ctx)
	}
	e, err = c.st.EnqueueIn(ctx, tx, in)
	if err == nil && !e.Duplicate {
		e.Shard, e.Key = in.Shard, in.Key
	}
	return e, err
}

// EnqueueBatch validates every task first and inserts none if any is
// invalid (a *tasks.BatchError names the first bad one). A batch with unique
// keys reports each task's id and whether it was a duplicate; one without
// goes by COPY and reports its count only.
func (c *Tasks) EnqueueBatch(ctx context.Context, ns []tasks.NewTask) (tasks.BatchEnqueued, error) {
	return c.EnqueueBatchTx(ctx, nil, ns)
}

// EnqueueBatchTx is EnqueueBatch inside tx, as EnqueueTx.
//
// With tracing on, one span "shardrun.enqueue_batch" covers the batch, and
// every task stores its trace context: each task's spans are its children.
func (c *Tasks) EnqueueBatchTx(ctx context.Context, tx pgx.Tx, ns []tasks.NewTask) (res tasks.BatchEnqueued, err error) {
	traceContext := ""
	if c.tracer != nil {
		var span trace.Span
		ctx, span = c.tracer.Start(ctx, "shardrun.enqueue_batch", trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(tracing.BatchSize.Int(len(ns))))
		defer func() {
			if err == nil {
				span.SetAttributes(attribute.Int64("shardrun.batch.inserted", res.Inserted),
					attribute.Int64("shardrun.batch.duplicates", res.Duplicates))
			}
			tracing.End(span, err)
		}()
		traceContext = tracing.Inject(ctx)
	}
	ins := make([]store.Insert, len(ns))
	now := c.cfg.Clock.Now()
	for i, n := range ns {
		in, err := c.cfg.Prepare(n, now)
		if err != nil {
			return tasks.BatchEnqueued{}, &tasks.BatchError{Index: i, Len: len(ns), Err: err}
		}
		in.TraceContext = traceContext
		ins[i] = in
	}
	res, err = c.st.EnqueueBatchIn(ctx, tx, ins)
	for i := range res.Tasks {
		if !res.Tasks[i].Duplicate {
			res.Tasks[i].Shard, res.Tasks[i].Key = ins[i].Shard, ins[i].Key
		}
	}
	return res, err
}

// Get returns one task with its payload, history and result.
func (c *Tasks) Get(ctx context.Context, id int64) (tasks.Task, error) {
	return c.st.Get(ctx, id)
}

// List returns one page of tasks; follow Page.Next (as req.After) until it
// is 0. The filter is checked as a task's fields are (tasks.Filter.Check).
// Limit 0 is "not set", the default page of tasks.DefaultListLimit, as a
// request without limit is in the HTTP API (which refuses limit=0: a value
// that is given must be valid).
func (c *Tasks) List(ctx context.Context, req tasks.ListRequest) (tasks.Page, error) {
	if req.Limit < 0 || req.Limit > tasks.MaxListLimit {
		return tasks.Page{}, &tasks.FieldError{Field: "limit", Problem: fmt.Sprintf("must be 1 to %d (0 for the default, %d), got %d", tasks.MaxListLimit, tasks.DefaultListLimit, req.Limit)}
	}
	if err := req.Filter.Check(c.cfg.ShardCount); err != nil {
		return tasks.Page{}, err
	}
	return c.st.List(ctx, req)
}

// Cancel cancels a task: a ready one at once (its state is then
// cancelled), a running one by a request its runner acts on within one
// heartbeat interval (its state is still running, with CancelRequestedAt
// set; it ends cancelled unless it completed or failed first).
func (c *Tasks) Cancel(ctx context.Context, id int64) (tasks.Task, error) {
	return c.st.CancelTask(ctx, id)
}

// Retry puts a dead, failed or cancelled task back to ready, with as many
// further attempts as it was enqueued with, its history kept.
func (c *Tasks) Retry(ctx context.Context, id int64) (tasks.Task, error) {
	return c.st.RetryTask(ctx, id)
}

// bulkBudget is how long one store call of a bulk operation runs before
// the client continues from its cursor: it bounds a transaction's time,
// not the operation's.
const bulkBudget = 10 * time.Second

// CancelMatching cancels every ready and running task matching f (f must
// filter on something), in bounded batches, and says how many it cancelled
// at once and how many running ones it asked to cancel.
func (c *Tasks) CancelMatching(ctx context.Context, f tasks.Filter) (tasks.BulkResult, error) {
	if err := f.Check(c.cfg.ShardCount); err != nil {
		return tasks.BulkResult{}, err
	}
	return bulk(ctx, f, c.st.CancelMatching)
}

// RetryMatching retries every dead, failed and cancelled task matching f,
// as Retry, in bounded batches. Of tasks sharing a unique key only the
// newest is retried, and none whose key an unfinished task holds (Skipped).
func (c *Tasks) RetryMatching(ctx context.Context, f tasks.Filter) (tasks.BulkResult, error) {
	if err := f.Check(c.cfg.ShardCount); err != nil {
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

// Warnings says which of classes no attached runner can run, given the
// classes the attached runners can run (runnable): such tasks stay ready
// until a runner that serves the queue with a handler of the kind attaches.
// One warning per class, in the order given.
func Warnings(runnable map[tasks.Class]bool, classes []tasks.Class) []string {
	var warnings []string
	seen := map[tasks.Class]bool{}
	for _, c := range classes {
		if runnable[c] || seen[c] {
			continue
		}
		seen[c] = true
		warnings = append(warnings, fmt.Sprintf("no attached runner serves queue %q with a handler of kind %q: its tasks stay ready until one does", c.Queue, c.Kind))
	}
	return warnings
}
