package executor

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/tasks"
)

// claimTimeout bounds one claim or fence statement.
const claimTimeout = 10 * time.Second

// probeAbove is the most queues a runner claims from directly when a
// notification names shards. Each served queue's claim reads every lane of
// the queue in the shards it visits: an idle runner serving 2,000 queues
// over 256 shards sent 2,000 claims a poll, 56% of a core of PostgreSQL
// (finding 5 of the hostile-input review; bench section idle). A runner
// serving more queues than this first asks which queues have tasks in
// which shards, in one statement for them all (Store.ReadyQueues, a loose
// scan of the lanes: one index descent when nothing is ready), for the
// shards each notification names, and claims only from those. A runner
// serving this many or fewer claims from the notified shards directly:
// the probe would add a round trip to the wake-up path.
//
// The poll probes first whatever the number of queues (issue 41): a claim
// per served queue over every held shard each poll made an idle fleet's
// cost grow with runners × shards (16 idle runners over 4,096 shards kept
// PostgreSQL at about half a core), where one probe of every held shard
// costs an index descent per database when nothing is ready. The probe
// reads task_ready, where a task is from its commit whether due or not,
// so a task whose notification was lost, or whose run_after came due, is
// still found by the next poll; a probe that fails makes every held shard
// pending for every queue, the poll as it was before.
const probeAbove = 4

// partialWarnEvery is the least time between two warnings of claims that
// failed at some databases only (the others' tasks run meanwhile).
const partialWarnEvery = 30 * time.Second

// orphansRetryMax caps the backoff between requeues of orphans a
// transaction held: well under the lease TTL (10s by default), which bounds
// such a transaction after CompleteTx, so that a held task is requeued
// soon after its transaction ends.
const orphansRetryMax = 5 * time.Second

// claimer is the claim loop: it fences newly owned shards, claims ready
// tasks of the held ones and starts them on the pool or keeps them ahead.
//
// Nothing one term needs holds up the others: a fence raise that fails is
// tried again later (raiseAt) while the terms fenced already are claimed
// from, and the orphans of a fenced term that a transaction still holds
// (Orphans.Pending) are requeued by later rounds (orphansAt) while the
// term's lanes are claimed from meanwhile: the locked claims are in no
// lane.
type claimer struct {
	store  Store
	owner  string
	own    Ownership
	pool   *pool
	ahead  *ahead
	writer *writer
	kinds  []string
	poll   time.Duration
	clock  clock.Clock
	log    hclog.Logger
	m      *Metrics
	tr     *tracer // nil: tracing off
	// partialWarned is when a claim that failed at some databases was
	// last logged, and partialQuiet how many such claims were not logged
	// since: an outage of one database fails a part of every claim round,
	// and a warning per round would bury the log.
	partialWarned time.Time
	partialQuiet  int
	// wake is signalled by enqueue notifications for held shards.
	wake wake.Signal
	// notified is when Wake last signalled (unix nanoseconds, wall
	// clock; kept only while tracing is on), and woke the round that
	// notification started (owned by Run): the hops of the wake-up path
	// on the claim batch span.
	notified atomic.Int64
	woke     wokeBy
	// queues are the queues served, in name order, each with its worker
	// limit and its pending shards; turn rotates which claims first.
	queues []*queueClaims
	turn   int
	// probe decides which queues' pending sets learn of which shards at
	// each poll and, when more than probeAbove queues are served
	// (!probe.direct), for the shards notifications name and those newly
	// held too; otherwise every queue's set marks those itself.
	probe *prober
	// held are the shards of the last hold, to filter notifications.
	held atomic.Pointer[map[int]bool]
	// round is when the last claim round completed (unix nanoseconds on
	// the executor's clock), for Stalled.
	round atomic.Int64
	// unsure: a claim statement failed without a clear answer, so it may
	// have committed claims nobody runs. The next round gives them back
	// first (recover). unsureTerms, when not nil, narrows it to these
	// terms: a claim over several databases failed at some of them only
	// (claims.PartialError). Owned by Run.
	unsure      bool
	unsureTerms map[claims.ShardEpoch]bool
	// recoverAt is when the listing of some terms' claims (unsureTerms)
	// that failed is tried again, paced by recoverBackoff: it fails while
	// their database is down, and a round comes at nearly every handler's
	// return under load (issue 40), so retried each round it was a
	// statement and a warning a round for as long as the outage lasts.
	// Zero when a term newly unsure is to be listed at once.
	recoverAt      time.Time
	recoverBackoff clock.Backoff
	// budget is the last round's measure of the workers that free up
	// soon. Owned by Run, as are the fields below.
	budget budget
	// sweepDue: the terms changed, or the poll interval passed, since the
	// tasks waiting ahead were last checked (ahead.sweep).
	sweepDue bool
	// raiseAt is when a fence raise that failed is tried again, paced by
	// raiseBackoff.
	raiseAt      time.Time
	raiseBackoff clock.Backoff
	// orphans are the fenced terms whose earlier owners' claims were
	// skipped, held by a transaction (Orphans.Pending): requeued again
	// from orphansAt, at most once per poll interval, paced by
	// orphansBackoff.
	orphans        map[claims.ShardEpoch]bool
	orphansAt      time.Time
	orphansBackoff clock.Backoff
}

// queueClaims is one served queue: how many of its tasks may run at once,
// and which held shards may have its tasks due.
type queueClaims struct {
	name    string
	limit   int
	pending *pending
}

func newClaimer(cfg Config, p *pool, a *ahead, w *writer, tr *tracer) *claimer {
	c := &claimer{store: cfg.Store, owner: cfg.RunnerID, own: cfg.Ownership, pool: p, ahead: a, writer: w,
		poll: cfg.PollInterval, clock: cfg.Clock, log: cfg.Logger, m: cfg.Metrics, tr: tr, wake: wake.New(),
		raiseBackoff: dbRetry, recoverBackoff: dbRetry, orphans: map[claims.ShardEpoch]bool{}, sweepDue: true,
		orphansBackoff: clock.Backoff{Min: cfg.PollInterval, Max: max(cfg.PollInterval, orphansRetryMax)}}
	probed := len(cfg.Queues) > probeAbove
	c.probe = newProber(cfg.Clock.Now(), !probed)
	// A store that splits a claim between databases says which part each
	// shard's claims go to (store.Router.PartOf), so that a claim's
	// drained shards are judged per part.
	var partOf func(int) int
	if ps, ok := cfg.Store.(interface{ PartOf(shard int) int }); ok {
		partOf = ps.PartOf
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.Queues)) {
		q := &queueClaims{name: name, limit: cfg.Queues[name], pending: newPending(probed)}
		q.pending.partOf = partOf
		c.queues = append(c.queues, q)
		c.probe.names = append(c.probe.names, name)
	}
	c.round.Store(cfg.Clock.Now().UnixNano())
	return c
}

func (c *claimer) lastRound() time.Time { return time.Unix(0, c.round.Load()) }

func (c *claimer) heldCount() int {
	if held := c.held.Load(); held != nil {
		return len(*held)
	}
	return 0
}

// Wake is called for enqueue notifications (all: any shard; urgent: the
// shards that got tasks more urgent than the default). It never blocks;
// wake-ups coalesce.
func (c *claimer) Wake(all bool, shards, urgent []int) {
	if !c.probe.direct {
		c.probe.notify(all, shards, urgent)
	} else {
		for _, q := range c.queues {
			q.pending.notify(all, shards, urgent)
		}
	}
	if !all {
		held := c.held.Load()
		if held == nil {
			return
		}
		hit := false
		for _, s := range shards {
			if (*held)[s] {
				hit = true
				break
			}
		}
		if !hit {
			return
		}
	}
	if c.tr != nil {
		c.notified.Store(time.Now().UnixNano())
	}
	c.wake.Notify()
}

// Run claims until ctx ends.
func (c *claimer) Run(ctx context.Context) {
	poll := c.clock.NewTimer(c.poll)
	defer poll.Stop()
	backoff := dbRetry
	for {
		err := c.once(ctx)
		c.woke = wokeBy{}
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			wait := backoff.Next()
			c.log.Warn("claiming failed", "error", err, "backoff", wait)
			// A wake-up ends the wait: the listener sends one for every
			// shard as soon as it has reconnected, which after an outage
			// says the database is back (the first task then starts within
			// a round trip of the reconnection, not a backoff later).
			poll.Reset(wait)
			select {
			case <-ctx.Done():
				return
			case <-c.wake.C():
			case <-poll.C():
			}
			continue
		}
		backoff.Reset()
		c.round.Store(c.clock.Now().UnixNano())
		if c.more() {
			continue // more work may be waiting
		}
		poll.Reset(c.wait())
		select {
		case <-ctx.Done():
			return
		case <-c.wake.C():
			if c.tr != nil {
				c.woke = wokeBy{notified: time.Unix(0, c.notified.Load()), woke: time.Now()}
			}
		case <-c.pool.freed.C():
		case <-c.own.Changes():
			c.sweepDue = true
		case <-poll.C():
			c.sweepDue = true
		}
	}
}

// recoverAtIfUnsure is recoverAt while some terms wait for their claims
// to be listed (zero otherwise), for wait.
func (c *claimer) recoverAtIfUnsure() time.Time {
	if !c.unsure || c.unsureTerms == nil {
		return time.Time{}
	}
	return c.recoverAt
}

// wait is how long the loop may sleep when nothing wakes it: the poll
// interval, or less when a fence raise or an orphan requeue is due again,
// or a task waiting ahead outstays aheadPatience, before that.
func (c *claimer) wait() time.Duration {
	now, d := c.clock.Now(), c.poll
	for _, at := range []time.Time{c.raiseAt, c.orphansAt, c.recoverAtIfUnsure(), c.ahead.nextStale()} {
		if !at.IsZero() {
			d = min(d, max(at.Sub(now), 0))
		}
	}
	return d
}

// once gives back the tasks waiting ahead whose terms no longer take work,
// fences newly owned shards, requeues orphans left pending, then claims as
// many tasks as there are free workers (and workers that free up soon)
// from the held shards that may have due tasks, and starts them.
func (c *claimer) once(ctx context.Context) error {
	// First, whatever happens to the rest of the round: a moving shard's
	// release waits for them. Only when the terms changed (the loop may go
	// from round to round without waiting, under load), at the poll, or
	// when one of them is due to outstay its patience: a round follows
	// nearly every handler's return when handlers are short.
	select {
	case <-c.own.Changes():
		c.sweepDue = true
	default:
	}
	if now, at := c.clock.Now(), c.ahead.nextStale(); c.sweepDue || (!at.IsZero() && !now.Before(at)) {
		c.sweepDue = false
		c.ahead.sweep(now)
	}
	c.fence(ctx)
	hold := &pinnedHold{Hold: c.own.Hold(), n: 1}
	defer hold.unpin()
	terms := hold.Terms()
	held := make(map[int]bool, len(terms))
	for _, t := range terms {
		held[t.Shard] = true
	}
	c.held.Store(&held)
	if c.unsure && (c.unsureTerms == nil || !c.clock.Now().Before(c.recoverAt)) {
		rterms := terms
		if c.unsureTerms != nil {
			rterms = slices.DeleteFunc(slices.Clone(terms), func(t claims.ShardEpoch) bool { return !c.unsureTerms[t] })
		}
		var partial *claims.PartialError
		switch err := c.recover(ctx, hold, rterms); {
		case errors.As(err, &partial):
			// Narrowed to the failed databases' terms (unsureOf leaves a
			// claimer unsure of every term as it is).
			c.unsure, c.unsureTerms = false, nil
			c.unsureOf(partial.Terms)
			c.recoverAt = c.clock.Now().Add(c.recoverBackoff.Next())
			c.log.Warn("listing claims after a failed claim failed at some databases; trying there again next round", "error", err)
		case err != nil && c.unsureTerms == nil:
			return err
		case err != nil:
			// Only some databases' terms are unsure: the others are claimed
			// from meanwhile.
			c.recoverAt = c.clock.Now().Add(c.recoverBackoff.Next())
			c.log.Warn("listing claims after a failed claim failed; trying again next round", "terms", len(rterms), "error", err)
		default:
			c.unsure, c.unsureTerms = false, nil
			c.recoverAt = time.Time{}
			c.recoverBackoff.Reset()
		}
	}
	c.requeueOrphans(ctx, terms)
	if len(terms) == 0 {
		return nil
	}
	c.budget = c.pool.soon(c.clock.Now(), aheadCover)
	if err := c.probeLanes(ctx, terms); err != nil {
		return err
	}
	// Queues with work waiting share the free workers: one queue's backlog
	// must not take every worker from another queue's tasks. The first to
	// claim rotates, and a share a queue leaves unused goes to the next
	// round.
	type visit struct {
		q            *queueClaims
		first, order []claims.ShardEpoch
	}
	var waiting []visit
	for _, q := range c.queues {
		if q.pending.quiet() {
			continue
		}
		if first, order := q.pending.order(terms); len(order) > 0 {
			waiting = append(waiting, visit{q, first, order})
		}
	}
	if len(waiting) == 0 {
		return nil
	}
	c.turn = (c.turn + 1) % len(waiting)
	room := 0
	for _, v := range waiting {
		now, more := c.ahead.room(v.q.name, c.budget)
		room += now + more
	}
	share := (room + len(waiting) - 1) / len(waiting)
	for i := range waiting {
		v := waiting[(c.turn+i)%len(waiting)]
		if err := c.claimQueue(ctx, hold, v.q, v.first, v.order, share); err != nil {
			return err
		}
	}
	return nil
}

// probeLanes asks which served queues have tasks in the held shards that
// may have some — all of them at each poll, else (!probe.direct) those
// notifications named and those newly held; never those every queue's
// pending set holds already — and tells each queue's pending set. A
// probed runner asks nothing while no worker is free: the requests wait
// for the next round. A direct one asks at the poll
// whatever its load, as its poll marked every shard pending whatever its
// load before the probe; when that probe fails, every held shard is
// pending for every queue, and the claims find what there is (or fail,
// and the round with them).
func (c *claimer) probeLanes(ctx context.Context, terms []claims.ShardEpoch) error {
	if !c.probe.direct && c.pool.idle() <= 0 {
		return nil
	}
	shards, urgent := c.probe.take(terms, c.clock.Now(), c.poll)
	// A shard every served queue's pending set already holds gains
	// nothing from the probe but an urgent mark: this round's claims read
	// its lanes anyway, later than the probe would. Where a backlog keeps
	// shards pending, the probe stepped over their lanes' dead entries
	// for nothing (bench section mixed, one runner: 0.6 s of probes
	// before, 0.3 s after; docs/performance.md, issue 41 fourth round).
	shards = slices.DeleteFunc(shards, func(s int) bool {
		if urgent[s] {
			return false
		}
		for _, q := range c.queues {
			if !q.pending.covers(s) {
				return false
			}
		}
		return true
	})
	if len(shards) == 0 {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, claimTimeout)
	found, truncatedFrom, err := c.store.ReadyQueues(cctx, shards, c.probe.names, c.kinds)
	cancel()
	if err != nil && c.probe.direct {
		c.log.Debug("probing the lanes at the poll failed; claiming from every held shard", "shards", len(shards), "error", err)
		for _, q := range c.queues {
			q.pending.notify(true, nil, nil)
		}
		return nil
	}
	if err != nil {
		c.probe.retry(urgent)
		return fmt.Errorf("asking which of %d queues have tasks in %d shards: %w", len(c.probe.names), len(shards), err)
	}
	var rest []int // shards the probe did not read to the end: every queue may have tasks there
	if truncatedFrom >= 0 {
		for _, s := range shards {
			if s >= truncatedFrom {
				rest = append(rest, s)
			}
		}
	}
	for _, q := range c.queues {
		mine := found[q.name]
		if len(rest) > 0 {
			mine = append(slices.Clone(mine), rest...)
		}
		if len(mine) == 0 {
			continue
		}
		var hot []int
		for _, s := range mine {
			if urgent[s] {
				hot = append(hot, s)
			}
		}
		q.pending.notify(false, mine, hot)
	}
	return nil
}

// more reports whether a claim round could take more now: some served
// queue may have due tasks and room for them.
func (c *claimer) more() bool {
	// The handlers this round started count among the workers that free
	// up soon.
	c.budget = c.pool.soon(c.clock.Now(), aheadCover)
	for _, q := range c.queues {
		if !q.pending.any() {
			continue
		}
		if now, more := c.ahead.room(q.name, c.budget); now+more > 0 {
			return true
		}
	}
	return false
}

// claimQueue claims up to share of q's tasks and starts them: first the
// urgent tasks of the shards in first, then, with what is left, any task
// of the shards in order.
//
// The free slots of the queue are reserved for the claim before it is
// sent, so that the buffer cannot start a waiting task on one of them
// meanwhile: the store records the first tasks of the answer as started
// now (startNow), and exactly those start at once, on the reserved slots.
// The others wait ahead.
func (c *claimer) claimQueue(ctx context.Context, hold *pinnedHold, q *queueClaims, first, order []claims.ShardEpoch, share int) error {
	// A slot a handler just freed goes to a task waiting ahead, not to this
	// claim: reserved, it would stay idle for the claim's round trip.
	c.ahead.startNext()
	now, more := c.ahead.room(q.name, c.budget)
	limit := min(now+more, claimBatch, share)
	if len(order) == 0 || limit <= 0 {
		return nil
	}
	toStart := min(now, limit)
	slots := &reserved{n: c.pool.reserve(q.name, toStart)}
	defer func() {
		// A slot the claim did not use may be the one a waiting task was
		// about to take when the reservation got it first.
		c.pool.unreserve(q.name, slots.n)
		c.ahead.startNext()
	}()
	if limit -= toStart - slots.n; limit <= 0 {
		return nil
	}
	if len(first) > 0 {
		got, err := c.claim(ctx, hold, q, first, limit, slots, c.store.ClaimUrgent)
		if err != nil {
			return err
		}
		q.pending.urgentClaimed(first, got, limit)
		if limit -= len(got); limit <= 0 {
			return nil
		}
	}
	got, err := c.claim(ctx, hold, q, order, limit, slots, c.store.Claim)
	if err != nil {
		return err
	}
	q.pending.claimed(order, got, limit)
	return nil
}

// reserved counts the slots reserved for a queue's claims that no task has
// started on yet.
type reserved struct{ n int }

// claimFunc is Store.Claim or Store.ClaimUrgent.
type claimFunc func(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error)

// claim runs one claim statement over order, starts the tasks it recorded
// as started on the reserved slots and keeps the others ahead.
func (c *claimer) claim(ctx context.Context, hold *pinnedHold, q *queueClaims, order []claims.ShardEpoch, limit int, slots *reserved, claim claimFunc) ([]tasks.Task, error) {
	// Not cancelled by shutdown: a cancelled statement may still have
	// committed, leaving claims nobody runs.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), claimTimeout)
	var start time.Time
	if c.tr != nil {
		start = time.Now() // span times are wall-clock, whatever the executor's clock
	}
	startNow := min(slots.n, limit)
	claimed, err := claim(cctx, c.owner, order, q.name, c.kinds, limit, startNow)
	cancel()
	var parents []trace.SpanContext
	if c.tr != nil {
		parents = c.tr.claimed(start, time.Now(), q.name, len(order), c.woke, claimed, err)
	}
	var partial *claims.PartialError
	if errors.As(err, &partial) {
		// The claim failed at some databases only: what the others claimed
		// runs, and only the failed databases' terms are unsure.
		c.unsureOf(partial.Terms)
		if now := c.clock.Now(); c.partialWarned.IsZero() || now.Sub(c.partialWarned) >= partialWarnEvery {
			c.log.Warn("claiming failed at some databases; the others' tasks run", "queue", q.name, "terms", len(partial.Terms),
				"error", err, "not_logged_since", c.partialQuiet)
			c.partialWarned, c.partialQuiet = now, 0
		} else {
			c.partialQuiet++
		}
		err = nil
	}
	if err != nil {
		c.unsure, c.unsureTerms = true, nil
		return nil, fmt.Errorf("claiming tasks of queue %s: %w", q.name, err)
	}
	c.m.Claimed.Add(float64(len(claimed)))
	var back []tasks.Task
	var later []*waiting
	for i, t := range claimed {
		onSlot := i < startNow
		if onSlot {
			slots.n-- // started on below, or given back to the pool
		}
		termCtx, done, ok := hold.Begin(t.Shard, t.Epoch)
		if !ok {
			if onSlot {
				c.pool.unreserve(q.name, 1)
			}
			back = append(back, t)
			continue
		}
		w := &waiting{task: t, termCtx: termCtx, done: done}
		if parents != nil {
			w.parent = parents[i]
		}
		if onSlot {
			if c.pool.alone(t.ID) {
				c.pool.start(termCtx, t, done, w.parent)
				continue
			}
			// A sweep requeued the task while its earlier attempt's
			// handler still runs here (its heartbeats could not be
			// written): the new attempt waits until that one returned.
			c.log.Warn("claimed a task whose earlier attempt still runs here; it waits for that one", "task", t.ID, "attempt", t.Attempt)
			c.pool.unreserve(q.name, 1)
			w.recorded = true
		}
		later = append(later, w)
	}
	c.ahead.add(later...)
	c.giveBack(hold, back)
	return claimed, nil
}

// giveBack hands claims that will not start (their term stopped taking
// work between the claim and the start, or their claim's answer was lost)
// to the writer, which gives them back with their attempts unspent. The
// round's hold stays until each is written: a term is not released, and
// its next owner does not requeue (and spend) a claim whose handler never
// ran, while its give-back is on the way.
func (c *claimer) giveBack(hold *pinnedHold, ts []tasks.Task) {
	if len(ts) == 0 {
		return
	}
	rs := make([]result, len(ts))
	for i, t := range ts {
		rs[i] = result{task: t, giveBack: true, done: hold.pin()}
	}
	c.writer.post(rs...)
}

// pinnedHold is a round's hold, kept until the round and every give-back
// it posted are done (pin, unpin).
type pinnedHold struct {
	Hold
	mu sync.Mutex
	n  int
}

// pin keeps the hold until the returned func is called (once).
func (p *pinnedHold) pin() func() {
	p.mu.Lock()
	p.n++
	p.mu.Unlock()
	var once sync.Once
	return func() { once.Do(p.unpin) }
}

// unpin ends one pin; the last releases the hold.
func (p *pinnedHold) unpin() {
	p.mu.Lock()
	p.n--
	last := p.n == 0
	p.mu.Unlock()
	if last {
		p.Hold.Release()
	}
}

// fence raises the fence of every newly owned term and, in the same
// transaction, requeues the tasks earlier owners left running, before
// anything is claimed there. A term whose fence is already newer was taken
// over: it is reported lost. A raise that fails is tried again after a
// backoff; the round goes on with the terms fenced already.
func (c *claimer) fence(ctx context.Context) {
	if c.clock.Now().Before(c.raiseAt) {
		return
	}
	c.raiseAt = time.Time{}
	fresh := c.own.Unfenced()
	if len(fresh) == 0 {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, claimTimeout)
	o, err := c.store.RaiseFences(cctx, c.owner, c.own.Group(), fresh)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		wait := c.raiseBackoff.Next()
		c.raiseAt = c.clock.Now().Add(wait)
		c.log.Warn("raising fences failed; claiming from the shards fenced already meanwhile", "shards", len(fresh), "error", err, "backoff", wait)
		return
	}
	if len(o.Moved)+len(o.Unreached) == 0 {
		c.raiseBackoff.Reset()
	}
	c.raiseAt = time.Time{}
	ok := make(map[claims.ShardEpoch]bool, len(o.Raised)+len(o.Moved)+len(o.Unreached))
	for _, t := range o.Raised {
		ok[t] = true
	}
	// A term whose database does not hold its shard (it moved to another
	// database) or could not be reached is neither raised nor lost: it
	// stays unfenced and is raised again later, at the shard's database.
	for _, t := range slices.Concat(o.Moved, o.Unreached) {
		ok[t] = true
		if c.raiseAt.IsZero() {
			wait := c.raiseBackoff.Next()
			c.raiseAt = c.clock.Now().Add(wait)
			c.log.Info("some fences not raised: their shards' databases moved them or could not be reached; raising them again later",
				"moved", len(o.Moved), "unreached", len(o.Unreached), "backoff", wait)
		}
	}
	for _, t := range fresh {
		if !ok[t] {
			c.m.FenceRejections.Inc()
			c.own.FenceLost(t.Shard, t.Epoch)
		}
	}
	if len(o.Raised) == 0 {
		return
	}
	c.own.Fenced(o.Raised)
	c.orphansLeft(o)
	if o.Requeued+o.Dead+o.Completed > 0 || len(o.Pending) > 0 {
		c.log.Info("requeued tasks orphaned by earlier owners", "shards", len(o.Raised), "requeued", o.Requeued, "dead", o.Dead,
			"completed", o.Completed, "pending_shards", len(o.Pending))
	}
}

// orphansLeft records the terms whose orphans a transaction held.
func (c *claimer) orphansLeft(o claims.Orphans) {
	for _, t := range o.Pending {
		c.orphans[t] = true
	}
	if len(c.orphans) > 0 && c.orphansAt.IsZero() {
		c.orphansAt = c.clock.Now().Add(c.poll)
	}
}

// requeueOrphans requeues the orphans a raise or an earlier requeue left
// pending on held terms, when they are due (at most once per poll
// interval, backing off while some stay pending). A term no longer held
// is forgotten: its next owner requeues them.
func (c *claimer) requeueOrphans(ctx context.Context, terms []claims.ShardEpoch) {
	if len(c.orphans) == 0 || c.clock.Now().Before(c.orphansAt) {
		return
	}
	var due []claims.ShardEpoch
	for _, t := range terms {
		if c.orphans[t] {
			due = append(due, t)
		}
	}
	clear(c.orphans)
	for _, t := range due {
		c.orphans[t] = true
	}
	if len(due) == 0 {
		c.orphansAt = time.Time{}
		c.orphansBackoff.Reset()
		return
	}
	cctx, cancel := context.WithTimeout(ctx, claimTimeout)
	o, err := c.store.RequeueOrphans(cctx, c.owner, c.own.Group(), due)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		c.orphansAt = c.clock.Now().Add(max(c.poll, c.orphansBackoff.Next()))
		c.log.Warn("requeueing orphans left by earlier owners failed; trying again later", "shards", len(due), "error", err)
		return
	}
	if o.Requeued+o.Dead+o.Completed > 0 {
		c.log.Info("requeued tasks orphaned by earlier owners that a transaction held", "requeued", o.Requeued, "dead", o.Dead, "completed", o.Completed)
	}
	clear(c.orphans)
	for _, t := range o.Pending {
		c.orphans[t] = true
	}
	if len(c.orphans) == 0 {
		c.orphansAt = time.Time{}
		c.orphansBackoff.Reset()
		return
	}
	c.orphansAt = c.clock.Now().Add(max(c.poll, c.orphansBackoff.Next()))
}

// unsureOf marks terms unsure (unless every term is already).
func (c *claimer) unsureOf(terms []claims.ShardEpoch) {
	if c.unsure && c.unsureTerms == nil {
		return
	}
	c.unsure = true
	if c.unsureTerms == nil {
		c.unsureTerms = make(map[claims.ShardEpoch]bool, len(terms))
	}
	for _, t := range terms {
		if !c.unsureTerms[t] {
			c.unsureTerms[t] = true
			c.recoverAt = time.Time{} // a term newly unsure is listed at once
		}
	}
}

// recover gives back the claims of the held terms that this runner holds
// in the database but neither runs nor keeps ahead: those of a claim
// statement that committed although its answer was lost. Left alone they
// would go stale.
func (c *claimer) recover(ctx context.Context, hold *pinnedHold, terms []claims.ShardEpoch) error {
	cctx, cancel := context.WithTimeout(ctx, claimTimeout)
	defer cancel()
	claimed, err := c.store.Claimed(cctx, c.owner, terms)
	var partial *claims.PartialError
	if err != nil && !errors.As(err, &partial) {
		return fmt.Errorf("listing claims after a failed claim: %w", err)
	}
	// Unclaim applies only to a claim still running under that attempt,
	// so an outcome written since the listing is left alone.
	// The buffer first, then the pool: a task moves only from the one to
	// the other, and holds its pool slot (pool.holds) from before it
	// leaves the buffer until its outcome is written, so none is missed.
	mine := make(map[claims.Ref]bool)
	for _, r := range c.ahead.refs() {
		mine[r] = true
	}
	for _, r := range c.pool.refs() {
		mine[r] = true
	}
	var lost []tasks.Task
	for _, r := range claimed {
		if !mine[r] && !c.pool.holds(r.ID) {
			lost = append(lost, tasks.Task{ID: r.ID, Shard: r.Shard, Attempt: r.Attempt, Epoch: r.Epoch})
		}
	}
	if len(lost) > 0 {
		c.log.Info("giving back the claims of a claim statement whose answer was lost", "tasks", len(lost))
		c.giveBack(hold, lost)
	}
	if partial != nil {
		return partial // the listing failed at some databases: their terms stay unsure
	}
	return nil
}

// prober collects what the probe must look at: at each poll interval,
// every held shard, and, unless direct, the shards enqueue notifications
// named (urgent: those that got tasks more urgent than the default) and
// those newly held. Notifications arrive from the listener's goroutine; the
// rest belongs to the claim loop.
type prober struct {
	// direct: the runner serves at most probeAbove queues, whose pending
	// sets take notifications and newly held shards themselves; the probe
	// covers the poll only.
	direct bool

	mu     sync.Mutex
	all    bool
	shards map[int]bool
	urgent map[int]bool

	// names are the served queues, in name order.
	names    []string
	lastPoll time.Time
	// known are the shards held at the last take: newly held ones are
	// probed at once.
	known map[int]bool
}

func newProber(now time.Time, direct bool) *prober {
	return &prober{direct: direct, shards: map[int]bool{}, urgent: map[int]bool{}, known: map[int]bool{}, lastPoll: now}
}

// notify records an enqueue notification (all: every shard).
func (p *prober) notify(all bool, shards, urgent []int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.all = p.all || all
	for _, s := range shards {
		p.shards[s] = true
	}
	for _, s := range urgent {
		p.shards[s], p.urgent[s] = true, true
	}
}

// take returns the held shards (terms, ordered by shard) to probe now —
// every one when the poll interval has passed or a notification said
// "every shard", else those notified and those newly held — and which
// shards got urgent tasks, and forgets them.
func (p *prober) take(terms []claims.ShardEpoch, now time.Time, poll time.Duration) (shards []int, urgent map[int]bool) {
	p.mu.Lock()
	all, notified, urgent := p.all, p.shards, p.urgent
	p.all, p.shards, p.urgent = false, map[int]bool{}, map[int]bool{}
	p.mu.Unlock()
	if now.Sub(p.lastPoll) >= poll {
		all, p.lastPoll = true, now
	}
	held := make(map[int]bool, len(terms))
	for _, t := range terms {
		held[t.Shard] = true
		if all || notified[t.Shard] || (!p.direct && !p.known[t.Shard]) {
			shards = append(shards, t.Shard)
		}
	}
	p.known = held
	return shards, urgent
}

// retry makes the next take probe every held shard, after a probe that
// failed (with the urgent marks it took).
func (p *prober) retry(urgent map[int]bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.all = true
	for s := range urgent {
		p.urgent[s] = true
	}
}
