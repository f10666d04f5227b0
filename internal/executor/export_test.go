package executor

import (
	"encoding/json"
	"testing"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// The executor's fakes as the contract suite (executortest) drives them:
// contract_test.go runs the same contracts against them as the store's and
// the shard manager's packages run against the real parts. The fakes stay
// unexported; these harnesses are visible to the package's external tests
// only.

// FakeStoreHarness is the fake store as an executortest.StoreHarness.
type FakeStoreHarness struct {
	s    *fakeStore
	next int64
}

// NewFakeStoreHarness returns an empty fake store.
func NewFakeStoreHarness(*testing.T) *FakeStoreHarness { return &FakeStoreHarness{s: newFakeStore()} }

// Store is the fake store.
func (h *FakeStoreHarness) Store() Store { return h.s }

// Group is the fake's only group.
func (h *FakeStoreHarness) Group() string { return "" }

// Add enqueues a ready task.
func (h *FakeStoreHarness) Add(_ *testing.T, kind string, shard, maxAttempts int) int64 {
	h.next++
	h.s.add(h.next, kind, shard, maxAttempts)
	return h.next
}

// Task reads a task.
func (h *FakeStoreHarness) Task(_ *testing.T, id int64) tasks.Task { return h.s.get(id) }

// LockClaim holds a claim row in a transaction left open.
func (h *FakeStoreHarness) LockClaim(t *testing.T, ref claims.Ref) func() {
	unlock := h.s.lockClaim(ref.ID)
	t.Cleanup(unlock)
	return unlock
}

// CompleteInTx records a completion in a transaction left open.
func (h *FakeStoreHarness) CompleteInTx(t *testing.T, ref claims.Ref, result json.RawMessage) func() {
	commit, err := h.s.completeInTx(ref, result)
	if err != nil {
		t.Fatal(err)
	}
	return commit
}

// SweepStale runs the stale rule on claims.
func (h *FakeStoreHarness) SweepStale(_ *testing.T, refs []claims.Ref) {
	for _, r := range refs {
		h.s.sweepStale(r.ID)
	}
}

// FakeOwnershipHarness is the fake ownership as an
// executortest.OwnershipHarness.
type FakeOwnershipHarness struct{ o *fakeOwnership }

// NewFakeOwnershipHarness returns a fake ownership that owns nothing.
func NewFakeOwnershipHarness(*testing.T) *FakeOwnershipHarness {
	return &FakeOwnershipHarness{o: newFakeOwnership()}
}

// Ownership is the fake ownership.
func (h *FakeOwnershipHarness) Ownership() Ownership { return h.o }

// Acquire owns shards 0 to 2.
func (h *FakeOwnershipHarness) Acquire(*testing.T) []claims.ShardEpoch {
	for s := range 3 {
		h.o.own(s, 7)
	}
	return h.o.Unfenced()
}

// Move moves the first of held.
func (h *FakeOwnershipHarness) Move(_ *testing.T, held []claims.ShardEpoch) claims.ShardEpoch {
	h.o.move(held[0].Shard)
	return held[0]
}

// Detach detaches the runner.
func (h *FakeOwnershipHarness) Detach(*testing.T) { h.o.detach() }

// Pause moves the lease clock past its detach point.
func (h *FakeOwnershipHarness) Pause(*testing.T) { h.o.pause() }
