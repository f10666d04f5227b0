package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
)

// scaleOpts are the scale section's flags.
type scaleOpts struct {
	runners, shards, tasks, maxWorkers int
}

var scaleFlags = scaleOpts{runners: 16, shards: 4096, tasks: 200_000, maxWorkers: 512}

// scaleDBConns is each scale runner's --db-max-conns: 17 runners at 4 stay
// well inside the server's max_connections of 300, with the bench's own.
const scaleDBConns = 4

// scaleConvergeTimeout bounds each wait for convergence; far above what a
// healthy cluster needs, so that hitting it means a product problem.
const scaleConvergeTimeout = 3 * time.Minute

// scaleStableFor is how long the ownership must stay unchanged after
// convergence for the bench to believe it (it should: see converged).
const scaleStableFor = time.Second

// scalePhase is one membership change of the scale section.
type scalePhase struct {
	What string `json:"what"`
	// Seconds from the change (first spawn, spawn, SIGTERM) to convergence.
	Seconds float64 `json:"converged_s"`
	// ReadyS: cold start only, until every runner's /readyz said ready.
	ReadyS float64 `json:"all_ready_s,omitempty"`
	// OwnedS: leave only, until every shard of the leaver was owned by
	// another runner (not yet necessarily balanced).
	OwnedS float64 `json:"leaver_shards_owned_elsewhere_s,omitempty"`
	// Moved: shards whose owner differs between before and after.
	Moved int `json:"shards_moved"`
	// MoveBound: the assignment's documented bound on Moved (shard.Assign).
	MoveBound int `json:"move_bound,omitempty"`
	// Acquisitions and Releases are the shards written into and removed
	// from owner keys under the cluster's prefix; above Moved they are
	// thrash.
	Acquisitions int `json:"shard_acquisitions"`
	Releases     int `json:"shard_releases"`
	// RunnerKeyWrites are writes of runners/<id> (state publications).
	RunnerKeyWrites int `json:"runner_key_writes"`
	// EtcdMessages is the gRPC messages etcd received, whoever sent them,
	// from the change to the end of the stability check (so including a
	// second of keep-alives).
	EtcdMessages float64 `json:"etcd_messages_received"`
	// ChangesAfter: owner key events in the scaleStableFor after
	// convergence (0 expected).
	ChangesAfter int `json:"shard_key_events_after_convergence"`
	// MinShards and MaxShards per runner at convergence.
	MinShards int `json:"min_shards_per_runner"`
	MaxShards int `json:"max_shards_per_runner"`
	// CPUSeconds the runners used in the phase (from their
	// process_cpu_seconds_total; a runner that exited is not counted).
	CPUSeconds float64 `json:"runner_cpu_s"`
}

// scaleResult is the scale section's report.
type scaleResult struct {
	Runners     int        `json:"runners"`
	Shards      int        `json:"shards"`
	LeaseTTL    string     `json:"lease_ttl"`
	MaxWorkers  int        `json:"max_workers_per_runner"`
	DBMaxConns  int        `json:"db_max_conns_per_runner"`
	Convergence string     `json:"convergence_means"`
	Cold        scalePhase `json:"cold_start"`
	Join        scalePhase `json:"join"`
	Leave       scalePhase `json:"leave"`
	IdleRSSMiB  float64    `json:"idle_rss_mib_per_runner"`
	// EnqueuePerS is COPY in one transaction, so that every task becomes
	// claimable at the same moment.
	BurnDown burnDown `json:"burn_down"`
	// TopStatements are the statements that took the most database time
	// in the section's database, mostly the burn-down's
	// (pg_stat_statements; absent without it).
	TopStatements []stmtStat `json:"burn_down_top_statements,omitempty"`
}

// stmtStat is one statement's totals from pg_stat_statements.
type stmtStat struct {
	Query   string  `json:"query"`
	Calls   int64   `json:"calls"`
	Rows    int64   `json:"rows"`
	MeanMS  float64 `json:"mean_ms"`
	TotalS  float64 `json:"total_s"`
	SharedK int64   `json:"shared_blocks_hit_and_read_k"`
}

// topStatements reads the statements of dsn's database that took the most
// time, so that a slow burn-down says where its time went.
func (e *env) topStatements(ctx context.Context, db string, n int) ([]stmtStat, error) {
	if !e.statStatements {
		return nil, nil
	}
	conn, err := pgx.Connect(ctx, e.pg.DSN("postgres"))
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT left(regexp_replace(query, '\s+', ' ', 'g'), 160), calls, rows, mean_exec_time,
			total_exec_time / 1000, (shared_blks_hit + shared_blks_read) / 1000
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1)
		ORDER BY total_exec_time DESC LIMIT $2`, db, n)
	if err != nil {
		return nil, fmt.Errorf("reading pg_stat_statements: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (stmtStat, error) {
		var s stmtStat
		err := r.Scan(&s.Query, &s.Calls, &s.Rows, &s.MeanMS, &s.TotalS, &s.SharedK)
		return s, err
	})
}

// scaleSection runs many runners over many shards in one cluster: a cold
// start of all of them at once, one more joining, one leaving (SIGTERM),
// then a burn-down of noop tasks by the runners that remain.
func (e *env) scaleSection(ctx context.Context, rep *Report) error {
	o := scaleFlags
	res := &scaleResult{Runners: o.runners, Shards: o.shards, LeaseTTL: "10s", MaxWorkers: o.maxWorkers, DBMaxConns: scaleDBConns,
		Convergence: "every shard owned (in an owner key) by a live runner, and shard.Assign(live runners, owners) == owners: the runners' own " +
			"assignment leaves every shard where it is (a fixed point; its quotas are exact, so this is also balanced to ±1); timed to the " +
			"receipt of the owner key event that completed it, then checked to stay unchanged for 1s"}
	rep.Scale = res
	dsn, err := e.database(ctx, "scale")
	if err != nil {
		return err
	}
	st, err := store.Open(ctx, dsn, store.Options{MaxConns: 4})
	if err != nil {
		return err
	}
	defer st.Close()
	if err := st.Migrate(ctx); err != nil {
		return err
	}
	c := e.newCluster(fmt.Sprintf("scale-%d", time.Now().UnixNano()), dsn, o.shards)
	defer c.stop()
	w, err := c.watchOwners(ctx)
	if err != nil {
		return err
	}
	defer w.stop()
	opts := runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: o.maxWorkers, dbMaxConns: scaleDBConns}
	var ids []string
	for i := 1; i <= o.runners; i++ {
		ids = append(ids, fmt.Sprintf("runner-%d", i))
	}

	// (a) Cold start: every runner spawned at once.
	mark := w.mark()
	start := time.Now()
	for _, id := range ids {
		if _, err := c.spawn(id, opts); err != nil {
			return err
		}
	}
	for _, r := range c.runners {
		if err := r.waitReady(); err != nil {
			return err
		}
	}
	res.Cold.ReadyS = time.Since(start).Seconds()
	if err := c.converge(ctx, w, mark, start, ids, &res.Cold); err != nil {
		return fmt.Errorf("cold start: %w", err)
	}
	res.Cold.What = fmt.Sprintf("cold start: %d runners spawned at once, from the first spawn", o.runners)
	res.Cold.Moved = moved(map[int]string{}, w.snapshot())
	res.Cold.MoveBound = o.shards // every shard is acquired once
	res.Cold.CPUSeconds = c.sumMetric("process_cpu_seconds_total")
	res.IdleRSSMiB = c.sumMetric("process_resident_memory_bytes") / float64(len(c.runners)) / (1 << 20)
	e.logPhase(res.Cold)

	// (b) One more runner joins.
	before := w.snapshot()
	cpu := c.sumMetric("process_cpu_seconds_total")
	joiner := fmt.Sprintf("runner-%d", o.runners+1)
	ids = append(ids, joiner)
	mark = w.mark()
	start = time.Now()
	if _, err := c.start(joiner, opts); err != nil {
		return err
	}
	if err := c.converge(ctx, w, mark, start, ids, &res.Join); err != nil {
		return fmt.Errorf("join: %w", err)
	}
	res.Join.What = fmt.Sprintf("runner %d joins %d, from its spawn", o.runners+1, o.runners)
	res.Join.Moved = moved(before, w.snapshot())
	res.Join.MoveBound = (o.shards+o.runners)/(o.runners+1) + o.runners // ⌈S/(n+1)⌉ + n
	res.Join.CPUSeconds = c.sumMetric("process_cpu_seconds_total") - cpu
	e.logPhase(res.Join)

	// (c) One runner leaves gracefully. Its CPU is lost with it, so the
	// phase counts the survivors' only.
	leaver := c.runners[1]
	ids = slices.DeleteFunc(ids, func(id string) bool { return id == leaver.id })
	before = w.snapshot()
	cpu = c.sumMetric("process_cpu_seconds_total") - leaver.metric("process_cpu_seconds_total")
	mark = w.mark()
	start = time.Now()
	_ = leaver.cmd.Process.Signal(syscall.SIGTERM)
	var owned time.Time // receipt of the event that completed it, as in converge
	if err := waitUntil(scaleConvergeTimeout, func() bool {
		now, _, changed := w.state()
		for s, owner := range before {
			if owner == leaver.id && (now[s] == "" || now[s] == leaver.id) {
				return false
			}
		}
		owned = changed
		return true
	}); err != nil {
		return fmt.Errorf("leave: the leaver's shards not owned elsewhere: %w\n%s", err, c.describe(w, ids))
	}
	res.Leave.OwnedS = owned.Sub(start).Seconds()
	if err := c.converge(ctx, w, mark, start, ids, &res.Leave); err != nil {
		return fmt.Errorf("leave: %w", err)
	}
	res.Leave.What = fmt.Sprintf("SIGTERM one of %d idle runners, from the signal", o.runners+1)
	res.Leave.Moved = moved(before, w.snapshot())
	res.Leave.MoveBound = countOwned(before, leaver.id) + len(ids) // its shards plus one per remaining member
	select {
	case err := <-leaver.done:
		leaver.done <- err // cluster.stop waits on it too
	case <-time.After(30 * time.Second):
		return fmt.Errorf("leave: %s did not exit within 30s of SIGTERM\n%s", leaver.id, linewriter.Tail(leaver.logs.String(), 20))
	}
	res.Leave.CPUSeconds = c.sumMetric("process_cpu_seconds_total") - cpu
	e.logPhase(res.Leave)

	// (d) Burn-down by the runners that remain.
	var err2 error
	res.BurnDown, err2 = e.scaleBurnDown(ctx, st, c, len(ids), o)
	if err2 != nil {
		return err2
	}
	if res.TopStatements, err = e.topStatements(ctx, st.Pool().Config().ConnConfig.Database, 5); err != nil {
		return err
	}
	for _, t := range res.TopStatements {
		fmt.Fprintf(e.log, "    %.1fs in %d calls (%.2f ms each, %d rows, %dk blocks): %s\n", t.TotalS, t.Calls, t.MeanMS, t.Rows, t.SharedK, t.Query)
	}
	b := res.BurnDown
	fmt.Fprintf(e.log, "  burn-down, %d runners: %d noop tasks in %.1fs, %.0f tasks/s (enqueue %.0f rows/s in one transaction), peak RSS %.0f MiB per runner\n",
		b.Processes, b.Tasks, b.Seconds, b.TasksPerS, b.EnqueuePerS, b.PeakRSSMiB)
	return nil
}

// scaleBurnDown enqueues o.tasks noop tasks in one transaction (so that the
// runners, already running, see them all at once) and times their
// burn-down from the first claim to the last completion.
func (e *env) scaleBurnDown(ctx context.Context, st *store.Store, c *cluster, runners int, o scaleOpts) (burnDown, error) {
	r := burnDown{System: "shardrun", Processes: runners, Tasks: o.tasks}
	prep := srclient.Config{ShardCount: o.shards}.WithDefaults()
	before, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	var peak sampler
	for _, rp := range c.runners {
		if rp.cmd.ProcessState == nil {
			peak.watch(rp)
		}
	}
	r.EnqueuePerS, err = enqueueNoopsAtOnce(ctx, st, prep, o.tasks)
	if err != nil {
		peak.stop()
		return r, err
	}
	err = waitBurnedDown(ctx, st.Pool(), c.running(), "noop", o.tasks)
	peak.stop()
	if err != nil {
		return r, err
	}
	// Stopped before reading the counters: a backend flushes its
	// transaction counts when it exits (see setCosts).
	c.stop()
	after, err := e.counters(ctx, st.Pool())
	if err != nil {
		return r, err
	}
	span, err := burnDownSpan(ctx, st.Pool(), "noop")
	if err != nil {
		return r, err
	}
	r.Seconds, r.TasksPerS = span, float64(o.tasks)/span
	// Read before the enqueue: its transaction, statements, pages and WAL
	// count as the system's.
	r.setCosts(before, after, 0, o.tasks)
	r.PeakRSSMiB = peak.max() / (1 << 20)
	return r, nil
}

func (e *env) logPhase(p scalePhase) {
	fmt.Fprintf(e.log, "  %s: converged after %.2fs", p.What, p.Seconds)
	if p.ReadyS > 0 {
		fmt.Fprintf(e.log, " (all ready after %.2fs)", p.ReadyS)
	}
	if p.OwnedS > 0 {
		fmt.Fprintf(e.log, " (its shards owned elsewhere after %.2fs)", p.OwnedS)
	}
	fmt.Fprintf(e.log, "; %d shards moved (bound %d), %d acquisitions, %d releases, %d runner key writes, %.0f etcd messages, %d-%d shards per runner, runners' CPU %.1fs\n",
		p.Moved, p.MoveBound, p.Acquisitions, p.Releases, p.RunnerKeyWrites, p.EtcdMessages, p.MinShards, p.MaxShards, p.CPUSeconds)
}

// converge waits until the ownership converged for ids (see scaleResult's
// Convergence) and stays so for scaleStableFor, then fills p's timing and
// counts from mark.
func (c *cluster) converge(ctx context.Context, w *ownerWatch, mark watchMark, start time.Time, ids []string, p *scalePhase) error {
	var at time.Time
	version := -1
	err := waitUntil(scaleConvergeTimeout, func() bool {
		if w.version() == version {
			return false // nothing changed since the last look
		}
		owners, v, changed := w.state()
		version = v
		if !converged(owners, ids, c.shards) {
			return false
		}
		at = changed
		return true
	})
	if err != nil {
		return fmt.Errorf("not converged: %w\n%s", err, c.describe(w, ids))
	}
	time.Sleep(scaleStableFor)
	after, _ := embedetcd.MessagesReceived()
	owners, v, _ := w.state()
	counts := w.since(mark)
	p.Seconds = at.Sub(start).Seconds()
	p.Acquisitions, p.Releases, p.RunnerKeyWrites = counts.puts, counts.deletes, counts.runnerPuts
	p.ChangesAfter = v - version
	p.EtcdMessages = after - mark.msgs
	per := map[string]int{}
	for _, id := range owners {
		per[id]++
	}
	p.MinShards, p.MaxShards = c.shards, 0
	for _, id := range ids {
		p.MinShards, p.MaxShards = min(p.MinShards, per[id]), max(p.MaxShards, per[id])
	}
	if err := w.failed(); err != nil {
		return err
	}
	if p.ChangesAfter != 0 {
		return fmt.Errorf("converged, then %d owner key events within %s\n%s", p.ChangesAfter, scaleStableFor, c.describe(w, ids))
	}
	return nil
}

// converged reports whether every shard is owned by one of ids and the
// assignment the runners compute (shard.Assign) keeps every shard where it
// is. Assign's quotas are exact, so a fixed point is balanced; and it is
// what the runners aim at, so nothing moves after it.
func converged(owners map[int]string, ids []string, shards int) bool {
	if len(owners) != shards {
		return false
	}
	current := make([]string, shards)
	for s, id := range owners {
		if s < 0 || s >= shards || !slices.Contains(ids, id) {
			return false
		}
		current[s] = id
	}
	return slices.Equal(shard.Assign(ids, current), current)
}

func moved(before, after map[int]string) int {
	n := 0
	for s, owner := range after {
		if before[s] != owner {
			n++
		}
	}
	return n
}

func countOwned(owners map[int]string, id string) int {
	n := 0
	for _, o := range owners {
		if o == id {
			n++
		}
	}
	return n
}

// sumMetric sums a metric over the runners still running.
func (c *cluster) sumMetric(name string) float64 {
	var sum float64
	for _, r := range c.runners {
		if r.cmd.ProcessState != nil {
			continue
		}
		if v := r.metric(name); v > 0 {
			sum += v
		}
	}
	return sum
}

// describe says, for a report of a failed wait, how many shards each
// runner owns and what each published, and the end of each runner's log.
func (c *cluster) describe(w *ownerWatch, ids []string) string {
	owners, _, _ := w.state()
	per := map[string]int{}
	for _, id := range owners {
		per[id]++
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d of %d shards owned; per owner: %v\n", len(owners), c.shards, per)
	resp, err := c.env.cli.Get(context.Background(), c.prefix()+"runners/", clientv3.WithPrefix())
	if err == nil {
		for _, kv := range resp.Kvs {
			fmt.Fprintf(&b, "%s = %s\n", kv.Key, kv.Value)
		}
	}
	for _, r := range c.runners {
		if slices.Contains(ids, r.id) {
			fmt.Fprintf(&b, "--- %s\n%s\n", r.id, linewriter.Tail(r.logs.String(), 5))
		}
	}
	return b.String()
}

// ownerWatch follows the owner keys of a cluster through one etcd watch,
// so that waiting for convergence costs etcd nothing per poll (reading
// thousands of keys every few milliseconds would load the machine being
// measured), and counts the key events.
type ownerWatch struct {
	prefix  string
	mu      sync.Mutex
	owners  map[int]string
	events  int       // owner key events applied
	changed time.Time // receipt of the newest owner key event
	counts  watchCounts
	err     error
	cancel  context.CancelFunc
	done    chan struct{}
}

type watchCounts struct{ puts, deletes, runnerPuts int }

// watchMark is the counts at the start of a phase.
type watchMark struct {
	counts watchCounts
	msgs   float64
}

func (c *cluster) watchOwners(ctx context.Context) (*ownerWatch, error) {
	w := &ownerWatch{prefix: c.prefix(), owners: map[int]string{}, done: make(chan struct{})}
	resp, err := c.env.cli.Get(ctx, w.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading the owner keys: %w", err)
	}
	units := shard.NewHistory(w.prefix, c.shards)
	for _, kv := range resp.Kvs {
		for _, u := range units.Apply(&clientv3.Event{Type: clientv3.EventTypePut, Kv: kv}) {
			w.owners[u.Shard] = u.Runner
		}
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
				key := string(ev.Kv.Key)
				put := ev.Type == clientv3.EventTypePut
				switch {
				case strings.HasPrefix(key, w.prefix+"owners/"):
					// One write of a runner's owner key acquires or
					// releases any number of its shards.
					if put {
						w.counts.puts++
					} else {
						w.counts.deletes++
					}
					for _, u := range units.Apply(ev) {
						if u.Acquired {
							w.owners[u.Shard] = u.Runner
						} else if w.owners[u.Shard] == u.Runner {
							delete(w.owners, u.Shard)
						}
					}
					w.events++
					w.changed = now
				case put && strings.HasPrefix(key, w.prefix+"runners/"):
					w.counts.runnerPuts++
				}
			}
			w.mu.Unlock()
		}
	}()
	return w, nil
}

func (w *ownerWatch) stop() { w.cancel(); <-w.done }

// failed is the watch's error, if it broke (then its owners are stale).
func (w *ownerWatch) failed() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err != nil {
		return fmt.Errorf("watching the owner keys: %w", w.err)
	}
	return nil
}

// state is a copy of the owners, the event count and the newest event's
// receipt time.
func (w *ownerWatch) state() (map[int]string, int, time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.owners), w.events, w.changed
}

func (w *ownerWatch) version() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.events
}

func (w *ownerWatch) snapshot() map[int]string { o, _, _ := w.state(); return o }

func (w *ownerWatch) mark() watchMark {
	msgs, _ := embedetcd.MessagesReceived()
	w.mu.Lock()
	defer w.mu.Unlock()
	return watchMark{counts: w.counts, msgs: msgs}
}

func (w *ownerWatch) since(m watchMark) watchCounts {
	w.mu.Lock()
	defer w.mu.Unlock()
	return watchCounts{puts: w.counts.puts - m.counts.puts, deletes: w.counts.deletes - m.counts.deletes,
		runnerPuts: w.counts.runnerPuts - m.counts.runnerPuts}
}

// printScale adds the scale section's rows.
func printScale(w io.Writer, sc *scaleResult) {
	for _, p := range []scalePhase{sc.Cold, sc.Join, sc.Leave} {
		if p.What == "" {
			continue
		}
		fmt.Fprintf(w, "| %d shards, %s | converged in **%.2fs**; %d shards moved (bound %d), %d acquisitions, %d releases; %.0f etcd messages |\n",
			sc.Shards, p.What, p.Seconds, p.Moved, p.MoveBound, p.Acquisitions, p.Releases, p.EtcdMessages)
	}
	if b := sc.BurnDown; b.Tasks > 0 {
		fmt.Fprintf(w, "| throughput, %d runners over %d shards, %d noop tasks, --max-workers %d, --db-max-conns %d | %.0f tasks/s; peak RSS %.0f MiB per runner (idle %.0f) |\n",
			b.Processes, sc.Shards, b.Tasks, sc.MaxWorkers, sc.DBMaxConns, b.TasksPerS, b.PeakRSSMiB, sc.IdleRSSMiB)
	}
}
