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

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtmp"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// burnDown is one throughput trial.
type burnDown struct {
	System       string  `json:"system"`
	Processes    int     `json:"processes"`
	Tasks        int     `json:"tasks"`
	MaxWorkers   int     `json:"max_workers_per_process,omitempty"`
	EnqueuePerS  float64 `json:"enqueue_rows_per_s"`
	TasksPerS    float64 `json:"tasks_per_s"`
	Seconds      float64 `json:"burn_down_s"`
	XactsPerTask float64 `json:"pg_transactions_per_task"`
	// StmtsPerTask, PagesPerTask (shared buffer hits and reads of every
	// statement) and PagesPerClaimedTask (those of the claim or fetch
	// statements over the tasks they claimed) are 0 when
	// pg_stat_statements could not be loaded. ClaimedTasks is the rows
	// those statements returned.
	StmtsPerTask        float64 `json:"pg_statements_per_task,omitempty"`
	PagesPerTask        float64 `json:"pg_pages_per_task,omitempty"`
	PagesPerClaimedTask float64 `json:"pg_pages_per_claimed_task,omitempty"`
	ClaimedTasks        int64   `json:"claimed_tasks,omitempty"`
	// WALBytesPerTask is the WAL the server wrote from just before the
	// workers started to the end of the burn-down, per task.
	WALBytesPerTask float64 `json:"wal_bytes_per_task"`
	PeakRSSMiB      float64 `json:"peak_rss_mib_per_process,omitempty"`
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
	// Autovacuums and Autoanalyzes of the trial's tables during the
	// burn-down: new statistics may change the plans mid-trial.
	Autovacuums  int64 `json:"autovacuums"`
	Autoanalyzes int64 `json:"autoanalyzes"`
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

// burnDownPoll is how often the bench asks River's table whether a
// burn-down is done.
// Not faster: the polls are PostgreSQL CPU in the measurement (the same
// for both systems), and the timing comes from the database's timestamps,
// not from when a poll noticed the end.
const burnDownPoll = 20 * time.Millisecond

// burnDownTimeout bounds a burn-down: far above what a working system
// needs, so that reaching it means the trial failed.
const burnDownTimeout = 20 * time.Minute

const insertBatch = 10_000

// trialOpts shape one burn-down trial.
type trialOpts struct {
	// label names the trial's database, with the process count and trial.
	label               string
	trial, processes, n int
	// maxWorkers is each process's worker count (shardrun --max-workers);
	// River's is in its riverSettings.
	maxWorkers int
	// dbMaxConns is each shardrun runner's --db-max-conns (0: 8).
	dbMaxConns int
	// unhandled is how many ready tasks of a kind no runner handles are
	// enqueued first (deployedBurnDown).
	unhandled int
	// queues is the runners' --queues (shardrunBurnDown); empty: their
	// default.
	queues string
	// task is the i-th noop task shardrunBurnDown enqueues; nil: a plain
	// one (kind noop, nothing else set).
	task func(i int) tasks.NewTask
	// check, when set, reads the trial's database after the burn-down,
	// before it is dropped (shardrunBurnDown).
	check func(context.Context, *pgxpool.Pool) error
	// traced, when set, traces the trial: the enqueue through its
	// provider, the runners with its OTEL_* environment (tracing.go).
	traced *tracedTrial
}

// shardrunBurnDown inserts o.n noop tasks with COPY, then starts
// o.processes runners and times the burn-down from the first claim to the
// last completion (database timestamps). It fails unless every noop task
// completed.
func (e *env) shardrunBurnDown(ctx context.Context, o trialOpts) (r burnDown, err error) {
	r = burnDown{System: "shardrun", Processes: o.processes, Tasks: o.n, MaxWorkers: o.maxWorkers}
	st, dsn, drop, err := e.trialStore(ctx, fmt.Sprintf("sr_%s_%d_%d", o.label, o.processes, o.trial), 4)
	if err != nil {
		return r, err
	}
	defer func() {
		if dropErr := drop(); err == nil {
			err = dropErr
		}
	}()
	db := st.Pool().Config().ConnConfig.Database
	ccfg := srclient.Config{ShardCount: 256}
	var env []string
	if o.traced != nil {
		ccfg.TracerProvider, env = o.traced.producer.TracerProvider(), o.traced.env
	}
	client, err := srclient.New(st, ccfg)
	if err != nil {
		return r, err
	}
	if r.EnqueuePerS, err = enqueueNoops(ctx, client, o.n, o.task); err != nil {
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
	c := e.newCluster(fmt.Sprintf("tp-%d-%d-%d", o.processes, o.trial, time.Now().UnixNano()), dsn, 256)
	defer c.stop()
	var peak sampler
	rps, err := c.startAll(o.processes, runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: o.maxWorkers, dbMaxConns: o.dbMaxConns, queues: o.queues, env: env})
	if err != nil {
		pgc.stop()
		return r, err
	}
	for _, rp := range rps {
		peak.watch(rp)
	}
	waits := e.sampleWaits(ctx, db)
	err = waitBurnedDown(ctx, st.Pool(), rps, "noop", o.n)
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
	r.setCPU(workerSeconds, pgSeconds, o.n)
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	r.setCosts(before, after, 0, o.n)
	span, err := burnDownSpan(ctx, st.Pool(), "noop")
	if err != nil {
		return r, err
	}
	r.Seconds, r.TasksPerS = span, float64(o.n)/span
	r.PeakRSSMiB = peak.max() / (1 << 20)
	if r.PerRunner, err = runnerShares(ctx, st.Pool(), "noop"); err != nil {
		return r, err
	}
	if r.TopStatements, err = e.topStatements(ctx, db, 6); err != nil {
		return r, err
	}
	if o.check != nil {
		err = o.check(ctx, st.Pool())
	}
	return r, err
}

// unhandledKind is the kind of the tasks no runner handles.
const unhandledKind = "nobody-handles-this"

// runnerShares is each runner's share of the finished tasks of kind.
func runnerShares(ctx context.Context, pool *pgxpool.Pool, kind string) ([]runnerShare, error) {
	rows, err := pool.Query(ctx, benchTag+`SELECT coalesce(claimed_by, ''), count(*)::int,
			extract(epoch FROM min(claimed_at) - (SELECT min(claimed_at) FROM tasks WHERE kind = $1))::float8,
			extract(epoch FROM max(finished_at) - (SELECT min(claimed_at) FROM tasks WHERE kind = $1))::float8
		FROM tasks WHERE kind = $1 GROUP BY claimed_by ORDER BY claimed_by`, kind)
	if err != nil {
		return nil, fmt.Errorf("reading the runners' shares: %w", err)
	}
	shares, err := pgx.CollectRows(rows, pgx.RowToStructByPos[runnerShare])
	if err != nil {
		return nil, fmt.Errorf("reading the runners' shares: %w", err)
	}
	return shares, nil
}

// enqueueNoops inserts n noop tasks by COPY in batches of insertBatch, each
// batch its own transaction, in order (task(0), task(1)...; plain noop
// tasks when task is nil), and returns the rows per second.
func enqueueNoops(ctx context.Context, client *srclient.Tasks, n int, task func(i int) tasks.NewTask) (float64, error) {
	batch := make([]tasks.NewTask, insertBatch)
	for i := range batch {
		batch[i] = tasks.NewTask{Kind: "noop"}
	}
	start := time.Now()
	for done := 0; done < n; done += insertBatch {
		k := min(insertBatch, n-done)
		if task != nil {
			for i := range k {
				batch[i] = task(done + i)
			}
		}
		if _, err := client.EnqueueBatch(ctx, batch[:k]); err != nil {
			return 0, fmt.Errorf("enqueueing noop tasks: %w", err)
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// enqueueNoopsAtOnce inserts n noop tasks in one transaction (COPY in
// batches of insertBatch), so that runners already running find them all
// claimable at the same moment, and returns the rows per second.
func enqueueNoopsAtOnce(ctx context.Context, st *store.Store, prep srclient.Config, n int) (float64, error) {
	start := time.Now()
	err := pgx.BeginFunc(ctx, st.Pool(), func(tx pgx.Tx) error {
		ins := make([]store.Insert, 0, insertBatch)
		for done := 0; done < n; done += insertBatch {
			ins = ins[:0]
			for range min(insertBatch, n-done) {
				in, err := prep.Prepare(tasks.NewTask{Kind: "noop"}, time.Now())
				if err != nil {
					return err
				}
				ins = append(ins, in)
			}
			if _, err := st.EnqueueBatchIn(ctx, tx, ins); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("enqueueing noop tasks: %w", err)
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// finishedPoll is how often the bench reads the runners' metrics to learn
// whether a burn-down is done: it costs PostgreSQL nothing, and the timing
// comes from the database's timestamps.
const finishedPoll = 100 * time.Millisecond

// finishedStall is how long the runners' count of completed tasks may stay
// still below n before the bench asks the database instead.
const finishedStall = time.Second

// waitBurnedDown waits until no task of kind is unfinished, then checks in
// the database that exactly n tasks of kind exist and all completed.
//
// It follows the runners' shardrun_tasks_finished_total (outcome
// completed) rather than polling the database: a query's plan depends on
// statistics a trial may have skewed (the unclaimable section does on
// purpose), and a poll that reads thousands of pages would count as the
// system's PostgreSQL CPU. The count is not exact, though: a completion
// whose answer was lost (its statement timed out after it committed) is
// recorded but not counted. So once the count reaches n, or stops moving
// below it for finishedStall, the database says whether any task of kind
// is still unfinished (ready or running: the states an unfinished task
// shows in tasks before and after the layout of issue 23). A metrics read
// or a query that fails, a runner that exits and a burn-down that does not
// end within burnDownTimeout fail the trial.
func waitBurnedDown(ctx context.Context, pool *pgxpool.Pool, runners []*runnerProc, kind string, n int) error {
	if _, err := waitDrained(ctx, pool, runners, kind, n); err != nil {
		return err
	}
	return checkCompleted(ctx, pool, "shardrun", "tasks", kind, n)
}

// waitDrained waits until the runners' metrics count n completed tasks of
// kind (or stop moving) and no task of kind is unfinished, and returns the
// completions the metrics counted.
func waitDrained(ctx context.Context, pool *pgxpool.Pool, runners []*runnerProc, kind string, n int) (float64, error) {
	last, moved := -1.0, time.Now()
	_, err := pollUntil(ctx, burnDownTimeout, finishedPoll, func() (bool, error) {
		done := 0.0
		for _, r := range runners {
			if r.cmd.ProcessState != nil {
				return false, fmt.Errorf("runner %s exited during the burn-down\n%s", r.id, linewriter.Tail(r.logs.String(), 20))
			}
			v, err := r.metricWith("shardrun_tasks_finished_total", `kind="`+kind+`"`, `outcome="completed"`)
			if err != nil {
				return false, err
			}
			done += v
		}
		if done != last {
			last, moved = done, time.Now()
		}
		if done < float64(n) && time.Since(moved) < finishedStall {
			return false, nil
		}
		var pending bool
		err := pool.QueryRow(ctx, benchTag+`SELECT EXISTS (SELECT 1 FROM tasks WHERE state = 'ready' AND kind = $1)
			OR EXISTS (SELECT 1 FROM tasks WHERE state = 'running' AND kind = $1)`, kind).Scan(&pending)
		if pending {
			moved = time.Now() // ask again after another stall
		}
		return !pending, err
	})
	if err != nil {
		states, serr := finalStates(ctx, pool, "tasks", kind)
		if serr != nil {
			return last, fmt.Errorf("shardrun burn-down: %w", err)
		}
		return last, fmt.Errorf("shardrun burn-down: %w (%s tasks: %s)", err, kind, describeStates(states))
	}
	return last, nil
}

// burnDownSpan is the seconds from the first claim to the last completion
// of the tasks of kind, from the database's own timestamps, so that neither
// the runners' start nor the bench's polling interval counts.
func burnDownSpan(ctx context.Context, pool *pgxpool.Pool, kind string) (float64, error) {
	var span float64
	if err := pool.QueryRow(ctx, benchTag+`SELECT extract(epoch FROM max(finished_at) - min(claimed_at)) FROM tasks WHERE kind = $1`, kind).Scan(&span); err != nil {
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
// from the bench process, then o.processes River child processes
// (riverProc, each with its own pool) burn the jobs down; timed from the
// first attempt to the last finalisation. It fails unless every job
// completed.
func (e *env) riverBurnDown(ctx context.Context, o trialOpts, rs riverSettings) (r burnDown, err error) {
	r = burnDown{System: "river", Processes: o.processes, Tasks: o.n, MaxWorkers: rs.MaxWorkers}
	dsn, err := e.database(ctx, fmt.Sprintf("river_%s_%d_%d", o.label, o.processes, o.trial))
	if err != nil {
		return r, err
	}
	pool, err := riverPool(ctx, dsn, rs.PoolConns)
	if err != nil {
		return r, err
	}
	db := pool.Config().ConnConfig.Database
	defer func() {
		pool.Close()
		if dropErr := e.dropDatabase(ctx, db); err == nil {
			err = dropErr
		}
	}()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return r, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return r, fmt.Errorf("migrating River: %w", err)
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
	for done := 0; done < o.n; done += insertBatch {
		if _, err := inserter.InsertManyFast(ctx, params[:min(insertBatch, o.n-done)]); err != nil {
			return r, fmt.Errorf("inserting River jobs: %w", err)
		}
	}
	r.EnqueuePerS = float64(o.n) / time.Since(start).Seconds()
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
	started, err := startRiverProcs(dsn, rs, o.processes)
	procs = started
	if err != nil {
		pgc.stop()
		return r, err
	}
	waits := e.sampleWaits(ctx, db)
	polls, err := pollUntil(ctx, burnDownTimeout, burnDownPoll, func() (bool, error) {
		var pending bool
		err := pool.QueryRow(ctx, benchTag+`SELECT EXISTS (SELECT 1 FROM river_job WHERE state IN ('available', 'running', 'retryable'))`).Scan(&pending)
		return !pending, err
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
	if err := checkCompleted(ctx, pool, "river", "river_job", "noop", o.n); err != nil {
		return r, err
	}
	after, err := e.counters(ctx, pool)
	if err != nil {
		return r, err
	}
	var span float64
	if err := pool.QueryRow(ctx, benchTag+`SELECT extract(epoch FROM max(finalized_at) - min(attempted_at)) FROM river_job WHERE kind = 'noop'`).Scan(&span); err != nil {
		return r, fmt.Errorf("reading River's burn-down span: %w", err)
	}
	r.Seconds, r.TasksPerS = span, float64(o.n)/span
	r.setCosts(before, after, polls, o.n)
	r.setCPU(workerSeconds, pgSeconds, o.n)
	r.TopStatements, err = e.topStatements(ctx, db, 6)
	return r, err
}

// database creates a fresh database on the bench server.
func (e *env) database(ctx context.Context, name string) (string, error) {
	return pgtmp.CreateDatabase(ctx, e.pg.DSN("postgres"), fmt.Sprintf("%s_%d", name, time.Now().UnixNano()%1_000_000))
}
