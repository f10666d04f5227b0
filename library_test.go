package shardrun_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

// TestAProducerNeedsOnlyPostgreSQL: a client given no etcd enqueues in
// every form, reads, waits, cancels and retries, with the shard count the
// database recorded; it cannot start a runner, and says why.
func TestAProducerNeedsOnlyPostgreSQL(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorker(workers, func(ctx context.Context, task *shardrun.Task[Greet]) error {
		if task.Args.Name == "fail" {
			return tasks.Permanent(errors.New("no"))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	runner := w.client(t, shardrun.Config{Workers: workers, ShardCount: 32})
	if err := runner.Start(ctx); err != nil {
		t.Fatal(err)
	}

	producer, err := shardrun.NewClient(ctx, w.pool, nil, quiet(t, shardrun.Config{}))
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close()
	if producer.ShardCount() != 32 {
		t.Fatalf("the producer without etcd reads %d shards, want the cluster's 32", producer.ShardCount())
	}
	one, err := producer.Enqueue(ctx, Greet{Name: "Ada"}, nil)
	if err != nil || len(one.Warnings) != 0 {
		t.Fatalf("enqueue: %+v %v (no warnings without etcd)", one, err)
	}
	var inTx shardrun.Enqueued
	if err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		inTx, err = producer.EnqueueTx(ctx, tx, Greet{Name: "Grace"}, &shardrun.EnqueueOpts{UniqueKey: "grace"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	many, err := producer.EnqueueMany(ctx, []shardrun.EnqueueParams{{Args: Greet{Name: "fail"}}, {Args: Greet{Name: "Linus"}}})
	if err != nil || many.Inserted != 2 {
		t.Fatalf("enqueue many: %+v %v", many, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for _, id := range []int64{one.ID, inTx.ID} {
		if done, err := producer.Wait(wctx, id); err != nil || done.State != tasks.Completed {
			t.Fatalf("waiting for task %d: %s %v", id, done.State, err)
		}
	}
	page, err := producer.List(ctx, tasks.ListRequest{Filter: tasks.Filter{Kind: "greet", States: []tasks.State{tasks.Dead}}})
	if err != nil {
		t.Fatal(err)
	}
	testutil.Until(t, 30*time.Second, "the failing task dead", func() (bool, string) {
		page, err = producer.List(ctx, tasks.ListRequest{Filter: tasks.Filter{Kind: "greet", States: []tasks.State{tasks.Dead}}})
		return err == nil && len(page.Tasks) == 1, "not yet"
	})
	if retried, err := producer.Retry(ctx, page.Tasks[0].ID); err != nil || retried.State != tasks.Ready {
		t.Fatalf("retry: %s %v", retried.State, err)
	}
	later, err := producer.Enqueue(ctx, Greet{Name: "later"}, &shardrun.EnqueueOpts{RunAfter: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if cancelled, err := producer.Cancel(ctx, later.ID); err != nil || cancelled.State != tasks.Cancelled {
		t.Fatalf("cancel: %s %v", cancelled.State, err)
	}
	if err := producer.Start(ctx); err == nil || !strings.Contains(err.Error(), "etcd") {
		t.Fatalf("Start on a client without etcd: %v, want an error naming etcd", err)
	}
}

// TestAProducerOnANewDatabaseNeedsTheShardCount: without etcd and before
// any runner or coordinator recorded the cluster's shard count, a producer
// must be told it, and says so.
func TestAProducerOnANewDatabaseNeedsTheShardCount(t *testing.T) {
	pool := newPool(t, pgtest.NewDatabase(t), 4)
	ctx := context.Background()
	if _, err := shardrun.NewClient(ctx, pool, nil, quiet(t, shardrun.Config{})); err == nil || !strings.Contains(err.Error(), "Config.ShardCount") {
		t.Fatalf("a producer without etcd on a new database: %v, want an error naming Config.ShardCount", err)
	}
	c, err := shardrun.NewClient(ctx, pool, nil, quiet(t, shardrun.Config{ShardCount: 16}))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, err := shardrun.NewClient(ctx, pool, nil, quiet(t, shardrun.Config{ShardCount: 32})); err == nil || !strings.Contains(err.Error(), "16") {
		t.Fatalf("a producer configured with 32 shards on a database of 16: %v", err)
	}
}

// TestNewClientFailsFastWhenEtcdIsUnreachable: with a context that never
// ends, NewClient gives up on an unreachable etcd after EtcdTimeout and
// names its endpoints.
func TestNewClientFailsFastWhenEtcdIsUnreachable(t *testing.T) {
	pool := newPool(t, pgtest.NewDatabase(t), 4)
	dead := "http://" + testutil.FreeAddr(t)
	etcd, err := clientv3.New(clientv3.Config{Endpoints: []string{dead}})
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()
	_, err = shardrun.NewClient(context.Background(), pool, etcd, quiet(t, shardrun.Config{EtcdTimeout: 200 * time.Millisecond}))
	if err == nil || !strings.Contains(err.Error(), dead) || !strings.Contains(err.Error(), "EtcdTimeout") {
		t.Fatalf("NewClient against an unreachable etcd: %v, want an error naming %s and the timeout", err, dead)
	}
}

// TestAPoolSmallerThanTheWorkersIsRefused: AddWorkerTx handlers each hold
// a connection of the program's pool; NewClient refuses a pool that would
// run them fewer at a time than MaxWorkers, naming both numbers.
func TestAPoolSmallerThanTheWorkersIsRefused(t *testing.T) {
	w := newWorld(t)
	small := newPool(t, pgtest.NewDatabase(t), 4)
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorkerTx(workers, func(context.Context, pgx.Tx, *shardrun.Task[*Charge]) error { return nil }); err != nil {
		t.Fatal(err)
	}
	_, err := shardrun.NewClient(context.Background(), small, w.etcd, quiet(t, shardrun.Config{Workers: workers, MaxWorkers: 20}))
	if err == nil || !strings.Contains(err.Error(), "4 connections") || !strings.Contains(err.Error(), "MaxWorkers is 20") {
		t.Fatalf("a pool of 4 for 20 transactional workers: %v, want both numbers named", err)
	}
	plain := shardrun.NewWorkers()
	if err := shardrun.AddWorker(plain, func(context.Context, *shardrun.Task[Greet]) error { return nil }); err != nil {
		t.Fatal(err)
	}
	c, err := shardrun.NewClient(context.Background(), small, w.etcd, quiet(t, shardrun.Config{Workers: plain, MaxWorkers: 20}))
	if err != nil {
		t.Fatalf("workers without transactions on a small pool: %v", err)
	}
	c.Close()
}

// TestCompleteTxNeedsNoClient: a handler completes its task in its own
// transaction with the package function, from its context alone; outside
// a handler's context CompleteTx says what is missing.
func TestCompleteTxNeedsNoClient(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	if _, err := w.pool.Exec(ctx, `CREATE TABLE greetings (task bigint PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorker(workers, func(ctx context.Context, task *shardrun.Task[Greet]) error {
		return pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO greetings (task) VALUES ($1)`, task.ID); err != nil {
				return err
			}
			return shardrun.CompleteTx(ctx, tx, task.Task)
		})
	}); err != nil {
		t.Fatal(err)
	}
	c := w.client(t, shardrun.Config{Workers: workers})
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	e, err := c.Enqueue(ctx, Greet{Name: "Ada"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if done, err := c.Wait(wctx, e.ID); err != nil || done.State != tasks.Completed {
		t.Fatalf("task %d: %s %v", e.ID, done.State, err)
	}
	var n int
	if err := w.pool.QueryRow(ctx, `SELECT count(*) FROM greetings WHERE task = $1`, e.ID).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d greeting rows for the task, want 1 (%v)", n, err)
	}
	err = pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error { return shardrun.CompleteTx(ctx, tx, &tasks.Task{ID: e.ID}) })
	if err == nil || !strings.Contains(err.Error(), "context") {
		t.Fatalf("CompleteTx outside a handler: %v, want an error saying the context is not a handler's", err)
	}
}

// TestLogsGoToSlog: a program that logs with log/slog receives the
// client's records, its components named.
func TestLogsGoToSlog(t *testing.T) {
	w := newWorld(t)
	out := &lockedWriter{w: &bytes.Buffer{}}
	logger := slog.New(slog.NewJSONHandler(out, nil))
	c, err := shardrun.NewClient(context.Background(), w.pool, w.etcd, shardrun.Config{Slog: logger,
		Periodic: []shardrun.PeriodicTask{{Name: "hourly-greeting", Every: time.Hour, Args: Greet{Name: "all"}}}})
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	got := out.String()
	if !strings.Contains(got, `"msg":"periodic task declared"`) || !strings.Contains(got, `"logger":"shardrun"`) {
		t.Fatalf("slog output: %s", got)
	}
}

// TestPeriodicTaskTakesATasksOptions: a periodic task's Opts are a task's
// options (EnqueueOpts) and SkipWhileUnfinished is the schedule's, both
// stored with it; the options a tick's task cannot take are refused
// naming them.
func TestPeriodicTaskTakesATasksOptions(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	c, err := shardrun.NewClient(ctx, w.pool, nil, quiet(t, shardrun.Config{ShardCount: 16, Periodic: []shardrun.PeriodicTask{{
		Name: "guarded", Every: time.Hour, Args: Greet{Name: "all"}, SkipWhileUnfinished: true,
		Opts: &shardrun.EnqueueOpts{Queue: "greetings", Priority: 2, MaxAttempts: 3}}}}))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	var queue string
	var priority, maxAttempts int
	var skip bool
	if err := w.pool.QueryRow(ctx, `SELECT queue, priority, max_attempts, skip_while_unfinished FROM schedules WHERE name = 'guarded'`).
		Scan(&queue, &priority, &maxAttempts, &skip); err != nil || queue != "greetings" || priority != 2 || maxAttempts != 3 || !skip {
		t.Fatalf("stored queue %q, priority %d, max_attempts %d, skip_while_unfinished %v (%v)", queue, priority, maxAttempts, skip, err)
	}
	_, err = shardrun.NewClient(ctx, w.pool, nil, quiet(t, shardrun.Config{ShardCount: 16, Periodic: []shardrun.PeriodicTask{{
		Name: "late", Every: time.Hour, Args: Greet{}, Opts: &shardrun.EnqueueOpts{UniqueKey: "u"}}}}))
	var fe *tasks.FieldError
	if !errors.As(err, &fe) || fe.Field != "unique_key" {
		t.Fatalf("a periodic task with a unique key: %v, want it refused naming unique_key", err)
	}
}

func newPool(t *testing.T, dsn string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// lockedWriter serialises writes from the client's goroutines.
type lockedWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func (l *lockedWriter) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.String()
}

// quiet is cfg with the client's logs at warn in the test's log.
func quiet(t *testing.T, cfg shardrun.Config) shardrun.Config {
	cfg.Logger = hclog.New(&hclog.LoggerOptions{Level: hclog.Warn, Output: testLog{t}})
	return cfg
}
