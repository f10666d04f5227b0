package leadership

import (
	"cmp"
	"context"
	"errors"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/store"
)

// The election: the leader campaigns under a fresh etcd session for each
// leadership term, raises the coordinator fence to the term's epoch, and
// runs the leader's services until the term ends — the session is lost,
// the leader key disappears, the fence moves to a newer leader, or ctx
// ends — then resigns and campaigns again.

// campaign runs terms until ctx ends.
func (l *Leader) campaign(ctx context.Context) {
	backoff := clock.Backoff{Min: 200 * time.Millisecond, Max: 5 * time.Second}
	for ctx.Err() == nil {
		sess, err := concurrency.NewSession(l.etcd, concurrency.WithTTL(int(l.cfg.ElectionTTL/time.Second)), concurrency.WithContext(ctx))
		if err != nil {
			if ctx.Err() == nil {
				wait := backoff.Next()
				l.cfg.Logger.Warn("creating an election session failed", "error", err, "backoff", wait)
				clock.Sleep(l.cfg.Clock, wait, ctx.Done())
			}
			continue
		}
		backoff.Reset()
		l.session.Store(sess)
		l.term(ctx, sess)
		l.session.Store(nil)
		// Close revokes the lease, so a failed or abandoned campaign leaves
		// no key behind (etcd #21128).
		_ = sess.Close()
	}
}

// term campaigns under sess and, once elected, leads until the session or
// the leader key is lost or ctx ends; then it resigns. It returns once
// the goroutines it started have ended.
func (l *Leader) term(ctx context.Context, sess *concurrency.Session) {
	tctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() {
		select {
		case <-sess.Done():
			cancel()
		case <-tctx.Done():
		}
	})
	el := concurrency.NewElection(sess, l.cfg.Prefix+Key)
	if err := el.Campaign(tctx, l.cfg.ID); err != nil {
		if tctx.Err() == nil {
			l.cfg.Logger.Warn("campaign failed", "error", err)
		}
		return
	}
	// Step down the moment the leader key goes (revoked or deleted), even
	// before the session notices.
	wg.Go(func() {
		wch := l.etcd.Watch(tctx, el.Key(), clientv3.WithRev(el.Rev()+1))
		for resp := range wch {
			for _, ev := range resp.Events {
				if ev.Type == clientv3.EventTypeDelete {
					cancel()
				}
			}
		}
	})
	l.lead(tctx, el.Rev(), el.Key())
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	if err := el.Resign(rctx); err != nil && ctx.Err() == nil {
		l.cfg.Logger.Debug("resigning failed", "error", err)
	}
	rcancel()
}

// lead raises the coordinator fence to epoch in every database and runs
// each database's services once its fence is raised, and the move driver
// (several databases) under the leader key key, until ctx ends or a
// fence holds a newer leader. A database that does not answer holds up
// only its own services: its fence is raised again and again, with a
// backoff, until it answers or the term ends. The term counts as begun
// (IsLeader, Terms) at the first fence raised.
func (l *Leader) lead(ctx context.Context, epoch int64, key string) {
	log := l.cfg.Logger
	tctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var begin sync.Once
	began := false
	start := func() {
		begin.Do(func() {
			began = true
			l.leader.Store(true)
			l.isLeader.Set(1)
			log.Info("became leader", "epoch", epoch)
			l.Terms.Emit(Event{ID: l.cfg.ID, Leader: true, Epoch: epoch, At: l.cfg.Clock.Now()})
		})
	}
	var wg sync.WaitGroup
	for _, db := range l.databases {
		wg.Go(func() {
			if !l.raise(tctx, db, epoch) {
				cancel(store.ErrNotLeader)
				return
			}
			if tctx.Err() != nil {
				return
			}
			db.raised.Store(epoch)
			start()
			if err := db.loop.Run(tctx, epoch); err != nil {
				cancel(err)
			}
		})
	}
	if len(l.databases) > 1 {
		mv := &mover{l: l, epoch: epoch, leaderKey: key}
		wg.Go(func() { mv.Run(tctx) })
	}
	wg.Wait()
	err := context.Cause(tctx)
	if errors.Is(err, context.Canceled) {
		err = nil // the term ended from outside (ctx): its cause is said below
	}
	if !began {
		log.Warn("could not raise the coordinator fence; not leading", "epoch", epoch, "error", err)
		return
	}
	l.leader.Store(false)
	l.isLeader.Set(0)
	l.Terms.Emit(Event{ID: l.cfg.ID, Leader: false, Epoch: epoch, At: l.cfg.Clock.Now()})
	log.Info("stopped leading", "epoch", epoch, "reason", cmp.Or(errString(err), errString(context.Cause(ctx)), "shutdown"))
}

// raise raises db's coordinator fence to epoch, again after a backoff
// while the database does not answer, until it is raised (true), it
// holds a newer leader (false) or ctx ends (true: nothing more to do).
func (l *Leader) raise(ctx context.Context, db *database, epoch int64) bool {
	backoff := clock.Backoff{Min: 200 * time.Millisecond, Max: 5 * time.Second}
	warned := false
	for {
		fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		ok, err := db.store.RaiseLeaderFence(fctx, l.cfg.ID, epoch)
		cancel()
		switch {
		case ctx.Err() != nil:
			return true
		case err == nil && !ok:
			db.log.Warn("the coordinator fence holds a newer leader; not leading", "epoch", epoch)
			return false
		case err == nil:
			if warned {
				db.log.Info("raised the coordinator fence: the database's services start", "epoch", epoch)
			}
			return true
		}
		if !warned {
			db.log.Warn("could not raise the coordinator fence: this database's services wait for it, the others' run", "epoch", epoch, "error", err)
			warned = true
		}
		if !clock.Sleep(l.cfg.Clock, backoff.Next(), ctx.Done()) {
			return true
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
