package main

// The outage section (issue 39): how soon the first task starts after a
// PostgreSQL restart, and how long a failover takes when the runner that
// fails holds a handler's transaction open (frozen with it, SIGSTOP).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// outageFlags are the outage section's settings.
var outageFlags = struct {
	// trials of the restart row; freezeTrials of the frozen-transaction
	// row at each lease TTL of ttls.
	trials, freezeTrials int
	// tasks are the noop tasks enqueued once the restarted server accepts
	// connections; down is how long it stays down.
	tasks int
	down  time.Duration
	ttls  string
	// rate is the effect tasks/s enqueued throughout a frozen-transaction
	// trial; shards its cluster's shard count; hold the held transaction's
	// hold_ms; bound how long a trial waits for the failover.
	rate   int
	shards int
	hold   time.Duration
	bound  time.Duration
	// logs, when set, is a directory for the runners' logs of each
	// restart trial, headed by the postmaster's start time.
	logs string
}{trials: 9, freezeTrials: 3, tasks: 300, down: 2 * time.Second, ttls: "10s,2s", rate: 200, shards: 256,
	hold: 60 * time.Second, bound: 90 * time.Second}

// outageResult is the section's report.
type outageResult struct {
	RunnerBinary   string          `json:"runner_binary"`
	TxWorkerBinary string          `json:"txworker_binary,omitempty"`
	Restart        *restartOutage  `json:"first_task_after_postgres_restart,omitempty"`
	Freeze         []*freezeOutage `json:"failover_with_frozen_open_transaction,omitempty"`
	Notes          []string        `json:"notes"`
}

// restartOutage is the first row: three idle runners, PostgreSQL restarted
// under them, a batch of noop tasks enqueued as soon as it accepts
// connections again.
type restartOutage struct {
	Runners int            `json:"runners"`
	Shards  int            `json:"shards"`
	Tasks   int            `json:"tasks"`
	DownFor string         `json:"down_for"`
	Trials  []restartTrial `json:"trials"`
	// FirstStart is min(claimed_at) - pg_postmaster_start_time() of the
	// tasks claimed after the restart (the measure);
	// EnqueueToFirstStart is min(claimed_at) - min(created_at).
	FirstStart          latencies `json:"first_start_after_postgres_start"`
	EnqueueToFirstStart latencies `json:"enqueue_to_first_start"`
	Accepted            latencies `json:"first_accepted_after_postgres_start"`
	AfterAccepted       latencies `json:"first_start_after_first_accepted"`
	LastRunnerFirst     latencies `json:"last_runner_first_start_after_postgres_start"`
	AllCompleted        latencies `json:"all_completed_after_postgres_start"`
}

// restartTrial is one restart; every time is in seconds after
// pg_postmaster_start_time() of the restarted server unless it says
// otherwise (the bench, the runners and PostgreSQL share the machine's
// clock).
type restartTrial struct {
	// OutageS is from the bench's stop signal to the server accepting
	// connections again, as the bench saw it.
	OutageS float64 `json:"outage_s"`
	// AcceptingS is when the bench's first connection succeeded (pgtmp
	// retries every 25 ms), FirstBackendS the earliest backend_start of a
	// runner's connection, and FirstAcceptedS the earlier of the two: the
	// server was back by then. EnqueuedS is the enqueue's created_at (its
	// transaction's start); EnqueueAttempts how many tries it took.
	AcceptingS      float64 `json:"accepting_s"`
	FirstBackendS   float64 `json:"first_runner_backend_s"`
	FirstAcceptedS  float64 `json:"first_accepted_s"`
	EnqueuedS       float64 `json:"enqueued_s"`
	EnqueueAttempts int     `json:"enqueue_attempts"`
	// ListenersS is the backend_start of each runner's LISTEN connection,
	// PoolS of each runner's first other connection (pg_stat_activity,
	// read once every task completed): when they were back.
	ListenersS []float64 `json:"listeners_connected_s"`
	PoolS      []float64 `json:"first_pool_connection_s"`
	// FirstStartS is the first claim; FirstBy the runner that made it.
	FirstStartS float64 `json:"first_start_s"`
	FirstBy     string  `json:"first_start_by"`
	// FirstStartAfterAcceptedS is FirstStartS - FirstAcceptedS: the
	// runners' and the enqueue's share, without the server's own start.
	FirstStartAfterAcceptedS float64 `json:"first_start_after_accepted_s"`
	EnqueueToFirstStartS     float64 `json:"enqueue_to_first_start_s"`
	// RunnersFirstS is each runner's first claim (by runner id), and
	// LastRunnerFirstS the latest of them: when every runner worked again.
	RunnersFirstS    []float64 `json:"each_runner_first_start_s"`
	LastRunnerFirstS float64   `json:"last_runner_first_start_s"`
	AllCompletedS    float64   `json:"all_completed_s"`
	// Detaches counts the runners' detach lines after the stop: an outage
	// of PostgreSQL alone must cost none.
	Detaches int `json:"runner_detaches"`
}

// freezeOutage is the second row at one lease TTL.
type freezeOutage struct {
	LeaseTTL string        `json:"lease_ttl"`
	Shards   int           `json:"shards"`
	Rate     int           `json:"effect_tasks_per_s"`
	HoldMS   int           `json:"hold_ms"`
	BoundS   float64       `json:"bound_s"`
	Trials   []freezeTrial `json:"trials"`
	// Owned: every shard of A's owned by B; Done: also a task enqueued
	// after the freeze completed by B on each of them (the row's measure);
	// a trial that did not get there within the bound counts as the bound.
	Owned latencies `json:"a_shards_owned_by_b"`
	Done  latencies `json:"a_shards_working_again"`
}

// freezeTrial is one freeze of runner A holding a handler's transaction
// open. Times are seconds after the SIGSTOP.
type freezeTrial struct {
	MovedShards int `json:"a_shards"`
	// OwnedS: every one of A's shards owned by B (-1: not within the
	// bound).
	OwnedS float64 `json:"owned_s"`
	// DoneS: B completed the probe task (one per shard, enqueued right
	// after the SIGSTOP) of every one of A's shards; TimedOut when it had
	// not within the bound (DoneS is then the bound), with DoneByBound of
	// them done by then.
	DoneS       float64 `json:"done_s"`
	TimedOut    bool    `json:"timed_out,omitempty"`
	DoneByBound int     `json:"a_shards_done_by_bound"`
	// OwnDoneS: the same for the probes of B's own shards, whether a
	// stall of the takeover reaches them too; -1 when not within the
	// bound.
	OwnDoneS float64 `json:"b_shards_done_s"`
	// LockWaits, when the bound passed: the statements then waiting for a
	// lock (pg_stat_activity), by their /* shardrun.<name> */ comment or
	// their start, with the state of what blocks them.
	LockWaits []string `json:"lock_waits_at_bound,omitempty"`
	// AfterKillS: when the bound passed, how long after A's SIGKILL every
	// probe of A's shards completed (-1: not within another bound).
	AfterKillS float64 `json:"done_after_kill_s,omitempty"`
	// The held task: when it completed (after the SIGSTOP), at which
	// attempt, whether only after A's SIGKILL, and its effect rows (1:
	// the held transaction rolled back, the retry committed).
	HeldID         int64   `json:"held_task"`
	HeldDoneS      float64 `json:"held_done_s"`
	HeldAttempt    int     `json:"held_attempt"`
	HeldAfterKill  bool    `json:"held_done_only_after_kill,omitempty"`
	HeldEffectRows int     `json:"held_effect_rows"`
	// DoubleEffects counts tasks with more than one effect row (a task
	// completed twice); LoadErrors the steady load's failed enqueues.
	DoubleEffects int   `json:"tasks_with_two_effect_rows"`
	LoadEnqueued  int64 `json:"load_enqueued"`
	LoadErrors    int64 `json:"load_enqueue_errors"`
}

func (e *env) outageSection(ctx context.Context, rep *Report) error {
	out := &outageResult{RunnerBinary: e.runnerBin, TxWorkerBinary: e.txworkerBin}
	rep.Outage = out
	out.Notes = append(out.Notes,
		"first task after a PostgreSQL restart: three bin/runner processes over 256 shards (lease TTL 10 s, poll interval 1 s), idle and attached; the bench's throwaway server is stopped (SIGINT, fast shutdown), kept down for down_for and started again on the same port and data; as soon as the bench connects, it enqueues the noop tasks in one batch (client.EnqueueBatch, notified after the commit). first_start is min(claimed_at) - pg_postmaster_start_time() over the tasks claimed after the restart (the query of integration's TestPostgresOutageCostsNoWork), which includes the server's own start; first_accepted is the earlier of the bench's first connection and the earliest backend_start of a runner's connection, first_start_after_first_accepted the rest; enqueue_to_first_start is min(claimed_at) - min(created_at); each trial a fresh database and cluster, migrated by the runners (so an older build runs on its own schema)",
		fmt.Sprintf("failover with a frozen open transaction: two txworker processes (internal/cmd/txworker) of one group over %d shards, a steady load of %d effect tasks/s from the bench; runner A (tx-1) takes a task of its own shard that holds its transaction open after CompleteTx (hold_ms %d, hold_attempts 1); at its 'holding' line A is frozen (SIGSTOP) and one probe task is enqueued on every shard. owned: every shard A owned is owned by B in etcd; working again (the row's measure): B has also completed the probe of every one of A's shards, from finished_at, against the SIGSTOP; a trial waits at most bound_s, and a failover not done by then is reported as '> bound'. A is SIGKILLed at the end of each trial, then the held task must complete with exactly one effect row", outageFlags.shards, outageFlags.rate, outageFlags.hold.Milliseconds()))
	var errs []error
	if outageFlags.trials > 0 {
		if r, err := e.restartOutage(ctx); err != nil {
			errs = append(errs, fmt.Errorf("first task after a restart: %w", err))
		} else {
			out.Restart = r
		}
	}
	if outageFlags.freezeTrials <= 0 {
		return errors.Join(errs...)
	}
	if e.txworkerBin == "" {
		errs = append(errs, errors.New("failover with a frozen open transaction: no txworker binary (-txworker)"))
		return errors.Join(errs...)
	}
	for _, f := range strings.Split(outageFlags.ttls, ",") {
		ttl, err := time.ParseDuration(strings.TrimSpace(f))
		if err != nil || ttl <= 0 {
			return errors.Join(append(errs, fmt.Errorf("-outage-ttls: %q is not a duration", f))...)
		}
		r, err := e.freezeOutage(ctx, ttl)
		if r != nil {
			out.Freeze = append(out.Freeze, r)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("failover with a frozen open transaction, lease TTL %s: %w", ttl, err))
			if ctx.Err() != nil {
				break
			}
		}
	}
	return errors.Join(errs...)
}

// outageStore creates a fresh database and opens a store and a client on
// it without migrating it: the runners migrate it with their own build's
// migrations. drop closes the store and drops the database.
func (e *env) outageStore(ctx context.Context, name string, shards int) (st *store.Store, client *srclient.Tasks, dsn string, drop func() error, err error) {
	if dsn, err = e.database(ctx, name); err != nil {
		return nil, nil, "", nil, err
	}
	if st, err = store.Open(ctx, dsn, store.Options{MaxConns: 4}); err != nil {
		return nil, nil, "", nil, err
	}
	db := st.Pool().Config().ConnConfig.Database
	drop = func() error {
		st.Close()
		return e.dropDatabase(context.WithoutCancel(ctx), db)
	}
	if client, err = srclient.New(st, srclient.Config{ShardCount: shards}); err != nil {
		_ = drop()
		return nil, nil, "", nil, err
	}
	return st, client, dsn, drop, nil
}

func (e *env) restartOutage(ctx context.Context) (*restartOutage, error) {
	r := &restartOutage{Runners: 3, Shards: 256, Tasks: outageFlags.tasks, DownFor: outageFlags.down.String()}
	var first, enqToFirst, accepted, afterAccepted, lastRunner, all []float64
	for trial := range outageFlags.trials {
		t, err := e.restartTrial(ctx, trial)
		if err != nil {
			return nil, fmt.Errorf("trial %d: %w", trial+1, err)
		}
		r.Trials = append(r.Trials, t)
		first, enqToFirst = append(first, t.FirstStartS), append(enqToFirst, t.EnqueueToFirstStartS)
		accepted, afterAccepted = append(accepted, t.FirstAcceptedS), append(afterAccepted, t.FirstStartAfterAcceptedS)
		lastRunner, all = append(lastRunner, t.LastRunnerFirstS), append(all, t.AllCompletedS)
		fmt.Fprintf(e.log, "  restart trial %d: down %.2fs; after the postmaster started: the bench connected %.3fs, a runner %.3fs, enqueued %.3fs, listeners back %ss, first pool connections %ss, first task %.3fs (%s; %.3fs after the first accepted connection), each runner's first %ss, all %d done %.3fs; enqueue -> first start %.3fs; %d detaches\n",
			trial+1, t.OutageS, t.AcceptingS, t.FirstBackendS, t.EnqueuedS, fmtList3(t.ListenersS), fmtList3(t.PoolS), t.FirstStartS, t.FirstBy,
			t.FirstStartAfterAcceptedS, fmtList3(t.RunnersFirstS), r.Tasks, t.AllCompletedS, t.EnqueueToFirstStartS, t.Detaches)
	}
	r.FirstStart = summarize("first task claimed after the restart, from pg_postmaster_start_time()", "", first)
	r.EnqueueToFirstStart = summarize("enqueue (created_at, once the server accepts connections) to the first claim", "", enqToFirst)
	r.Accepted = summarize("the first connection the restarted server accepted (the bench's or a runner's), after pg_postmaster_start_time()", "", accepted)
	r.AfterAccepted = summarize("first task claimed after the restart, from the first accepted connection", "", afterAccepted)
	r.LastRunnerFirst = summarize("every runner's first task after the restart, from pg_postmaster_start_time()", "", lastRunner)
	r.AllCompleted = summarize("every task enqueued after the restart completed, from pg_postmaster_start_time()", "", all)
	return r, nil
}

func (e *env) restartTrial(ctx context.Context, trial int) (t restartTrial, err error) {
	st, client, dsn, drop, err := e.outageStore(ctx, "outage_restart", 256)
	if err != nil {
		return t, err
	}
	defer func() {
		if derr := drop(); err == nil {
			err = derr
		}
	}()
	c, err := e.threeRunners(ctx, dsn, trial, 10*time.Second, false)
	if err != nil {
		return t, err
	}
	defer c.stop()
	// Idle: the claim loops wait out their poll, as in a quiet cluster.
	time.Sleep(time.Second)
	stopped := time.Now()
	if err := e.pg.Restart(ctx, outageFlags.down); err != nil {
		return t, fmt.Errorf("restarting PostgreSQL: %w", err)
	}
	up := time.Now()
	// The pool's connections died with the server: new ones, at once.
	st.Pool().Reset()
	batch := make([]tasks.NewTask, outageFlags.tasks)
	for i := range batch {
		batch[i] = tasks.NewTask{Kind: "noop"}
	}
	for {
		t.EnqueueAttempts++
		_, err = client.EnqueueBatch(ctx, batch)
		if err == nil {
			break
		}
		if time.Since(up) > 10*time.Second {
			return t, fmt.Errorf("enqueueing after the restart: %w", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	pool := st.Pool()
	if err := waitEvery(30*time.Second, 20*time.Millisecond, func() bool {
		var n int
		err := pool.QueryRow(ctx, `/* bench */ SELECT count(*) FROM task_view WHERE state = 'completed'`).Scan(&n)
		return err == nil && n == outageFlags.tasks
	}); err != nil {
		var states string
		_ = pool.QueryRow(ctx, `/* bench */ SELECT string_agg(state || ' ' || n, ', ') FROM (SELECT state, count(*) n FROM task_view GROUP BY state) s`).Scan(&states)
		return t, fmt.Errorf("the %d tasks enqueued after the restart did not all complete: %w (%s)", outageFlags.tasks, err, states)
	}
	var start, created, claimed, finished time.Time
	if err := pool.QueryRow(ctx, `/* bench */ SELECT pg_postmaster_start_time(), min(created_at), min(claimed_at), max(finished_at),
			(array_agg(claimed_by ORDER BY claimed_at))[1]
		FROM task_view WHERE claimed_at > pg_postmaster_start_time()`).Scan(&start, &created, &claimed, &finished, &t.FirstBy); err != nil {
		return t, fmt.Errorf("reading the claims after the restart: %w", err)
	}
	since := func(at time.Time) float64 { return at.Sub(start).Seconds() }
	firsts, err := pool.Query(ctx, `/* bench */ SELECT min(claimed_at) FROM task_view
		WHERE claimed_at > pg_postmaster_start_time() GROUP BY claimed_by ORDER BY claimed_by`)
	if err != nil {
		return t, fmt.Errorf("reading each runner's first claim: %w", err)
	}
	byRunner, err := pgx.CollectRows(firsts, pgx.RowTo[time.Time])
	if err != nil {
		return t, fmt.Errorf("reading each runner's first claim: %w", err)
	}
	for _, at := range byRunner {
		t.RunnersFirstS = append(t.RunnersFirstS, since(at))
		t.LastRunnerFirstS = max(t.LastRunnerFirstS, since(at))
	}
	t.OutageS = up.Sub(stopped).Seconds()
	t.AcceptingS, t.EnqueuedS, t.FirstStartS, t.AllCompletedS = since(up), since(created), since(claimed), since(finished)
	t.EnqueueToFirstStartS = claimed.Sub(created).Seconds()
	// A listener still in its backoff has no connection yet: wait for
	// every runner's (its backend_start is read below).
	_ = waitEvery(5*time.Second, 20*time.Millisecond, func() bool {
		var n int
		err := pool.QueryRow(ctx, `/* bench */ SELECT count(DISTINCT application_name) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name LIKE 'shardrun-runner %' AND query LIKE 'LISTEN%'`).Scan(&n)
		return err == nil && n == len(c.runners)
	})
	rows, err := pool.Query(ctx, `/* bench */ SELECT application_name, min(backend_start) FILTER (WHERE query LIKE 'LISTEN%'),
			min(backend_start) FILTER (WHERE query NOT LIKE 'LISTEN%')
		FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE 'shardrun-runner %'
		GROUP BY 1 ORDER BY 1`)
	if err != nil {
		return t, fmt.Errorf("reading the runners' connections: %w", err)
	}
	for rows.Next() {
		var name string
		var listener, other *time.Time
		if err := rows.Scan(&name, &listener, &other); err != nil {
			rows.Close()
			return t, err
		}
		if listener != nil {
			t.ListenersS = append(t.ListenersS, since(*listener))
		}
		if other != nil {
			t.PoolS = append(t.PoolS, since(*other))
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return t, err
	}
	t.FirstAcceptedS = t.AcceptingS
	if len(t.ListenersS) > 0 || len(t.PoolS) > 0 {
		t.FirstBackendS = slices.Min(append(slices.Clone(t.ListenersS), t.PoolS...))
		t.FirstAcceptedS = min(t.FirstAcceptedS, t.FirstBackendS)
	}
	t.FirstStartAfterAcceptedS = t.FirstStartS - t.FirstAcceptedS
	if d := outageFlags.logs; d != "" {
		for _, r := range c.runners {
			name := filepath.Join(d, fmt.Sprintf("restart-%d-%s.log", trial+1, r.id))
			if err := os.WriteFile(name, fmt.Appendf(nil, "postmaster start %s\n%s", start.Format(time.RFC3339Nano), r.logs.String()), 0o644); err != nil {
				return t, err
			}
		}
	}
	for _, r := range c.runners {
		if _, _, ok := r.logTime("detach", stopped); ok {
			t.Detaches++
		}
	}
	return t, nil
}

func (e *env) freezeOutage(ctx context.Context, ttl time.Duration) (*freezeOutage, error) {
	r := &freezeOutage{LeaseTTL: ttl.String(), Shards: outageFlags.shards, Rate: outageFlags.rate,
		HoldMS: int(outageFlags.hold.Milliseconds()), BoundS: outageFlags.bound.Seconds()}
	var owned, done []float64
	for trial := range outageFlags.freezeTrials {
		t, err := e.freezeTrial(ctx, ttl, trial)
		if err != nil {
			if len(r.Trials) == 0 {
				return nil, fmt.Errorf("trial %d: %w", trial+1, err)
			}
			return r, fmt.Errorf("trial %d: %w", trial+1, err)
		}
		r.Trials = append(r.Trials, t)
		owned, done = append(owned, cmpBound(t.OwnedS, r.BoundS)), append(done, t.DoneS)
		r.Owned = summarize("every shard of the frozen runner owned by the other", ttl.String(), owned)
		r.Done = summarize("and the other completed a task enqueued after the freeze on each of them", ttl.String(), done)
		state := fmt.Sprintf("%.2fs", t.DoneS)
		if t.TimedOut {
			state = fmt.Sprintf("> %.0fs (%d of %d done by then; all %s after A's SIGKILL)", r.BoundS, t.DoneByBound, t.MovedShards, fmtWithin(t.AfterKillS))
		}
		fmt.Fprintf(e.log, "  TTL %s freeze trial %d: %d of A's shards owned by B after %s, working again after %s; B's own shards %s; held task %d done %.2fs after the freeze at attempt %d (only after SIGKILL: %v), %d effect row(s); %d tasks with two effect rows; load %d enqueued, %d errors\n",
			ttl, trial+1, t.MovedShards, fmtWithin(t.OwnedS), state, fmtWithin(t.OwnDoneS), t.HeldID, t.HeldDoneS, t.HeldAttempt, t.HeldAfterKill,
			t.HeldEffectRows, t.DoubleEffects, t.LoadEnqueued, t.LoadErrors)
	}
	return r, nil
}

// cmpBound is x, or the bound when x is -1 (not within it).
func cmpBound(x, bound float64) float64 {
	if x < 0 {
		return bound
	}
	return x
}

var holdingLine = regexp.MustCompile(`holding (\d+) (\d+)`)

func (e *env) freezeTrial(ctx context.Context, ttl time.Duration, trial int) (t freezeTrial, err error) {
	shards := outageFlags.shards
	st, client, dsn, drop, err := e.outageStore(ctx, "outage_freeze", shards)
	if err != nil {
		return t, err
	}
	defer func() {
		if derr := drop(); err == nil {
			err = derr
		}
	}()
	c := e.newCluster(fmt.Sprintf("o-%d-%d", trial, time.Now().UnixNano()), dsn, shards)
	defer c.stop()
	if _, err := shard.EnsureShardCount(ctx, e.cli, c.prefix(), shards); err != nil {
		return t, err
	}
	a, err := c.spawnTxWorker("tx-1", ttl)
	if err != nil {
		return t, err
	}
	if err := waitUntil(60*time.Second, func() bool { return c.balanced(ctx, "tx-1") }); err != nil {
		return t, fmt.Errorf("tx-1 owning every shard: %w\n%s", err, linewriter.Tail(a.logs.String(), 20))
	}
	b, err := c.spawnTxWorker("tx-2", ttl)
	if err != nil {
		return t, err
	}
	if err := waitUntil(60*time.Second, func() bool { return c.balanced(ctx, "tx-1", "tx-2") }); err != nil {
		return t, fmt.Errorf("tx-1 and tx-2 balanced: %w\n%s", err, linewriter.Tail(b.logs.String(), 20))
	}
	load := startEffectLoad(ctx, client, outageFlags.rate)
	defer func() { t.LoadEnqueued, t.LoadErrors = load.stop() }()

	// A takes a task of one of its shards that holds its transaction open.
	keys := keysByShard("probe-", shards)
	aShards := c.shardsOf(ctx, a.id)
	var holdKey string
	for s, k := range keysByShard("held-", shards) {
		if aShards[s] {
			holdKey = k
			break
		}
	}
	if _, err := client.Enqueue(ctx, tasks.NewTask{Kind: "effect",
		Payload: fmt.Appendf(nil, `{"hold_ms": %d, "hold_attempts": 1}`, outageFlags.hold.Milliseconds()), Options: tasks.Options{Key: holdKey, MaxAttempts: 5},
	}); err != nil {
		return t, fmt.Errorf("enqueueing the held task: %w", err)
	}
	if err := waitUntil(30*time.Second, func() bool {
		m := holdingLine.FindStringSubmatch(a.logs.String())
		if m == nil {
			return false
		}
		t.HeldID, _ = strconv.ParseInt(m[1], 10, 64)
		return true
	}); err != nil {
		return t, fmt.Errorf("tx-1 holding its transaction: %w\n%s", err, linewriter.Tail(a.logs.String(), 20))
	}
	moved := c.shardsOf(ctx, a.id)
	t.MovedShards = len(moved)
	frozen := time.Now()
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return t, fmt.Errorf("freezing tx-1: %w", err)
	}
	// Kill A however the trial ends: SIGKILL ends a stopped process, and
	// with it its open transaction.
	killed := false
	kill := func() {
		if !killed {
			killed = true
			_ = a.cmd.Process.Signal(syscall.SIGKILL)
		}
	}
	defer kill()
	probes := make([]tasks.NewTask, shards)
	for s := range probes {
		probes[s] = tasks.NewTask{Kind: "effect", Options: tasks.Options{Key: keys[s], MaxAttempts: 5}}
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	res, err := client.EnqueueBatch(pctx, probes)
	cancel()
	if err != nil {
		return t, fmt.Errorf("enqueueing the probes: %w", err)
	}
	if res.Inserted != int64(shards) {
		return t, fmt.Errorf("enqueueing the probes: %d inserted of %d", res.Inserted, shards)
	}
	pool := st.Pool()
	// probesDone is, per shard, when B completed its probe.
	probesDone := func() (map[int]time.Time, error) {
		rows, err := pool.Query(ctx, `/* bench */ SELECT shard, finished_at FROM task_view
			WHERE key = ANY($1) AND state = 'completed' AND claimed_by = $2`, keys, b.id)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		out := map[int]time.Time{}
		for rows.Next() {
			var s int
			var at time.Time
			if err := rows.Scan(&s, &at); err != nil {
				return nil, err
			}
			out[s] = at
		}
		return out, rows.Err()
	}
	held := func() (state string, attempt int, finished *time.Time, err error) {
		err = pool.QueryRow(ctx, `/* bench */ SELECT state, attempt, finished_at FROM task_view WHERE id = $1`, t.HeldID).Scan(&state, &attempt, &finished)
		return state, attempt, finished, err
	}
	// latest is the last completion among the probes of shards in set
	// (-1 when one is missing), and how many of them completed.
	latest := func(done map[int]time.Time, in func(int) bool) (float64, int) {
		var last time.Time
		n, all := 0, true
		for s := range shards {
			if !in(s) {
				continue
			}
			at, ok := done[s]
			if !ok {
				all = false
				continue
			}
			n++
			if at.After(last) {
				last = at
			}
		}
		if !all {
			return -1, n
		}
		return last.Sub(frozen).Seconds(), n
	}
	t.OwnedS, t.DoneS, t.OwnDoneS = -1, -1, -1
	var heldDone bool
	deadline := frozen.Add(outageFlags.bound)
	for time.Now().Before(deadline) {
		if t.OwnedS < 0 {
			if o, err := c.owners(ctx); err == nil {
				all := true
				for s := range moved {
					all = all && o[s] == b.id
				}
				if all {
					t.OwnedS = time.Since(frozen).Seconds()
				}
			}
		}
		done, err := probesDone()
		if err != nil {
			return t, fmt.Errorf("reading the probes: %w", err)
		}
		t.DoneS, t.DoneByBound = latest(done, func(s int) bool { return moved[s] })
		t.OwnDoneS, _ = latest(done, func(s int) bool { return !moved[s] })
		state, attempt, finished, err := held()
		if err != nil {
			return t, fmt.Errorf("reading the held task: %w", err)
		}
		if state == string(tasks.Completed) && finished != nil {
			heldDone, t.HeldAttempt, t.HeldDoneS = true, attempt, finished.Sub(frozen).Seconds()
		}
		if t.OwnedS >= 0 && t.DoneS >= 0 && t.OwnDoneS >= 0 && heldDone {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if t.DoneS < 0 {
		t.TimedOut, t.DoneS = true, outageFlags.bound.Seconds()
		if t.LockWaits, err = lockWaits(ctx, pool); err != nil {
			return t, err
		}
	}
	kill()
	killedAt := time.Now()
	if t.TimedOut || !heldDone {
		// What the SIGKILL unblocked: the probes of A's shards and the held
		// task, within another bound.
		t.HeldAfterKill = !heldDone
		t.AfterKillS = -1
		_ = waitEvery(outageFlags.bound, 50*time.Millisecond, func() bool {
			done, err := probesDone()
			if err != nil {
				return false
			}
			if t.TimedOut && t.AfterKillS < 0 {
				if last, _ := latest(done, func(s int) bool { return moved[s] }); last >= 0 {
					t.AfterKillS = max(last-killedAt.Sub(frozen).Seconds(), 0)
				}
			}
			if !heldDone {
				state, attempt, finished, err := held()
				if err == nil && state == string(tasks.Completed) && finished != nil {
					heldDone, t.HeldAttempt, t.HeldDoneS = true, attempt, finished.Sub(frozen).Seconds()
				}
			}
			return heldDone && (!t.TimedOut || t.AfterKillS >= 0)
		})
		if !heldDone {
			return t, fmt.Errorf("the held task %d did not complete within %s of A's SIGKILL", t.HeldID, outageFlags.bound)
		}
	}
	if err := pool.QueryRow(ctx, `/* bench */ SELECT
			(SELECT count(*) FROM effects WHERE task_id = $1),
			(SELECT count(*) FROM (SELECT task_id FROM effects GROUP BY task_id HAVING count(*) > 1) d)`, t.HeldID).Scan(&t.HeldEffectRows, &t.DoubleEffects); err != nil {
		return t, fmt.Errorf("counting effect rows: %w", err)
	}
	if t.HeldEffectRows != 1 {
		return t, fmt.Errorf("the held task %d has %d effect rows, want 1", t.HeldID, t.HeldEffectRows)
	}
	return t, nil
}

// lockWaits lists the statements of the database waiting for a lock, each
// with what blocks it: "<statement> waits for <state> <statement>".
func lockWaits(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	rows, err := pool.Query(ctx, `/* bench */ SELECT coalesce(substring(w.query FROM '/\* (shardrun\.[a-z_]+) \*/'), left(w.query, 60)),
			coalesce(b.state, '?'), coalesce(substring(b.query FROM '/\* (shardrun\.[a-z_]+) \*/'), left(b.query, 60), '?')
		FROM pg_stat_activity w
		LEFT JOIN LATERAL unnest(pg_blocking_pids(w.pid)) bp(pid) ON true
		LEFT JOIN pg_stat_activity b ON b.pid = bp.pid
		WHERE w.datname = current_database() AND w.wait_event_type = 'Lock'
		ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("reading the lock waits: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (string, error) {
		var waiting, state, blocker string
		err := row.Scan(&waiting, &state, &blocker)
		return fmt.Sprintf("%s waits for %s %s", waiting, state, blocker), err
	})
	if err != nil {
		return nil, fmt.Errorf("reading the lock waits: %w", err)
	}
	return out, nil
}

// spawnTxWorker starts a txworker (internal/cmd/txworker) of the cluster.
// It has no admin address: its ownership is read from etcd.
func (c *cluster) spawnTxWorker(id string, ttl time.Duration) (*runnerProc, error) {
	r := &runnerProc{id: id, logs: &linewriter.Buffer{}, done: make(chan error, 1)}
	r.cmd = exec.Command(c.env.txworkerBin, "--database-url", c.dsn+"&pool_max_conns=32",
		"--etcd-endpoints", c.env.etcd.Endpoints()[0], "--cluster", c.name, "--runner-id", id,
		"--lease-ttl", ttl.String(), "--handoff-timeout", "2s")
	r.cmd.Stdout, r.cmd.Stderr = r.logs, r.logs
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting txworker %s: %w", id, err)
	}
	go func() { r.done <- r.cmd.Wait() }()
	c.runners = append(c.runners, r)
	return r, nil
}

// keysByShard is a key for each shard (ShardOf), each starting with prefix.
func keysByShard(prefix string, shards int) []string {
	keys := make([]string, shards)
	left := shards
	for i := 0; left > 0; i++ {
		k := prefix + strconv.Itoa(i)
		if s := tasks.ShardOf(k, shards); keys[s] == "" {
			keys[s] = k
			left--
		}
	}
	return keys
}

// effectLoad enqueues effect tasks at a steady rate, in a batch every
// 20 ms, until stopped.
type effectLoad struct {
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	enqueued atomic.Int64
	errors   atomic.Int64
}

func startEffectLoad(ctx context.Context, client *srclient.Tasks, rate int) *effectLoad {
	ctx, cancel := context.WithCancel(ctx)
	l := &effectLoad{cancel: cancel}
	const tick = 20 * time.Millisecond
	l.wg.Go(func() {
		ticker := time.NewTicker(tick)
		defer ticker.Stop()
		began, sent := time.Now(), 0
		for {
			select {
			case <-ctx.Done():
				return
			case <-ticker.C:
			}
			// Open loop: what is due by now, whatever a slow enqueue delayed.
			n := int(time.Since(began).Seconds()*float64(rate)) - sent
			if n <= 0 {
				continue
			}
			batch := make([]tasks.NewTask, n)
			for i := range batch {
				batch[i] = tasks.NewTask{Kind: "effect", Options: tasks.Options{MaxAttempts: 5}}
			}
			sent += n
			ectx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, err := client.EnqueueBatch(ectx, batch)
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					l.errors.Add(1)
				}
				continue
			}
			l.enqueued.Add(int64(n))
		}
	})
	return l
}

func (l *effectLoad) stop() (enqueued, errors int64) {
	l.cancel()
	l.wg.Wait()
	return l.enqueued.Load(), l.errors.Load()
}

// fmtWithin is "1.23s", or "not within the bound" for -1.
func fmtWithin(s float64) string {
	if s < 0 {
		return "not within the bound"
	}
	return fmt.Sprintf("%.2fs", s)
}

func fmtList3(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.3f", x)
	}
	return strings.Join(parts, ", ")
}

// boundedCell is "p50 X s, max Y s", with "> bound" for a value at the bound.
func boundedCell(l latencies, bound float64) string {
	cell := func(x float64) string {
		if bound > 0 && x >= bound {
			return fmt.Sprintf("> %.0fs", bound)
		}
		return fmt.Sprintf("%.2fs", x)
	}
	return fmt.Sprintf("p50 %s, max %s", cell(l.P50), cell(l.Max))
}

func printOutage(w io.Writer, o *outageResult) {
	if r := o.Restart; r != nil {
		fmt.Fprintf(w, "| outage: first task after a PostgreSQL restart (%d idle runners, %d shards, down %s, %d noop tasks enqueued once it accepts connections), from the postmaster's start | p50 %.3fs, max %.3fs over %d trials (%s); the server accepted its first connection p50 %.3fs after its start, the first task p50 %.3fs (max %.3fs) after that; enqueue → first start p50 %.3fs, max %.3fs; every runner's first task p50 %.3fs, max %.3fs; all %d done p50 %.3fs, max %.3fs |\n",
			r.Runners, r.Shards, r.DownFor, r.Tasks, r.FirstStart.P50, r.FirstStart.Max, len(r.FirstStart.Trials), fmtList3(r.FirstStart.Trials),
			r.Accepted.P50, r.AfterAccepted.P50, r.AfterAccepted.Max, r.EnqueueToFirstStart.P50, r.EnqueueToFirstStart.Max,
			r.LastRunnerFirst.P50, r.LastRunnerFirst.Max, r.Tasks, r.AllCompleted.P50, r.AllCompleted.Max)
	}
	for _, f := range o.Freeze {
		var done, rows []string
		for _, t := range f.Trials {
			if t.TimedOut {
				done = append(done, fmt.Sprintf("> %.0f", f.BoundS))
			} else {
				done = append(done, fmt.Sprintf("%.2f", t.DoneS))
			}
			rows = append(rows, strconv.Itoa(t.HeldEffectRows))
		}
		fmt.Fprintf(w, "| outage: failover from a runner frozen with an open handler transaction, lease TTL %s, %d shards, %d tasks/s | A's shards owned by B %s; working again (a task enqueued after the freeze done on each) %s over %d trials (%s s); the held task's effect rows %s |\n",
			f.LeaseTTL, f.Shards, f.Rate, boundedCell(f.Owned, f.BoundS), boundedCell(f.Done, f.BoundS), len(f.Trials), strings.Join(done, ", "), strings.Join(rows, ", "))
	}
}

// outageTargets (issue 39): the first task after PostgreSQL returns starts
// within 0.1 s (median).
func outageTargets(o *outageResult) []target {
	t := target{Measure: "first task after a PostgreSQL restart, from pg_postmaster_start_time()", Target: "median ≤ 0.1 s", Status: notMeasured}
	if o != nil && o.Restart != nil && len(o.Restart.Trials) > 0 {
		l := o.Restart.FirstStart
		t.Measured = fmt.Sprintf("median %.3f s (max %.3f, %d trials)", l.P50, l.Max, len(l.Trials))
		t.Status = verdict(l.P50 <= 0.1)
	}
	return []target{t}
}
