package shardruntest_test

import (
	"context"
	"errors"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/shardruntest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type Charge struct {
	Order string `json:"order"`
	Cents int    `json:"cents"`
}

func (Charge) Kind() string { return "charge" }

// charge is a transactional worker as a program writes it.
func charge(ctx context.Context, tx pgx.Tx, t *shardrun.Task[Charge]) error {
	if t.Args.Cents <= 0 {
		return errors.New("nothing to charge")
	}
	if _, err := tx.Exec(ctx, `INSERT INTO charges (order_id, cents) VALUES ($1, $2)`, t.Args.Order, t.Args.Cents); err != nil {
		return err
	}
	return t.SetResult(map[string]string{"charged": t.Args.Order})
}

func testPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), pgtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(context.Background(), `CREATE TABLE charges (order_id text PRIMARY KEY, cents int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return pool
}

// WorkTx runs a transactional worker in the test's transaction: its
// writes are there to read, its completion is recorded, and a failing
// worker's writes are rolled back with its savepoint.
func TestWorkTx(t *testing.T) {
	ctx := context.Background()
	tx, err := testPool(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	res := shardruntest.WorkTx(ctx, t, tx, charge, Charge{Order: "o-1", Cents: 500}, nil)
	if res.Err != nil || !res.Completed || string(res.Task.Result) != `{"charged":"o-1"}` {
		t.Fatalf("worked: %+v", res)
	}
	failed := shardruntest.WorkTx(ctx, t, tx, func(ctx context.Context, tx pgx.Tx, t *shardrun.Task[Charge]) error {
		if err := charge(ctx, tx, t); err != nil {
			return err
		}
		return errors.New("the card processor said no")
	}, Charge{Order: "o-2", Cents: 700}, nil)
	if failed.Err == nil || failed.Completed {
		t.Fatalf("a failing worker: %+v", failed)
	}
	var orders []string
	rows, _ := tx.Query(ctx, `SELECT order_id FROM charges ORDER BY order_id`)
	orders, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(orders) != 1 || orders[0] != "o-1" {
		t.Fatalf("charges in the test's transaction: %v %v, want only o-1", orders, err)
	}
}

// Work runs a worker without a transaction; a worker that completes in a
// transaction of its own with shardrun.CompleteTx is recorded completed.
func TestWork(t *testing.T) {
	ctx := context.Background()
	res := shardruntest.Work(ctx, t, func(ctx context.Context, task *shardrun.Task[Charge]) error {
		if task.Args.Order != "o-9" || task.Attempt != 1 {
			t.Errorf("the worker saw %+v at attempt %d", task.Args, task.Attempt)
		}
		return nil
	}, Charge{Order: "o-9", Cents: 1}, nil)
	if res.Err != nil || res.Completed {
		t.Fatalf("worked: %+v", res)
	}
	pool := testPool(t)
	res = shardruntest.Work(ctx, t, func(ctx context.Context, task *shardrun.Task[Charge]) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := charge(ctx, tx, task); err != nil {
				return err
			}
			return shardrun.CompleteTx(ctx, tx, task.Task)
		})
	}, Charge{Order: "o-10", Cents: 3}, &shardruntest.Opts{Attempt: 2})
	if res.Err != nil || !res.Completed || res.Task.Attempt != 2 {
		t.Fatalf("worked: %+v", res)
	}
}

// RequireEnqueuedTx finds what the code under test enqueued in its
// transaction before the transaction commits.
func TestRequireEnqueuedTx(t *testing.T) {
	ctx := context.Background()
	pool := testPool(t)
	c, err := shardrun.NewClient(ctx, pool, nil, shardrun.Config{ShardCount: 8,
		Logger: hclog.New(&hclog.LoggerOptions{Level: hclog.Warn})})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := c.EnqueueTx(ctx, tx, Charge{Order: "o-3", Cents: 900}, &shardrun.EnqueueOpts{Queue: "payments"}); err != nil {
		t.Fatal(err)
	}
	task := shardruntest.RequireEnqueuedTx[Charge](ctx, t, tx)
	if task.Args.Order != "o-3" || task.Queue != "payments" {
		t.Fatalf("found %+v in queue %s", task.Args, task.Queue)
	}
}
