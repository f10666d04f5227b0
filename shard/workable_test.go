package shard

import (
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
)

// offlineManager is a manager that never reaches etcd, on a fake clock,
// with a lease of generation 1 trusted from now for TTL 3s (margin 1s):
// for the rules that need no cluster.
func offlineManager(t *testing.T, log hclog.Logger) (*Manager, *clock.Fake) {
	t.Helper()
	c := clock.NewFake()
	m, err := New(Config{Client: &clientv3.Client{}, Detach: detach.New(detach.Config{Clock: c}), Prefix: "/p/",
		RunnerID: "r", ShardCount: 256, LeaseTTL: 3 * time.Second, Clock: c, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	m.keeper.gen = 1
	m.keeper.lc = detach.NewLeaseClock(c.Now(), 3*time.Second, time.Second, 2)
	return m, c
}

// TestWorkable: new work may start on a term only while it is fenced,
// at its epoch, under the current lease, and while the runner may work:
// attached, no other process holding its id, the lease clock before its
// detach point. It allocates nothing.
func TestWorkable(t *testing.T) {
	m, c := offlineManager(t, nil)
	now := c.Now()
	l := m.ledger
	l.adopt(1, 10, now, 1) // acquired
	l.adopt(2, 20, now, 1) // fenced
	l.adopt(3, 30, now, 1) // releasing
	l.adopt(4, 40, now, 1) // cancelled
	l.adopt(5, 50, now, 0) // fenced, of an earlier lease
	l.adopt(6, 60, now, 1) // lost: no term any more
	m.Fenced([]claims.ShardEpoch{{Shard: 2, Epoch: 20}, {Shard: 3, Epoch: 30}, {Shard: 4, Epoch: 40}, {Shard: 5, Epoch: 50}})
	l.mu.Lock()
	l.move(l.terms[3], releasing, now, "test")
	l.move(l.terms[6], lost, now, "test")
	l.mu.Unlock()
	l.cancelTerm(4, 40, "test")

	for _, tc := range []struct {
		name   string
		shard  int
		epoch  int64
		expect bool
	}{
		{"acquired, fence not raised", 1, 10, false},
		{"fenced", 2, 20, true},
		{"fenced, another epoch", 2, 21, false},
		{"releasing", 3, 30, false},
		{"cancelled", 4, 40, false},
		{"fenced under an earlier lease", 5, 50, false},
		{"ended", 6, 60, false},
		{"never held", 7, 70, false},
	} {
		if got := m.Workable(tc.shard, tc.epoch); got != tc.expect {
			t.Errorf("%s: Workable(%d, %d) = %v, want %v", tc.name, tc.shard, tc.epoch, got, tc.expect)
		}
	}
	if n := testing.AllocsPerRun(1000, func() { m.Workable(2, 20) }); n != 0 {
		t.Errorf("Workable allocates %.1f times a call", n)
	}

	// The lease clock passes its detach point before the keep-alive loop
	// detaches (a process woken from a pause): nothing new starts.
	c.Advance(2 * time.Second)
	if m.Workable(2, 20) {
		t.Error("workable past the lease clock's detach point")
	}
	if m.machine.IsDetached() {
		t.Fatal("the test needs the runner still attached")
	}
	m.keeper.lc = detach.NewLeaseClock(c.Now(), 3*time.Second, time.Second, 2) // a keep-alive succeeded
	if !m.Workable(2, 20) {
		t.Fatal("not workable after a keep-alive renewed the lease clock")
	}

	// Another process holds the runner id.
	key := "/p/runners/r"
	m.conflict.Store(&key)
	if m.Workable(2, 20) {
		t.Error("workable while another process holds the runner id")
	}
	m.conflict.Store(nil)

	// A detach cancels every term at once.
	m.machine.Detach(detach.Reason{Kind: detach.Manual, Detail: "test"})
	if m.Workable(2, 20) {
		t.Error("workable after a detach")
	}
}

// TestChangesSignalledWhenAFencedTermStops: the executor gives back the
// tasks it claimed ahead of need on a term when Changes fires; a fenced
// term that starts releasing, or is cancelled by a detach, fires it.
func TestChangesSignalledWhenAFencedTermStops(t *testing.T) {
	m, c := offlineManager(t, nil)
	drain := func() {
		select {
		case <-m.Changes():
		default:
		}
	}
	fired := func() bool {
		select {
		case <-m.Changes():
			return true
		default:
			return false
		}
	}
	m.ledger.adopt(1, 10, c.Now(), 1)
	m.ledger.adopt(2, 20, c.Now(), 1)
	m.Fenced([]claims.ShardEpoch{{Shard: 1, Epoch: 10}, {Shard: 2, Epoch: 20}})
	drain()

	m.ledger.releaseStep(c.Now(), time.Minute, func(s int) string {
		if s == 1 {
			return "assigned to x"
		}
		return ""
	})
	if m.ledger.terms[1].state != releasing {
		t.Fatalf("shard 1 is %s, want releasing", m.ledger.terms[1].state)
	}
	if !fired() {
		t.Error("fenced -> releasing did not signal Changes")
	}
	if m.Workable(1, 10) {
		t.Error("a releasing term is workable")
	}

	m.machine.Detach(detach.Reason{Kind: detach.Manual, Detail: "test"})
	if m.ledger.terms[2].state != cancelled {
		t.Fatalf("shard 2 is %s after the detach, want cancelled", m.ledger.terms[2].state)
	}
	if !fired() {
		t.Error("fenced -> cancelled on detach did not signal Changes")
	}
}

// TestOneLostLeaseOneWarning: when the runner's owner key vanishes (its
// lease was revoked) with 128 terms held, the runner warns once, with the
// count and the first shards, not once per shard.
func TestOneLostLeaseOneWarning(t *testing.T) {
	lines := &logLines{t: t}
	m, c := offlineManager(t, hclog.New(&hclog.LoggerOptions{Level: hclog.Info, Output: lines}))
	for s := range 128 {
		m.ledger.adopt(s, 10, c.Now(), 1)
	}
	m.dropVanished() // the view has no owner key of the runner
	if !m.ledger.empty() {
		t.Fatal("terms of a vanished key are still held")
	}
	warned := lines.matching("[WARN]")
	if len(warned) != 1 {
		t.Fatalf("%d warnings for one lost key, want one; the first: %v", len(warned), warned[:min(len(warned), 1)])
	}
	for _, part := range []string{"shards=128", `first="0,1,2,3,4,…"`} {
		if len(lines.matching("[WARN]", part)) != 1 {
			t.Errorf("the warning does not say %s: %s", part, warned[0])
		}
	}
}

// TestHandoffTimeoutWarnsOnce: when the handoff of many busy shards times
// out in one pass, the runner warns once with the count.
func TestHandoffTimeoutWarnsOnce(t *testing.T) {
	lines := &logLines{t: t}
	c := clock.NewFake()
	l := newLedger("me", c, hclog.New(&hclog.LoggerOptions{Level: hclog.Info, Output: lines}), NewMetrics(nil))
	for s := range 64 {
		l.adopt(s, 10, c.Now(), 1)
		l.markFenced([]claims.ShardEpoch{{Shard: s, Epoch: 10}})
	}
	h := l.hold(func() bool { return true }, 1) // work in flight on every term
	defer h.Release()
	away := func(int) string { return "assigned to x" }
	l.releaseStep(c.Now(), time.Second, away)
	c.Advance(time.Second)
	l.releaseStep(c.Now(), time.Second, away)
	warned := lines.matching("[WARN]")
	if len(warned) != 1 || len(lines.matching("[WARN]", "handoff timeout", "shards=64")) != 1 {
		t.Fatalf("%d warnings for one handoff timeout of 64 shards, want one with the count; the first: %v", len(warned), warned[:min(len(warned), 1)])
	}
}
