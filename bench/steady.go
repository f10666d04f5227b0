package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// steadyRun is one steady-state run: noop tasks enqueued at a target rate
// while the workers keep up (or not), measured over a window.
type steadyRun struct {
	// from and to bound the window on the database's clock.
	from, to   time.Time
	System     string  `json:"system"`
	Processes  int     `json:"processes"`
	Mode       string  `json:"insert_mode"`
	Rate       int     `json:"target_tasks_per_s"`
	MaxWorkers int     `json:"max_workers_per_process"`
	WindowS    float64 `json:"window_s"`
	// Tasks created inside the window (database clock).
	Enqueued    int     `json:"enqueued_in_window"`
	EnqueuePerS float64 `json:"achieved_enqueue_per_s"`
	// Of those, completed by the window's end.
	Completed int     `json:"completed_by_window_end"`
	TasksPerS float64 `json:"achieved_tasks_per_s"`
	// Of those, not started after the producers stopped and the workers
	// were given up to 10s to catch up: they are not in the percentiles.
	NotStarted int `json:"not_started_after_drain"`
	// Enqueue-to-start latency of the window's tasks: shardrun claimed_at -
	// created_at, River attempted_at - created_at (both database clock).
	P50MS float64 `json:"latency_p50_ms"`
	P95MS float64 `json:"latency_p95_ms"`
	P99MS float64 `json:"latency_p99_ms"`
	MaxMS float64 `json:"latency_max_ms"`
}

// steadyOpts are the steady section's flags.
type steadyOpts struct {
	procs, seconds int
	rates          string
}

var steadyFlags steadyOpts

const (
	steadyWarmup    = 2 * time.Second
	steadyWorkers   = 128
	steadyBatchTick = 10 * time.Millisecond
	// steadyProducers insert statements may be in flight at once: enough
	// for 10,000/s single-row inserts at a few ms per commit.
	steadyProducers = 32
	steadyDrain     = 10 * time.Second
)

// steadySystem is what a steady run needs of a system whose workers run.
type steadySystem struct {
	pool *pgxpool.Pool // the bench's queries
	one  func(context.Context) error
	many func(context.Context, int) error
	// table and the columns of start and finish.
	table, started, finished string
	stop                     func() error
}

func (e *env) steadySection(ctx context.Context, rep *Report) error {
	var rates []int
	for _, f := range strings.Split(steadyFlags.rates, ",") {
		r, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || r <= 0 {
			return fmt.Errorf("-steady-rates: bad rate %q", f)
		}
		rates = append(rates, r)
	}
	procs, window := steadyFlags.procs, time.Duration(steadyFlags.seconds)*time.Second
	rs := riverBase(steadyWorkers)
	rep.Settings["steady"] = map[string]any{"processes": procs, "window_s": window.Seconds(), "warmup_s": steadyWarmup.Seconds(),
		"rates": rates, "batch_every_ms": steadyBatchTick.Milliseconds(), "single_row_producers": steadyProducers,
		"shardrun": map[string]any{"max_workers": steadyWorkers, "db_max_conns": 8, "shard_count": 256, "poll_interval": "1s (default)"},
		"river":    rs}
	rep.Notes = append(rep.Notes,
		"steady state: the workers start first (shardrun: until all 256 shards are owned and balanced; River: until each client started), then producers in the bench process enqueue at the target rate - batched: a statement of rate/100 tasks every 10ms (shardrun EnqueueBatch, River InsertManyFast, both COPY); single: one task per statement, 1/rate apart (shardrun Enqueue, River Insert); open loop, each statement due on its schedule with up to 32 in flight, so a slow commit does not lower the rate unless all 32 are busy - for a 2s warm-up and the window; latency is enqueue-to-start from the database's clock (shardrun claimed_at - created_at, River attempted_at - created_at, created_at being the inserting transaction's now() in both, so the insert's own commit time is part of it) of the tasks created in the window",
		"steady state: 128 workers per process for both (a noop task holds a worker for well under a millisecond, so even 10,000/s over 3 processes needs a few dozen at most; more would only differ in River's fetch sizes); River's FetchCooldown 2ms and FetchPollInterval 20ms as in the throughput runs, notifications at River's default (LISTEN/NOTIFY: the inserting client notifies at most once per FetchCooldown), so a River job waits for a notification-triggered fetch or at worst the 20ms poll; shardrun's runners are woken by NOTIFY too, with their default 1s poll as the fallback",
		"steady state: achieved tasks/s counts the window's tasks completed by the window's end; a target the producers could not meet shows as an achieved enqueue rate below it")
	for _, rate := range rates {
		for _, mode := range []string{"batched", "single"} {
			for _, system := range []string{"shardrun", "river"} {
				var sys *steadySystem
				var err error
				if system == "shardrun" {
					sys, err = e.steadyShardrun(ctx, procs, shardrunTap{})
				} else {
					sys, err = e.steadyRiver(ctx, procs, rs)
				}
				if err != nil {
					return fmt.Errorf("%s: %w", system, err)
				}
				run, err := e.steadyOnce(ctx, sys, rate, mode, window)
				if stopErr := sys.stop(); err == nil {
					err = stopErr
				}
				if err != nil {
					return fmt.Errorf("%s %d/s %s: %w", system, rate, mode, err)
				}
				run.System, run.Processes, run.MaxWorkers = system, procs, steadyWorkers
				rep.Steady = append(rep.Steady, run)
				fmt.Fprintf(e.log, "  %s %d/s %s, %d processes: latency p50/p95/p99 %.1f/%.1f/%.1f ms, %.0f tasks/s (enqueued %.0f/s), %d not started\n",
					system, rate, mode, procs, run.P50MS, run.P95MS, run.P99MS, run.TasksPerS, run.EnqueuePerS, run.NotStarted)
			}
		}
	}
	return nil
}

// shardrunTap is what the wakeup section adds to a steady system: the
// runners' environment (tracing), and a hook told of every enqueue when
// its commit returned: when it was sent, and its tasks (none for a batch
// sent by COPY, which reports no ids).
type shardrunTap struct {
	env       []string
	committed func(sent, at time.Time, ts []tasks.Enqueued)
}

// steadyShardrun starts procs runners on a fresh database and returns once
// the shards are balanced among them.
func (e *env) steadyShardrun(ctx context.Context, procs int, tap shardrunTap) (*steadySystem, error) {
	dsn, err := e.database(ctx, "sr_steady")
	if err != nil {
		return nil, err
	}
	st, err := store.Open(ctx, dsn, store.Options{MaxConns: steadyProducers + 8})
	if err != nil {
		return nil, err
	}
	if err := st.Migrate(ctx); err != nil {
		st.Close()
		return nil, err
	}
	client, err := srclient.New(st, srclient.Config{ShardCount: 256})
	if err != nil {
		st.Close()
		return nil, err
	}
	c := e.newCluster(fmt.Sprintf("steady-%d", time.Now().UnixNano()), dsn, 256)
	stop := func() error { c.stop(); st.Close(); return nil }
	var ids []string
	for i := range procs {
		id := fmt.Sprintf("runner-%d", i+1)
		if _, err := c.start(id, runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: steadyWorkers, env: tap.env}); err != nil {
			stop()
			return nil, err
		}
		ids = append(ids, id)
	}
	if err := waitEvery(time.Minute, 50*time.Millisecond, func() bool { return c.balanced(ctx, ids...) }); err != nil {
		stop()
		return nil, fmt.Errorf("shards not balanced among %d runners: %w", procs, err)
	}
	batch := make([]tasks.NewTask, 10_000)
	for i := range batch {
		batch[i] = tasks.NewTask{Kind: "noop"}
	}
	return &steadySystem{
		pool: st.Pool(),
		one: func(ctx context.Context) error {
			sent := time.Now()
			t, err := client.Enqueue(ctx, tasks.NewTask{Kind: "noop"})
			if err == nil && tap.committed != nil {
				tap.committed(sent, time.Now(), []tasks.Enqueued{t})
			}
			return err
		},
		many: func(ctx context.Context, k int) error {
			sent := time.Now()
			b, err := client.EnqueueBatch(ctx, batch[:min(k, len(batch))])
			if err == nil && tap.committed != nil {
				tap.committed(sent, time.Now(), b.Tasks)
			}
			return err
		},
		table: "tasks", started: "claimed_at", finished: "finished_at",
		stop: stop,
	}, nil
}

// steadyRiver starts procs River child processes on a fresh database.
func (e *env) steadyRiver(ctx context.Context, procs int, rs riverSettings) (*steadySystem, error) {
	dsn, err := e.database(ctx, "river_steady")
	if err != nil {
		return nil, err
	}
	pool, err := riverPool(ctx, dsn, steadyProducers+8)
	if err != nil {
		return nil, err
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		pool.Close()
		return nil, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		pool.Close()
		return nil, err
	}
	inserter, err := newRiverClient(pool, rs, false)
	if err != nil {
		pool.Close()
		return nil, err
	}
	var children []*riverProc
	stop := func() error {
		var errs []error
		for _, p := range children {
			_, err := p.stop()
			errs = append(errs, err)
		}
		pool.Close()
		return errors.Join(errs...)
	}
	for range procs {
		p, err := startRiverProc(dsn, rs)
		if err != nil {
			stop()
			return nil, err
		}
		children = append(children, p)
	}
	params := make([]river.InsertManyParams, 10_000)
	for i := range params {
		params[i] = river.InsertManyParams{Args: NoopArgs{}}
	}
	return &steadySystem{
		pool: pool,
		one: func(ctx context.Context) error {
			_, err := inserter.Insert(ctx, NoopArgs{}, nil)
			return err
		},
		many: func(ctx context.Context, k int) error {
			// InsertManyFast (COPY), as River's throughput trials insert.
			_, err := inserter.InsertManyFast(ctx, params[:min(k, len(params))])
			return err
		},
		table: "river_job", started: "attempted_at", finished: "finalized_at",
		stop: stop,
	}, nil
}

// steadyOnce runs the producers for the warm-up and the window, stops
// them, lets the workers catch up for at most steadyDrain and reads the
// window's tasks from the database.
func (e *env) steadyOnce(ctx context.Context, sys *steadySystem, rate int, mode string, window time.Duration) (steadyRun, error) {
	run := steadyRun{Mode: mode, Rate: rate}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var prodErr error
	wg.Go(func() { prodErr = produce(ctx, stop, mode, rate, sys.one, sys.many) })
	time.Sleep(steadyWarmup) // a fixed warm-up window, not a wait for a condition
	from, err := dbTime(ctx, sys.pool)
	if err != nil {
		return run, err
	}
	time.Sleep(window) // the measured window
	to, err := dbTime(ctx, sys.pool)
	if err != nil {
		return run, err
	}
	close(stop)
	wg.Wait()
	if prodErr != nil {
		return run, fmt.Errorf("producer: %w", prodErr)
	}
	unstarted := fmt.Sprintf(`SELECT count(*) FROM %s WHERE created_at >= $1 AND created_at < $2 AND %s IS NULL`, sys.table, sys.started)
	// Not reaching 0 within steadyDrain is a result (NotStarted), a poll
	// that fails is not.
	var pollErr error
	_ = waitEvery(steadyDrain, 50*time.Millisecond, func() bool {
		var n int
		if pollErr = sys.pool.QueryRow(ctx, unstarted, from, to).Scan(&n); pollErr != nil {
			return true
		}
		return n == 0
	})
	if pollErr != nil {
		return run, fmt.Errorf("waiting for the window's tasks to start: %w", pollErr)
	}
	var pct []float64
	err = sys.pool.QueryRow(ctx, fmt.Sprintf(`
		SELECT count(*), count(*) FILTER (WHERE state = 'completed' AND %[3]s <= $2), count(*) FILTER (WHERE %[2]s IS NULL),
			coalesce(percentile_cont(ARRAY[0.5, 0.95, 0.99, 1]) WITHIN GROUP (ORDER BY extract(epoch FROM %[2]s - created_at) * 1000), '{0,0,0,0}')
		FROM %[1]s WHERE created_at >= $1 AND created_at < $2`, sys.table, sys.started, sys.finished), from, to).
		Scan(&run.Enqueued, &run.Completed, &run.NotStarted, &pct)
	if err != nil {
		return run, fmt.Errorf("reading the window's tasks: %w", err)
	}
	run.from, run.to = from, to
	run.WindowS = to.Sub(from).Seconds()
	run.EnqueuePerS, run.TasksPerS = float64(run.Enqueued)/run.WindowS, float64(run.Completed)/run.WindowS
	run.P50MS, run.P95MS, run.P99MS, run.MaxMS = pct[0], pct[1], pct[2], pct[3]
	return run, nil
}

// produce enqueues rate tasks per second until stop is closed: batched, rate/100
// tasks every 10ms; single, one task per statement. Open loop: the i-th
// statement is due at start + i*interval whenever the ones before it
// finish, and up to steadyProducers statements are in flight, so a commit
// slower than the interval does not lower the rate unless all producers
// are busy (then the achieved enqueue rate shows it).
//
// Closing stop ends it once the statements in flight are done: cancelling
// them instead would let one that began before the window's end (its
// created_at inside the window) commit after the tasks were counted.
func produce(ctx context.Context, stop <-chan struct{}, mode string, rate int, one func(context.Context) error, many func(context.Context, int) error) error {
	var insert func(context.Context) error
	var interval time.Duration
	switch mode {
	case "batched":
		per := max(rate*int(steadyBatchTick/time.Millisecond)/1000, 1)
		insert = func(ctx context.Context) error { return many(ctx, per) }
		interval = time.Duration(int64(time.Second) * int64(per) / int64(rate))
	case "single":
		insert, interval = one, time.Duration(int64(time.Second)/int64(rate))
	default:
		return fmt.Errorf("unknown insert mode %q", mode)
	}
	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, steadyProducers)
	for g := range steadyProducers {
		wg.Go(func() {
			for {
				due := start.Add(time.Duration(next.Add(1)-1) * interval)
				if d := time.Until(due); d > 0 {
					select {
					case <-stop:
						return
					case <-time.After(d):
					}
				}
				select {
				case <-stop:
					return
				default:
				}
				if err := insert(ctx); err != nil {
					errs[g] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func dbTime(ctx context.Context, pool *pgxpool.Pool) (time.Time, error) {
	var t time.Time
	if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&t); err != nil {
		return t, fmt.Errorf("reading the database's clock: %w", err)
	}
	return t, nil
}

// printSteady writes one row per steady run of shardrun, with River's run
// of the same rate, mode and process count beside it.
func printSteady(w io.Writer, runs []steadyRun) {
	cell := func(r steadyRun) string {
		s := fmt.Sprintf("p50/p95/p99 %.1f/%.1f/%.1f ms, %s tasks/s", r.P50MS, r.P95MS, r.P99MS, fmtThousands(int(r.TasksPerS+0.5)))
		if r.EnqueuePerS < 0.98*float64(r.Rate) {
			s += fmt.Sprintf(" (enqueued only %s/s)", fmtThousands(int(r.EnqueuePerS+0.5)))
		}
		if r.NotStarted > 0 {
			s += fmt.Sprintf(", %d not started", r.NotStarted)
		}
		return s
	}
	for _, ours := range runs {
		if ours.System != "shardrun" {
			continue
		}
		theirs := "not run"
		for _, r := range runs {
			if r.System == "river" && r.Rate == ours.Rate && r.Mode == ours.Mode && r.Processes == ours.Processes {
				theirs = cell(r)
			}
		}
		fmt.Fprintf(w, "| steady %s/s %s, %d processes | shardrun %s; River %s |\n",
			fmtThousands(ours.Rate), ours.Mode, ours.Processes, cell(ours), theirs)
	}
}
