package shard

import (
	"context"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Another live process with the same runner id.
//
// A runner id is meant to be unique, but a process paused past its lease
// (a GC pause, SIGSTOP, a VM migration) wakes to find that a successor
// started with the same --runner-id after its lease expired, registered
// runners/<id> and took the group's shards under owners/<group>/<id>. Both
// processes write the same two keys. Every such write is therefore
// conditioned on the key being under the writer's own lease, or absent
// (ownCmp): the old process's lease is gone, so it can no longer touch the
// successor's keys. When one of those writes finds the key under another
// lease, the writer stands down instead of fighting: it cancels its work,
// writes nothing but the releases of what is still under its own lease,
// and checks with backoff until the id's keys are free, as register does
// at start. Whichever process holds the keys keeps them.

// Bounds of the backoff between checks of a runner id that another
// process holds: the first check comes about as soon as register's, and
// the process rejoins at most a few seconds after the other one left.
const (
	conflictCheckMin = 250 * time.Millisecond
	conflictCheckMax = 5 * time.Second
)

// heldElsewhere reports whether a read (kvs) of key, one of the runner's
// own, made after lease was granted, found it under another lease; if so
// the runner stands down. Such a read cannot show a key of an earlier
// lease of the runner's: a lease is granted anew only once etcd said the
// previous one is gone, and its keys went with it.
func (m *Manager) heldElsewhere(key string, kvs []*mvccpb.KeyValue, lease clientv3.LeaseID) bool {
	for _, kv := range kvs {
		if string(kv.Key) == key && kv.Lease != int64(lease) {
			m.standDown(key, kv.Lease, lease)
			return true
		}
	}
	return false
}

// standDown stops all work and every write of the runner's keys once key
// was found under holder, another process's lease. It logs once per
// conflict: the checks that follow log at debug level.
func (m *Manager) standDown(key string, holder int64, lease clientv3.LeaseID) {
	if m.conflict.Load() != nil {
		return
	}
	now := m.clock.Now()
	m.log.Error("another live process uses this runner id: standing down, doing no work, until it leaves",
		"runner", m.cfg.RunnerID, "key", key, "holder_lease", fmt.Sprintf("%x", holder), "lease", fmt.Sprintf("%x", int64(lease)))
	m.conflict.Store(&key)
	if n := m.ledger.cancelAll(now, "another live process uses this runner id"); n > 0 {
		m.log.Warn("work cancelled: the runner id is another process's", "shards", n)
	}
	// Published under this process nothing any more: on rejoining it
	// registers again.
	m.published, m.publishedGen = "", 0
	m.conflictCheck.Reset()
	m.conflictCheckAt = now.Add(m.conflictCheck.Next())
}

// standingDown is the Run loop's pass while another process holds the
// runner id: release what is still under the runner's own lease (the
// terms whose work stopped, then its runner key), and check the id's keys
// when the backoff says so.
func (m *Manager) standingDown(ctx context.Context) {
	now := m.clock.Now()
	m.ledger.setAssigned(nil)
	m.metrics.ShardsAssigned.Set(0)
	m.releaseStep(ctx, plan{now: now, target: make([]string, m.cfg.ShardCount)})
	lease, _ := m.keeper.lease()
	me := m.cfg.RunnerID
	if m.view.runners[me].lease == int64(lease) && !now.Before(m.storageRetryAt) {
		key := m.keys.runner(me)
		cctx, cancel := m.opContext(ctx)
		resp, err := m.client.Txn(cctx).
			If(clientv3.Compare(clientv3.LeaseValue(key), "=", int64(lease))).
			Then(clientv3.OpDelete(key)).Else(clientv3.OpGet(key)).Commit()
		cancel()
		if err != nil {
			m.storageError(fmt.Errorf("withdrawing runner key %s: %w", key, err))
		} else {
			m.storageOK()
			var kvs []*mvccpb.KeyValue
			if !resp.Succeeded {
				kvs = resp.Responses[0].GetResponseRange().Kvs
			}
			m.view.loadKey(m.keys, key, kvs, resp.Header.Revision)
		}
	}
	if now.Before(m.conflictCheckAt) {
		return
	}
	m.checkConflict(ctx, now)
}

// checkConflict reads the runner id's keys and ends the conflict when
// none is under another lease.
func (m *Manager) checkConflict(ctx context.Context, now time.Time) {
	lease, _ := m.keeper.lease()
	ids := []string{m.keys.runner(m.cfg.RunnerID), m.keys.owner(m.group, m.cfg.RunnerID)}
	cctx, cancel := m.opContext(ctx)
	resp, err := m.client.Txn(cctx).Then(clientv3.OpGet(ids[0]), clientv3.OpGet(ids[1])).Commit()
	cancel()
	if err != nil {
		m.conflictCheckAt = now.Add(m.conflictCheck.Next())
		m.log.Debug("checking the runner id's keys failed", "error", err)
		return
	}
	for i, key := range ids {
		kvs := resp.Responses[i].GetResponseRange().Kvs
		m.view.loadKey(m.keys, key, kvs, resp.Header.Revision)
		if len(kvs) > 0 && kvs[0].Lease != int64(lease) {
			wait := m.conflictCheck.Next()
			m.conflictCheckAt = now.Add(wait)
			m.log.Debug("runner id still held by another process", "key", key,
				"holder_lease", fmt.Sprintf("%x", kvs[0].Lease), "next_check", wait)
			return
		}
	}
	m.conflict.Store(nil)
	m.conflictCheckAt = time.Time{}
	m.log.Info("runner id free again: rejoining", "runner", m.cfg.RunnerID)
	m.ledger.kick.Notify()
}
