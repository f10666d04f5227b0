package shardrun_test

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) { pgtest.Main(m, testutil.EtcdLeaks...) }

// Greet is a typed task.
type Greet struct {
	Name string `json:"name"`
}

func (Greet) Kind() string { return "greet" }

// Charge is a typed task whose handler writes to the database.
type Charge struct {
	Order string `json:"order"`
	Cents int    `json:"cents"`
}

func (*Charge) Kind() string { return "charge" }

type world struct {
	pool *pgxpool.Pool
	etcd *clientv3.Client
}

func newWorld(t *testing.T) world {
	t.Helper()
	dsn := pgtest.NewDatabase(t)
	pcfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	// One connection per worker for AddWorkerTx handlers (NewClient
	// refuses fewer), the default 64.
	pcfg.MaxConns = 64
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	_, etcd := testutil.Etcd(t)
	return world{pool: pool, etcd: etcd}
}

func (w world) client(t *testing.T, cfg shardrun.Config) *shardrun.Client {
	t.Helper()
	cfg.Logger = hclog.New(&hclog.LoggerOptions{Level: hclog.Warn, Output: testLog{t}})
	cfg.LeaseTTL, cfg.PollInterval, cfg.HeartbeatInterval, cfg.RetryBase = 2*time.Second, 100*time.Millisecond, time.Second, 10*time.Millisecond
	c, err := shardrun.NewClient(context.Background(), w.pool, w.etcd, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("closing the client: %v", err)
		}
	})
	return c
}

// TestTypedTasksRunAndWait: one client enqueues a typed task, runs it with
// its typed handler, and waits for its outcome; the shard count comes from
// the cluster.
func TestTypedTasksRunAndWait(t *testing.T) {
	w := newWorld(t)
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorker(workers, func(ctx context.Context, task *shardrun.Task[Greet]) error {
		return task.SetResult(map[string]string{"said": "hello, " + task.Args.Name})
	}); err != nil {
		t.Fatal(err)
	}
	c := w.client(t, shardrun.Config{Workers: workers})
	if c.ShardCount() != shardrun.DefaultShardCount {
		t.Errorf("a new cluster has %d shards, want %d", c.ShardCount(), shardrun.DefaultShardCount)
	}
	ctx := context.Background()
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	e, err := c.Enqueue(ctx, Greet{Name: "Ada"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	done, err := c.Wait(wctx, e.ID)
	if err != nil {
		t.Fatal(err)
	}
	if done.State != tasks.Completed || !strings.Contains(string(done.Result), "hello, Ada") {
		t.Fatalf("task %d ended %s with result %s", e.ID, done.State, done.Result)
	}
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	// Another process of the cluster with its own idea of the shard
	// count is refused; one without takes the cluster's.
	if _, err := shardrun.NewClient(ctx, w.pool, w.etcd, shardrun.Config{ShardCount: 64}); !errors.Is(err, shard.ErrShardCountMismatch) {
		t.Errorf("a client configured with 64 shards on a cluster of 256: %v", err)
	}
	if got := w.client(t, shardrun.Config{}).ShardCount(); got != shardrun.DefaultShardCount {
		t.Errorf("a producer's client reads %d shards", got)
	}
}

// TestPayloadThatDoesNotDecodeIsPermanent: a task whose payload is not its
// kind's type ends dead at its first attempt.
func TestPayloadThatDoesNotDecodeIsPermanent(t *testing.T) {
	w := newWorld(t)
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorker(workers, func(ctx context.Context, task *shardrun.Task[Greet]) error { return nil }); err != nil {
		t.Fatal(err)
	}
	c := w.client(t, shardrun.Config{Workers: workers})
	ctx := context.Background()
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	e, err := c.EnqueueTask(ctx, tasks.NewTask{Kind: "greet", Payload: []byte(`{"name": 42}`)})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	done, err := c.Wait(wctx, e.ID)
	if err != nil {
		t.Fatal(err)
	}
	if done.State != tasks.Dead || done.Attempt != 1 || !strings.Contains(done.Errors[0].Error, "decoding payload") {
		t.Fatalf("task with a bad payload: %s after %d attempts, errors %+v", done.State, done.Attempt, done.Errors)
	}
}

// TestEnqueueWarnsWhenNoRunnerCanRunIt: a Go producer hears, as an HTTP
// one does, that no attached runner can run what it enqueued, and stops
// hearing it once one can.
func TestEnqueueWarnsWhenNoRunnerCanRunIt(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	producer := w.client(t, shardrun.Config{})
	e, err := producer.Enqueue(ctx, Greet{Name: "nobody"}, &shardrun.EnqueueOpts{Queue: "greetings"})
	if err != nil {
		t.Fatal(err)
	}
	if len(e.Warnings) != 1 || !strings.Contains(e.Warnings[0], `queue "greetings" with a handler of kind "greet"`) {
		t.Fatalf("warnings %q; want one naming the queue and the kind", e.Warnings)
	}
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorker(workers, func(ctx context.Context, task *shardrun.Task[Greet]) error { return nil }); err != nil {
		t.Fatal(err)
	}
	worker := w.client(t, shardrun.Config{Workers: workers, Queues: map[string]int{"greetings": 0}})
	if err := worker.Start(ctx); err != nil {
		t.Fatal(err)
	}
	testutil.Until(t, 10*time.Second, "no warning once a runner can run the task", func() (bool, string) {
		e, err := producer.Enqueue(ctx, Greet{Name: "somebody"}, &shardrun.EnqueueOpts{Queue: "greetings"})
		if err != nil {
			return false, err.Error()
		}
		return len(e.Warnings) == 0, fmt.Sprint(e.Warnings)
	})
}

// TestCompleteTxCommitsTheEffectWithTheCompletion: a transactional
// handler's writes and its task's completion commit together: each
// charge's row exists exactly once, and a handler whose writes fail leaves
// nothing behind and is retried.
func TestCompleteTxCommitsTheEffectWithTheCompletion(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	if _, err := w.pool.Exec(ctx, `CREATE TABLE charges (n bigserial PRIMARY KEY, order_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	failed := map[string]bool{}
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorkerTx(workers, func(ctx context.Context, tx pgx.Tx, task *shardrun.Task[*Charge]) error {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (order_id) VALUES ($1)`, task.Args.Order); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if strings.HasSuffix(task.Args.Order, "7") && !failed[task.Args.Order] {
			failed[task.Args.Order] = true
			return errors.New("the card processor timed out") // rolls the insert back
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	c := w.client(t, shardrun.Config{Workers: workers})
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	var batch []shardrun.EnqueueParams
	for i := range 200 {
		batch = append(batch, shardrun.EnqueueParams{Args: &Charge{Order: fmt.Sprintf("o-%d", i), Cents: 100 + i}})
	}
	if _, err := c.EnqueueMany(ctx, batch); err != nil {
		t.Fatal(err)
	}
	testutil.Until(t, 60*time.Second, "every charge completed", func() (bool, string) {
		page, err := c.List(ctx, tasks.ListRequest{Filter: tasks.Filter{Kind: "charge", States: []tasks.State{tasks.Completed}}, Limit: 1000})
		if err != nil {
			return false, err.Error()
		}
		return len(page.Tasks) == 200, fmt.Sprintf("%d completed", len(page.Tasks))
	})
	var rows, orders int
	if err := w.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT order_id) FROM charges`).Scan(&rows, &orders); err != nil {
		t.Fatal(err)
	}
	if rows != 200 || orders != 200 {
		t.Fatalf("%d charge rows for %d orders, want one per order (200)", rows, orders)
	}
	if len(failed) != 20 {
		t.Fatalf("%d first attempts failed, want 20", len(failed))
	}
}

// TestCompleteTxIsRefusedToARunnerThatLostTheTask: the transaction of an
// attempt whose claim a new owner took is refused whole, so its writes are
// not committed a second time.
func TestCompleteTxIsRefusedToARunnerThatLostTheTask(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	if _, err := w.pool.Exec(ctx, `CREATE TABLE charges (n bigserial PRIMARY KEY, order_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan int64, 1), make(chan struct{})
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorkerTx(workers, func(ctx context.Context, tx pgx.Tx, task *shardrun.Task[*Charge]) error {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (order_id) VALUES ($1)`, task.Args.Order); err != nil {
			return err
		}
		select {
		case entered <- task.ID:
			<-release
		default: // a later attempt
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	c := w.client(t, shardrun.Config{Workers: workers, HandoffTimeout: time.Minute})
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	e, err := c.Enqueue(ctx, &Charge{Order: "o-1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	id := <-entered
	// A new owner of the shard raises its fence: the attempt's claim goes
	// back to ready, as when this runner is paused past its lease.
	task, err := c.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.pool.Exec(ctx, `UPDATE shard_fences SET epoch = epoch + 1000000, owner = 'new-owner' WHERE shard = $1`, task.Shard); err != nil {
		t.Fatal(err)
	}
	if _, err := w.pool.Exec(ctx, `WITH k AS (DELETE FROM task_claims WHERE id = $1 RETURNING id)
		INSERT INTO task_ready (shard, queue, kind, priority, run_after, id)
		SELECT t.shard, t.queue, t.kind, t.priority, t.run_after, t.id FROM tasks t JOIN k USING (id)`, id); err != nil {
		t.Fatal(err)
	}
	close(release)
	testutil.Until(t, 10*time.Second, "the stale attempt's outcome written", func() (bool, string) {
		var n int
		if err := w.pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n); err != nil {
			return false, err.Error()
		}
		got, err := c.Get(ctx, e.ID)
		if err != nil {
			return false, err.Error()
		}
		return n == 0 && got.State == tasks.Ready, fmt.Sprintf("%d charge rows, task %s", n, got.State)
	})
}

// testLog writes a client's log lines to the test's log.
type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
