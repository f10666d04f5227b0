package main

// Runner-bound throughput on real work (issue 35, item 1): tasks that
// sleep 20 ms, both systems at the same worker count per process, 1 to 16
// processes, and each point's share of the ideal (every worker busy all
// the time: processes × workers × 1000/sleep ms tasks/s).

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/tasks"
)

// workOpts are the work section's flags.
type workOpts struct {
	procs   string
	workers int
	sleepMS int
	// seconds at the ideal rate each trial's tasks last: tasks =
	// processes × workers × 1000/sleepMS × seconds.
	seconds float64
	conns   int
	shards  int
	trials  int
}

// The defaults: the 64 workers and 20 ms tasks; 16 processes at 8
// connections each are 128 of the server's 300 for either system.
var workFlags = workOpts{procs: "1,2,4,8,16", workers: 64, sleepMS: 20, seconds: 6, conns: 8, shards: 256, trials: 1}

// workHeadroom: a point is judged against the target only when the
// machine's cores were busy less than this share of the time; above it
// the runners, River and PostgreSQL are CPU-bound and the share of ideal
// says what the machine can do, not what the executor leaves idle.
const workHeadroom = 0.85

// workTrial is one burn-down of sleep tasks by one system.
type workTrial struct {
	System    string `json:"system"`
	Processes int    `json:"processes"`
	Trial     int    `json:"trial"`
	Tasks     int    `json:"tasks"`
	// Seconds from the first claim (River: attempt) to the last completion
	// (finalisation), from the database's timestamps.
	Seconds   float64 `json:"burn_down_s"`
	TasksPerS float64 `json:"tasks_per_s"`
	IdealPerS float64 `json:"ideal_tasks_per_s"`
	Share     float64 `json:"share_of_ideal"`
	// SlotIdleMSPerTask is how long a worker slot was empty per task, on
	// average: processes × workers × seconds / tasks - the sleep. The
	// issue's "each slot sits empty about 3 ms per 20 ms job".
	SlotIdleMSPerTask float64 `json:"slot_idle_ms_per_task"`
	EnqueuePerS       float64 `json:"enqueue_rows_per_s"`
	// CPU is where the machine's CPU went from the enqueue's commit to the
	// end of the burn-down, in percent of one core; Runners is the
	// system's worker processes (shardrun runners or River children).
	CPU cpuShares `json:"cpu_pct_of_a_core"`
	// MachineBusy is CPU.Machine over all the cores (1: saturated).
	MachineBusy float64 `json:"machine_busy_share"`
	// PostgreSQL's and the worker processes' CPU per task in the window.
	PGCPUMsPerTask      float64 `json:"postgres_cpu_ms_per_task"`
	WorkersCPUMsPerTask float64 `json:"workers_cpu_ms_per_task"`
	// Per task, from before the enqueue to after the workers exit (the
	// enqueue's own statements included, as in the scale section).
	XactsPerTask        float64 `json:"pg_transactions_per_task"`
	StmtsPerTask        float64 `json:"pg_statements_per_task,omitempty"`
	PagesPerClaimedTask float64 `json:"pg_pages_per_claimed_task,omitempty"`
	WALBytesPerTask     float64 `json:"wal_bytes_per_task"`
	// PerRunner is each shardrun runner's share of the tasks.
	PerRunner     []runnerShare `json:"per_runner,omitempty"`
	TopStatements []stmtStat    `json:"top_statements,omitempty"`
}

// workPoint is one process count's trials, medians by system.
type workPoint struct {
	Processes int                `json:"processes"`
	IdealPerS float64            `json:"ideal_tasks_per_s"`
	TasksPerS map[string]float64 `json:"median_tasks_per_s"`
	Share     map[string]float64 `json:"median_share_of_ideal"`
	SlotIdle  map[string]float64 `json:"median_slot_idle_ms_per_task"`
	// Medians of the trials' CPU, percent of one core.
	MachinePct  map[string]float64 `json:"median_machine_cpu_pct"`
	PostgresPct map[string]float64 `json:"median_postgres_cpu_pct"`
	WorkersPct  map[string]float64 `json:"median_workers_cpu_pct"`
	OtherPct    map[string]float64 `json:"median_other_processes_cpu_pct"`
}

// workResult is the work section's report.
type workResult struct {
	What              string        `json:"what"`
	WorkersPerProcess int           `json:"workers_per_process"`
	SleepMS           int           `json:"task_sleep_ms"`
	SecondsAtIdeal    float64       `json:"seconds_at_ideal_per_trial"`
	Shards            int           `json:"shard_count"`
	DBConns           int           `json:"db_connections_per_process"`
	Cores             int           `json:"cores"`
	River             riverSettings `json:"river"`
	Points            []workPoint   `json:"points"`
	Trials            []workTrial   `json:"trials"`
	Notes             []string      `json:"notes"`
}

func (o workOpts) ideal(procs int) float64 {
	return float64(procs*o.workers) * 1000 / float64(o.sleepMS)
}

func (o workOpts) tasks(procs int) int { return int(o.ideal(procs) * o.seconds) }

func (e *env) workSection(ctx context.Context, rep *Report) error {
	o := workFlags
	procs, err := parseInts(o.procs)
	if err != nil {
		return fmt.Errorf("-work-procs: %w", err)
	}
	if o.workers < 1 || o.sleepMS < 1 || o.seconds <= 0 || o.trials < 1 {
		return fmt.Errorf("-work-workers, -work-sleep-ms, -work-seconds and -work-trials must be positive")
	}
	rs := riverBase(o.workers)
	rs.PoolConns = int32(o.conns)
	res := &workResult{
		What: fmt.Sprintf("burn-down of sleep {\"ms\":%d} tasks at each process count, %d workers per process for both systems (shardrun "+
			"--max-workers, River MaxWorkers), %s seconds of tasks at the ideal rate, enqueued in one transaction while the workers already "+
			"run idle (shardrun: its %d shards owned and balanced); timed from the first claim (attempt) to the last completion "+
			"(finalisation) from the database's timestamps; share of ideal = tasks/s ÷ (processes × workers × 1000/%d)",
			o.sleepMS, o.workers, fmt.Sprint(o.seconds), o.shards, o.sleepMS),
		WorkersPerProcess: o.workers, SleepMS: o.sleepMS, SecondsAtIdeal: o.seconds, Shards: o.shards, DBConns: o.conns,
		Cores: runtime.NumCPU(), River: rs,
		Notes: []string{
			fmt.Sprintf("River: FetchCooldown %s, FetchPollInterval %s (the bench's riverBase, those of River's own benchmark and of the "+
				"issue's measurement), MaxWorkers %d, a pool of %d connections per client; River's defaults (100 ms cooldown, 1 s poll) "+
				"gave 0.20 of ideal in the issue", rs.FetchCooldown, rs.FetchPollInterval, rs.MaxWorkers, rs.PoolConns),
			fmt.Sprintf("shardrun: bin/runner processes, --max-workers %d, --db-max-conns %d, lease TTL 10s, default poll interval", o.workers, o.conns),
			"CPU in percent of one core from the enqueue's commit to the end of the burn-down: the worker processes from /proc/<pid>/stat " +
				"(shardrun runners and River children alike), PostgreSQL's postmaster and children (sampled every 100 ms), the bench process " +
				"with its embedded etcd, the whole machine (/proc/stat) and what is left: other processes sharing the cores",
			"the bench follows shardrun's burn-down through the runners' metrics (no statement) and River's by a poll of river_job every 20 ms, " +
				"which counts in River's PostgreSQL CPU",
			fmt.Sprintf("a point is judged against the target (share ≥ 0.95 while PostgreSQL has headroom) only when the machine was busy "+
				"less than %.0f%% of its cores' time; above, the share measures the machine", workHeadroom*100),
		},
	}
	rep.Work = res
	for _, p := range procs {
		var trials []workTrial
		for trial := range o.trials {
			// The systems alternate which goes first, trial by trial.
			systems := []string{"shardrun", "river"}
			if !tuning.withRiver {
				systems = systems[:1]
			} else if trial%2 == 1 {
				slices.Reverse(systems)
			}
			for _, system := range systems {
				var t workTrial
				var err error
				if system == "shardrun" {
					t, err = e.workShardrun(ctx, o, p, trial)
				} else {
					t, err = e.workRiver(ctx, o, p, trial, rs)
				}
				if err != nil {
					return fmt.Errorf("%s, %d processes: %w", system, p, err)
				}
				trials = append(trials, t)
				fmt.Fprintf(e.log, "  %2d process(es) × %d workers, trial %d: %-8s %6.0f tasks/s = %.2f of ideal %.0f (slots idle %.1f ms per %d ms task); "+
					"CPU %% of a core: workers %.0f, PostgreSQL %.0f, bench+etcd %.0f, other processes %.0f (machine %.0f of %d)\n",
					p, o.workers, trial+1, system, t.TasksPerS, t.Share, t.IdealPerS, t.SlotIdleMSPerTask, o.sleepMS,
					t.CPU.Runners, t.CPU.Postgres, t.CPU.Bench, t.CPU.Other, t.CPU.Machine, 100*runtime.NumCPU())
			}
		}
		res.Trials = append(res.Trials, trials...)
		res.Points = append(res.Points, workPointOf(p, o.ideal(p), trials))
	}
	return nil
}

func workPointOf(procs int, ideal float64, trials []workTrial) workPoint {
	by := func(f func(workTrial) float64) map[string]float64 {
		xs := map[string][]float64{}
		for _, t := range trials {
			xs[t.System] = append(xs[t.System], f(t))
		}
		out := map[string]float64{}
		for system, v := range xs {
			out[system] = median(v)
		}
		return out
	}
	return workPoint{Processes: procs, IdealPerS: ideal,
		TasksPerS:   by(func(t workTrial) float64 { return t.TasksPerS }),
		Share:       by(func(t workTrial) float64 { return t.Share }),
		SlotIdle:    by(func(t workTrial) float64 { return t.SlotIdleMSPerTask }),
		MachinePct:  by(func(t workTrial) float64 { return t.CPU.Machine }),
		PostgresPct: by(func(t workTrial) float64 { return t.CPU.Postgres }),
		WorkersPct:  by(func(t workTrial) float64 { return t.CPU.Runners }),
		OtherPct:    by(func(t workTrial) float64 { return t.CPU.Other }),
	}
}

// finish fills a trial's rates from its span and CPU window.
func (t *workTrial) finish(o workOpts, span float64, cpu cpuShares) {
	t.Seconds, t.TasksPerS = span, float64(t.Tasks)/span
	t.Share = t.TasksPerS / t.IdealPerS
	t.SlotIdleMSPerTask = float64(t.Processes*o.workers)*span*1000/float64(t.Tasks) - float64(o.sleepMS)
	t.CPU = cpu
	t.MachineBusy = cpu.Machine / float64(100*runtime.NumCPU())
	perTask := cpu.Seconds / 100 * 1000 / float64(t.Tasks)
	t.PGCPUMsPerTask, t.WorkersCPUMsPerTask = cpu.Postgres*perTask, cpu.Runners*perTask
}

// costs copies what setCosts computes between two readings.
func (t *workTrial) costs(before, after pgCounters, polls int) {
	var b burnDown
	b.setCosts(before, after, polls, t.Tasks)
	t.XactsPerTask, t.StmtsPerTask, t.PagesPerClaimedTask, t.WALBytesPerTask = b.XactsPerTask, b.StmtsPerTask, b.PagesPerClaimedTask, b.WALBytesPerTask
}

// workShardrun: runners started and balanced, then the sleep tasks in one
// transaction, burnt down.
func (e *env) workShardrun(ctx context.Context, o workOpts, procs, trial int) (t workTrial, err error) {
	t = workTrial{System: "shardrun", Processes: procs, Trial: trial, Tasks: o.tasks(procs), IdealPerS: o.ideal(procs)}
	st, dsn, drop, err := e.trialStore(ctx, fmt.Sprintf("sr_work_%d_%d", procs, trial), 4)
	if err != nil {
		return t, err
	}
	defer func() {
		if derr := drop(); err == nil {
			err = derr
		}
	}()
	c := e.newCluster(fmt.Sprintf("work-%d-%d-%d", procs, trial, time.Now().UnixNano()), dsn, o.shards)
	defer c.stop()
	rps, err := c.startAll(procs, runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: o.workers, dbMaxConns: o.conns})
	if err != nil {
		return t, err
	}
	var ids []string
	var pids []int
	for _, rp := range rps {
		ids, pids = append(ids, rp.id), append(pids, rp.cmd.Process.Pid)
	}
	if err := waitEvery(scaleConvergeTimeout, 50*time.Millisecond, func() bool { return c.balanced(ctx, ids...) }); err != nil {
		return t, fmt.Errorf("%d shards not owned and balanced: %w", o.shards, err)
	}
	before, err := e.counters(ctx, st.Pool())
	if err != nil {
		return t, err
	}
	payload := json.RawMessage(fmt.Sprintf(`{"ms":%d}`, o.sleepMS))
	t.EnqueuePerS, err = enqueueAtOnce(ctx, st, srclient.Config{ShardCount: o.shards}.WithDefaults(), t.Tasks,
		func(int) tasks.NewTask { return tasks.NewTask{Kind: "sleep", Payload: payload} })
	if err != nil {
		return t, err
	}
	win, err := e.startLoadWindow(ctx, pids)
	if err != nil {
		return t, err
	}
	err = waitBurnedDown(ctx, st.Pool(), rps, "sleep", t.Tasks)
	cpu, cerr := win.done(pids)
	if err != nil {
		return t, err
	}
	if cerr != nil {
		return t, cerr
	}
	c.stop()
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return t, err
	}
	t.costs(before, after, 0)
	span, err := burnDownSpan(ctx, st.Pool(), "sleep")
	if err != nil {
		return t, err
	}
	t.finish(o, span, cpu)
	if t.PerRunner, err = runnerShares(ctx, st.Pool(), "sleep"); err != nil {
		return t, err
	}
	t.TopStatements, err = e.topStatements(ctx, st.Pool().Config().ConnConfig.Database, 4)
	return t, err
}

// workRiver: River's child processes started, then the sleep jobs in one
// transaction (InsertManyFastTx in batches), burnt down.
func (e *env) workRiver(ctx context.Context, o workOpts, procs, trial int, rs riverSettings) (t workTrial, err error) {
	t = workTrial{System: "river", Processes: procs, Trial: trial, Tasks: o.tasks(procs), IdealPerS: o.ideal(procs)}
	dsn, err := e.database(ctx, fmt.Sprintf("river_work_%d_%d", procs, trial))
	if err != nil {
		return t, err
	}
	pool, err := riverPool(ctx, dsn, 4)
	if err != nil {
		return t, err
	}
	db := pool.Config().ConnConfig.Database
	defer func() {
		pool.Close()
		if derr := e.dropDatabase(ctx, db); err == nil {
			err = derr
		}
	}()
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return t, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return t, fmt.Errorf("migrating River: %w", err)
	}
	inserter, err := newRiverClient(pool, rs, false)
	if err != nil {
		return t, err
	}
	started, err := startRiverProcs(dsn, rs, procs)
	stopAll := func() error {
		var first error
		for _, p := range started {
			if _, err := p.stop(); first == nil {
				first = err
			}
		}
		started = nil
		return first
	}
	defer func() { _ = stopAll() }()
	if err != nil {
		return t, err
	}
	var pids []int
	for _, p := range started {
		pids = append(pids, p.pid())
	}
	before, err := e.counters(ctx, pool)
	if err != nil {
		return t, err
	}
	params := make([]river.InsertManyParams, insertBatch)
	for i := range params {
		params[i] = river.InsertManyParams{Args: SleepArgs{MS: o.sleepMS}}
	}
	begin := time.Now()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for done := 0; done < t.Tasks; done += insertBatch {
			if _, err := inserter.InsertManyFastTx(ctx, tx, params[:min(insertBatch, t.Tasks-done)]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return t, fmt.Errorf("inserting River jobs: %w", err)
	}
	t.EnqueuePerS = float64(t.Tasks) / time.Since(begin).Seconds()
	win, err := e.startLoadWindow(ctx, pids)
	if err != nil {
		return t, err
	}
	polls, err := pollUntil(ctx, burnDownTimeout, burnDownPoll, func() (bool, error) {
		var pending bool
		err := pool.QueryRow(ctx, benchTag+`SELECT EXISTS (SELECT 1 FROM river_job WHERE state IN ('available', 'running', 'retryable'))`).Scan(&pending)
		return !pending, err
	})
	cpu, cerr := win.done(pids)
	if err != nil {
		return t, fmt.Errorf("river burn-down: %w", err)
	}
	if cerr != nil {
		return t, cerr
	}
	if err := stopAll(); err != nil {
		return t, err
	}
	if err := checkCompleted(ctx, pool, "river", "river_job", "sleep", t.Tasks); err != nil {
		return t, err
	}
	after, err := e.counters(ctx, pool)
	if err != nil {
		return t, err
	}
	t.costs(before, after, polls)
	var span float64
	if err := pool.QueryRow(ctx, benchTag+`SELECT extract(epoch FROM max(finalized_at) - min(attempted_at)) FROM river_job WHERE kind = 'sleep'`).Scan(&span); err != nil {
		return t, fmt.Errorf("reading River's burn-down span: %w", err)
	}
	t.finish(o, span, cpu)
	t.TopStatements, err = e.topStatements(ctx, db, 4)
	return t, err
}

// SleepArgs is River's sleep job: the worker sleeps MS milliseconds, as
// shardrun's built-in sleep kind does.
type SleepArgs struct {
	MS int `json:"ms"`
}

// Kind names the job kind.
func (SleepArgs) Kind() string { return "sleep" }

// SleepWorker sleeps, honouring cancellation.
type SleepWorker struct {
	river.WorkerDefaults[SleepArgs]
}

// Work sleeps the job's MS milliseconds.
func (SleepWorker) Work(ctx context.Context, job *river.Job[SleepArgs]) error {
	timer := time.NewTimer(time.Duration(job.Args.MS) * time.Millisecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// loadWindow measures cpuShares over a window like cpuWindow (mixed.go),
// but reads the system's worker processes from /proc by pid, so that
// River's children (no metrics endpoint) and shardrun's runners are
// measured alike. A process the window did not see at its start counts
// from 0 (it was born within it).
type loadWindow struct {
	start          time.Time
	first          map[int]float64
	bench, machine float64
	pg             *pgCPU
}

func (e *env) startLoadWindow(ctx context.Context, pids []int) (*loadWindow, error) {
	postmaster, err := e.postmasterPID(ctx)
	if err != nil {
		return nil, err
	}
	w := &loadWindow{first: map[int]float64{}}
	for _, pid := range pids {
		if st, err := readProcStat(pid); err == nil {
			w.first[pid] = st.cpu
		}
	}
	if w.machine, err = machineBusy(); err != nil {
		return nil, err
	}
	self, err := readProcStat(os.Getpid())
	if err != nil {
		return nil, err
	}
	w.bench = self.cpu
	w.pg = startPGCPU(postmaster)
	w.start = time.Now()
	return w, nil
}

// done ends the window; pids are the worker processes, still running.
func (w *loadWindow) done(pids []int) (cpuShares, error) {
	pg := w.pg.stop()
	var workers float64
	for _, pid := range pids {
		if st, err := readProcStat(pid); err == nil {
			workers += st.cpu - w.first[pid]
		}
	}
	machine, err := machineBusy()
	if err != nil {
		return cpuShares{}, err
	}
	self, err := readProcStat(os.Getpid())
	if err != nil {
		return cpuShares{}, err
	}
	secs := time.Since(w.start).Seconds()
	pct := 100 / secs
	s := cpuShares{Seconds: secs, Runners: workers * pct, Postgres: pg * pct, Bench: (self.cpu - w.bench) * pct, Machine: (machine - w.machine) * pct}
	s.Other = max(0, s.Machine-s.Runners-s.Postgres-s.Bench)
	return s, nil
}

// printWork adds the work section's rows.
func printWork(w io.Writer, r *workResult) {
	cores := 100 * r.Cores
	for _, pt := range r.Points {
		row := fmt.Sprintf("| work: %d process(es) × %d workers, %d ms tasks (ideal %.0f/s) | share of ideal shardrun **%.2f** (%.0f tasks/s, slots idle %.1f ms per task)",
			pt.Processes, r.WorkersPerProcess, r.SleepMS, pt.IdealPerS, pt.Share["shardrun"], pt.TasksPerS["shardrun"], pt.SlotIdle["shardrun"])
		if _, ok := pt.Share["river"]; ok {
			row += fmt.Sprintf(", River **%.2f** (%.0f, %.1f ms)", pt.Share["river"], pt.TasksPerS["river"], pt.SlotIdle["river"])
		}
		var cpu []string
		for _, system := range []string{"shardrun", "river"} {
			if m, ok := pt.MachinePct[system]; ok {
				cpu = append(cpu, fmt.Sprintf("%s: machine %.0f of %d, PostgreSQL %.0f, workers %.0f, other processes %.0f",
					system, m, cores, pt.PostgresPct[system], pt.WorkersPct[system], pt.OtherPct[system]))
			}
		}
		fmt.Fprintf(w, "%s; CPU %% of a core (medians) %s |\n", row, strings.Join(cpu, "; "))
	}
}

// workTargets (issue 35): with 20 ms tasks, shardrun's share of the ideal
// at least 0.95 at each process count while PostgreSQL has headroom.
func workTargets(r *workResult) []target {
	if r == nil || len(r.Points) == 0 {
		return []target{{Measure: "runner-bound throughput, 20 ms tasks, 64 workers per runner: shardrun's share of ideal", Target: "≥ 0.95 while PostgreSQL has headroom", Status: notMeasured}}
	}
	var out []target
	for _, pt := range r.Points {
		share, ok := pt.Share["shardrun"]
		if !ok {
			continue
		}
		t := target{Measure: fmt.Sprintf("runner-bound throughput, %d ms tasks, %d runner(s) × %d workers: shardrun's share of ideal", r.SleepMS, pt.Processes, r.WorkersPerProcess),
			Target: "≥ 0.95 while PostgreSQL has headroom"}
		busy := pt.MachinePct["shardrun"] / float64(100*r.Cores)
		t.Measured = fmt.Sprintf("%.2f (River %.2f); machine busy %.0f%%, PostgreSQL %.0f%% of a core", share, pt.Share["river"], busy*100, pt.PostgresPct["shardrun"])
		if busy >= workHeadroom {
			t.Status = "not judged: CPU saturated"
		} else {
			t.Status = verdict(share >= 0.95)
		}
		out = append(out, t)
	}
	return out
}
