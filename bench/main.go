// Command bench measures shardrun side by side with River on one throwaway
// PostgreSQL and one embedded etcd: end-to-end throughput, failover after
// kill -9, graceful handoff, the detach margin, sweep cost and the cost of
// running it. It prints a table and writes a JSON report.
//
//	make bench        # from the repository root: builds the binaries first
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/pgtmp"
)

type pgxTx = pgx.Tx

// env is what every measurement shares.
type env struct {
	pg        *pgtmp.Server
	etcd      *embedetcd.Server
	cli       *clientv3.Client
	runnerBin string
	// coordinatorBin is bin/coordinator, which the unclaimable section
	// runs as a deployment does.
	coordinatorBin string
	// txworkerBin is internal/cmd/txworker, which the outage section runs
	// (a runner on package shardrun whose handler holds its transaction
	// open when asked); empty when that section does not run.
	txworkerBin string
	log         io.Writer
	// statStatements: pg_stat_statements is loaded, so statements are counted.
	statStatements bool
}

// Report is the JSON written to -out.
type Report struct {
	GeneratedAt time.Time         `json:"generated_at"`
	Machine     map[string]string `json:"machine"`
	Postgres    map[string]string `json:"postgres_settings"`
	Settings    map[string]any    `json:"settings"`
	Throughput  []burnDown        `json:"throughput"`
	Ratios      []ratio           `json:"throughput_ratio_shardrun_over_river"`
	Failover    []latencies       `json:"failover_after_kill_9"`
	Handoff     *latencies        `json:"graceful_handoff,omitempty"`
	Detach      []detachTrial     `json:"detach_margin"`
	Sweep       []sweepResult     `json:"sweep"`
	Inspect     *inspectResult    `json:"inspect_10m_rows,omitempty"`
	Enqueue     *enqueueResult    `json:"enqueue_paths,omitempty"`
	Cost        *cost             `json:"cost,omitempty"`
	Unclaimable *unclaimable      `json:"unclaimable,omitempty"`
	Retention   *retentionRun     `json:"retention,omitempty"`
	Churn       []churn           `json:"churn,omitempty"`
	Steady      []steadyRun       `json:"steady_state,omitempty"`
	Wakeup      []wakeupRun       `json:"wakeup_hops,omitempty"`
	Notify      *notifyResult     `json:"notify_trigger_cost,omitempty"`
	Scale       *scaleResult      `json:"scale,omitempty"`
	Mixed       *mixedResult      `json:"mixed,omitempty"`
	Curve       *curveResult      `json:"scale_curve,omitempty"`
	Work        *workResult       `json:"work,omitempty"`
	Startup     *startupResult    `json:"startup,omitempty"`
	Features    *featuresResult   `json:"features,omitempty"`
	Tracing     *tracingCost      `json:"tracing,omitempty"`
	Idle        []idleRun         `json:"idle_queues,omitempty"`
	IdleFleets  []idleFleetRun    `json:"idle_fleets,omitempty"`
	Outage      *outageResult     `json:"outage,omitempty"`
	Databases   *databasesResult  `json:"databases,omitempty"`
	// Targets are the targets of issues 23, 26, 31, 35, 39 and 40, judged from this run.
	Targets []target `json:"targets"`
	// Seconds each section took.
	SectionSeconds map[string]float64 `json:"section_seconds"`
	// Failed holds the error of each section that failed (a trial whose
	// tasks did not all complete, a poll that failed...); the sections
	// after it still ran.
	Failed map[string]string `json:"failed_sections,omitempty"`
	Notes  []string          `json:"notes"`
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == riverChildFlag {
		os.Exit(riverChild(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == runnerChildFlag {
		os.Exit(runnerChild(os.Args[2:]))
	}
	out := flag.String("out", "results/latest.json", "where to write the JSON report")
	trials := flag.Int("trials", 3, "trials of each throughput measurement")
	faultTrials := flag.Int("fault-trials", 5, "trials of each failover, handoff and detach measurement")
	n := flag.Int("n", 200_000, "tasks per throughput trial")
	runnerBin := flag.String("runner", "../bin/runner", "the runner binary")
	coordinatorBin := flag.String("coordinator", "../bin/coordinator", "the coordinator binary (the unclaimable section runs one)")
	txworkerBin := flag.String("txworker", "../bin/txworker", "the txworker binary, internal/cmd/txworker (the outage section runs two)")
	maxWorkers := flag.String("max-workers", "1=1024,3=1024", "shardrun runners' --max-workers per process count in the throughput runs")
	riverWorkers := flag.Int("river-workers", 1000, "River's MaxWorkers in the throughput runs")
	procs := flag.String("procs", "1,3", "process counts of the throughput runs")
	withRiver := flag.Bool("river", true, "run River's throughput trials too (false: shardrun's alone, to compare changes quickly)")
	flag.IntVar(&inspectRows, "inspect-rows", inspectRows, "rows of the inspect section's table")
	only := flag.String("only", "", "comma-separated sections to run: throughput,features,curve,work,failover,handoff,detach,sweep,inspect,enqueue,cost,unclaimable,retention,churn,steady,wakeup,notify,scale,startup,mixed,tracing,idle,outage,databases (default all)")
	redraw := flag.String("chart-from", "", "draw the scale curve chart of this JSON report next to -out, and run nothing")
	flag.StringVar(&curveFlags.procs, "curve-procs", curveFlags.procs, "process counts of the scale curve (curve section)")
	flag.IntVar(&curveFlags.trials, "curve-trials", curveFlags.trials, "trials of each system at each process count of the scale curve")
	flag.IntVar(&curveFlags.workers, "curve-workers", curveFlags.workers, "workers per process of both systems in the scale curve")
	flag.IntVar(&curveFlags.conns, "curve-conns", curveFlags.conns, "PostgreSQL connections per process of both systems in the scale curve")
	flag.StringVar(&workFlags.procs, "work-procs", workFlags.procs, "process counts of the work section (runner-bound throughput on sleep tasks, both systems)")
	flag.IntVar(&workFlags.workers, "work-workers", workFlags.workers, "workers per process of both systems in the work section")
	flag.IntVar(&workFlags.sleepMS, "work-sleep-ms", workFlags.sleepMS, "sleep of each task in the work section, ms")
	flag.Float64Var(&workFlags.seconds, "work-seconds", workFlags.seconds, "seconds of tasks at the ideal rate per work trial (tasks = processes × workers × 1000/sleep × this)")
	flag.IntVar(&workFlags.conns, "work-conns", workFlags.conns, "PostgreSQL connections per process of both systems in the work section")
	flag.IntVar(&workFlags.shards, "work-shards", workFlags.shards, "shards of the work section's shardrun clusters")
	flag.IntVar(&workFlags.trials, "work-trials", workFlags.trials, "trials of each system at each process count of the work section")
	flag.IntVar(&unclaimableFlags.tasks, "unhandled", unclaimableFlags.tasks, "ready tasks of a kind nobody handles in the unclaimable section")
	flag.IntVar(&unclaimableFlags.procs, "unhandled-procs", unclaimableFlags.procs, "runner processes of the unclaimable section")
	flag.IntVar(&maint.retentionRows, "retention-rows", 10_000_000, "finished rows the retention section deletes")
	flag.IntVar(&maint.steadyRate, "steady-rate", 500, "tasks/s of the steady workload during the retention section")
	flag.IntVar(&maint.churnTasks, "churn-tasks", 1_000_000, "tasks of each churn run")
	flag.IntVar(&maint.churnRate, "churn-rate", 8_000, "tasks/s of the churn runs")
	flag.IntVar(&steadyFlags.procs, "steady-procs", 3, "worker processes of each system in the steady section")
	flag.IntVar(&steadyFlags.seconds, "steady-seconds", 10, "measured window of each steady run, seconds (after a 2s warm-up)")
	flag.StringVar(&steadyFlags.rates, "steady-rates", "1000,5000,10000", "target enqueue rates (tasks/s) of the steady section")
	flag.IntVar(&notifySeconds, "notify-seconds", notifySeconds, "seconds of each notify run (one per variant and producer count)")
	flag.IntVar(&scaleFlags.runners, "scale-runners", scaleFlags.runners, "runners started at once in the scale section (one more joins)")
	flag.IntVar(&scaleFlags.shards, "scale-shards", scaleFlags.shards, "shards of the scale section's cluster")
	flag.IntVar(&scaleFlags.tasks, "scale-tasks", scaleFlags.tasks, "noop tasks of the scale section's burn-down")
	flag.IntVar(&scaleFlags.maxWorkers, "scale-max-workers", scaleFlags.maxWorkers, "--max-workers of each runner in the scale section")
	flag.IntVar(&startupFlags.runners, "startup-runners", startupFlags.runners, "runners started at once on a backlog in the startup section (one more joins under load)")
	flag.IntVar(&startupFlags.shards, "startup-shards", startupFlags.shards, "shards of the startup section's cluster")
	flag.IntVar(&startupFlags.tasks, "startup-tasks", startupFlags.tasks, "noop tasks of the startup section's backlog")
	flag.IntVar(&startupFlags.maxWorkers, "startup-max-workers", startupFlags.maxWorkers, "--max-workers of each runner in the startup section")
	flag.IntVar(&startupFlags.joinTasks, "startup-join-tasks", startupFlags.joinTasks, "noop tasks draining while one more runner joins in the startup section (0: no join)")
	flag.DurationVar(&startupFlags.joinAfter, "startup-join-after", startupFlags.joinAfter, "when the joiner is spawned after the join backlog's commit in the startup section")
	flag.IntVar(&mixedFlags.runners, "mixed-runners", mixedFlags.runners, "runners of each fleet of the mixed section (uniform and mixed; one more joins)")
	flag.IntVar(&mixedFlags.shards, "mixed-shards", mixedFlags.shards, "shards of the mixed section's clusters")
	flag.IntVar(&mixedFlags.queues, "mixed-queues", mixedFlags.queues, "queues (q0, q1...) of the mixed section's fleets")
	flag.IntVar(&mixedFlags.kinds, "mixed-kinds", mixedFlags.kinds, "task kinds (k00, k01...) of the mixed section's fleets")
	flag.IntVar(&mixedFlags.maxWorkers, "mixed-max-workers", mixedFlags.maxWorkers, "--max-workers of each runner of the mixed section's cost fleets")
	flag.IntVar(&mixedFlags.idleSeconds, "mixed-idle-seconds", mixedFlags.idleSeconds, "seconds over which the mixed section counts etcd messages of an idle fleet")
	flag.IntVar(&mixedFlags.pagesTasks, "mixed-tasks", mixedFlags.pagesTasks, "noop tasks of each cost fleet's burn-down in the mixed section (claim pages per claimed task)")
	flag.StringVar(&mixedFlags.tpRunners, "mixed-tp-runners", mixedFlags.tpRunners, "runner counts of the emails queue in the mixed section's throughput trials")
	flag.IntVar(&mixedFlags.tpWorkers, "mixed-tp-max-workers", mixedFlags.tpWorkers, "--max-workers of each runner in the mixed section's throughput trials")
	flag.IntVar(&mixedFlags.tpTasksPerRunner, "mixed-tp-tasks", mixedFlags.tpTasksPerRunner, "emails tasks per emails runner in the mixed section's throughput trials")
	flag.IntVar(&mixedFlags.tpShards, "mixed-tp-shards", mixedFlags.tpShards, "shards of the mixed section's throughput trials (0: -mixed-shards)")
	flag.IntVar(&mixedFlags.tpSleepMS, "mixed-tp-sleep-ms", mixedFlags.tpSleepMS, "sleep of each task in the mixed section's throughput trials, ms")
	flag.IntVar(&featuresFlags.procs, "features-procs", featuresFlags.procs, "runner processes of the features section (--max-workers as in the throughput runs at that count)")
	flag.IntVar(&featuresFlags.sequences, "sequences", featuresFlags.sequences, "sequences of the features section's sequence burn-down")
	flag.IntVar(&featuresFlags.sequenceLen, "sequence-length", featuresFlags.sequenceLen, "tasks per sequence in the features section")
	flag.IntVar(&featuresFlags.backlog, "priority-backlog", featuresFlags.backlog, "default-priority tasks draining while the features section enqueues urgent ones")
	flag.IntVar(&featuresFlags.rate, "priority-rate", featuresFlags.rate, "tasks/s of each priority (1 and 3) enqueued one by one during the drain")
	flag.IntVar(&featuresFlags.seconds, "priority-seconds", featuresFlags.seconds, "seconds of the one-by-one enqueue during the drain")
	flag.StringVar(&idleFlags.queues, "idle-queues", idleFlags.queues, "queue counts the idle section's runner serves in turn (default, then q0001...)")
	flag.IntVar(&idleFlags.seconds, "idle-seconds", idleFlags.seconds, "measured window of each idle run, seconds")
	flag.StringVar(&idleFleetFlags.fleets, "idle-fleets", idleFleetFlags.fleets, "RUNNERSxSHARDS idle fleets of the idle section, uniform and (from 10 runners) mixed; empty: none")
	flag.IntVar(&idleFleetFlags.seconds, "idle-fleet-seconds", idleFleetFlags.seconds, "measured window of each idle fleet, seconds")
	flag.IntVar(&outageFlags.trials, "outage-trials", outageFlags.trials, "PostgreSQL restarts of the outage section (first task after the restart)")
	flag.IntVar(&outageFlags.freezeTrials, "outage-freeze-trials", outageFlags.freezeTrials, "trials of the outage section's failover with a frozen open transaction, at each lease TTL")
	flag.IntVar(&outageFlags.tasks, "outage-tasks", outageFlags.tasks, "noop tasks enqueued once the restarted PostgreSQL accepts connections")
	flag.DurationVar(&outageFlags.down, "outage-down", outageFlags.down, "how long the outage section keeps PostgreSQL down")
	flag.StringVar(&outageFlags.ttls, "outage-ttls", outageFlags.ttls, "lease TTLs of the outage section's failover with a frozen open transaction")
	flag.IntVar(&outageFlags.rate, "outage-rate", outageFlags.rate, "effect tasks/s enqueued during the outage section's frozen-transaction trials")
	flag.IntVar(&outageFlags.shards, "outage-shards", outageFlags.shards, "shards of the outage section's frozen-transaction clusters")
	flag.DurationVar(&outageFlags.hold, "outage-hold", outageFlags.hold, "how long the frozen runner's handler holds its transaction open after CompleteTx")
	flag.DurationVar(&outageFlags.bound, "outage-bound", outageFlags.bound, "how long a frozen-transaction trial waits for the failover (longer: reported as more than this)")
	flag.StringVar(&outageFlags.logs, "outage-logs", "", "a directory for the runners' logs of each outage restart trial (none when empty)")
	flag.StringVar(&databasesFlags.counts, "db-counts", databasesFlags.counts, "database counts of the databases section (one PostgreSQL server each)")
	flag.IntVar(&databasesFlags.trials, "db-trials", databasesFlags.trials, "trials at each database count of the databases section")
	flag.Float64Var(&databasesFlags.cores, "db-cpu", databasesFlags.cores, "cgroup v1 cpu quota of each PostgreSQL server in the databases section, in cores")
	flag.IntVar(&databasesFlags.runnersPer, "db-runners", databasesFlags.runnersPer, "runners per database in the databases section")
	flag.IntVar(&databasesFlags.maxWorkers, "db-max-workers", databasesFlags.maxWorkers, "--max-workers of each runner in the databases section")
	flag.IntVar(&databasesFlags.dbMaxConns, "db-max-conns", databasesFlags.dbMaxConns, "--db-max-conns of each runner in the databases section (per database)")
	flag.IntVar(&databasesFlags.tasksPerDB, "db-tasks", databasesFlags.tasksPerDB, "noop tasks enqueued per database before each databases trial")
	flag.DurationVar(&databasesFlags.warmup, "db-warmup", databasesFlags.warmup, "wait after the ownership is balanced before the databases section's window")
	flag.DurationVar(&databasesFlags.window, "db-window", databasesFlags.window, "measured window of each databases trial")
	flag.IntVar(&databasesFlags.shares, "db-shares", databasesFlags.shares, "cpu.shares of the databases section's server groups and of its group of the bench process (etcd) and the runners (0: the default 1024)")
	flag.StringVar(&databasesFlags.logs, "db-logs", "", "a directory for the runners' logs of each databases trial (none when empty)")
	flag.BoolVar(&databasesFlags.halt, "db-halt", databasesFlags.halt, "halt one server in the last trial at the largest count and measure the others")
	flag.BoolVar(&databasesFlags.move, "db-move", databasesFlags.move, "in each trial at 2 databases, start a coordinator after the window and move one shard of db1 to db2 under the load, measuring the move's time and the rates before, during and after")
	flag.DurationVar(&databasesFlags.moveWindow, "db-move-window", databasesFlags.moveWindow, "windows before and after the databases section's shard move")
	flag.IntVar(&tracingFlags.procs, "tracing-procs", tracingFlags.procs, "runner processes of the tracing section (--max-workers as in the throughput runs at that count)")
	flag.Parse()
	if *redraw != "" {
		if err := redrawChart(*redraw, *out); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	tuning = tune{shardrunWorkers: map[int]int{}, riverWorkers: *riverWorkers, withRiver: *withRiver}
	for _, kv := range strings.Split(*maxWorkers, ",") {
		var p, w int
		if _, err := fmt.Sscanf(kv, "%d=%d", &p, &w); err == nil {
			tuning.shardrunWorkers[p] = w
		}
	}
	for _, p := range strings.Split(*procs, ",") {
		var n int
		fmt.Sscan(p, &n)
		tuning.procs = append(tuning.procs, n)
	}
	if err := run(ctx, *out, *trials, *faultTrials, *n, *runnerBin, *coordinatorBin, *txworkerBin, *only); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, out string, trials, faultTrials, n int, runnerBin, coordinatorBin, txworkerBin, only string) error {
	want := func(section string) bool {
		return only == "" || slices.Contains(strings.Split(only, ","), section)
	}
	bin, err := filepath.Abs(runnerBin)
	if err != nil {
		return err
	}
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("no runner binary at %s: run `make build` first (make bench does)", bin)
	}
	coordBin, err := filepath.Abs(coordinatorBin)
	if err != nil {
		return err
	}
	if _, err := os.Stat(coordBin); err != nil {
		if want("unclaimable") {
			return fmt.Errorf("no coordinator binary at %s: run `make build` first (make bench does)", coordBin)
		}
		coordBin = ""
	}
	txBin := ""
	if want("outage") {
		if txBin, err = filepath.Abs(txworkerBin); err != nil {
			return err
		}
		if _, err := os.Stat(txBin); err != nil {
			return fmt.Errorf("no txworker binary at %s: run `go build -o bin/ ./internal/cmd/txworker` first (make bench does)", txBin)
		}
	}
	settings := map[string]string{"shared_buffers": "256MB", "max_wal_size": "2GB"}
	statStatements := pgStatStatementsInstalled()
	if statStatements {
		settings["shared_preload_libraries"] = "pg_stat_statements"
	}
	pg, err := pgtmp.Start(ctx, pgtmp.Options{Durable: true, Settings: settings})
	if err != nil {
		return err
	}
	defer pg.Stop()
	if statStatements {
		if err := createExtension(ctx, pg.DSN("postgres"), "pg_stat_statements"); err != nil {
			return err
		}
	}
	dir, err := os.MkdirTemp("", "shardrun-bench-etcd-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	etcd, err := embedetcd.Start(ctx, embedetcd.Config{Dir: dir})
	if err != nil {
		return err
	}
	defer etcd.Close()
	etcdCli, err := cli.NewEtcdClient(etcd.Endpoints(), nil)
	if err != nil {
		return err
	}
	defer etcdCli.Close()
	e := &env{pg: pg, etcd: etcd, cli: etcdCli, runnerBin: bin, coordinatorBin: coordBin, txworkerBin: txBin, log: os.Stdout, statStatements: statStatements}

	rep := &Report{GeneratedAt: time.Now().UTC(), Machine: machine(ctx, pg), Settings: map[string]any{}}
	rep.Postgres = map[string]string{"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
		"shared_buffers": settings["shared_buffers"], "max_wal_size": settings["max_wal_size"], "max_connections": "300",
		"shared_preload_libraries": settings["shared_preload_libraries"],
		"note":                     "one server for both systems, started the same way; each trial in a fresh database"}
	if !statStatements {
		rep.Notes = append(rep.Notes, "pg_stat_statements is not installed with these PostgreSQL binaries: statements per task not measured, transactions only")
	}
	sections := []struct {
		name string
		fn   func() error
	}{
		{"throughput", func() error { return e.throughputSection(ctx, rep, trials, n) }},
		{"features", func() error { return e.featuresSection(ctx, rep, trials, n) }},
		{"curve", func() error { return e.curveSection(ctx, rep, n, out) }},
		{"work", func() error { return e.workSection(ctx, rep) }},
		{"failover", func() error { return e.failoverSection(ctx, rep, faultTrials) }},
		{"handoff", func() error { return e.handoffSection(ctx, rep, faultTrials) }},
		{"detach", func() error { return e.detachSection(ctx, rep, faultTrials) }},
		{"sweep", func() error { return e.sweepSection(ctx, rep, trials) }},
		{"inspect", func() error { return e.inspectSection(ctx, rep, trials) }},
		{"enqueue", func() error { return e.enqueueSection(ctx, rep, trials) }},
		{"cost", func() error { return e.costSection(ctx, rep) }},
		{"unclaimable", func() error { return e.unclaimableSection(ctx, rep, trials, n) }},
		{"retention", func() error { return e.retentionSection(ctx, rep, maint.retentionRows, maint.steadyRate) }},
		{"churn", func() error { return e.churnSection(ctx, rep, maint.churnTasks, maint.churnRate) }},
		{"steady", func() error { return e.steadySection(ctx, rep) }},
		{"wakeup", func() error { return e.wakeupSection(ctx, rep) }},
		{"notify", func() error { return e.notifySection(ctx, rep) }},
		{"scale", func() error { return e.scaleSection(ctx, rep) }},
		{"startup", func() error { return e.startupSection(ctx, rep) }},
		{"mixed", func() error { return e.mixedSection(ctx, rep) }},
		{"tracing", func() error { return e.tracingSection(ctx, rep, trials, n) }},
		{"idle", func() error { return e.idleSection(ctx, rep) }},
		{"outage", func() error { return e.outageSection(ctx, rep) }},
		{"databases", func() error { return e.databasesSection(ctx, rep) }},
	}
	rep.SectionSeconds = map[string]float64{}
	benchStart := time.Now()
	for _, s := range sections {
		if !want(s.name) {
			continue
		}
		fmt.Fprintf(e.log, "== %s\n", s.name)
		began := time.Now()
		err := s.fn()
		rep.SectionSeconds[s.name] = time.Since(began).Seconds()
		if err != nil {
			// Reported, and the run goes on: a failed trial must not throw
			// away an hour of other sections' measurements.
			if rep.Failed == nil {
				rep.Failed = map[string]string{}
			}
			rep.Failed[s.name] = err.Error()
			fmt.Fprintf(e.log, "!! section %s failed: %v\n", s.name, err)
			if ctx.Err() != nil {
				break
			}
		}
	}
	rep.SectionSeconds["total"] = time.Since(benchStart).Seconds()
	rep.Targets = targets(rep)
	printTable(e.log, rep)
	printTargets(e.log, rep.Targets)
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	b, _ := json.MarshalIndent(rep, "", "  ")
	if err := os.WriteFile(out, append(b, '\n'), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(e.log, "\nwrote %s\n", out)
	if len(rep.Failed) > 0 {
		return fmt.Errorf("%d section(s) failed: %s (see failed_sections in %s)", len(rep.Failed), strings.Join(slices.Sorted(maps.Keys(rep.Failed)), ", "), out)
	}
	return nil
}

type ratio struct {
	Processes int       `json:"processes"`
	PerTrial  []float64 `json:"per_trial"`
	Median    float64   `json:"median"`
}

// tune holds the worker counts of the throughput runs (flags).
type tune struct {
	shardrunWorkers map[int]int // per process count
	riverWorkers    int
	procs           []int
	// withRiver: false runs shardrun's trials alone (-river=false), for
	// comparing changes to shardrun quickly.
	withRiver bool
}

var tuning tune

func (e *env) throughputSection(ctx context.Context, rep *Report, trials, n int) error {
	rs := riverBase(tuning.riverWorkers)
	rep.Settings["shardrun"] = map[string]any{"max_workers_by_processes": tuning.shardrunWorkers, "db_max_conns": 8, "shard_count": 256}
	rep.Settings["river"] = rs
	rep.Notes = append(rep.Notes,
		"worker counts, chosen by measurement on this machine: one process - shardrun --max-workers 256/512/1024 gave 37.4k/45.9k/50.3k tasks/s, River MaxWorkers 500/1000/2000 gave 27.8k/29.8k/28.9k jobs/s (100,000-task trials); three processes - shardrun 256/512/1024 per runner gave 31.8-32.1k/34.8-36.5k/22.0-33.0k, River 333/1000/2000 per client gave 22.0-25.0k/25.5-30.7k/25.4-29.1k (200,000-task trials); so shardrun runs 1024 workers alone and 512 per runner for three, River 1000 per client. River's FetchCooldown 2ms and FetchPollInterval 20ms are those of River's own benchmark (cmd/river/riverbench)",
		"River runs in child processes of the bench binary (one River client each, with its own pool of 16 connections; the jobs are inserted by the bench process beforehand); shardrun runners are separate processes of bin/runner; both share the machine's 2 cores with PostgreSQL and the bench process",
		"CPU seconds per 10,000 tasks: the worker processes' user+system CPU over their whole life (start-up and graceful stop included), exact from wait4; PostgreSQL's is the postmaster's and all its children's CPU from just before the workers start to the end of the burn-down, sampled from /proc every 100ms (processes born and gone between two samples are missed); the bench follows shardrun's burn-down through the runners' metrics (every 100ms; no statement) and asks the database only once their count reaches n or stalls for a second, River's from a cheap poll of river_job every 20ms, which is in River's PostgreSQL figure; shardrun's etcd runs embedded in the bench process and is not counted",
		"throughput is timed from the first claim (attempt) to the last completion (finalisation), from the database's own timestamps; a trial fails unless exactly n noop tasks exist and all completed, or when a poll fails",
		"per task, from just before the workers start to the end of the burn-down (read after they exit): statements and pages (shared_blks_hit + shared_blks_read) from pg_stat_statements, less the bench's own statements (tagged /* bench */); pages per claimed task are those of the claim statements (shardrun: /* shardrun.claim */ when its statements are named, else its claim's text; River: JobGetAvailable) over the rows they returned; WAL bytes from the server's insert position (each trial drops its database when done, so no other database is active meanwhile)")
	for _, procs := range tuning.procs {
		var ratios []float64
		for trial := range trials {
			ours, err := e.shardrunBurnDown(ctx, trialOpts{label: "tp", trial: trial, processes: procs, n: n, maxWorkers: cmp.Or(tuning.shardrunWorkers[procs], 512)})
			if err != nil {
				return err
			}
			if !tuning.withRiver {
				rep.Throughput = append(rep.Throughput, ours)
				fmt.Fprintf(e.log, "  %d process(es), trial %d: shardrun %.0f tasks/s, CPU s per 10k tasks %.2f (runners %.2f, PostgreSQL %.2f), statements per task %.4f\n",
					procs, trial+1, ours.TasksPerS, ours.CPUTotalPer10k, ours.CPUWorkersPer10k, ours.CPUPostgresPer10k, ours.StmtsPerTask)
				continue
			}
			theirs, err := e.riverBurnDown(ctx, trialOpts{label: "tp", trial: trial, processes: procs, n: n}, rs)
			if err != nil {
				return err
			}
			rep.Throughput = append(rep.Throughput, ours, theirs)
			ratios = append(ratios, ours.TasksPerS/theirs.TasksPerS)
			fmt.Fprintf(e.log, "  %d process(es), trial %d: shardrun %.0f tasks/s, river %.0f jobs/s, ratio %.2f (enqueue %.0f vs %.0f rows/s)\n",
				procs, trial+1, ours.TasksPerS, theirs.TasksPerS, ours.TasksPerS/theirs.TasksPerS, ours.EnqueuePerS, theirs.EnqueuePerS)
		}
		if len(ratios) > 0 {
			rep.Ratios = append(rep.Ratios, ratio{Processes: procs, PerTrial: ratios, Median: median(ratios)})
		}
	}
	return nil
}

// riverBase is River's settings with maxWorkers: FetchCooldown and
// FetchPollInterval those of River's own benchmark (cmd/river/riverbench),
// 16 connections per client.
func riverBase(maxWorkers int) riverSettings {
	return riverSettings{MaxWorkers: maxWorkers, FetchCooldown: "2ms", FetchPollInterval: "20ms", PoolConns: 16}
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func machine(ctx context.Context, pg *pgtmp.Server) map[string]string {
	m := map[string]string{"cpus": fmt.Sprint(runtime.NumCPU()), "go": runtime.Version(), "os": runtime.GOOS + "/" + runtime.GOARCH}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				m["cpu"] = strings.TrimSpace(strings.SplitN(l, ":", 2)[1])
				break
			}
		}
	}
	if conn, err := pgx.Connect(ctx, pg.DSN("postgres")); err == nil {
		var v string
		_ = conn.QueryRow(ctx, "SHOW server_version").Scan(&v)
		m["postgres"] = v
		conn.Close(ctx)
	}
	return m
}

// pgStatStatementsInstalled reports whether the server binaries come with
// pg_stat_statements (Debian's postgresql package does), which must be
// preloaded for statements to be counted.
func pgStatStatementsInstalled() bool {
	bin, err := pgtmp.FindBinaries()
	if err != nil {
		return false
	}
	_, err = os.Stat(filepath.Join(bin, "..", "lib", "pg_stat_statements.so"))
	return err == nil
}

func createExtension(ctx context.Context, dsn, name string) error {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return fmt.Errorf("connecting to create extension %s: %w", name, err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("creating extension %s: %w", name, err)
	}
	return nil
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func printTable(w io.Writer, rep *Report) {
	fmt.Fprintln(w, "\n| measurement | result |\n| --- | --- |")
	for _, r := range rep.Ratios {
		var ours, theirs, enqOurs, enqTheirs []float64
		for _, t := range rep.Throughput {
			if t.Processes != r.Processes {
				continue
			}
			if t.System == "shardrun" {
				ours, enqOurs = append(ours, t.TasksPerS), append(enqOurs, t.EnqueuePerS)
			} else {
				theirs, enqTheirs = append(theirs, t.TasksPerS), append(enqTheirs, t.EnqueuePerS)
			}
		}
		fmt.Fprintf(w, "| throughput, %d process(es), %d noop tasks | shardrun %.0f tasks/s, River %.0f jobs/s (medians); ratio median **%.2f** (per trial %s) |\n",
			r.Processes, rep.Throughput[0].Tasks, median(ours), median(theirs), r.Median, fmtList(r.PerTrial))
		fmt.Fprintf(w, "| enqueue (COPY), %d process(es) trials | shardrun %.0f rows/s, River %.0f rows/s (medians) |\n",
			r.Processes, median(enqOurs), median(enqTheirs))
		fmt.Fprintf(w, "| CPU seconds per 10,000 tasks (workers + PostgreSQL), %d process(es) | shardrun %s, River %s (medians) |\n",
			r.Processes, cpuCell(rep.Throughput, "shardrun", r.Processes), cpuCell(rep.Throughput, "river", r.Processes))
		fmt.Fprintf(w, "| PostgreSQL per task, %d process(es): statements, pages, pages per claimed task, WAL bytes | shardrun %s; River %s (medians) |\n",
			r.Processes, pgCell(rep.Throughput, "shardrun", r.Processes), pgCell(rep.Throughput, "river", r.Processes))
	}
	if f := rep.Features; f != nil {
		printFeatures(w, f)
	}
	printSteady(w, rep.Steady)
	printWakeup(w, rep.Wakeup)
	for _, l := range rep.Failover {
		fmt.Fprintf(w, "| kill -9, lease TTL %s: %s | p50 %.2fs, max %.2fs over %d trials |\n", l.LeaseTTL, l.What, l.P50, l.Max, len(l.Trials))
	}
	if o := rep.Outage; o != nil {
		printOutage(w, o)
	}
	if h := rep.Handoff; h != nil {
		fmt.Fprintf(w, "| graceful handoff: %s | p50 %.3fs, max %.3fs over %d trials |\n", h.What, h.P50, h.Max, len(h.Trials))
	}
	if len(rep.Detach) > 0 {
		var dl, ex, tk []float64
		ok := true
		for _, d := range rep.Detach {
			dl, ex, tk = append(dl, d.BeforeDeadlineS), append(ex, d.BeforeExpiryS), append(tk, d.BeforeTakeoverS)
			ok = ok && d.DetachBeforeTakeOK
		}
		fmt.Fprintf(w, "| detach margin, blackholed etcd link, TTL 2s | detached %ss before its lease deadline, %ss before etcd expired the lease, %ss before the first takeover; strictly before in every trial: %v |\n",
			fmtList(dl), fmtList(ex), fmtList(tk), ok)
	}
	for _, sw := range rep.Sweep {
		fmt.Fprintf(w, "| sweep pass, %d rows with 1,000 stale claims | median %.1f ms (%s) |\n", sw.Rows, sw.MedianMS, fmtList(sw.PassMS))
	}
	if in := rep.Inspect; in != nil {
		for _, q := range in.Queries {
			fmt.Fprintf(w, "| list at %s rows: %s (%d tasks) | p50 %.2f ms, max %.2f ms |\n", fmtRows(in.Rows), q.Name, q.Returned, q.P50MS, q.MaxMS)
		}
		fmt.Fprintf(w, "| count by state at %s rows | full %.0f ms, capped at %d per state %.1f ms |\n", fmtRows(in.Rows), in.CountFullMS, in.CountCap, in.CountCappedMS)
		fmt.Fprintf(w, "| bulk cancel, bulk retry at %s rows | %d tasks in %.1fs (%.0f/s), %d in %.1fs (%.0f/s) |\n", fmtRows(in.Rows),
			in.BulkCancel.Tasks, in.BulkCancel.S, in.BulkCancel.PerS, in.BulkRetry.Tasks, in.BulkRetry.S, in.BulkRetry.PerS)
		var builds []string
		for name, s := range in.IndexBuildS {
			builds = append(builds, fmt.Sprintf("%s %.1fs", name, s))
		}
		slices.Sort(builds)
		fmt.Fprintf(w, "| index builds at %s rows | %s |\n", fmtRows(in.Rows), strings.Join(builds, ", "))
	}
	if en := rep.Enqueue; en != nil {
		var names []string
		for name := range en.Median {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			fmt.Fprintf(w, "| enqueue: %s | %.0f rows/s (median of %s) |\n", name, en.Median[name], fmtList(en.PerS[name]))
		}
	}
	if u := rep.Unclaimable; u != nil {
		for _, v := range u.Variants {
			fmt.Fprintf(w, "| noop throughput, %d processes, %d tasks, with %d ready tasks of a kind nobody handles, %s | %.0f tasks/s with, %.0f without (medians); ratio median **%.2f** (%s)",
				u.Processes, u.Tasks, u.Unhandled, v.Name, median(v.With), median(v.Without), v.MedianRatio, fmtList(v.Ratios))
			if len(v.IdleCPUPctWith) > 0 {
				fmt.Fprintf(w, "; idle PostgreSQL CPU %.1f%% of a core with, %.1f%% without (medians)", median(v.IdleCPUPctWith), median(v.IdleCPUPctWithout))
			}
			fmt.Fprintln(w, " |")
		}
	}
	if r := rep.Retention; r != nil {
		fmt.Fprintf(w, "| retention: %d finished rows deleted while %d tasks/s run | %.0f rows/s (%.0fs, %d statements of %d); pickup latency p99 %.1f ms before, %.1f ms during (p50 %.1f, %.1f); claim statement mean %.2f ms before, %.2f ms during |\n",
			r.Rows, r.SteadyRate, r.DeletePerS, r.DeleteSeconds, r.Statements, r.BatchSize, r.BeforeP99MS, r.DuringP99MS, r.BeforeP50MS, r.DuringP50MS, r.ClaimMeanMSBefore, r.ClaimMeanMSDuring)
	}
	for _, c := range rep.Churn {
		fmt.Fprintf(w, "| tasks table after a churn of %d tasks at %d/s, %s | %d rows, table %.1f MiB, indexes %.1f MiB (ready index %.0f KiB), %d autovacuums |\n",
			c.Tasks, c.Rate, c.Variant, c.LiveRows, c.TableMiB, c.IndexesMiB, c.ReadyIdxKiB, c.Autovacuums)
	}
	if n := rep.Notify; n != nil {
		printNotify(w, n)
	}
	if len(rep.Idle) > 0 {
		printIdle(w, rep.Idle)
	}
	if len(rep.IdleFleets) > 0 {
		printIdleFleets(w, rep.IdleFleets)
	}
	if sc := rep.Scale; sc != nil {
		printScale(w, sc)
	}
	if s := rep.Startup; s != nil {
		printStartup(w, s)
	}
	if m := rep.Mixed; m != nil {
		printMixed(w, m)
	}
	if d := rep.Databases; d != nil {
		printDatabases(w, d)
	}
	if c := rep.Curve; c != nil {
		printCurve(w, c)
	}
	if r := rep.Work; r != nil {
		printWork(w, r)
	}
	if t, ok := rep.SectionSeconds["total"]; ok {
		fmt.Fprintf(w, "| bench time | %.0f s in all (%s) |\n", t, sectionTimes(rep.SectionSeconds))
	}
	if c := rep.Cost; c != nil {
		fmt.Fprintf(w, "| etcd messages/s per runner at steady state | 256 shards: %.2f, 4,096 shards: %.2f |\n", c.EtcdMsgsPerRunnerPerS["256"], c.EtcdMsgsPerRunnerPerS["4096"])
		fmt.Fprintf(w, "| RSS per runner | idle %.0f MiB, under load %.0f MiB |\n", c.IdleRSSMiB, c.LoadRSSMiB)
		if c.StmtsPerTask["shardrun"] > 0 {
			fmt.Fprintf(w, "| PostgreSQL statements per completed task | shardrun %.4f, River %.4f |\n", c.StmtsPerTask["shardrun"], c.StmtsPerTask["river"])
		}
		fmt.Fprintf(w, "| PostgreSQL transactions per completed task | shardrun %.4f, River %.4f |\n", c.XactsPerTask["shardrun"], c.XactsPerTask["river"])
	}
}

// cpuCell is "workers + postgres = total" CPU seconds per 10,000 tasks,
// medians over a system's trials at a process count.
func cpuCell(runs []burnDown, system string, procs int) string {
	var w, p, t []float64
	for _, r := range runs {
		if r.System == system && r.Processes == procs {
			w, p, t = append(w, r.CPUWorkersPer10k), append(p, r.CPUPostgresPer10k), append(t, r.CPUTotalPer10k)
		}
	}
	return fmt.Sprintf("%.2f + %.2f = %.2f", median(w), median(p), median(t))
}

// pgCell is a system's statements, pages, pages per claimed task and WAL
// bytes per task, medians over its trials at a process count.
func pgCell(runs []burnDown, system string, procs int) string {
	var st, pg, pc, wal []float64
	for _, r := range runs {
		if r.System == system && r.Processes == procs {
			st, pg, pc, wal = append(st, r.StmtsPerTask), append(pg, r.PagesPerTask), append(pc, r.PagesPerClaimedTask), append(wal, r.WALBytesPerTask)
		}
	}
	return fmt.Sprintf("%.4f, %.1f, %.1f, %.0f", median(st), median(pg), median(pc), median(wal))
}

// fmtThousands writes n with thousands separators: 10000 as 10,000.
func fmtThousands(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

func fmtRows(n int) string {
	if n >= 1_000_000 {
		return fmt.Sprintf("%dM", n/1_000_000)
	}
	return fmt.Sprint(n)
}

func fmtList(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.2f", x)
	}
	return strings.Join(parts, ", ")
}

// maintOpts are the flags of the maintenance sections.
type maintOpts struct {
	retentionRows, steadyRate, churnTasks, churnRate int
}

var maint maintOpts

func sectionTimes(m map[string]float64) string {
	var parts []string
	for _, name := range []string{"throughput", "features", "curve", "work", "failover", "handoff", "detach", "sweep", "inspect", "enqueue", "cost", "unclaimable", "retention", "churn", "steady", "wakeup", "notify", "scale", "startup", "mixed", "tracing", "idle", "outage", "databases"} {
		if v, ok := m[name]; ok {
			parts = append(parts, fmt.Sprintf("%s %.0f s", name, v))
		}
	}
	return strings.Join(parts, ", ")
}
