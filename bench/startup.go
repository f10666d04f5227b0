package main

// A fleet at full speed at once (issue 35, item 2): runners started
// together on a backlog, timed to full throughput, with the ownership's
// changes of hands on the way; then one more runner joining a fleet under
// load, and the throughput before, during and after.

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/shard"
)

// startupOpts are the startup section's flags.
type startupOpts struct {
	runners, shards, tasks, maxWorkers int
	joinTasks                          int
	joinAfter                          time.Duration
}

// The defaults are the scale section's fleet (16 runners over 4,096
// shards, --max-workers 512, --db-max-conns 4), whose burn-down is the
// issue's "once converged" rate.
var startupFlags = startupOpts{runners: 16, shards: 4096, tasks: 200_000, maxWorkers: 512, joinTasks: 300_000, joinAfter: 3 * time.Second}

const (
	// startupBucket is the width of a completion-rate sample.
	startupBucket = 100 * time.Millisecond
	// startupFull is the share of the steady rate that counts as full speed.
	startupFull = 0.9
	// startupSustain buckets in a row must average full speed for the
	// sustained figure.
	startupSustain = 5
	// startupMinBuckets is the fewest buckets a steady rate is taken over.
	startupMinBuckets = 5
)

// unitCounts are the changes of hands of a phase, from the etcd history of
// the owner keys (shard.History).
type unitCounts struct {
	// Acquisitions and Releases of units (a shard of the group).
	Acquisitions int `json:"unit_acquisitions"`
	Releases     int `json:"unit_releases"`
	// Moves are acquisitions of a shard that was owned at the phase's start
	// or had been acquired already in it: every acquisition beyond the
	// first of a shard nobody owned.
	Moves int `json:"units_moved"`
	// ShardsAcquired is the distinct shards acquired; MovedMoreThanOnce the
	// shards acquired more than once in the phase (cold start: moved after
	// their first owner), MaxPerShard the most acquisitions of one shard.
	ShardsAcquired    int `json:"shards_acquired"`
	MovedMoreThanOnce int `json:"shards_acquired_more_than_once"`
	MaxPerShard       int `json:"max_acquisitions_of_one_shard"`
	// NetMoved is the shards whose owner at the end differs from the
	// start's; Bound shard.Assign's bound on it (join: ⌈S/(n+1)⌉ + n).
	NetMoved       int `json:"shards_with_another_owner_at_end"`
	Bound          int `json:"move_bound,omitempty"`
	OwnerKeyWrites int `json:"owner_key_writes"`
	// LastChangeS: the receipt of the phase's last unit event, and
	// ConvergedS of the one that made the ownership shard.Assign's fixed
	// point, in seconds from the phase's start.
	LastChangeS float64 `json:"last_unit_change_s"`
	ConvergedS  float64 `json:"converged_s"`
}

// coldStart is the fleet started at once on a backlog.
type coldStart struct {
	Tasks       int     `json:"tasks"`
	EnqueuePerS float64 `json:"enqueue_rows_per_s"`
	// Seconds from the first spawn.
	AllReadyS   float64 `json:"all_ready_s"`
	FirstClaimS float64 `json:"first_claim_s"`
	LastFinishS float64 `json:"last_completion_s"`
	// FullSpeedS: the end of the first 100 ms bucket whose completions
	// reach startupFull of the steady rate; SustainedS: of the first of
	// startupSustain buckets in a row that do on average. -1: never.
	FullSpeedS float64 `json:"full_speed_s"`
	SustainedS float64 `json:"sustained_full_speed_s"`
	// OverallPerS: tasks over the first spawn to the last completion;
	// FromClaimPerS: over the first claim to the last completion.
	OverallPerS   float64 `json:"overall_tasks_per_s"`
	FromClaimPerS float64 `json:"first_claim_to_last_completion_tasks_per_s"`
	// SteadyPerS: the median bucket after the last unit change (SteadyFrom
	// says when the ownership settled too late for that).
	SteadyPerS float64    `json:"steady_tasks_per_s"`
	SteadyFrom string     `json:"steady_rate_from"`
	Units      unitCounts `json:"ownership"`
	// BucketsPerS are the completions per 100 ms from the first spawn, as
	// tasks/s (database timestamps: finished_at).
	BucketsPerS []float64 `json:"completions_per_s_by_100ms"`
	CPU         cpuShares `json:"cpu_pct_of_a_core"`
}

// joinUnderLoad is one more runner joining a fleet that drains a backlog.
type joinUnderLoad struct {
	Tasks       int     `json:"tasks"`
	EnqueuePerS float64 `json:"enqueue_rows_per_s"`
	Runners     int     `json:"runners_before"`
	// JoinAfterS: the joiner's spawn, from the backlog's commit.
	JoinAfterS float64 `json:"join_after_commit_s"`
	// Seconds from the joiner's spawn.
	ReadyS float64 `json:"joiner_ready_s"`
	// BeforePerS: the median bucket from 0.5 s after the commit to the
	// spawn; DipPerS the smallest from the spawn to 1 s after the last
	// unit change; AfterPerS the median after the last unit change.
	BeforePerS float64 `json:"before_tasks_per_s"`
	DipPerS    float64 `json:"dip_tasks_per_s"`
	DipAtS     float64 `json:"dip_bucket_end_s"`
	AfterPerS  float64 `json:"after_tasks_per_s"`
	Step       float64 `json:"after_over_before"`
	DipRatio   float64 `json:"dip_over_before"`
	// SteadyAgainS: the end of the first bucket from the dip on at
	// startupFull of the after rate, from the spawn. -1: not measured.
	SteadyAgainS float64    `json:"new_steady_rate_reached_s"`
	AfterBuckets int        `json:"after_buckets"`
	Units        unitCounts `json:"ownership"`
	// BucketsPerS are the completions per 100 ms from the backlog's commit.
	BucketsPerS []float64 `json:"completions_per_s_by_100ms"`
	CPU         cpuShares `json:"cpu_pct_of_a_core"`
	Note        string    `json:"note,omitempty"`
}

// startupResult is the startup section's report.
type startupResult struct {
	Runners    int            `json:"runners"`
	Shards     int            `json:"shards"`
	MaxWorkers int            `json:"max_workers_per_runner"`
	DBMaxConns int            `json:"db_max_conns_per_runner"`
	LeaseTTL   string         `json:"lease_ttl"`
	Cores      int            `json:"cores"`
	Cold       *coldStart     `json:"cold_start,omitempty"`
	Join       *joinUnderLoad `json:"join_under_load,omitempty"`
	Notes      []string       `json:"notes"`
}

func (e *env) startupSection(ctx context.Context, rep *Report) error {
	o := startupFlags
	if o.runners < 1 || o.tasks < 1 || o.joinTasks < 0 {
		return fmt.Errorf("-startup-runners and -startup-tasks must be positive")
	}
	res := &startupResult{Runners: o.runners, Shards: o.shards, MaxWorkers: o.maxWorkers, DBMaxConns: scaleDBConns, LeaseTTL: "10s", Cores: runtime.NumCPU(),
		Notes: []string{
			fmt.Sprintf("cold start: a fresh database with %s noop tasks enqueued in one transaction, then %d bin/runner processes spawned at "+
				"once on a fresh etcd prefix (%d shards, --max-workers %d, --db-max-conns %d, lease TTL 10s); completions counted per 100 ms "+
				"from the tasks' finished_at (the database's clock, on the bench's host) from the first spawn; steady rate = the median "+
				"100 ms bucket after the last change of hands (the final, partial bucket left out), or of the burn-down's second half "+
				"when fewer than %d buckets come after it; full speed = the end of the first bucket at ≥ %.0f%% of it",
				fmtThousands(o.tasks), o.runners, o.shards, o.maxWorkers, scaleDBConns, startupMinBuckets, startupFull*100),
			"ownership from one etcd watch of the cluster's owner keys through shard.History: every unit (shard) acquired and released, " +
				"with the receipt time of its event; a unit moved = acquired while another runner owned it at the phase's start or " +
				"after it had been acquired once in the phase",
			fmt.Sprintf("join under load: the same fleet once converged, a second backlog of %s noop tasks in one transaction, one more "+
				"runner spawned %s after its commit; before = median bucket from 0.5 s after the commit to the spawn, dip = the "+
				"smallest bucket from the spawn to 1 s after the last change of hands, after = median bucket after it",
				fmtThousands(o.joinTasks), o.joinAfter),
			"CPU in percent of one core: the runners from /proc/<pid>/stat, PostgreSQL's processes sampled every 100 ms, the bench " +
				"process with its embedded etcd, the machine (/proc/stat), and other processes (the rest)",
		}}
	rep.Startup = res
	st, dsn, drop, err := e.trialStore(ctx, "startup", 4)
	if err != nil {
		return err
	}
	defer func() { _ = drop() }()
	c := e.newCluster(fmt.Sprintf("startup-%d", time.Now().UnixNano()), dsn, o.shards)
	defer c.stop()
	w, err := c.watchUnits(ctx)
	if err != nil {
		return err
	}
	defer w.stop()
	prep := srclient.Config{ShardCount: o.shards}.WithDefaults()
	opts := runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: o.maxWorkers, dbMaxConns: scaleDBConns}
	var ids []string
	for i := 1; i <= o.runners; i++ {
		ids = append(ids, fmt.Sprintf("runner-%d", i))
	}

	// (a) Cold start on a backlog.
	cold := &coldStart{Tasks: o.tasks}
	res.Cold = cold
	if cold.EnqueuePerS, err = enqueueNoopsAtOnce(ctx, st, prep, o.tasks); err != nil {
		return err
	}
	win, err := e.startLoadWindow(ctx, nil)
	if err != nil {
		return err
	}
	mark := w.mark()
	start := time.Now()
	for _, id := range ids {
		if _, err := c.spawn(id, opts); err != nil {
			win.pg.stop()
			return err
		}
	}
	for _, r := range c.runners {
		if err := r.waitReady(); err != nil {
			win.pg.stop()
			return err
		}
	}
	cold.AllReadyS = time.Since(start).Seconds()
	err = waitBurnedDown(ctx, st.Pool(), c.runners, "noop", o.tasks)
	if cold.CPU, err = doneWindow(win, c, err); err != nil {
		return fmt.Errorf("cold start: %w", err)
	}
	convergedAt, err := w.waitConverged(ids, o.shards, scaleConvergeTimeout)
	if err != nil {
		return fmt.Errorf("cold start: %w\n%s", err, c.describeUnits(w, ids))
	}
	cold.Units = w.counts(mark, start, map[int]string{})
	cold.Units.ConvergedS = convergedAt.Sub(start).Seconds()
	cold.Units.Bound = o.shards
	if cold.BucketsPerS, err = completionBuckets(ctx, st.Pool(), start, 0); err != nil {
		return err
	}
	if cold.FirstClaimS, cold.LastFinishS, err = claimSpan(ctx, st.Pool(), start, 0); err != nil {
		return err
	}
	cold.OverallPerS = float64(o.tasks) / cold.LastFinishS
	cold.FromClaimPerS = float64(o.tasks) / (cold.LastFinishS - cold.FirstClaimS)
	cold.SteadyPerS, cold.SteadyFrom = steadyRate(cold.BucketsPerS, cold.Units.LastChangeS)
	cold.FullSpeedS, cold.SustainedS = fullSpeed(cold.BucketsPerS, cold.SteadyPerS)
	fmt.Fprintf(e.log, "  cold start, %d runners, %d shards, %s noop tasks: full speed after %s (sustained %s); first claim %.2fs, all ready %.2fs, "+
		"last completion %.2fs; overall %.0f tasks/s from the first spawn (%.0f from the first claim), steady %.0f (%s)\n",
		o.runners, o.shards, fmtThousands(o.tasks), fmtSeconds(cold.FullSpeedS), fmtSeconds(cold.SustainedS), cold.FirstClaimS, cold.AllReadyS,
		cold.LastFinishS, cold.OverallPerS, cold.FromClaimPerS, cold.SteadyPerS, cold.SteadyFrom)
	e.logUnits("cold start", cold.Units)
	e.logCPU(cold.CPU)
	fmt.Fprintf(e.log, "    completions/s by 100 ms from the first spawn: %s\n", fmtRates(cold.BucketsPerS))
	if o.joinTasks == 0 {
		return nil
	}

	// (b) One more runner joins while a backlog drains.
	time.Sleep(scaleStableFor)
	if n := w.since(w.mark()); len(n) > 0 {
		return fmt.Errorf("join: %d unit events after convergence", len(n))
	}
	j := &joinUnderLoad{Tasks: o.joinTasks, Runners: o.runners}
	res.Join = j
	var boundary int64
	if err := st.Pool().QueryRow(ctx, benchTag+`SELECT coalesce(max(id), 0) FROM tasks`).Scan(&boundary); err != nil {
		return fmt.Errorf("reading the last task id: %w", err)
	}
	before := w.owners()
	var pids []int
	for _, r := range c.runners {
		pids = append(pids, r.cmd.Process.Pid)
	}
	if j.EnqueuePerS, err = enqueueNoopsAtOnce(ctx, st, prep, o.joinTasks); err != nil {
		return err
	}
	committed := time.Now()
	if win, err = e.startLoadWindow(ctx, pids); err != nil {
		return err
	}
	time.Sleep(time.Until(committed.Add(o.joinAfter)))
	joiner := fmt.Sprintf("runner-%d", o.runners+1)
	ids = append(ids, joiner)
	mark = w.mark()
	spawned := time.Now()
	j.JoinAfterS = spawned.Sub(committed).Seconds()
	r, err := c.spawn(joiner, opts)
	if err == nil {
		err = r.waitReady()
	}
	if err != nil {
		win.pg.stop()
		return fmt.Errorf("join: %w", err)
	}
	j.ReadyS = time.Since(spawned).Seconds()
	convergedAt, err = w.waitConverged(ids, o.shards, scaleConvergeTimeout)
	if err != nil {
		win.pg.stop()
		return fmt.Errorf("join: %w\n%s", err, c.describeUnits(w, ids))
	}
	err = waitBurnedDown(ctx, st.Pool(), c.runners, "noop", o.tasks+o.joinTasks)
	if j.CPU, err = doneWindow(win, c, err); err != nil {
		return fmt.Errorf("join: %w", err)
	}
	j.Units = w.counts(mark, spawned, before)
	j.Units.ConvergedS = convergedAt.Sub(spawned).Seconds()
	j.Units.Bound = (o.shards+o.runners)/(o.runners+1) + o.runners // ⌈S/(n+1)⌉ + n
	if j.BucketsPerS, err = completionBuckets(ctx, st.Pool(), committed, boundary); err != nil {
		return err
	}
	j.analyse(spawned.Sub(committed).Seconds(), j.Units.LastChangeS+j.JoinAfterS)
	fmt.Fprintf(e.log, "  join under load: runner %d joins %d draining %s noop tasks, %.2fs after the commit: before %.0f tasks/s, dip %.0f (%.2f of before, bucket ending %.2fs after the spawn), after %.0f (%.2f of before, over %d buckets); new steady rate after %s; joiner ready %.2fs, converged %.2fs\n",
		o.runners+1, o.runners, fmtThousands(o.joinTasks), j.JoinAfterS, j.BeforePerS, j.DipPerS, j.DipRatio, j.DipAtS, j.AfterPerS, j.Step, j.AfterBuckets,
		fmtSeconds(j.SteadyAgainS), j.ReadyS, j.Units.ConvergedS)
	if j.Note != "" {
		fmt.Fprintf(e.log, "    note: %s\n", j.Note)
	}
	e.logUnits("join", j.Units)
	e.logCPU(j.CPU)
	fmt.Fprintf(e.log, "    completions/s by 100 ms from the commit: %s\n", fmtRates(j.BucketsPerS))
	return nil
}

// doneWindow ends a load window over the cluster's running runners; err
// is the measurement's, returned first.
func doneWindow(win *loadWindow, c *cluster, err error) (cpuShares, error) {
	var pids []int
	for _, r := range c.running() {
		pids = append(pids, r.cmd.Process.Pid)
	}
	cpu, cerr := win.done(pids)
	if err != nil {
		return cpu, err
	}
	return cpu, cerr
}

// analyse fills the join's rates from its buckets (from the commit): the
// spawn at spawnS and the last change of hands at settledS.
func (j *joinUnderLoad) analyse(spawnS, settledS float64) {
	b := j.BucketsPerS
	last := len(b) - 1 // partial: left out
	var before []float64
	for i := range last {
		if s := bucketStart(i); s >= 0.5 && s+startupBucket.Seconds() <= spawnS {
			before = append(before, b[i])
		}
	}
	j.BeforePerS = median(before)
	j.DipPerS, j.SteadyAgainS = -1, -1
	dip := -1
	for i := bucketIndex(spawnS); i < last && bucketStart(i) <= settledS+1; i++ {
		if dip < 0 || b[i] < j.DipPerS {
			dip, j.DipPerS = i, b[i]
		}
	}
	var after []float64
	for i := bucketIndex(settledS) + 1; i < last; i++ {
		after = append(after, b[i])
	}
	j.AfterBuckets = len(after)
	if len(after) >= startupMinBuckets {
		j.AfterPerS = median(after)
	} else {
		j.Note = fmt.Sprintf("the backlog ran out %d bucket(s) after the last change of hands: no after rate (raise -startup-join-tasks)", len(after))
	}
	if j.BeforePerS > 0 {
		j.Step, j.DipRatio = j.AfterPerS/j.BeforePerS, j.DipPerS/j.BeforePerS
	}
	if dip >= 0 {
		j.DipAtS = bucketStart(dip+1) - spawnS
		if j.AfterPerS > 0 {
			for i := dip; i < last; i++ {
				if b[i] >= startupFull*j.AfterPerS {
					j.SteadyAgainS = bucketStart(i+1) - spawnS
					break
				}
			}
		}
	}
}

func bucketStart(i int) float64 { return float64(i) * startupBucket.Seconds() }

func bucketIndex(s float64) int { return max(0, int(s/startupBucket.Seconds())) }

// steadyRate is the median bucket after the ownership's last change at
// settledS (the final, partial bucket left out), or, when fewer than
// startupMinBuckets come after it, the median of the burn-down's second
// half (from its first completion).
func steadyRate(b []float64, settledS float64) (float64, string) {
	last := len(b) - 1
	var after []float64
	for i := bucketIndex(settledS) + 1; i < last; i++ {
		after = append(after, b[i])
	}
	if len(after) >= startupMinBuckets {
		return median(after), fmt.Sprintf("median of %d buckets after the last change of hands at %.2fs", len(after), settledS)
	}
	first := slices.IndexFunc(b, func(v float64) bool { return v > 0 })
	if first < 0 || last <= first {
		return 0, "no completions"
	}
	half := b[(first+last)/2 : last]
	return median(half), fmt.Sprintf("median of the second half of the burn-down (%d buckets): the ownership last changed at %.2fs, only %d buckets before the backlog ran out",
		len(half), settledS, len(after))
}

// fullSpeed is the end of the first bucket at startupFull of steady, and
// that of the first of startupSustain buckets in a row that average it
// (before the final, partial bucket); -1 when none is.
func fullSpeed(b []float64, steady float64) (first, sustained float64) {
	first, sustained = -1, -1
	if steady <= 0 {
		return
	}
	last := len(b) - 1
	for i := range last {
		if first < 0 && b[i] >= startupFull*steady {
			first = bucketStart(i + 1)
		}
		if i+startupSustain <= last {
			var sum float64
			for _, v := range b[i : i+startupSustain] {
				sum += v
			}
			if sum/startupSustain >= startupFull*steady {
				sustained = bucketStart(i + 1)
				break
			}
		}
	}
	return first, sustained
}

// completionBuckets counts the completed noop tasks of id above afterID by
// 100 ms of finished_at from t0 (the bench's host clock, which the local
// server shares), as tasks/s; bucket i is [t0 + i×100ms, t0 + (i+1)×100ms).
func completionBuckets(ctx context.Context, pool *pgxpool.Pool, t0 time.Time, afterID int64) ([]float64, error) {
	rows, err := pool.Query(ctx, benchTag+`SELECT floor(extract(epoch FROM finished_at - $1::timestamptz) / $3)::int, count(*)::int
		FROM tasks WHERE kind = 'noop' AND state = 'completed' AND id > $2 GROUP BY 1 ORDER BY 1`, t0, afterID, startupBucket.Seconds())
	if err != nil {
		return nil, fmt.Errorf("counting completions by 100 ms: %w", err)
	}
	var out []float64
	var i, n int
	_, err = pgx.ForEachRow(rows, []any{&i, &n}, func() error {
		i = max(i, 0) // a task finished before t0: none expected
		for len(out) <= i {
			out = append(out, 0)
		}
		out[i] += float64(n) / startupBucket.Seconds()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("counting completions by 100 ms: %w", err)
	}
	return out, nil
}

// claimSpan is the first claim and the last completion of the noop tasks
// of id above afterID, in seconds from t0.
func claimSpan(ctx context.Context, pool *pgxpool.Pool, t0 time.Time, afterID int64) (first, last float64, err error) {
	err = pool.QueryRow(ctx, benchTag+`SELECT extract(epoch FROM min(claimed_at) - $1::timestamptz)::float8, extract(epoch FROM max(finished_at) - $1::timestamptz)::float8
		FROM tasks WHERE kind = 'noop' AND id > $2`, t0, afterID).Scan(&first, &last)
	if err != nil {
		err = fmt.Errorf("reading the first claim and the last completion: %w", err)
	}
	return first, last, err
}

func (e *env) logUnits(phase string, u unitCounts) {
	fmt.Fprintf(e.log, "    %s ownership: %d unit acquisitions of %d shards, %d releases, %d units moved, %d shards acquired more than once (at most %d times), "+
		"%d with another owner at the end", phase, u.Acquisitions, u.ShardsAcquired, u.Releases, u.Moves, u.MovedMoreThanOnce, u.MaxPerShard, u.NetMoved)
	if u.Bound > 0 {
		fmt.Fprintf(e.log, " (bound %d)", u.Bound)
	}
	fmt.Fprintf(e.log, "; %d owner key writes; last change %.2fs, converged %.2fs\n", u.OwnerKeyWrites, u.LastChangeS, u.ConvergedS)
}

func (e *env) logCPU(c cpuShares) {
	fmt.Fprintf(e.log, "    CPU %% of a core over %.1fs: runners %.0f, PostgreSQL %.0f, bench+etcd %.0f, other processes %.0f (machine %.0f of %d)\n",
		c.Seconds, c.Runners, c.Postgres, c.Bench, c.Other, c.Machine, 100*runtime.NumCPU())
}

func fmtSeconds(s float64) string {
	if s < 0 {
		return "never"
	}
	return fmt.Sprintf("%.1fs", s)
}

// fmtRates is the buckets in thousands of tasks/s.
func fmtRates(b []float64) string {
	parts := make([]string, len(b))
	for i, v := range b {
		parts[i] = fmt.Sprintf("%.1f", v/1000)
	}
	return strings.Join(parts, " ") + " (k/s)"
}

// unitAt is a unit event with the receipt time of its etcd event.
type unitAt struct {
	at time.Time
	shard.UnitEvent
}

// unitWatch follows a cluster's owner keys through one etcd watch and
// shard.History, keeping every change of hands with its receipt time.
type unitWatch struct {
	mu          sync.Mutex
	held        map[int]string
	events      []unitAt
	ownerWrites []time.Time
	err         error
	cancel      context.CancelFunc
	done        chan struct{}
}

func (c *cluster) watchUnits(ctx context.Context) (*unitWatch, error) {
	prefix := c.prefix()
	w := &unitWatch{held: map[int]string{}, done: make(chan struct{})}
	resp, err := c.env.cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading the owner keys: %w", err)
	}
	hist := shard.NewHistory(prefix, c.shards)
	for _, kv := range resp.Kvs {
		for _, u := range hist.Apply(&clientv3.Event{Type: clientv3.EventTypePut, Kv: kv}) {
			w.apply(u)
		}
	}
	wctx, cancel := context.WithCancel(ctx)
	w.cancel = cancel
	ch := c.env.cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		defer close(w.done)
		for resp := range ch {
			now := time.Now()
			w.mu.Lock()
			if err := resp.Err(); err != nil && w.err == nil {
				w.err = err
			}
			for _, ev := range resp.Events {
				if strings.HasPrefix(string(ev.Kv.Key), prefix+"owners/") {
					w.ownerWrites = append(w.ownerWrites, now)
				}
				for _, u := range hist.Apply(ev) {
					w.apply(u)
					w.events = append(w.events, unitAt{at: now, UnitEvent: u})
				}
			}
			w.mu.Unlock()
		}
	}()
	return w, nil
}

func (w *unitWatch) apply(u shard.UnitEvent) {
	if u.Acquired {
		w.held[u.Shard] = u.Runner
	} else if w.held[u.Shard] == u.Runner {
		delete(w.held, u.Shard)
	}
}

func (w *unitWatch) stop() { w.cancel(); <-w.done }

// unitMark is where a phase starts in the watch's records.
type unitMark struct{ events, writes int }

func (w *unitWatch) mark() unitMark {
	w.mu.Lock()
	defer w.mu.Unlock()
	return unitMark{len(w.events), len(w.ownerWrites)}
}

func (w *unitWatch) since(m unitMark) []unitAt {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.events[m.events:])
}

func (w *unitWatch) owners() map[int]string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[int]string, len(w.held))
	for s, o := range w.held {
		out[s] = o
	}
	return out
}

// waitConverged waits until every shard is owned by one of ids and
// shard.Assign keeps each where it is, and returns the receipt of the
// event that made it so.
func (w *unitWatch) waitConverged(ids []string, shards int, timeout time.Duration) (time.Time, error) {
	var at time.Time
	seen := -1
	err := waitUntil(timeout, func() bool {
		w.mu.Lock()
		n := len(w.events)
		if n == seen || w.err != nil {
			w.mu.Unlock()
			return w.err != nil
		}
		seen = n
		if n > 0 {
			at = w.events[n-1].at
		}
		w.mu.Unlock()
		return converged(w.owners(), ids, shards)
	})
	if err == nil {
		w.mu.Lock()
		err = w.err
		w.mu.Unlock()
	}
	if err != nil {
		return at, fmt.Errorf("ownership not converged: %w", err)
	}
	return at, nil
}

// counts are the changes of hands since m, timed from start; before is
// the ownership at the phase's start.
func (w *unitWatch) counts(m unitMark, start time.Time, before map[int]string) unitCounts {
	w.mu.Lock()
	events := slices.Clone(w.events[m.events:])
	u := unitCounts{OwnerKeyWrites: len(w.ownerWrites) - m.writes}
	w.mu.Unlock()
	per := map[int]int{}
	for _, ev := range events {
		u.LastChangeS = ev.at.Sub(start).Seconds()
		if !ev.Acquired {
			u.Releases++
			continue
		}
		u.Acquisitions++
		per[ev.Shard]++
		if before[ev.Shard] != "" || per[ev.Shard] > 1 {
			u.Moves++
		}
	}
	u.ShardsAcquired = len(per)
	for _, n := range per {
		u.MaxPerShard = max(u.MaxPerShard, n)
		if n > 1 {
			u.MovedMoreThanOnce++
		}
	}
	u.NetMoved = moved(before, w.owners())
	return u
}

// describeUnits says, for a failed wait, how many shards each runner owns
// and the end of each runner's log.
func (c *cluster) describeUnits(w *unitWatch, ids []string) string {
	per := map[string]int{}
	owners := w.owners()
	for _, id := range owners {
		per[id]++
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d of %d shards owned; per owner: %v\n", len(owners), c.shards, per)
	for _, r := range c.runners {
		if slices.Contains(ids, r.id) {
			fmt.Fprintf(&b, "--- %s\n%s\n", r.id, linewriter.Tail(r.logs.String(), 5))
		}
	}
	return b.String()
}

// printStartup adds the startup section's rows.
func printStartup(w io.Writer, s *startupResult) {
	if c := s.Cold; c != nil && len(c.BucketsPerS) > 0 {
		fmt.Fprintf(w, "| startup: %d runners over %d shards spawned at once on %s noop tasks | full speed (a 100 ms bucket at ≥ %.0f%% of steady) after **%s** (sustained %s); "+
			"overall %.0f tasks/s from the first spawn, steady %.0f; first claim %.2fs, all ready %.2fs; %d units moved beyond the first %d acquisitions, "+
			"%d shards acquired more than once (at most %d times), last change of hands %.2fs |\n",
			s.Runners, s.Shards, fmtThousands(c.Tasks), startupFull*100, fmtSeconds(c.FullSpeedS), fmtSeconds(c.SustainedS), c.OverallPerS, c.SteadyPerS,
			c.FirstClaimS, c.AllReadyS, c.Units.Moves, c.Units.ShardsAcquired, c.Units.MovedMoreThanOnce, c.Units.MaxPerShard, c.Units.LastChangeS)
	}
	if j := s.Join; j != nil && len(j.BucketsPerS) > 0 {
		fmt.Fprintf(w, "| startup: runner %d joins %d draining %s noop tasks | before %.0f tasks/s, dip %.0f (%.2f), after %.0f (%.2f); new steady rate %s after the spawn; "+
			"converged %.2fs; %d units moved (bound %d), %d shards acquired more than once |\n",
			j.Runners+1, j.Runners, fmtThousands(j.Tasks), j.BeforePerS, j.DipPerS, j.DipRatio, j.AfterPerS, j.Step, fmtSeconds(j.SteadyAgainS),
			j.Units.ConvergedS, j.Units.Moves, j.Units.Bound, j.Units.MovedMoreThanOnce)
	}
}

// startupTargets (issue 35): runners started together on a backlog at
// full speed within a second.
func startupTargets(s *startupResult) []target {
	t := target{Measure: "runners started at once on a backlog: time to full speed (first 100 ms at ≥ 90% of the converged rate)", Target: "≤ 1 s", Status: notMeasured}
	if s == nil || s.Cold == nil || len(s.Cold.BucketsPerS) == 0 {
		return []target{t}
	}
	c := s.Cold
	t.Measure = fmt.Sprintf("%d runners over %d shards started at once on a backlog: time to full speed (first 100 ms at ≥ 90%% of the converged rate)", s.Runners, s.Shards)
	t.Measured = fmt.Sprintf("%s (sustained %s); overall %.0f tasks/s against %.0f steady; %d units moved", fmtSeconds(c.FullSpeedS), fmtSeconds(c.SustainedS),
		c.OverallPerS, c.SteadyPerS, c.Units.Moves)
	t.Status = verdict(c.FullSpeedS >= 0 && c.FullSpeedS <= 1)
	return []target{t}
}
