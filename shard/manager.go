package shard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/tasks"
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
	// Kinds are the task kinds the runner has handlers for, so that the
	// coordinator can tell producers when no attached runner handles one.
	Kinds []string `json:"kinds,omitempty"`
}

// ErrShardCountMismatch is returned by Start when the cluster was created
// with another shard count.
var ErrShardCountMismatch = errors.New("shard count mismatch")

// Manager owns this runner's membership and shards. Start it, then Run it;
// the executor uses Owned, Begin, FenceLost and Changes.
type Manager struct {
	cfg     Config
	keys    keys
	client  *clientv3.Client
	machine *detach.Machine
	clock   clock.Clock
	log     hclog.Logger
	metrics *Metrics
	started time.Time

	leaseMu  sync.Mutex
	lease    clientv3.LeaseID
	leaseGen int
	deadline time.Time // earliest expiry of the current lease
	detachAt time.Time
	keeper   *keeper

	// mu guards the ownership the executor sees.
	mu       sync.Mutex
	owned    map[int]*ownedShard
	assigned []int
	changes  chan struct{}

	kick     chan struct{}
	draining atomic.Bool
	// crash makes Run return without draining when its context ends; tests
	// use it to simulate a process that dies.
	crash atomic.Bool

	// Owned by the Run loop.
	view         view
	rev          int64 // revision of the snapshot Start read
	published    string
	publishedGen int
	lastOwned    []tasks.ShardEpoch
	// unansweredSent records when an acquiring Txn that got no answer was
	// sent, per shard: if it committed, the shard is adopted from the watch,
	// and its ownership began no earlier than that.
	unansweredSent  map[int]time.Time
	knownMembers    map[string]bool
	settleUntil     time.Time
	retryBackoff    time.Duration
	retryAt         time.Time
	storageFailedAt time.Time
}

// ownedShard is one shard this runner holds the key of.
type ownedShard struct {
	shard    int
	epoch    int64
	ctx      context.Context
	cancel   context.CancelFunc
	inflight int
	// releasing: no new work may start; the key is deleted once inflight
	// work is done (after handoff timeout it is cancelled, and after
	// cancelGrace the key is deleted regardless).
	releasing    bool
	releaseStart time.Time
	cancelledAt  time.Time
}

// New validates cfg and returns a manager; it does not touch etcd.
func New(cfg Config) (*Manager, error) {
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
		owned:   map[int]*ownedShard{},
		changes: make(chan struct{}, 1),
		kick:    make(chan struct{}, 1),
		view:    newView(cfg.ShardCount),
	}
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
	sent := m.clock.Now()
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	resp, err := m.client.Grant(gctx, int64(m.cfg.LeaseTTL/time.Second))
	cancel()
	if err != nil {
		return fmt.Errorf("granting the runner lease on etcd %v: %w", m.client.Endpoints(), err)
	}
	ttl := time.Duration(resp.TTL) * time.Second
	lc := detach.NewLeaseClock(sent, ttl, m.cfg.DetachMargin, m.cfg.FailureThreshold)
	m.keeper = &keeper{m: m, lc: lc}
	m.newLease(resp.ID, lc)
	if err := m.register(ctx); err != nil {
		return err
	}
	gctx, cancel = context.WithTimeout(ctx, 5*time.Second)
	snap, err := m.client.Get(gctx, m.keys.prefix, clientv3.WithPrefix())
	cancel()
	if err != nil {
		return fmt.Errorf("reading cluster state from etcd: %w", err)
	}
	m.view.load(m.keys, snap.Kvs, snap.Header.Revision)
	m.rev = snap.Header.Revision
	m.log.Info("joined cluster", "runner", m.cfg.RunnerID, "lease", fmt.Sprintf("%x", int64(resp.ID)),
		"ttl", ttl, "shards", m.cfg.ShardCount, "members", len(m.view.attached()))
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
	deadline := m.clock.Now().Add(m.cfg.LeaseTTL + time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := m.client.Txn(cctx).
			If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, val, clientv3.WithLease(m.leaseID()))).Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("registering runner %s: %w", m.cfg.RunnerID, err)
		}
		if resp.Succeeded {
			m.published, m.publishedGen = StateAttached, m.leaseGeneration()
			return nil
		}
		if !m.clock.Now().Before(deadline) {
			return fmt.Errorf("--runner-id: runner id %q is already registered by another live process (%s exists)", m.cfg.RunnerID, key)
		}
		m.log.Warn("runner id still registered by a previous process; waiting for its lease to expire", "key", key)
		if !clock.Sleep(m.clock, 250*time.Millisecond, ctx.Done()) {
			return ctx.Err()
		}
	}
}

func (m *Manager) runnerValue(state string) string {
	b, _ := json.Marshal(RunnerInfo{ID: m.cfg.RunnerID, AdminAddr: m.cfg.AdminAddr, Version: m.cfg.Version,
		StartedAt: m.started.UTC(), State: state, Kinds: m.cfg.Kinds})
	return string(b)
}

// Run keeps the lease alive, follows the cluster and acquires and releases
// shards until ctx ends; then it drains: it publishes "draining", lets
// in-flight work finish (up to the handoff timeout), releases every key and
// revokes the lease, so other runners take the shards at once.
func (m *Manager) Run(ctx context.Context) error {
	if m.keeper == nil {
		return errors.New("shard: Run called before a successful Start")
	}
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	updates := make(chan watchUpdate, 16)
	wg.Go(func() { m.watch(runCtx, m.rev, updates) })
	wg.Go(func() { m.keeper.run(runCtx) })
	defer func() {
		stop()
		wg.Wait()
	}()

	timer := m.clock.NewTimer(time.Hour)
	defer timer.Stop()
	done := ctx.Done()
	var drainBy time.Time
	for {
		if ctx.Err() != nil && m.crash.Load() {
			return nil
		}
		if done == nil || ctx.Err() != nil {
			if drainBy.IsZero() {
				done = nil
				m.draining.Store(true)
				drainBy = m.clock.Now().Add(m.cfg.HandoffTimeout + cancelGrace + 5*time.Second)
				m.log.Info("draining: releasing every shard", "bound", drainBy.Sub(m.clock.Now()))
			}
		}
		m.reconcile(runCtx)
		if !drainBy.IsZero() && (m.drained() || !m.clock.Now().Before(drainBy)) {
			m.finishDrain(runCtx)
			return nil
		}
		timer.Reset(m.nextWake(drainBy))
		select {
		case u := <-updates:
			m.view.apply(m.keys, u)
			for more := true; more; {
				select {
				case u := <-updates:
					m.view.apply(m.keys, u)
				default:
					more = false
				}
			}
		case <-m.kick:
		case <-timer.C():
		case <-done:
		}
		m.dropVanished()
	}
}

// dropVanished stops the work of owned shards whose key the view shows
// deleted or re-created by someone else (the lease was revoked, or an
// operator deleted the key): the runner no longer owns them, whatever its
// keep-alives say yet.
func (m *Manager) dropVanished() {
	now := m.clock.Now()
	var lost []*ownedShard
	m.mu.Lock()
	for s, o := range m.owned {
		e := m.view.shards[s]
		if e.owner == m.cfg.RunnerID && e.createRev == o.epoch {
			continue
		}
		o.cancel()
		delete(m.owned, s)
		lost = append(lost, o)
		m.observe(Event{Kind: Lost, Shard: s, Epoch: o.epoch, At: now})
	}
	m.mu.Unlock()
	for _, o := range lost {
		m.log.Warn("shard key vanished while owned; work cancelled", "shard", o.shard, "epoch", o.epoch)
	}
}

// nextWake is how long the loop may sleep before some deadline of its own.
func (m *Manager) nextWake(drainBy time.Time) time.Duration {
	now := m.clock.Now()
	wake := now.Add(time.Minute)
	if !m.retryAt.IsZero() && m.retryAt.Before(wake) {
		wake = m.retryAt
	}
	if m.settleUntil.After(now) && m.settleUntil.Before(wake) {
		wake = m.settleUntil
	}
	if !drainBy.IsZero() && drainBy.Before(wake) {
		wake = drainBy
	}
	m.mu.Lock()
	for _, o := range m.owned {
		if !o.releasing {
			continue
		}
		if o.cancelledAt.IsZero() {
			if at := o.releaseStart.Add(m.cfg.HandoffTimeout); at.Before(wake) {
				wake = at
			}
		} else if at := o.cancelledAt.Add(cancelGrace); at.Before(wake) {
			wake = at
		}
	}
	m.mu.Unlock()
	return max(wake.Sub(now), time.Millisecond)
}

func (m *Manager) drained() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.owned) == 0
}

// finishDrain revokes the lease, which deletes the runner key and any shard
// key that could not be released in time.
func (m *Manager) finishDrain(ctx context.Context) {
	m.mu.Lock()
	for _, o := range m.owned {
		o.cancel()
	}
	left := len(m.owned)
	m.mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := m.client.Revoke(cctx, m.leaseID()); err != nil {
		m.log.Warn("revoking the lease failed; it will expire by itself", "error", err)
	}
	if left > 0 {
		m.log.Warn("drain bound reached with shards still held; revoked the lease", "shards", left)
	}
	m.mu.Lock()
	for s, o := range m.owned {
		m.observe(Event{Kind: Lost, Shard: s, Epoch: o.epoch})
	}
	m.owned = map[int]*ownedShard{}
	m.mu.Unlock()
	m.metrics.ShardsOwned.Set(0)
	m.log.Info("left the cluster")
}

// onDetachEvent runs synchronously inside the detach machine's transition:
// on detach every shard's work is cancelled before Detach returns.
func (m *Manager) onDetachEvent(ev detach.Event) {
	m.mu.Lock()
	if ev.Detached {
		for _, o := range m.owned {
			o.cancel()
			if !o.releasing {
				o.releasing, o.releaseStart = true, ev.At
			}
			if o.cancelledAt.IsZero() {
				o.cancelledAt = ev.At
			}
		}
	}
	m.mu.Unlock()
	if ev.Detached {
		m.metrics.Detached.Set(1)
		m.observe(Event{Kind: Detached, Shard: -1, At: ev.At})
	} else {
		m.metrics.Detached.Set(0)
		m.observe(Event{Kind: Attached, Shard: -1, At: ev.At})
	}
	m.poke()
}

func (m *Manager) poke() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

func (m *Manager) notifyChanges() {
	select {
	case m.changes <- struct{}{}:
	default:
	}
}

func (m *Manager) observe(e Event) {
	if m.cfg.Observe == nil {
		return
	}
	e.Runner = m.cfg.RunnerID
	if e.At.IsZero() {
		e.At = m.clock.Now()
	}
	m.cfg.Observe(e)
}

func (m *Manager) newLease(id clientv3.LeaseID, lc *detach.LeaseClock) {
	m.leaseMu.Lock()
	m.lease = id
	m.leaseGen++
	m.deadline, m.detachAt = lc.Deadline(), lc.DetachAt()
	m.leaseMu.Unlock()
	m.poke()
}

func (m *Manager) setLeaseClock(lc *detach.LeaseClock) {
	m.leaseMu.Lock()
	m.deadline, m.detachAt = lc.Deadline(), lc.DetachAt()
	m.leaseMu.Unlock()
}

func (m *Manager) leaseID() clientv3.LeaseID {
	m.leaseMu.Lock()
	defer m.leaseMu.Unlock()
	return m.lease
}

func (m *Manager) leaseGeneration() int {
	m.leaseMu.Lock()
	defer m.leaseMu.Unlock()
	return m.leaseGen
}

// opContext bounds an etcd call made to keep or prove ownership: it must
// finish before the runner would have to detach.
func (m *Manager) opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	m.leaseMu.Lock()
	until := m.detachAt.Sub(m.clock.Now())
	m.leaseMu.Unlock()
	timeout := min(5*time.Second, max(until, 100*time.Millisecond))
	return context.WithTimeout(clientv3.WithRequireLeader(ctx), timeout)
}

// Owned returns the shards this runner may work on, with their epochs,
// ordered by shard. It is empty while detached.
func (m *Manager) Owned() []tasks.ShardEpoch {
	if m.machine.IsDetached() {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]tasks.ShardEpoch, 0, len(m.owned))
	for _, o := range m.owned {
		if !o.releasing {
			out = append(out, tasks.ShardEpoch{Shard: o.shard, Epoch: o.epoch})
		}
	}
	slices.SortFunc(out, func(a, b tasks.ShardEpoch) int { return a.Shard - b.Shard })
	return out
}

// Begin registers a unit of work on shard at epoch. It returns the shard's
// context (cancelled when the shard is lost, the runner detaches, or a
// release runs out of handoff time) and done, which must be called once the
// work and the write of its outcome have finished; the shard's key is not
// released before. ok is false when the shard is not owned at that epoch or
// is being released: the work must not start.
func (m *Manager) Begin(shard int, epoch int64) (ctx context.Context, done func(), ok bool) {
	if m.machine.IsDetached() {
		return nil, nil, false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	o := m.owned[shard]
	if o == nil || o.epoch != epoch || o.releasing {
		return nil, nil, false
	}
	return o.ctx, m.begin(o), true
}

// begin counts one unit of work on o (m.mu held) and returns its done.
func (m *Manager) begin(o *ownedShard) func() {
	o.inflight++
	var once sync.Once
	return func() { once.Do(func() { m.end(o) }) }
}

// end ends one unit of work on o.
func (m *Manager) end(o *ownedShard) {
	m.mu.Lock()
	o.inflight--
	idle := o.releasing && o.inflight == 0
	m.mu.Unlock()
	if idle {
		m.poke()
	}
}

// Hold pins the owned shards among owned for one claim (tasks.ClaimHold).
func (m *Manager) Hold(owned []tasks.ShardEpoch) tasks.ClaimHold {
	h := &hold{m: m, held: make(map[int]*ownedShard, len(owned))}
	if m.machine.IsDetached() {
		return h
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, se := range owned {
		if o := m.owned[se.Shard]; o != nil && o.epoch == se.Epoch && o.cancelledAt.IsZero() {
			o.inflight++
			h.held[se.Shard] = o
		}
	}
	return h
}

type hold struct {
	m    *Manager
	once sync.Once
	held map[int]*ownedShard
}

// Begin starts work on a held shard, even if its release started after the
// hold was taken, unless its work was cancelled (detach, lost fence).
func (h *hold) Begin(shard int, epoch int64) (context.Context, func(), bool) {
	h.m.mu.Lock()
	defer h.m.mu.Unlock()
	o := h.held[shard]
	if o == nil || o.epoch != epoch || !o.cancelledAt.IsZero() || o.ctx.Err() != nil {
		return nil, nil, false
	}
	return o.ctx, h.m.begin(o), true
}

func (h *hold) Release() {
	h.once.Do(func() {
		for _, o := range h.held {
			h.m.end(o)
		}
	})
}

// FenceLost reports that a write for shard at epoch was refused because the
// shard's fence moved on: the shard was taken over. Its work is cancelled at
// once and the shard is dropped.
func (m *Manager) FenceLost(shard int, epoch int64) {
	m.mu.Lock()
	o := m.owned[shard]
	if o != nil && o.epoch == epoch {
		o.cancel()
		now := m.clock.Now()
		if !o.releasing {
			o.releasing, o.releaseStart = true, now
		}
		if o.cancelledAt.IsZero() {
			o.cancelledAt = now
		}
	}
	m.mu.Unlock()
	if o != nil {
		m.log.Warn("fence lost: another runner owns the shard now", "shard", shard, "epoch", epoch)
		m.poke()
	}
}

// Changes is signalled (coalesced) whenever the owned set changes.
func (m *Manager) Changes() <-chan struct{} { return m.changes }

// Status is a snapshot of membership and ownership for /status.
type Status struct {
	RunnerID string
	// State is attached, detached or draining.
	State         string
	LeaseID       int64
	LeaseDeadline time.Time
	LeaseTimeLeft time.Duration
	Assigned      []int
	Owned         []tasks.ShardEpoch
	Releasing     []int
}

// Status returns the current state.
func (m *Manager) Status() Status {
	now := m.clock.Now()
	m.leaseMu.Lock()
	st := Status{RunnerID: m.cfg.RunnerID, LeaseID: int64(m.lease), LeaseDeadline: m.deadline, LeaseTimeLeft: m.deadline.Sub(now)}
	m.leaseMu.Unlock()
	switch {
	case m.draining.Load():
		st.State = StateDraining
	case m.machine.IsDetached():
		st.State = StateDetached
	default:
		st.State = StateAttached
	}
	m.mu.Lock()
	st.Assigned = slices.Clone(m.assigned)
	for _, o := range m.owned {
		if o.releasing {
			st.Releasing = append(st.Releasing, o.shard)
		} else {
			st.Owned = append(st.Owned, tasks.ShardEpoch{Shard: o.shard, Epoch: o.epoch})
		}
	}
	m.mu.Unlock()
	slices.Sort(st.Releasing)
	slices.SortFunc(st.Owned, func(a, b tasks.ShardEpoch) int { return a.Shard - b.Shard })
	if st.State == StateDetached {
		st.Owned = nil
	}
	return st
}
