package detach

import (
	"fmt"
	"time"
)

// LeaseClock is the lease-deadline model. etcd expires a lease no earlier
// than TTL after the server *received* its last keep-alive, and that receipt
// is no earlier than when the request was *sent*. So with
//
//	deadline = send time of the newest successful keep-alive + granted TTL
//
// (on the monotonic clock) the lease cannot expire before deadline, and a
// runner that stops work by deadline - margin has stopped before its owner
// key (owners/<group>/<runner>, under the lease) goes away, so before any
// other runner can take one of its shards. The margin absorbs the local
// clock running slower than the server's and the time it takes to cancel
// work. Computing the deadline from the response's receipt time instead
// would be unsafe: a response delayed in the network would push the deadline
// past the server's real expiry.
//
// LeaseClock also keeps the failure-streak rule, counted in time rather
// than in calls so that it means the same however often keep-alives are
// retried: the streak is the number of whole keep-alive periods (TTL/3, the
// brief's cadence) since the newest successful keep-alive was sent, and
// reaching the threshold detaches. With the default margin (TTL/3) and
// threshold (2) both rules fall on the same moment; a smaller margin lets
// the streak rule detach first.
//
// LeaseClock is not safe for concurrent use; one keep-alive loop owns it.
type LeaseClock struct {
	margin    time.Duration
	threshold int
	period    time.Duration

	deadline time.Time
	lastSent time.Time
}

// NewLeaseClock starts the model for a lease granted by a request sent at
// sentAt with the granted TTL. threshold is the failure streak, in
// keep-alive periods of TTL/3 without a success, that detaches (at least 1).
func NewLeaseClock(sentAt time.Time, ttl, margin time.Duration, threshold int) *LeaseClock {
	return &LeaseClock{margin: margin, threshold: max(threshold, 1), period: ttl / 3,
		deadline: sentAt.Add(ttl), lastSent: sentAt}
}

// Succeeded records a keep-alive sent at sentAt that the server answered with
// the lease's TTL. A zero or negative TTL means the lease is gone: the caller
// must treat that as LeaseExpired, not call Succeeded.
func (l *LeaseClock) Succeeded(sentAt time.Time, ttl time.Duration) {
	if d := sentAt.Add(ttl); d.After(l.deadline) {
		l.deadline = d
	}
	if sentAt.After(l.lastSent) {
		l.lastSent = sentAt
	}
}

// Deadline is the earliest time the server may expire the lease.
func (l *LeaseClock) Deadline() time.Time { return l.deadline }

// DetachAt is the latest time the runner may keep working: deadline - margin,
// or earlier when the failure streak reaches its threshold first.
func (l *LeaseClock) DetachAt() time.Time {
	at := l.deadline.Add(-l.margin)
	if streak := l.lastSent.Add(time.Duration(l.threshold) * l.period); streak.Before(at) {
		return streak
	}
	return at
}

// TimeLeft is how long until the deadline (negative once past).
func (l *LeaseClock) TimeLeft(now time.Time) time.Duration { return l.deadline.Sub(now) }

// Streak is the number of whole keep-alive periods since the newest
// successful keep-alive was sent.
func (l *LeaseClock) Streak(now time.Time) int {
	if l.period <= 0 || now.Before(l.lastSent) {
		return 0
	}
	return int(now.Sub(l.lastSent) / l.period)
}

// Check says whether the runner must be detached at now, and why: the
// deadline rule wins over the failure streak because it is the one that
// guarantees safety.
func (l *LeaseClock) Check(now time.Time) (Reason, bool) {
	if !now.Before(l.deadline.Add(-l.margin)) {
		return Reason{Kind: LeaseExpired, Detail: fmt.Sprintf("no keep-alive succeeded within %s of the lease deadline", l.margin)}, true
	}
	if streak := l.Streak(now); streak >= l.threshold {
		return Reason{Kind: KeepaliveFailure, Streak: streak}, true
	}
	return Reason{}, false
}
