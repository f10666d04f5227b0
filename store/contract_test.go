package store_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/executor/executortest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// TestStoreKeepsTheExecutorsContract runs the contract the executor relies
// on (executortest) against the real store, as the executor's own tests
// run it against its fake: the fake is trusted as far as both pass.
func TestStoreKeepsTheExecutorsContract(t *testing.T) {
	t.Parallel()
	executortest.StoreContract(t, func(t *testing.T) executortest.StoreHarness {
		return &storeHarness{s: setup(t)}
	})
}

// storeHarness is a store with its own database, as the contract drives it.
type storeHarness struct{ s *store.Store }

var (
	_ executortest.StoreHarness = (*storeHarness)(nil)
)

func (h *storeHarness) Store() executor.Store { return h.s }

func (h *storeHarness) Group() string { return "gcontract" }

func (h *storeHarness) Add(t *testing.T, kind string, shard, maxAttempts int) int64 {
	return enqueue(t, h.s, insert(kind, shard, maxAttempts))
}

func (h *storeHarness) Task(t *testing.T, id int64) tasks.Task { return get(t, h.s, id) }

// LockClaim holds the claim row as a transaction of another session does.
func (h *storeHarness) LockClaim(t *testing.T, ref claims.Ref) func() {
	t.Helper()
	ctx := context.Background()
	tx, err := h.s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1 FROM task_claims WHERE id = $1 FOR UPDATE`, ref.ID); err != nil {
		t.Fatal(err)
	}
	unlock := func() { _ = tx.Rollback(context.Background()) }
	t.Cleanup(unlock)
	return unlock
}

// CompleteInTx is a handler's CompleteTx in a transaction left open.
func (h *storeHarness) CompleteInTx(t *testing.T, ref claims.Ref, result json.RawMessage) func() {
	t.Helper()
	ctx := context.Background()
	tx, err := h.s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	res, err := h.s.CompleteTx(ctx, tx, executortest.Owner, claims.Completion{Ref: ref, Result: result})
	if err != nil || res.Outcome != claims.Applied {
		t.Fatalf("CompleteTx of %+v: %+v %v", ref, res, err)
	}
	return func() {
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

// SweepStale dates the claims of refs back past the threshold and runs
// the leader's stale rule.
func (h *storeHarness) SweepStale(t *testing.T, refs []claims.Ref) {
	t.Helper()
	ctx := context.Background()
	ids := make([]int64, len(refs))
	for i, r := range refs {
		ids[i] = r.ID
	}
	err := pgx.BeginFunc(ctx, h.s.Pool(), func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE task_claims SET claimed_at = now() - interval '1 hour', heartbeat_at = now() - interval '1 hour'
			WHERE id = ANY ($1)`, ids)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.s.SweepStale(ctx, leaderEpoch, time.Minute, 100, store.Backoff{Base: time.Millisecond, Cap: time.Second}); err != nil {
		t.Fatal(err)
	}
}
