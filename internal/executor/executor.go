// Package executor runs a runner's tasks: it claims ready tasks of the
// shards the runner owns, runs their handlers on a bounded pool, heartbeats
// them while they run and records each attempt's outcome. It sits above the
// store and the shard manager and sees them only through the two small
// interfaces below, Store and Ownership.
//
// Three loops, each one type with Run(ctx):
//
//	claimer      raises the fences of newly owned shards, requeues what
//	             earlier owners left running, claims tasks under a Hold of
//	             the owned shards and starts them on the pool, or keeps
//	             them ahead of need (ahead.go); gives back, each round, the
//	             tasks waiting ahead whose shards no longer take work
//	writer       records outcomes, give-backs and starts in batches,
//	             retrying while the database is unreachable and while a
//	             claim is held by another transaction (claims.Busy); each
//	             attempt's done is called after its write, so a shard is
//	             never released with outcomes unwritten
//	heartbeater  beats every running attempt in one statement per interval,
//	             cancels attempts a sweep took back, and cancels those an
//	             operator asked to cancel (the beat returns the requests)
//
// The pool (not a loop) starts one goroutine per attempt and knows which
// attempts run; the claim-ahead buffer (not a loop either) holds the tasks
// claimed before a worker is free for them. Every write is fenced by the
// shard's epoch in the store; a write the fence refuses is reported to
// Ownership as FenceLost, which stops all work on that shard.
package executor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/tasks"
)

// Store is what the executor needs from the database (store.Store).
//
// No statement of it waits for a transaction the runner does not control
// (a handler's, a producer's, one a frozen process left open): a claim row
// such a transaction holds is skipped, and each write that names it
// answers claims.Busy for it (Heartbeat, Complete, Fail, Interrupt,
// CancelAttempts, Unclaim, Started): the write changed nothing there and
// the claim is still the runner's; it writes again later. A fence raise
// or an orphan requeue skips such claims the same way and names their
// terms in Orphans.Pending.
//
// The contract is tested by executortest.StoreContract, against the
// executor's fake and against the real store.
type Store interface {
	// RaiseFences raises the fences of terms (shards of group) and
	// requeues, in the same transaction, what earlier owners left running
	// on them; Orphans.Raised are the terms whose fence now holds their
	// epoch, Orphans.Pending those where claims locked by an open
	// transaction were skipped (RequeueOrphans).
	RaiseFences(ctx context.Context, owner, group string, terms []claims.ShardEpoch) (claims.Orphans, error)
	// RequeueOrphans requeues again the earlier owners' claims of these
	// (already raised) terms that a RaiseFences or an earlier
	// RequeueOrphans skipped because a transaction held them
	// (Orphans.Pending).
	RequeueOrphans(ctx context.Context, owner, group string, terms []claims.ShardEpoch) (claims.Orphans, error)
	// Claim claims up to limit tasks of queue and of kinds, visiting the
	// shards of terms in the order given. The first startNow tasks of the
	// result (in the order returned) are recorded as started now; the
	// others as waiting ahead of need, attempts whose handlers never
	// started: giving one back (Unclaim), an orphan requeue or a stale
	// sweep never spends its attempt.
	Claim(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error)
	// ClaimUrgent is Claim of the tasks more urgent than the default
	// priority only.
	ClaimUrgent(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error)
	// Started records that the handlers of these attempts, claimed ahead,
	// have started: from now on losing the claim spends the attempt.
	Started(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error)
	// ReadyQueues says which of queues have tasks of kinds in the lanes of
	// shards, each with those shards: a hint read without locks, one
	// statement for every queue. truncatedFrom >= 0 says it stopped in that
	// shard, so that the lanes from there on were not all read.
	ReadyQueues(ctx context.Context, shards []int, queues, kinds []string) (found map[string][]int, truncatedFrom int, err error)
	// Claimed lists the attempts owner holds claims of under terms.
	Claimed(ctx context.Context, owner string, terms []claims.ShardEpoch) ([]claims.Ref, error)
	// Unclaim gives back claims whose handlers never ran: ready again with
	// the same attempt (cancelled, if an operator asked meanwhile).
	Unclaim(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error)
	Heartbeat(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error)
	Complete(ctx context.Context, owner string, done []claims.Completion) ([]claims.WriteResult, error)
	Fail(ctx context.Context, owner string, failed []claims.Failure) ([]claims.WriteResult, error)
	Interrupt(ctx context.Context, owner string, cut []claims.Interruption) ([]claims.WriteResult, error)
	CancelAttempts(ctx context.Context, owner string, cancelled []claims.Cancellation) ([]claims.WriteResult, error)
	// Unavailable reports whether err, returned by one of the methods
	// above, means that the database could not serve the statement now
	// (no connection, shutdown, a timeout): the same write may succeed
	// later. Only such writes are retried.
	Unavailable(err error) bool
}

// Ownership is what the executor needs from shard ownership (shard.Manager).
// A term is one ownership of one shard at one epoch.
//
// A term that moves to another runner is not cancelled: it leaves the
// claimable terms at once (Hold, Workable, and Changes is signalled), its
// begun work runs on under its context, and its key is released once that
// work is done. The contract is tested by executortest.OwnershipContract,
// against the executor's fake and against the real manager.
type Ownership interface {
	// Group is the capability group whose shards the terms are: every term
	// is a unit (group, shard), fenced on its own.
	Group() string
	// Unfenced lists the terms whose fence is not yet raised in the
	// database: nothing may be claimed from them until Fenced.
	Unfenced() []claims.ShardEpoch
	// Fenced records that the fences of these terms are raised and their
	// orphans requeued: their shards may be claimed from now on.
	Fenced(terms []claims.ShardEpoch)
	// FenceLost reports a write refused because the shard's fence moved to
	// a newer owner: all work on that term must stop.
	FenceLost(shard int, epoch int64)
	// Hold pins the terms that may be claimed from now for one claim (none
	// while detached or when the lease can no longer be trusted).
	Hold() Hold
	// Changes is signalled, coalesced, when the terms change.
	Changes() <-chan struct{}
	// Workable reports whether new work may start on the term now:
	// attached, the lease clock before its detach point, and the term
	// fenced under the current lease (not releasing, not ended). Called
	// each time a task claimed ahead is about to start; cheap (O(1)).
	Workable(shard int, epoch int64) bool
}

// Hold pins terms while a claim runs: their keys are not released before
// Release, and tasks claimed under the hold may begin even if a release of
// their shard started meanwhile (the handoff then waits for them). Without
// it a claim that commits just as its shard starts to move would leave
// tasks that nobody runs until the next owner requeues them.
type Hold interface {
	// Terms are the held terms, ordered by shard.
	Terms() []claims.ShardEpoch
	// Begin registers work on a held term and returns the term's context;
	// done must be called once the work's outcome is written. ok is false
	// when the work must not start (the term's work was cancelled, or the
	// lease can no longer be trusted).
	Begin(shard int, epoch int64) (ctx context.Context, done func(), ok bool)
	// Release ends the hold.
	Release()
}

// Defaults of Config.
const (
	DefaultMaxWorkers        = 64
	DefaultHeartbeatInterval = claims.DefaultHeartbeatInterval
	DefaultPollInterval      = time.Second
	DefaultFlushDelay        = 5 * time.Millisecond
	DefaultShutdownTimeout   = 30 * time.Second
	DefaultStuckAfter        = 10 * time.Second
	// MaxMaxWorkers bounds MaxWorkers: every running attempt is a goroutine
	// and a claimed row, and the outcome channel holds one slot per worker.
	MaxMaxWorkers = 100_000
	// MaxQueues bounds the queues one runner serves (--queues). An idle
	// runner costs the same whatever its queues (one probe a poll, bench
	// section idle: 0.4% of a core of PostgreSQL at 1,000 and at 2,000
	// queues over 256 shards), but a runner's queues are published in its
	// etcd key (up to 100 bytes a name: 100 KB at 1,000) and read by every
	// coordinator, each queue with work costs a claim statement per round,
	// and the queues of every attached runner make the classes the
	// coordinator checks ready tasks against. 1,000 is ten times the most
	// queues a deployment was seen to ask for, and was measured cheap.
	MaxQueues = 1000
	// flushSize bounds the outcomes written by one statement.
	flushSize = 1024
	// claimBatch bounds the tasks one claim statement takes.
	claimBatch = 1024
)

// dbRetry is how claims and outcome writes retry while the database is
// away: a capped, jittered backoff whose cap bounds how long after the
// database is back the first task starts (measured in the integration
// tests: well under a second), whatever the outage's length. At most a few
// statements a second per runner reach a database that is down.
var dbRetry = clock.Backoff{Min: 50 * time.Millisecond, Max: 400 * time.Millisecond}

// Config configures an Executor. Zero durations and counts take the
// defaults above.
type Config struct {
	// RunnerID is the owner written into every claim; required.
	RunnerID  string
	Store     Store
	Ownership Ownership
	Registry  *Registry
	// Retry decides the backoff after a failed attempt. Default
	// tasks.DefaultRetryPolicy().
	Retry tasks.RetryPolicy
	// MaxWorkers bounds the attempts running at once (--max-workers).
	MaxWorkers int
	// Queues are the queues the executor claims from, each with the most
	// of its tasks that may run at once (--queues); MaxWorkers bounds them
	// all together. Default: the default queue, up to MaxWorkers.
	Queues map[string]int
	// HeartbeatInterval between heartbeats of the running attempts, one
	// statement for all of them (--heartbeat-interval).
	HeartbeatInterval time.Duration
	// PollInterval: claims follow enqueue notifications; polling is the
	// fallback and finds retries whose backoff ended (--poll-interval).
	PollInterval time.Duration
	// FlushDelay: outcomes are written in batches, at most this long after
	// the first outcome of a batch.
	FlushDelay time.Duration
	// ShutdownTimeout bounds how long Run waits for handlers after its
	// context ends.
	ShutdownTimeout time.Duration
	// StuckAfter: a handler still running this long after its context
	// ended (its shard lost, its task taken back) is reported stuck — it
	// ignores cancellation. The runner sets it to --handoff-timeout.
	StuckAfter time.Duration
	Clock      clock.Clock
	Logger     hclog.Logger
	Metrics    *Metrics
	// TracerProvider, when set, traces claims, handler runs and outcome
	// writes (trace.go; docs/reference.md, Traces). Nil: tracing off, at no cost.
	TracerProvider trace.TracerProvider
}

func (c *Config) fill() {
	c.MaxWorkers = cmp.Or(c.MaxWorkers, DefaultMaxWorkers)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, DefaultHeartbeatInterval)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.FlushDelay = cmp.Or(c.FlushDelay, DefaultFlushDelay)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, DefaultShutdownTimeout)
	c.StuckAfter = cmp.Or(c.StuckAfter, DefaultStuckAfter)
	if len(c.Queues) == 0 {
		c.Queues = map[string]int{tasks.DefaultQueue: c.MaxWorkers}
	}
	if c.Retry == (tasks.RetryPolicy{}) {
		c.Retry = tasks.DefaultRetryPolicy()
	}
	c.Clock = cmp.Or(c.Clock, clock.Real())
	c.Logger = cmp.Or(c.Logger, hclog.NewNullLogger())
	c.Metrics = cmp.Or(c.Metrics, NewMetrics(nil))
}

// Validate reports the first bad setting, naming its flag.
func (c Config) Validate() error {
	switch {
	case c.MaxWorkers < 1 || c.MaxWorkers > MaxMaxWorkers:
		return fmt.Errorf("--max-workers: must be 1 to %d (each running task is a goroutine and a claimed row), got %d", MaxMaxWorkers, c.MaxWorkers)
	case c.HeartbeatInterval < 10*time.Millisecond || c.HeartbeatInterval > time.Hour:
		return fmt.Errorf("--heartbeat-interval: must be 10ms to 1h, got %s", c.HeartbeatInterval)
	case c.PollInterval < 10*time.Millisecond || c.PollInterval > time.Hour:
		return fmt.Errorf("--poll-interval: must be 10ms to 1h, got %s", c.PollInterval)
	case c.FlushDelay < 0 || c.FlushDelay > time.Second:
		return fmt.Errorf("executor: flush delay must be 0 to 1s, got %s", c.FlushDelay)
	case c.ShutdownTimeout < 0:
		return fmt.Errorf("executor: shutdown timeout must not be negative, got %s", c.ShutdownTimeout)
	case c.StuckAfter < 0:
		return fmt.Errorf("executor: stuck-after must not be negative, got %s", c.StuckAfter)
	}
	if len(c.Queues) > MaxQueues {
		return fmt.Errorf("--queues: %d queues, at most %d: every served queue is claimed on its own and published in the runner's etcd key", len(c.Queues), MaxQueues)
	}
	for name, limit := range c.Queues {
		if err := tasks.CheckQueue(name); err != nil {
			return fmt.Errorf("--queues: %w", err)
		}
		if limit < 1 || limit > c.MaxWorkers {
			return fmt.Errorf("--queues: queue %s: the worker limit must be 1 to --max-workers (%d), got %d", name, c.MaxWorkers, limit)
		}
	}
	return c.Retry.Validate()
}

// Executor claims tasks of the owned shards and runs them on a bounded pool.
type Executor struct {
	cfg     Config
	log     hclog.Logger
	pool    *pool
	ahead   *ahead
	claimer *claimer
	writer  *writer
	beats   *heartbeater
}

// New fills the defaults of cfg, validates it and wires the loops.
func New(cfg Config) (*Executor, error) {
	cfg.fill()
	switch {
	case cfg.RunnerID == "":
		return nil, errors.New("executor: a runner id is required")
	case cfg.Store == nil || cfg.Ownership == nil || cfg.Registry == nil:
		return nil, errors.New("executor: a store, an ownership and a registry are required")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	results := make(chan result, cfg.MaxWorkers) // a finishing handler never blocks
	tr := newTracer(cfg.TracerProvider, cfg.RunnerID)
	w := &writer{store: cfg.Store, owner: cfg.RunnerID, own: cfg.Ownership, retry: cfg.Retry, in: results,
		delay: cfg.FlushDelay, clock: cfg.Clock, log: cfg.Logger, m: cfg.Metrics, tr: tr, wake: wake.New()}
	p := newPool(cfg.Registry, cfg.MaxWorkers, cfg.Queues, results, cfg.StuckAfter, cfg.Clock, cfg.Metrics, tr)
	a := newAhead(p, cfg.Ownership.Workable, w.post, cfg.Clock, cfg.Logger)
	p.returned = a.returned
	return &Executor{
		cfg:     cfg,
		log:     cfg.Logger,
		pool:    p,
		ahead:   a,
		claimer: newClaimer(cfg, p, a, w, tr),
		writer:  w,
		beats: &heartbeater{store: cfg.Store, owner: cfg.RunnerID, own: cfg.Ownership, pool: p, ahead: a,
			interval: cfg.HeartbeatInterval, clock: cfg.Clock, log: cfg.Logger, m: cfg.Metrics},
	}, nil
}

// Wake tells the executor that shards got ready tasks (all: any shard;
// urgent: shards that got tasks more urgent than the default, which the
// next claim visits first). It never blocks; wake-ups coalesce.
func (e *Executor) Wake(all bool, shards, urgent []int) { e.claimer.Wake(all, shards, urgent) }

// InFlight is the number of attempts running now.
func (e *Executor) InFlight() int { return e.pool.inFlight() }

// Stuck lists the handlers that ignore their cancellation (see
// Config.StuckAfter), oldest first.
func (e *Executor) Stuck() []Stuck { return e.pool.stuck() }

// stalledPolls is how many poll intervals the claim loop may go without a
// completed round before the executor reports itself stalled.
const stalledPolls = 3

// Stalled reports whether the claim loop has made no progress — no claim
// round completed — for several poll intervals while the runner holds
// shards to claim from and has free workers: a runner that keeps its lease
// but no longer works is the worst failure, because nobody takes over.
func (e *Executor) Stalled() (bool, string) {
	since := e.cfg.Clock.Now().Sub(e.claimer.lastRound())
	if since <= stalledPolls*e.cfg.PollInterval || e.pool.idle() <= 0 || e.claimer.heldCount() == 0 {
		return false, ""
	}
	return true, fmt.Sprintf("no claim round completed for %s (poll interval %s) while holding %d shards", since.Round(time.Millisecond), e.cfg.PollInterval, e.claimer.heldCount())
}

// Run claims and runs tasks until ctx ends. Then it stops claiming, lets the
// running attempts finish (their contexts end when their shards are
// released, bounded by ShutdownTimeout), writes their outcomes and returns.
func (e *Executor) Run(ctx context.Context) error {
	kinds := e.cfg.Registry.Kinds()
	if len(kinds) == 0 {
		return errors.New("executor: no handlers registered")
	}
	e.claimer.kinds = kinds
	// The writer and the heartbeats outlive ctx: outcomes of attempts that
	// finish during the drain must still be written, and those attempts
	// must still be beaten meanwhile.
	writerCtx, stopWriter := context.WithCancel(context.WithoutCancel(ctx))
	beatCtx, stopBeats := context.WithCancel(context.WithoutCancel(ctx))
	var writer, beats sync.WaitGroup
	writer.Go(func() { e.writer.Run(writerCtx) })
	beats.Go(func() { e.beats.Run(beatCtx) })

	e.claimer.Run(ctx)
	// What was claimed ahead goes back to the lanes at once: no new
	// handler starts during the drain.
	e.ahead.close()

	if !e.pool.wait(e.cfg.ShutdownTimeout) {
		e.log.Warn("handlers still running after the shutdown timeout; leaving them", "running", e.pool.inFlight())
	}
	stopWriter()
	writer.Wait()
	stopBeats()
	beats.Wait()
	return nil
}
