package shard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
)

// reconcile moves this runner one step towards the assignment: publish its
// state, release what is no longer its (once the work stopped), adopt or
// acquire what is. It runs after every batch of watch events, detach event,
// end of in-flight work on a releasing shard, and retry timer.
func (m *Manager) reconcile(ctx context.Context) {
	now := m.clock.Now()
	detached := m.machine.IsDetached()
	draining := m.draining.Load()
	desired := StateAttached
	switch {
	case draining:
		desired = StateDraining
	case detached:
		desired = StateDetached
	}
	// A detached or draining runner rewrites its state first, so the others
	// exclude it at once; an attached one announces itself before acquiring.
	published := m.publish(ctx, desired)

	me := m.cfg.RunnerID
	members := slices.DeleteFunc(m.view.attached(), func(id string) bool { return id == me })
	if desired == StateAttached && published {
		members = append(members, me)
	}
	settling := m.settle(now, members)
	target := Assign(members, m.view.owners())
	var mine []int
	for s, owner := range target {
		if owner == me {
			mine = append(mine, s)
		}
	}

	m.mu.Lock()
	m.assigned = mine
	var ready []*ownedShard
	for s, o := range m.owned {
		if detached && o.cancelledAt.IsZero() {
			// Acquired by a Txn that was in flight when the runner detached.
			o.cancel()
			o.releasing, o.releaseStart, o.cancelledAt = true, now, now
		}
		if !o.releasing && target[s] != me && (!settling || target[s] == "") {
			o.releasing, o.releaseStart = true, now
			m.log.Debug("releasing shard", "shard", s, "epoch", o.epoch, "new_owner", target[s], "inflight", o.inflight)
		}
		if !o.releasing {
			continue
		}
		if o.inflight > 0 && o.cancelledAt.IsZero() && now.Sub(o.releaseStart) >= m.cfg.HandoffTimeout {
			m.log.Warn("handoff timeout: cancelling in-flight work", "shard", s, "inflight", o.inflight)
			o.cancel()
			o.cancelledAt = now
		}
		if o.inflight == 0 || (!o.cancelledAt.IsZero() && now.Sub(o.cancelledAt) >= cancelGrace) {
			ready = append(ready, o)
		}
	}
	m.mu.Unlock()
	m.metrics.ShardsAssigned.Set(float64(len(mine)))
	if len(ready) > 0 {
		m.release(ctx, ready)
	}
	if detached || draining || !published || settling {
		m.ownedChanged()
		return
	}

	lease := int64(m.leaseID())
	var free []int
	pending := 0
	m.mu.Lock()
	for _, s := range mine {
		if m.owned[s] != nil {
			continue
		}
		e := m.view.shards[s]
		switch {
		case e.owner == "":
			free = append(free, s)
		case e.owner == me && e.lease == lease:
			// Ours already: an acquisition whose answer was lost.
			m.adopt(s, e.createRev, m.unansweredSent[s])
			delete(m.unansweredSent, s)
		default:
			pending++
		}
	}
	m.mu.Unlock()
	var strays []*ownedShard
	for s, e := range m.view.shards {
		if e.owner == me && e.lease == lease && target[s] != me && !m.isOwned(s) {
			strays = append(strays, &ownedShard{shard: s, epoch: e.createRev, cancel: func() {}})
		}
	}
	if len(strays) > 0 {
		m.release(ctx, strays)
	}
	if len(free) > 0 {
		pending += m.acquire(ctx, free)
	}
	m.scheduleRetry(ctx, now, pending)
	m.ownedChanged()
}

// settle reports whether the membership is still settling after a join:
// someone appeared in the attached set less than JoinSettle ago.
func (m *Manager) settle(now time.Time, members []string) bool {
	if m.cfg.JoinSettle <= 0 {
		return false
	}
	joined := false
	current := make(map[string]bool, len(members))
	for _, id := range members {
		current[id] = true
		if !m.knownMembers[id] {
			joined = true
		}
	}
	m.knownMembers = current
	if joined {
		m.settleUntil = now.Add(m.cfg.JoinSettle)
	}
	return now.Before(m.settleUntil)
}

// scheduleRetry re-reads the shard keys with backoff while assigned shards
// stay held elsewhere, in case an event was missed; DELETE events normally
// trigger the acquisition first.
func (m *Manager) scheduleRetry(ctx context.Context, now time.Time, pending int) {
	if pending == 0 {
		m.retryAt, m.retryBackoff = time.Time{}, 0
		return
	}
	if !m.retryAt.IsZero() && now.Before(m.retryAt) {
		return
	}
	if !m.retryAt.IsZero() {
		m.metrics.AcquireRetries.Add(float64(pending))
		cctx, cancel := m.opContext(ctx)
		snap, err := m.client.Get(cctx, m.keys.prefix, clientv3.WithPrefix())
		cancel()
		if err == nil {
			m.view.load(m.keys, snap.Kvs, snap.Header.Revision)
		}
		m.log.Debug("assigned shards still held elsewhere", "shards", pending, "backoff", m.retryBackoff)
	}
	m.retryBackoff = min(max(2*m.retryBackoff, 200*time.Millisecond), 5*time.Second)
	m.retryAt = now.Add(m.retryBackoff)
}

// publish writes runners/<me> with state when it or the lease changed. It
// reports whether the key now says state.
func (m *Manager) publish(ctx context.Context, state string) bool {
	gen := m.leaseGeneration()
	if m.published == state && m.publishedGen == gen {
		return true
	}
	if !m.storageFailedAt.IsZero() && m.clock.Now().Sub(m.storageFailedAt) < 200*time.Millisecond {
		return false
	}
	cctx, cancel := m.opContext(ctx)
	_, err := m.client.Put(cctx, m.keys.runner(m.cfg.RunnerID), m.runnerValue(state), clientv3.WithLease(m.leaseID()))
	cancel()
	if err != nil {
		m.storageError(fmt.Errorf("publishing runner state %s: %w", state, err))
		return false
	}
	m.storageFailedAt = time.Time{}
	m.log.Info("published runner state", "state", state)
	m.published, m.publishedGen = state, gen
	return true
}

// storageError detaches at once (a failed acquire, release or publish means
// the runner cannot prove what it owns) and arms a retry.
func (m *Manager) storageError(err error) {
	m.storageFailedAt = m.clock.Now()
	m.retryAt = m.storageFailedAt.Add(200 * time.Millisecond)
	if m.machine.IsDetached() {
		m.log.Debug("etcd still unreachable", "error", err)
		return
	}
	m.machine.Detach(detach.Reason{Kind: detach.StorageError, Detail: err.Error()})
}

// acquire creates the keys of free shards in batched Txns: each shard is a
// nested Txn "if the key does not exist, put it under my lease, else read
// it", so one taken key does not fail the batch. It returns how many shards
// turned out to be held by someone else.
func (m *Manager) acquire(ctx context.Context, shards []int) (held int) {
	lease := m.leaseID()
	for len(shards) > 0 {
		n := min(len(shards), m.cfg.AcquireBatch)
		batch := shards[:n]
		ops := make([]clientv3.Op, n)
		for i, s := range batch {
			k := m.keys.shard(s)
			ops[i] = clientv3.OpTxn(
				[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(k), "=", 0)},
				[]clientv3.Op{clientv3.OpPut(k, m.cfg.RunnerID, clientv3.WithLease(lease))},
				[]clientv3.Op{clientv3.OpGet(k)})
		}
		sent := m.clock.Now()
		cctx, cancel := m.opContext(ctx)
		resp, err := m.client.Txn(cctx).Then(ops...).Commit()
		cancel()
		if errors.Is(err, rpctypes.ErrTooManyOps) && m.cfg.AcquireBatch > 1 {
			m.cfg.AcquireBatch /= 2
			m.log.Warn("etcd refused the acquire batch size; halving it", "batch", m.cfg.AcquireBatch)
			continue
		}
		if err != nil {
			if m.unansweredSent == nil {
				m.unansweredSent = map[int]time.Time{}
			}
			for _, s := range batch {
				m.unansweredSent[s] = sent
			}
			m.storageError(fmt.Errorf("acquiring %d shards: %w", n, err))
			return held
		}
		rev := resp.Header.Revision
		m.mu.Lock()
		for i, r := range resp.Responses {
			s := batch[i]
			tr := r.GetResponseTxn()
			if tr.Succeeded {
				m.view.shards[s] = shardEntry{owner: m.cfg.RunnerID, createRev: rev, modRev: rev, lease: int64(lease)}
				m.adopt(s, rev, sent)
				continue
			}
			held++
			if kvs := tr.Responses[0].GetResponseRange().Kvs; len(kvs) == 1 {
				m.view.set(m.keys, kvs[0], false)
			}
		}
		m.mu.Unlock()
		shards = shards[n:]
	}
	return held
}

// adopt records shard as owned at epoch; called with m.mu held.
func (m *Manager) adopt(shard int, epoch int64, sent time.Time) {
	ctx, cancel := context.WithCancel(context.Background())
	m.owned[shard] = &ownedShard{shard: shard, epoch: epoch, ctx: ctx, cancel: cancel}
	m.metrics.Acquisitions.Inc()
	m.observe(Event{Kind: Acquired, Shard: shard, Epoch: epoch, Sent: sent})
}

// release deletes the keys of shards whose work has stopped, each only if it
// is still the same ownership term (CreateRevision == epoch), in batches.
func (m *Manager) release(ctx context.Context, shards []*ownedShard) {
	for len(shards) > 0 {
		n := min(len(shards), m.cfg.AcquireBatch)
		batch := shards[:n]
		ops := make([]clientv3.Op, n)
		for i, o := range batch {
			k := m.keys.shard(o.shard)
			ops[i] = clientv3.OpTxn(
				[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(k), "=", o.epoch)},
				[]clientv3.Op{clientv3.OpDelete(k)}, nil)
		}
		sent := m.clock.Now()
		cctx, cancel := m.opContext(ctx)
		resp, err := m.client.Txn(cctx).Then(ops...).Commit()
		cancel()
		if err != nil {
			m.storageError(fmt.Errorf("releasing %d shards: %w", n, err))
			return
		}
		rev := resp.Header.Revision
		m.mu.Lock()
		for i, r := range resp.Responses {
			o := batch[i]
			o.cancel()
			if cur := m.owned[o.shard]; cur == o {
				delete(m.owned, o.shard)
			}
			if r.GetResponseTxn().Succeeded {
				if e := m.view.shards[o.shard]; e.modRev <= rev {
					m.view.shards[o.shard] = shardEntry{modRev: rev}
				}
				m.metrics.Releases.Inc()
				// The work stopped before the delete was sent.
				m.observe(Event{Kind: Released, Shard: o.shard, Epoch: o.epoch, At: sent})
			} else {
				m.observe(Event{Kind: Lost, Shard: o.shard, Epoch: o.epoch})
			}
		}
		m.mu.Unlock()
		shards = shards[n:]
	}
}

func (m *Manager) isOwned(s int) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.owned[s] != nil
}

// ownedChanged updates the gauge and wakes the executor when the set of
// shards it may work on changed.
func (m *Manager) ownedChanged() {
	owned := m.Owned()
	m.metrics.ShardsOwned.Set(float64(len(owned)))
	if !slices.Equal(owned, m.lastOwned) {
		m.lastOwned = owned
		m.notifyChanges()
	}
}
