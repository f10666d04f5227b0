package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/store"
)

// idleFlags are the idle section's settings.
var idleFlags = struct {
	queues  string
	seconds int
	shards  int
}{queues: "1,200,1000,2000", seconds: 20, shards: 256}

// idleRun is what one idle runner serving Queues queues costs (finding 5
// of the hostile-input review: the cost grew with the queues served).
type idleRun struct {
	Queues int `json:"queues"`
	Shards int `json:"shards"`
	// Refused is the runner's one line when it refused the queues (over
	// the limit of --queues); nothing was measured then.
	Refused string `json:"refused,omitempty"`
	// PostgresCPUPct and RunnerCPUPct are % of one core over the window:
	// every PostgreSQL process (the postmaster and its children, from
	// /proc/<pid>/stat) and the runner process.
	PostgresCPUPct float64 `json:"pg_cpu_pct_of_core"`
	RunnerCPUPct   float64 `json:"runner_cpu_pct_of_core"`
	RunnerRSSMiB   float64 `json:"runner_rss_mib"`
	// Statements per second the runner sent (pg_stat_statements calls in
	// the trial's database), in all and by name (/* shardrun.<name> */).
	StatementsPerS float64            `json:"pg_statements_per_s,omitempty"`
	ByName         map[string]float64 `json:"pg_statements_per_s_by_name,omitempty"`
}

// idleSection starts one runner over idleFlags.shards shards, serving 1,
// 200... queues in turn (default, then q0001, q0002...), with no task
// anywhere, and measures what it costs once it owns every shard; then the
// idle fleets of -idle-fleets (idlefleet.go). An empty -idle-queues skips
// the queue counts.
func (e *env) idleSection(ctx context.Context, rep *Report) error {
	if err := e.idleQueues(ctx, rep); err != nil {
		return err
	}
	return e.idleFleetSection(ctx, rep)
}

func (e *env) idleQueues(ctx context.Context, rep *Report) error {
	if strings.TrimSpace(idleFlags.queues) == "" {
		return nil
	}
	var runs []idleRun
	for _, f := range strings.Split(idleFlags.queues, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return fmt.Errorf("-idle-queues: %q is not a positive number", f)
		}
		r, err := e.idleRun(ctx, n)
		if err != nil {
			return err
		}
		runs = append(runs, r)
		if r.Refused != "" {
			fmt.Fprintf(e.log, "  %d queues: refused: %s\n", n, r.Refused)
			continue
		}
		fmt.Fprintf(e.log, "  %d queues: PostgreSQL %.1f%% of a core, runner %.1f%%, RSS %.0f MiB, %.1f statements/s %v\n",
			n, r.PostgresCPUPct, r.RunnerCPUPct, r.RunnerRSSMiB, r.StatementsPerS, r.ByName)
	}
	rep.Idle = runs
	rep.Settings["idle"] = map[string]any{"window_s": idleFlags.seconds, "shard_count": idleFlags.shards, "runners": 1,
		"poll_interval": "1s (default)", "kinds": "the runner's built-in handlers"}
	return nil
}

func (e *env) idleRun(ctx context.Context, n int) (idleRun, error) {
	r := idleRun{Queues: n, Shards: idleFlags.shards}
	dsn, err := e.database(ctx, fmt.Sprintf("idle_%d", n))
	if err != nil {
		return r, err
	}
	st, err := store.Open(ctx, dsn, store.Options{})
	if err != nil {
		return r, err
	}
	err = st.Migrate(ctx)
	db := st.Pool().Config().ConnConfig.Database
	st.Close()
	if err != nil {
		return r, err
	}
	names := []string{"default"}
	for i := 1; i < n; i++ {
		names = append(names, fmt.Sprintf("q%04d", i))
	}
	cl := e.newCluster(fmt.Sprintf("idle-%d-%d", n, time.Now().UnixNano()), dsn, idleFlags.shards)
	defer cl.stop()
	rp, err := cl.spawn("runner-1", runnerOpts{leaseTTL: 10 * time.Second, queues: strings.Join(names, ",")})
	if err != nil {
		return r, err
	}
	exited := false
	err = waitUntil(60*time.Second, func() bool {
		select {
		case e := <-rp.done:
			rp.done <- e // cluster.stop waits for it
			exited = true
			return true
		default:
			return httpStatus("http://"+rp.admin+"/readyz") == 200
		}
	})
	if exited {
		if line, ok := refusal(rp.logs.String()); ok {
			r.Refused = line
			return r, nil
		}
		return r, fmt.Errorf("runner exited:\n%s", linewriter.Tail(rp.logs.String(), 20))
	}
	if err != nil {
		return r, fmt.Errorf("runner not ready: %w\n%s", err, linewriter.Tail(rp.logs.String(), 20))
	}
	if err := waitUntil(60*time.Second, func() bool { return rp.metric("shardrun_shards_owned") == float64(idleFlags.shards) }); err != nil {
		return r, fmt.Errorf("runner owns %v shards of %d: %w", rp.metric("shardrun_shards_owned"), idleFlags.shards, err)
	}
	time.Sleep(3 * time.Second) // settle: the first claims of newly held shards, then idle polls
	pm, err := e.postmasterPID(ctx)
	if err != nil {
		return r, err
	}
	before, err := readProcStat(rp.cmd.Process.Pid)
	if err != nil {
		return r, err
	}
	calls0, err := e.statementCalls(ctx, db)
	if err != nil {
		return r, err
	}
	pgc := startPGCPU(pm)
	began := time.Now()
	time.Sleep(time.Duration(idleFlags.seconds) * time.Second) // a fixed measurement window, not a wait for a condition
	pgCPU := pgc.stop()
	after, err := readProcStat(rp.cmd.Process.Pid)
	if err != nil {
		return r, err
	}
	window := time.Since(began).Seconds()
	calls1, err := e.statementCalls(ctx, db)
	if err != nil {
		return r, err
	}
	r.PostgresCPUPct = pgCPU / window * 100
	r.RunnerCPUPct = (after.cpu - before.cpu) / window * 100
	r.RunnerRSSMiB = rp.metric("process_resident_memory_bytes") / (1 << 20)
	if calls1 != nil {
		r.ByName = map[string]float64{}
		for name, c := range calls1 {
			if d := float64(c-calls0[name]) / window; d > 0 {
				r.ByName[name] = d
				r.StatementsPerS += d
			}
		}
	}
	return r, nil
}

// refusal is the runner's own line when it exited refusing --queues.
func refusal(logs string) (string, bool) {
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, "--queues") {
			return strings.TrimSpace(line), true
		}
	}
	return "", false
}

// statementCalls are the calls of each statement of the database db so
// far, by the name in its leading /* shardrun.<name> */ comment (other:
// the rest); nil without pg_stat_statements.
func (e *env) statementCalls(ctx context.Context, db string) (map[string]int64, error) {
	if !e.statStatements {
		return nil, nil
	}
	conn, err := pgx.Connect(ctx, e.pg.DSN("postgres"))
	if err != nil {
		return nil, fmt.Errorf("connecting to read pg_stat_statements: %w", err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT coalesce(substring(query from '/\* shardrun\.([a-z_]+) \*/'), 'other'), sum(calls)::bigint
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1) GROUP BY 1`, db)
	if err != nil {
		return nil, fmt.Errorf("reading pg_stat_statements: %w", err)
	}
	out := map[string]int64{}
	for rows.Next() {
		var name string
		var calls int64
		if err := rows.Scan(&name, &calls); err != nil {
			return nil, err
		}
		out[name] = calls
	}
	return out, rows.Err()
}

func printIdle(w io.Writer, runs []idleRun) {
	for _, r := range runs {
		if r.Refused != "" {
			fmt.Fprintf(w, "| idle runner, %d shards, %d queues | refused: %s |\n", r.Shards, r.Queues, r.Refused)
			continue
		}
		fmt.Fprintf(w, "| idle runner, %d shards, %d queues | PostgreSQL %.1f%% of a core, runner %.1f%%, RSS %.0f MiB, %.1f statements/s |\n",
			r.Shards, r.Queues, r.PostgresCPUPct, r.RunnerCPUPct, r.RunnerRSSMiB, r.StatementsPerS)
	}
}
