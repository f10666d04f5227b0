package shard

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
)

// keeper is the lease keep-alive loop. It does not use clientv3's KeepAlive,
// which hides when each request was sent and computes its deadline from
// receipt: it sends one KeepAliveOnce every interval, each with a deadline
// no later than the moment the runner must detach, records the send time,
// and feeds the lease clock and the detach machine.
type keeper struct {
	m  *Manager
	lc *detach.LeaseClock
}

// run keeps the lease alive until ctx ends.
func (k *keeper) run(ctx context.Context) {
	m := k.m
	interval := m.cfg.KeepAliveInterval
	next := m.clock.Now().Add(interval)
	timer := m.clock.NewTimer(0)
	defer timer.Stop()
	for {
		now := m.clock.Now()
		wake := next
		if at := k.lc.DetachAt(); !m.machine.IsDetached() && at.Before(wake) {
			wake = at
		}
		timer.Reset(wake.Sub(now))
		select {
		case <-ctx.Done():
			return
		case <-timer.C():
		}
		if now := m.clock.Now(); now.Before(next) {
			k.check(now)
			continue
		}
		sent := m.clock.Now()
		next = sent.Add(interval)
		timeout := interval
		if until := k.lc.DetachAt().Sub(sent); until > 0 && until < timeout {
			timeout = until
		}
		lease := m.leaseID()
		cctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), timeout)
		resp, err := m.client.KeepAliveOnce(cctx, lease)
		cancel()
		if ctx.Err() != nil {
			return
		}
		switch {
		case err == nil && resp.TTL > 0:
			k.lc.Succeeded(sent, time.Duration(resp.TTL)*time.Second)
			m.metrics.KeepaliveStreak.Set(0)
			m.setLeaseClock(k.lc)
			m.machine.Healthy()
		case errors.Is(err, rpctypes.ErrLeaseNotFound) || (err == nil && resp.TTL <= 0):
			m.machine.Detach(detach.Reason{Kind: detach.LeaseExpired, Detail: fmt.Sprintf("etcd no longer has lease %x", int64(lease))})
			if !k.regrant(ctx) {
				return
			}
			next = m.clock.Now().Add(interval)
			continue
		default:
			streak := k.lc.Failed()
			m.metrics.KeepaliveFailures.Inc()
			m.metrics.KeepaliveStreak.Set(float64(streak))
			m.machine.Unhealthy()
			m.log.Warn("lease keep-alive failed", "lease", fmt.Sprintf("%x", int64(lease)), "streak", streak, "error", err)
		}
		k.check(m.clock.Now())
	}
}

// check detaches when the lease clock says so.
func (k *keeper) check(now time.Time) {
	k.m.metrics.LeaseDeadline.Set(k.lc.TimeLeft(now).Seconds())
	if r, detach := k.lc.Check(now); detach {
		if !k.m.machine.IsDetached() {
			k.m.log.Warn("cannot prove the lease: detaching", "reason", r.String(),
				"lease_deadline", k.lc.Deadline().UTC().Format(time.RFC3339Nano), "time_left", k.lc.TimeLeft(now))
		}
		k.m.machine.Detach(r)
	}
}

// regrant obtains a new lease after the old one expired, retrying with
// backoff until ctx ends. The runner stays detached meanwhile; the manager
// re-registers under the new lease and the recovery window applies.
func (k *keeper) regrant(ctx context.Context) bool {
	m := k.m
	backoff := 200 * time.Millisecond
	for {
		sent := m.clock.Now()
		cctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), m.cfg.KeepAliveInterval)
		resp, err := m.client.Grant(cctx, int64(m.cfg.LeaseTTL/time.Second))
		cancel()
		if ctx.Err() != nil {
			return false
		}
		if err == nil {
			ttl := time.Duration(resp.TTL) * time.Second
			k.lc = detach.NewLeaseClock(sent, ttl, m.cfg.DetachMargin, m.cfg.FailureThreshold)
			m.newLease(resp.ID, k.lc)
			m.log.Info("granted a new lease after the old one expired", "lease", fmt.Sprintf("%x", int64(resp.ID)), "ttl", ttl)
			m.machine.Healthy()
			return true
		}
		m.log.Warn("granting a new lease failed", "error", err, "backoff", backoff)
		t := m.clock.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C():
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}
