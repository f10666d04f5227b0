package coordinator

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Counting bounds: status pages polled by many people cost one query a
// second, and the tasks{state} gauge is refreshed every few seconds.
const (
	countsMaxAge    = time.Second
	countsRefresh   = 5 * time.Second
	countsQueryTime = 10 * time.Second
	// A full count (a scan of the table) runs only for states whose capped
	// count reached store.CountCap, at most every fullCountEvery or
	// fullCountCost times as long as the last one took, whichever is
	// longer: a count that takes 1.3s runs at most once a minute.
	fullCountEvery = time.Minute
	fullCountCost  = 30
	// attentionSize is how many tasks of each list the status page shows.
	attentionSize = 10
)

// AttentionTask is a task the status page lists: no payload, key, result
// or error text, which need the API token (GET /api/tasks/{id}).
type AttentionTask struct {
	ID          int64       `json:"id"`
	Kind        string      `json:"kind"`
	Shard       int         `json:"shard"`
	State       tasks.State `json:"state"`
	Attempt     int         `json:"attempt"`
	MaxAttempts int         `json:"max_attempts"`
	ClaimedBy   string      `json:"claimed_by,omitempty"`
	// Since is when it finished (dead, failed) or was claimed (running).
	Since *time.Time `json:"since,omitempty"`
}

// Attention lists the newest dead and failed tasks and the longest running
// ones.
type Attention struct {
	Dead        []AttentionTask `json:"dead"`
	Failed      []AttentionTask `json:"failed"`
	LongRunning []AttentionTask `json:"long_running"`
	// Blocked lists the first blocked sequences (by key), each with the
	// dead or failed task that holds it back.
	Blocked []BlockedSequence `json:"blocked_sequences"`
}

// BlockedSequence is a sequence held back by a dead or failed task, until
// an operator retries or cancels it.
type BlockedSequence struct {
	Key     string        `json:"sequence_key"`
	Task    AttentionTask `json:"blocked_by"`
	Waiting int64         `json:"waiting"`
}

// taskCounts is what the counter serves.
type taskCounts struct {
	// counts are the cluster's: the sum of its databases'.
	counts map[tasks.State]int64
	// estimated lists the states whose count reached store.CountCap in a
	// database: their number is the last full count (up to a few minutes
	// old), or the cap when none has run yet.
	estimated []tasks.State
	// databases are each database's counts, in the map's order.
	databases []databaseCounts
	attention Attention
	// queues are the queues with their counts, rates and pauses.
	queues []store.QueueStats
}

// databaseCounts are one database's task counts.
type databaseCounts struct {
	name      string
	counts    map[tasks.State]int64
	estimated []tasks.State
	// at is when they were counted: a database that did not answer the
	// last count keeps its last counts (zero: never counted).
	at time.Time
}

// counter is the loop that keeps the tasks{state} gauge current, and the
// cache the API reads counts and the attention lists from. Counts are
// capped (store.CountByStateCapped: bounded by the cap, not by the table)
// and taken in each database, and a state at the cap gets its number
// from an occasional full count. A database that does not answer keeps
// its last counts: one database's outage leaves the others' current.
type counter struct {
	router *store.Router
	clock  clock.Clock
	log    hclog.Logger
	gauge  *prometheus.GaugeVec

	mu   sync.Mutex
	last taskCounts
	at   time.Time
	// byDB are the last counts of each database.
	byDB map[string]databaseCounts

	fullMu   sync.Mutex
	full     map[string]map[tasks.State]int64
	fullAt   time.Time
	fullTook time.Duration
}

// View returns the counts and the attention lists, at most countsMaxAge
// old. It fails only when no database answered.
func (c *counter) View(ctx context.Context) (taskCounts, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last.counts != nil && c.clock.Now().Sub(c.at) < countsMaxAge {
		return c.last, nil
	}
	if c.byDB == nil {
		c.byDB = map[string]databaseCounts{}
	}
	v := taskCounts{counts: map[tasks.State]int64{}}
	var failed error
	answered := 0
	for _, name := range c.router.Names() {
		d, err := c.countDatabase(ctx, name)
		if err != nil {
			failed = fmt.Errorf("counting the tasks of database %s: %w", name, err)
			if ctx.Err() == nil {
				c.log.Warn("counting tasks failed; keeping the database's last counts", "database", name, "error", err)
			}
			d = c.byDB[name]
			d.name = name
		} else {
			answered++
			c.byDB[name] = d
		}
		v.databases = append(v.databases, d)
		for st, n := range d.counts {
			v.counts[st] += n
		}
		for _, st := range d.estimated {
			if !slices.Contains(v.estimated, st) {
				v.estimated = append(v.estimated, st)
			}
		}
	}
	if answered == 0 {
		return taskCounts{}, failed
	}
	var err error
	if v.attention, err = c.attention(ctx); err != nil {
		if ctx.Err() == nil {
			c.log.Warn("listing the tasks that need attention failed; keeping the last lists", "error", err)
		}
		v.attention = c.last.attention
		if v.attention.Dead == nil {
			v.attention = Attention{Dead: []AttentionTask{}, Failed: []AttentionTask{}, LongRunning: []AttentionTask{}, Blocked: []BlockedSequence{}}
		}
	}
	if v.queues, err = c.router.Queues(ctx, rateWindow); err != nil {
		if ctx.Err() == nil {
			c.log.Warn("reading the queues failed; keeping the last ones", "error", err)
		}
		v.queues = c.last.queues
	}
	c.last, c.at = v, c.clock.Now()
	for st, n := range v.counts {
		c.gauge.WithLabelValues(string(st)).Set(float64(n))
	}
	return v, nil
}

// countDatabase counts one database's tasks by state, capped, a state at
// the cap given its last full count.
func (c *counter) countDatabase(ctx context.Context, name string) (databaseCounts, error) {
	capped, err := c.router.Store(name).CountByStateCapped(ctx, store.CountCap)
	if err != nil {
		return databaseCounts{}, err
	}
	d := databaseCounts{name: name, counts: capped, at: c.clock.Now()}
	c.fullMu.Lock()
	defer c.fullMu.Unlock()
	for st, n := range capped {
		if n < store.CountCap {
			continue
		}
		d.estimated = append(d.estimated, st)
		d.counts[st] = max(n, c.full[name][st])
	}
	return d, nil
}

func (c *counter) attention(ctx context.Context) (Attention, error) {
	a := Attention{Dead: []AttentionTask{}, Failed: []AttentionTask{}, LongRunning: []AttentionTask{}}
	for _, l := range []struct {
		state tasks.State
		into  *[]AttentionTask
	}{{tasks.Dead, &a.Dead}, {tasks.Failed, &a.Failed}} {
		page, err := c.router.List(ctx, tasks.ListRequest{Filter: tasks.Filter{States: []tasks.State{l.state}}, Limit: attentionSize, Desc: true})
		if err != nil {
			return Attention{}, err
		}
		for _, t := range page.Tasks {
			*l.into = append(*l.into, attentionTask(t, t.FinishedAt))
		}
	}
	running, err := c.router.LongestRunning(ctx, attentionSize)
	if err != nil {
		return Attention{}, err
	}
	for _, t := range running {
		a.LongRunning = append(a.LongRunning, attentionTask(t, t.ClaimedAt))
	}
	blocked, err := c.router.BlockedSequences(ctx, "", attentionSize)
	if err != nil {
		return Attention{}, err
	}
	a.Blocked = make([]BlockedSequence, len(blocked))
	for i, b := range blocked {
		a.Blocked[i] = BlockedSequence{Key: b.Key, Task: attentionTask(b.Task, b.Task.FinishedAt), Waiting: b.Waiting}
	}
	return a, nil
}

func attentionTask(t tasks.Summary, since *time.Time) AttentionTask {
	return AttentionTask{ID: t.ID, Kind: t.Kind, Shard: t.Shard, State: t.State, Attempt: t.Attempt,
		MaxAttempts: t.MaxAttempts, ClaimedBy: t.ClaimedBy, Since: since}
}

// fullCount counts every state of a database exactly when one of its
// capped counts reached the cap and the last full count is old enough for
// its cost.
func (c *counter) fullCount(ctx context.Context) {
	c.mu.Lock()
	var needed []string
	for _, d := range c.last.databases {
		if len(d.estimated) > 0 {
			needed = append(needed, d.name)
		}
	}
	c.mu.Unlock()
	c.fullMu.Lock()
	due := c.full == nil || c.clock.Now().Sub(c.fullAt) >= max(fullCountEvery, fullCountCost*c.fullTook)
	c.fullMu.Unlock()
	if len(needed) == 0 || !due {
		return
	}
	start := c.clock.Now()
	counted := map[string]map[tasks.State]int64{}
	for _, name := range needed {
		full, err := c.router.Store(name).CountByState(ctx)
		if err != nil {
			if ctx.Err() == nil {
				c.log.Warn("counting all tasks failed", "database", name, "error", err)
			}
			continue
		}
		counted[name] = full
	}
	c.fullMu.Lock()
	if c.full == nil {
		c.full = map[string]map[tasks.State]int64{}
	}
	maps.Copy(c.full, counted)
	c.fullAt, c.fullTook = c.clock.Now(), c.clock.Now().Sub(start)
	c.fullMu.Unlock()
	c.log.Debug("counted all tasks", "took", c.clock.Now().Sub(start), "databases", needed)
}

// Run refreshes the counts every countsRefresh until ctx ends, and the full
// counts as they fall due.
func (c *counter) Run(ctx context.Context) {
	refresh(ctx, c.clock, func(qctx context.Context) {
		if _, err := c.View(qctx); err != nil && ctx.Err() == nil {
			c.log.Warn("counting tasks failed", "error", err)
		}
		fctx, cancel := context.WithTimeout(ctx, time.Minute)
		c.fullCount(fctx)
		cancel()
	})
}

// refresh calls once with a context bounded by countsQueryTime, every
// countsRefresh until ctx ends: the loop of the coordinator's cached
// views.
func refresh(ctx context.Context, clk clock.Clock, once func(qctx context.Context)) {
	for {
		qctx, cancel := context.WithTimeout(ctx, countsQueryTime)
		once(qctx)
		cancel()
		if !clock.Sleep(clk, countsRefresh, ctx.Done()) {
			return
		}
	}
}

// unrunnableWatch is the loop that keeps the
// shardrun_unrunnable_tasks{queue,kind} gauge current on every coordinator,
// and the cache the cluster view reads the unrunnable work from: ready
// tasks of a queue no attached runner serves, or of a kind none of the
// runners serving the queue handles (runners publish their queues and
// kinds in their runners/ key).
type unrunnableWatch struct {
	store    *store.Router
	runnable func(ctx context.Context) (map[tasks.Class]bool, error)
	clock    clock.Clock
	log      hclog.Logger
	gauge    *prometheus.GaugeVec

	mu   sync.Mutex
	last []store.ClassCount
	at   time.Time
}

// Unrunnable returns the ready tasks no attached runner can run, at most
// countsMaxAge old.
func (u *unrunnableWatch) Unrunnable(ctx context.Context) ([]store.ClassCount, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.last != nil && u.clock.Now().Sub(u.at) < countsMaxAge {
		return u.last, nil
	}
	runnable, err := u.runnable(ctx)
	if err != nil {
		return nil, err
	}
	got, err := u.store.ReadyUnrunnable(ctx, slices.Collect(maps.Keys(runnable)))
	if err != nil {
		return nil, err
	}
	if got == nil {
		got = []store.ClassCount{}
	}
	u.last, u.at = got, u.clock.Now()
	u.gauge.Reset()
	for _, cc := range got {
		u.gauge.WithLabelValues(cc.Queue, cc.Kind).Set(float64(cc.Ready))
	}
	return got, nil
}

// Run refreshes every countsRefresh until ctx ends.
func (u *unrunnableWatch) Run(ctx context.Context) {
	refresh(ctx, u.clock, func(qctx context.Context) {
		if _, err := u.Unrunnable(qctx); err != nil && ctx.Err() == nil {
			u.log.Warn("counting ready tasks no attached runner can run failed", "error", err)
		}
	})
}
