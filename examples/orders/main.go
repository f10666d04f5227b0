// Command orders shows transactional, idempotent enqueue: an order row and
// the task that sends its receipt commit together or not at all, and the
// receipt is enqueued at most once per order however often the producer
// retries.
//
//	go run ./examples/orders --database-url postgres://... --etcd-endpoints http://127.0.0.1:2379
//
// The producer writes each order and enqueues its "send-receipt" task in
// one transaction of its own (client.EnqueueTx). An order whose payment is
// declined rolls back: no order row, no task, and no runner is woken (the
// enqueue notification is sent only on commit). The receipt's unique key
// is the order id, so enqueueing it again while it is unfinished (a
// producer that retries after a timeout, say) returns the same task.
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
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/internal/store"
	"github.com/shardrun/shardrun/tasks"
)

// Receipt is the payload of a "send-receipt" task.
type Receipt struct {
	Order string `json:"order"`
	Cents int    `json:"cents"`
}

var errDeclined = errors.New("payment declined")

func sendReceipt(ctx context.Context, t *tasks.Task, r Receipt) error {
	select { // stands in for a mail API call that honours cancellation
	case <-time.After(5 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	return t.SetResult(map[string]string{"sent": fmt.Sprintf("receipt for %s (%d cents)", r.Order, r.Cents)})
}

func main() {
	dsn := flag.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL")
	etcd := flag.String("etcd-endpoints", "http://127.0.0.1:2379", "comma-separated etcd URLs")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *dsn, strings.Split(*etcd, ","), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dsn string, etcd []string, out io.Writer) error {
	cfg := runner.DefaultConfig()
	cfg.DatabaseURL, cfg.EtcdEndpoints = dsn, etcd
	cfg.Cluster, cfg.ShardCount, cfg.AdminAddr = "orders", 16, "127.0.0.1:0"
	r, err := runner.New(cfg)
	if err != nil {
		return err
	}
	if err := runner.HandleTyped(r, "send-receipt", sendReceipt); err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	defer func() { cancel(); <-done }()
	select {
	case <-r.Started():
	case err := <-done:
		return err
	}

	st, err := store.Open(ctx, dsn, store.Options{})
	if err != nil {
		return err
	}
	defer st.Close()
	c, err := client.New(st, client.Config{ShardCount: cfg.ShardCount})
	if err != nil {
		return err
	}
	db := st.Pool() // the producer's own pool would do as well
	if _, err := db.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, cents int NOT NULL)`); err != nil {
		return err
	}

	// placeOrder writes the order and enqueues its receipt in one
	// transaction: both or neither.
	placeOrder := func(id string, cents int) (tasks.Enqueued, error) {
		var e tasks.Enqueued
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders (id, cents) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING`, id, cents); err != nil {
				return err
			}
			var err error
			e, err = c.EnqueueTx(ctx, tx, tasks.NewTask{Kind: "send-receipt", Key: id, UniqueKey: "receipt/" + id,
				Payload: fmt.Appendf(nil, `{"order": %q, "cents": %d}`, id, cents)})
			if err != nil {
				return err
			}
			if cents > 100_000 {
				return errDeclined // rolls back the order and its task
			}
			return nil
		})
		return e, err
	}

	var ids []int64
	for i, cents := range []int{1999, 250_000, 4500} {
		id := fmt.Sprintf("order-%d", i+1)
		e, err := placeOrder(id, cents)
		switch {
		case errors.Is(err, errDeclined):
			fmt.Fprintf(out, "%s: %v, rolled back: no order, no task\n", id, err)
			continue
		case err != nil:
			return err
		}
		// The producer retries (it never saw the commit, say): same task.
		again, err := placeOrder(id, cents)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "%s: task %d; placed again: task %d, duplicate %v\n", id, e.ID, again.ID, again.Duplicate)
		ids = append(ids, e.ID)
	}
	var orders int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		return err
	}
	page, err := c.List(ctx, tasks.ListRequest{Filter: tasks.Filter{Kind: "send-receipt"}})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "%d orders, %d receipt tasks\n", orders, len(page.Tasks))

	for _, id := range ids {
		for {
			t, err := c.Get(ctx, id)
			if err != nil {
				return err
			}
			if t.State == tasks.Completed {
				fmt.Fprintf(out, "task %d (%s): %s\n", t.ID, t.Key, t.Result)
				break
			}
			if t.State.Terminal() {
				return fmt.Errorf("task %d ended %s: %v", t.ID, t.State, t.Errors)
			}
			select {
			case <-ctx.Done():
				return errors.New("interrupted")
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	return nil
}
