package shardrun_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/tasks"
)

// The examples run against a throwaway PostgreSQL database each and one
// embedded etcd, which the test binary starts; in a program, these are
// your database's URL and your etcd's endpoints.

// databaseURL is a new, empty database.
func databaseURL() string {
	dsn, err := pgtest.ExampleDatabase()
	if err != nil {
		log.Fatal(err)
	}
	return dsn
}

var (
	etcdOnce sync.Once
	etcdURLs []string
)

// etcdEndpoints are the embedded etcd's, started at the first call and
// stopped when the tests end.
func etcdEndpoints() []string {
	etcdOnce.Do(func() {
		dir, err := os.MkdirTemp("", "example-etcd-")
		if err != nil {
			log.Fatal(err)
		}
		srv, err := embedetcd.Start(context.Background(), embedetcd.Config{Dir: dir, Fast: true})
		if err != nil {
			log.Fatal(err)
		}
		pgtest.AtExit(srv.Close)
		etcdURLs = srv.Endpoints()
	})
	return etcdURLs
}

// connect opens the pool and the etcd client an example's program would,
// closed when the tests end; each example is its own cluster.
func connect(ctx context.Context) (*pgxpool.Pool, *clientv3.Client) {
	pcfg, err := pgxpool.ParseConfig(databaseURL())
	if err != nil {
		log.Fatal(err)
	}
	pcfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		log.Fatal(err)
	}
	etcd, err := clientv3.New(clientv3.Config{Endpoints: etcdEndpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		log.Fatal(err)
	}
	pgtest.AtExit(func() { etcd.Close(); pool.Close() })
	return pool, etcd
}

// exampleConfig is the settings every example shares: its own cluster,
// quiet logs, short timings.
func exampleConfig(cluster string) shardrun.Config {
	return shardrun.Config{Cluster: cluster, Logger: hclog.NewNullLogger(), MaxWorkers: 4,
		LeaseTTL: 2 * time.Second, PollInterval: 100 * time.Millisecond}
}

// Greeting is a typed task: its Kind names its handler.
type Greeting struct {
	Name string `json:"name"`
}

func (Greeting) Kind() string { return "greeting" }

// ChargeOrder is a task whose handler writes to the database.
type ChargeOrder struct {
	Order string `json:"order"`
	Cents int    `json:"cents"`
}

func (ChargeOrder) Kind() string { return "charge-order" }

func ExampleNewClient() {
	ctx := context.Background()
	pool, etcd := connect(ctx)
	c, err := shardrun.NewClient(ctx, pool, etcd, exampleConfig("example-newclient"))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	fmt.Println("shards:", c.ShardCount())

	// A producer needs only the database: the same cluster, no etcd.
	producer, err := shardrun.NewClient(ctx, pool, nil, exampleConfig("example-newclient"))
	if err != nil {
		log.Fatal(err)
	}
	defer producer.Close()
	fmt.Println("producer's shards:", producer.ShardCount())
	// Output:
	// shards: 256
	// producer's shards: 256
}

func ExampleAddWorker() {
	ctx := context.Background()
	pool, etcd := connect(ctx)
	cfg := exampleConfig("example-addworker")
	cfg.Workers = shardrun.NewWorkers()
	if err := shardrun.AddWorker(cfg.Workers, func(ctx context.Context, t *shardrun.Task[Greeting]) error {
		return t.SetResult(map[string]string{"said": "hello, " + t.Args.Name})
	}); err != nil {
		log.Fatal(err)
	}
	c, err := shardrun.NewClient(ctx, pool, etcd, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	if err := c.Start(ctx); err != nil {
		log.Fatal(err)
	}
	e, err := c.Enqueue(ctx, Greeting{Name: "Ada"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	t, err := c.Wait(ctx, e.ID)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(t.State, string(t.Result))
	// Output: completed {"said": "hello, Ada"}
}

func ExampleClient_EnqueueTx() {
	ctx := context.Background()
	pool, _ := connect(ctx)
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, cents int)`); err != nil {
		log.Fatal(err)
	}
	cfg := exampleConfig("example-enqueuetx")
	cfg.ShardCount = 16 // a producer without etcd on a new cluster is told its shard count
	c, err := shardrun.NewClient(ctx, pool, nil, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	// The order and its charge commit together, or neither does.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, cents) VALUES ('o-42', 1250)`); err != nil {
			return err
		}
		e, err := c.EnqueueTx(ctx, tx, ChargeOrder{Order: "o-42", Cents: 1250},
			&shardrun.EnqueueOpts{UniqueKey: "charge/o-42", SequenceKey: "customer-7"})
		fmt.Println("duplicate:", e.Duplicate)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	// Enqueued again with the same unique key while unfinished: the same task.
	again, err := c.Enqueue(ctx, ChargeOrder{Order: "o-42", Cents: 1250}, &shardrun.EnqueueOpts{UniqueKey: "charge/o-42"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("duplicate:", again.Duplicate)
	// Output:
	// duplicate: false
	// duplicate: true
}

func ExampleAddWorkerTx() {
	ctx := context.Background()
	pool, etcd := connect(ctx)
	if _, err := pool.Exec(ctx, `CREATE TABLE charges (order_id text PRIMARY KEY, cents int)`); err != nil {
		log.Fatal(err)
	}
	cfg := exampleConfig("example-addworkertx")
	cfg.Workers = shardrun.NewWorkers()
	// The charge row and the task's completion commit in one transaction:
	// a runner that lost the task's shard cannot commit it a second time.
	if err := shardrun.AddWorkerTx(cfg.Workers, func(ctx context.Context, tx pgx.Tx, t *shardrun.Task[ChargeOrder]) error {
		_, err := tx.Exec(ctx, `INSERT INTO charges (order_id, cents) VALUES ($1, $2)`, t.Args.Order, t.Args.Cents)
		return err
	}); err != nil {
		log.Fatal(err)
	}
	c, err := shardrun.NewClient(ctx, pool, etcd, cfg) // the pool serves MaxWorkers connections
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	if err := c.Start(ctx); err != nil {
		log.Fatal(err)
	}
	e, err := c.Enqueue(ctx, ChargeOrder{Order: "o-7", Cents: 990}, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := c.Wait(ctx, e.ID); err != nil {
		log.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM charges WHERE order_id = 'o-7'`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("charges:", n)
	// Output: charges: 1
}

func ExampleCompleteTx() {
	ctx := context.Background()
	pool, etcd := connect(ctx)
	if _, err := pool.Exec(ctx, `CREATE TABLE greetings (name text)`); err != nil {
		log.Fatal(err)
	}
	cfg := exampleConfig("example-completetx")
	cfg.Workers = shardrun.NewWorkers()
	// A handler with a transaction of its own completes its task in it,
	// last, with the handler's context: no client needed.
	if err := shardrun.AddWorker(cfg.Workers, func(ctx context.Context, t *shardrun.Task[Greeting]) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO greetings (name) VALUES ($1)`, t.Args.Name); err != nil {
				return err
			}
			return shardrun.CompleteTx(ctx, tx, t.Task)
		})
	}); err != nil {
		log.Fatal(err)
	}
	c, err := shardrun.NewClient(ctx, pool, etcd, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	if err := c.Start(ctx); err != nil {
		log.Fatal(err)
	}
	e, err := c.Enqueue(ctx, Greeting{Name: "Grace"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	t, err := c.Wait(ctx, e.ID)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(t.State)
	// Output: completed
}

func ExampleClient_Wait() {
	ctx := context.Background()
	pool, etcd := connect(ctx)
	cfg := exampleConfig("example-wait")
	cfg.Workers = shardrun.NewWorkers()
	// An untyped handler, for kinds known only at run time.
	if err := cfg.Workers.Handle("resize", func(ctx context.Context, t *tasks.Task) error {
		return tasks.Permanent(fmt.Errorf("cannot resize %s", t.Payload))
	}); err != nil {
		log.Fatal(err)
	}
	c, err := shardrun.NewClient(ctx, pool, etcd, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	if err := c.Start(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("runner:", c.RunnerID() != "")
	e, err := c.EnqueueTask(ctx, tasks.NewTask{Kind: "resize", Payload: []byte(`{"w":0}`)})
	if err != nil {
		log.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	t, err := c.Wait(wctx, e.ID) // returns once the task has finished, whatever its outcome
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(t.State, t.Errors[0].Error)
	// The dead task goes back to ready with a fresh budget of attempts.
	r, err := c.RetryMatching(ctx, tasks.Filter{Kind: "resize", States: []tasks.State{tasks.Dead}})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("retried:", r.Retried)
	// Output:
	// runner: true
	// dead permanent failure: cannot resize {"w": 0}
	// retried: 1
}

func ExampleClient_CancelMatching() {
	ctx := context.Background()
	pool, _ := connect(ctx)
	cfg := exampleConfig("example-cancel")
	cfg.ShardCount = 16
	c, err := shardrun.NewClient(ctx, pool, nil, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	for _, name := range []string{"a", "b", "c"} {
		if _, err := c.Enqueue(ctx, Greeting{Name: name}, &shardrun.EnqueueOpts{Queue: "later", RunAfter: time.Now().Add(time.Hour)}); err != nil {
			log.Fatal(err)
		}
	}
	r, err := c.CancelMatching(ctx, tasks.Filter{Queue: "later"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("cancelled:", r.Cancelled)
	// Output: cancelled: 3
}
