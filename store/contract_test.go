package store_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/executor/executortest"
	"github.com/shardrun/shardrun/internal/pgtest"
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

// TestRouterKeepsTheExecutorsContract runs the same contract against a
// router over two databases, the contract's shards placed on both (shard
// 0, which it uses most, in the second database).
func TestRouterKeepsTheExecutorsContract(t *testing.T) {
	t.Parallel()
	for _, m := range []store.Map{
		{Rev: 1, Databases: []string{"x", "y"}, Shards: []string{"y", "x", "y", "x"}},
		{Databases: []string{"main"}, Shards: []string{"main", "main", "main", "main"}}, // one database: the fast path
	} {
		t.Run(strings.Join(m.Databases, "+"), func(t *testing.T) {
			t.Parallel()
			executortest.StoreContract(t, func(t *testing.T) executortest.StoreHarness {
				r, _ := pgtest.NewCluster(t, store.Options{MaxConns: 20}, m)
				if ok, err := r.RaiseLeaderFence(context.Background(), "test-coordinator", leaderEpoch); err != nil || !ok {
					t.Fatalf("raising the coordinator fence: %v %v", ok, err)
				}
				return &routerHarness{r: r}
			})
		})
	}
}

// routerHarness is a router over its own databases, as the contract
// drives it: each set-up at the database of its shard.
type routerHarness struct{ r *store.Router }

var _ executortest.StoreHarness = (*routerHarness)(nil)

func (h *routerHarness) Store() executor.Store { return h.r }

func (h *routerHarness) Group() string { return "gcontract" }

func (h *routerHarness) Add(t *testing.T, kind string, shard, maxAttempts int) int64 {
	id, err := h.r.Enqueue(context.Background(), insert(kind, shard, maxAttempts))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func (h *routerHarness) Task(t *testing.T, id int64) tasks.Task {
	task, err := h.r.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return task
}

func (h *routerHarness) at(shard int) *store.Store {
	_, st := h.r.Of(shard)
	return st
}

func (h *routerHarness) LockClaim(t *testing.T, ref claims.Ref) func() {
	return (&storeHarness{s: h.at(ref.Shard)}).LockClaim(t, ref)
}

// CompleteInTx is a handler's CompleteTx, through the router, in a
// transaction on the task's database left open.
func (h *routerHarness) CompleteInTx(t *testing.T, ref claims.Ref, result json.RawMessage) func() {
	t.Helper()
	ctx := context.Background()
	tx, err := h.at(ref.Shard).Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	res, err := h.r.CompleteTx(ctx, tx, executortest.Owner, claims.Completion{Ref: ref, Result: result})
	if err != nil || res.Outcome != claims.Applied {
		t.Fatalf("CompleteTx of %+v: %+v %v", ref, res, err)
	}
	return func() {
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func (h *routerHarness) SweepStale(t *testing.T, refs []claims.Ref) {
	t.Helper()
	ctx := context.Background()
	for _, ref := range refs {
		exec(t, h.at(ref.Shard), `UPDATE task_claims SET claimed_at = now() - interval '1 hour', heartbeat_at = now() - interval '1 hour'
			WHERE id = $1`, ref.ID)
	}
	if _, _, err := h.r.SweepStale(ctx, leaderEpoch, time.Minute, 100, store.Backoff{Base: time.Millisecond, Cap: time.Second}); err != nil {
		t.Fatal(err)
	}
}
