package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5/pgxpool"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// notifyProducers are the producer counts of the notify section.
var notifyProducers = []int{1, 2, 4, 8, 16, 32}

// notifySeconds is how long each notify run inserts (-notify-seconds).
var notifySeconds = 5

// notifyVariant is one way the tasks table is set up for the notify
// section. The variants are a list so that another (say, a cheaper
// trigger) can be measured by adding an entry.
type notifyVariant struct {
	name string
	// setup changes the freshly migrated schema.
	setup func(ctx context.Context, pool *pgxpool.Pool) error
	// listen runs one LISTEN connection during the run, as a runner keeps
	// one: PostgreSQL does more at commit for a notification somebody
	// listens to, so a run without a listener would flatter the trigger.
	listen bool
	// baseline: the other variants' cost is relative to this one.
	baseline bool
	// raw: the producers insert with plain SQL, as a producer without the
	// client (or inside its own transaction) does, so the trigger notifies
	// each statement; otherwise through client.Tasks.Enqueue, whose
	// inserts skip the trigger and are notified after their commit,
	// coalesced (store/notify.go).
	raw bool
}

var notifyVariants = []notifyVariant{
	{name: "trigger per statement", raw: true, listen: true, setup: noSetup},
	{name: "store, coalesced", listen: true, setup: noSetup},
	{name: "no notification", raw: true, baseline: true, listen: true, setup: func(ctx context.Context, pool *pgxpool.Pool) error {
		// The insert trigger files each task into its lane as well as
		// notifying, so it stays; shardrun.notify off (what the store's own
		// inserts set per transaction) makes it skip the notification, set
		// here for every new session of the database.
		if _, err := pool.Exec(ctx, `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET shardrun.notify = off', current_database()); END $$`); err != nil {
			return err
		}
		pool.Reset()
		return nil
	}},
}

func noSetup(context.Context, *pgxpool.Pool) error { return nil }

// notifyRun is one variant at one producer count.
type notifyRun struct {
	Variant   string  `json:"variant"`
	Producers int     `json:"producers"`
	Rows      int64   `json:"rows"`
	Seconds   float64 `json:"seconds"`
	RowsPerS  float64 `json:"rows_per_s"`
	// Notifications the listener received (0 without a listener).
	Notifications int64 `json:"notifications_received,omitempty"`
	Listener      bool  `json:"listener"`
	// CostPct is how much slower this variant inserted than the baseline
	// at the same producer count, in percent (absent for the baseline).
	CostPct *float64 `json:"cost_vs_baseline_pct,omitempty"`
}

// notifyResult is the notify section's report.
type notifyResult struct {
	What     string      `json:"what"`
	Baseline string      `json:"baseline"`
	Runs     []notifyRun `json:"runs"`
}

// notifySection measures what the insert trigger's per-statement NOTIFY
// costs single-row producers: PostgreSQL serialises the commits of
// transactions that notified (a global lock at commit), so the cost is
// expected to grow with the number of concurrent producers.
//
// The variants of one producer count run back to back, so that load from
// elsewhere on the machine affects them alike.
func (e *env) notifySection(ctx context.Context, rep *Report) error {
	res := &notifyResult{
		What: fmt.Sprintf("single-row inserts (autocommit; plain SQL, or client.Tasks.Enqueue for the store's path), %ds per run, each producer a goroutine with its own connection, fresh database per run, one LISTEN connection", notifySeconds),
	}
	for _, v := range notifyVariants {
		if v.baseline {
			res.Baseline = v.name
		}
	}
	rep.Notify = res
	for _, producers := range notifyProducers {
		var runs []notifyRun
		for _, v := range notifyVariants {
			r, err := e.notifyRun(ctx, v, producers, time.Duration(notifySeconds)*time.Second)
			if err != nil {
				return fmt.Errorf("%s, %d producers: %w", v.name, producers, err)
			}
			runs = append(runs, r)
		}
		var base float64
		for i, v := range notifyVariants {
			if v.baseline {
				base = runs[i].RowsPerS
			}
		}
		for i, v := range notifyVariants {
			if !v.baseline && base > 0 {
				pct := (base - runs[i].RowsPerS) / base * 100
				runs[i].CostPct = &pct
			}
			fmt.Fprintf(e.log, "  %2d producers, %-10s %8.0f rows/s", producers, v.name+":", runs[i].RowsPerS)
			if runs[i].CostPct != nil {
				fmt.Fprintf(e.log, " (%.1f%% fewer than %s)", *runs[i].CostPct, res.Baseline)
			}
			fmt.Fprintln(e.log)
		}
		res.Runs = append(res.Runs, runs...)
	}
	return nil
}

// notifyRun inserts single rows from producers goroutines for d into a
// fresh database set up by v, and counts the rows.
func (e *env) notifyRun(ctx context.Context, v notifyVariant, producers int, d time.Duration) (notifyRun, error) {
	r := notifyRun{Variant: v.name, Producers: producers, Listener: v.listen}
	dsn, err := e.database(ctx, fmt.Sprintf("notify_%d", producers))
	if err != nil {
		return r, err
	}
	st, err := store.Open(ctx, dsn, store.Options{MaxConns: max(producers, store.MinMaxConns)})
	if err != nil {
		return r, err
	}
	defer st.Close()
	if err := st.Migrate(ctx); err != nil {
		return r, err
	}
	if err := v.setup(ctx, st.Pool()); err != nil {
		return r, fmt.Errorf("setting up variant %q: %w", v.name, err)
	}
	// Connect every producer's connection before the clock starts.
	conns := make([]*pgxpool.Conn, producers)
	for i := range conns {
		if conns[i], err = st.Pool().Acquire(ctx); err != nil {
			return r, fmt.Errorf("connecting producer %d: %w", i, err)
		}
	}
	for _, c := range conns {
		c.Release()
	}
	client, err := srclient.New(st, srclient.Config{ShardCount: 256})
	if err != nil {
		return r, err
	}

	var received atomic.Int64
	lctx, stopListening := context.WithCancel(ctx)
	defer stopListening()
	var listening sync.WaitGroup
	if v.listen {
		ready := make(chan struct{})
		var once sync.Once
		l := st.NewListener(hclog.NewNullLogger(), func(n store.Notification) {
			once.Do(func() { close(ready) }) // the first call follows LISTEN
			if !n.All {
				received.Add(1)
			}
		})
		listening.Go(func() { _ = l.Run(lctx) })
		select {
		case <-ready:
		case <-time.After(10 * time.Second):
			return r, fmt.Errorf("the listener did not start")
		}
	}

	var rows atomic.Int64
	var failed atomic.Pointer[error]
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for range producers {
		wg.Go(func() {
			for i := 0; time.Now().Before(deadline); i++ {
				var err error
				if v.raw {
					_, err = st.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key) VALUES ('noop', $1, '')`, i%256)
				} else {
					_, err = client.Enqueue(ctx, tasks.NewTask{Kind: "noop"})
				}
				if err != nil {
					failed.CompareAndSwap(nil, &err)
					return
				}
				rows.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := failed.Load(); err != nil {
		return r, fmt.Errorf("enqueue: %w", *err)
	}
	// Let the last notifications arrive before counting them (one per
	// statement only when the trigger notifies each).
	if v.listen && v.raw {
		_ = waitUntil(2*time.Second, func() bool { return received.Load() >= rows.Load() })
	}
	stopListening()
	listening.Wait()
	var counted int64
	if err := st.Pool().QueryRow(ctx, `SELECT count(*) FROM tasks`).Scan(&counted); err != nil {
		return r, err
	}
	if counted != rows.Load() {
		return r, fmt.Errorf("producers counted %d inserts, the table has %d rows", rows.Load(), counted)
	}
	r.Rows, r.Seconds, r.Notifications = counted, elapsed.Seconds(), received.Load()
	r.RowsPerS = float64(counted) / r.Seconds
	return r, nil
}

// printNotify adds a table row per producer count: every variant's rate and
// the cost against the baseline.
func printNotify(w io.Writer, n *notifyResult) {
	for _, producers := range notifyProducers {
		var parts []string
		var costs []string
		for _, r := range n.Runs {
			if r.Producers != producers {
				continue
			}
			parts = append(parts, fmt.Sprintf("%s %.0f", r.Variant, r.RowsPerS))
			if r.CostPct != nil {
				costs = append(costs, fmt.Sprintf("%s costs **%.1f%%**", r.Variant, *r.CostPct))
			}
		}
		if len(parts) == 0 {
			continue
		}
		fmt.Fprintf(w, "| single-row enqueue, %d producer(s), %ds | %s rows/s; %s vs %s |\n",
			producers, notifySeconds, strings.Join(parts, ", "), strings.Join(costs, ", "), n.Baseline)
	}
}
