// Command thumbnails shows shardrun as a library: one client that runs a
// typed handler and enqueues tasks for it, then waits for their outcomes.
//
//	go run ./examples/thumbnails --database-url postgres://... --etcd-endpoints http://127.0.0.1:2379
//
// Each task asks for a thumbnail of one image. The image name is the task's
// key, so every task for the same image runs on the same shard, one at a
// time per owner, and the handler gets the shard's epoch as a fencing token
// for any downstream system that accepts one.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/tasks"
)

// Resize is a "resize-image" task.
type Resize struct {
	Image string `json:"image"`
	Width int    `json:"width"`
}

// Kind names the handler of a Resize.
func (Resize) Kind() string { return "resize-image" }

// Thumbnail is the result stored with a completed task.
type Thumbnail struct {
	Path  string `json:"path"`
	Epoch int64  `json:"epoch"`
}

func resize(ctx context.Context, t *shardrun.Task[Resize]) error {
	if t.Args.Width <= 0 {
		return tasks.Permanent(fmt.Errorf("width must be positive, got %d", t.Args.Width))
	}
	select { // stands in for real work that honours cancellation
	case <-time.After(10 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	return t.SetResult(Thumbnail{Path: fmt.Sprintf("thumbs/%d/%s", t.Args.Width, t.Args.Image), Epoch: t.Epoch})
}

func main() {
	dsn := flag.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL")
	etcd := flag.String("etcd-endpoints", "http://127.0.0.1:2379", "comma-separated etcd URLs")
	n := flag.Int("images", 20, "how many thumbnails to make")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *dsn, strings.Split(*etcd, ","), *n, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "thumbnails:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dsn string, endpoints []string, n int, out io.Writer) error {
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	etcd, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second})
	if err != nil {
		return err
	}
	defer etcd.Close()
	workers := shardrun.NewWorkers()
	if err := shardrun.AddWorker(workers, resize); err != nil {
		return err
	}
	c, err := shardrun.NewClient(ctx, pool, etcd, shardrun.Config{Cluster: "thumbnails", ShardCount: 16, Workers: workers})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.Start(ctx); err != nil {
		return err
	}
	ids := make([]int64, n)
	for i := range ids {
		image := fmt.Sprintf("photo-%03d.jpg", i)
		e, err := c.Enqueue(ctx, Resize{Image: image, Width: 128}, &shardrun.EnqueueOpts{Key: image})
		if err != nil {
			return err
		}
		ids[i] = e.ID
	}
	for _, id := range ids {
		t, err := c.Wait(ctx, id)
		if err != nil {
			return err
		}
		if t.State != tasks.Completed {
			return fmt.Errorf("task %d ended %s: %v", t.ID, t.State, t.Errors)
		}
		fmt.Fprintf(out, "task %d (%s, shard %d): %s\n", t.ID, t.Key, t.Shard, t.Result)
	}
	return nil
}
