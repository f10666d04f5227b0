package coordinator

import (
	"context"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Counting bounds: status pages polled by many people cost one query a
// second, and the tasks{state} gauge is refreshed every few seconds.
const (
	countsMaxAge    = time.Second
	countsRefresh   = 5 * time.Second
	countsQueryTime = 10 * time.Second
)

// counter is the loop that keeps the tasks{state} gauge current, and the
// cache the API reads counts from.
type counter struct {
	store *store.Store
	clock clock.Clock
	log   hclog.Logger
	gauge *prometheus.GaugeVec

	mu     sync.Mutex
	counts map[tasks.State]int64
	at     time.Time
}

// Counts returns the tasks by state, at most countsMaxAge old.
func (c *counter) Counts(ctx context.Context) (map[tasks.State]int64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.counts != nil && c.clock.Now().Sub(c.at) < countsMaxAge {
		return c.counts, nil
	}
	counts, err := c.store.CountByState(ctx)
	if err != nil {
		return nil, err
	}
	c.counts, c.at = counts, c.clock.Now()
	for st, n := range counts {
		c.gauge.WithLabelValues(string(st)).Set(float64(n))
	}
	return counts, nil
}

// Run refreshes the counts every countsRefresh until ctx ends.
func (c *counter) Run(ctx context.Context) {
	for {
		qctx, cancel := context.WithTimeout(ctx, countsQueryTime)
		if _, err := c.Counts(qctx); err != nil && ctx.Err() == nil {
			c.log.Warn("counting tasks failed", "error", err)
		}
		cancel()
		if !clock.Sleep(c.clock, countsRefresh, ctx.Done()) {
			return
		}
	}
}
