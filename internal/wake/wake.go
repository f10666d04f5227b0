// Package wake is the one way a loop is woken without blocking the waker:
// a channel with room for one pending wake-up, so that any number of
// notifications before the loop looks coalesce into one.
package wake

// Signal is a coalescing wake-up. The zero value is not usable; use New.
type Signal chan struct{}

// New returns a signal with no wake-up pending.
func New() Signal { return make(Signal, 1) }

// Notify records a wake-up; it never blocks.
func (s Signal) Notify() {
	select {
	case s <- struct{}{}:
	default:
	}
}

// C is received from by the loop that waits.
func (s Signal) C() <-chan struct{} { return s }
