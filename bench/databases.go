package main

// The databases section (issue 40): a cluster's tasks over 1, 2 and 3
// PostgreSQL servers, each capped to the same CPU by a cgroup v1 cpu
// quota; converged noop throughput and PostgreSQL CPU per task at each
// count, the ratio to one database, the other databases' throughput
// while one server is halted, and the time and the rates of one shard's
// move between two databases under the load.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtmp"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
)

// databasesOpts are the section's flags.
type databasesOpts struct {
	counts string // database counts, "1,2,3"
	trials int
	// cores is each server's cpu quota, in cores.
	cores float64
	// runnersPer database: the runner count is this times the count.
	runnersPer, maxWorkers, dbMaxConns int
	// tasksPerDB noop tasks are enqueued per database before the runners
	// start: enough that none drains before the last window ends.
	tasksPerDB     int
	warmup, window time.Duration
	// halt: in the last trial at the largest count, one server is halted
	// after the window and the others' throughput measured again.
	halt bool
	// shares is the cpu.shares of the servers' groups and of the group of
	// the bench process (etcd) and the runners (0: the default, 1024), so
	// that other work on the machine does not take the CPU their quota
	// gives them.
	shares int
	// logs is a directory for each trial's runner logs (none when empty).
	logs string
	// move: in each trial at 2 databases, after the window, a coordinator
	// is started and one shard of the first database moved to the second
	// under the load, its rate and the others' measured over moveWindow
	// before and after the move and during it.
	move       bool
	moveWindow time.Duration
}

var databasesFlags = databasesOpts{counts: "1,2,3", trials: 3, cores: 0.3, runnersPer: 1, maxWorkers: 512, dbMaxConns: 8,
	tasksPerDB: 150_000, warmup: 5 * time.Second, window: 10 * time.Second, halt: true, shares: 8192,
	move: true, moveWindow: 3 * time.Second}

// dbCPUPeriod is the servers' cpu.cfs_period_us.
const dbCPUPeriod = 100 * time.Millisecond

// dbResumeWait bounds the wait for the moved shard's first task finished
// at its destination.
const dbResumeWait = 60 * time.Second

// dbHaltSettle is how long after a server's halt the others' window starts.
const dbHaltSettle = 2 * time.Second

type databasesResult struct {
	CoresPerServer     float64 `json:"cpu_quota_cores_per_server"`
	PeriodUS           int64   `json:"cpu_period_us"`
	Shares             int     `json:"cpu_shares,omitempty"`
	RunnersPerDatabase int     `json:"runners_per_database"`
	MaxWorkers         int     `json:"max_workers_per_runner"`
	DBMaxConns         int     `json:"db_max_conns_per_runner_per_database"`
	TasksPerDatabase   int     `json:"backlog_tasks_per_database"`
	WarmupS            float64 `json:"warmup_s"`
	WindowS            float64 `json:"window_s"`
	// CPUSource is where the servers' CPU comes from: the cgroups'
	// cpuacct.usage, or /proc of each postmaster and its children.
	CPUSource string      `json:"postgres_cpu_source"`
	Trials    []dbTrial   `json:"trials"`
	Summary   []dbSummary `json:"summary"`
	Halt      *dbHalt     `json:"one_halted,omitempty"`
}

// dbTrial is one converged window at a database count.
type dbTrial struct {
	Databases int `json:"databases"`
	Trial     int `json:"trial"`
	Runners   int `json:"runners"`
	// Tasks completed in the window, all databases.
	Tasks       int       `json:"tasks"`
	WindowS     float64   `json:"window_s"`
	TasksPerS   float64   `json:"tasks_per_s"`
	PerDatabase []dbShare `json:"per_database"`
	// PGCPUPer10k is every server's CPU in the window per 10,000 tasks
	// completed in it.
	PGCPUPer10k float64 `json:"cpu_s_per_10k_tasks_postgres"`
	// CPU in the window, % of one core: the runners' (from /proc), the
	// bench process's (embedded etcd included) and the whole machine's
	// busy time (/proc/stat, every process).
	RunnersCPUPct  float64 `json:"runners_cpu_pct_of_core"`
	BenchCPUPct    float64 `json:"bench_and_etcd_cpu_pct_of_core"`
	MachineBusyPct float64 `json:"machine_busy_pct_of_core"`
	EnqueuePerS    float64 `json:"enqueue_rows_per_s"`
	// ConvergedS is from the runners' spawn to every shard owned and the
	// ownership balanced.
	ConvergedS float64 `json:"converged_s"`
	// Move is the move of one shard after the window (trials at 2
	// databases).
	Move *dbMove `json:"shard_move,omitempty"`
}

// dbMove is one shard's move from one database to another under the
// backlog's load: POST /api/shards/{n}/move to a coordinator, the
// duration from the request to the map's moves list empty (etcd), and
// the rates before, during and after.
type dbMove struct {
	Shard int    `json:"shard"`
	From  string `json:"from"`
	To    string `json:"to"`
	// ShardLeft is the shard's noop tasks without finished_at at the
	// source when it was chosen, at the request (of the source's shards
	// that finished tasks in the last 2s, the one with the most left), and
	// at the end of
	// the window after the move (at the destination).
	ShardLeft      int `json:"shard_unfinished_at_choice"`
	ShardLeftAfter int `json:"shard_unfinished_after"`
	// CopiedTasks is the tasks the copy moved, from the coordinator's "a
	// move committed" line (-1: not found).
	CopiedTasks int `json:"copied_tasks"`
	// LeaderWaitS is from the coordinator's start to its fence raised at
	// every database (before the first window).
	LeaderWaitS float64 `json:"leader_wait_s"`
	// DurationS is from the request to the map's moves list empty, read
	// from etcd every 20ms.
	DurationS float64 `json:"duration_s"`
	// SourceRowsAfter is the shard's rows left at the source after the
	// move (0: the copy's commit deleted them all).
	SourceRowsAfter int `json:"source_rows_after"`
	// ShardPauseS is the longest time between two of the shard's tasks
	// finishing (at either database) from the first window's start to
	// the last's end, and ShardPauseFromS when it began, from the
	// request (negative: before it).
	ShardPauseS     float64 `json:"shard_longest_pause_s"`
	ShardPauseFromS float64 `json:"shard_longest_pause_from_request_s"`
	// ResumedS is from the move's end to the first of the shard's tasks
	// finished at the destination (read every 100ms after the last
	// window, up to dbResumeWait; -1: none by then, or none left to run).
	ResumedS float64       `json:"shard_resumed_after_move_s"`
	Phases   []dbMovePhase `json:"phases"`
	// Error is why the move's measure failed (the trial's window stands).
	Error string `json:"error,omitempty"`
}

// dbMovePhase is the tasks finished before, during or after the move.
type dbMovePhase struct {
	Phase     string  `json:"phase"`
	Seconds   float64 `json:"seconds"`
	TasksPerS float64 `json:"tasks_per_s_all"`
	// PerDatabase is each database's tasks/s, in the servers' order.
	PerDatabase []float64 `json:"tasks_per_s_per_database"`
	// ShardTasks is the moved shard's tasks finished in the phase, at
	// either database.
	ShardTasks     int     `json:"shard_tasks"`
	ShardTasksPerS float64 `json:"shard_tasks_per_s"`
}

// dbShare is one database's part of a window.
type dbShare struct {
	Name      string  `json:"name"`
	Tasks     int     `json:"tasks"`
	TasksPerS float64 `json:"tasks_per_s"`
	PGCPUS    float64 `json:"postgres_cpu_s"`
	// PGCPUOfQuota is the server's CPU over its quota in the window (1:
	// it used all of it).
	PGCPUOfQuota float64 `json:"postgres_cpu_of_quota"`
	// ThrottledPct is the % of the cpu periods in which the server had
	// work that the quota stopped (cpu.stat).
	ThrottledPct float64 `json:"throttled_pct_of_periods"`
	// Left is the database's unfinished noop tasks at the window's end
	// (the backlog did not drain: the window is converged throughput).
	Left int `json:"unfinished_at_window_end"`
	// Autovacuums and Autoanalyzes of the database's tables that ended in
	// the window: their CPU is in the server's.
	Autovacuums  int64 `json:"autovacuums"`
	Autoanalyzes int64 `json:"autoanalyzes"`
}

type dbSummary struct {
	Databases      int       `json:"databases"`
	PerTrial       []float64 `json:"tasks_per_s_per_trial"`
	Median         float64   `json:"tasks_per_s_median"`
	RatioToOne     float64   `json:"ratio_to_one_database,omitempty"`
	Goal           float64   `json:"goal_ratio,omitempty"`
	Met            bool      `json:"goal_met"`
	PGCPUPer10k    float64   `json:"cpu_s_per_10k_tasks_postgres_median"`
	PGCPUOfQuota   float64   `json:"postgres_cpu_of_quota_median"`
	MachineBusyPct float64   `json:"machine_busy_pct_of_core_median"`
}

// dbHalt is the other databases' throughput while one server is halted.
type dbHalt struct {
	Databases int    `json:"databases"`
	Halted    string `json:"halted"`
	// HaltS is how long the server's fast shutdown took.
	HaltS float64 `json:"halt_s"`
	// Others' tasks/s in the window before the halt and in the window
	// that starts dbHaltSettle after it.
	BeforeTasksPerS float64   `json:"others_tasks_per_s_before"`
	DuringTasksPerS float64   `json:"others_tasks_per_s_while_halted"`
	Ratio           float64   `json:"ratio_while_halted_to_before"`
	Before          []dbShare `json:"before"`
	During          []dbShare `json:"while_halted"`
	RunnersCPUPct   float64   `json:"runners_cpu_pct_of_core_while_halted"`
	MachineBusyPct  float64   `json:"machine_busy_pct_of_core_while_halted"`
}

// cappedServer is one PostgreSQL server of the section, in its cgroups.
type cappedServer struct {
	name       string // the database's name in the cluster: db1, db2...
	pg         *pgtmp.Server
	cpu        *cpuCap
	postmaster int
	halted     bool
}

// noopArgs is a noop task of the library client.
type noopArgs struct{}

func (noopArgs) Kind() string { return "noop" }

func (e *env) databasesSection(ctx context.Context, rep *Report) error {
	o := databasesFlags
	if err := checkCgroupV1(); err != nil {
		return err
	}
	var counts []int
	for _, f := range strings.Split(o.counts, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 16 {
			return fmt.Errorf("-db-counts: %q is not a database count from 1 to 16", f)
		}
		counts = append(counts, n)
	}
	slices.Sort(counts)
	counts = slices.Compact(counts)
	res := &databasesResult{CoresPerServer: o.cores, PeriodUS: dbCPUPeriod.Microseconds(), Shares: o.shares, RunnersPerDatabase: o.runnersPer,
		MaxWorkers: o.maxWorkers, DBMaxConns: o.dbMaxConns, TasksPerDatabase: o.tasksPerDB, WarmupS: o.warmup.Seconds(), WindowS: o.window.Seconds()}
	rep.Databases = res
	servers, stop, err := startCappedServers(ctx, counts[len(counts)-1], o.cores, o.shares)
	if err != nil {
		return err
	}
	defer stop()
	// The bench process (the embedded etcd) and the runners in one group
	// of the same cpu.shares: other work must not starve etcd either (the
	// runners' leases), and the group is left when the section ends.
	runnersCPU, err := newCPUCap(fmt.Sprintf("shardrun-bench-%d-bench", os.Getpid()), 0, dbCPUPeriod, o.shares)
	if err != nil {
		return err
	}
	defer func() { _ = runnersCPU.remove() }()
	if err := runnersCPU.add(os.Getpid()); err != nil {
		return err
	}
	res.CPUSource = "cgroup cpuacct.usage"
	if _, ok := servers[0].cpu.usage(); !ok {
		res.CPUSource = "/proc of each postmaster and its children (no cpuacct controller)"
	}
	rep.Notes = append(rep.Notes, fmt.Sprintf("databases section: %d PostgreSQL 15 servers started alike (durable, shared_buffers 128MB), each in a cgroup v1 cpu group of its own capped at %.2f core (cpu.cfs_quota_us %d over cpu.cfs_period_us %d, cpu.shares %d; the bench process, with its embedded etcd, and the runners in one group of cpu.shares %d, no quota); the postmaster and its children moved in before any trial, backends born in it. "+
		"A trial at N databases creates a fresh database on each of the first N servers, one cluster over them (--database db1=URL ... in that order: shards spread in contiguous ranges), enqueues %d noop tasks per database through the library client (Config.Databases: each batch split by shard), runs VACUUM (ANALYZE) on each database (so that the backlog's insert does not set autovacuum off inside the quota during the window), then starts %d runner(s) per database (--max-workers %d, --db-max-conns %d), waits until every shard is owned and the ownership balanced, waits %s, and counts the tasks each database finished (finished_at) in a window of %s; PostgreSQL CPU per task is the servers' CPU in the window (%s) over those tasks; the trials at each count run interleaved (1, 2, 3, 1, 2, 3...)",
		len(servers), o.cores, int64(o.cores*float64(dbCPUPeriod.Microseconds())), dbCPUPeriod.Microseconds(), o.shares, o.shares, o.tasksPerDB, o.runnersPer, o.maxWorkers, o.dbMaxConns, o.warmup, o.window, res.CPUSource))
	if o.move && slices.Contains(counts, 2) {
		rep.Notes = append(rep.Notes, fmt.Sprintf("databases section, shard move: in each trial at 2 databases, after the window, a coordinator is started over both (--database, the leader), and once its fence is raised at both and a first window has passed, db1's shard with tasks finished in the last 2s and the most without finished_at is moved to db2 (POST /api/shards/{n}/move) under the runners' load; the move's time is from the request to the map in etcd listing no move (read every 20ms); tasks are counted by finished_at over %s before the request, the move, and %s after its end, per database and for the moved shard at either database", o.moveWindow, o.moveWindow))
	}
	for trial := range o.trials {
		for _, n := range counts {
			halt := o.halt && n > 1 && trial == o.trials-1 && n == counts[len(counts)-1]
			move := o.move && n == 2
			t, h, err := e.databasesTrial(ctx, servers[:n], runnersCPU, trial, halt, move)
			if err != nil {
				return fmt.Errorf("%d database(s), trial %d: %w", n, trial+1, err)
			}
			res.Trials = append(res.Trials, t)
			fmt.Fprintf(e.log, "  %d database(s), trial %d: %.0f tasks/s (%s), PostgreSQL CPU %.2f s per 10k tasks, %s of quota, throttled %s of periods, autovacuums %s; runners %.0f%%, bench+etcd %.0f%%, machine %.0f%% of a core; converged in %.2fs, enqueue %.0f rows/s\n",
				n, trial+1, t.TasksPerS, shareRates(t.PerDatabase), t.PGCPUPer10k, shareQuota(t.PerDatabase), shareThrottled(t.PerDatabase), shareVacuums(t.PerDatabase),
				t.RunnersCPUPct, t.BenchCPUPct, t.MachineBusyPct, t.ConvergedS, t.EnqueuePerS)
			if m := t.Move; m != nil {
				fmt.Fprintf(e.log, "  %s\n", m.line())
			}
			if h != nil {
				res.Halt = h
				fmt.Fprintf(e.log, "  %s halted (fast shutdown %.2fs) at %d databases: the others %.0f tasks/s before, %.0f while it is down (ratio %.2f; %s before, %s while down)\n",
					h.Halted, h.HaltS, h.Databases, h.BeforeTasksPerS, h.DuringTasksPerS, h.Ratio, shareRates(h.Before), shareRates(h.During))
			}
		}
	}
	res.Summary = summarizeDatabases(res.Trials, counts)
	for _, s := range res.Summary {
		fmt.Fprintf(e.log, "  %d database(s): median %.0f tasks/s (%s)", s.Databases, s.Median, fmtList(s.PerTrial))
		if s.Databases > 1 && s.RatioToOne > 0 {
			fmt.Fprintf(e.log, ", %.2f × one database (goal ≥ %.2f: %s)", s.RatioToOne, s.Goal, verdict(s.Met))
		}
		fmt.Fprintf(e.log, "; PostgreSQL CPU %.2f s per 10k tasks, %.2f of quota (medians)\n", s.PGCPUPer10k, s.PGCPUOfQuota)
	}
	return nil
}

// startCappedServers starts n servers, each in cgroups of its own capped
// at cores; stop stops them and removes the groups.
func startCappedServers(ctx context.Context, n int, cores float64, shares int) (servers []*cappedServer, stop func(), err error) {
	stop = func() {
		for _, s := range servers {
			_ = s.pg.Stop()
			if s.cpu != nil {
				_ = s.cpu.remove()
			}
		}
	}
	defer func() {
		if err != nil {
			stop()
		}
	}()
	for i := range n {
		pg, err := pgtmp.Start(ctx, pgtmp.Options{Durable: true, Settings: map[string]string{"shared_buffers": "128MB", "max_wal_size": "2GB"}})
		if err != nil {
			return servers, stop, fmt.Errorf("starting server %d: %w", i+1, err)
		}
		s := &cappedServer{name: fmt.Sprintf("db%d", i+1), pg: pg}
		servers = append(servers, s)
		if s.postmaster, err = postmasterOf(ctx, pg.DSN("postgres")); err != nil {
			return servers, stop, err
		}
		if s.cpu, err = newCPUCap(fmt.Sprintf("shardrun-bench-%d-pg%d", os.Getpid(), i+1), cores, dbCPUPeriod, shares); err != nil {
			return servers, stop, err
		}
		// The postmaster first: what it forks from then on is born in the
		// groups; then the children it already has.
		if err := s.cpu.add(s.postmaster); err != nil {
			return servers, stop, err
		}
		for _, pid := range childrenOf(s.postmaster) {
			if err := s.cpu.add(pid); err != nil && fileExists(fmt.Sprintf("/proc/%d", pid)) {
				return servers, stop, err
			}
		}
	}
	return servers, stop, nil
}

// postmasterOf is the pid of the postmaster of the server behind dsn: the
// parent of a backend.
func postmasterOf(ctx context.Context, dsn string) (int, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return 0, fmt.Errorf("connecting to find the postmaster: %w", err)
	}
	defer conn.Close(ctx)
	var backend int
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		return 0, fmt.Errorf("reading the backend pid: %w", err)
	}
	st, err := readProcStat(backend)
	if err != nil {
		return 0, fmt.Errorf("reading the backend's parent: %w", err)
	}
	return st.ppid, nil
}

// childrenOf is the pids whose parent is ppid.
func childrenOf(ppid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if st, err := readProcStat(pid); err == nil && st.ppid == ppid {
			out = append(out, pid)
		}
	}
	return out
}

// databasesTrial runs one cluster over servers' fresh databases and
// measures its converged window; with halt, the last server is then halted
// and the others measured again.
func (e *env) databasesTrial(ctx context.Context, servers []*cappedServer, runnersCPU *cpuCap, trial int, halt, move bool) (t dbTrial, h *dbHalt, err error) {
	o := databasesFlags
	n := len(servers)
	t = dbTrial{Databases: n, Trial: trial + 1, Runners: n * o.runnersPer}
	name := fmt.Sprintf("dbs-%d-%d-%d", n, trial, time.Now().UnixNano())
	dbName := fmt.Sprintf("sr_dbs_%d_%d", n, trial)
	var dbs []shardrun.Database
	var flags []string
	defer func() {
		for i, d := range dbs {
			d.Pool.Close()
			if s := servers[i]; !s.halted {
				if dropErr := dropDatabaseOn(ctx, s.pg, dbName); err == nil {
					err = dropErr
				}
			}
		}
	}()
	for _, s := range servers {
		dsn, err := s.pg.CreateDatabase(ctx, dbName)
		if err != nil {
			return t, nil, err
		}
		cfg, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			return t, nil, err
		}
		cfg.MaxConns = 4
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return t, nil, fmt.Errorf("connecting to %s: %w", s.name, err)
		}
		dbs = append(dbs, shardrun.Database{Name: s.name, Pool: pool})
		flags = append(flags, s.name+"="+dsn)
	}
	// The cluster is created here, over the databases in this order.
	client, err := shardrun.NewClient(ctx, nil, e.cli, shardrun.Config{Databases: dbs, Cluster: name, ShardCount: 256, Logger: hclog.NewNullLogger()})
	if err != nil {
		return t, nil, fmt.Errorf("the library client: %w", err)
	}
	batch := make([]shardrun.EnqueueParams, insertBatch)
	for i := range batch {
		batch[i] = shardrun.EnqueueParams{Args: noopArgs{}}
	}
	began, total := time.Now(), o.tasksPerDB*n
	for done := 0; done < total; done += insertBatch {
		if _, err := client.EnqueueMany(ctx, batch[:min(insertBatch, total-done)]); err != nil {
			_ = client.Close()
			return t, nil, fmt.Errorf("enqueueing noop tasks: %w", err)
		}
	}
	t.EnqueuePerS = float64(total) / time.Since(began).Seconds()
	if err := client.Close(); err != nil {
		return t, nil, fmt.Errorf("closing the library client: %w", err)
	}
	// So that the backlog's insert does not set autovacuum off on the
	// tables in the window, inside the server's quota.
	for _, d := range dbs {
		if _, err := d.Pool.Exec(ctx, benchTag+"VACUUM (ANALYZE)"); err != nil {
			return t, nil, fmt.Errorf("vacuuming %s after the enqueue: %w", d.Name, err)
		}
	}

	c := e.newCluster(name, "", 256)
	defer c.stop()
	began = time.Now()
	rps, err := c.startAll(t.Runners, runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: o.maxWorkers, dbMaxConns: o.dbMaxConns, databases: flags})
	if err != nil {
		return t, nil, err
	}
	if o.logs != "" {
		defer func() {
			for _, rp := range rps {
				_ = os.WriteFile(filepath.Join(o.logs, name+"-"+rp.id+".log"), []byte(rp.logs.String()), 0o644)
			}
		}()
	}
	var ids []string
	for _, rp := range rps {
		ids = append(ids, rp.id)
		if err := runnersCPU.add(rp.cmd.Process.Pid); err != nil {
			return t, nil, err
		}
	}
	if err := waitUntil(60*time.Second, func() bool { return c.balanced(ctx, ids...) }); err != nil {
		return t, nil, fmt.Errorf("the ownership of %d runners not balanced: %w", len(ids), err)
	}
	t.ConvergedS = time.Since(began).Seconds()
	if err := sleepCtx(ctx, o.warmup); err != nil {
		return t, nil, err
	}
	w, err := measureDBWindow(ctx, servers, dbs, rps, o.window)
	if err != nil {
		return t, nil, err
	}
	t.PerDatabase, t.WindowS = w.shares, w.seconds
	t.RunnersCPUPct, t.BenchCPUPct, t.MachineBusyPct = w.runnersPct, w.benchPct, w.machinePct
	var cpu float64
	for _, s := range w.shares {
		t.Tasks += s.Tasks
		cpu += s.PGCPUS
	}
	t.TasksPerS = float64(t.Tasks) / w.seconds
	if t.Tasks > 0 {
		t.PGCPUPer10k = cpu / float64(t.Tasks) * 10_000
	}
	if move {
		t.Move = moveShardUnderLoad(ctx, c, servers, dbs, flags, runnersCPU)
	}
	if !halt {
		return t, nil, nil
	}

	victim := servers[n-1]
	h = &dbHalt{Databases: n, Halted: victim.name, Before: w.shares[:n-1]}
	for _, s := range h.Before {
		h.BeforeTasksPerS += s.TasksPerS
	}
	haltAt := time.Now()
	victim.halted = true
	if err := victim.pg.Halt(); err != nil {
		return t, nil, fmt.Errorf("halting %s: %w", victim.name, err)
	}
	h.HaltS = time.Since(haltAt).Seconds()
	if err := sleepCtx(ctx, dbHaltSettle); err != nil {
		return t, nil, err
	}
	w, err = measureDBWindow(ctx, servers[:n-1], dbs[:n-1], rps, o.window)
	if err != nil {
		return t, nil, fmt.Errorf("while %s is halted: %w", victim.name, err)
	}
	h.During, h.RunnersCPUPct, h.MachineBusyPct = w.shares, w.runnersPct, w.machinePct
	for _, s := range h.During {
		h.DuringTasksPerS += s.TasksPerS
	}
	if h.BeforeTasksPerS > 0 {
		h.Ratio = h.DuringTasksPerS / h.BeforeTasksPerS
	}
	return t, h, nil
}

// moveShardUnderLoad starts a coordinator over the cluster's databases
// (the leader, whose driver makes moves), chooses the shard of the first
// database with the most unfinished tasks, and measures its move to the
// second under the runners' load: moveWindow before the request, the
// move (POST /api/shards/{n}/move until the map in etcd lists no move),
// moveWindow after. The tasks of each phase are counted afterwards by
// finished_at (the copy keeps the moved tasks' finished_at, and the
// source's rows are deleted at its commit, so none is counted twice). A
// failure is the move's Error, not the trial's.
func moveShardUnderLoad(ctx context.Context, c *cluster, servers []*cappedServer, dbs []shardrun.Database, flags []string, runnersCPU *cpuCap) *dbMove {
	mv := &dbMove{From: servers[0].name, To: servers[1].name, CopiedTasks: -1}
	if err := mv.run(ctx, c, servers, dbs, flags, runnersCPU); err != nil {
		mv.Error = err.Error()
	}
	return mv
}

func (mv *dbMove) run(ctx context.Context, c *cluster, servers []*cappedServer, dbs []shardrun.Database, flags []string, runnersCPU *cpuCap) error {
	o := databasesFlags
	began := time.Now()
	coord, err := c.startCoordinator(flags...)
	if err != nil {
		return err
	}
	defer func() {
		coord.stop()
		if o.logs != "" {
			_ = os.WriteFile(filepath.Join(o.logs, c.name+"-coordinator.log"), []byte(coord.logs.String()), 0o644)
		}
	}()
	if err := runnersCPU.add(coord.cmd.Process.Pid); err != nil {
		return err
	}
	// The driver moves once the leader's fence is raised at both
	// databases: wait for it, so that the move's time is the move's. Each
	// database's services start after its fence is raised, the sweeper
	// first logging "sweeping".
	if err := waitEvery(60*time.Second, 50*time.Millisecond, func() bool {
		return strings.Count(coord.logs.String(), `"@message":"sweeping"`) >= len(dbs)
	}); err != nil {
		return fmt.Errorf("the coordinator did not raise its fence at %d databases: %w\n%s", len(dbs), err, linewriter.Tail(coord.logs.String(), 20))
	}
	mv.LeaderWaitS = time.Since(began).Seconds()
	t0 := time.Now()
	if err := sleepCtx(ctx, o.moveWindow); err != nil {
		return err
	}
	// Chosen at the end of the first window, so that the shard still has
	// tasks when the move begins (a busy shard drains in seconds).
	// A shard the runners are working on (tasks finished in the last 2s),
	// of those the one with the most left; any with the most left when
	// none is.
	if err := dbs[0].Pool.QueryRow(ctx, benchTag+`SELECT shard, count(*) FILTER (WHERE finished_at IS NULL)::int AS unfinished
		FROM tasks WHERE kind = 'noop' GROUP BY shard
		ORDER BY count(*) FILTER (WHERE finished_at > now() - interval '2 seconds') > 0 DESC, unfinished DESC, shard LIMIT 1`).Scan(&mv.Shard, &mv.ShardLeft); err != nil {
		return fmt.Errorf("choosing the shard to move: %w", err)
	}
	t1 := time.Now()
	body, _ := json.Marshal(map[string]string{"to": mv.To})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, fmt.Sprintf("http://%s/api/shards/%d/move", coord.addr, mv.Shard), bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("asking for the move: %w", err)
	}
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		return fmt.Errorf("asking for the move: %s: %s", resp.Status, msg)
	}
	var last store.Map
	var readErr error
	if err := waitEvery(120*time.Second, 20*time.Millisecond, func() bool {
		m, err := shard.ReadDatabases(ctx, c.env.cli, c.prefix(), c.shards)
		if readErr = err; err != nil {
			return false
		}
		last = m
		return len(m.Moves) == 0
	}); err != nil {
		return fmt.Errorf("the move of shard %d did not end: %w (etcd: %v)\n%s", mv.Shard, err, readErr, linewriter.Tail(coord.logs.String(), 20))
	}
	t2 := time.Now()
	mv.DurationS = t2.Sub(t1).Seconds()
	if at := last.Shards[mv.Shard]; at != mv.To {
		return fmt.Errorf("the move ended with shard %d in %s\n%s", mv.Shard, at, linewriter.Tail(coord.logs.String(), 20))
	}
	if err := sleepCtx(ctx, o.moveWindow); err != nil {
		return err
	}
	t3 := time.Now()
	for _, line := range strings.Split(coord.logs.String(), "\n") {
		var l struct {
			Tasks *int `json:"tasks"`
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.Tasks != nil && strings.Contains(line, "a move committed") {
			mv.CopiedTasks = *l.Tasks
		}
	}
	at := []time.Time{t0, t1, t2, t3}
	mv.Phases = []dbMovePhase{{Phase: "before"}, {Phase: "during"}, {Phase: "after"}}
	for i := range mv.Phases {
		mv.Phases[i].Seconds = at[i+1].Sub(at[i]).Seconds()
	}
	for i, d := range dbs {
		var all, sh [3]int
		var left, shardLeft int
		if err := d.Pool.QueryRow(ctx, benchTag+`SELECT
				count(*) FILTER (WHERE finished_at >= $1 AND finished_at < $2)::int,
				count(*) FILTER (WHERE finished_at >= $2 AND finished_at < $3)::int,
				count(*) FILTER (WHERE finished_at >= $3 AND finished_at < $4)::int,
				count(*) FILTER (WHERE shard = $5 AND finished_at >= $1 AND finished_at < $2)::int,
				count(*) FILTER (WHERE shard = $5 AND finished_at >= $2 AND finished_at < $3)::int,
				count(*) FILTER (WHERE shard = $5 AND finished_at >= $3 AND finished_at < $4)::int,
				count(*) FILTER (WHERE finished_at IS NULL OR finished_at >= $4)::int,
				count(*) FILTER (WHERE shard = $5 AND (finished_at IS NULL OR finished_at >= $4))::int
			FROM tasks WHERE kind = 'noop'`, t0, t1, t2, t3, mv.Shard).Scan(&all[0], &all[1], &all[2], &sh[0], &sh[1], &sh[2], &left, &shardLeft); err != nil {
			return fmt.Errorf("counting %s's tasks of the move's phases: %w", servers[i].name, err)
		}
		if left == 0 {
			return fmt.Errorf("%s's backlog drained before the move's last window ended: give more -db-tasks", servers[i].name)
		}
		mv.ShardLeftAfter += shardLeft
		if i == 0 {
			if err := d.Pool.QueryRow(ctx, benchTag+`SELECT count(*)::int FROM tasks WHERE shard = $1`, mv.Shard).Scan(&mv.SourceRowsAfter); err != nil {
				return fmt.Errorf("counting the shard's rows left at %s: %w", servers[i].name, err)
			}
		}
		for p := range mv.Phases {
			ph := &mv.Phases[p]
			r := float64(all[p]) / ph.Seconds
			ph.PerDatabase = append(ph.PerDatabase, r)
			ph.TasksPerS += r
			ph.ShardTasks += sh[p]
		}
	}
	for p := range mv.Phases {
		mv.Phases[p].ShardTasksPerS = float64(mv.Phases[p].ShardTasks) / mv.Phases[p].Seconds
	}
	// The first of the shard's tasks run at the destination: after t2
	// (the copied ones finished before the copy's commit, before t2).
	mv.ResumedS = -1
	if mv.ShardLeftAfter > 0 {
		var first *time.Time
		_ = waitEvery(dbResumeWait, 100*time.Millisecond, func() bool {
			err := dbs[1].Pool.QueryRow(ctx, benchTag+`SELECT min(finished_at) FROM tasks WHERE shard = $1 AND finished_at >= $2`, mv.Shard, t2).Scan(&first)
			return err != nil || first != nil
		})
		if first != nil {
			mv.ResumedS = first.Sub(t2).Seconds()
		}
	}
	// Every row of the shard is at the destination now (the copy took the
	// finished ones with their finished_at).
	if err := dbs[1].Pool.QueryRow(ctx, benchTag+`SELECT coalesce(extract(epoch FROM gap), 0)::float8, coalesce(extract(epoch FROM finished_at - gap - $4), 0)::float8
		FROM (SELECT finished_at, finished_at - lag(finished_at) OVER (ORDER BY finished_at) AS gap
			FROM tasks WHERE kind = 'noop' AND shard = $1 AND finished_at >= $2 AND finished_at < $3) g
		ORDER BY gap DESC NULLS LAST LIMIT 1`, mv.Shard, t0, t3, t1).Scan(&mv.ShardPauseS, &mv.ShardPauseFromS); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("reading the shard's longest pause at %s: %w", servers[1].name, err)
	}
	return nil
}

// line is the move's line of the section's output.
func (mv *dbMove) line() string {
	if mv.Error != "" {
		return fmt.Sprintf("move of shard %d from %s to %s: not measured: %s", mv.Shard, mv.From, mv.To, mv.Error)
	}
	resumed := fmt.Sprintf("%.2fs", mv.ResumedS)
	if mv.ResumedS < 0 {
		resumed = "none"
		if mv.ShardLeftAfter > 0 {
			resumed = fmt.Sprintf("none within %s", dbResumeWait)
		}
	}
	var parts []string
	for _, p := range mv.Phases {
		var per []string
		for _, r := range p.PerDatabase {
			per = append(per, fmt.Sprintf("%.0f", r))
		}
		parts = append(parts, fmt.Sprintf("%s (%.2fs) %.0f tasks/s (%s), the shard %.0f/s (%d)", p.Phase, p.Seconds, p.TasksPerS, strings.Join(per, "/"), p.ShardTasksPerS, p.ShardTasks))
	}
	return fmt.Sprintf("move of shard %d from %s to %s under load: %.2fs from the request to the map's moves empty (%d tasks copied; the shard had %d unfinished when chosen, %d after, %d rows left at %s; its longest pause %.2fs from %+.2fs of the request; its first task at %s %s after the move's end); %s",
		mv.Shard, mv.From, mv.To, mv.DurationS, mv.CopiedTasks, mv.ShardLeft, mv.ShardLeftAfter, mv.SourceRowsAfter, mv.From, mv.ShardPauseS, mv.ShardPauseFromS, mv.To, resumed, strings.Join(parts, "; "))
}

// dbWindow is what measureDBWindow read.
type dbWindow struct {
	seconds                          float64
	shares                           []dbShare
	runnersPct, benchPct, machinePct float64
}

// measureDBWindow reads the servers' cgroups, the runners', the bench's and
// the machine's CPU at the start and the end of a window, then counts the
// tasks each database finished in it and those left unfinished at its
// end. A runner that exited, or a database whose backlog drained, fails
// the window.
func measureDBWindow(ctx context.Context, servers []*cappedServer, dbs []shardrun.Database, rps []*runnerProc, window time.Duration) (dbWindow, error) {
	type reading struct {
		at             time.Time
		pg             []float64
		thr            []throttling
		runners, bench float64
		busyS          float64
		machineOK      bool
	}
	read := func() reading {
		r := reading{at: time.Now()}
		for _, s := range servers {
			u, _ := s.cpu.usage()
			r.pg = append(r.pg, u)
			r.thr = append(r.thr, s.cpu.throttling())
		}
		for _, rp := range rps {
			if st, err := readProcStat(rp.cmd.Process.Pid); err == nil {
				r.runners += st.cpu
			}
		}
		if st, err := readProcStat(os.Getpid()); err == nil {
			r.bench = st.cpu
		}
		busy, err := machineBusy()
		r.busyS, r.machineOK = busy, err == nil
		return r
	}
	vacuums := func() ([][2]int64, error) {
		var out [][2]int64
		for i, d := range dbs {
			var v [2]int64
			if err := d.Pool.QueryRow(ctx, benchTag+`SELECT coalesce(sum(autovacuum_count), 0)::bigint, coalesce(sum(autoanalyze_count), 0)::bigint
				FROM pg_stat_user_tables`).Scan(&v[0], &v[1]); err != nil {
				return nil, fmt.Errorf("reading %s's autovacuum counts: %w", servers[i].name, err)
			}
			out = append(out, v)
		}
		return out, nil
	}
	va, err := vacuums()
	if err != nil {
		return dbWindow{}, err
	}
	var pgcs []*pgCPU
	if _, ok := servers[0].cpu.usage(); !ok {
		for _, s := range servers {
			pgcs = append(pgcs, startPGCPU(s.postmaster))
		}
	}
	a := read()
	if err := sleepCtx(ctx, window); err != nil {
		for _, p := range pgcs {
			p.stop()
		}
		return dbWindow{}, err
	}
	b := read()
	var procCPU []float64
	for _, p := range pgcs {
		procCPU = append(procCPU, p.stop())
	}
	vb, err := vacuums()
	if err != nil {
		return dbWindow{}, err
	}
	w := dbWindow{seconds: b.at.Sub(a.at).Seconds()}
	w.runnersPct = (b.runners - a.runners) / w.seconds * 100
	w.benchPct = (b.bench - a.bench) / w.seconds * 100
	if a.machineOK && b.machineOK {
		w.machinePct = (b.busyS - a.busyS) / w.seconds * 100
	}
	for _, rp := range rps {
		if rp.cmd.ProcessState != nil {
			return w, fmt.Errorf("runner %s exited during the window\n%s", rp.id, linewriter.Tail(rp.logs.String(), 20))
		}
	}
	for i, s := range servers {
		sh := dbShare{Name: s.name, PGCPUS: b.pg[i] - a.pg[i], Autovacuums: vb[i][0] - va[i][0], Autoanalyzes: vb[i][1] - va[i][1]}
		if procCPU != nil {
			sh.PGCPUS = procCPU[i]
		}
		sh.PGCPUOfQuota = sh.PGCPUS / (s.cpu.cores * w.seconds)
		if p := b.thr[i].periods - a.thr[i].periods; p > 0 {
			sh.ThrottledPct = float64(b.thr[i].throttled-a.thr[i].throttled) / float64(p) * 100
		}
		if err := dbs[i].Pool.QueryRow(ctx, benchTag+`SELECT count(*) FILTER (WHERE finished_at >= $1 AND finished_at < $2)::int,
				count(*) FILTER (WHERE finished_at IS NULL OR finished_at >= $2)::int
			FROM tasks WHERE kind = 'noop'`, a.at, b.at).Scan(&sh.Tasks, &sh.Left); err != nil {
			return w, fmt.Errorf("counting %s's finished tasks: %w", s.name, err)
		}
		if sh.Left == 0 {
			return w, fmt.Errorf("%s's backlog drained within the window: give more -db-tasks", s.name)
		}
		sh.TasksPerS = float64(sh.Tasks) / w.seconds
		w.shares = append(w.shares, sh)
	}
	return w, nil
}

func dropDatabaseOn(ctx context.Context, pg *pgtmp.Server, name string) error {
	conn, err := pgx.Connect(ctx, pg.DSN("postgres"))
	if err != nil {
		return fmt.Errorf("connecting to drop database %s: %w", name, err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("dropping database %s: %w", name, err)
	}
	return nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// summarizeDatabases is each count's medians and its ratio to one
// database.
func summarizeDatabases(trials []dbTrial, counts []int) []dbSummary {
	var out []dbSummary
	var one float64
	for _, n := range counts {
		s := dbSummary{Databases: n}
		var cpu, quota, busy []float64
		for _, t := range trials {
			if t.Databases != n {
				continue
			}
			s.PerTrial = append(s.PerTrial, t.TasksPerS)
			cpu, busy = append(cpu, t.PGCPUPer10k), append(busy, t.MachineBusyPct)
			var q float64
			for _, sh := range t.PerDatabase {
				q += sh.PGCPUOfQuota / float64(len(t.PerDatabase))
			}
			quota = append(quota, q)
		}
		if len(s.PerTrial) == 0 {
			continue
		}
		s.Median, s.PGCPUPer10k, s.PGCPUOfQuota, s.MachineBusyPct = median(s.PerTrial), median(cpu), median(quota), median(busy)
		if n == 1 {
			one = s.Median
		}
		if one > 0 && n > 1 {
			s.RatioToOne = s.Median / one
			s.Goal = 0.9 * float64(n)
			s.Met = s.RatioToOne >= s.Goal
		}
		out = append(out, s)
	}
	return out
}

func shareRates(shares []dbShare) string {
	var parts []string
	for _, s := range shares {
		parts = append(parts, fmt.Sprintf("%s %.0f", s.Name, s.TasksPerS))
	}
	return strings.Join(parts, ", ")
}

func shareQuota(shares []dbShare) string {
	var parts []string
	for _, s := range shares {
		parts = append(parts, fmt.Sprintf("%.2f", s.PGCPUOfQuota))
	}
	return strings.Join(parts, "/")
}

func shareVacuums(shares []dbShare) string {
	var parts []string
	for _, s := range shares {
		parts = append(parts, fmt.Sprintf("%d+%d", s.Autovacuums, s.Autoanalyzes))
	}
	return strings.Join(parts, "/")
}

func shareThrottled(shares []dbShare) string {
	var parts []string
	for _, s := range shares {
		parts = append(parts, fmt.Sprintf("%.0f%%", s.ThrottledPct))
	}
	return strings.Join(parts, "/")
}

// printDatabases writes the section's rows of the results table.
func printDatabases(w io.Writer, r *databasesResult) {
	for _, s := range r.Summary {
		fmt.Fprintf(w, "| noop throughput, %d database(s) capped at %.2f core each, %d runner(s) | median %.0f tasks/s (%s)", s.Databases, r.CoresPerServer, s.Databases*r.RunnersPerDatabase, s.Median, fmtList(s.PerTrial))
		if s.Databases > 1 && s.RatioToOne > 0 {
			fmt.Fprintf(w, "; **%.2f** × one database (goal ≥ %.2f)", s.RatioToOne, s.Goal)
		}
		fmt.Fprintf(w, "; PostgreSQL CPU %.2f s per 10k tasks, %.2f of quota (medians) |\n", s.PGCPUPer10k, s.PGCPUOfQuota)
	}
	for _, t := range r.Trials {
		if m := t.Move; m != nil {
			fmt.Fprintf(w, "| %d databases, trial %d: %s |\n", t.Databases, t.Trial, m.line())
		}
	}
	if h := r.Halt; h != nil {
		fmt.Fprintf(w, "| %d databases, %s halted | the others %.0f tasks/s before, %.0f while it is down (ratio %.2f) |\n", h.Databases, h.Halted, h.BeforeTasksPerS, h.DuringTasksPerS, h.Ratio)
	}
}

// databasesTargets (issue 40): N databases ≥ 0.9 × N × one.
func databasesTargets(r *databasesResult) []target {
	var out []target
	for _, n := range []int{2, 3} {
		t := target{Measure: fmt.Sprintf("noop throughput, %d databases ÷ one database (each server capped alike)", n), Target: fmt.Sprintf("≥ %.1f", 0.9*float64(n)), Status: notMeasured}
		if r != nil {
			for _, s := range r.Summary {
				if s.Databases == n && s.RatioToOne > 0 {
					t.Measured = fmt.Sprintf("%.2f (medians %.0f ÷ %.0f tasks/s)", s.RatioToOne, s.Median, s.Median/s.RatioToOne)
					t.Status = verdict(s.Met)
				}
			}
		}
		out = append(out, t)
	}
	return out
}
