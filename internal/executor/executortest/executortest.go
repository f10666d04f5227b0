// Package executortest is the contract the executor relies on from its
// two collaborators, executor.Store and executor.Ownership, as tests that
// run against any implementation: the executor's fakes (its own tests run
// them) and the real store.Store and shard.Manager (their packages run
// them). It is River's riverdrivertest applied here: the executor's tests
// are only as good as its fakes, and its fakes are trusted only as far as
// the same tests pass against the real parts.
//
// Each contract takes a function that opens a fresh implementation for one
// test, through a harness: the part under test and the means to set up
// what the executor never does itself (enqueue tasks, hold a claim row in
// a transaction left open, move a unit to another runner, detach). The
// package imports neither the store nor the shard manager.
//
// What the contracts check is what the executor's rules stand on
// (docs/architecture.md, "Slow parts"; internal/executor/ahead.go):
//
//   - fenced writes: after a newer owner raised a unit's fence, every write
//     of the old owner's claims is refused (claims.FenceLost), and its
//     claims of the unit take nothing;
//   - nothing waits for a transaction the system does not control: a claim
//     row another transaction holds is skipped, answered claims.Busy and
//     left unchanged by every write, and named pending by a raise or a
//     requeue of orphans, which RequeueOrphans finishes later;
//   - an attempt whose handler never started is never spent: a give-back,
//     an orphan requeue or a stale sweep of a claim taken ahead of need
//     (Claim's startNow) keeps its attempt; one recorded as started spends
//     it;
//   - a completion recorded in the handler's own transaction (CompleteTx)
//     is what ends the claim, whoever ends it;
//   - ownership: a unit moves as a rebalance moves it — it leaves the
//     claimable terms at once (Hold, Workable, Changes) while its begun
//     work runs on under a live context until it is done, and only then is
//     it released; a detach ends every term at once.
package executortest

import (
	"context"
	"testing"
	"time"
)

// callTimeout bounds every call the contracts make. A call that waits for
// a transaction it should have skipped fails here instead of hanging the
// test; no contract asserts how fast anything is.
const callTimeout = 10 * time.Second

// Runners whose claims and fences the store contract writes.
const (
	// Owner is the runner under test.
	Owner = "runner-a"
	// Other is a newer owner of the same units.
	Other = "runner-b"
)

// Kind is the task kind of every task the store contract enqueues.
const Kind = "contract"

// bounded is a context for one call of the part under test.
func bounded(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls cond until it holds or callTimeout passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(callTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", callTimeout, what)
		}
		time.Sleep(time.Millisecond)
	}
}
