package coordinator

import (
	"context"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/store"
)

// unhandledWatch is the loop that keeps the shardrun_unhandled_tasks{kind}
// gauge current on every coordinator, and the cache the cluster view reads
// the unhandled kinds from: ready tasks whose kind no attached runner
// handles (runners publish their kinds in their runners/ key).
type unhandledWatch struct {
	store *store.Store
	kinds func(ctx context.Context) (map[string]bool, error)
	clock clock.Clock
	log   hclog.Logger
	gauge *prometheus.GaugeVec

	mu   sync.Mutex
	last []store.KindCount
	at   time.Time
}

// Unhandled returns the ready tasks of unhandled kinds, at most
// countsMaxAge old.
func (u *unhandledWatch) Unhandled(ctx context.Context) ([]store.KindCount, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.last != nil && u.clock.Now().Sub(u.at) < countsMaxAge {
		return u.last, nil
	}
	handled, err := u.kinds(ctx)
	if err != nil {
		return nil, err
	}
	got, err := u.store.ReadyKindsExcept(ctx, slices.Sorted(maps.Keys(handled)))
	if err != nil {
		return nil, err
	}
	if got == nil {
		got = []store.KindCount{}
	}
	u.last, u.at = got, u.clock.Now()
	u.gauge.Reset()
	for _, kc := range got {
		u.gauge.WithLabelValues(kc.Kind).Set(float64(kc.Ready))
	}
	return got, nil
}

// Run refreshes every countsRefresh until ctx ends.
func (u *unhandledWatch) Run(ctx context.Context) {
	for {
		qctx, cancel := context.WithTimeout(ctx, countsQueryTime)
		if _, err := u.Unhandled(qctx); err != nil && ctx.Err() == nil {
			u.log.Warn("counting ready tasks of unhandled kinds failed", "error", err)
		}
		cancel()
		if !clock.Sleep(u.clock, countsRefresh, ctx.Done()) {
			return
		}
	}
}
