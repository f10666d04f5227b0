package tasks

import (
	"context"
	"fmt"

	"github.com/shardrun/shardrun/internal/clock"
)

// Inserter is the part of the store the client needs.
type Inserter interface {
	Enqueue(ctx context.Context, in Insert) (int64, error)
	EnqueueBatch(ctx context.Context, ins []Insert) (int64, error)
}

// ClientConfig configures a Client.
type ClientConfig struct {
	// ShardCount is the cluster's shard count (etcd meta/shard-count);
	// required, since it decides every task's shard.
	ShardCount int
	// MaxAttempts for tasks that do not set one. Default 5.
	MaxAttempts int
	// Clock checks deadlines; default the real clock.
	Clock clock.Clock
}

// Client validates and enqueues tasks.
type Client struct {
	ins Inserter
	cfg ClientConfig
}

// NewClient returns a client that enqueues through ins.
func NewClient(ins Inserter, cfg ClientConfig) (*Client, error) {
	if cfg.ShardCount < 1 {
		return nil, &FieldError{Field: "shard_count", Problem: fmt.Sprintf("must be at least 1, got %d (unknown shard count)", cfg.ShardCount)}
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.MaxAttempts < 1 || cfg.MaxAttempts > MaxAttemptsLimit {
		return nil, &FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be 1 to %d, got %d", MaxAttemptsLimit, cfg.MaxAttempts)}
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real()
	}
	return &Client{ins: ins, cfg: cfg}, nil
}

// Prepare validates one task and computes its shard.
func (c *Client) Prepare(n NewTask) (Insert, error) {
	return n.Prepare(c.cfg.Clock.Now(), c.cfg.ShardCount, c.cfg.MaxAttempts)
}

// Enqueue validates and inserts one task, returning its id. Errors from
// the database are the store's; store.Classify tells an unavailable
// database from a refused value.
func (c *Client) Enqueue(ctx context.Context, n NewTask) (int64, error) {
	in, err := c.Prepare(n)
	if err != nil {
		return 0, err
	}
	return c.ins.Enqueue(ctx, in)
}

// EnqueueBatch validates every task first and inserts none if any is
// invalid; the error names the index of the first bad task.
func (c *Client) EnqueueBatch(ctx context.Context, ns []NewTask) (int64, error) {
	ins := make([]Insert, len(ns))
	for i, n := range ns {
		in, err := c.Prepare(n)
		if err != nil {
			return 0, fmt.Errorf("task %d of %d: %w", i, len(ns), err)
		}
		ins[i] = in
	}
	return c.ins.EnqueueBatch(ctx, ins)
}
