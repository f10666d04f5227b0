package detach

import (
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/shardrun/shardrun/internal/clock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newMachine(window time.Duration) (*Machine, *clock.Fake) {
	c := clock.NewFake()
	return New(Config{RecoveryWindow: window, Clock: c}), c
}

// The seed's tests, with the fake clock instead of sleeps.

func TestInitiallyNotDetached(t *testing.T) {
	m, _ := newMachine(100 * time.Millisecond)
	st := m.Status()
	if m.IsDetached() || st.Detached || st.Reason.Kind != 0 || !st.Since.IsZero() {
		t.Fatalf("new machine: %+v", st)
	}
}

func TestDetachSetsState(t *testing.T) {
	m, c := newMachine(100 * time.Millisecond)
	if !m.Detach(Reason{Kind: Manual}) {
		t.Fatal("first detach must report the transition")
	}
	st := m.Status()
	if !m.IsDetached() || st.Reason.Kind != Manual || !st.Since.Equal(c.Now()) {
		t.Fatalf("after detach: %+v", st)
	}
}

func TestDoubleDetachUpdatesReasonOnly(t *testing.T) {
	m, c := newMachine(100 * time.Millisecond)
	m.Detach(Reason{Kind: LeaseExpired, Detail: "x"})
	since := m.Status().Since
	c.Advance(time.Second)
	if m.Detach(Reason{Kind: LeaseExpired}) {
		t.Fatal("second detach reported a transition")
	}
	if st := m.Status(); st.Reason.Kind != LeaseExpired || !st.Since.Equal(since) {
		t.Fatalf("reason not updated or since moved: %+v", st)
	}
}

func TestReattachRequiresRecoveryWindow(t *testing.T) {
	m, c := newMachine(50 * time.Millisecond)
	m.Detach(Reason{Kind: LeaseExpired})
	if m.Healthy() || !m.IsDetached() {
		t.Fatal("first healthy signal must only start the window")
	}
	c.Advance(49 * time.Millisecond)
	if m.Healthy() || !m.IsDetached() {
		t.Fatal("re-attached before the window passed")
	}
	c.Advance(time.Millisecond)
	if !m.Healthy() || m.IsDetached() {
		t.Fatal("did not re-attach once the window passed")
	}
	if st := m.Status(); st.Reason.Kind != 0 || !st.HealthySince.IsZero() {
		t.Fatalf("state not cleared on re-attach: %+v", st)
	}
}

func TestUnhealthySignalResetsRecovery(t *testing.T) {
	m, c := newMachine(100 * time.Millisecond)
	m.Detach(Reason{Kind: KeepaliveFailure, Streak: 2})
	m.Healthy()
	c.Advance(80 * time.Millisecond)
	m.Unhealthy()
	c.Advance(50 * time.Millisecond)
	if m.Healthy() {
		t.Fatal("re-attached although the window was reset 50ms ago")
	}
	c.Advance(99 * time.Millisecond)
	if m.Healthy() {
		t.Fatal("re-attached before a full window after the reset")
	}
	c.Advance(time.Millisecond)
	if !m.Healthy() {
		t.Fatal("did not re-attach after a full window of health")
	}
}

func TestDetachDuringRecoveryResetsWindow(t *testing.T) {
	m, c := newMachine(100 * time.Millisecond)
	m.Detach(Reason{Kind: LeaseExpired})
	m.Healthy()
	c.Advance(90 * time.Millisecond)
	m.Detach(Reason{Kind: KeepaliveFailure, Streak: 3})
	c.Advance(20 * time.Millisecond)
	if m.Healthy() {
		t.Fatal("a new detach reason must restart the recovery window")
	}
}

func TestReasonStrings(t *testing.T) {
	for r, want := range map[Reason]string{
		{Kind: KeepaliveFailure, Streak: 5}:   "keep-alive failure streak: no keep-alive succeeded for 5 keep-alive periods (TTL/3 each)",
		{Kind: LeaseExpired}:                  "lease expired",
		{Kind: Manual}:                        "manual detachment",
		{Kind: Manual, Detail: "maintenance"}: "manual detachment: maintenance",
	} {
		if got := r.String(); got != want {
			t.Errorf("%v: %q, want %q", r.Kind, got, want)
		}
	}
	if KeepaliveFailure.String() != "keepalive_failure" ||
		LeaseExpired.String() != "lease_expired" || Manual.String() != "manual" {
		t.Error("kind names are part of /status and metrics")
	}
}

// Beyond the seed: stickiness, operator attach, synchronous notification.

func TestManualIsStickyUntilAttach(t *testing.T) {
	m, c := newMachine(100 * time.Millisecond)
	m.Detach(Reason{Kind: Manual, Detail: "maintenance"})
	for range 10 {
		c.Advance(time.Second)
		if m.Healthy() {
			t.Fatal("health ended a manual detachment")
		}
	}
	if st := m.Status(); !st.Sticky || !st.HealthySince.IsZero() {
		t.Fatalf("manual detachment must not run a recovery window: %+v", st)
	}
	m.Attach()
	if !m.IsDetached() {
		t.Fatal("attach must still wait for the recovery window")
	}
	c.Advance(99 * time.Millisecond)
	if m.Healthy() {
		t.Fatal("re-attached before the window after attach")
	}
	c.Advance(time.Millisecond)
	if !m.Healthy() {
		t.Fatal("did not re-attach after attach and a window of health")
	}
}

func TestManualWinsOverOtherReasons(t *testing.T) {
	m, c := newMachine(10 * time.Millisecond)
	m.Detach(Reason{Kind: LeaseExpired})
	m.Detach(Reason{Kind: Manual})
	m.Detach(Reason{Kind: LeaseExpired, Detail: "later"})
	c.Advance(time.Second)
	m.Healthy()
	c.Advance(time.Second)
	if m.Healthy() || !m.Status().Sticky {
		t.Fatal("a later non-manual reason lifted the manual stickiness")
	}
}

func TestAttachWithZeroWindowIsImmediate(t *testing.T) {
	m, _ := newMachine(0)
	m.Detach(Reason{Kind: Manual})
	m.Attach()
	if m.IsDetached() {
		t.Fatal("attach with no recovery window must re-attach at once")
	}
	m.Attach() // attached: no-op
	if m.IsDetached() {
		t.Fatal("attach on an attached machine changed it")
	}
}

func TestSubscribersRunBeforeDetachReturns(t *testing.T) {
	m, c := newMachine(10 * time.Millisecond)
	var events []Event
	var sawDetached []bool
	m.Subscribe(func(e Event) {
		events = append(events, e)
		sawDetached = append(sawDetached, m.IsDetached())
	})
	m.Detach(Reason{Kind: LeaseExpired})
	if len(events) != 1 || !events[0].Detached || !sawDetached[0] {
		t.Fatalf("subscriber not called synchronously with the state already detached: %+v", events)
	}
	m.Detach(Reason{Kind: LeaseExpired}) // no transition, no event
	m.Healthy()
	c.Advance(10 * time.Millisecond)
	m.Healthy()
	if len(events) != 2 || events[1].Detached || events[1].Reason.Kind != LeaseExpired || sawDetached[1] {
		t.Fatalf("re-attach event: %+v %v", events, sawDetached)
	}
}

func TestConcurrentUseKeepsEventsAlternating(t *testing.T) {
	m, c := newMachine(0)
	var mu sync.Mutex
	var last *bool
	bad := 0
	m.Subscribe(func(e Event) {
		mu.Lock()
		defer mu.Unlock()
		if last != nil && *last == e.Detached {
			bad++
		}
		d := e.Detached
		last = &d
	})
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 500 {
				switch (i + j) % 4 {
				case 0:
					m.Detach(Reason{Kind: LeaseExpired})
				case 1:
					m.Healthy()
				case 2:
					m.Unhealthy()
				default:
					_ = m.IsDetached()
					_ = m.Status()
				}
			}
		})
	}
	wg.Wait()
	_ = c
	if bad != 0 {
		t.Fatalf("%d events out of order (two detaches or two attaches in a row)", bad)
	}
}

// The lease-deadline rule.

func TestLeaseDeadlineCountsFromSendTime(t *testing.T) {
	c := clock.NewFake()
	ttl, margin := 9*time.Second, 3*time.Second
	granted := c.Now()
	l := NewLeaseClock(granted, ttl, margin, 2)
	c.Advance(3 * time.Second)
	sent := c.Now()
	c.Advance(2 * time.Second) // the response takes 2s to arrive
	l.Succeeded(sent, ttl)
	if want := sent.Add(ttl); !l.Deadline().Equal(want) {
		t.Fatalf("deadline %v, want send time + TTL = %v (not receipt time + TTL)", l.Deadline(), want)
	}
	if want := sent.Add(ttl - margin); !l.DetachAt().Equal(want) {
		t.Fatalf("detach at %v, want %v", l.DetachAt(), want)
	}
	c.Advance(l.DetachAt().Sub(c.Now()) - time.Nanosecond)
	if _, detach := l.Check(c.Now()); detach {
		t.Fatal("detached before deadline - margin")
	}
	c.Advance(time.Nanosecond)
	r, detach := l.Check(c.Now())
	if !detach || r.Kind != LeaseExpired {
		t.Fatalf("at deadline - margin: %v %v", r, detach)
	}
	if left := l.TimeLeft(c.Now()); left != margin {
		t.Fatalf("time left %s, want the margin %s", left, margin)
	}
}

func TestLeaseDeadlineNeverMovesBack(t *testing.T) {
	c := clock.NewFake()
	l := NewLeaseClock(c.Now(), 10*time.Second, time.Second, 2)
	newer := c.Now().Add(5 * time.Second)
	l.Succeeded(newer, 10*time.Second)
	l.Succeeded(c.Now(), 10*time.Second) // an older send answered late
	if !l.Deadline().Equal(newer.Add(10 * time.Second)) {
		t.Fatalf("a late answer to an older keep-alive moved the deadline back: %v", l.Deadline())
	}
}

func TestLeaseFailureStreak(t *testing.T) {
	c := clock.NewFake()
	// TTL 12s: periods of 4s; margin 1s so that the streak rule (2
	// periods, 8s) comes before the deadline rule (11s).
	l := NewLeaseClock(c.Now(), 12*time.Second, time.Second, 2)
	c.Advance(4 * time.Second)
	if _, detach := l.Check(c.Now()); detach || l.Streak(c.Now()) != 1 {
		t.Fatalf("one period without a success (streak %d) below the threshold detached", l.Streak(c.Now()))
	}
	if want := l.Deadline().Add(-12 * time.Second).Add(8 * time.Second); !l.DetachAt().Equal(want) {
		t.Fatalf("detach at %v, want the streak's %v", l.DetachAt(), want)
	}
	c.Advance(4 * time.Second)
	if r, detach := l.Check(c.Now()); !detach || r.Kind != KeepaliveFailure || r.Streak != 2 {
		t.Fatalf("two periods without a success at threshold 2: %v %v", r, detach)
	}
	l.Succeeded(c.Now(), 12*time.Second)
	if _, detach := l.Check(c.Now()); detach || l.Streak(c.Now()) != 0 {
		t.Fatal("a success must end the streak")
	}
}
