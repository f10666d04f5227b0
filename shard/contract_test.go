package shard

import (
	"testing"
	"time"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/executor/executortest"
	"github.com/shardrun/shardrun/internal/testutil"
)

// TestManagerKeepsTheExecutorsContract runs the ownership contract the
// executor relies on (executortest) against the real manager on a real
// etcd, as the executor's own tests run it against its fake. A move is
// a second runner joining the group, as in production; the fake once
// modelled it as a cancel, and a task claimed ahead on a moving unit went
// unnoticed (issue 39, defect 3).
func TestManagerKeepsTheExecutorsContract(t *testing.T) {
	executortest.OwnershipContract(t, func(t *testing.T) executortest.OwnershipHarness {
		// Two units: the joining runner takes exactly one of them. "a" is
		// started through a fault proxy, so that Pause can cut it off.
		c := newCluster(t, 2)
		return &ownershipHarness{c: c, a: c.add("a", true, withoutJoinSettle())}
	})
}

// ownershipHarness is one runner "a" of a cluster, with the means to move
// one of its units (runner "b" joins), detach it and pause it.
type ownershipHarness struct {
	c *cluster
	a *member
}

var (
	_ executortest.OwnershipHarness = (*ownershipHarness)(nil)
)

// contractOwnership is the manager as the runner hands it to the
// executor (runner.ownership).
type contractOwnership struct{ *Manager }

func (o contractOwnership) Hold() executor.Hold { return o.Manager.Hold() }

func (h *ownershipHarness) Ownership() executor.Ownership { return contractOwnership{h.a.mgr} }

// Acquire waits until "a" has acquired both units.
func (h *ownershipHarness) Acquire(t *testing.T) []claims.ShardEpoch {
	t.Helper()
	var terms []claims.ShardEpoch
	testutil.WaitFor(t, 10*time.Second, "a acquiring both units", func() bool {
		terms = h.a.mgr.Unfenced()
		return len(terms) == 2
	})
	return terms
}

// Move starts "b" in a's group: the assignment gives it one of the two
// units, which a begins to release.
func (h *ownershipHarness) Move(t *testing.T, held []claims.ShardEpoch) claims.ShardEpoch {
	t.Helper()
	h.c.add("b", false, withoutJoinSettle())
	var moved claims.ShardEpoch
	testutil.WaitFor(t, 10*time.Second, "a releasing one unit", func() bool {
		for _, s := range h.a.mgr.Status().Releasing {
			for _, term := range held {
				if term.Shard == s {
					moved = term
					return true
				}
			}
		}
		return false
	})
	return moved
}

// Detach detaches a as an operator does.
func (h *ownershipHarness) Detach(*testing.T) {
	h.a.machine.Detach(detach.Reason{Kind: detach.Manual, Detail: "contract"})
}

// Pause is a process woken from a pause before its keep-alive loop
// noticed: its keep-alives stop getting through, and its lease clock is
// past its detach point, with nothing told yet.
func (h *ownershipHarness) Pause(t *testing.T) {
	t.Helper()
	h.a.proxy.Blackhole()
	k := h.a.mgr.keeper
	k.mu.Lock()
	ttl := h.c.ttl
	k.lc = detach.NewLeaseClock(time.Now().Add(-2*ttl), ttl, ttl/3, 2)
	k.mu.Unlock()
}
