// Package testsignal carries events from a component to its tests, in the
// manner of River's test signals: in production a component's signal is nil
// and emitting costs a nil check; a test creates one, hands it to every
// component whose events it wants on one timeline (several runners' shard
// events, say), reads them in arrival order and waits on them instead of
// sleeping.
package testsignal

import (
	"slices"
	"sync"
	"time"
)

// Signal is an append-only log of events of type T. A nil *Signal accepts
// and drops every event.
type Signal[T any] struct {
	mu      sync.Mutex
	events  []T
	changed chan struct{} // closed and replaced by every Emit
}

// New returns an empty signal.
func New[T any]() *Signal[T] { return &Signal[T]{changed: make(chan struct{})} }

// Emit records v; it never blocks. On a nil signal it does nothing.
func (s *Signal[T]) Emit(v T) {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.events = append(s.events, v)
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
}

// Events returns a copy of the events so far, in arrival order.
func (s *Signal[T]) Events() []T {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.events)
}

// Wait returns the first event, from the start of the log, for which match
// holds, waiting up to timeout for it to arrive; ok is false on timeout.
func (s *Signal[T]) Wait(timeout time.Duration, match func(T) bool) (v T, ok bool) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	seen := 0
	for {
		s.mu.Lock()
		for ; seen < len(s.events); seen++ {
			if match(s.events[seen]) {
				v := s.events[seen]
				s.mu.Unlock()
				return v, true
			}
		}
		changed := s.changed
		s.mu.Unlock()
		select {
		case <-changed:
		case <-deadline.C:
			return v, false
		}
	}
}
