// Command txworker is a runner built on package shardrun whose one kind,
// effect, writes a row of the program's own (effects) and records its
// task's completion in the same transaction, the way a service's handler
// does. A task asking for it holds that transaction open after
// CompleteTx (hold_ms), ignoring its context: the misbehaving handler the
// integration tests and the bench's outage section run the cluster
// against. It prints "holding <task id> <pid>" when it starts to hold, so
// that a test can act while the transaction is open.
package main

import (
	"context"
	"flag"
	"fmt"
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
)

// Effect is the one kind: an effect row, and a hold of the transaction on
// the attempts up to HoldAttempts.
type Effect struct {
	HoldMS       int `json:"hold_ms,omitempty"`
	HoldAttempts int `json:"hold_attempts,omitempty"`
}

// Kind names the task kind.
func (Effect) Kind() string { return "effect" }

const schema = `CREATE TABLE IF NOT EXISTS effects (
	task_id bigint NOT NULL, attempt int NOT NULL, epoch bigint NOT NULL, runner text NOT NULL,
	at timestamptz NOT NULL DEFAULT clock_timestamp())`

func main() {
	var (
		dsn, endpoints, cluster, runnerID string
		leaseTTL, handoff                 time.Duration
		maxWorkers                        int
	)
	flag.StringVar(&dsn, "database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL")
	flag.StringVar(&endpoints, "etcd-endpoints", "http://127.0.0.1:2379", "comma-separated etcd URLs")
	flag.StringVar(&cluster, "cluster", shardrun.DefaultCluster, "the cluster's name")
	flag.StringVar(&runnerID, "runner-id", "", "the runner id (default hostname-pid)")
	flag.DurationVar(&leaseTTL, "lease-ttl", 10*time.Second, "the runner's etcd lease TTL")
	flag.DurationVar(&handoff, "handoff-timeout", 10*time.Second, "how long a moving shard waits for its work")
	flag.IntVar(&maxWorkers, "max-workers", 16, "tasks running at once")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, dsn, strings.Split(endpoints, ","), shardrun.Config{Cluster: cluster, RunnerID: runnerID,
		LeaseTTL: leaseTTL, HandoffTimeout: handoff, MaxWorkers: maxWorkers}); err != nil {
		fmt.Fprintln(os.Stderr, "txworker:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dsn string, endpoints []string, cfg shardrun.Config) error {
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(7000002)`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, schema)
		return err
	}); err != nil {
		return fmt.Errorf("creating the effects table: %w", err)
	}
	etcd, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second})
	if err != nil {
		return err
	}
	defer etcd.Close()
	cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "txworker", Level: hclog.Info, Output: os.Stderr})
	cfg.Workers = shardrun.NewWorkers()
	err = shardrun.AddWorker(cfg.Workers, func(ctx context.Context, t *shardrun.Task[Effect]) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		if _, err := tx.Exec(ctx, `INSERT INTO effects (task_id, attempt, epoch, runner) VALUES ($1, $2, $3, $4)`,
			t.ID, t.Attempt, t.Epoch, t.ClaimedBy); err != nil {
			return err
		}
		if err := shardrun.CompleteTx(ctx, tx, t.Task); err != nil {
			return err
		}
		if t.Args.HoldMS > 0 && t.Attempt <= t.Args.HoldAttempts {
			fmt.Printf("holding %d %d\n", t.ID, os.Getpid())
			// Deaf to its context on purpose: the system, not the
			// handler, must end this transaction.
			time.Sleep(time.Duration(t.Args.HoldMS) * time.Millisecond)
		}
		return tx.Commit(context.Background())
	})
	if err != nil {
		return err
	}
	c, err := shardrun.NewClient(ctx, pool, etcd, cfg)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	return c.Stop(context.Background())
}
