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
	if m.conflict.Load() != nil {
		m.standingDown(ctx)
		m.claimableChanged()
		return
	}
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
	p.target = m.assignMemo.assign(members, owners)
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
	// Shards named by a key under another lease are not strays of this
	// runner's: an earlier lease's key is gone with it, and another
	// process's is none of its business.
	strays := false
	lease, _ := m.keeper.lease()
	if mine, ok := m.view.owners[m.group][me]; ok && mine.lease == int64(lease) {
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
// reports whether the key now says state. The write applies only to the
// runner's own key (ownCmp): when another process with the same runner id
// holds it, the runner stands down instead.
func (m *Manager) publish(ctx context.Context, state string) bool {
	lease, gen := m.keeper.lease()
	if m.published == state && m.publishedGen == gen {
		return true
	}
	if m.clock.Now().Before(m.storageRetryAt) {
		return false
	}
	me := m.cfg.RunnerID
	key := m.keys.runner(me)
	cctx, cancel := m.opContext(ctx)
	resp, err := m.client.Txn(cctx).
		If(ownCmp(key, m.view.runners[me].lease, lease)).
		Then(clientv3.OpPut(key, m.runnerValue(state), clientv3.WithLease(lease)), clientv3.OpGet(key)).
		Else(clientv3.OpGet(key)).Commit()
	cancel()
	if err != nil {
		m.storageError(fmt.Errorf("publishing runner state %s: %w", state, err))
		return false
	}
	m.storageOK()
	read := resp.Responses[len(resp.Responses)-1].GetResponseRange().Kvs
	m.view.loadKey(m.keys, key, read, resp.Header.Revision)
	if !resp.Succeeded {
		if !m.heldElsewhere(key, read, lease) {
			m.ledger.kick.Notify() // the view was wrong about the key: again with what the read found
		}
		return false
	}
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

// ownCmp is the condition under which the runner writes or deletes key,
// one of its own (runners/<id>, owners/<group>/<id>): the key is under
// its lease, or absent. Another process may use the same runner id — a
// successor started while this one was paused past its lease — and an
// unconditioned write would delete or take over that process's key, after
// which the two take every shard from each other. A Txn's compares are a
// conjunction and a missing key compares as a zero KeyValue (lease 0,
// create revision 0), so the view's knowledge of the key, under the lease
// of viewLease (0: absent), chooses one of the two; when the view was
// wrong, the Txn's Else branch reads the key and the next pass chooses
// again.
func ownCmp(key string, viewLease int64, lease clientv3.LeaseID) clientv3.Cmp {
	if viewLease == int64(lease) {
		return clientv3.Compare(clientv3.LeaseValue(key), "=", int64(lease))
	}
	return clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
}

// ownerWrite is the write of the runner's owner key holding terms (epoch
// 0: added by this write; a delete when terms is empty), and the
// comparison that the key is the runner's own.
func (m *Manager) ownerWrite(terms map[int]int64, lease clientv3.LeaseID) (clientv3.Cmp, clientv3.Op) {
	key := m.keys.owner(m.group, m.cfg.RunnerID)
	own := ownCmp(key, m.view.owners[m.group][m.cfg.RunnerID].lease, lease)
	if len(terms) == 0 {
		return own, clientv3.OpDelete(key)
	}
	return own, clientv3.OpPut(key, encodeTerms(terms), clientv3.WithLease(lease))
}

// groupUnchanged is the comparison that no owner key of the group was
// written since groupRev, the revision up to which the view of them is
// complete.
func (m *Manager) groupUnchanged() clientv3.Cmp {
	return clientv3.Compare(clientv3.ModRevision(m.keys.group(m.group)), "<", m.groupRev+1).WithPrefix()
}

// readGroup reads every owner key of the group: a Txn branch that holds it
// makes the view of them complete up to the Txn's revision (loadGroup). A
// branch that does not read them says nothing of what the view missed.
func (m *Manager) readGroup() clientv3.Op {
	return clientv3.OpGet(m.keys.group(m.group), clientv3.WithPrefix())
}

// acquire adds the free shards to the runner's owner key, in one
// transaction that applies only if no owner key of the group changed
// since the view's revision (then none of the shards was taken in
// between, and the transaction's revision is the epoch of each: it grows
// with every change of hands) and the key is the runner's own. Either
// branch reads the group's owner keys, so that the view is complete up to
// the transaction's revision; when it did not apply, the next pass
// acquires what is still free. It returns how many shards turned out to
// be held by someone else.
func (m *Manager) acquire(ctx context.Context, shards []int) (held int) {
	lease, gen := m.keeper.lease()
	terms := m.ledger.current(gen)
	for _, s := range shards {
		terms[s] = 0
	}
	own, write := m.ownerWrite(terms, lease)
	sent := m.clock.Now()
	cctx, cancel := m.opContext(ctx)
	resp, err := m.client.Txn(cctx).If(m.groupUnchanged(), own).Then(write, m.readGroup()).Else(m.readGroup()).Commit()
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
	read := resp.Responses[len(resp.Responses)-1].GetResponseRange().Kvs
	m.loadGroup(read, rev)
	if !resp.Succeeded {
		if m.heldElsewhere(m.keys.owner(m.group, m.cfg.RunnerID), read, lease) {
			return 0
		}
		owners, _ := m.view.holders(m.group)
		for _, s := range shards {
			if owners[s] != "" && owners[s] != m.cfg.RunnerID {
				held++
			}
		}
		m.ledger.kick.Notify() // try again with what is free now
		return held
	}
	for _, s := range shards {
		m.ledger.adopt(s, rev, sent, gen)
	}
	return 0
}

// release drops the terms whose work has stopped from the runner's owner
// key (and whatever else it names that the runner no longer tracks): one
// write of the key with the terms it keeps, whatever the group's other
// keys did meanwhile, as long as the key is the runner's own. Either
// branch reads the group's owner keys, so that the view stays complete
// for the next acquisition.
func (m *Manager) release(ctx context.Context, ready []*term) {
	lease, gen := m.keeper.lease()
	terms := m.ledger.current(gen)
	for _, t := range ready {
		delete(terms, t.shard)
	}
	own, write := m.ownerWrite(terms, lease)
	// The work stopped before the write was sent: that is when the terms
	// ended.
	sent := m.clock.Now()
	cctx, cancel := m.opContext(ctx)
	resp, err := m.client.Txn(cctx).If(own).Then(write, m.readGroup()).Else(m.readGroup()).Commit()
	cancel()
	if err != nil {
		m.storageError(fmt.Errorf("releasing %d shards: %w", len(ready), err))
		return
	}
	m.storageOK()
	read := resp.Responses[len(resp.Responses)-1].GetResponseRange().Kvs
	m.loadGroup(read, resp.Header.Revision)
	if !resp.Succeeded {
		if !m.heldElsewhere(m.keys.owner(m.group, m.cfg.RunnerID), read, lease) {
			m.ledger.kick.Notify() // the view was wrong about the key: again with what the read found
		}
		return
	}
	for _, t := range ready {
		m.ledger.released(t, true, sent)
	}
}

// loadGroup replaces the view of the group's owner keys with what a
// complete read of them at rev found, and makes rev the revision the next
// acquisition compares against.
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
