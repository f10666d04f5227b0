package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/shardrun/shardrun/internal/linewriter"
)

// idleFleetFlags are the idle section's fleet rows (issue 41: an idle
// fleet's cost must not grow with its runners or its shards).
var idleFleetFlags = struct {
	// fleets are "RUNNERSxSHARDS" pairs; a fleet of at least 10 runners
	// is measured uniform and mixed, a smaller one uniform only (the mixed
	// fleet's five capability sets need 10).
	fleets  string
	seconds int
}{fleets: "1x256,16x256,1x4096,16x4096", seconds: 15}

// idleFleetRun is what an idle fleet costs: Runners runners over Shards
// shards, every unit owned and no task anywhere. The fleets are those of
// the mixed section (its -mixed-queues queues and -mixed-kinds kinds, each
// runner a child of the bench binary): uniform, every runner serving every
// queue and kind, one group; or mixed, five capability sets, each group
// owning every shard, so that the fleet holds Shards × groups units.
type idleFleetRun struct {
	Fleet   string `json:"fleet"`
	Runners int    `json:"runners"`
	Shards  int    `json:"shards"`
	// Units are the (shard, group) units the fleet owns.
	Units   int     `json:"units"`
	Seconds float64 `json:"window_s"`
	// PostgresCPUPct is every PostgreSQL process's CPU over the window,
	// % of one core; RunnerCPUPct the runners' summed.
	PostgresCPUPct float64 `json:"pg_cpu_pct_of_core"`
	RunnerCPUPct   float64 `json:"runners_cpu_pct_of_core"`
	// Statements the fleet sent per second (pg_stat_statements), in all,
	// per runner and by name; pages (shared hits and reads) per second, in
	// all and of the claim statements.
	StatementsPerS          float64            `json:"pg_statements_per_s"`
	StatementsPerRunnerPerS float64            `json:"pg_statements_per_runner_per_s"`
	ByName                  map[string]float64 `json:"pg_statements_per_s_by_name,omitempty"`
	PagesPerS               float64            `json:"pg_pages_per_s"`
	ClaimPagesPerS          float64            `json:"pg_claim_pages_per_s"`
	// MachineBusyPct is the whole machine's CPU over the window, % of one
	// core (of 100 × cores): how much the others' load may have disturbed it.
	MachineBusyPct float64 `json:"machine_busy_pct"`
}

// idleFleetSection measures each fleet of -idle-fleets, uniform and (from
// 10 runners) mixed.
func (e *env) idleFleetSection(ctx context.Context, rep *Report) error {
	if strings.TrimSpace(idleFleetFlags.fleets) == "" {
		return nil
	}
	var runs []idleFleetRun
	for _, f := range strings.Split(idleFleetFlags.fleets, ",") {
		rs, ss, ok := strings.Cut(strings.TrimSpace(f), "x")
		runners, err1 := strconv.Atoi(rs)
		shards, err2 := strconv.Atoi(ss)
		if !ok || err1 != nil || err2 != nil || runners < 1 || shards < 1 {
			return fmt.Errorf("-idle-fleets: %q is not RUNNERSxSHARDS", f)
		}
		o := mixedFlags
		o.runners, o.shards = runners, shards
		fleets := map[string][]capSet{"uniform": uniformSets(o)}
		names := []string{"uniform"}
		if runners >= 10 {
			sets, err := mixedSets(o)
			if err != nil {
				return err
			}
			fleets["mixed"] = sets
			names = append(names, "mixed")
		}
		for _, name := range names {
			r, err := e.idleFleetRun(ctx, name, fleets[name], o)
			if err != nil {
				return fmt.Errorf("idle %s fleet of %d runners over %d shards: %w", name, runners, shards, err)
			}
			runs = append(runs, r)
			fmt.Fprintf(e.log, "  idle %s fleet, %d runners, %d shards (%d units): PostgreSQL %.1f%% of a core, runners %.1f%%, "+
				"%.1f statements/s (%.2f per runner) %v, %.0f pages/s (claims %.0f); machine %.0f%% of %d\n",
				r.Fleet, r.Runners, r.Shards, r.Units, r.PostgresCPUPct, r.RunnerCPUPct, r.StatementsPerS, r.StatementsPerRunnerPerS,
				r.ByName, r.PagesPerS, r.ClaimPagesPerS, r.MachineBusyPct, 100*runtime.NumCPU())
		}
	}
	rep.IdleFleets = runs
	rep.Settings["idle_fleets"] = map[string]any{"window_s": idleFleetFlags.seconds, "queues": mixedFlags.queues, "kinds": mixedFlags.kinds,
		"max_workers": mixedFlags.maxWorkers, "db_max_conns": mixedDBConns, "poll_interval": "1s (default)",
		"settle": "3s after every unit is owned"}
	return nil
}

func (e *env) idleFleetRun(ctx context.Context, fleet string, sets []capSet, o mixedOpts) (r idleFleetRun, err error) {
	r = idleFleetRun{Fleet: fleet, Runners: o.runners, Shards: o.shards, Units: o.shards * len(sets)}
	st, dsn, drop, err := e.trialStore(ctx, fmt.Sprintf("idle_%s_%d_%d", fleet, o.runners, o.shards), 2)
	if err != nil {
		return r, err
	}
	defer func() {
		if derr := drop(); err == nil {
			err = derr
		}
	}()
	c := e.newCluster(fmt.Sprintf("idle-%s-%d-%d-%d", fleet, o.runners, o.shards, time.Now().UnixNano()), dsn, o.shards)
	defer c.stop()
	for _, s := range sets {
		for _, id := range s.ids() {
			if _, err := c.spawn(id, s.opts(o, o.maxWorkers)); err != nil {
				return r, err
			}
		}
	}
	for _, rp := range c.runners {
		if err := rp.waitReady(); err != nil {
			return r, err
		}
	}
	if err := waitUntil(120*time.Second, func() bool { return c.sumMetric("shardrun_shards_owned") == float64(r.Units) }); err != nil {
		var tail string
		if len(c.runners) > 0 {
			tail = linewriter.Tail(c.runners[0].logs.String(), 10)
		}
		return r, fmt.Errorf("the fleet owns %v units of %d: %w\n%s", c.sumMetric("shardrun_shards_owned"), r.Units, err, tail)
	}
	time.Sleep(3 * time.Second) // settle: the first claims of newly held shards, then idle polls
	pm, err := e.postmasterPID(ctx)
	if err != nil {
		return r, err
	}
	db := st.Pool().Config().ConnConfig.Database
	before, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	calls0, err := e.statementCalls(ctx, db)
	if err != nil {
		return r, err
	}
	machine0, err := machineBusy()
	if err != nil {
		return r, err
	}
	cpu0 := c.sumMetric("process_cpu_seconds_total")
	pgc := startPGCPU(pm)
	began := time.Now()
	time.Sleep(time.Duration(idleFleetFlags.seconds) * time.Second) // a fixed measurement window, not a wait for a condition
	pgCPU := pgc.stop()
	r.Seconds = time.Since(began).Seconds()
	cpu1 := c.sumMetric("process_cpu_seconds_total")
	machine1, err := machineBusy()
	if err != nil {
		return r, err
	}
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	calls1, err := e.statementCalls(ctx, db)
	if err != nil {
		return r, err
	}
	r.PostgresCPUPct = pgCPU / r.Seconds * 100
	r.RunnerCPUPct = (cpu1 - cpu0) / r.Seconds * 100
	r.MachineBusyPct = (machine1 - machine0) / r.Seconds * 100
	r.StatementsPerS = float64(after.stmts-before.stmts) / r.Seconds
	r.StatementsPerRunnerPerS = r.StatementsPerS / float64(o.runners)
	r.PagesPerS = float64(after.blocks-before.blocks) / r.Seconds
	r.ClaimPagesPerS = float64(after.claimBlocks-before.claimBlocks) / r.Seconds
	if calls1 != nil {
		r.ByName = map[string]float64{}
		for name, n := range calls1 {
			if d := float64(n-calls0[name]) / r.Seconds; d > 0 {
				r.ByName[name] = d
			}
		}
	}
	return r, nil
}

func printIdleFleets(w io.Writer, runs []idleFleetRun) {
	for _, r := range runs {
		fmt.Fprintf(w, "| idle %s fleet, %d runners, %d shards (%d units) | PostgreSQL %.1f%% of a core; %.1f statements/s (%.2f per runner); %.0f pages/s (claims %.0f); runners %.1f%% of a core; machine %.0f%% |\n",
			r.Fleet, r.Runners, r.Shards, r.Units, r.PostgresCPUPct, r.StatementsPerS, r.StatementsPerRunnerPerS, r.PagesPerS, r.ClaimPagesPerS,
			r.RunnerCPUPct, r.MachineBusyPct)
	}
}
