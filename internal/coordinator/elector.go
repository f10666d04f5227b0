package coordinator

import (
	"cmp"
	"context"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/store"
)

// elector is the election loop: it campaigns under a fresh etcd session
// for each leadership term, raises the coordinator fence to the term's
// epoch, and runs the leader's work (lead) until the term ends — the
// session is lost, the leader key disappears, the fence moves to a newer
// leader, or ctx ends — then resigns and campaigns again.
type elector struct {
	client     *clientv3.Client
	key        string // the election prefix, <cluster>/coordinator/leader
	id         string
	ttl        time.Duration
	store      *store.Store
	clock      clock.Clock
	log        hclog.Logger
	leadership *testsignal.Signal[Leadership]
	isLeader   prometheus.Gauge
	// lead is the leader's work for one term, under the term's epoch.
	lead func(ctx context.Context, epoch int64) error

	leader  atomic.Bool
	session atomic.Pointer[concurrency.Session]
}

// Run campaigns until ctx ends.
func (e *elector) Run(ctx context.Context) {
	backoff := clock.Backoff{Min: 200 * time.Millisecond, Max: 5 * time.Second}
	for ctx.Err() == nil {
		sess, err := concurrency.NewSession(e.client, concurrency.WithTTL(int(e.ttl/time.Second)), concurrency.WithContext(ctx))
		if err != nil {
			if ctx.Err() == nil {
				wait := backoff.Next()
				e.log.Warn("creating an election session failed", "error", err, "backoff", wait)
				clock.Sleep(e.clock, wait, ctx.Done())
			}
			continue
		}
		backoff.Reset()
		e.session.Store(sess)
		e.term(ctx, sess)
		e.session.Store(nil)
		// Close revokes the lease, so a failed or abandoned campaign leaves
		// no key behind (etcd #21128).
		_ = sess.Close()
	}
}

// term campaigns under sess and, once elected, leads until the session or
// the leader key is lost or ctx ends; then it resigns.
func (e *elector) term(ctx context.Context, sess *concurrency.Session) {
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-sess.Done():
			cancel()
		case <-tctx.Done():
		}
	}()
	el := concurrency.NewElection(sess, e.key)
	if err := el.Campaign(tctx, e.id); err != nil {
		if tctx.Err() == nil {
			e.log.Warn("campaign failed", "error", err)
		}
		return
	}
	// Step down the moment the leader key goes (revoked or deleted), even
	// before the session notices.
	go func() {
		wch := e.client.Watch(tctx, el.Key(), clientv3.WithRev(el.Rev()+1))
		for resp := range wch {
			for _, ev := range resp.Events {
				if ev.Type == clientv3.EventTypeDelete {
					cancel()
					return
				}
			}
		}
	}()
	e.leadTerm(tctx, el.Rev())
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	if err := el.Resign(rctx); err != nil && ctx.Err() == nil {
		e.log.Debug("resigning failed", "error", err)
	}
	rcancel()
}

// leadTerm raises the coordinator fence to epoch and runs the leader's work
// until ctx ends or the fence moves to a newer leader.
func (e *elector) leadTerm(ctx context.Context, epoch int64) {
	fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	ok, err := e.store.RaiseLeaderFence(fctx, e.id, epoch)
	cancel()
	if err != nil || !ok {
		e.log.Warn("could not raise the coordinator fence; not leading", "epoch", epoch, "error", err, "newer_leader", !ok)
		return
	}
	e.leader.Store(true)
	e.isLeader.Set(1)
	e.log.Info("became leader", "epoch", epoch)
	e.leadership.Emit(Leadership{ID: e.id, Leader: true, Epoch: epoch, At: e.clock.Now()})
	err = e.lead(ctx, epoch)
	e.leader.Store(false)
	e.isLeader.Set(0)
	e.leadership.Emit(Leadership{ID: e.id, Leader: false, Epoch: epoch, At: e.clock.Now()})
	e.log.Info("stopped leading", "epoch", epoch, "reason", cmp.Or(errString(err), errString(context.Cause(ctx)), "shutdown"))
}
