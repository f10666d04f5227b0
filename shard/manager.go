package shard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
)

// Runner states published in runners/<id>.
const (
	StateAttached = "attached"
	StateDetached = "detached"
	StateDraining = "draining"
)

// RunnerInfo is the JSON value of runners/<id>.
type RunnerInfo struct {
	ID        string    `json:"id"`
	AdminAddr string    `json:"admin_addr,omitempty"`
	Version   string    `json:"version,omitempty"`
	StartedAt time.Time `json:"started_at"`
	State     string    `json:"state"`
	// Queues are the queues the runner serves, Kinds the task kinds it has
	// handlers for: it can run a task of one of its kinds in one of its
	// queues. Group is the group of runners that serve and handle the same
	// (GroupOf), whose shards it shares; the coordinator shows producers
	// the work no attached runner can run.
	Queues []string `json:"queues,omitempty"`
	Kinds  []string `json:"kinds,omitempty"`
	Group  string   `json:"group,omitempty"`
}

// ErrShardCountMismatch is returned by Start when the cluster was created
// with another shard count.
var ErrShardCountMismatch = errors.New("shard count mismatch")

// Manager owns this runner's membership and shards. Start it, then Run it;
// the executor uses it through Unfenced, Fenced, Hold, FenceLost and
// Changes. Its state lives in three places, each with one owner:
//
//   - the keeper: the lease (id, generation, lease clock);
//   - the ledger: the ownership terms, one per shard its owner key names,
//     each moved only by ledger.move (see termState for the legal moves);
//   - the Run loop's own fields below: the view of etcd and what it
//     published, touched by no other goroutine.
type Manager struct {
	cfg     Config
	keys    keys
	client  *clientv3.Client
	machine *detach.Machine
	clock   clock.Clock
	log     hclog.Logger
	metrics *Metrics
	started time.Time
	keeper  *keeper
	ledger  *ledger

	draining atomic.Bool
	orphaned atomic.Bool
	// conflict, when set, names a key of the runner id that another live
	// process holds: the runner stands down (conflict.go). Set and
	// cleared by the Run loop, read by the executor's calls.
	conflict atomic.Pointer[string]

	// group is the runner's capability group (GroupOf its queues and
	// kinds): it owns shards of this group only.
	group string

	// Owned by the Run loop.
	view view
	rev  int64 // revision of the snapshot Start read
	// groupRev is the revision up to which the view of the group's owner
	// keys is known complete: an acquisition applies only if none of them
	// changed after it.
	groupRev      int64
	published     string
	publishedGen  int
	lastClaimable []claims.ShardEpoch
	// unansweredSent records when an acquiring Txn that got no answer was
	// sent, per shard: if it committed, the shard is adopted from the watch,
	// and its ownership began no earlier than that.
	unansweredSent map[int]time.Time
	knownMembers   map[string]bool
	settleUntil    time.Time
	assignMemo     assignMemo
	// retryAt: when to re-read the owner keys while assigned shards stay
	// held elsewhere (scheduleRetry).
	retry   clock.Backoff
	retryAt time.Time
	// storageRetryAt: no etcd write (publish, acquire, release) before it,
	// after one failed; storageRetry spaces the failures out.
	storageRetry   clock.Backoff
	storageRetryAt time.Time
	// conflictCheckAt: the next check of the runner id's keys while
	// another process holds them; conflictCheck spaces the checks out.
	conflictCheck   clock.Backoff
	conflictCheckAt time.Time

	// hooks are set by tests only.
	hooks hooks
}

// hooks are points where a test holds or observes the Run loop and its
// watcher, to force an interleaving without sleeping. All nil in
// production, where each costs a nil check.
type hooks struct {
	// watchOpening runs on the watcher before it opens a watch.
	watchOpening func(ctx context.Context)
	// delivering runs on the watcher before it hands u to the Run loop.
	delivering func(ctx context.Context, u watchUpdate)
	// applied runs on the Run loop once u is in the view.
	applied func(u watchUpdate)
	// reconciled runs on the Run loop after each reconcile pass.
	reconciled func()
}

// New validates cfg and returns a manager; it does not touch etcd.
func New(cfg Config) (*Manager, error) {
	switch {
	case cfg.Client == nil:
		return nil, errors.New("shard: an etcd client is required")
	case cfg.Detach == nil:
		return nil, errors.New("shard: a detach machine is required")
	}
	cfg.fill()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Manager{
		cfg:     cfg,
		keys:    keys{cfg.Prefix},
		client:  cfg.Client,
		machine: cfg.Detach,
		clock:   cfg.Clock,
		log:     cfg.Logger,
		metrics: cfg.Metrics,
		view:    newView(cfg.ShardCount),
		retry:   clock.Backoff{Min: 200 * time.Millisecond, Max: 5 * time.Second},
		// Short enough to re-acquire within a lease TTL, long enough not
		// to add load to an etcd that is electing a leader.
		storageRetry:  clock.Backoff{Min: 200 * time.Millisecond, Max: 2 * time.Second},
		conflictCheck: clock.Backoff{Min: conflictCheckMin, Max: conflictCheckMax},
		ledger:        newLedger(cfg.RunnerID, cfg.Clock, cfg.Logger, cfg.Metrics),
		group:         GroupOf(cfg.Queues, cfg.Kinds),
	}
	m.keeper = &keeper{client: cfg.Client, cfg: cfg, machine: cfg.Detach, clock: cfg.Clock, log: cfg.Logger,
		metrics: cfg.Metrics, newLease: m.ledger.kick.Notify}
	m.ledger.detached = m.machine.IsDetached
	m.machine.Subscribe(m.onDetachEvent)
	return m, nil
}

// Start checks the cluster's shard count (writing it if the cluster is new),
// grants the runner's lease and registers the runner as attached. Errors
// here mean the runner must not start.
func (m *Manager) Start(ctx context.Context) error {
	m.started = m.clock.Now()
	if err := m.checkShardCount(ctx); err != nil {
		return err
	}
	if err := m.keeper.grant(ctx, 5*time.Second); err != nil {
		return err
	}
	if err := m.register(ctx); err != nil {
		return err
	}
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	snap, err := m.client.Get(gctx, m.keys.prefix, clientv3.WithPrefix())
	cancel()
	if err != nil {
		return fmt.Errorf("reading cluster state from etcd: %w", err)
	}
	m.view.load(m.keys, snap.Kvs, snap.Header.Revision)
	m.rev, m.groupRev = snap.Header.Revision, snap.Header.Revision
	lease, _ := m.keeper.lease()
	m.log.Info("joined cluster", "runner", m.cfg.RunnerID, "lease", fmt.Sprintf("%x", int64(lease)),
		"ttl", m.cfg.LeaseTTL, "shards", m.cfg.ShardCount, "group", m.group, "group_members", len(m.view.attached(m.group)),
		"members", len(m.view.attached("")))
	return nil
}

func (m *Manager) checkShardCount(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	created, err := EnsureShardCount(cctx, m.client, m.keys.prefix, m.cfg.ShardCount)
	if created {
		m.log.Info("created cluster", "prefix", m.keys.prefix, "shard_count", m.cfg.ShardCount)
	}
	return err
}

// register creates runners/<id> under the lease. If the key exists (a
// previous process with this id whose lease has not expired yet) it waits
// up to one lease TTL for it to go away.
func (m *Manager) register(ctx context.Context) error {
	key := m.keys.runner(m.cfg.RunnerID)
	val := m.runnerValue(StateAttached)
	lease, gen := m.keeper.lease()
	deadline := m.clock.Now().Add(m.cfg.LeaseTTL + time.Second)
	warned := false
	for {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := m.client.Txn(cctx).
			If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, val, clientv3.WithLease(lease))).Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("registering runner %s: %w", m.cfg.RunnerID, err)
		}
		if resp.Succeeded {
			m.published, m.publishedGen = StateAttached, gen
			return nil
		}
		if !m.clock.Now().Before(deadline) {
			return fmt.Errorf("--runner-id: runner id %q is already registered by another live process (%s exists)", m.cfg.RunnerID, key)
		}
		if !warned {
			m.log.Warn("runner id still registered by a previous process; waiting for its lease to expire", "key", key, "up_to", deadline.Sub(m.clock.Now()))
			warned = true
		}
		if !clock.Sleep(m.clock, 250*time.Millisecond, ctx.Done()) {
			return ctx.Err()
		}
	}
}

func (m *Manager) runnerValue(state string) string {
	b, _ := json.Marshal(RunnerInfo{ID: m.cfg.RunnerID, AdminAddr: m.cfg.AdminAddr, Version: m.cfg.Version,
		StartedAt: m.started.UTC(), State: state, Queues: sortedSet(m.cfg.Queues), Kinds: sortedSet(m.cfg.Kinds), Group: m.group})
	return string(b)
}

// Run keeps the lease alive, follows the cluster and acquires and releases
// shards until ctx ends; then it drains: it publishes "draining", lets
// in-flight work finish (up to the handoff timeout), releases every key and
// revokes the lease, so other runners take the shards at once. After
// Orphan it returns at once instead, releasing nothing.
func (m *Manager) Run(ctx context.Context) error {
	if lease, _ := m.keeper.lease(); lease == 0 {
		return errors.New("shard: Run called before a successful Start")
	}
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	updates := make(chan watchUpdate, 16)
	loops := make(chan struct{}, 2)
	w := &watcher{client: m.client, prefix: m.keys.prefix, clock: m.clock, log: m.log, out: updates, rev: m.rev, hooks: &m.hooks}
	go func() { w.Run(runCtx); loops <- struct{}{} }()
	go func() { m.keeper.Run(runCtx); loops <- struct{}{} }()
	defer func() {
		stop()
		<-loops
		<-loops
	}()

	timer := m.clock.NewTimer(time.Hour)
	defer timer.Stop()
	done := ctx.Done()
	var drainBy time.Time
	for {
		if m.orphaned.Load() {
			m.ledger.cancelAll(m.clock.Now(), "orphaned: the runner stopped without releasing")
			return nil
		}
		if done == nil && drainBy.IsZero() {
			m.draining.Store(true)
			drainBy = m.clock.Now().Add(m.cfg.HandoffTimeout + cancelGrace + 5*time.Second)
			m.log.Info("draining: releasing every shard", "bound", drainBy.Sub(m.clock.Now()))
		}
		m.reconcile(runCtx)
		if m.hooks.reconciled != nil {
			m.hooks.reconciled()
		}
		if !drainBy.IsZero() && (m.drained() || !m.clock.Now().Before(drainBy)) {
			m.finishDrain(runCtx)
			return nil
		}
		timer.Reset(m.nextWake(drainBy))
		select {
		case u := <-updates:
			m.apply(u)
			for more := true; more; {
				select {
				case u := <-updates:
					m.apply(u)
				default:
					more = false
				}
			}
		case <-m.ledger.kick.C():
		case <-timer.C():
		case <-done:
			done = nil
		}
		m.dropVanished()
	}
}

// Orphan stops the manager without releasing anything, as if the process
// died: Run cancels all work and returns at once, the keep-alives stop,
// and the keys stay until the lease expires, when other runners take the
// shards (compare etcd's concurrency.Session.Orphan). For a process that
// must stop at once, and for tests of a crash.
func (m *Manager) Orphan() {
	m.orphaned.Store(true)
	m.ledger.kick.Notify()
}

// apply takes a batch of watch events (or a snapshot) into the view: the
// watch reports every change up to u.rev.
func (m *Manager) apply(u watchUpdate) {
	m.view.apply(m.keys, u)
	m.groupRev = max(m.groupRev, u.rev)
	if m.hooks.applied != nil {
		m.hooks.applied(u)
	}
}

// sortedSet is list sorted, without repeats.
func sortedSet(list []string) []string {
	out := slices.Clone(list)
	slices.Sort(out)
	return slices.Compact(out)
}

// dropVanished ends the terms that the runner's owner key, as the view
// shows it, no longer names (the lease was revoked, or an operator deleted
// the key), or whose key is under another lease than the runner's (an
// earlier lease of its, gone with its keys, or another process's with the
// same runner id): the runner no longer owns them, whatever its
// keep-alives say. One event, one warning, however many shards it ends.
func (m *Manager) dropVanished() {
	lease, _ := m.keeper.lease()
	mine := m.view.owners[m.group][m.cfg.RunnerID]
	if mine.lease != int64(lease) {
		mine = ownerEntry{}
	}
	gone := m.ledger.loseVanished(m.clock.Now(), func(s int, epoch int64) bool {
		return mine.terms[s] == epoch
	})
	if len(gone) == 0 {
		return
	}
	shards := make([]int, len(gone))
	for i, t := range gone {
		shards[i] = t.shard
		m.log.Debug("owner key no longer names a shard held", "shard", t.shard, "epoch", t.epoch)
	}
	m.log.Warn("owner key no longer names shards this runner held; their work is cancelled",
		"shards", len(gone), "first", firstShards(shards))
}

// firstShards writes the lowest few of shards for a log line that counts
// them all: one line per event, not one per shard.
func firstShards(shards []int) string {
	const few = 5
	s := slices.Clone(shards)
	slices.Sort(s)
	out := ""
	for i, n := range s {
		if i == few {
			return out + ",…"
		}
		if i > 0 {
			out += ","
		}
		out += strconv.Itoa(n)
	}
	return out
}

// nextWake is how long the loop may sleep before some deadline of its own.
func (m *Manager) nextWake(drainBy time.Time) time.Duration {
	now := m.clock.Now()
	wake := now.Add(time.Minute)
	if !m.retryAt.IsZero() && m.retryAt.Before(wake) {
		wake = m.retryAt
	}
	storageBlocked := now.Before(m.storageRetryAt)
	if storageBlocked && m.storageRetryAt.Before(wake) {
		wake = m.storageRetryAt
	}
	if m.settleUntil.After(now) && m.settleUntil.Before(wake) {
		wake = m.settleUntil
	}
	if !drainBy.IsZero() && drainBy.Before(wake) {
		wake = drainBy
	}
	if !m.conflictCheckAt.IsZero() && m.conflictCheckAt.Before(wake) {
		wake = m.conflictCheckAt
	}
	// A term due already is held only by a failed release on etcd: it is
	// retried with that backoff rather than spun on.
	if at := m.ledger.nextDeadline(now, m.cfg.HandoffTimeout, storageBlocked); !at.IsZero() && at.Before(wake) {
		wake = at
	}
	return max(wake.Sub(now), time.Millisecond)
}

func (m *Manager) drained() bool { return m.ledger.empty() }

// finishDrain revokes the lease, which deletes the runner key and any shard
// key that could not be released in time.
func (m *Manager) finishDrain(ctx context.Context) {
	now := m.clock.Now()
	m.ledger.cancelAll(now, "draining")
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	lease, _ := m.keeper.lease()
	if _, err := m.client.Revoke(cctx, lease); err != nil {
		m.log.Warn("revoking the lease failed; it will expire by itself", "error", err)
	}
	if left := m.ledger.loseAll(now, "lease revoked at the end of the drain"); left > 0 {
		m.log.Warn("drain bound reached with shards still held; revoked the lease", "shards", left)
	}
	m.metrics.ShardsOwned.Set(0)
	m.log.Info("left the cluster")
}

// onDetachEvent runs synchronously inside the detach machine's transition:
// on detach every term's work is cancelled before Detach returns.
func (m *Manager) onDetachEvent(ev detach.Event) {
	if ev.Detached {
		if n := m.ledger.cancelAll(ev.At, "detached: "+ev.Reason.String()); n > 0 {
			m.log.Info("work cancelled on detach", "shards", n)
		}
		m.metrics.Detached.Set(1)
		m.ledger.events.Emit(Event{Kind: Detached, Runner: m.cfg.RunnerID, Shard: -1, At: ev.At})
	} else {
		m.metrics.Detached.Set(0)
		m.ledger.events.Emit(Event{Kind: Attached, Runner: m.cfg.RunnerID, Shard: -1, At: ev.At})
	}
	m.ledger.kick.Notify()
}

// opContext bounds an etcd call made to keep or prove ownership: it must
// finish before the runner would have to detach.
func (m *Manager) opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	_, detachAt := m.keeper.deadline()
	timeout := min(5*time.Second, max(detachAt.Sub(m.clock.Now()), 100*time.Millisecond))
	return context.WithTimeout(clientv3.WithRequireLeader(ctx), timeout)
}

// mayWork reports whether new work may start: attached, no other process
// holding the runner id, and the lease clock before its detach point.
func (m *Manager) mayWork() bool {
	return !m.machine.IsDetached() && m.conflict.Load() == nil && m.keeper.trusted(m.clock.Now())
}

// Group is the runner's capability group: the fences and claims of its
// shards are the group's (executor).
func (m *Manager) Group() string { return m.group }

// Unfenced lists the terms whose fence is not raised yet (executor).
func (m *Manager) Unfenced() []claims.ShardEpoch {
	if m.machine.IsDetached() {
		return nil
	}
	return m.ledger.unfenced()
}

// Fenced records that the fences of these terms are raised (executor).
func (m *Manager) Fenced(terms []claims.ShardEpoch) { m.ledger.markFenced(terms) }

// Hold pins the fenced terms for one claim (executor). It holds nothing
// while detached or once the lease clock has passed its detach point, and
// no term whose key was created under an earlier lease.
func (m *Manager) Hold() *Hold {
	_, gen := m.keeper.lease()
	return m.ledger.hold(m.mayWork, gen)
}

// Workable reports whether new work may start now on the term of shard at
// epoch (executor): the runner may work (mayWork), and the term exists at
// that epoch, under the current lease, and is fenced — not acquired yet,
// not releasing, not cancelled or ended. The executor asks it each time a
// task claimed ahead of need is about to start from its buffer: a claim's
// hold ended long ago, and the term may have moved on since. It is on
// the executor's hot path: a few atomic loads, two short locks, a map
// lookup, no allocation.
func (m *Manager) Workable(shard int, epoch int64) bool {
	if m.machine.IsDetached() || m.conflict.Load() != nil {
		return false
	}
	gen, ok := m.keeper.trustedGen(m.clock.Now())
	return ok && m.ledger.workable(shard, epoch, gen)
}

// FenceLost reports that a write for shard at epoch was refused because the
// shard's fence moved on: the shard was taken over. Its work is cancelled
// at once and the key released.
func (m *Manager) FenceLost(shard int, epoch int64) {
	if m.ledger.cancelTerm(shard, epoch, "a newer owner's fence refused a write") {
		m.log.Warn("fence lost: another runner owns the shard now", "shard", shard, "epoch", epoch)
	}
}

// Changes is signalled (coalesced) whenever the claimable terms change.
func (m *Manager) Changes() <-chan struct{} { return m.ledger.changes.C() }

// Status is a snapshot of membership and ownership for /status.
type Status struct {
	RunnerID string
	// Group is the runner's capability group (GroupOf).
	Group string
	// State is attached, detached or draining; detached too while another
	// process holds the runner id (Conflict).
	State string
	// Conflict names the key of this runner id that another live process
	// holds — one started with the same --runner-id while this one was
	// paused past its lease — while this one stands down, doing no work
	// and checking until the key is free. Empty normally.
	Conflict      string
	LeaseID       int64
	LeaseDeadline time.Time
	LeaseTimeLeft time.Duration
	Assigned      []int
	// Owned are the terms that may work (acquired or fenced).
	Owned     []claims.ShardEpoch
	Releasing []int
}

// Status returns the current state.
func (m *Manager) Status() Status {
	now := m.clock.Now()
	lease, _ := m.keeper.lease()
	deadline, _ := m.keeper.deadline()
	st := Status{RunnerID: m.cfg.RunnerID, Group: m.group, LeaseID: int64(lease), LeaseDeadline: deadline, LeaseTimeLeft: deadline.Sub(now)}
	if key := m.conflict.Load(); key != nil {
		st.Conflict = *key
	}
	switch {
	case m.draining.Load():
		st.State = StateDraining
	case m.machine.IsDetached() || st.Conflict != "":
		st.State = StateDetached
	default:
		st.State = StateAttached
	}
	st.Assigned, st.Owned, st.Releasing = m.ledger.snapshot()
	if st.State == StateDetached {
		st.Owned = nil
	}
	return st
}

// claimableChanged updates the gauge and wakes the executor when the set of
// terms it may work on changed.
func (m *Manager) claimableChanged() {
	owned := m.ledger.list(acquired, fenced)
	if m.machine.IsDetached() || m.conflict.Load() != nil {
		owned = nil
	}
	m.metrics.ShardsOwned.Set(float64(len(owned)))
	if !slices.Equal(owned, m.lastClaimable) {
		m.lastClaimable = owned
		m.ledger.changes.Notify()
	}
}
