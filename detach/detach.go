// Package detach is the runner's detachment state machine. A runner that can
// no longer prove it owns its lease detaches: it stops all shard work at once,
// before any other runner can take its shards, and re-attaches only after a
// recovery window of continuous health.
//
// States and moves (all through transition, under one lock):
//
//	attached --Detach(reason)-->                 detached(reason, since)
//	detached --Detach(reason)-->                 detached(new reason, same since), recovery window reset
//	detached --Healthy, first after detach-->    detached, recovery window starts
//	detached --Unhealthy-->                      detached, recovery window reset
//	detached --Healthy, window passed-->         attached
//	detached(manual) --Healthy-->                unchanged: manual is sticky
//	detached(manual) --Attach-->                 detached, not sticky, window starts
//	                                             (attached at once when the window is 0)
//
// IsDetached is the hot path: one atomic load. Subscribers are told of every
// transition synchronously, in order, before Detach returns, so the runner
// cancels every shard's work before it does anything else.
//
// It is one of the cluster's protocol packages (shard, detach, sweeper,
// store): importable, so that the runner and coordinator libraries and
// tools can be built on it, but not the library API and under no
// compatibility promise to library users, as etcd's server packages are
// importable but are not its client API. Programs use package shardrun
// and package tasks.
package detach

import (
	"cmp"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/clock"
)

// Kind is why the runner detached.
type Kind int

// The detach reasons. The brief's storage_error is not one: a failed etcd
// call to acquire, release or publish is retried, and the lease clock
// decides when to detach (docs/architecture.md).
const (
	// KeepaliveFailure: no keep-alive succeeded for the threshold's number
	// of keep-alive periods (TTL/3 each).
	KeepaliveFailure Kind = iota + 1
	// LeaseExpired: the lease deadline (minus the margin) passed without a
	// newer successful keep-alive, or etcd says the lease is gone.
	LeaseExpired
	// Manual: an operator asked for it. Sticky until Attach.
	Manual
)

func (k Kind) String() string {
	switch k {
	case KeepaliveFailure:
		return "keepalive_failure"
	case LeaseExpired:
		return "lease_expired"
	case Manual:
		return "manual"
	}
	return ""
}

// Reason is a Kind with its details.
type Reason struct {
	Kind Kind
	// Streak is the number of keep-alive periods (TTL/3) without a
	// successful keep-alive, for KeepaliveFailure.
	Streak int
	// Detail is free text: the lease's failure, or the operator's reason.
	Detail string
}

func (r Reason) String() string {
	switch r.Kind {
	case KeepaliveFailure:
		return fmt.Sprintf("keep-alive failure streak: no keep-alive succeeded for %d keep-alive periods (TTL/3 each)", r.Streak)
	case LeaseExpired:
		if r.Detail != "" {
			return "lease expired: " + r.Detail
		}
		return "lease expired"
	case Manual:
		if r.Detail != "" {
			return "manual detachment: " + r.Detail
		}
		return "manual detachment"
	}
	return ""
}

// Event is one transition, as told to subscribers.
type Event struct {
	Detached bool
	Reason   Reason // why it detached; on re-attach, the reason it had
	At       time.Time
}

// Status is a snapshot for /status.
type Status struct {
	Detached bool
	Reason   Reason
	Since    time.Time
	// HealthySince is when the current recovery window started (zero when
	// none is running).
	HealthySince time.Time
	// Sticky is set while a manual detachment waits for Attach.
	Sticky bool
}

// Config configures a Machine.
type Config struct {
	// RecoveryWindow is how long health must hold before re-attaching
	// (DefaultRecoveryWindow in the runner). Zero re-attaches on the second
	// healthy signal.
	RecoveryWindow time.Duration
	// Clock defaults to the real clock.
	Clock clock.Clock
	// Logger defaults to a null logger.
	Logger hclog.Logger
}

// DefaultRecoveryWindow is the default Config.RecoveryWindow.
const DefaultRecoveryWindow = 3 * time.Second

// MaxRecoveryWindow bounds the recovery window: a runner stays detached at
// least this long after its health returns.
const MaxRecoveryWindow = time.Hour

// Validate reports a bad setting naming its flag. Zero is a valid window.
func (c Config) Validate() error {
	if c.RecoveryWindow < 0 || c.RecoveryWindow > MaxRecoveryWindow {
		return fmt.Errorf("--recovery-window: must be 0 to %s (a runner stays detached this long after its health returns), got %s", MaxRecoveryWindow, c.RecoveryWindow)
	}
	return nil
}

// Machine is the detachment state. Safe for concurrent use.
type Machine struct {
	detached atomic.Bool
	window   time.Duration
	clock    clock.Clock
	log      hclog.Logger

	// transitions serialises transitions with their notifications, so that
	// subscribers see them in order.
	transitions sync.Mutex

	mu           sync.Mutex // guards the fields below
	reason       Reason
	since        time.Time
	healthySince time.Time
	sticky       bool
	subs         []func(Event)
}

// New returns an attached machine.
func New(cfg Config) *Machine {
	cfg.Clock = cmp.Or(cfg.Clock, clock.Real())
	cfg.Logger = cmp.Or(cfg.Logger, hclog.NewNullLogger())
	return &Machine{window: cfg.RecoveryWindow, clock: cfg.Clock, log: cfg.Logger}
}

// Subscribe registers fn for every transition. fn runs synchronously on the
// goroutine that caused the transition; it must be quick and must not call
// Detach, Healthy, Unhealthy or Attach (IsDetached and Status are fine).
func (m *Machine) Subscribe(fn func(Event)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.subs = append(m.subs, fn)
}

// IsDetached reports whether the runner is detached.
func (m *Machine) IsDetached() bool { return m.detached.Load() }

// Detach marks the runner detached for r. It reports whether this call made
// the transition; when already detached it only updates the reason (a
// manual reason also makes the detachment sticky).
func (m *Machine) Detach(r Reason) bool {
	return m.transition(func(now time.Time) *Event {
		if r.Kind == Manual {
			m.sticky = true
		}
		m.reason = r
		if m.detached.Load() {
			m.healthySince = time.Time{}
			m.log.Debug("detachment reason updated", "reason", r.String())
			return nil
		}
		m.since = now
		m.healthySince = time.Time{}
		m.detached.Store(true)
		m.log.Warn("runner detached from cluster", "reason", r.String())
		return &Event{Detached: true, Reason: r, At: now}
	})
}

// Healthy records a healthy signal (a successful keep-alive). While detached
// the first one starts the recovery window, and one after the window has
// passed with no Unhealthy in between re-attaches. It reports whether this
// call re-attached. Manual detachment ignores health until Attach.
func (m *Machine) Healthy() bool {
	if !m.detached.Load() {
		return false
	}
	return m.transition(func(now time.Time) *Event {
		if !m.detached.Load() || m.sticky {
			return nil
		}
		if m.healthySince.IsZero() {
			m.healthySince = now
			m.log.Info("healthy while detached; recovery window started", "window", m.window)
			return nil
		}
		if healthy := now.Sub(m.healthySince); healthy < m.window {
			return nil
		}
		return m.reattach(now)
	})
}

// Unhealthy records an unhealthy signal: the recovery window starts over.
func (m *Machine) Unhealthy() {
	m.transition(func(time.Time) *Event {
		if !m.healthySince.IsZero() {
			m.log.Debug("recovery window reset by an unhealthy signal")
		}
		m.healthySince = time.Time{}
		return nil
	})
}

// Attach is the operator's request to end a detachment. It lifts the
// stickiness of a manual detachment and starts the recovery window; the
// runner re-attaches on the first healthy signal after the window (at once
// when the window is zero).
func (m *Machine) Attach() {
	m.transition(func(now time.Time) *Event {
		if !m.detached.Load() {
			return nil
		}
		m.sticky = false
		if m.healthySince.IsZero() {
			m.healthySince = now
		}
		m.log.Info("operator attach; recovery window started", "window", m.window)
		if m.window <= 0 {
			return m.reattach(now)
		}
		return nil
	})
}

func (m *Machine) reattach(now time.Time) *Event {
	prev := m.reason
	m.log.Info("runner re-attached to cluster", "previous_reason", prev.String(),
		"detached_for", now.Sub(m.since), "healthy_for", now.Sub(m.healthySince))
	m.detached.Store(false)
	m.reason, m.since, m.healthySince = Reason{}, time.Time{}, time.Time{}
	return &Event{Detached: false, Reason: prev, At: now}
}

// transition runs change under the state lock and notifies subscribers of
// the event it returns (if any) before returning.
func (m *Machine) transition(change func(now time.Time) *Event) bool {
	m.transitions.Lock()
	defer m.transitions.Unlock()
	m.mu.Lock()
	ev := change(m.clock.Now())
	subs := m.subs
	m.mu.Unlock()
	if ev == nil {
		return false
	}
	for _, fn := range subs {
		fn(*ev)
	}
	return true
}

// Status returns a snapshot of the state.
func (m *Machine) Status() Status {
	m.mu.Lock()
	defer m.mu.Unlock()
	return Status{
		Detached:     m.detached.Load(),
		Reason:       m.reason,
		Since:        m.since,
		HealthySince: m.healthySince,
		Sticky:       m.sticky,
	}
}
