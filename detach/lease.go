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
// runner that stops work by deadline - margin has stopped before any other
// runner can create one of its shard keys. The margin absorbs the local
// clock running slower than the server's and the time it takes to cancel
// work. Computing the deadline from the response's receipt time instead
// would be unsafe: a response delayed in the network would push the deadline
// past the server's real expiry.
//
// LeaseClock is not safe for concurrent use; one keep-alive loop owns it.
type LeaseClock struct {
	margin    time.Duration
	threshold int

	deadline time.Time
	streak   int
}

// NewLeaseClock starts the model for a lease granted by a request sent at
// sentAt with the granted TTL. threshold is the keep-alive failure streak
// that detaches (at least 1).
func NewLeaseClock(sentAt time.Time, ttl, margin time.Duration, threshold int) *LeaseClock {
	return &LeaseClock{margin: margin, threshold: max(threshold, 1), deadline: sentAt.Add(ttl)}
}

// Succeeded records a keep-alive sent at sentAt that the server answered with
// the lease's TTL. A zero or negative TTL means the lease is gone: the caller
// must treat that as LeaseExpired, not call Succeeded.
func (l *LeaseClock) Succeeded(sentAt time.Time, ttl time.Duration) {
	if d := sentAt.Add(ttl); d.After(l.deadline) {
		l.deadline = d
	}
	l.streak = 0
}

// Failed records a keep-alive that got no answer, and returns the streak.
func (l *LeaseClock) Failed() int {
	l.streak++
	return l.streak
}

// Deadline is the earliest time the server may expire the lease.
func (l *LeaseClock) Deadline() time.Time { return l.deadline }

// DetachAt is the latest time the runner may keep working: deadline - margin.
func (l *LeaseClock) DetachAt() time.Time { return l.deadline.Add(-l.margin) }

// TimeLeft is how long until the deadline (negative once past).
func (l *LeaseClock) TimeLeft(now time.Time) time.Duration { return l.deadline.Sub(now) }

// Streak is the current run of consecutive failures.
func (l *LeaseClock) Streak() int { return l.streak }

// Check says whether the runner must be detached at now, and why: the
// deadline rule wins over the failure streak because it is the one that
// guarantees safety.
func (l *LeaseClock) Check(now time.Time) (Reason, bool) {
	if !now.Before(l.DetachAt()) {
		return Reason{Kind: LeaseExpired, Detail: fmt.Sprintf("no keep-alive succeeded within %s of the lease deadline", l.margin)}, true
	}
	if l.streak >= l.threshold {
		return Reason{Kind: KeepaliveFailure, Streak: l.streak}, true
	}
	return Reason{}, false
}
