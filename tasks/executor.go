package tasks

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/clock"
)

// Store is what the executor needs from the database (store.Store).
type Store interface {
	RaiseFences(ctx context.Context, owner string, owned []ShardEpoch) ([]ShardEpoch, error)
	RequeueOrphans(ctx context.Context, owner string, owned []ShardEpoch) (requeued, dead int64, err error)
	Claim(ctx context.Context, owner string, owned []ShardEpoch, kinds []string, limit int) ([]Task, error)
	Unclaim(ctx context.Context, owner string, refs []Ref) ([]WriteResult, error)
	Heartbeat(ctx context.Context, owner string, refs []Ref) ([]WriteResult, error)
	Complete(ctx context.Context, owner string, done []Completion) ([]WriteResult, error)
	Fail(ctx context.Context, owner string, failed []Failure) ([]WriteResult, error)
}

// Ownership is what the executor needs from shard membership
// (shard.Manager).
type Ownership interface {
	// Owned lists the shards the runner may work on; empty while detached.
	Owned() []ShardEpoch
	// Hold pins shards for one claim (see ClaimHold).
	Hold(owned []ShardEpoch) ClaimHold
	// FenceLost reports a write refused because the shard moved on.
	FenceLost(shard int, epoch int64)
	// Changes is signalled when the owned set changes.
	Changes() <-chan struct{}
}

// ClaimHold pins shards while a claim runs: their keys are not released
// before Release, and tasks claimed under the hold may begin even if a
// release of their shard started meanwhile (the handoff then waits for
// them). Without it a claim that commits just as its shard starts to move
// would leave tasks that nobody runs until the next owner requeues them,
// spending an attempt.
type ClaimHold interface {
	// Begin registers work on a held shard and returns its context; done
	// must be called once the work's outcome is written.
	Begin(shard int, epoch int64) (ctx context.Context, done func(), ok bool)
	// Release ends the hold.
	Release()
}

// Executor defaults.
const (
	DefaultMaxWorkers        = 64
	DefaultHeartbeatInterval = 5 * time.Second
	DefaultPollInterval      = time.Second
	defaultFlushDelay        = 5 * time.Millisecond
	defaultFlushSize         = 256
	maxClaimBatch            = 512
)

// ExecutorConfig configures an Executor.
type ExecutorConfig struct {
	RunnerID  string
	Store     Store
	Ownership Ownership
	Registry  *Registry
	// Retry decides the backoff after a failed attempt.
	Retry RetryPolicy
	// MaxWorkers bounds the tasks running at once. Default 64.
	MaxWorkers int
	// HeartbeatInterval between the heartbeats of running tasks (one
	// statement for all of them). Default 5s.
	HeartbeatInterval time.Duration
	// PollInterval: the executor claims on enqueue notifications; polling
	// is the fallback (and finds retries whose backoff ended). Default 1s.
	PollInterval time.Duration
	// FlushDelay: completions and failures are written in batches, at most
	// this long after the first one of a batch. Default 5ms.
	FlushDelay time.Duration
	// ShutdownTimeout bounds how long Run waits for handlers after its
	// context ends. Default 30s.
	ShutdownTimeout time.Duration
	Clock           clock.Clock
	Logger          hclog.Logger
	Metrics         *Metrics
}

// Executor claims tasks of the owned shards and runs them on a bounded pool.
type Executor struct {
	cfg   ExecutorConfig
	log   hclog.Logger
	clock clock.Clock
	m     *Metrics
	kinds []string

	wake     chan struct{}
	slots    chan struct{}
	inflight atomic.Int64
	owned    atomic.Pointer[map[int]bool]

	mu      sync.Mutex
	running map[int64]*running

	results chan result
	fenced  map[int]int64
}

type running struct {
	task   Task
	cancel context.CancelFunc
}

// result is one attempt's outcome on its way to the database.
type result struct {
	task    Task
	err     error // nil: completed
	elapsed time.Duration
	done    func()
}

// NewExecutor validates cfg.
func NewExecutor(cfg ExecutorConfig) (*Executor, error) {
	cfg.MaxWorkers = cmp.Or(cfg.MaxWorkers, DefaultMaxWorkers)
	cfg.HeartbeatInterval = cmp.Or(cfg.HeartbeatInterval, DefaultHeartbeatInterval)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, DefaultPollInterval)
	cfg.FlushDelay = cmp.Or(cfg.FlushDelay, defaultFlushDelay)
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, 30*time.Second)
	if cfg.Retry == (RetryPolicy{}) {
		cfg.Retry = DefaultRetryPolicy()
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real()
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	switch {
	case cfg.RunnerID == "":
		return nil, errors.New("executor: runner id required")
	case cfg.Store == nil || cfg.Ownership == nil || cfg.Registry == nil:
		return nil, errors.New("executor: store, ownership and registry are required")
	case cfg.MaxWorkers < 1:
		return nil, &FieldError{Field: "max_workers", Problem: fmt.Sprintf("must be at least 1, got %d", cfg.MaxWorkers)}
	case cfg.HeartbeatInterval < 0 || cfg.PollInterval < 0:
		return nil, &FieldError{Field: "heartbeat_interval", Problem: "intervals must be positive"}
	}
	if err := cfg.Retry.Validate(); err != nil {
		return nil, err
	}
	e := &Executor{
		cfg: cfg, log: cfg.Logger, clock: cfg.Clock, m: cfg.Metrics,
		wake:    make(chan struct{}, 1),
		slots:   make(chan struct{}, 1),
		running: map[int64]*running{},
		results: make(chan result, cfg.MaxWorkers),
		fenced:  map[int]int64{},
	}
	empty := map[int]bool{}
	e.owned.Store(&empty)
	return e, nil
}

// Wake tells the executor that shards got ready tasks (all: any shard). It
// never blocks; wake-ups coalesce.
func (e *Executor) Wake(all bool, shards []int) {
	if !all {
		owned := *e.owned.Load()
		hit := false
		for _, s := range shards {
			if owned[s] {
				hit = true
				break
			}
		}
		if !hit {
			return
		}
	}
	signal(e.wake)
}

// InFlight is the number of tasks running now.
func (e *Executor) InFlight() int { return int(e.inflight.Load()) }

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// Run claims and runs tasks until ctx ends, then stops claiming, lets the
// running tasks finish (their contexts end when their shards are released),
// writes their outcomes and returns.
func (e *Executor) Run(ctx context.Context) error {
	e.kinds = e.cfg.Registry.Kinds()
	if len(e.kinds) == 0 {
		return errors.New("executor: no handlers registered")
	}
	bg, stopBg := context.WithCancel(context.WithoutCancel(ctx))
	stopWriter := make(chan struct{})
	var writer, heartbeats sync.WaitGroup
	writer.Go(func() { e.writer(bg, stopWriter) })
	heartbeats.Go(func() { e.heartbeats(bg) })
	var workers sync.WaitGroup

	e.claimLoop(ctx, &workers)

	finished := make(chan struct{})
	go func() { workers.Wait(); close(finished) }()
	t := e.clock.NewTimer(e.cfg.ShutdownTimeout)
	select {
	case <-finished:
		t.Stop()
	case <-t.C():
		e.log.Warn("handlers still running after the shutdown timeout; leaving them", "running", e.InFlight())
	}
	// The writer flushes what is left (under bg), then heartbeats stop.
	close(stopWriter)
	writer.Wait()
	stopBg()
	heartbeats.Wait()
	return nil
}

func (e *Executor) claimLoop(ctx context.Context, workers *sync.WaitGroup) {
	poll := e.clock.NewTimer(e.cfg.PollInterval)
	defer poll.Stop()
	backoff := time.Duration(0)
	for {
		n, limit, err := e.claimOnce(ctx, workers)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			backoff = min(max(2*backoff, 100*time.Millisecond), 5*time.Second)
			e.log.Warn("claiming failed", "error", err, "backoff", backoff)
			if !clock.Sleep(e.clock, backoff, ctx.Done()) {
				return
			}
			continue
		}
		backoff = 0
		if n > 0 && n == limit {
			continue // more work is likely waiting
		}
		poll.Reset(e.cfg.PollInterval)
		select {
		case <-ctx.Done():
			return
		case <-e.wake:
		case <-e.slots:
		case <-e.cfg.Ownership.Changes():
		case <-poll.C():
		}
	}
}

// claimOnce fences newly owned shards, then claims as many tasks as there
// are free workers and starts them. It returns how many it claimed and the
// limit it asked for.
func (e *Executor) claimOnce(ctx context.Context, workers *sync.WaitGroup) (n, limit int, err error) {
	owned := e.cfg.Ownership.Owned()
	set := make(map[int]bool, len(owned))
	for _, se := range owned {
		set[se.Shard] = true
	}
	e.owned.Store(&set)
	for s := range e.fenced {
		if !set[s] {
			delete(e.fenced, s)
		}
	}
	if err := e.fenceNew(ctx, owned); err != nil {
		return 0, 0, err
	}
	claimable := owned[:0:0]
	for _, se := range owned {
		if e.fenced[se.Shard] == se.Epoch {
			claimable = append(claimable, se)
		}
	}
	limit = min(e.cfg.MaxWorkers-e.InFlight(), maxClaimBatch)
	if len(claimable) == 0 || limit <= 0 {
		return 0, limit, nil
	}
	// A claim is not cancelled by shutdown: a cancelled statement may still
	// have committed, leaving claims nobody runs.
	hold := e.cfg.Ownership.Hold(claimable)
	defer hold.Release()
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	claimed, err := e.cfg.Store.Claim(cctx, e.cfg.RunnerID, claimable, e.kinds, limit)
	cancel()
	if err != nil {
		return 0, limit, err
	}
	e.m.Claimed.Add(float64(len(claimed)))
	var giveBack []Ref
	for _, t := range claimed {
		sctx, done, ok := hold.Begin(t.Shard, t.Epoch)
		if !ok {
			giveBack = append(giveBack, t.Ref())
			continue
		}
		e.start(sctx, t, done, workers)
	}
	if len(giveBack) > 0 {
		e.unclaim(giveBack)
	}
	return len(claimed), limit, nil
}

// unclaim returns claims made just as their shard began to move. If the
// fence has already moved, the next owner requeues them instead.
func (e *Executor) unclaim(refs []Ref) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	res, err := e.cfg.Store.Unclaim(ctx, e.cfg.RunnerID, refs)
	if err != nil {
		e.log.Warn("giving back claims on a moving shard failed; the next owner requeues them", "tasks", len(refs), "error", err)
		return
	}
	for _, r := range res {
		e.log.Debug("gave back a claim on a moving shard", "task", r.Ref.ID, "shard", r.Ref.Shard, "outcome", r.Outcome.String())
	}
}

// fenceNew raises the fence of every newly owned shard and requeues the
// tasks that earlier owners left running, before anything is claimed there.
func (e *Executor) fenceNew(ctx context.Context, owned []ShardEpoch) error {
	var fresh []ShardEpoch
	for _, se := range owned {
		if e.fenced[se.Shard] != se.Epoch {
			fresh = append(fresh, se)
		}
	}
	if len(fresh) == 0 {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	raised, err := e.cfg.Store.RaiseFences(cctx, e.cfg.RunnerID, fresh)
	if err != nil {
		return fmt.Errorf("raising fences: %w", err)
	}
	ok := make(map[int]int64, len(raised))
	for _, se := range raised {
		ok[se.Shard] = se.Epoch
	}
	for _, se := range fresh {
		if ok[se.Shard] != se.Epoch {
			e.m.FenceRejections.Inc()
			e.cfg.Ownership.FenceLost(se.Shard, se.Epoch)
		}
	}
	if len(raised) == 0 {
		return nil
	}
	requeued, dead, err := e.cfg.Store.RequeueOrphans(cctx, e.cfg.RunnerID, raised)
	if err != nil {
		return fmt.Errorf("requeueing orphans: %w", err)
	}
	for _, se := range raised {
		e.fenced[se.Shard] = se.Epoch
	}
	if requeued+dead > 0 {
		e.log.Info("requeued tasks orphaned by earlier owners", "shards", len(raised), "requeued", requeued, "dead", dead)
	}
	return nil
}

// start runs one claimed task on its own goroutine.
func (e *Executor) start(shardCtx context.Context, t Task, done func(), workers *sync.WaitGroup) {
	h, _ := e.cfg.Registry.Lookup(t.Kind)
	var tctx context.Context
	var cancel context.CancelFunc
	if t.Deadline != nil {
		tctx, cancel = context.WithDeadline(shardCtx, *t.Deadline)
	} else {
		tctx, cancel = context.WithCancel(shardCtx)
	}
	e.mu.Lock()
	e.running[t.ID] = &running{task: t, cancel: cancel}
	e.mu.Unlock()
	e.inflight.Add(1)
	e.m.InFlight.Inc()
	workers.Go(func() {
		start := e.clock.Now()
		task := t
		err := call(tctx, h, &task)
		cancel()
		e.mu.Lock()
		delete(e.running, t.ID)
		e.mu.Unlock()
		e.results <- result{task: task, err: err, elapsed: e.clock.Now().Sub(start), done: done}
		e.inflight.Add(-1)
		e.m.InFlight.Dec()
		signal(e.slots)
	})
}

// call runs the handler, turning a panic into an error that carries the
// panic text and stack: the attempt fails, the runner keeps going.
func call(ctx context.Context, h Handler, t *Task) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v\n%s", r, debug.Stack())
		}
	}()
	return h(ctx, t)
}

// writer records outcomes in batches: everything that arrives within
// FlushDelay of the first result, up to defaultFlushSize, in one statement
// per kind of write. Each attempt's done is called after its write, so a
// shard is never released before its outcomes are written. When stop is
// closed it writes what is left, within a bounded time, and returns; the
// results channel holds MaxWorkers results, so a late handler never blocks.
func (e *Executor) writer(ctx context.Context, stop <-chan struct{}) {
	var batch []result
	timer := e.clock.NewTimer(time.Hour)
	timer.Stop()
	for {
		var fire <-chan time.Time
		if len(batch) > 0 {
			fire = timer.C()
		}
		select {
		case r := <-e.results:
			if len(batch) == 0 {
				timer.Reset(e.cfg.FlushDelay)
			}
			batch = append(batch, r)
			if len(batch) < defaultFlushSize {
				continue
			}
			timer.Stop()
		case <-fire:
		case <-stop:
			for more := true; more; {
				select {
				case r := <-e.results:
					batch = append(batch, r)
				default:
					more = false
				}
			}
			fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			e.flush(fctx, batch)
			cancel()
			return
		}
		e.flush(ctx, batch)
		batch = batch[:0]
	}
}

func (e *Executor) flush(ctx context.Context, batch []result) {
	if len(batch) == 0 {
		return
	}
	var completions []Completion
	var failures []Failure
	var cItems, fItems []result
	for _, r := range batch {
		if r.err == nil {
			completions = append(completions, Completion{Ref: r.task.Ref(), Result: r.task.Result})
			cItems = append(cItems, r)
		} else {
			failures = append(failures, Failure{Ref: r.task.Ref(), Error: r.err.Error(), RetryAfter: e.cfg.Retry.Backoff(r.task.Attempt, nil)})
			fItems = append(fItems, r)
		}
	}
	if len(completions) > 0 {
		res := e.retryWrite(ctx, "completing", func(c context.Context) ([]WriteResult, error) {
			return e.cfg.Store.Complete(c, e.cfg.RunnerID, completions)
		})
		e.account(cItems, res)
	}
	if len(failures) > 0 {
		res := e.retryWrite(ctx, "failing", func(c context.Context) ([]WriteResult, error) {
			return e.cfg.Store.Fail(c, e.cfg.RunnerID, failures)
		})
		e.account(fItems, res)
	}
	for _, r := range batch {
		r.done()
	}
}

// retryWrite retries a batch write while the database is unreachable; the
// outcomes stay valid as long as the fence does (the write is fenced). It
// gives up when ctx ends (shutdown bound).
func (e *Executor) retryWrite(ctx context.Context, what string, write func(context.Context) ([]WriteResult, error)) []WriteResult {
	backoff := 50 * time.Millisecond
	for {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		res, err := write(cctx)
		cancel()
		if err == nil {
			return res
		}
		if ctx.Err() != nil {
			e.log.Error("giving up writing task outcomes at shutdown", "what", what, "error", err)
			return nil
		}
		e.log.Warn("writing task outcomes failed; retrying", "what", what, "error", err, "backoff", backoff)
		if !clock.Sleep(e.clock, backoff, ctx.Done()) {
			return nil
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

func (e *Executor) account(items []result, res []WriteResult) {
	for i, r := range res {
		it := items[i]
		switch r.Outcome {
		case Applied:
			outcome := string(r.State)
			if r.State == Ready {
				outcome = "retried"
			}
			e.m.Finished.WithLabelValues(it.task.Kind, outcome).Inc()
			e.m.Duration.Observe(it.elapsed.Seconds())
		case FenceLost:
			e.m.FenceRejections.Inc()
			e.log.Warn("outcome refused: shard fence moved on", "task", it.task.ID, "shard", it.task.Shard, "epoch", it.task.Epoch)
			e.cfg.Ownership.FenceLost(it.task.Shard, it.task.Epoch)
		default:
			e.log.Info("outcome dropped: the task moved on", "task", it.task.ID, "outcome", r.Outcome.String())
		}
	}
}

// heartbeats records, every interval, that all running tasks are alive, in
// one statement. A task whose fence moved loses its shard; a task that a
// sweep took back is cancelled.
func (e *Executor) heartbeats(ctx context.Context) {
	t := e.clock.NewTimer(e.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		}
		t.Reset(e.cfg.HeartbeatInterval)
		e.mu.Lock()
		refs := make([]Ref, 0, len(e.running))
		for _, r := range e.running {
			refs = append(refs, r.task.Ref())
		}
		e.mu.Unlock()
		if len(refs) == 0 {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, e.cfg.HeartbeatInterval)
		res, err := e.cfg.Store.Heartbeat(cctx, e.cfg.RunnerID, refs)
		cancel()
		if err != nil {
			e.log.Warn("heartbeat failed", "tasks", len(refs), "error", err)
			continue
		}
		for _, r := range res {
			switch r.Outcome {
			case FenceLost:
				e.m.FenceRejections.Inc()
				e.cfg.Ownership.FenceLost(r.Ref.Shard, r.Ref.Epoch)
			case TaskMoved, TaskGone:
				e.mu.Lock()
				if run := e.running[r.Ref.ID]; run != nil {
					run.cancel()
				}
				e.mu.Unlock()
				e.log.Warn("running task was taken back (stale claim swept); cancelled it", "task", r.Ref.ID)
			}
		}
	}
}
