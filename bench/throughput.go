package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	srclient "github.com/shardrun/shardrun/client"
	"github.com/shardrun/shardrun/internal/pgtmp"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// burnDown is one throughput trial.
type burnDown struct {
	System       string  `json:"system"`
	Processes    int     `json:"processes"`
	Tasks        int     `json:"tasks"`
	EnqueuePerS  float64 `json:"enqueue_rows_per_s"`
	TasksPerS    float64 `json:"tasks_per_s"`
	Seconds      float64 `json:"burn_down_s"`
	XactsPerTask float64 `json:"pg_transactions_per_task"`
	// StmtsPerTask is 0 when pg_stat_statements could not be loaded.
	StmtsPerTask float64 `json:"pg_statements_per_task,omitempty"`
	PeakRSSMiB   float64 `json:"peak_rss_mib_per_process,omitempty"`
	// Unhandled ready tasks of a kind nobody handles, present throughout.
	Unhandled int `json:"unhandled_ready_tasks,omitempty"`
	// CPU seconds per 10,000 tasks of the worker processes (their whole
	// life) and of the PostgreSQL server (from just before the workers
	// started to the end of the burn-down): see pgCPU for the method.
	CPUWorkersPer10k  float64 `json:"cpu_s_per_10k_tasks_workers"`
	CPUPostgresPer10k float64 `json:"cpu_s_per_10k_tasks_postgres"`
	CPUTotalPer10k    float64 `json:"cpu_s_per_10k_tasks_total"`
	// Deadlocks PostgreSQL detected in the trial's database (each one stalls
	// its statements for deadlock_timeout, a second, before one is
	// cancelled and retried).
	Deadlocks int64 `json:"pg_deadlocks"`
	// TopStatements and Waits say where the trial's database time went.
	TopStatements []stmtStat `json:"top_statements,omitempty"`
	Waits         []string   `json:"active_backends_by_wait_event,omitempty"`
	// PerRunner is each shardrun runner's share: tasks, its first claim
	// and last finish in seconds from the trial's first claim.
	PerRunner []runnerShare `json:"per_runner,omitempty"`
}

type runnerShare struct {
	Runner      string  `json:"runner"`
	Tasks       int     `json:"tasks"`
	FirstClaimS float64 `json:"first_claim_s"`
	LastFinishS float64 `json:"last_finish_s"`
}

// setCPU records the CPU seconds spent on the trial's n tasks.
func (r *burnDown) setCPU(workers, postgres float64, n int) {
	per := 10_000 / float64(n)
	r.CPUWorkersPer10k, r.CPUPostgresPer10k = workers*per, postgres*per
	r.CPUTotalPer10k = r.CPUWorkersPer10k + r.CPUPostgresPer10k
}

// burnDownPoll is how often the bench asks whether a burn-down is done.
// Not faster: the polls are PostgreSQL CPU in the measurement (the same
// for both systems), and the timing comes from the database's timestamps,
// not from when a poll noticed the end.
const burnDownPoll = 20 * time.Millisecond

const insertBatch = 10_000

// pgCounters are a database's cumulative transaction, statement and
// deadlock counts.
type pgCounters struct{ xacts, stmts, deadlocks int64 }

// counters reads the counters of the database pool is connected to; stmts
// stays 0 without pg_stat_statements. The statements counted are those
// clients sent (pg_stat_statements.track = top), read from the admin
// database so that reading them adds nothing to the count.
func (e *env) counters(ctx context.Context, pool *pgxpool.Pool) (pgCounters, error) {
	var c pgCounters
	if err := pool.QueryRow(ctx, `SELECT xact_commit + xact_rollback, deadlocks FROM pg_stat_database WHERE datname = current_database()`).Scan(&c.xacts, &c.deadlocks); err != nil {
		return c, err
	}
	if !e.statStatements {
		return c, nil
	}
	conn, err := pgx.Connect(ctx, e.pg.DSN("postgres"))
	if err != nil {
		return c, err
	}
	defer conn.Close(ctx)
	err = conn.QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements
		WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1)`, pool.Config().ConnConfig.Database).Scan(&c.stmts)
	return c, err
}

// perTask is what a system cost per task between two readings, less the
// bench's own polls (one autocommit statement each) and one reading of the
// transaction counter (the other falls outside each count). Read after
// the system's connections closed: a backend may hold its transaction
// counts back for up to a second while it stays connected and idle, but
// flushes them when it exits; pg_stat_statements counts at once.
func perTask(before, after pgCounters, polls, n int) (xacts, stmts float64) {
	own := int64(polls + 1)
	xacts = float64(after.xacts-before.xacts-own) / float64(n)
	if after.stmts > 0 {
		stmts = float64(after.stmts-before.stmts-own) / float64(n)
	}
	return xacts, stmts
}

// shardrunBurnDown inserts n noop tasks with COPY, then starts processes
// runners and times the burn-down from the first claim to the last
// completion (database timestamps).
//
// unhandled ready tasks of a kind no runner handles, due an hour earlier
// than the noop tasks, are inserted first when unhandled > 0 (issue 14:
// claims used to scan them all).
func (e *env) shardrunBurnDown(ctx context.Context, trial, processes, n, maxWorkers, unhandled int) (burnDown, error) {
	r := burnDown{System: "shardrun", Processes: processes, Tasks: n, Unhandled: unhandled}
	dsn, err := e.database(ctx, fmt.Sprintf("sr_tp_%d_%d_%d", processes, trial, unhandled))
	if err != nil {
		return r, err
	}
	st, err := store.Open(ctx, dsn, store.Options{MaxConns: 4})
	if err != nil {
		return r, err
	}
	defer st.Close()
	if err := st.Migrate(ctx); err != nil {
		return r, err
	}
	client, err := srclient.New(st, srclient.Config{ShardCount: 256})
	if err != nil {
		return r, err
	}
	if unhandled > 0 {
		if _, err := st.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key, run_after)
			SELECT 'nobody-handles-this', g % 256, g::text, now() - interval '1 hour' FROM generate_series(1, $1) g`, unhandled); err != nil {
			return r, err
		}
	}
	if r.EnqueuePerS, err = enqueueNoops(ctx, client, n); err != nil {
		return r, err
	}
	before, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}

	postmaster, err := e.postmasterPID(ctx)
	if err != nil {
		return r, err
	}
	pgc := startPGCPU(postmaster)
	c := e.newCluster(fmt.Sprintf("tp-%d-%d-%d", processes, trial, time.Now().UnixNano()), dsn, 256)
	defer c.stop()
	var peak sampler
	var rps []*runnerProc
	for i := range processes {
		rp, err := c.start(fmt.Sprintf("runner-%d", i+1), runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: maxWorkers})
		if err != nil {
			pgc.stop()
			return r, err
		}
		peak.watch(rp)
		rps = append(rps, rp)
	}
	waits := e.sampleWaits(ctx, st.Pool().Config().ConnConfig.Database)
	polls, err := waitBurnedDown(ctx, st)
	peak.stop()
	r.Waits = waits.stop()
	// While the runners are still connected: their backends exit with them.
	pgSeconds := pgc.stop()
	if err != nil {
		return r, err
	}
	c.stop()
	var workerSeconds float64
	for _, rp := range rps {
		workerSeconds += processCPU(rp.cmd.ProcessState)
	}
	r.setCPU(workerSeconds, pgSeconds, n)
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	span, err := burnDownSpan(ctx, st, "noop")
	if err != nil {
		return r, err
	}
	r.Seconds, r.TasksPerS = span, float64(n)/span
	r.XactsPerTask, r.StmtsPerTask = perTask(before, after, polls, n)
	r.Deadlocks = after.deadlocks - before.deadlocks
	r.PeakRSSMiB = peak.max() / (1 << 20)
	shares, err := st.Pool().Query(ctx, `SELECT claimed_by, count(*)::int,
			extract(epoch FROM min(claimed_at) - (SELECT min(claimed_at) FROM tasks))::float8,
			extract(epoch FROM max(finished_at) - (SELECT min(claimed_at) FROM tasks))::float8
		FROM tasks GROUP BY claimed_by ORDER BY claimed_by`)
	if err != nil {
		return r, err
	}
	if r.PerRunner, err = pgx.CollectRows(shares, pgx.RowToStructByPos[runnerShare]); err != nil {
		return r, err
	}
	r.TopStatements, err = e.topStatements(ctx, st.Pool().Config().ConnConfig.Database, 6)
	return r, err
}

// enqueueNoops inserts n noop tasks by COPY in batches of insertBatch, each
// batch its own transaction, and returns the rows per second.
func enqueueNoops(ctx context.Context, client *srclient.Client, n int) (float64, error) {
	batch := make([]tasks.NewTask, insertBatch)
	for i := range batch {
		batch[i] = tasks.NewTask{Kind: "noop"}
	}
	start := time.Now()
	for done := 0; done < n; done += insertBatch {
		if _, err := client.EnqueueBatch(ctx, batch[:min(insertBatch, n-done)]); err != nil {
			return 0, fmt.Errorf("enqueueing noop tasks: %w", err)
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// waitBurnedDown polls until no noop task is ready and none is running,
// and returns how many polls it took (each one autocommit statement, which
// perTask subtracts).
func waitBurnedDown(ctx context.Context, st *store.Store) (int, error) {
	polls := 0
	err := waitEvery(10*time.Minute, burnDownPoll, func() bool {
		var pending bool
		polls++
		// Index-driven whatever else is ready (the ready index is keyed by kind).
		_ = st.Pool().QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM tasks WHERE state = 'ready' AND kind = 'noop')
			OR EXISTS (SELECT 1 FROM tasks WHERE state = 'running')`).Scan(&pending)
		return !pending
	})
	if err != nil {
		return polls, fmt.Errorf("burn-down: %w", err)
	}
	return polls, nil
}

// burnDownSpan is the seconds from the first claim to the last completion
// of the tasks of kind, from the database's own timestamps, so that neither
// the runners' start nor the bench's polling interval counts.
func burnDownSpan(ctx context.Context, st *store.Store, kind string) (float64, error) {
	var span float64
	if err := st.Pool().QueryRow(ctx, `SELECT extract(epoch FROM max(finished_at) - min(claimed_at)) FROM tasks WHERE kind = $1`, kind).Scan(&span); err != nil {
		return 0, fmt.Errorf("reading the burn-down span: %w", err)
	}
	return span, nil
}

// sampler records the largest RSS of the runners while it runs.
type sampler struct {
	mu   sync.Mutex
	rss  float64
	quit chan struct{}
	wg   sync.WaitGroup
	rps  []*runnerProc
}

func (s *sampler) watch(r *runnerProc) {
	if s.quit == nil {
		s.quit = make(chan struct{})
		s.wg.Go(s.loop)
	}
	s.mu.Lock()
	s.rps = append(s.rps, r)
	s.mu.Unlock()
}

func (s *sampler) loop() {
	for {
		s.mu.Lock()
		rps := append([]*runnerProc(nil), s.rps...)
		s.mu.Unlock()
		for _, r := range rps {
			if v := r.metric("process_resident_memory_bytes"); v > 0 {
				s.mu.Lock()
				s.rss = max(s.rss, v)
				s.mu.Unlock()
			}
		}
		select {
		case <-s.quit:
			return
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func (s *sampler) stop() {
	if s.quit != nil {
		close(s.quit)
		s.wg.Wait()
	}
}

func (s *sampler) max() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rss
}

// NoopArgs is River's no-op job.
type NoopArgs struct{}

// Kind names the job kind.
func (NoopArgs) Kind() string { return "noop" }

// NoopWorker does nothing.
type NoopWorker struct {
	river.WorkerDefaults[NoopArgs]
}

// Work completes at once.
func (NoopWorker) Work(context.Context, *river.Job[NoopArgs]) error { return nil }

// riverSettings are River's settings for this machine: those of River's own
// benchmark (cmd/river/riverbench), with the worker count that did best
// here (see the report).
type riverSettings struct {
	MaxWorkers        int    `json:"max_workers"`
	FetchCooldown     string `json:"fetch_cooldown"`
	FetchPollInterval string `json:"fetch_poll_interval"`
	PoolConns         int32  `json:"pool_max_conns"`
}

// riverBurnDown does the same with River: InsertManyFast (COPY) in batches
// from the bench process, then clients River child processes (riverProc,
// each with its own pool) burn the jobs down; timed from the first attempt
// to the last finalisation.
func (e *env) riverBurnDown(ctx context.Context, trial, clients, n int, rs riverSettings) (burnDown, error) {
	r := burnDown{System: "river", Processes: clients, Tasks: n}
	dsn, err := e.database(ctx, fmt.Sprintf("river_tp_%d_%d", clients, trial))
	if err != nil {
		return r, err
	}
	pool, err := riverPool(ctx, dsn, rs.PoolConns)
	if err != nil {
		return r, err
	}
	defer pool.Close()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return r, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return r, err
	}
	inserter, err := newRiverClient(pool, rs, false)
	if err != nil {
		return r, err
	}
	params := make([]river.InsertManyParams, insertBatch)
	for i := range params {
		params[i] = river.InsertManyParams{Args: NoopArgs{}}
	}
	start := time.Now()
	for done := 0; done < n; done += insertBatch {
		if _, err := inserter.InsertManyFast(ctx, params[:min(insertBatch, n-done)]); err != nil {
			return r, err
		}
	}
	r.EnqueuePerS = float64(n) / time.Since(start).Seconds()
	before, err := e.counters(ctx, pool)
	if err != nil {
		return r, err
	}
	postmaster, err := e.postmasterPID(ctx)
	if err != nil {
		return r, err
	}
	pgc := startPGCPU(postmaster)
	var procs []*riverProc
	stopAll := func() (float64, error) {
		var sum float64
		var firstErr error
		for _, p := range procs {
			cpu, err := p.stop()
			sum += cpu
			if firstErr == nil {
				firstErr = err
			}
		}
		procs = nil
		return sum, firstErr
	}
	defer stopAll()
	for range clients {
		p, err := startRiverProc(dsn, rs)
		if err != nil {
			pgc.stop()
			return r, err
		}
		procs = append(procs, p)
	}
	waits := e.sampleWaits(ctx, pool.Config().ConnConfig.Database)
	polls := 0
	err = waitEvery(10*time.Minute, burnDownPoll, func() bool {
		var pending bool
		polls++
		_ = pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM river_job WHERE state IN ('available', 'running', 'retryable'))`).Scan(&pending)
		return !pending
	})
	r.Waits = waits.stop()
	// While the children are still connected: their backends exit with them.
	pgSeconds := pgc.stop()
	workerSeconds, stopErr := stopAll()
	if err != nil {
		return r, fmt.Errorf("river burn-down: %w", err)
	}
	if stopErr != nil {
		return r, stopErr
	}
	after, err := e.counters(ctx, pool)
	if err != nil {
		return r, err
	}
	var span float64
	var completed int
	if err := pool.QueryRow(ctx, `SELECT extract(epoch FROM max(finalized_at) - min(attempted_at)), count(*) FILTER (WHERE state = 'completed') FROM river_job`).Scan(&span, &completed); err != nil {
		return r, err
	}
	if completed != n {
		return r, fmt.Errorf("river completed %d of %d jobs", completed, n)
	}
	r.Seconds, r.TasksPerS = span, float64(n)/span
	r.XactsPerTask, r.StmtsPerTask = perTask(before, after, polls, n)
	r.Deadlocks = after.deadlocks - before.deadlocks
	r.setCPU(workerSeconds, pgSeconds, n)
	r.TopStatements, err = e.topStatements(ctx, pool.Config().ConnConfig.Database, 6)
	return r, err
}

// database creates a fresh database on the bench server.
func (e *env) database(ctx context.Context, name string) (string, error) {
	return pgtmp.CreateDatabase(ctx, e.pg.DSN("postgres"), fmt.Sprintf("%s_%d", name, time.Now().UnixNano()%1_000_000))
}
