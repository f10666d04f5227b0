package shard

import (
	"context"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/clock"
)

// watcher follows the cluster prefix and hands every batch of events to the
// manager's Run loop. When the watch fails (compaction, lost leader, closed
// channel) it re-reads the prefix and sends a snapshot, then watches on.
type watcher struct {
	client *clientv3.Client
	prefix string
	clock  clock.Clock
	log    hclog.Logger
	out    chan<- watchUpdate
	// rev is the revision the manager's view reflects; the watch starts
	// after it.
	rev   int64
	hooks *hooks
}

// Run watches until ctx ends.
func (w *watcher) Run(ctx context.Context) {
	backoff := clock.Backoff{Min: 100 * time.Millisecond, Max: 2 * time.Second}
	for ctx.Err() == nil {
		if w.hooks.watchOpening != nil {
			w.hooks.watchOpening(ctx)
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		ch := w.client.Watch(wctx, w.prefix, clientv3.WithPrefix(), clientv3.WithRev(w.rev+1))
		for resp := range ch {
			if err := resp.Err(); err != nil || resp.CompactRevision != 0 {
				if ctx.Err() == nil {
					w.log.Debug("watch interrupted; re-reading cluster state", "error", err, "compacted", resp.CompactRevision)
				}
				break
			}
			if len(resp.Events) == 0 {
				// A progress notification: its revision says nothing of
				// events still on their way to a watch that is behind.
				continue
			}
			// Complete up to the last event received, never up to the
			// header: a watch that fell behind gets its backlog in
			// batches of up to 1,000 revisions, each with the store's
			// current revision in its header (etcd's syncWatchers), while
			// the next batch may still change the group's keys. Every
			// event of a revision comes in one batch.
			w.rev = resp.Events[len(resp.Events)-1].Kv.ModRevision
			if !w.send(ctx, watchUpdate{events: resp.Events, rev: w.rev}) {
				cancel()
				return
			}
			backoff.Reset()
		}
		cancel()
		for ctx.Err() == nil {
			gctx, gcancel := context.WithTimeout(ctx, 5*time.Second)
			snap, err := w.client.Get(gctx, w.prefix, clientv3.WithPrefix())
			gcancel()
			if err == nil {
				w.rev = snap.Header.Revision
				if !w.send(ctx, watchUpdate{snapshot: snap.Kvs, snapshotRev: w.rev, rev: w.rev}) {
					return
				}
				break
			}
			if !clock.Sleep(w.clock, backoff.Next(), ctx.Done()) {
				return
			}
		}
	}
}

func (w *watcher) send(ctx context.Context, u watchUpdate) bool {
	if w.hooks.delivering != nil {
		w.hooks.delivering(ctx, u)
	}
	select {
	case w.out <- u:
		return true
	case <-ctx.Done():
		return false
	}
}
