package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// waitSampler samples pg_stat_activity's wait events of one database every
// few milliseconds: which waits the backends of a trial spent their time in
// (lock waits on shard_fences show as Lock/tuple or Lock/transactionid).
type waitSampler struct {
	mu      sync.Mutex
	counts  map[string]int
	samples int
	cancel  context.CancelFunc
	done    chan struct{}
}

func (e *env) sampleWaits(ctx context.Context, db string) *waitSampler {
	ctx, cancel := context.WithCancel(ctx)
	w := &waitSampler{counts: map[string]int{}, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		conn, err := pgx.Connect(ctx, e.pg.DSN("postgres"))
		if err != nil {
			return
		}
		defer conn.Close(context.Background())
		for ctx.Err() == nil {
			rows, err := conn.Query(ctx, `SELECT coalesce(wait_event_type || '/' || wait_event, 'CPU'), count(*)
				FROM pg_stat_activity WHERE datname = $1 AND state = 'active' AND pid <> pg_backend_pid() GROUP BY 1`, db)
			if err == nil {
				var ev string
				var c int
				_, _ = pgx.ForEachRow(rows, []any{&ev, &c}, func() error {
					w.mu.Lock()
					w.counts[ev] += c
					w.mu.Unlock()
					return nil
				})
				w.mu.Lock()
				w.samples++
				w.mu.Unlock()
			}
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	return w
}

// stop ends sampling and returns the mean number of active backends in
// each wait event, largest first.
func (w *waitSampler) stop() []string {
	w.cancel()
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	type ev struct {
		name string
		n    int
	}
	var evs []ev
	for k, v := range w.counts {
		evs = append(evs, ev{k, v})
	}
	slices.SortFunc(evs, func(a, b ev) int { return b.n - a.n })
	var out []string
	for _, e := range evs {
		out = append(out, fmt.Sprintf("%s %.2f", e.name, float64(e.n)/float64(max(w.samples, 1))))
	}
	return out
}
