package shardrun_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/shardrun/shardrun"
)

// Report is a periodic task.
type Report struct{}

func (Report) Kind() string { return "report" }

// A program with workers and a Leader needs no coordinator process: its
// client leads the cluster (or another replica does) and enqueues the
// ticks of its periodic tasks, which its runner runs.
func ExampleLeaderConfig() {
	ctx := context.Background()
	pool, etcd := connect(ctx)
	ran := make(chan struct{}, 1)
	cfg := exampleConfig("example-leader")
	cfg.Workers = shardrun.NewWorkers()
	if err := shardrun.AddWorker(cfg.Workers, func(ctx context.Context, t *shardrun.Task[Report]) error {
		select {
		case ran <- struct{}{}:
		default:
		}
		return nil
	}); err != nil {
		log.Fatal(err)
	}
	cfg.Periodic = []shardrun.PeriodicTask{{Name: "report", Every: time.Second, Args: Report{}}}
	cfg.Leader = &shardrun.LeaderConfig{ElectionTTL: 2 * time.Second} // the other settings: the coordinator's defaults
	c, err := shardrun.NewClient(ctx, pool, etcd, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	if err := c.Start(ctx); err != nil {
		log.Fatal(err)
	}
	select {
	case <-ran:
		fmt.Println("a tick ran; leads:", c.IsLeader())
	case <-time.After(30 * time.Second):
		fmt.Println("no tick within 30s")
	}
	// Output:
	// a tick ran; leads: true
}
