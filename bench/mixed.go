package main

// The mixed section (issue 31): fleets whose runners fall into several
// capability groups (queues served × kinds handled), each group owning all
// the cluster's shards on its own. It measures what that costs against a
// uniform fleet of as many runners (one group), and the throughput of one
// queue as runners of that queue are added.

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// mixedOpts are the mixed section's flags.
type mixedOpts struct {
	runners, shards, queues, kinds int
	// maxWorkers is --max-workers of the runners of the cost fleets.
	maxWorkers int
	// idleSeconds is the window etcd's messages are counted over, idle.
	idleSeconds int
	// pagesTasks is the burn-down each cost fleet runs at the end, for
	// the pages its claims read per claimed task.
	pagesTasks int
	// tpRunners are the runner counts of the throughput trials' queue;
	// tpWorkers their --max-workers; tpTasksPerRunner the queue's tasks
	// per runner of it; tpSleepMS each task's sleep.
	tpRunners        string
	tpWorkers        int
	tpTasksPerRunner int
	tpSleepMS        int
	// tpShards is the throughput trials' shard count; 0: shards.
	tpShards int
}

var mixedFlags = mixedOpts{runners: 16, shards: 4096, queues: 4, kinds: 20, maxWorkers: 64, idleSeconds: 10, pagesTasks: 20_000,
	tpRunners: "1,2,4", tpWorkers: 16, tpTasksPerRunner: 2_000, tpSleepMS: 20}

// mixedDBConns is each runner's --db-max-conns: 17 runners at 4 stay well
// inside the server's max_connections of 300.
const mixedDBConns = 4

// mixedSideRunners serve the throughput trials' side queue.
const mixedSideRunners = 2

// mixedSideBacklog is how many seconds of the side runners' ideal rate
// the side queue's backlog holds: a trial whose measured queue takes
// longer than that (a quarter of it when the machine is 4x slower than
// ideal) reports its side load as not held.
const mixedSideBacklog = 30

// Targets of issue 31, point 5.
const (
	mixedColdTarget   = 2.0 // seconds, cold start to every unit owned
	mixedChangeTarget = 1.0 // seconds, a join or a leave
	mixedCostTarget   = 2.0 // mixed ÷ uniform, keys and etcd messages/s
	// mixedPagesTarget is the bench's reading of "pages per claimed task
	// stay flat": the mixed fleet's within 25% of the uniform fleet's.
	mixedPagesTarget = 1.25
)

// capSet is a capability set: runners that serve the same queues and
// handle the same kinds, which makes them one capability group.
type capSet struct {
	Name    string   `json:"name"`
	Runners int      `json:"runners"`
	Queues  []string `json:"queues"`
	Kinds   []string `json:"kinds"`
	// Group is shard.GroupOf(Queues, Kinds).
	Group string `json:"group"`
}

func queueName(i int) string { return "q" + strconv.Itoa(i) }

func queueNames(n int) []string {
	var out []string
	for i := range n {
		out = append(out, queueName(i))
	}
	return out
}

func newCapSet(name string, runners int, queues, kinds []string) capSet {
	return capSet{Name: name, Runners: runners, Queues: queues, Kinds: kinds, Group: shard.GroupOf(queues, kinds)}
}

// ids are the set's runner ids: <name>-1, <name>-2...
func (s capSet) ids() []string {
	var out []string
	for i := 1; i <= s.Runners; i++ {
		out = append(out, fmt.Sprintf("%s-%d", s.Name, i))
	}
	return out
}

// opts are the runner options of the set's runners.
func (s capSet) opts(o mixedOpts, maxWorkers int) runnerOpts {
	return runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: maxWorkers, dbMaxConns: mixedDBConns,
		queues: strings.Join(s.Queues, ","), kindCount: o.kinds, kinds: s.Kinds}
}

// describe is "general ×4: q0,q1,q2,q3 / k00-k18".
func (s capSet) describe() string {
	kinds := strings.Join(s.Kinds, ",")
	if n := len(s.Kinds); n > 2 && s.Kinds[n-1] == benchKind(kindIndex(s.Kinds[0])+n-1) {
		kinds = s.Kinds[0] + "-" + s.Kinds[n-1]
	}
	return fmt.Sprintf("%s ×%d: %s / %s", s.Name, s.Runners, strings.Join(s.Queues, ","), kinds)
}

func kindIndex(k string) int {
	i, _ := strconv.Atoi(strings.TrimPrefix(k, "k"))
	return i
}

// uniformSets is the uniform fleet: n runners serving every queue and
// handling every kind, one group.
func uniformSets(o mixedOpts) []capSet {
	return []capSet{newCapSet("uniform", o.runners, queueNames(o.queues), benchKinds(0, o.kinds))}
}

// mixedSets is the mixed fleet, the example at 16 runners, 4
// queues and 20 kinds: 4 general runners (every queue, every kind but the
// last), 4 emails runners (q1, k00-k04), 2 gpu runners (q0, the last kind
// alone), 3 reports runners (q2, k10-k14) and 3 rollout runners (q0 and the
// last queue, every kind). Other counts scale the same shares.
func mixedSets(o mixedOpts) ([]capSet, error) {
	n, q, k := o.runners, o.queues, o.kinds
	if n < 10 || q < 3 || k < 8 {
		return nil, fmt.Errorf("the mixed fleet needs at least 10 runners, 3 queues and 8 kinds (-mixed-runners %d, -mixed-queues %d, -mixed-kinds %d)", n, q, k)
	}
	general, emails, gpu, reports := n/4, n/4, n/8, 3*n/16
	return []capSet{
		newCapSet("general", general, queueNames(q), benchKinds(0, k-1)),
		newCapSet("emails", emails, []string{queueName(1)}, benchKinds(0, k/4)),
		newCapSet("gpu", gpu, []string{queueName(0)}, []string{benchKind(k - 1)}),
		newCapSet("reports", reports, []string{queueName(2)}, benchKinds(k/2, k/2+k/4)),
		newCapSet("rollout", n-general-emails-gpu-reports, []string{queueName(0), queueName(q - 1)}, benchKinds(0, k)),
	}, nil
}

// runnableClasses are the (queue, kind) pairs some set can run, sorted.
func runnableClasses(sets []capSet) []tasks.Class {
	seen := map[tasks.Class]bool{}
	for _, s := range sets {
		for _, q := range s.Queues {
			for _, k := range s.Kinds {
				seen[tasks.Class{Queue: q, Kind: k}] = true
			}
		}
	}
	return slices.SortedFunc(maps.Keys(seen), func(a, b tasks.Class) int {
		return strings.Compare(a.Queue+"/"+a.Kind, b.Queue+"/"+b.Kind)
	})
}

// mixedPhase is one membership change of a fleet.
type mixedPhase struct {
	What string `json:"what"`
	// Seconds from the change (first spawn, spawn, SIGTERM) to the receipt
	// of the owner key event that made every group converged.
	Seconds float64 `json:"converged_s"`
	// Target is the bound on Seconds, and WithinTarget whether
	// Seconds kept to it.
	Target       float64 `json:"target_s"`
	WithinTarget bool    `json:"within_target"`
	// ReadyS: cold start only, until every runner's /readyz said ready.
	ReadyS float64 `json:"all_ready_s,omitempty"`
	// OwnedS: leave only, until every unit of the leaver was owned by
	// another member of its group (not yet necessarily converged).
	OwnedS float64 `json:"leaver_units_owned_elsewhere_s,omitempty"`
	// Group is the set joined or left.
	Group string `json:"set,omitempty"`
	// Moved: the group's units whose owner differs between before and
	// after; MoveBound the assignment's bound on it (shard.Assign).
	Moved     int `json:"units_moved"`
	MoveBound int `json:"move_bound,omitempty"`
	// MovedElsewhere: units of the other groups that changed hands (0
	// expected: a group's membership is its own).
	MovedElsewhere int `json:"units_moved_in_other_groups"`
	// OwnerKeyWrites are puts and deletes of owner keys (one write moves
	// any number of a runner's units); RunnerKeyWrites puts of runners/.
	OwnerKeyWrites  int `json:"owner_key_writes"`
	RunnerKeyWrites int `json:"runner_key_writes"`
	// EtcdMessages: gRPC messages etcd received from the change to the end
	// of the stability check.
	EtcdMessages float64 `json:"etcd_messages_received"`
}

// groupShare is a group's balance at a convergence.
type groupShare struct {
	Set      string `json:"set"`
	Group    string `json:"group"`
	Members  int    `json:"members"`
	MinUnits int    `json:"min_units_per_member"`
	MaxUnits int    `json:"max_units_per_member"`
}

// etcdKeys counts the keys under the cluster's prefix.
type etcdKeys struct {
	Total   int64 `json:"total"`
	Runners int64 `json:"runners"`
	Owners  int64 `json:"owners"`
	Meta    int64 `json:"meta"`
	Other   int64 `json:"other"`
	// Bytes of every key and value; OwnerValueBytes those of the owner
	// keys' values (each lists the runner's units and their epochs).
	Bytes           int64 `json:"key_and_value_bytes"`
	OwnerValueBytes int64 `json:"owner_value_bytes"`
}

// idleCost is a converged fleet's cost over a window with no work.
type idleCost struct {
	Seconds           float64 `json:"window_s"`
	Messages          float64 `json:"etcd_messages_received"`
	MsgsPerS          float64 `json:"etcd_messages_per_s"`
	MsgsPerRunnerPerS float64 `json:"etcd_messages_per_s_per_runner"`
	// OwnerKeyWrites in the window (0 expected: nothing should move).
	OwnerKeyWrites  int `json:"owner_key_writes"`
	RunnerKeyWrites int `json:"runner_key_writes"`
	// RunnerCPUPct is each runner's CPU in the window, in percent of a
	// core (mean; process_cpu_seconds_total).
	RunnerCPUPct float64 `json:"runner_cpu_pct_of_a_core"`
	// What the idle runners cost PostgreSQL: statements, pages (shared
	// blocks hit and read) and those of the claim statements, per second
	// (pg_stat_statements; 0 without it), and the server's CPU in percent
	// of a core (pgCPU).
	PGStatementsPerS float64 `json:"pg_statements_per_s"`
	PGPagesPerS      float64 `json:"pg_pages_per_s"`
	ClaimPagesPerS   float64 `json:"pg_claim_pages_per_s"`
	PostgresCPUPct   float64 `json:"postgres_cpu_pct_of_a_core"`
}

// mixedFleet is one fleet's cost figures.
type mixedFleet struct {
	Fleet string     `json:"fleet"`
	Sets  []capSet   `json:"capability_sets"`
	Cold  mixedPhase `json:"cold_start"`
	// ColdCPU is where the machine's CPU went from the first spawn to the
	// end of the cold start's stability check; IdleCPU in the idle window.
	ColdCPU cpuShares    `json:"cold_start_cpu_pct_of_a_core"`
	IdleCPU cpuShares    `json:"idle_cpu_pct_of_a_core"`
	Groups  []groupShare `json:"groups_after_cold_start"`
	Keys    etcdKeys     `json:"etcd_keys_after_cold_start"`
	Idle    idleCost     `json:"idle"`
	Join    mixedPhase   `json:"join"`
	Leave   mixedPhase   `json:"leave"`
	Classes int          `json:"burn_down_classes"`
	// BurnDown is noop tasks spread over Classes (queue, kind) pairs,
	// burnt down by the fleet after the leave: its claim pages per claimed
	// task.
	BurnDown      *burnDown  `json:"burn_down,omitempty"`
	TopStatements []stmtStat `json:"burn_down_top_statements,omitempty"`
}

// queueTrial is one throughput trial: the queue's runners, a side load.
type queueTrial struct {
	Runners int `json:"queue_runners"`
	Tasks   int `json:"queue_tasks"`
	// TasksPerS: the queue's tasks over first claim to last completion.
	TasksPerS float64 `json:"queue_tasks_per_s"`
	Seconds   float64 `json:"queue_burn_down_s"`
	// Ideal is runners × workers × 1000/sleep ms; Efficiency TasksPerS
	// over it.
	Ideal      float64 `json:"queue_ideal_tasks_per_s"`
	Efficiency float64 `json:"queue_efficiency"`
	// SideTasksPerS: the side queue's completions within the queue's
	// burn-down window, per second of it.
	SideTasksPerS    float64 `json:"side_tasks_per_s_in_window"`
	SideIdeal        float64 `json:"side_ideal_tasks_per_s"`
	SideEfficiency   float64 `json:"side_efficiency"`
	SideBacklog      int     `json:"side_backlog_tasks"`
	SideHeld         bool    `json:"side_backlog_left_at_end"`
	ConvergedS       float64 `json:"fleet_converged_s"`
	ClaimPagesPerTsk float64 `json:"claim_pages_per_claimed_task,omitempty"`
	// CPU is where the machine's CPU went from the enqueue to the end of
	// the queue's burn-down; PGCPUMsPerTask is PostgreSQL's over the tasks
	// of both queues completed by the end of the queue's burn-down.
	CPU            cpuShares `json:"cpu_pct_of_a_core"`
	PGCPUMsPerTask float64   `json:"postgres_cpu_ms_per_task"`
	// TopStatements took the most database time in the trial.
	TopStatements []stmtStat `json:"top_statements,omitempty"`
}

// cpuShares is where the machine's CPU went over a window, each in percent
// of one core: the trial's runners (their process_cpu_seconds_total),
// PostgreSQL (pgCPU), the bench process (the embedded etcd included), the
// whole machine (/proc/stat), and what is left of it: other processes,
// which share the cores with the measurement.
type cpuShares struct {
	Seconds  float64 `json:"window_s"`
	Runners  float64 `json:"runners"`
	Postgres float64 `json:"postgres"`
	Bench    float64 `json:"bench_and_etcd"`
	Machine  float64 `json:"machine"`
	Other    float64 `json:"other_processes"`
}

// cpuWindow measures cpuShares from its start to done.
type cpuWindow struct {
	start          time.Time
	runners, bench float64
	machine        float64
	pg             *pgCPU
	c              *cluster
}

func (e *env) startCPUWindow(ctx context.Context, c *cluster) (*cpuWindow, error) {
	postmaster, err := e.postmasterPID(ctx)
	if err != nil {
		return nil, err
	}
	w := &cpuWindow{c: c, runners: c.sumMetric("process_cpu_seconds_total"), pg: startPGCPU(postmaster)}
	if w.machine, err = machineBusy(); err != nil {
		w.pg.stop()
		return nil, err
	}
	self, err := readProcStat(os.Getpid())
	if err != nil {
		w.pg.stop()
		return nil, err
	}
	w.bench, w.start = self.cpu, time.Now()
	return w, nil
}

// done ends the window; the runners must still be running.
func (w *cpuWindow) done() (cpuShares, error) {
	pg := w.pg.stop()
	runners := w.c.sumMetric("process_cpu_seconds_total")
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
	s := cpuShares{Seconds: secs, Runners: (runners - w.runners) * pct, Postgres: pg * pct, Bench: (self.cpu - w.bench) * pct, Machine: (machine - w.machine) * pct}
	s.Other = max(0, s.Machine-s.Runners-s.Postgres-s.Bench)
	return s, nil
}

// machineBusy is the CPU seconds the machine's cores have been busy since
// boot (/proc/stat: all but idle and iowait).
func machineBusy() (float64, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("reading /proc/stat: %w", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var busy uint64
	for i, v := range f[1:] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/stat: %w", err)
		}
		if i != 3 && i != 4 && i < 8 { // idle, iowait; guest time is in user already
			busy += n
		}
	}
	return float64(busy) / clockTicks, nil
}

// queueScaling is the throughput part: a queue's throughput as its
// runners are added, beside a side queue kept busy by its own runners.
type queueScaling struct {
	Queue       string       `json:"queue"`
	Shards      int          `json:"shards"`
	Set         capSet       `json:"queue_set"`
	Side        capSet       `json:"side_set"`
	SideQueue   string       `json:"side_queue"`
	MaxWorkers  int          `json:"max_workers_per_runner"`
	SleepMS     int          `json:"task_sleep_ms"`
	TasksPerRun int          `json:"queue_tasks_per_runner"`
	Trials      []queueTrial `json:"trials"`
}

// mixedResult is the mixed section's report.
type mixedResult struct {
	Runners     int    `json:"runners"`
	Shards      int    `json:"shards"`
	Queues      int    `json:"queues"`
	Kinds       int    `json:"kinds"`
	LeaseTTL    string `json:"lease_ttl"`
	MaxWorkers  int    `json:"max_workers_per_runner"`
	DBMaxConns  int    `json:"db_max_conns_per_runner"`
	Convergence string `json:"convergence_means"`
	// Uniform is one group of every queue and kind; Mixed the capability
	// sets of mixedSets.
	Uniform *mixedFleet `json:"uniform"`
	Mixed   *mixedFleet `json:"mixed"`
	// Ratios mixed ÷ uniform.
	KeysRatio      float64       `json:"keys_ratio_mixed_over_uniform"`
	KeyBytesRatio  float64       `json:"key_bytes_ratio_mixed_over_uniform"`
	MsgsRatio      float64       `json:"etcd_msgs_per_s_ratio_mixed_over_uniform"`
	PagesRatio     float64       `json:"claim_pages_per_claimed_task_ratio_mixed_over_uniform"`
	IdlePagesRatio float64       `json:"idle_pg_pages_per_s_ratio_mixed_over_uniform"`
	Throughput     *queueScaling `json:"throughput_per_queue,omitempty"`
	Notes          []string      `json:"notes"`
}

// mixedSection measures a mixed fleet against a uniform one of as many
// runners over as many shards (cold start, keys, idle etcd messages, a
// join, a leave, the claims' pages in a burn-down), then the throughput of
// one queue as runners of it are added beside a busy side queue.
func (e *env) mixedSection(ctx context.Context, rep *Report) error {
	o := mixedFlags
	sets, err := mixedSets(o)
	if err != nil {
		return err
	}
	res := &mixedResult{Runners: o.runners, Shards: o.shards, Queues: o.queues, Kinds: o.kinds, LeaseTTL: "10s",
		MaxWorkers: o.maxWorkers, DBMaxConns: mixedDBConns,
		Convergence: "in every capability group, every shard owned by a member of the group and shard.Assign(members, owners) == owners " +
			"(a fixed point of the runners' own assignment, so balanced to ±1); timed to the receipt of the owner key event that completed " +
			"it (one etcd watch on the prefix through shard.History), then checked to stay unchanged for 1s"}
	res.Notes = []string{
		"runners are child processes of the bench binary (-runner-child): the runner library as cmd/runner builds it, with the built-ins and " +
			"kinds k00..k" + fmt.Sprintf("%02d", o.kinds-1) + " (each the built-in sleep handler: empty payload = noop, {\"ms\":N} sleeps), " +
			"narrowed by runner.Config.Kinds to the set's kinds; queues by runner.Config.Queues (no limit: --max-workers)",
		"uniform fleet: every runner serves every queue and handles every kind (one group); mixed fleet: the capability sets listed, one group each",
		fmt.Sprintf("keys: one count and one read of the prefix after the cold start converged; etcd messages: embedetcd.MessagesReceived (every gRPC "+
			"message the embedded etcd received, the bench's own included: one watch, which sends nothing while idle) over %ds with no work, "+
			"after convergence", o.idleSeconds),
		"join: one more runner of the set named, from its spawn; leave: SIGTERM to the set's first runner, from the signal; bounds from shard.Assign: " +
			"⌈S/(n+1)⌉+n for a join to n members, the leaver's units plus one per remaining member for a leave",
		"burn-down: noop tasks spread evenly over every (queue, kind) pair some set of the mixed fleet can run (the same tasks for both fleets), " +
			"enqueued in one transaction once the fleet converged after the leave; claim pages per claimed task are those of the " +
			"/* shardrun.claim */ statements (idle polls included) over the rows they returned (pg_stat_statements)",
	}
	rep.Mixed = res
	uniform := &mixedFleet{Fleet: "uniform", Sets: uniformSets(o)}
	res.Uniform = uniform
	if err := e.fleetCost(ctx, uniform, o, "uniform"); err != nil {
		return fmt.Errorf("uniform fleet: %w", err)
	}
	mixed := &mixedFleet{Fleet: "mixed", Sets: sets}
	res.Mixed = mixed
	if err := e.fleetCost(ctx, mixed, o, "general"); err != nil {
		return fmt.Errorf("mixed fleet: %w", err)
	}
	res.KeysRatio = ratioOf(float64(mixed.Keys.Total), float64(uniform.Keys.Total))
	res.KeyBytesRatio = ratioOf(float64(mixed.Keys.Bytes), float64(uniform.Keys.Bytes))
	res.MsgsRatio = ratioOf(mixed.Idle.MsgsPerS, uniform.Idle.MsgsPerS)
	res.IdlePagesRatio = ratioOf(mixed.Idle.PGPagesPerS, uniform.Idle.PGPagesPerS)
	if uniform.BurnDown != nil && mixed.BurnDown != nil {
		res.PagesRatio = ratioOf(mixed.BurnDown.PagesPerClaimedTask, uniform.BurnDown.PagesPerClaimedTask)
	}
	fmt.Fprintf(e.log, "  mixed ÷ uniform: keys %.2f, key bytes %.2f, etcd messages/s %.2f, idle PostgreSQL pages/s %.2f, claim pages per claimed task %.2f\n",
		res.KeysRatio, res.KeyBytesRatio, res.MsgsRatio, res.IdlePagesRatio, res.PagesRatio)
	if !e.statStatements {
		res.Notes = append(res.Notes, "pg_stat_statements is not loaded: claim pages per claimed task not measured")
	}
	return e.queueScalingRun(ctx, res, sets, o)
}

func ratioOf(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// fleetCost starts f's fleet at once on a fresh prefix and database and
// measures its cold start, keys, idle cost, a join to and a leave from set
// change, and a burn-down's claim pages.
func (e *env) fleetCost(ctx context.Context, f *mixedFleet, o mixedOpts, change string) (err error) {
	fmt.Fprintf(e.log, "  %s fleet: %s\n", f.Fleet, describeSets(f.Sets))
	st, dsn, drop, err := e.trialStore(ctx, "mixed_"+f.Fleet, 4)
	if err != nil {
		return err
	}
	defer func() {
		if derr := drop(); err == nil {
			err = derr
		}
	}()
	c := e.newCluster(fmt.Sprintf("mixed-%s-%d", f.Fleet, time.Now().UnixNano()), dsn, o.shards)
	defer c.stop()
	w, err := c.watchGroups(ctx)
	if err != nil {
		return err
	}
	defer w.stop()
	want := map[string][]string{}
	setOf := map[string]capSet{}
	for _, s := range f.Sets {
		want[s.Group] = s.ids()
		setOf[s.Name] = s
	}

	// (a) Cold start: every runner spawned at once.
	cpu, err := e.startCPUWindow(ctx, c)
	if err != nil {
		return err
	}
	mark := w.mark()
	start := time.Now()
	for _, s := range f.Sets {
		for _, id := range s.ids() {
			if _, err := c.spawn(id, s.opts(o, o.maxWorkers)); err != nil {
				return err
			}
		}
	}
	for _, r := range c.runners {
		if err := r.waitReady(); err != nil {
			_, _ = cpu.done()
			return err
		}
	}
	f.Cold.ReadyS = time.Since(start).Seconds()
	if err := w.checkPublished(f.Sets); err != nil {
		_, _ = cpu.done()
		return err
	}
	if err := c.convergeGroups(w, mark, start, want, &f.Cold); err != nil {
		_, _ = cpu.done()
		return fmt.Errorf("cold start: %w", err)
	}
	if f.ColdCPU, err = cpu.done(); err != nil {
		return err
	}
	f.Cold.What = fmt.Sprintf("cold start, %d runners in %d group(s) spawned at once, from the first spawn", o.runners, len(f.Sets))
	f.Cold.Target = mixedColdTarget
	f.Cold.WithinTarget = f.Cold.Seconds <= mixedColdTarget
	f.Cold.Moved = o.shards * len(f.Sets)
	f.Cold.MoveBound = f.Cold.Moved
	f.Groups = w.shares(f.Sets, want)
	e.logMixedPhase(f.Cold)
	fmt.Fprintf(e.log, "    cold start CPU, %% of a core: runners %.0f, PostgreSQL %.0f, bench+etcd %.0f, other processes %.0f (machine %.0f of %d)\n",
		f.ColdCPU.Runners, f.ColdCPU.Postgres, f.ColdCPU.Bench, f.ColdCPU.Other, f.ColdCPU.Machine, 100*runtime.NumCPU())

	// (b) Keys and the idle cost.
	if f.Keys, err = c.countKeys(ctx); err != nil {
		return err
	}
	fmt.Fprintf(e.log, "    etcd keys: %d (runners %d, owners %d, meta %d, other %d), %d bytes of keys and values (owner values %d)\n",
		f.Keys.Total, f.Keys.Runners, f.Keys.Owners, f.Keys.Meta, f.Keys.Other, f.Keys.Bytes, f.Keys.OwnerValueBytes)
	if cpu, err = e.startCPUWindow(ctx, c); err != nil {
		return err
	}
	f.Idle, err = e.idle(ctx, c, st, w, time.Duration(o.idleSeconds)*time.Second)
	if cpu, cerr := cpu.done(); err == nil {
		f.IdleCPU, err = cpu, cerr
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(e.log, "    idle %.0fs: %.1f etcd messages/s (%.2f per runner), %d owner key writes, %d runner key writes, runner CPU %.1f%% of a core each; "+
		"PostgreSQL %.0f statements/s, %.0f pages/s (claims %.0f), CPU %.0f%% of a core\n",
		f.Idle.Seconds, f.Idle.MsgsPerS, f.Idle.MsgsPerRunnerPerS, f.Idle.OwnerKeyWrites, f.Idle.RunnerKeyWrites, f.Idle.RunnerCPUPct,
		f.Idle.PGStatementsPerS, f.Idle.PGPagesPerS, f.Idle.ClaimPagesPerS, f.Idle.PostgresCPUPct)
	fmt.Fprintf(e.log, "    idle CPU, %% of a core: other processes %.0f (machine %.0f of %d)\n", f.IdleCPU.Other, f.IdleCPU.Machine, 100*runtime.NumCPU())

	// (c) One more runner of the changed set joins.
	set := setOf[change]
	before := w.snapshot()
	members := len(want[set.Group])
	joiner := fmt.Sprintf("%s-%d", set.Name, set.Runners+1)
	want[set.Group] = append(want[set.Group], joiner)
	mark = w.mark()
	start = time.Now()
	if _, err := c.start(joiner, set.opts(o, o.maxWorkers)); err != nil {
		return err
	}
	if err := c.convergeGroups(w, mark, start, want, &f.Join); err != nil {
		return fmt.Errorf("join: %w", err)
	}
	f.Join.What = fmt.Sprintf("a %s runner joins its %d, from its spawn", set.Name, members)
	f.Join.Group, f.Join.Target = set.Name, mixedChangeTarget
	f.Join.WithinTarget = f.Join.Seconds <= mixedChangeTarget
	f.Join.Moved, f.Join.MovedElsewhere = movedUnits(before, w.snapshot(), set.Group)
	f.Join.MoveBound = (o.shards+members)/(members+1) + members // ⌈S/(n+1)⌉ + n
	e.logMixedPhase(f.Join)

	// (d) The set's first runner leaves (SIGTERM).
	leaver := c.runner(set.ids()[0])
	want[set.Group] = slices.DeleteFunc(slices.Clone(want[set.Group]), func(id string) bool { return id == leaver.id })
	before = w.snapshot()
	var units []int
	for s, id := range before[set.Group] {
		if id == leaver.id {
			units = append(units, s)
		}
	}
	mark = w.mark()
	start = time.Now()
	_ = leaver.cmd.Process.Signal(syscall.SIGTERM)
	var owned time.Time
	if err := waitUntil(scaleConvergeTimeout, func() bool {
		now, changed := w.group(set.Group)
		for _, s := range units {
			if now[s] == "" || now[s] == leaver.id {
				return false
			}
		}
		owned = changed
		return true
	}); err != nil {
		return fmt.Errorf("leave: the leaver's units not owned elsewhere: %w\n%s", err, c.describeGroups(w, want))
	}
	f.Leave.OwnedS = owned.Sub(start).Seconds()
	if err := c.convergeGroups(w, mark, start, want, &f.Leave); err != nil {
		return fmt.Errorf("leave: %w", err)
	}
	f.Leave.What = fmt.Sprintf("SIGTERM one of %d %s runners, from the signal", members+1, set.Name)
	f.Leave.Group, f.Leave.Target = set.Name, mixedChangeTarget
	f.Leave.WithinTarget = f.Leave.Seconds <= mixedChangeTarget
	f.Leave.Moved, f.Leave.MovedElsewhere = movedUnits(before, w.snapshot(), set.Group)
	f.Leave.MoveBound = len(units) + len(want[set.Group])
	select {
	case err := <-leaver.done:
		leaver.done <- err // cluster.stop waits on it too
	case <-time.After(30 * time.Second):
		return fmt.Errorf("leave: %s did not exit within 30s of SIGTERM\n%s", leaver.id, linewriter.Tail(leaver.logs.String(), 20))
	}
	e.logMixedPhase(f.Leave)

	// (e) A burn-down over every class the mixed fleet can run.
	mixed, err := mixedSets(o)
	if err != nil {
		return err
	}
	classes := runnableClasses(mixed)
	f.Classes = len(classes)
	b, err := e.classBurnDown(ctx, st, c, o.shards, o.pagesTasks, func(i int) tasks.NewTask {
		cl := classes[i%len(classes)]
		return tasks.NewTask{Kind: cl.Kind, Options: tasks.Options{Queue: cl.Queue}}
	})
	if err != nil {
		return err
	}
	b.MaxWorkers = o.maxWorkers
	f.BurnDown = &b
	if f.TopStatements, err = e.topStatements(ctx, st.Pool().Config().ConnConfig.Database, 5); err != nil {
		return err
	}
	fmt.Fprintf(e.log, "    burn-down, %d runners: %d noop tasks over %d classes in %.1fs, %.0f tasks/s; per task %.2f statements, %.1f pages; claim pages per claimed task %.1f (%d claimed)\n",
		b.Processes, b.Tasks, f.Classes, b.Seconds, b.TasksPerS, b.StmtsPerTask, b.PagesPerTask, b.PagesPerClaimedTask, b.ClaimedTasks)
	return nil
}

func describeSets(sets []capSet) string {
	var parts []string
	for _, s := range sets {
		parts = append(parts, s.describe())
	}
	return strings.Join(parts, "; ")
}

// runner is the cluster's runner named id (nil if none).
func (c *cluster) runner(id string) *runnerProc {
	for _, r := range c.runners {
		if r.id == id {
			return r
		}
	}
	return nil
}

// movedUnits counts the units of group whose owner changed between before
// and after, and those of the other groups.
func movedUnits(before, after map[string][]string, group string) (in, elsewhere int) {
	for g, owners := range after {
		for s, id := range owners {
			var was string
			if b := before[g]; b != nil {
				was = b[s]
			}
			if was == id {
				continue
			}
			if g == group {
				in++
			} else {
				elsewhere++
			}
		}
	}
	return in, elsewhere
}

// countKeys counts the keys under the cluster's prefix (one count, one
// read of them all: tens of keys, however many shards).
func (c *cluster) countKeys(ctx context.Context) (etcdKeys, error) {
	var k etcdKeys
	count, err := c.env.cli.Get(ctx, c.prefix(), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return k, fmt.Errorf("counting the cluster's keys: %w", err)
	}
	resp, err := c.env.cli.Get(ctx, c.prefix(), clientv3.WithPrefix())
	if err != nil {
		return k, fmt.Errorf("reading the cluster's keys: %w", err)
	}
	k.Total = count.Count
	for _, kv := range resp.Kvs {
		key := strings.TrimPrefix(string(kv.Key), c.prefix())
		k.Bytes += int64(len(kv.Key) + len(kv.Value))
		switch {
		case strings.HasPrefix(key, "runners/"):
			k.Runners++
		case strings.HasPrefix(key, "owners/"):
			k.Owners++
			k.OwnerValueBytes += int64(len(kv.Value))
		case strings.HasPrefix(key, "meta/"):
			k.Meta++
		default:
			k.Other++
		}
	}
	return k, nil
}

// idle measures the fleet over a window with no work: etcd's messages,
// the key writes and the runners' CPU.
func (e *env) idle(ctx context.Context, c *cluster, st *store.Store, w *groupWatch, window time.Duration) (idleCost, error) {
	var r idleCost
	runners := len(c.running())
	postmaster, err := e.postmasterPID(ctx)
	if err != nil {
		return r, err
	}
	before, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	pg := startPGCPU(postmaster)
	cpu := c.sumMetric("process_cpu_seconds_total")
	mark := w.mark()
	start := time.Now()
	select {
	case <-ctx.Done():
		pg.stop()
		return r, ctx.Err()
	case <-time.After(window):
	}
	msgs, err := embedetcd.MessagesReceived()
	if err != nil {
		pg.stop()
		return r, err
	}
	r.Seconds = time.Since(start).Seconds()
	r.PostgresCPUPct = pg.stop() / r.Seconds * 100
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	r.PGStatementsPerS = float64(after.stmts-before.stmts) / r.Seconds
	r.PGPagesPerS = float64(after.blocks-before.blocks) / r.Seconds
	r.ClaimPagesPerS = float64(after.claimBlocks-before.claimBlocks) / r.Seconds
	counts := w.since(mark)
	r.Messages = msgs - mark.msgs
	r.MsgsPerS = r.Messages / r.Seconds
	r.MsgsPerRunnerPerS = r.MsgsPerS / float64(runners)
	r.OwnerKeyWrites, r.RunnerKeyWrites = counts.puts+counts.deletes, counts.runnerPuts
	r.RunnerCPUPct = (c.sumMetric("process_cpu_seconds_total") - cpu) / r.Seconds / float64(runners) * 100
	return r, w.failed()
}

// classBurnDown enqueues n tasks (task(i)) in one transaction, once the
// cluster's runners are running, waits until every one completed, stops
// the runners and reports the burn-down (first claim to last completion)
// and what it cost PostgreSQL.
func (e *env) classBurnDown(ctx context.Context, st *store.Store, c *cluster, shards, n int, task func(i int) tasks.NewTask) (burnDown, error) {
	runners := c.running()
	r := burnDown{System: "shardrun", Processes: len(runners), Tasks: n}
	before, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	if r.EnqueuePerS, err = enqueueAtOnce(ctx, st, srclient.Config{ShardCount: shards}.WithDefaults(), n, task); err != nil {
		return r, err
	}
	if err := waitQueuesDone(ctx, st.Pool(), runners, nil, n); err != nil {
		return r, err
	}
	c.stop() // backends flush their transaction counts when they exit
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	if r.Seconds, _, _, err = queueSpan(ctx, st.Pool(), nil); err != nil {
		return r, err
	}
	r.TasksPerS = float64(n) / r.Seconds
	r.setCosts(before, after, 0, n)
	return r, nil
}

// enqueueAtOnce inserts n tasks (task(i)) in one transaction, COPY in
// batches of insertBatch, and returns the rows per second.
func enqueueAtOnce(ctx context.Context, st *store.Store, prep srclient.Config, n int, task func(i int) tasks.NewTask) (float64, error) {
	start := time.Now()
	err := pgx.BeginFunc(ctx, st.Pool(), func(tx pgx.Tx) error {
		ins := make([]store.Insert, 0, insertBatch)
		for done := 0; done < n; done += insertBatch {
			ins = ins[:0]
			for i := range min(insertBatch, n-done) {
				in, err := prep.Prepare(task(done+i), time.Now())
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
		return 0, fmt.Errorf("enqueueing %d tasks: %w", n, err)
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// waitQueuesDone waits until runners' metrics count n completed tasks (or
// stop moving) and no task of queues (every queue when nil) is ready or
// running, then checks that exactly n tasks of queues exist and all
// completed. Only the runners' metrics are polled until then, as in
// waitDrained: the bench's queries must not be the load it measures.
func waitQueuesDone(ctx context.Context, pool *pgxpool.Pool, runners []*runnerProc, queues []string, n int) error {
	last, moved := -1.0, time.Now()
	_, err := pollUntil(ctx, burnDownTimeout, finishedPoll, func() (bool, error) {
		done := 0.0
		for _, r := range runners {
			if r.cmd.ProcessState != nil {
				return false, fmt.Errorf("runner %s exited during the burn-down\n%s", r.id, linewriter.Tail(r.logs.String(), 20))
			}
			v, err := r.metricWith("shardrun_tasks_finished_total", `outcome="completed"`)
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
		err := pool.QueryRow(ctx, benchTag+`SELECT EXISTS (SELECT 1 FROM tasks WHERE state = 'ready' AND ($1::text[] IS NULL OR queue = ANY ($1)))
			OR EXISTS (SELECT 1 FROM tasks WHERE state = 'running' AND ($1::text[] IS NULL OR queue = ANY ($1)))`, queues).Scan(&pending)
		if pending {
			moved = time.Now() // ask again after another stall
		}
		return !pending, err
	})
	states, serr := queueStates(ctx, pool, queues)
	if serr != nil {
		return serr
	}
	if err != nil {
		return fmt.Errorf("burn-down of queues %v: %w (tasks: %s)", queues, err, describeStates(states))
	}
	if states["completed"] != n || len(states) != 1 {
		return fmt.Errorf("burn-down of queues %v: %d of %d tasks completed (%s)", queues, states["completed"], n, describeStates(states))
	}
	return nil
}

// queueStates counts the tasks of queues (every queue when nil) by state.
func queueStates(ctx context.Context, pool *pgxpool.Pool, queues []string) (map[string]int, error) {
	rows, err := pool.Query(ctx, benchTag+`SELECT state::text, count(*)::int FROM tasks WHERE $1::text[] IS NULL OR queue = ANY ($1) GROUP BY 1`, queues)
	if err != nil {
		return nil, fmt.Errorf("counting tasks by state: %w", err)
	}
	out := map[string]int{}
	var state string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&state, &n}, func() error { out[state] = n; return nil }); err != nil {
		return nil, fmt.Errorf("counting tasks by state: %w", err)
	}
	return out, nil
}

// queueSpan is the seconds from the first claim to the last completion of
// the completed tasks of queues (every queue when nil), and both times,
// from the database's timestamps.
func queueSpan(ctx context.Context, pool *pgxpool.Pool, queues []string) (float64, time.Time, time.Time, error) {
	var first, last time.Time
	if err := pool.QueryRow(ctx, benchTag+`SELECT min(claimed_at), max(finished_at) FROM tasks
		WHERE state = 'completed' AND ($1::text[] IS NULL OR queue = ANY ($1))`, queues).Scan(&first, &last); err != nil {
		return 0, first, last, fmt.Errorf("reading the burn-down span: %w", err)
	}
	return last.Sub(first).Seconds(), first, last, nil
}

// queueScalingRun is the throughput part: for each count k of
// -mixed-tp-runners, a fresh cluster and database with k runners of the
// emails set and mixedSideRunners of the reports set, the emails queue's
// tasks and a backlog of the reports queue enqueued at once; the emails
// queue's tasks/s from its first claim to its last completion, and the
// reports queue's completions in that window.
func (e *env) queueScalingRun(ctx context.Context, res *mixedResult, sets []capSet, o mixedOpts) error {
	var emails, side capSet
	for _, s := range sets {
		switch s.Name {
		case "emails":
			emails = s
		case "reports":
			side = s
		}
	}
	side.Runners = mixedSideRunners
	q := &queueScaling{Queue: emails.Queues[0], Shards: cmp.Or(o.tpShards, o.shards), Set: emails, Side: side, SideQueue: side.Queues[0], MaxWorkers: o.tpWorkers,
		SleepMS: o.tpSleepMS, TasksPerRun: o.tpTasksPerRunner}
	res.Throughput = q
	res.Notes = append(res.Notes, fmt.Sprintf("throughput per queue: at each count k, a fresh database and cluster of %d shards with k runners of "+
		"the emails set (%s) and %d of the reports set (%s), --max-workers %d, --db-max-conns %d; once it converged, %d×k sleep {\"ms\":%d} tasks "+
		"of the emails queue (its kinds in turn) and a backlog of %ds of the reports runners' ideal rate enqueued in one transaction; the "+
		"emails queue's tasks/s from its first claim to its last completion (database timestamps), the reports queue's completions within "+
		"that window per second; ideal = runners × workers × 1000/sleep ms",
		q.Shards, emails.describe(), side.Runners, side.describe(), o.tpWorkers, mixedDBConns, o.tpTasksPerRunner, o.tpSleepMS, mixedSideBacklog))
	for _, f := range strings.Split(o.tpRunners, ",") {
		k, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || k < 1 {
			return fmt.Errorf("-mixed-tp-runners: %q is not a runner count", f)
		}
		emails.Runners = k
		t, err := e.queueTrialRun(ctx, emails, side, o, q.Shards)
		if err != nil {
			return fmt.Errorf("throughput, %d %s runner(s): %w", k, emails.Name, err)
		}
		q.Trials = append(q.Trials, t)
		fmt.Fprintf(e.log, "  %s queue %s, %d runner(s): %d tasks in %.2fs, %.0f tasks/s (%.0f%% of ideal %.0f); side queue %s: %.0f tasks/s (%.0f%% of %.0f), backlog left at end %v; fleet converged in %.2fs; claim pages per claimed task %.1f, PostgreSQL CPU %.2f ms per task; CPU %% of a core: runners %.0f, PostgreSQL %.0f, bench+etcd %.0f, other processes %.0f (machine %.0f of %d)\n",
			emails.Name, q.Queue, k, t.Tasks, t.Seconds, t.TasksPerS, t.Efficiency*100, t.Ideal, q.SideQueue, t.SideTasksPerS,
			t.SideEfficiency*100, t.SideIdeal, t.SideHeld, t.ConvergedS, t.ClaimPagesPerTsk, t.PGCPUMsPerTask, t.CPU.Runners, t.CPU.Postgres, t.CPU.Bench,
			t.CPU.Other, t.CPU.Machine, 100*runtime.NumCPU())
		for _, st := range t.TopStatements {
			fmt.Fprintf(e.log, "    %.1fs in %d calls (%.2f ms each, %d rows, %dk blocks): %s\n", st.TotalS, st.Calls, st.MeanMS, st.Rows, st.SharedK, st.Query)
		}
	}
	return nil
}

// queueTrialRun is one throughput trial (see queueScalingRun).
func (e *env) queueTrialRun(ctx context.Context, emails, side capSet, o mixedOpts, shards int) (t queueTrial, err error) {
	perRunner := float64(o.tpWorkers) * 1000 / float64(o.tpSleepMS)
	t = queueTrial{Runners: emails.Runners, Tasks: o.tpTasksPerRunner * emails.Runners, Ideal: float64(emails.Runners) * perRunner,
		SideIdeal: float64(side.Runners) * perRunner}
	t.SideBacklog = int(t.SideIdeal) * mixedSideBacklog
	st, dsn, drop, err := e.trialStore(ctx, fmt.Sprintf("mixed_tp_%d", emails.Runners), 4)
	if err != nil {
		return t, err
	}
	defer func() {
		if derr := drop(); err == nil {
			err = derr
		}
	}()
	c := e.newCluster(fmt.Sprintf("mixed-tp-%d-%d", emails.Runners, time.Now().UnixNano()), dsn, shards)
	defer c.stop()
	w, err := c.watchGroups(ctx)
	if err != nil {
		return t, err
	}
	defer w.stop()
	want := map[string][]string{emails.Group: emails.ids(), side.Group: side.ids()}
	mark := w.mark()
	start := time.Now()
	var queueRunners []*runnerProc
	for _, s := range []capSet{emails, side} {
		for _, id := range s.ids() {
			r, err := c.spawn(id, s.opts(o, o.tpWorkers))
			if err != nil {
				return t, err
			}
			if s.Name == emails.Name {
				queueRunners = append(queueRunners, r)
			}
		}
	}
	for _, r := range c.runners {
		if err := r.waitReady(); err != nil {
			return t, err
		}
	}
	if err := w.checkPublished([]capSet{emails, side}); err != nil {
		return t, err
	}
	var p mixedPhase
	if err := c.convergeGroups(w, mark, start, want, &p); err != nil {
		return t, err
	}
	t.ConvergedS = p.Seconds
	payload := json.RawMessage(fmt.Sprintf(`{"ms":%d}`, o.tpSleepMS))
	queue, sideQueue := emails.Queues[0], side.Queues[0]
	before, err := e.counters(ctx, st.Pool())
	if err != nil {
		return t, err
	}
	cpu, err := e.startCPUWindow(ctx, c)
	if err != nil {
		return t, err
	}
	_, err = enqueueAtOnce(ctx, st, srclient.Config{ShardCount: shards}.WithDefaults(), t.SideBacklog+t.Tasks, func(i int) tasks.NewTask {
		if i < t.SideBacklog {
			return tasks.NewTask{Kind: side.Kinds[i%len(side.Kinds)], Payload: payload, Options: tasks.Options{Queue: sideQueue}}
		}
		return tasks.NewTask{Kind: emails.Kinds[i%len(emails.Kinds)], Payload: payload, Options: tasks.Options{Queue: queue}}
	})
	if err != nil {
		return t, err
	}
	if err := waitQueuesDone(ctx, st.Pool(), queueRunners, []string{queue}, t.Tasks); err != nil {
		_, _ = cpu.done()
		return t, err
	}
	if t.CPU, err = cpu.done(); err != nil {
		return t, err
	}
	var done int
	if err := st.Pool().QueryRow(ctx, benchTag+`SELECT count(*) FROM tasks WHERE state = 'completed'`).Scan(&done); err != nil {
		return t, fmt.Errorf("counting the completions: %w", err)
	}
	if done > 0 {
		t.PGCPUMsPerTask = t.CPU.Postgres / 100 * t.CPU.Seconds * 1000 / float64(done)
	}
	if err := st.Pool().QueryRow(ctx, benchTag+`SELECT EXISTS (SELECT 1 FROM tasks WHERE state = 'ready' AND queue = $1)`, sideQueue).Scan(&t.SideHeld); err != nil {
		return t, fmt.Errorf("reading the side queue's backlog: %w", err)
	}
	c.stop()
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return t, err
	}
	var first, last time.Time
	if t.Seconds, first, last, err = queueSpan(ctx, st.Pool(), []string{queue}); err != nil {
		return t, err
	}
	t.TasksPerS = float64(t.Tasks) / t.Seconds
	t.Efficiency = t.TasksPerS / t.Ideal
	var sideDone int
	if err := st.Pool().QueryRow(ctx, benchTag+`SELECT count(*) FROM tasks WHERE queue = $1 AND state = 'completed' AND finished_at BETWEEN $2 AND $3`,
		sideQueue, first, last).Scan(&sideDone); err != nil {
		return t, fmt.Errorf("counting the side queue's completions: %w", err)
	}
	t.SideTasksPerS = float64(sideDone) / t.Seconds
	if t.TopStatements, err = e.topStatements(ctx, st.Pool().Config().ConnConfig.Database, 4); err != nil {
		return t, err
	}
	t.SideEfficiency = t.SideTasksPerS / t.SideIdeal
	if after.claimRows > before.claimRows {
		t.ClaimPagesPerTsk = float64(after.claimBlocks-before.claimBlocks) / float64(after.claimRows-before.claimRows)
	}
	return t, nil
}

func (e *env) logMixedPhase(p mixedPhase) {
	fmt.Fprintf(e.log, "    %s: converged after %.2fs (target %.0fs: %v)", p.What, p.Seconds, p.Target, p.WithinTarget)
	if p.ReadyS > 0 {
		fmt.Fprintf(e.log, " (all ready after %.2fs)", p.ReadyS)
	}
	if p.OwnedS > 0 {
		fmt.Fprintf(e.log, " (its units owned elsewhere after %.2fs)", p.OwnedS)
	}
	fmt.Fprintf(e.log, "; %d units moved (bound %d), %d in other groups, %d owner key writes, %d runner key writes, %.0f etcd messages\n",
		p.Moved, p.MoveBound, p.MovedElsewhere, p.OwnerKeyWrites, p.RunnerKeyWrites, p.EtcdMessages)
}

// convergeGroups waits until every group of want converged with the
// members want names (see mixedResult's Convergence) and no other group
// holds a unit, and stays so for scaleStableFor, then fills p's timing and
// counts from mark.
func (c *cluster) convergeGroups(w *groupWatch, mark watchMark, start time.Time, want map[string][]string, p *mixedPhase) error {
	var at time.Time
	version := -1
	err := waitUntil(scaleConvergeTimeout, func() bool {
		if w.version() == version {
			return false // nothing changed since the last look
		}
		owners, v, changed := w.state()
		version = v
		if !groupsConverged(owners, want, c.shards) {
			return false
		}
		at = changed
		return true
	})
	if err != nil {
		return fmt.Errorf("not converged: %w\n%s", err, c.describeGroups(w, want))
	}
	time.Sleep(scaleStableFor) // a fixed window: nothing may change in it
	msgs, _ := embedetcd.MessagesReceived()
	_, v, _ := w.state()
	counts := w.since(mark)
	p.Seconds = at.Sub(start).Seconds()
	p.OwnerKeyWrites, p.RunnerKeyWrites = counts.puts+counts.deletes, counts.runnerPuts
	p.EtcdMessages = msgs - mark.msgs
	if err := w.failed(); err != nil {
		return err
	}
	if v != version {
		return fmt.Errorf("converged, then %d owner key events within %s\n%s", v-version, scaleStableFor, c.describeGroups(w, want))
	}
	return nil
}

// groupsConverged: in every group of want, every shard is owned by one of
// its members and shard.Assign keeps every shard where it is; no other
// group owns anything.
func groupsConverged(owners map[string][]string, want map[string][]string, shards int) bool {
	for g, ids := range want {
		current := owners[g]
		if len(current) != shards {
			return false
		}
		for _, id := range current {
			if !slices.Contains(ids, id) {
				return false
			}
		}
		if !slices.Equal(shard.Assign(ids, current), current) {
			return false
		}
	}
	for g, current := range owners {
		if _, ok := want[g]; ok {
			continue
		}
		for _, id := range current {
			if id != "" {
				return false
			}
		}
	}
	return true
}

// describeGroups says, for a report of a failed wait, how each group's
// units are held, what each runner published, and the end of each wanted
// runner's log.
func (c *cluster) describeGroups(w *groupWatch, want map[string][]string) string {
	owners, _, _ := w.state()
	var b strings.Builder
	for _, g := range slices.Sorted(maps.Keys(owners)) {
		per := map[string]int{}
		for _, id := range owners[g] {
			per[id]++
		}
		fmt.Fprintf(&b, "group %s (want %v): free %d; per owner %v\n", g, want[g], per[""], per)
	}
	w.mu.Lock()
	for _, id := range slices.Sorted(maps.Keys(w.runners)) {
		info := w.runners[id]
		fmt.Fprintf(&b, "runners/%s: state %s, group %s, queues %v, kinds %v\n", id, info.State, info.Group, info.Queues, info.Kinds)
	}
	w.mu.Unlock()
	for _, r := range c.runners {
		for _, ids := range want {
			if slices.Contains(ids, r.id) {
				fmt.Fprintf(&b, "--- %s\n%s\n", r.id, linewriter.Tail(r.logs.String(), 5))
			}
		}
	}
	return b.String()
}

// groupWatch follows a cluster's owner and runner keys through one etcd
// watch and shard.History: who holds each unit (group, shard), what each
// runner published, and counts of the key writes. Waiting for convergence
// costs etcd nothing per look.
type groupWatch struct {
	prefix  string
	shards  int
	mu      sync.Mutex
	history *shard.History
	owners  map[string][]string // group -> shard -> runner ("" free)
	runners map[string]shard.RunnerInfo
	events  int       // owner key events applied
	changed time.Time // receipt of the newest owner key event
	counts  watchCounts
	err     error
	cancel  context.CancelFunc
	done    chan struct{}
}

func (c *cluster) watchGroups(ctx context.Context) (*groupWatch, error) {
	w := &groupWatch{prefix: c.prefix(), shards: c.shards, history: shard.NewHistory(c.prefix(), c.shards),
		owners: map[string][]string{}, runners: map[string]shard.RunnerInfo{}, done: make(chan struct{})}
	resp, err := c.env.cli.Get(ctx, w.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading the cluster's keys: %w", err)
	}
	for _, kv := range resp.Kvs {
		w.apply(&clientv3.Event{Type: clientv3.EventTypePut, Kv: kv}, time.Now())
	}
	wctx, cancel := context.WithCancel(ctx)
	w.cancel = cancel
	ch := c.env.cli.Watch(wctx, w.prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		defer close(w.done)
		for resp := range ch {
			now := time.Now()
			w.mu.Lock()
			if err := resp.Err(); err != nil && w.err == nil {
				w.err = err
			}
			for _, ev := range resp.Events {
				w.apply(ev, now)
			}
			w.mu.Unlock()
		}
	}()
	return w, nil
}

// apply takes one event; w.mu is held (or w not yet shared).
func (w *groupWatch) apply(ev *clientv3.Event, now time.Time) {
	key := strings.TrimPrefix(string(ev.Kv.Key), w.prefix)
	put := ev.Type == clientv3.EventTypePut
	switch {
	case strings.HasPrefix(key, "owners/"):
		if put {
			w.counts.puts++
		} else {
			w.counts.deletes++
		}
		for _, u := range w.history.Apply(ev) {
			owners := w.owners[u.Group]
			if owners == nil {
				owners = make([]string, w.shards)
				w.owners[u.Group] = owners
			}
			if u.Acquired {
				owners[u.Shard] = u.Runner
			} else if owners[u.Shard] == u.Runner {
				owners[u.Shard] = ""
			}
		}
		w.events++
		w.changed = now
	case strings.HasPrefix(key, "runners/"):
		id := strings.TrimPrefix(key, "runners/")
		if !put {
			delete(w.runners, id)
			return
		}
		w.counts.runnerPuts++
		var info shard.RunnerInfo
		if json.Unmarshal(ev.Kv.Value, &info) == nil {
			w.runners[id] = info
		}
	}
}

func (w *groupWatch) stop() { w.cancel(); <-w.done }

// failed is the watch's error, if it broke (then its state is stale).
func (w *groupWatch) failed() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err != nil {
		return fmt.Errorf("watching the cluster's keys: %w", w.err)
	}
	return nil
}

// state is a copy of the owners of every group, the event count and the
// newest event's receipt time.
func (w *groupWatch) state() (map[string][]string, int, time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[string][]string, len(w.owners))
	for g, o := range w.owners {
		out[g] = slices.Clone(o)
	}
	return out, w.events, w.changed
}

// group is a copy of one group's owners and the newest event's receipt.
func (w *groupWatch) group(g string) ([]string, time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	o := slices.Clone(w.owners[g])
	if o == nil {
		o = make([]string, w.shards)
	}
	return o, w.changed
}

func (w *groupWatch) version() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.events
}

func (w *groupWatch) snapshot() map[string][]string { o, _, _ := w.state(); return o }

func (w *groupWatch) mark() watchMark {
	msgs, _ := embedetcd.MessagesReceived()
	w.mu.Lock()
	defer w.mu.Unlock()
	return watchMark{counts: w.counts, msgs: msgs}
}

func (w *groupWatch) since(m watchMark) watchCounts {
	w.mu.Lock()
	defer w.mu.Unlock()
	return watchCounts{puts: w.counts.puts - m.counts.puts, deletes: w.counts.deletes - m.counts.deletes,
		runnerPuts: w.counts.runnerPuts - m.counts.runnerPuts}
}

// checkPublished checks that every runner of sets published the group the
// bench expects of its set (else convergence could never be seen).
func (w *groupWatch) checkPublished(sets []capSet) error {
	return waitUntil(10*time.Second, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		for _, s := range sets {
			for _, id := range s.ids() {
				if w.runners[id].Group != s.Group {
					return false
				}
			}
		}
		return true
	})
}

// shares is each set's group balance now.
func (w *groupWatch) shares(sets []capSet, want map[string][]string) []groupShare {
	owners := w.snapshot()
	var out []groupShare
	for _, s := range sets {
		per := map[string]int{}
		for _, id := range owners[s.Group] {
			per[id]++
		}
		g := groupShare{Set: s.Name, Group: s.Group, Members: len(want[s.Group]), MinUnits: w.shards}
		for _, id := range want[s.Group] {
			g.MinUnits, g.MaxUnits = min(g.MinUnits, per[id]), max(g.MaxUnits, per[id])
		}
		out = append(out, g)
	}
	return out
}

// printMixed adds the mixed section's rows.
func printMixed(w io.Writer, m *mixedResult) {
	u, x := m.Uniform, m.Mixed
	if u == nil || x == nil {
		return
	}
	fmt.Fprintf(w, "| mixed fleet, %d runners, %d shards, %d queues, %d kinds: capability sets | %s (uniform: one set of every queue and kind) |\n",
		m.Runners, m.Shards, m.Queues, m.Kinds, describeSets(x.Sets))
	if u.Keys.Total > 0 && x.Keys.Total > 0 {
		fmt.Fprintf(w, "| etcd keys after cold start, uniform vs mixed | %d vs %d (ratio **%.2f**, target ≤ %.0f); %d vs %d bytes of keys and values (ratio %.2f) |\n",
			u.Keys.Total, x.Keys.Total, m.KeysRatio, mixedCostTarget, u.Keys.Bytes, x.Keys.Bytes, m.KeyBytesRatio)
	}
	if u.Idle.Seconds > 0 && x.Idle.Seconds > 0 {
		fmt.Fprintf(w, "| etcd messages/s while idle (%.0fs), uniform vs mixed | %.1f vs %.1f, per runner %.2f vs %.2f (ratio **%.2f**, target ≤ %.0f); runner CPU %.1f%% vs %.1f%% of a core each |\n",
			x.Idle.Seconds, u.Idle.MsgsPerS, x.Idle.MsgsPerS, u.Idle.MsgsPerRunnerPerS, x.Idle.MsgsPerRunnerPerS, m.MsgsRatio, mixedCostTarget,
			u.Idle.RunnerCPUPct, x.Idle.RunnerCPUPct)
		if u.Idle.PGPagesPerS > 0 {
			fmt.Fprintf(w, "| PostgreSQL while idle (%.0fs), uniform vs mixed | %.0f vs %.0f pages/s (ratio **%.2f**; claims' %.0f vs %.0f), %.0f vs %.0f statements/s, server CPU %.0f%% vs %.0f%% of a core |\n",
				x.Idle.Seconds, u.Idle.PGPagesPerS, x.Idle.PGPagesPerS, m.IdlePagesRatio, u.Idle.ClaimPagesPerS, x.Idle.ClaimPagesPerS,
				u.Idle.PGStatementsPerS, x.Idle.PGStatementsPerS, u.Idle.PostgresCPUPct, x.Idle.PostgresCPUPct)
		}
	}
	for _, f := range []*mixedFleet{u, x} {
		for _, p := range []mixedPhase{f.Cold, f.Join, f.Leave} {
			if p.What == "" {
				continue
			}
			fmt.Fprintf(w, "| %s fleet, %s | converged in **%.2fs** (target ≤ %.0fs: %s); %d units moved (bound %d), %d in other groups; %d owner key writes; %.0f etcd messages",
				f.Fleet, p.What, p.Seconds, p.Target, verdict(p.WithinTarget), p.Moved, p.MoveBound, p.MovedElsewhere, p.OwnerKeyWrites, p.EtcdMessages)
			if p.ReadyS > 0 {
				fmt.Fprintf(w, "; other processes used %.0f%% of a core meanwhile", f.ColdCPU.Other)
			}
			fmt.Fprintln(w, " |")
		}
	}
	if u.BurnDown != nil && x.BurnDown != nil {
		fmt.Fprintf(w, "| claim pages per claimed task, %d noop tasks over %d (queue, kind) pairs, uniform vs mixed | %.1f vs %.1f (ratio **%.2f**); %.0f vs %.0f tasks/s |\n",
			x.BurnDown.Tasks, x.Classes, u.BurnDown.PagesPerClaimedTask, x.BurnDown.PagesPerClaimedTask, m.PagesRatio, u.BurnDown.TasksPerS, x.BurnDown.TasksPerS)
	}
	if q := m.Throughput; q != nil && len(q.Trials) > 0 {
		var parts []string
		for _, t := range q.Trials {
			parts = append(parts, fmt.Sprintf("k=%d: **%.0f** tasks/s (%.0f%% of ideal), %s %.0f tasks/s; CPU runners %.0f%%, PostgreSQL %.0f%%, other processes %.0f%%",
				t.Runners, t.TasksPerS, t.Efficiency*100, q.SideQueue, t.SideTasksPerS, t.CPU.Runners, t.CPU.Postgres, t.CPU.Other))
		}
		fmt.Fprintf(w, "| throughput of queue %s (%s set) with k runners of it, %d ms tasks, --max-workers %d, beside %d %s runners busy on %s | %s |\n",
			q.Queue, q.Set.Name, q.SleepMS, q.MaxWorkers, q.Side.Runners, q.Side.Name, q.SideQueue, strings.Join(parts, "; "))
	}
}

// mixedTargets (issue 31, point 5) from the mixed section.
func mixedTargets(m *mixedResult) []target {
	keys := target{Measure: "mixed fleet ÷ uniform fleet, etcd keys in total", Target: fmt.Sprintf("≤ %.0f", mixedCostTarget), Status: notMeasured}
	msgs := target{Measure: "mixed fleet ÷ uniform fleet, etcd messages/s while idle", Target: fmt.Sprintf("≤ %.0f", mixedCostTarget), Status: notMeasured}
	cold := target{Measure: "mixed fleet, cold start to every unit owned (converged)", Target: fmt.Sprintf("≤ %.0f s", mixedColdTarget), Status: notMeasured}
	join := target{Measure: "mixed fleet, a join (converged)", Target: fmt.Sprintf("≤ %.0f s", mixedChangeTarget), Status: notMeasured}
	leave := target{Measure: "mixed fleet, a leave (converged)", Target: fmt.Sprintf("≤ %.0f s", mixedChangeTarget), Status: notMeasured}
	pages := target{Measure: "mixed fleet ÷ uniform fleet, claim pages per claimed task (flat)", Target: fmt.Sprintf("≤ %.2f", mixedPagesTarget), Status: notMeasured}
	out := []target{keys, msgs, cold, join, leave, pages}
	if m == nil || m.Uniform == nil || m.Mixed == nil {
		return out
	}
	u, x := m.Uniform, m.Mixed
	if u.Keys.Total > 0 && x.Keys.Total > 0 {
		out[0].Measured = fmt.Sprintf("%.2f (%d ÷ %d)", m.KeysRatio, x.Keys.Total, u.Keys.Total)
		out[0].Status = verdict(m.KeysRatio <= mixedCostTarget)
	}
	if u.Idle.MsgsPerS > 0 && x.Idle.MsgsPerS > 0 {
		out[1].Measured = fmt.Sprintf("%.2f (%.1f ÷ %.1f)", m.MsgsRatio, x.Idle.MsgsPerS, u.Idle.MsgsPerS)
		out[1].Status = verdict(m.MsgsRatio <= mixedCostTarget)
	}
	for i, p := range []mixedPhase{x.Cold, x.Join, x.Leave} {
		if p.What != "" {
			out[2+i].Measured = fmt.Sprintf("%.2f s", p.Seconds)
			out[2+i].Status = verdict(p.WithinTarget)
		}
	}
	if m.PagesRatio > 0 {
		out[5].Measured = fmt.Sprintf("%.2f (%.1f ÷ %.1f)", m.PagesRatio, x.BurnDown.PagesPerClaimedTask, u.BurnDown.PagesPerClaimedTask)
		out[5].Status = verdict(m.PagesRatio <= mixedPagesTarget)
	}
	return out
}
