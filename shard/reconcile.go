package shard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// plan is what one reconcile pass aims at.
type plan struct {
	now time.Time
	// target[s] is the runner shard s should have.
	target []string
	// mine are the shards the target gives this runner.
	mine []int
	// settling: a runner joined less than JoinSettle ago.
	settling bool
	// acquire: this runner may acquire now (attached, published, not
	// draining, membership settled).
	acquire bool
}

// leaving reports whether a held shard is to be released now: assigned to
// another runner, or to nobody. While membership settles after a join,
// only the latter, so that many runners joining together rebalance once.
func (p plan) leaving(s int, me string) bool {
	return p.target[s] != me && (!p.settling || p.target[s] == "")
}

// reconcile moves this runner one step towards the assignment: publish its
// state, compute the target, release what is no longer its (once the work
// stopped), adopt or acquire what is. It runs after every batch of watch
// events, detach event, end of in-flight work on a releasing shard, and
// retry timer.
func (m *Manager) reconcile(ctx context.Context) {
	p := m.target(ctx)
	m.releaseStep(ctx, p)
	if p.acquire {
		m.acquireStep(ctx, p)
	}
	m.claimableChanged()
}

// target publishes the runner's state and computes the assignment.
func (m *Manager) target(ctx context.Context) plan {
	p := plan{now: m.clock.Now()}
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
	p.settling = m.settle(p.now, members)
	p.target = Assign(members, m.view.owners())
	for s, owner := range p.target {
		if owner == me {
			p.mine = append(p.mine, s)
		}
	}
	p.acquire = desired == StateAttached && published && !p.settling
	m.ledger.setAssigned(p.mine)
	m.metrics.ShardsAssigned.Set(float64(len(p.mine)))
	return p
}

// releaseStep starts releasing the terms assigned elsewhere, cancels the
// work of those whose handoff timed out, and deletes the keys of terms
// whose work stopped (or whose cancel grace passed), and of stray keys of
// this lease that the runner does not track.
func (m *Manager) releaseStep(ctx context.Context, p plan) {
	me := m.cfg.RunnerID
	ready := m.ledger.releaseStep(p.now, m.cfg.HandoffTimeout, func(s int) string {
		if !p.leaving(s, me) {
			return ""
		}
		return "assigned to " + orNobody(p.target[s])
	})
	if p.now.Before(m.storageRetryAt) {
		return // etcd failed a moment ago: the keys wait for the retry
	}
	if len(ready) > 0 {
		m.release(ctx, ready)
	}
	if !p.acquire {
		return
	}
	lease, _ := m.keeper.lease()
	var strays []*term
	for s, e := range m.view.shards {
		if e.owner == me && e.lease == int64(lease) && p.target[s] != me && !m.holds(s) {
			strays = append(strays, &term{shard: s, epoch: e.createRev, state: releasing})
		}
	}
	if len(strays) > 0 {
		m.release(ctx, strays)
	}
}

// acquireStep adopts shards whose acquisition answer was lost and acquires
// the free shards assigned to this runner; it schedules a retry while some
// stay held elsewhere.
func (m *Manager) acquireStep(ctx context.Context, p plan) {
	me := m.cfg.RunnerID
	lease, gen := m.keeper.lease()
	var free []int
	pending := 0
	for _, s := range p.mine {
		if m.holds(s) {
			continue
		}
		e := m.view.shards[s]
		switch {
		case e.owner == "":
			free = append(free, s)
		case e.owner == me && e.lease == int64(lease):
			// Ours already: an acquisition whose answer was lost.
			m.ledger.adopt(s, e.createRev, m.unansweredSent[s], gen)
			delete(m.unansweredSent, s)
		default:
			pending++
		}
	}
	if len(free) > 0 && !p.now.Before(m.storageRetryAt) {
		pending += m.acquire(ctx, free)
	}
	m.scheduleRetry(ctx, p.now, pending)
}

func orNobody(id string) string {
	if id == "" {
		return "nobody"
	}
	return id
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
		m.retryAt = time.Time{}
		m.retry.Reset()
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
		if err != nil {
			m.storageError(fmt.Errorf("re-reading the shard keys: %w", err))
		} else {
			m.storageOK()
			m.view.load(m.keys, snap.Kvs, snap.Header.Revision)
		}
		m.log.Debug("assigned shards still held elsewhere", "shards", pending)
	}
	m.retryAt = now.Add(m.retry.Next())
}

// publish writes runners/<me> with state when it or the lease changed. It
// reports whether the key now says state.
func (m *Manager) publish(ctx context.Context, state string) bool {
	lease, gen := m.keeper.lease()
	if m.published == state && m.publishedGen == gen {
		return true
	}
	if m.clock.Now().Before(m.storageRetryAt) {
		return false
	}
	cctx, cancel := m.opContext(ctx)
	_, err := m.client.Put(cctx, m.keys.runner(m.cfg.RunnerID), m.runnerValue(state), clientv3.WithLease(lease))
	cancel()
	if err != nil {
		m.storageError(fmt.Errorf("publishing runner state %s: %w", state, err))
		return false
	}
	m.storageOK()
	m.log.Info("published runner state", "state", state)
	m.published, m.publishedGen = state, gen
	return true
}

// storageError records a failed acquire, release or publish and arms a
// retry. It does not detach: such a call fails on every routine etcd leader
// election, and its outcome, unknown, is safe either way — an acquisition
// that committed is adopted from the watch (the key names this runner's
// lease), a release is sent only after the term's work stopped, and a
// publish is retried. Whether the runner may work is the lease clock's to
// say (the keeper), and it detaches when the lease can no longer be proven.
func (m *Manager) storageError(err error) {
	wait := m.storageRetry.Next()
	m.storageRetryAt = m.clock.Now().Add(wait)
	m.metrics.EtcdErrors.Inc()
	m.log.Warn("etcd call failed; retrying", "error", err, "retry_in", wait)
}

// storageOK ends the storage backoff after a call that succeeded.
func (m *Manager) storageOK() {
	m.storageRetryAt = time.Time{}
	m.storageRetry.Reset()
}

// acquire creates the keys of free shards in batched Txns: each shard is a
// nested Txn "if the key does not exist, put it under my lease, else read
// it", so one taken key does not fail the batch. It returns how many shards
// turned out to be held by someone else.
func (m *Manager) acquire(ctx context.Context, shards []int) (held int) {
	lease, gen := m.keeper.lease()
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
		m.storageOK()
		rev := resp.Header.Revision
		for i, r := range resp.Responses {
			s := batch[i]
			tr := r.GetResponseTxn()
			if tr.Succeeded {
				m.view.shards[s] = shardEntry{owner: m.cfg.RunnerID, createRev: rev, modRev: rev, lease: int64(lease)}
				m.ledger.adopt(s, rev, sent, gen)
				continue
			}
			held++
			if kvs := tr.Responses[0].GetResponseRange().Kvs; len(kvs) == 1 {
				m.view.set(m.keys, kvs[0], false)
			}
		}
		shards = shards[n:]
	}
	return held
}

// release deletes the keys of terms whose work has stopped, each only if it
// is still the same term (CreateRevision == epoch), in batches.
func (m *Manager) release(ctx context.Context, terms []*term) {
	for len(terms) > 0 {
		n := min(len(terms), m.cfg.AcquireBatch)
		batch := terms[:n]
		ops := make([]clientv3.Op, n)
		for i, t := range batch {
			k := m.keys.shard(t.shard)
			ops[i] = clientv3.OpTxn(
				[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(k), "=", t.epoch)},
				[]clientv3.Op{clientv3.OpDelete(k)}, nil)
		}
		// The work stopped before the delete was sent: that is when the
		// term ended.
		sent := m.clock.Now()
		cctx, cancel := m.opContext(ctx)
		resp, err := m.client.Txn(cctx).Then(ops...).Commit()
		cancel()
		if err != nil {
			m.storageError(fmt.Errorf("releasing %d shards: %w", n, err))
			return
		}
		m.storageOK()
		rev := resp.Header.Revision
		for i, r := range resp.Responses {
			t := batch[i]
			deleted := r.GetResponseTxn().Succeeded
			if deleted {
				if e := m.view.shards[t.shard]; e.modRev <= rev {
					m.view.shards[t.shard] = shardEntry{modRev: rev}
				}
			}
			m.ledger.released(t, deleted, sent)
		}
		terms = terms[n:]
	}
}

// holds reports whether the runner has a term on shard s.
func (m *Manager) holds(s int) bool { return m.ledger.holds(s) }
