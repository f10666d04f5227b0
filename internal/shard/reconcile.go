package shard

import (
	"context"
	"fmt"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
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

// target publishes the runner's state and computes the assignment of its
// group's shards among the group's attached members.
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
	members := slices.DeleteFunc(m.view.attached(m.group), func(id string) bool { return id == me })
	if desired == StateAttached && published {
		members = append(members, me)
	}
	p.settling = m.settle(p.now, members)
	owners, _ := m.view.holders(m.group)
	p.target = Assign(members, owners)
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
// work of those whose handoff timed out, and drops from the runner's owner
// key the terms whose work stopped (or whose cancel grace passed), and the
// shards the key names that the runner does not track (a put whose answer
// was lost, adopted by acquireStep if it was an acquisition).
func (m *Manager) releaseStep(ctx context.Context, p plan) {
	me := m.cfg.RunnerID
	ready := m.ledger.releaseStep(p.now, m.cfg.HandoffTimeout, func(s int) string {
		if !p.leaving(s, me) {
			return ""
		}
		return "assigned to " + orNobody(p.target[s])
	})
	if p.now.Before(m.storageRetryAt) {
		return // etcd failed a moment ago: the key waits for the retry
	}
	strays := false
	if mine, ok := m.view.owners[m.group][me]; ok {
		for s := range mine.terms {
			if !m.holds(s) && m.unansweredSent[s].IsZero() {
				strays = true
				break
			}
		}
	}
	if len(ready) > 0 || strays {
		m.release(ctx, ready)
	}
}

// acquireStep adopts shards whose acquisition answer was lost and acquires
// the free shards assigned to this runner; it schedules a retry while some
// stay held elsewhere.
func (m *Manager) acquireStep(ctx context.Context, p plan) {
	me := m.cfg.RunnerID
	_, gen := m.keeper.lease()
	owners, epochs := m.view.holders(m.group)
	var free []int
	pending := 0
	for _, s := range p.mine {
		if m.holds(s) {
			continue
		}
		switch owners[s] {
		case "":
			free = append(free, s)
		case me:
			// Ours already: an acquisition whose answer was lost.
			if sent := m.unansweredSent[s]; !sent.IsZero() {
				m.ledger.adopt(s, epochs[s], sent, gen)
				delete(m.unansweredSent, s)
			}
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
// someone appeared in the group's attached set less than JoinSettle ago.
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

// scheduleRetry re-reads the cluster with backoff while assigned shards
// stay held elsewhere, in case an event was missed; the owner key's change
// normally triggers the acquisition first.
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
			m.storageError(fmt.Errorf("re-reading the cluster: %w", err))
		} else {
			m.storageOK()
			m.view.load(m.keys, snap.Kvs, snap.Header.Revision)
			m.groupRev = max(m.groupRev, snap.Header.Revision)
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
// that committed is adopted from the watch (the owner key names the
// shards), a release is sent only after the term's work stopped, and a
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

// ownerOps is the write of the runner's owner key holding terms (epoch 0:
// added by this write), and the comparison that makes it conditional on no
// other change to the group's owner keys since the view's revision.
func (m *Manager) ownerOps(terms map[int]int64, lease clientv3.LeaseID) (clientv3.Cmp, clientv3.Op) {
	cmp := clientv3.Compare(clientv3.ModRevision(m.keys.group(m.group)), "<", m.groupRev+1).WithPrefix()
	key := m.keys.owner(m.group, m.cfg.RunnerID)
	if len(terms) == 0 {
		return cmp, clientv3.OpDelete(key)
	}
	return cmp, clientv3.OpPut(key, encodeTerms(terms), clientv3.WithLease(lease))
}

// acquire adds the free shards to the runner's owner key, in one
// transaction that applies only if no other runner's owner key of the group
// changed since the view saw them: then none of the shards was taken in
// between, and the transaction's revision is the epoch of each (it grows
// with every change of hands). Otherwise the transaction reads the group's
// owner keys instead, and the next pass acquires what is still free. It
// returns how many shards turned out to be held by someone else.
func (m *Manager) acquire(ctx context.Context, shards []int) (held int) {
	lease, gen := m.keeper.lease()
	terms := m.ledger.current(gen)
	for _, s := range shards {
		terms[s] = 0
	}
	cmp, put := m.ownerOps(terms, lease)
	sent := m.clock.Now()
	cctx, cancel := m.opContext(ctx)
	resp, err := m.client.Txn(cctx).If(cmp).Then(put).Else(clientv3.OpGet(m.keys.group(m.group), clientv3.WithPrefix())).Commit()
	cancel()
	if err != nil {
		if m.unansweredSent == nil {
			m.unansweredSent = map[int]time.Time{}
		}
		for _, s := range shards {
			m.unansweredSent[s] = sent
		}
		m.storageError(fmt.Errorf("acquiring %d shards: %w", len(shards), err))
		return 0
	}
	m.storageOK()
	rev := resp.Header.Revision
	if !resp.Succeeded {
		m.loadGroup(resp.Responses[0].GetResponseRange().Kvs, rev)
		owners, _ := m.view.holders(m.group)
		for _, s := range shards {
			if owners[s] != "" && owners[s] != m.cfg.RunnerID {
				held++
			}
		}
		m.ledger.kick.Notify() // try again with what is free now
		return held
	}
	m.groupRev = rev
	for s, epoch := range terms {
		if epoch == 0 {
			terms[s] = rev
		}
	}
	m.setMine(terms, rev, int64(lease))
	for _, s := range shards {
		m.ledger.adopt(s, rev, sent, gen)
	}
	return 0
}

// release drops the terms whose work has stopped from the runner's owner
// key (and whatever else it names that the runner no longer tracks): one
// write of the key with the terms it keeps. It applies whatever else the
// group's keys did meanwhile; when they changed, the transaction also reads
// them, so that the view stays current for the next acquisition.
func (m *Manager) release(ctx context.Context, ready []*term) {
	lease, gen := m.keeper.lease()
	terms := m.ledger.current(gen)
	for _, t := range ready {
		delete(terms, t.shard)
	}
	cmp, put := m.ownerOps(terms, lease)
	// The work stopped before the write was sent: that is when the terms
	// ended.
	sent := m.clock.Now()
	cctx, cancel := m.opContext(ctx)
	resp, err := m.client.Txn(cctx).If(cmp).Then(put).Else(put, clientv3.OpGet(m.keys.group(m.group), clientv3.WithPrefix())).Commit()
	cancel()
	if err != nil {
		m.storageError(fmt.Errorf("releasing %d shards: %w", len(ready), err))
		return
	}
	m.storageOK()
	rev := resp.Header.Revision
	if resp.Succeeded {
		m.groupRev = rev
	} else {
		m.loadGroup(resp.Responses[1].GetResponseRange().Kvs, rev)
	}
	m.setMine(terms, rev, int64(lease))
	for _, t := range ready {
		m.ledger.released(t, true, sent)
	}
}

// setMine records in the view what the runner's owner key holds after its
// own write at rev.
func (m *Manager) setMine(terms map[int]int64, rev, lease int64) {
	byRunner := m.view.owners[m.group]
	if byRunner == nil {
		byRunner = map[string]ownerEntry{}
		m.view.owners[m.group] = byRunner
	}
	if len(terms) == 0 {
		delete(byRunner, m.cfg.RunnerID)
		m.view.gone[m.group+"/"+m.cfg.RunnerID] = rev
		return
	}
	byRunner[m.cfg.RunnerID] = ownerEntry{terms: terms, modRev: rev, lease: lease}
}

// loadGroup replaces the view of the group's owner keys with what a read
// at rev found, and makes rev the revision the next acquisition compares
// against.
func (m *Manager) loadGroup(kvs []*mvccpb.KeyValue, rev int64) {
	seen := map[string]bool{}
	for _, kv := range kvs {
		if _, id, ok := m.keys.parseOwner(kv.Key); ok {
			seen[id] = true
		}
		m.view.set(m.keys, kv, false)
	}
	for id, e := range m.view.owners[m.group] {
		if !seen[id] && e.modRev <= rev {
			delete(m.view.owners[m.group], id)
			m.view.gone[m.group+"/"+id] = rev
		}
	}
	m.groupRev = max(m.groupRev, rev)
}

// holds reports whether the runner has a term on shard s.
func (m *Manager) holds(s int) bool { return m.ledger.holds(s) }
