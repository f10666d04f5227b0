package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/maintenance"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// unclaimable is the noop throughput of shardrun runners with and without
// ready tasks of a kind nobody handles (issues 14 and 23), in each
// variant of the setup.
type unclaimable struct {
	Unhandled  int                  `json:"unhandled_ready_tasks"`
	Tasks      int                  `json:"tasks"`
	Processes  int                  `json:"processes"`
	MaxWorkers int                  `json:"max_workers_per_process"`
	Variants   []unclaimableVariant `json:"variants"`
}

// unclaimableVariant is one setup's paired trials.
type unclaimableVariant struct {
	Name        string    `json:"name"`
	What        string    `json:"what"`
	Without     []float64 `json:"tasks_per_s_without"`
	With        []float64 `json:"tasks_per_s_with"`
	Ratios      []float64 `json:"ratios_with_over_without"`
	MedianRatio float64   `json:"median_with_over_without"`
	// IdleCPUPct is PostgreSQL's CPU, in % of one core, while the runners
	// and the coordinator waited with nothing to do, before the noop tasks
	// came (with and without the unhandled tasks ready).
	IdleCPUPctWithout []float64  `json:"idle_pg_cpu_pct_of_core_without,omitempty"`
	IdleCPUPctWith    []float64  `json:"idle_pg_cpu_pct_of_core_with,omitempty"`
	Trials            []burnDown `json:"trials"`
}

// unclaimableSetup is how a variant prepares the database before the noop
// tasks arrive.
type unclaimableSetup struct {
	name, what string
	// settle: VACUUM ANALYZE the database once the unhandled tasks are in
	// (or, without them, at the same point), while nothing is ready or
	// running of the kinds the runners handle.
	settle bool
	// idle: measure PostgreSQL's CPU for this long before the noop tasks.
	idle time.Duration
}

var unclaimableSetups = []unclaimableSetup{
	{name: "right after the enqueue",
		what: "a coordinator and the runners running; the unhandled tasks enqueued through the coordinator's API (batches of 10,000), then at once the noop tasks (COPY, one transaction); the bench runs no VACUUM or ANALYZE and waits for nothing in between (autovacuum may still start on its own)"},
	{name: "statistics gathered at idle", settle: true, idle: 10 * time.Second,
		what: "the same, but the database is vacuumed and analysed (VACUUM ANALYZE) after the unhandled tasks are enqueued (without them: at the same point), while the runners have nothing to do: what autovacuum does within a minute of a bulk enqueue or of the end of a burn-down, so the statistics a long-lived cluster plans its next burn-down with; then PostgreSQL's idle CPU is sampled for 10 s"},
}

func (e *env) unclaimableSection(ctx context.Context, rep *Report, trials, n int) error {
	u := &unclaimable{Unhandled: unclaimableFlags.tasks, Tasks: n, Processes: unclaimableFlags.procs,
		MaxWorkers: cmp.Or(tuning.shardrunWorkers[unclaimableFlags.procs], 512)}
	rep.Unclaimable = u
	for _, setup := range unclaimableSetups {
		v := unclaimableVariant{Name: setup.name, What: setup.what}
		for trial := range trials {
			o := trialOpts{label: "uc", trial: trial, processes: u.Processes, n: n, maxWorkers: u.MaxWorkers}
			without, idleWithout, err := e.deployedBurnDown(ctx, o, setup)
			if err != nil {
				return fmt.Errorf("%s, without unhandled tasks: %w", setup.name, err)
			}
			o.unhandled = u.Unhandled
			with, idleWith, err := e.deployedBurnDown(ctx, o, setup)
			if err != nil {
				return fmt.Errorf("%s, with %d unhandled tasks: %w", setup.name, u.Unhandled, err)
			}
			v.Without, v.With = append(v.Without, without.TasksPerS), append(v.With, with.TasksPerS)
			v.Ratios = append(v.Ratios, with.TasksPerS/without.TasksPerS)
			v.Trials = append(v.Trials, without, with)
			if setup.idle > 0 {
				v.IdleCPUPctWithout, v.IdleCPUPctWith = append(v.IdleCPUPctWithout, idleWithout), append(v.IdleCPUPctWith, idleWith)
			}
			fmt.Fprintf(e.log, "  %s, trial %d: %.0f tasks/s without, %.0f with %d unhandled ready tasks (ratio %.2f); claim pages per claimed task %.1f and %.1f",
				setup.name, trial+1, without.TasksPerS, with.TasksPerS, u.Unhandled, with.TasksPerS/without.TasksPerS,
				without.PagesPerClaimedTask, with.PagesPerClaimedTask)
			if setup.idle > 0 {
				fmt.Fprintf(e.log, "; idle PostgreSQL CPU %.1f%% and %.1f%% of a core", idleWithout, idleWith)
			}
			fmt.Fprintln(e.log)
		}
		v.MedianRatio = median(v.Ratios)
		u.Variants = append(u.Variants, v)
	}
	return nil
}

// unclaimableOpts are the unclaimable section's flags.
type unclaimableOpts struct{ tasks, procs int }

var unclaimableFlags = unclaimableOpts{tasks: 200_000, procs: 2}

// deployedBurnDown is a burn-down in a deployment's shape: a coordinator
// process and o.processes runners start on a fresh database and own every
// shard; o.unhandled tasks of a kind nobody handles are enqueued through
// the coordinator's API; setup may then vacuum and analyse the database
// and sample PostgreSQL's CPU while everything waits (returned in % of a
// core); then o.n noop tasks are enqueued in one transaction, so that
// they become claimable at once, and their burn-down is timed from the
// first claim to the last completion. The coordinator runs throughout, as
// it does in a deployment: its task counts and unhandled-kind report read
// the tasks table every few seconds.
//
// The per-task costs count from right after the noop tasks' transaction
// committed (the runners' first claims may have begun a few milliseconds
// earlier) and include the coordinator's statements.
func (e *env) deployedBurnDown(ctx context.Context, o trialOpts, setup unclaimableSetup) (r burnDown, idlePct float64, err error) {
	r = burnDown{System: "shardrun", Processes: o.processes, Tasks: o.n, MaxWorkers: o.maxWorkers, Unhandled: o.unhandled}
	st, dsn, drop, err := e.trialStore(ctx, fmt.Sprintf("sr_%s_%d_%d_%d", o.label, o.processes, o.trial, o.unhandled), 4)
	if err != nil {
		return r, 0, err
	}
	defer func() {
		if dropErr := drop(); err == nil {
			err = dropErr
		}
	}()
	db := st.Pool().Config().ConnConfig.Database
	prep := srclient.Config{ShardCount: 256}.WithDefaults()
	c := e.newCluster(fmt.Sprintf("uc-%d-%d", o.trial, time.Now().UnixNano()), dsn, 256)
	defer c.stop()
	coord, err := c.startCoordinator()
	if err != nil {
		return r, 0, err
	}
	defer coord.stop()
	rps, err := c.startAll(o.processes, runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: o.maxWorkers})
	if err != nil {
		return r, 0, err
	}
	var ids []string
	for _, rp := range rps {
		ids = append(ids, rp.id)
	}
	if err := waitEvery(time.Minute, 50*time.Millisecond, func() bool { return c.balanced(ctx, ids...) }); err != nil {
		return r, 0, fmt.Errorf("shards not balanced among %d runners: %w", o.processes, err)
	}
	if o.unhandled > 0 {
		body, err := json.Marshal(slices.Repeat([]map[string]string{{"kind": unhandledKind}}, insertBatch))
		if err != nil {
			return r, 0, err
		}
		for done := 0; done < o.unhandled; done += insertBatch {
			if o.unhandled-done < insertBatch {
				body, _ = json.Marshal(slices.Repeat([]map[string]string{{"kind": unhandledKind}}, o.unhandled-done))
			}
			if err := coord.enqueue(ctx, body); err != nil {
				return r, 0, err
			}
		}
	}
	if setup.settle {
		// The whole database, whatever tables the layout has.
		if _, err := st.Pool().Exec(ctx, `VACUUM ANALYZE`); err != nil {
			return r, 0, fmt.Errorf("vacuuming at idle: %w", err)
		}
	}
	postmaster, err := e.postmasterPID(ctx)
	if err != nil {
		return r, 0, err
	}
	if setup.idle > 0 {
		pgc := startPGCPU(postmaster)
		time.Sleep(setup.idle) // a fixed window of idleness, not a wait for a condition
		idlePct = pgc.stop() / setup.idle.Seconds() * 100
	}
	if r.EnqueuePerS, err = enqueueNoopsAtOnce(ctx, st, prep, o.n); err != nil {
		return r, idlePct, err
	}
	pgc := startPGCPU(postmaster)
	before, err := e.counters(ctx, st.Pool())
	if err != nil {
		pgc.stop()
		return r, idlePct, err
	}
	err = waitBurnedDown(ctx, st.Pool(), c.running(), "noop", o.n)
	pgSeconds := pgc.stop()
	if err != nil {
		return r, idlePct, err
	}
	runners := c.runners
	c.stop()
	var workerSeconds float64
	for _, rp := range runners {
		workerSeconds += processCPU(rp.cmd.ProcessState)
	}
	r.setCPU(workerSeconds, pgSeconds, o.n)
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, idlePct, err
	}
	r.setCosts(before, after, 0, o.n)
	span, err := burnDownSpan(ctx, st.Pool(), "noop")
	if err != nil {
		return r, idlePct, err
	}
	r.Seconds, r.TasksPerS = span, float64(o.n)/span
	r.TopStatements, err = e.topStatements(ctx, db, 6)
	return r, idlePct, err
}

// retentionRun is the deletion of a large backlog of finished tasks while
// tasks run at a steady rate.
type retentionRun struct {
	Rows          int     `json:"finished_rows"`
	LoadSeconds   float64 `json:"insert_s"`
	DeleteSeconds float64 `json:"delete_s"`
	DeletePerS    float64 `json:"deleted_rows_per_s"`
	Statements    int     `json:"statements"`
	BatchSize     int     `json:"batch_size"`
	SteadyRate    int     `json:"steady_tasks_per_s"`
	// Pickup latency: claimed_at - run_after of the steady tasks (database
	// clock), in milliseconds, before and during the deletion.
	BeforeP50MS float64 `json:"pickup_p50_ms_before"`
	BeforeP99MS float64 `json:"pickup_p99_ms_before"`
	DuringP50MS float64 `json:"pickup_p50_ms_during"`
	DuringP99MS float64 `json:"pickup_p99_ms_during"`
	// Claim statement mean time from pg_stat_statements, before and during.
	ClaimMeanMSBefore float64 `json:"claim_statement_mean_ms_before,omitempty"`
	ClaimMeanMSDuring float64 `json:"claim_statement_mean_ms_during,omitempty"`
}

// churn is the tasks table's size after a churn of tasks.
type churn struct {
	Variant    string  `json:"variant"`
	Tasks      int     `json:"tasks"`
	Rate       int     `json:"tasks_per_s"`
	Seconds    float64 `json:"seconds"`
	LiveRows   int64   `json:"rows_left"`
	TableMiB   float64 `json:"table_mib"`
	IndexesMiB float64 `json:"indexes_mib"`
	// ReadyIdxKiB is task_ready's size (table and primary key), and
	// QueueTablesMiB that of task_ready, task_claims and task_finished
	// with their indexes: the tables a task passes through.
	ReadyIdxKiB    float64 `json:"ready_lanes_kib"`
	QueueTablesMiB float64 `json:"queue_tables_mib"`
	Autovacuums    int64   `json:"autovacuum_runs"`
	DeadTuples     int64   `json:"dead_tuples_at_end"`
	PickupP99MS    float64 `json:"pickup_p99_ms"`
	Autovacuum     string  `json:"autovacuum_settings"`
	RetainFor      string  `json:"retain_completed,omitempty"`
}

// steady enqueues rate noop tasks per second in ten batches a second until
// stop is closed, and returns how many it enqueued.
func steady(ctx context.Context, client *srclient.Tasks, rate int, limit int, stop <-chan struct{}) (int, error) {
	per := max(rate/10, 1)
	batch := make([]tasks.NewTask, per)
	for i := range batch {
		batch[i] = tasks.NewTask{Kind: "noop"}
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	sent := 0
	for limit == 0 || sent < limit {
		select {
		case <-stop:
			return sent, nil
		case <-ctx.Done():
			return sent, ctx.Err()
		case <-tick.C:
		}
		k := per
		if limit > 0 {
			k = min(k, limit-sent)
		}
		if _, err := client.EnqueueBatch(ctx, batch[:k]); err != nil {
			return sent, err
		}
		sent += k
	}
	return sent, nil
}

// pickup returns the p50 and p99 of claimed_at - run_after in ms of the
// noop tasks enqueued in [from, to) (database clock).
func pickup(ctx context.Context, st *store.Store, from, to time.Time) (p50, p99 float64, err error) {
	err = st.Pool().QueryRow(ctx, `
		SELECT coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), 0), coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0)
		FROM (SELECT extract(epoch FROM claimed_at - run_after) * 1000 AS ms FROM tasks
		      WHERE kind = 'noop' AND created_at >= $1 AND created_at < $2 AND claimed_at IS NOT NULL) x`, from, to).Scan(&p50, &p99)
	return p50, p99, err
}

func dbNow(ctx context.Context, st *store.Store) time.Time {
	var t time.Time
	_ = st.Pool().QueryRow(ctx, `SELECT now()`).Scan(&t)
	return t
}

// claimMean is the mean time of the claim statement so far
// (pg_stat_statements), with its call count.
func (e *env) claimMean(ctx context.Context, st *store.Store) (calls int64, totalMS float64) {
	if !e.statStatements {
		return 0, 0
	}
	// The view lives in the database the extension was created in.
	conn, err := pgx.Connect(ctx, e.pg.DSN("postgres"))
	if err != nil {
		return 0, 0
	}
	defer conn.Close(ctx)
	_ = conn.QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(total_exec_time), 0) FROM pg_stat_statements
		WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1) AND query LIKE '%candidates AS%'`,
		st.Pool().Config().ConnConfig.Database).Scan(&calls, &totalMS)
	return calls, totalMS
}

func (e *env) retentionSection(ctx context.Context, rep *Report, rows, rate int) error {
	dsn, err := e.database(ctx, "retention")
	if err != nil {
		return err
	}
	st, err := store.Open(ctx, dsn, store.Options{MaxConns: 8})
	if err != nil {
		return err
	}
	defer st.Close()
	if err := st.Migrate(ctx); err != nil {
		return err
	}
	res := &retentionRun{Rows: rows, SteadyRate: rate, BatchSize: maintenance.DefaultRetentionBatch}
	start := time.Now()
	const chunk = 1_000_000
	for done := 0; done < rows; done += chunk {
		k := min(chunk, rows-done)
		if _, err := st.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key, state, claimed_by, claim_epoch, claimed_at, finished_at, created_at)
			SELECT 'noop', g % 256, g::text, 'completed', 'r', 1, now() - interval '3 days', now() - interval '2 days' - g * interval '1 millisecond', now() - interval '3 days'
			FROM generate_series($1::bigint, $2::bigint) g`, done+1, done+k); err != nil {
			return err
		}
		fmt.Fprintf(e.log, "  inserted %d finished rows (%.0fs)\n", done+k, time.Since(start).Seconds())
	}
	if _, err := st.Pool().Exec(ctx, `VACUUM ANALYZE tasks`); err != nil {
		return err
	}
	res.LoadSeconds = time.Since(start).Seconds()
	client, _ := srclient.New(st, srclient.Config{ShardCount: 256})
	c := e.newCluster(fmt.Sprintf("ret-%d", time.Now().UnixNano()), dsn, 256)
	defer c.stop()
	if _, err := c.start("runner-1", runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: 256}); err != nil {
		return err
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var prodErr error
	wg.Go(func() { _, prodErr = steady(ctx, client, rate, 0, stop) })
	time.Sleep(5 * time.Second) // warm-up of the steady workload: a fixed window, not a wait for a condition
	beforeFrom := dbNow(ctx, st)
	c0, t0 := e.claimMean(ctx, st)
	time.Sleep(20 * time.Second) // the "before" measurement window
	beforeTo := dbNow(ctx, st)
	c1, t1 := e.claimMean(ctx, st)

	if ok, err := st.RaiseLeaderFence(ctx, "bench", 1); err != nil || !ok {
		return fmt.Errorf("fence: %v %v", ok, err)
	}
	r, err := maintenance.NewRetainer(st, maintenance.RetentionConfig{RetainCompleted: 24 * time.Hour, Interval: time.Hour}, nil)
	if err != nil {
		return err
	}
	duringFrom := dbNow(ctx, st)
	delStart := time.Now()
	term := leader.Term{Epoch: 1, Start: time.Now(), Clock: clock.Real(), Log: hclog.NewNullLogger()}
	r.Begin(term)
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Minute)
	result, p := leader.Once(rctx, r, term)
	rcancel()
	pass := result.Detail.(maintenance.RetentionResult)
	res.DeleteSeconds = time.Since(delStart).Seconds()
	duringTo := dbNow(ctx, st)
	c2, t2 := e.claimMean(ctx, st)
	close(stop)
	wg.Wait()
	if prodErr != nil {
		return prodErr
	}
	if result.Err != nil {
		return result.Err
	}
	res.Statements = p.Statements
	res.DeletePerS = float64(pass.Deleted["completed"]) / res.DeleteSeconds
	if pass.Deleted["completed"] != int64(rows) {
		return fmt.Errorf("retention deleted %d of %d rows", pass.Deleted["completed"], rows)
	}
	if res.BeforeP50MS, res.BeforeP99MS, err = pickup(ctx, st, beforeFrom, beforeTo); err != nil {
		return err
	}
	if res.DuringP50MS, res.DuringP99MS, err = pickup(ctx, st, duringFrom, duringTo); err != nil {
		return err
	}
	if c1 > c0 && c2 > c1 {
		res.ClaimMeanMSBefore, res.ClaimMeanMSDuring = (t1-t0)/float64(c1-c0), (t2-t1)/float64(c2-c1)
	}
	rep.Retention = res
	fmt.Fprintf(e.log, "  deleted %d rows in %.1fs (%.0f rows/s, %d statements); pickup p99 %.1f ms before, %.1f ms during\n",
		rows, res.DeleteSeconds, res.DeletePerS, res.Statements, res.BeforeP99MS, res.DuringP99MS)
	return nil
}

// tightAutovacuum is the candidate autovacuum setting for the tasks table
// that the churn compares with PostgreSQL's defaults (which migration 00005
// keeps: see docs/architecture.md).
const tightAutovacuum = `ALTER TABLE tasks SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
	autovacuum_vacuum_insert_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0)`

func (e *env) churnSection(ctx context.Context, rep *Report, n, rate int) error {
	variants := []struct {
		name   string
		retain time.Duration
		tight  bool
	}{
		{"no retention", 0, false},
		{"retention, PostgreSQL's default autovacuum", 10 * time.Second, false},
		{"retention, autovacuum at 1% dead rows, unthrottled", 10 * time.Second, true},
	}
	for _, v := range variants {
		res, err := e.churnOnce(ctx, n, rate, v.name, v.retain, v.tight)
		if err != nil {
			return err
		}
		rep.Churn = append(rep.Churn, res)
		fmt.Fprintf(e.log, "  %s: %d rows left, table %.1f MiB, indexes %.1f MiB, task_ready %.0f KiB, task_ready+task_claims+task_finished %.1f MiB, %d autovacuums, pickup p99 %.1f ms\n",
			v.name, res.LiveRows, res.TableMiB, res.IndexesMiB, res.ReadyIdxKiB, res.QueueTablesMiB, res.Autovacuums, res.PickupP99MS)
	}
	return nil
}

func (e *env) churnOnce(ctx context.Context, n, rate int, name string, retain time.Duration, tight bool) (churn, error) {
	res := churn{Variant: name, Tasks: n, Rate: rate, Autovacuum: "PostgreSQL defaults"}
	dsn, err := e.database(ctx, "churn")
	if err != nil {
		return res, err
	}
	st, err := store.Open(ctx, dsn, store.Options{MaxConns: 8})
	if err != nil {
		return res, err
	}
	defer st.Close()
	if err := st.Migrate(ctx); err != nil {
		return res, err
	}
	if tight {
		if _, err := st.Pool().Exec(ctx, tightAutovacuum); err != nil {
			return res, err
		}
		res.Autovacuum = "scale factors 0.01 (vacuum, insert), 0.02 (analyze), threshold 1000, cost delay 0"
	}
	client, _ := srclient.New(st, srclient.Config{ShardCount: 256})
	c := e.newCluster(fmt.Sprintf("churn-%d", time.Now().UnixNano()), dsn, 256)
	defer c.stop()
	if _, err := c.start("runner-1", runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: 512}); err != nil {
		return res, err
	}
	rctx, rcancel := context.WithCancel(ctx)
	var rwg sync.WaitGroup
	if retain > 0 {
		res.RetainFor = retain.String()
		if ok, err := st.RaiseLeaderFence(ctx, "bench", 1); err != nil || !ok {
			rcancel()
			return res, fmt.Errorf("fence: %v %v", ok, err)
		}
		r, err := maintenance.NewRetainer(st, maintenance.RetentionConfig{RetainCompleted: retain, Interval: time.Second}, nil)
		if err != nil {
			rcancel()
			return res, err
		}
		loop := leader.New(leader.Config{Logger: hclog.NewNullLogger()}, r)
		rwg.Go(func() { _ = loop.Run(rctx, 1) })
	}
	from := dbNow(ctx, st)
	start := time.Now()
	if _, err := steady(ctx, client, rate, n, nil); err != nil {
		rcancel()
		return res, err
	}
	if retain > 0 {
		// Retention deletes completed tasks as the churn goes, so the
		// table cannot show that all n completed: the runners' metrics
		// count them, and the table that none is left unfinished.
		var done float64
		if done, err = waitDrained(ctx, st.Pool(), c.running(), "noop", n); err == nil && done < float64(n) {
			err = fmt.Errorf("shardrun: the runners completed %.0f of %d noop tasks", done, n)
		}
	} else {
		err = waitBurnedDown(ctx, st.Pool(), c.running(), "noop", n)
	}
	res.Seconds = time.Since(start).Seconds()
	_, res.PickupP99MS, _ = pickup(ctx, st, from, dbNow(ctx, st))
	if retain > 0 {
		// Let retention catch up with the last tasks (horizon + a pass).
		time.Sleep(retain + 2*time.Second)
	}
	rcancel()
	rwg.Wait()
	if err != nil {
		return res, err
	}
	var table, indexes, ready, queues int64
	err = st.Pool().QueryRow(ctx, `SELECT pg_table_size('tasks'), pg_indexes_size('tasks'), pg_total_relation_size('task_ready'),
		pg_total_relation_size('task_ready') + pg_total_relation_size('task_claims') + pg_total_relation_size('task_finished'),
		(SELECT count(*) FROM tasks), s.autovacuum_count, s.n_dead_tup
		FROM pg_stat_user_tables s WHERE s.relname = 'tasks'`).Scan(&table, &indexes, &ready, &queues, &res.LiveRows, &res.Autovacuums, &res.DeadTuples)
	if err != nil {
		return res, err
	}
	res.TableMiB, res.IndexesMiB, res.ReadyIdxKiB = float64(table)/(1<<20), float64(indexes)/(1<<20), float64(ready)/1024
	res.QueueTablesMiB = float64(queues) / (1 << 20)
	return res, nil
}
