package shard

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/clock"
)

// keeper owns the runner's lease: its id, its generation (a new lease after
// the old one expired is a new generation) and its lease clock. It does not
// use clientv3's KeepAlive, which hides when each request was sent and
// computes its deadline from receipt: it sends one KeepAliveOnce every
// interval, each with a deadline no later than the moment the runner must
// detach, records the send time, and feeds the lease clock and the detach
// machine.
type keeper struct {
	client   *clientv3.Client
	cfg      Config
	machine  *detach.Machine
	clock    clock.Clock
	log      hclog.Logger
	metrics  *Metrics
	newLease func() // tells the manager a new lease was granted

	mu  sync.Mutex
	id  clientv3.LeaseID
	gen int
	lc  *detach.LeaseClock
}

// grant obtains a lease; the runner may work under it until its lease
// clock says otherwise.
func (k *keeper) grant(ctx context.Context, timeout time.Duration) error {
	sent := k.clock.Now()
	gctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), timeout)
	resp, err := k.client.Grant(gctx, int64(k.cfg.LeaseTTL/time.Second))
	cancel()
	if err != nil {
		return fmt.Errorf("granting the runner lease on etcd %v: %w", k.client.Endpoints(), err)
	}
	ttl := time.Duration(resp.TTL) * time.Second
	k.mu.Lock()
	k.id, k.gen = resp.ID, k.gen+1
	k.lc = detach.NewLeaseClock(sent, ttl, k.cfg.DetachMargin, k.cfg.FailureThreshold)
	k.mu.Unlock()
	if k.newLease != nil {
		k.newLease()
	}
	return nil
}

// lease returns the current lease and its generation.
func (k *keeper) lease() (clientv3.LeaseID, int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.id, k.gen
}

// deadline is the earliest time etcd may expire the lease, and detachAt
// the latest time the runner may keep working under it.
func (k *keeper) deadline() (deadline, detachAt time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.lc.Deadline(), k.lc.DetachAt()
}

// trusted reports whether work may start at now: before the lease clock's
// detach point. The keep-alive loop detaches at that point too, but a
// process that was paused past it would otherwise start work in the moment
// between waking up and the loop noticing.
func (k *keeper) trusted(now time.Time) bool {
	_, at := k.deadline()
	return now.Before(at)
}

// trustedGen is trusted with the lease's generation, under one lock: the
// hot path of Workable.
func (k *keeper) trustedGen(now time.Time) (gen int, ok bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.gen, k.lc != nil && now.Before(k.lc.DetachAt())
}

// Keep-alive retry bounds. A keep-alive that fails or stalls — an etcd
// leader election makes requests fail with "no leader" or hang until a new
// leader is chosen — is retried at once, against whichever endpoint the
// client balances to, with a deadline of half the time left before the
// detach point: an attempt that stalls still leaves room for the next. So a
// runner rides out an election shorter than its lease's slack
// (TTL − margin − the time since the last success) instead of detaching.
const (
	attemptMinTimeout = 100 * time.Millisecond
	retryMinPause     = 20 * time.Millisecond
	retryMaxPause     = 100 * time.Millisecond
)

// Run keeps the lease alive until ctx ends: one round per interval, each
// round retrying until a keep-alive succeeds, the next round is due, or the
// lease clock says to detach.
func (k *keeper) Run(ctx context.Context) {
	interval := k.cfg.KeepAliveInterval
	next := k.clock.Now().Add(interval)
	timer := k.clock.NewTimer(0)
	defer timer.Stop()
	for {
		now := k.clock.Now()
		wake := next
		if _, at := k.deadline(); !k.machine.IsDetached() && at.Before(wake) {
			wake = at
		}
		timer.Reset(wake.Sub(now))
		select {
		case <-ctx.Done():
			return
		case <-timer.C():
		}
		// Check before sending: a process woken from a pause past its
		// detach point stops its work before anything else, whatever the
		// keep-alive it is about to send will say.
		now = k.clock.Now()
		k.check(now)
		if now.Before(next) {
			continue
		}
		next = now.Add(interval)
		switch k.round(ctx, next) {
		case roundStopped:
			return
		case roundLeaseGone:
			if !k.regrant(ctx) {
				return
			}
			next = k.clock.Now().Add(interval)
			continue
		case roundFailed:
			k.machine.Unhealthy()
		}
		k.check(k.clock.Now())
	}
}

type roundResult int

const (
	roundOK roundResult = iota
	roundFailed
	roundLeaseGone
	roundStopped
)

// round sends keep-alives until one succeeds or the next round is due,
// checking the detach point between attempts.
func (k *keeper) round(ctx context.Context, until time.Time) roundResult {
	pause := clock.Backoff{Min: retryMinPause, Max: retryMaxPause}
	for attempt := 0; ; attempt++ {
		sent := k.clock.Now()
		timeout := until.Sub(sent)
		if _, at := k.deadline(); at.After(sent) {
			timeout = min(timeout, max(at.Sub(sent)/2, attemptMinTimeout))
		}
		lease, _ := k.lease()
		cctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), max(timeout, attemptMinTimeout))
		resp, err := k.client.KeepAliveOnce(cctx, lease)
		cancel()
		if ctx.Err() != nil {
			return roundStopped
		}
		switch {
		case err == nil && resp.TTL > 0:
			k.mu.Lock()
			k.lc.Succeeded(sent, time.Duration(resp.TTL)*time.Second)
			k.mu.Unlock()
			k.metrics.KeepaliveStreak.Set(0)
			if attempt > 0 {
				k.log.Info("lease keep-alive succeeded after retries", "lease", fmt.Sprintf("%x", int64(lease)), "retries", attempt)
			}
			k.machine.Healthy()
			return roundOK
		case errors.Is(err, rpctypes.ErrLeaseNotFound) || (err == nil && resp.TTL <= 0):
			k.machine.Detach(detach.Reason{Kind: detach.LeaseExpired, Detail: fmt.Sprintf("etcd no longer has lease %x", int64(lease))})
			return roundLeaseGone
		}
		k.metrics.KeepaliveFailures.Inc()
		k.log.Warn("lease keep-alive failed; retrying", "lease", fmt.Sprintf("%x", int64(lease)), "attempt", attempt+1, "error", err)
		now := k.clock.Now()
		k.check(now)
		wait := pause.Next()
		if !now.Add(wait).Before(until) {
			return roundFailed
		}
		if !clock.Sleep(k.clock, wait, ctx.Done()) {
			return roundStopped
		}
	}
}

// check detaches when the lease clock says so.
func (k *keeper) check(now time.Time) {
	k.mu.Lock()
	left := k.lc.TimeLeft(now)
	k.metrics.KeepaliveStreak.Set(float64(k.lc.Streak(now)))
	r, detach := k.lc.Check(now)
	deadline := k.lc.Deadline()
	k.mu.Unlock()
	k.metrics.LeaseDeadline.Set(left.Seconds())
	if !detach {
		return
	}
	if !k.machine.IsDetached() {
		k.log.Warn("cannot prove the lease: detaching", "reason", r.String(),
			"lease_deadline", deadline.UTC().Format(time.RFC3339Nano), "time_left", left)
	}
	k.machine.Detach(r)
}

// regrant obtains a new lease after the old one expired, retrying with
// backoff until ctx ends. The runner stays detached meanwhile; the manager
// re-registers under the new lease and the recovery window applies.
func (k *keeper) regrant(ctx context.Context) bool {
	backoff := clock.Backoff{Min: 200 * time.Millisecond, Max: 5 * time.Second}
	for {
		err := k.grant(ctx, k.cfg.KeepAliveInterval)
		if ctx.Err() != nil {
			return false
		}
		if err == nil {
			id, _ := k.lease()
			k.log.Info("granted a new lease after the old one expired", "lease", fmt.Sprintf("%x", int64(id)), "ttl", k.cfg.LeaseTTL)
			k.machine.Healthy()
			return true
		}
		wait := backoff.Next()
		k.log.Warn("granting a new lease failed", "error", err, "backoff", wait)
		if !clock.Sleep(k.clock, wait, ctx.Done()) {
			return false
		}
	}
}
