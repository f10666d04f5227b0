// Package clock abstracts time so that every rule that depends on it (lease
// deadlines, recovery windows, grace periods, backoff) can be tested with a
// fake clock instead of sleeps.
package clock

import (
	"math/rand/v2"
	"time"
)

// Clock is the subset of the time package the rest of the code uses.
// Implementations must return monotonic readings from Now: durations are
// always computed as differences of two Now values, never from wall time.
type Clock interface {
	Now() time.Time
	// NewTimer returns a timer that fires once after d.
	NewTimer(d time.Duration) Timer
}

// Timer is a one-shot timer created by a Clock.
type Timer interface {
	// C delivers the fire time once.
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it was active.
	Stop() bool
	// Reset re-arms the timer to fire after d.
	Reset(d time.Duration)
}

// Real returns the process clock.
func Real() Clock { return realClock{} }

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) NewTimer(d time.Duration) Timer { return &realTimer{t: time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (r *realTimer) C() <-chan time.Time   { return r.t.C }
func (r *realTimer) Stop() bool            { return r.t.Stop() }
func (r *realTimer) Reset(d time.Duration) { r.t.Reset(d) }

// Sleep waits for d on c or until done is closed; it reports whether the full
// duration passed.
func Sleep(c Clock, d time.Duration, done <-chan struct{}) bool {
	t := c.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C():
		return true
	case <-done:
		return false
	}
}

// Backoff is the delay between retries of one loop: it doubles from Min up
// to Max and every delay is scaled by a uniform factor in [0.5, 1) ("equal
// jitter"), so that many processes retrying the same failure (a database
// restart, an etcd election) spread out instead of arriving together. The
// zero value is not usable; Reset after a success.
type Backoff struct {
	Min, Max time.Duration
	cur      time.Duration
}

// Next returns the delay before the next retry.
func (b *Backoff) Next() time.Duration {
	b.cur = min(max(2*b.cur, b.Min), b.Max)
	return time.Duration(float64(b.cur) * (0.5 + rand.Float64()/2))
}

// Reset starts the next failure's delays from Min again.
func (b *Backoff) Reset() { b.cur = 0 }

// Pause sleeps a uniform [d/2, d) on c, so that loops pausing between
// batches do not march in step; it reports false when done closed first.
func Pause(c Clock, d time.Duration, done <-chan struct{}) bool {
	if d <= 0 {
		select {
		case <-done:
			return false
		default:
			return true
		}
	}
	return Sleep(c, d/2+time.Duration(rand.Int64N(int64(d/2)+1)), done)
}
