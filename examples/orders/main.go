// Command orders is a small shop on shardrun's Go API (package shardrun):
// each order writes its row and enqueues its charge and its receipt in one
// transaction; the charges of a customer run one at a time, in order (a
// sequence per customer), and record the charge in the database in the
// same transaction as their completion, so that each order is charged
// exactly once whatever happens to the runners; large orders get an urgent
// fraud check; a periodic report counts the charges.
//
//	go run ./examples/orders --database-url postgres://... --etcd-endpoints http://127.0.0.1:2379
//
// --role all (the default) runs a worker and the shop in one process and
// exits once every order is charged; --role worker runs a worker until
// SIGTERM, --role shop places the orders and waits for their charges, so
// that several workers can run the shop's tasks (the example's test kills
// and freezes some of them on the way).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/tasks"
)

// Charge charges an order to its customer. Its handler writes the charge
// and completes the task in one transaction.
type Charge struct {
	Order    string `json:"order"`
	Customer string `json:"customer"`
	Cents    int    `json:"cents"`
}

// Kind names the charge's handler.
func (Charge) Kind() string { return "charge" }

// Receipt mails an order's receipt: outside the database, so at least
// once.
type Receipt struct {
	Order string `json:"order"`
}

// Kind names the receipt's handler.
func (Receipt) Kind() string { return "send-receipt" }

// FraudCheck looks at a large order before anything else runs.
type FraudCheck struct {
	Order string `json:"order"`
	Cents int    `json:"cents"`
}

// Kind names the fraud check's handler.
func (FraudCheck) Kind() string { return "fraud-check" }

// Report counts the charges so far, every tick of its schedule.
type Report struct{}

// Kind names the report's handler.
func (Report) Kind() string { return "charges-report" }

const schema = `
CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, customer text NOT NULL, cents int NOT NULL);
-- No unique key on purpose: the charges are exactly once because the
-- charge and its task's completion commit together, fenced.
CREATE TABLE IF NOT EXISTS charges (n bigserial PRIMARY KEY, order_id text NOT NULL, customer text NOT NULL,
	cents int NOT NULL, epoch bigint NOT NULL, charged_at timestamptz NOT NULL DEFAULT clock_timestamp());`

// settings are the command line.
type settings struct {
	dsn, role, runnerID string
	etcd                []string
	orders, customers   int
	leaseTTL            time.Duration
	chargeTime          time.Duration
}

func main() {
	var s settings
	var etcd string
	flag.StringVar(&s.dsn, "database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL")
	flag.StringVar(&etcd, "etcd-endpoints", "http://127.0.0.1:2379", "comma-separated etcd URLs")
	flag.StringVar(&s.role, "role", "all", "all (a worker and the shop), worker, or shop")
	flag.StringVar(&s.runnerID, "runner-id", "", "the worker's runner id (default hostname-pid)")
	flag.IntVar(&s.orders, "orders", 12, "orders the shop places")
	flag.IntVar(&s.customers, "customers", 3, "customers the orders are spread over")
	flag.DurationVar(&s.leaseTTL, "lease-ttl", 10*time.Second, "the worker's etcd lease TTL")
	flag.DurationVar(&s.chargeTime, "charge-time", 5*time.Millisecond, "how long the card processor takes")
	flag.Parse()
	s.etcd = strings.Split(etcd, ",")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, s, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, s settings, out io.Writer) error {
	pcfg, err := pgxpool.ParseConfig(s.dsn)
	if err != nil {
		return err
	}
	// A charge's transaction holds a connection while it runs: one per
	// worker, and a few for the shop (NewClient refuses fewer).
	pcfg.MaxConns = maxWorkers + 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	etcd, err := clientv3.New(clientv3.Config{Endpoints: s.etcd, DialTimeout: 5 * time.Second})
	if err != nil {
		return err
	}
	defer etcd.Close()
	// Every process of the example creates the tables; a lock keeps two
	// CREATE ... IF NOT EXISTS from racing in the catalog.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(7000001)`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, schema)
		return err
	}); err != nil {
		return fmt.Errorf("creating the shop's tables: %w", err)
	}
	cfg := shardrun.Config{Cluster: "orders", RunnerID: s.runnerID, LeaseTTL: s.leaseTTL, MaxWorkers: maxWorkers,
		Logger: hclog.New(&hclog.LoggerOptions{Name: "orders", Level: hclog.Warn, Output: os.Stderr}),
		// Declared at every start; stored once.
		Periodic: []shardrun.PeriodicTask{{Name: "charges-report", Every: time.Minute, Args: Report{}}}}
	if s.role != "shop" {
		if cfg.Workers, err = workers(s); err != nil {
			return err
		}
	}
	c, err := shardrun.NewClient(ctx, pool, etcd, cfg)
	if err != nil {
		return err
	}
	defer c.Close()
	if cfg.Workers != nil {
		if err := c.Start(ctx); err != nil {
			return err
		}
	}
	switch s.role {
	case "worker":
		<-ctx.Done()
		return c.Stop(context.Background())
	case "all", "shop":
		return shop(ctx, c, pool, s, out)
	default:
		return fmt.Errorf("--role: all, worker or shop, got %q", s.role)
	}
}

// maxWorkers is how many tasks a worker process runs at once.
const maxWorkers = 16

// workers are the handlers of the shop's tasks.
func workers(s settings) (*shardrun.Workers, error) {
	w := shardrun.NewWorkers()
	err := errors.Join(
		shardrun.AddWorkerTx(w, func(ctx context.Context, tx pgx.Tx, t *shardrun.Task[Charge]) error {
			if _, err := tx.Exec(ctx, `INSERT INTO charges (order_id, customer, cents, epoch) VALUES ($1, $2, $3, $4)`,
				t.Args.Order, t.Args.Customer, t.Args.Cents, t.Epoch); err != nil {
				return err
			}
			select { // the card processor's answer; honours cancellation
			case <-time.After(s.chargeTime):
			case <-ctx.Done():
				return ctx.Err()
			}
			return t.SetResult(map[string]string{"charged": t.Args.Order})
		}),
		shardrun.AddWorker(w, func(ctx context.Context, t *shardrun.Task[Receipt]) error {
			return t.SetResult(map[string]string{"sent": "receipt for " + t.Args.Order})
		}),
		shardrun.AddWorker(w, func(ctx context.Context, t *shardrun.Task[FraudCheck]) error {
			return t.SetResult(map[string]bool{"ok": t.Args.Cents < 1_000_000})
		}),
		shardrun.AddWorkerTx(w, func(ctx context.Context, tx pgx.Tx, t *shardrun.Task[Report]) error {
			var n int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n); err != nil {
				return err
			}
			return t.SetResult(map[string]int{"charges": n})
		}),
	)
	return w, err
}

// shop places the orders, each in one transaction with its tasks, then
// waits for every charge.
func shop(ctx context.Context, c *shardrun.Client, pool *pgxpool.Pool, s settings, out io.Writer) error {
	var charges []int64
	for i := range s.orders {
		id, customer, cents := fmt.Sprintf("order-%d", i+1), fmt.Sprintf("customer-%d", i%s.customers+1), 1000+i*137
		if i%5 == 4 {
			cents *= 100 // a large one
		}
		var charge shardrun.Enqueued
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders (id, customer, cents) VALUES ($1, $2, $3)`, id, customer, cents); err != nil {
				return err
			}
			var err error
			// A customer's charges run one at a time, in order.
			if charge, err = c.EnqueueTx(ctx, tx, Charge{Order: id, Customer: customer, Cents: cents},
				&shardrun.EnqueueOpts{SequenceKey: customer, UniqueKey: "charge/" + id}); err != nil {
				return err
			}
			if _, err = c.EnqueueTx(ctx, tx, Receipt{Order: id}, &shardrun.EnqueueOpts{UniqueKey: "receipt/" + id}); err != nil {
				return err
			}
			if cents > 100_000 {
				_, err = c.EnqueueTx(ctx, tx, FraudCheck{Order: id, Cents: cents}, &shardrun.EnqueueOpts{Priority: 1})
			}
			return err
		})
		if err != nil {
			return fmt.Errorf("placing %s: %w", id, err)
		}
		for _, w := range charge.Warnings {
			fmt.Fprintf(out, "warning: %s\n", w)
		}
		charges = append(charges, charge.ID)
	}
	fmt.Fprintf(out, "placed %d orders for %d customers\n", s.orders, s.customers)
	for _, id := range charges {
		t, err := c.Wait(ctx, id)
		if err != nil {
			return err
		}
		if t.State != tasks.Completed {
			return fmt.Errorf("charge task %d ended %s: %+v", id, t.State, t.Errors)
		}
	}
	var rows, orders int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT order_id) FROM charges`).Scan(&rows, &orders); err != nil {
		return err
	}
	fmt.Fprintf(out, "charged %d orders with %d charges\n", orders, rows)
	return nil
}
