package shard

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/clock"
)

// watch follows the cluster prefix from rev+1 and sends every batch of
// events to out. When the watch fails (compaction, lost leader, closed
// channel) it re-reads the prefix and sends a snapshot, then watches on.
func (m *Manager) watch(ctx context.Context, rev int64, out chan<- watchUpdate) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		ch := m.client.Watch(wctx, m.keys.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
		for resp := range ch {
			if err := resp.Err(); err != nil || resp.CompactRevision != 0 {
				if ctx.Err() == nil {
					m.log.Debug("watch interrupted; re-reading cluster state", "error", err, "compacted", resp.CompactRevision)
				}
				break
			}
			if len(resp.Events) == 0 {
				continue
			}
			rev = resp.Header.Revision
			select {
			case out <- watchUpdate{events: resp.Events}:
			case <-ctx.Done():
				cancel()
				return
			}
			backoff = 100 * time.Millisecond
		}
		cancel()
		for ctx.Err() == nil {
			gctx, gcancel := context.WithTimeout(ctx, 5*time.Second)
			snap, err := m.client.Get(gctx, m.keys.prefix, clientv3.WithPrefix())
			gcancel()
			if err == nil {
				rev = snap.Header.Revision
				select {
				case out <- watchUpdate{snapshot: snap.Kvs, snapshotRev: rev}:
				case <-ctx.Done():
					return
				}
				break
			}
			if !clock.Sleep(m.clock, backoff, ctx.Done()) {
				return
			}
			backoff = min(2*backoff, 2*time.Second)
		}
	}
}
