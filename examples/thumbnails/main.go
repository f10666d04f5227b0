// Command thumbnails shows shardrun as a library: a runner with a custom,
// typed handler, and a producer that enqueues tasks and waits for them.
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
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/internal/store"
	"github.com/shardrun/shardrun/tasks"
)

// Resize is the payload of a "resize-image" task.
type Resize struct {
	Image string `json:"image"`
	Width int    `json:"width"`
}

// Thumbnail is the result stored with a completed task.
type Thumbnail struct {
	Path  string `json:"path"`
	Epoch int64  `json:"epoch"`
}

func resize(ctx context.Context, t *tasks.Task, p Resize) error {
	if p.Width <= 0 {
		return fmt.Errorf("width must be positive, got %d", p.Width)
	}
	select { // stands in for real work that honours cancellation
	case <-time.After(10 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	return t.SetResult(Thumbnail{Path: fmt.Sprintf("thumbs/%d/%s", p.Width, p.Image), Epoch: t.Epoch})
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

func run(ctx context.Context, dsn string, etcd []string, n int, out io.Writer) error {
	cfg := runner.DefaultConfig()
	cfg.DatabaseURL, cfg.EtcdEndpoints = dsn, etcd
	cfg.Cluster, cfg.ShardCount, cfg.AdminAddr = "thumbnails", 16, "127.0.0.1:0"
	r, err := runner.New(cfg)
	if err != nil {
		return err
	}
	if err := runner.HandleTyped(r, "resize-image", resize); err != nil {
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

	// The producer side: validated tasks, sharded by key.
	st, err := store.Open(ctx, dsn, store.Options{})
	if err != nil {
		return err
	}
	defer st.Close()
	c, err := client.New(st, client.Config{ShardCount: cfg.ShardCount})
	if err != nil {
		return err
	}
	ids := make([]int64, n)
	for i := range ids {
		image := fmt.Sprintf("photo-%03d.jpg", i)
		payload := fmt.Sprintf(`{"image": %q, "width": 128}`, image)
		e, err := c.Enqueue(ctx, tasks.NewTask{Kind: "resize-image", Key: image, Payload: []byte(payload)})
		if err != nil {
			return err
		}
		ids[i] = e.ID
	}
	for _, id := range ids {
		for {
			t, err := st.Get(ctx, id)
			if err != nil {
				return err
			}
			if t.State == tasks.Completed {
				fmt.Fprintf(out, "task %d (%s, shard %d): %s\n", t.ID, t.Key, t.Shard, t.Result)
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
