package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var backoff = store.Backoff{Base: time.Second, Cap: time.Minute}

func setup(t testing.TB) *store.Store {
	t.Helper()
	ctx := context.Background()
	s, _ := pgtest.NewStore(t, store.Options{MaxConns: 20})
	if ok, err := s.RaiseLeaderFence(ctx, "test-coordinator", leaderEpoch); err != nil || !ok {
		t.Fatalf("raising the coordinator fence: %v %v", ok, err)
	}
	return s
}

// leaderEpoch is the coordinator fence every test's sweeps run under.
const leaderEpoch = 1

func insert(kind string, shard, maxAttempts int) store.Insert {
	return store.Insert{NewTask: tasks.NewTask{Kind: kind, Payload: json.RawMessage(`{}`), Options: tasks.Options{Key: fmt.Sprint("k", shard), MaxAttempts: maxAttempts}.WithDefaults(0)}, Shard: shard}
}

func enqueue(t testing.TB, s *store.Store, in store.Insert) int64 {
	t.Helper()
	id, err := s.Enqueue(context.Background(), in)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// raiseFences is s.RaiseFences with the counts the tests look at, and an
// error when some orphans were left pending (no test here holds a claim
// in another transaction but those that say so).
func raiseFences(s *store.Store, ctx context.Context, owner, group string, terms []claims.ShardEpoch) (raised []claims.ShardEpoch, requeued, dead int64, err error) {
	o, err := s.RaiseFences(ctx, owner, group, terms)
	if err == nil && len(o.Pending) > 0 {
		err = fmt.Errorf("raising fences of %v: orphans left pending on %v", terms, o.Pending)
	}
	return o.Raised, o.Requeued + o.Completed, o.Dead, err
}

func raise(t testing.TB, s *store.Store, owner string, shard int, epoch int64) {
	t.Helper()
	raised, _, _, err := raiseFences(s, context.Background(), owner, "", []claims.ShardEpoch{{Shard: shard, Epoch: epoch}})
	if err != nil {
		t.Fatal(err)
	}
	if len(raised) != 1 {
		t.Fatalf("fence of shard %d not raised to %d", shard, epoch)
	}
}

func claim(t testing.TB, s *store.Store, owner string, shard int, epoch int64, limit int) []tasks.Task {
	t.Helper()
	got, err := s.Claim(context.Background(), owner, []claims.ShardEpoch{{Shard: shard, Epoch: epoch}}, tasks.DefaultQueue, []string{"k"}, limit, limit)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func get(t testing.TB, s *store.Store, id int64) tasks.Task {
	t.Helper()
	task, err := s.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return task
}

// retime: pgtest.Retime.
func retime(t testing.TB, s *store.Store, col, expr string, ids ...int64) {
	t.Helper()
	pgtest.Retime(t, s, col, expr, ids...)
}

func exec(t testing.TB, s *store.Store, sql string, args ...any) {
	t.Helper()
	if _, err := s.Pool().Exec(context.Background(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// one checks that a single-task write returned one result and returns it:
// one(t)(s.Complete(...)).
func one(t interface {
	Helper()
	Fatal(...any)
	Fatalf(string, ...any)
}) func([]claims.WriteResult, error) claims.WriteResult {
	return func(rs []claims.WriteResult, err error) claims.WriteResult {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		if len(rs) != 1 {
			t.Fatalf("want 1 result, got %d", len(rs))
		}
		return rs[0]
	}
}

func TestMigrateConcurrentlyAndTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := pgtest.NewDatabase(t)
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for range 6 {
		wg.Go(func() {
			s, err := store.Open(ctx, dsn, store.Options{})
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			errs <- s.Migrate(ctx)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("concurrent migrate: %v", err)
		}
	}
	s, err := store.Open(ctx, dsn, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("second migrate: %v", err)
	}
	if _, err := s.Enqueue(ctx, insert("k", 1, 1)); err != nil {
		t.Fatalf("schema unusable after migrating: %v", err)
	}
}

// TestRefusedConnectionSaysItOnce: with sslmode=prefer pgx tries twice and
// lists both attempts; the error names the refusal once and no password.
func TestRefusedConnectionSaysItOnce(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now
	_, err = store.Open(context.Background(), "postgres://u:secret@"+addr+"/db", store.Options{ConnectTimeout: 2 * time.Second})
	if err == nil {
		t.Fatal("opening a closed port succeeded")
	}
	msg := err.Error()
	if strings.Count(msg, "connection refused") != 1 || strings.Contains(msg, "secret") || strings.Contains(msg, "\n") {
		t.Fatalf("want one line naming the refusal once, without the password: %q", msg)
	}
}

func TestMaskDSN(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"postgres://u:secret@h:5432/db?sslmode=disable", "postgres://u:xxxxx@h:5432/db?sslmode=disable"},
		{"postgresql://u@h/db", "postgresql://u@h/db"},
		{"postgres://u@h/db?password=secret", "postgres://u@h/db?password=xxxxx"},
		{"host=h user=u password=secret dbname=db", "host=h user=u password=xxxxx dbname=db"},
		{"host=h password='se cret' dbname=db", "host=h password=xxxxx dbname=db"},
	} {
		if got := store.MaskDSN(tc.in); got != tc.want {
			t.Errorf("MaskDSN(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestOpenErrorsNameTheDatabaseWithoutPassword(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, err := store.Open(ctx, "postgres://u:hunter2@127.0.0.1:1/db?connect_timeout=1", store.Options{ConnectTimeout: time.Second})
	if err == nil {
		t.Fatal("connecting to a closed port succeeded")
	}
	if strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("error must name the database without its password: %v", err)
	}
	_, err = store.Open(ctx, "postgres://u:hunter2@host:notaport/db", store.Options{})
	if err == nil || strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "parsing database URL") {
		t.Fatalf("malformed DSN: want a parse error without the password, got %v", err)
	}
}

func TestLegalMoves(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 5)

	t.Run("ready to running to completed", func(t *testing.T) {
		id := enqueue(t, s, insert("k", 1, 3))
		got := claim(t, s, "a", 1, 5, 10)
		if len(got) != 1 || got[0].ID != id || got[0].State != tasks.Running || got[0].Epoch != 5 || got[0].Attempt != 1 {
			t.Fatalf("claim: %+v", got)
		}
		r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(got[0]), Result: json.RawMessage(`{"ok":true}`)}}))
		if r.Outcome != claims.Applied || r.State != tasks.Completed {
			t.Fatalf("complete: %+v", r)
		}
		task := get(t, s, id)
		if task.State != tasks.Completed || string(task.Result) != `{"ok": true}` || task.FinishedAt == nil || task.ClaimedBy != "a" || task.Epoch != 5 {
			t.Fatalf("completed row: %+v", task)
		}
	})

	t.Run("running to ready with backoff then dead", func(t *testing.T) {
		id := enqueue(t, s, insert("k", 1, 2))
		got := claim(t, s, "a", 1, 5, 10)
		r := one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(got[0]), Error: "boom", Backoff: claims.Backoff{Base: 2 * time.Hour, Cap: 2 * time.Hour}}}))
		if r.Outcome != claims.Applied || r.State != tasks.Ready {
			t.Fatalf("fail with attempts left: %+v", r)
		}
		task := get(t, s, id)
		if task.Attempt != 2 || time.Until(task.RunAfter) < 50*time.Minute || len(task.Errors) != 1 ||
			task.Errors[0].Error != "boom" || task.Errors[0].Attempt != 1 || task.ClaimedBy != "" {
			t.Fatalf("retried row: %+v", task)
		}
		if again := claim(t, s, "a", 1, 5, 10); len(again) != 0 {
			t.Fatalf("claimed a task before its backoff ended: %+v", again)
		}
		retime(t, s, "run_after", "now()", id)
		got = claim(t, s, "a", 1, 5, 10)
		if len(got) != 1 || got[0].Attempt != 2 {
			t.Fatalf("claim after backoff: %+v", got)
		}
		r = one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(got[0]), Error: "boom again"}}))
		if r.Outcome != claims.Applied || r.State != tasks.Dead {
			t.Fatalf("fail with no attempts left: %+v", r)
		}
		if task := get(t, s, id); task.State != tasks.Dead || len(task.Errors) != 2 || task.FinishedAt == nil {
			t.Fatalf("dead row: %+v", task)
		}
	})

	t.Run("ready and running to failed by deadline", func(t *testing.T) {
		soon := time.Now().Add(time.Hour)
		in := insert("k", 1, 3)
		in.Deadline = soon
		readyID := enqueue(t, s, in)
		runningID := enqueue(t, s, in)
		got := claim(t, s, "a", 1, 5, 10)
		if len(got) != 2 {
			t.Fatalf("claim: %+v", got)
		}
		r := one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: claims.RefOf(got[0]), Error: "x"}})) // back to ready
		if r.State != tasks.Ready {
			t.Fatalf("fail: %+v", r)
		}
		retime(t, s, "deadline", "now() - interval '1 second'", readyID, runningID)
		n, err := s.SweepDeadlines(ctx, leaderEpoch, 0, 100)
		if err != nil || n != 2 {
			t.Fatalf("deadline sweep: %d, %v", n, err)
		}
		for _, id := range []int64{readyID, runningID} {
			task := get(t, s, id)
			if task.State != tasks.Failed || task.Errors[len(task.Errors)-1].Error != "deadline exceeded" {
				t.Fatalf("task %d after deadline: %+v", id, task)
			}
		}
	})

	t.Run("running to ready or dead when stale", func(t *testing.T) {
		retry := enqueue(t, s, insert("k", 1, 2))
		last := enqueue(t, s, insert("k", 1, 1))
		if got := claim(t, s, "a", 1, 5, 10); len(got) != 2 {
			t.Fatalf("claim: %+v", got)
		}
		retime(t, s, "claimed_at", "now() - interval '1 hour'", retry, last)
		requeued, dead, err := s.SweepStale(ctx, leaderEpoch, time.Minute, 100, backoff)
		if err != nil || requeued != 1 || dead != 1 {
			t.Fatalf("stale sweep: requeued %d dead %d err %v", requeued, dead, err)
		}
		if task := get(t, s, retry); task.State != tasks.Ready || task.Attempt != 2 || !strings.HasPrefix(task.Errors[0].Error, "stale claim") {
			t.Fatalf("requeued row: %+v", task)
		}
		if task := get(t, s, last); task.State != tasks.Dead || task.Attempt != 1 {
			t.Fatalf("exhausted row: %+v", task)
		}
	})
}

func TestIllegalMovesAreRefused(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 5)
	readyID := enqueue(t, s, insert("k", 1, 3))
	readyRef := claims.Ref{ID: readyID, Shard: 1, Attempt: 1, Epoch: 5}

	if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: readyRef}})); r.Outcome != claims.TaskMoved {
		t.Fatalf("completing a ready task: %v", r.Outcome)
	}
	if r := one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: readyRef, Error: "x"}})); r.Outcome != claims.TaskMoved {
		t.Fatalf("failing a ready task: %v", r.Outcome)
	}
	if r := one(t)(s.Heartbeat(ctx, "a", []claims.Ref{readyRef})); r.Outcome != claims.TaskMoved {
		t.Fatalf("heartbeating a ready task: %v", r.Outcome)
	}
	got := claim(t, s, "a", 1, 5, 1)
	ref := claims.RefOf(got[0])
	if r := one(t)(s.Complete(ctx, "b", []claims.Completion{{Ref: ref}})); r.Outcome != claims.FenceLost {
		t.Fatalf("completing another runner's claim: %v", r.Outcome)
	}
	old := ref
	old.Attempt = 0
	if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: old}})); r.Outcome != claims.TaskMoved {
		t.Fatalf("completing an old attempt: %v", r.Outcome)
	}
	if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: ref}})); r.Outcome != claims.Applied {
		t.Fatalf("completing: %v", r.Outcome)
	}
	// Its completion is recorded: a second write of the attempt changes
	// nothing and says so (as after a handler's own CompleteTx).
	if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: ref}})); r.Outcome != claims.Completed {
		t.Fatalf("completing twice: %v", r.Outcome)
	}
	if r := one(t)(s.Fail(ctx, "a", []claims.Failure{{Ref: ref, Error: "late"}})); r.Outcome != claims.Completed {
		t.Fatalf("failing a completed task: %v", r.Outcome)
	}
	if task := get(t, s, ref.ID); task.State != tasks.Completed || len(task.Errors) != 0 {
		t.Fatalf("the completed task after the late writes: %s, errors %+v", task.State, task.Errors)
	}
	gone := claims.Ref{ID: 999999, Shard: 1, Attempt: 1, Epoch: 5}
	if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: gone}})); r.Outcome != claims.TaskGone {
		t.Fatalf("completing a missing task: %v", r.Outcome)
	}
	// Sweeps never touch finished or ready tasks.
	readyID = enqueue(t, s, insert("k", 1, 3))
	retime(t, s, "claimed_at", "now() - interval '1 hour'")
	retime(t, s, "deadline", "now() - interval '1 second'")
	if _, _, err := s.SweepStale(ctx, leaderEpoch, time.Second, 100, backoff); err != nil {
		t.Fatal(err)
	}
	if task := get(t, s, ref.ID); task.State != tasks.Completed {
		t.Fatalf("a sweep changed a completed task: %+v", task)
	}
	if task := get(t, s, readyID); task.State != tasks.Ready {
		t.Fatalf("the stale sweep changed a ready task: %+v", task)
	}
	if n, err := s.SweepDeadlines(ctx, leaderEpoch, 0, 100); err != nil || n != 1 {
		t.Fatalf("deadline sweep should fail only the ready task: %d %v", n, err)
	}
	if task := get(t, s, ref.ID); task.State != tasks.Completed {
		t.Fatalf("the deadline sweep changed a completed task: %+v", task)
	}
}

func TestFencing(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	for range 5 {
		enqueue(t, s, insert("k", 3, 3))
	}
	raise(t, s, "old", 3, 10)
	mine := claim(t, s, "old", 3, 10, 3)
	if len(mine) != 3 {
		t.Fatalf("old owner claimed %d", len(mine))
	}
	// The shard moves: the new owner raises the fence, and in the same
	// transaction requeues what the old owner left running.
	raised, requeued, dead, err := raiseFences(s, ctx, "new", "", []claims.ShardEpoch{{Shard: 3, Epoch: 20}})
	if err != nil || len(raised) != 1 || requeued != 3 || dead != 0 {
		t.Fatalf("new owner raised %v, requeued %d dead %d err %v", raised, requeued, dead, err)
	}
	// A zombie cannot lower the fence, nor requeue the new owner's work.
	if raised, n, d, err := raiseFences(s, ctx, "old", "", []claims.ShardEpoch{{Shard: 3, Epoch: 10}}); err != nil || len(raised) != 0 || n+d != 0 {
		t.Fatalf("an older epoch lowered the fence: %v %d/%d %v", raised, n, d, err)
	}
	if raised, _, _, err := raiseFences(s, ctx, "new", "", []claims.ShardEpoch{{Shard: 3, Epoch: 20}}); err != nil || len(raised) != 1 {
		t.Fatalf("re-raising the current epoch is not idempotent: %v %v", raised, err)
	}
	if got := claim(t, s, "old", 3, 10, 10); len(got) != 0 {
		t.Fatalf("old epoch claimed %d tasks after the fence moved", len(got))
	}
	if r := one(t)(s.Heartbeat(ctx, "old", []claims.Ref{claims.RefOf(mine[0])})); r.Outcome != claims.FenceLost {
		t.Fatalf("old heartbeat: %v", r.Outcome)
	}
	if r := one(t)(s.Complete(ctx, "old", []claims.Completion{{Ref: claims.RefOf(mine[1])}})); r.Outcome != claims.FenceLost {
		t.Fatalf("old complete: %v", r.Outcome)
	}
	if r := one(t)(s.Fail(ctx, "old", []claims.Failure{{Ref: claims.RefOf(mine[2]), Error: "x"}})); r.Outcome != claims.FenceLost {
		t.Fatalf("old fail: %v", r.Outcome)
	}
	got := claim(t, s, "new", 3, 20, 10)
	if len(got) != 5 {
		t.Fatalf("new owner claimed %d of 5 tasks", len(got))
	}
	for _, task := range got {
		if task.Epoch != 20 {
			t.Fatalf("claimed under epoch %d", task.Epoch)
		}
	}
	if task := get(t, s, mine[0].ID); task.Attempt != 2 || !strings.Contains(task.Errors[0].Error, "orphaned") {
		t.Fatalf("orphan not requeued with attempt+1: %+v", task)
	}
}

// TestOverlappingGroupsShareALane: two capability groups that both run a
// kind own the same shard, each under its own fence. They claim from one
// lane and never take the same task; a move of one group's unit requeues
// that group's claims only, and the other group's work completes under
// its own fence.
func TestOverlappingGroupsShareALane(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	for range 10 {
		enqueue(t, s, insert("k", 3, 3))
	}
	for _, g := range []struct {
		owner, group string
		epoch        int64
	}{{"a", "gA", 10}, {"b", "gB", 11}} {
		if raised, _, _, err := raiseFences(s, ctx, g.owner, g.group, []claims.ShardEpoch{{Shard: 3, Epoch: g.epoch}}); err != nil || len(raised) != 1 {
			t.Fatalf("group %s raising its fence: %v %v", g.group, raised, err)
		}
	}
	byA := claim(t, s, "a", 3, 10, 4)
	byB := claim(t, s, "b", 3, 11, 10)
	if len(byA) != 4 || len(byB) != 6 {
		t.Fatalf("a claimed %d and b %d of 10", len(byA), len(byB))
	}
	seen := map[int64]bool{}
	for _, task := range append(slices.Clone(byA), byB...) {
		if seen[task.ID] {
			t.Fatalf("task %d claimed by both groups", task.ID)
		}
		seen[task.ID] = true
	}
	// Group B's unit moves to b2: B's claims go back to the lane, A's stay.
	_, requeued, _, err := raiseFences(s, ctx, "b2", "gB", []claims.ShardEpoch{{Shard: 3, Epoch: 12}})
	if err != nil || requeued != 6 {
		t.Fatalf("b2 raising group B's fence requeued %d (want b's 6): %v", requeued, err)
	}
	for _, task := range byA {
		if r := one(t)(s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(task)}})); r.Outcome != claims.Applied {
			t.Fatalf("a completing %d after group B moved: %v", task.ID, r.Outcome)
		}
	}
	if r := one(t)(s.Complete(ctx, "b", []claims.Completion{{Ref: claims.RefOf(byB[0])}})); r.Outcome != claims.FenceLost {
		t.Fatalf("b completing after its unit moved: %v", r.Outcome)
	}
	if got := claim(t, s, "b2", 3, 12, 10); len(got) != 6 {
		t.Fatalf("b2 claimed %d of the 6 requeued", len(got))
	}
}

// TestFenceRaiseWaitsForClaimsInFlight holds a claim's transaction open
// (the fence row locked FOR SHARE, a ready entry taken into a claim, as
// Claim does) and checks that raising the fence waits for it, that the
// raise's requeue then takes back what that claim took, and that a
// completion starting after the raise changes nothing.
func TestFenceRaiseWaitsForClaimsInFlight(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	enqueue(t, s, insert("k", 4, 3))
	late := enqueue(t, s, insert("k", 4, 3))
	raise(t, s, "old", 4, 1)
	mine := claim(t, s, "old", 4, 1, 1)

	tx, err := s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM shard_fences WHERE shard = 4 FOR SHARE`); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `WITH r AS (DELETE FROM task_ready WHERE id = $1 RETURNING id, shard)
		INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt) SELECT id, shard, 'default', 1, 'old', 1 FROM r`, late); err != nil {
		t.Fatal(err)
	}
	type raiseResult struct {
		requeued int64
		err      error
	}
	raised := make(chan raiseResult, 1)
	go func() {
		_, requeued, _, err := raiseFences(s, ctx, "new", "", []claims.ShardEpoch{{Shard: 4, Epoch: 2}})
		raised <- raiseResult{requeued, err}
	}()
	waitForLock(t, s, raised, "INSERT INTO shard_fences")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-raised; r.err != nil || r.requeued != 2 {
		t.Fatalf("raise after the claim committed: requeued %d (want both claims), %v", r.requeued, r.err)
	}
	if task := get(t, s, late); task.State != tasks.Ready || task.Attempt != 2 {
		t.Fatalf("the claim made during the raise was not requeued: %+v", task)
	}
	if r := one(t)(s.Complete(ctx, "old", []claims.Completion{{Ref: claims.RefOf(mine[0])}})); r.Outcome != claims.FenceLost {
		t.Fatalf("completion after the raise: %v", r.Outcome)
	}
}

// TestARaiseSkipsAClaimAWriteHolds: a completion of the old owner that
// locked its claim row before the new owner's requeue reached it is not
// waited for: the raise commits at once and reports the unit's orphans
// pending; the write lands; the requeue that comes back finds the claim
// gone and requeues nothing: the task has one outcome.
func TestARaiseSkipsAClaimAWriteHolds(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	id := enqueue(t, s, insert("k", 5, 3))
	raise(t, s, "old", 5, 1)
	claim(t, s, "old", 5, 1, 1)
	tx, err := s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `DELETE FROM task_claims WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `WITH u AS (UPDATE tasks SET state = 'completed', finished_at = now() WHERE id = $1 RETURNING id, finished_at)
		INSERT INTO task_finished (state, id, finished_at, queue) SELECT 'completed', id, finished_at, 'default' FROM u`, id); err != nil {
		t.Fatal(err)
	}
	term := []claims.ShardEpoch{{Shard: 5, Epoch: 2}}
	o, err := s.RaiseFences(ctx, "new", "", term)
	if err != nil || len(o.Raised) != 1 || o.Requeued+o.Dead != 0 || !slices.Equal(o.Pending, term) {
		t.Fatalf("raise while a write holds the old claim: %+v %v, want raised with the unit pending", o, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if o, err := s.RequeueOrphans(ctx, "new", "", term); err != nil || o.Requeued+o.Dead != 0 || len(o.Pending) != 0 {
		t.Fatalf("requeue after the write landed: %+v %v, want nothing to do", o, err)
	}
	if task := get(t, s, id); task.State != tasks.Completed || task.Attempt != 1 {
		t.Fatalf("task after the race: %+v", task)
	}
}

// waitForLock waits until a statement whose text holds query waits for a
// lock, failing if done reports first: a blocked statement, not a slow one.
func waitForLock[T any](t *testing.T, s *store.Store, done <-chan T, query string) {
	t.Helper()
	testutil.Until(t, 10*time.Second, "waiting on a lock: "+query, func() (bool, string) {
		select {
		case r := <-done:
			t.Fatalf("did not wait for the lock: %+v", r)
		default:
		}
		var waiting bool
		err := s.Pool().QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%')`, query).Scan(&waiting)
		return err == nil && waiting, fmt.Sprintf("not waiting on a lock (%v)", err)
	})
}

func TestConcurrentClaimersNeverShareATask(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	const total, shards = 10000, 16
	owned := make([]claims.ShardEpoch, shards)
	ins := make([]store.Insert, total)
	for i := range ins {
		ins[i] = insert("k", i%shards, 3)
	}
	for i := range owned {
		owned[i] = claims.ShardEpoch{Shard: i, Epoch: 7}
	}
	if n, err := s.EnqueueBatch(ctx, ins); err != nil || n != total {
		t.Fatalf("enqueue: %d %v", n, err)
	}
	if _, _, _, err := raiseFences(s, ctx, "r", "", owned); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := make(map[int64]int, total)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			for {
				got, err := s.Claim(ctx, "r", owned, tasks.DefaultQueue, []string{"k"}, 50, 50)
				if err != nil {
					errs <- err
					return
				}
				if len(got) == 0 {
					return
				}
				done := make([]claims.Completion, len(got))
				mu.Lock()
				for i, task := range got {
					seen[task.ID]++
					done[i] = claims.Completion{Ref: claims.RefOf(task)}
				}
				mu.Unlock()
				rs, err := s.Complete(ctx, "r", done)
				if err != nil {
					errs <- err
					return
				}
				for _, r := range rs {
					if r.Outcome != claims.Applied {
						errs <- fmt.Errorf("completion of %d: %v", r.Ref.ID, r.Outcome)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(seen) != total {
		t.Fatalf("claimed %d distinct tasks, want %d", len(seen), total)
	}
	for id, n := range seen {
		if n != 1 {
			t.Fatalf("task %d claimed %d times", id, n)
		}
	}
	counts, err := s.CountByState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if counts[tasks.Completed] != total || counts[tasks.Ready] != 0 || counts[tasks.Running] != 0 {
		t.Fatalf("counts: %v", counts)
	}
}

// listen starts a listener on s for the test's duration and returns its
// notifications after the first, which must say all shards (it follows
// connecting).
func listen(t *testing.T, s *store.Store) <-chan store.Notification {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	notes := make(chan store.Notification, 64)
	l := s.NewListener(nil, func(n store.Notification) { notes <- n })
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	if n := <-notes; !n.All {
		t.Fatalf("first notification after connecting must say all shards: %+v", n)
	}
	return notes
}

func TestEnqueueBatchAndNotify(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	notes := listen(t, s)
	later := time.Now().Add(time.Hour)
	deadline := time.Now().Add(2 * time.Hour)
	ins := []store.Insert{insert("k", 3, 2), insert("k", 5, 2), {NewTask: tasks.NewTask{Kind: "k", Payload: json.RawMessage(`[1]`), Options: tasks.Options{Key: "x", MaxAttempts: 1, RunAfter: later, Deadline: deadline}.WithDefaults(0)}, Shard: 5}}
	if n, err := s.EnqueueBatch(ctx, ins); err != nil || n != 3 {
		t.Fatalf("enqueue batch: %d %v", n, err)
	}
	seen := map[int]bool{}
	for !seen[3] || !seen[5] {
		select {
		case n := <-notes:
			if n.All {
				t.Fatalf("unexpected catch-all notification")
			}
			for _, sh := range n.Shards {
				seen[sh] = true
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no notification for shards 3 and 5; saw %v", seen)
		}
	}
	counts, err := s.CountByState(ctx)
	if err != nil || counts[tasks.Ready] != 3 || len(counts) != len(tasks.States) {
		t.Fatalf("counts %v %v", counts, err)
	}
	var runAfter, dl time.Time
	if err := s.Pool().QueryRow(ctx, `SELECT run_after, deadline FROM tasks WHERE key = 'x'`).Scan(&runAfter, &dl); err != nil {
		t.Fatal(err)
	}
	if runAfter.Sub(later).Abs() > time.Millisecond || dl.Sub(deadline).Abs() > time.Millisecond {
		t.Fatalf("COPY lost run_after/deadline: %v %v", runAfter, dl)
	}
}

// The store's own single-row inserts skip the trigger and are notified
// after their commit; the quiet setting is the transaction's only, so raw
// SQL on the same connection afterwards is notified by the trigger.
func TestQuietEnqueueIsNotifiedAndRawSQLStillIs(t *testing.T) {
	t.Parallel()
	// Two connections (the least allowed): the raw insert runs on one that
	// has run quiet inserts.
	s, _ := pgtest.NewStore(t, store.Options{MaxConns: 2})
	ctx := context.Background()
	notes := listen(t, s)
	// The trigger skips a quiet transaction: notifications come in commit
	// order, so the first one is the raw insert's after it.
	if err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SELECT set_config('shardrun.notify', 'off', true);
			INSERT INTO tasks (kind, shard, key) VALUES ('k', 50, 'quiet')`)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	exec(t, s, `INSERT INTO tasks (kind, shard, key) VALUES ('k', 51, 'raw')`)
	if n := <-notes; n.All || !slices.Equal(n.Shards, []int{51}) {
		t.Fatalf("first notification %+v, want shard 51 only: the quiet insert must not notify", n)
	}
	want := map[int]bool{}
	var wg sync.WaitGroup
	for shard := range 8 {
		want[shard] = true
		wg.Go(func() {
			if _, err := s.Enqueue(ctx, insert("k", shard, 3)); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if _, err := s.Enqueue(ctx, uniqueInsert("quiet")); err != nil {
		t.Fatal(err)
	}
	exec(t, s, `INSERT INTO tasks (kind, shard, key) VALUES ('k', 77, 'raw')`)
	want[uniqueInsert("quiet").Shard], want[77] = true, true
	for len(want) > 0 {
		select {
		case n := <-notes:
			if n.All {
				t.Fatalf("unexpected catch-all notification")
			}
			for _, sh := range n.Shards {
				delete(want, sh)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no notification for shards %v", want)
		}
	}
}

func TestGetMissingTask(t *testing.T) {
	t.Parallel()
	s := setup(t)
	if _, err := s.Get(context.Background(), 42); err == nil || !strings.Contains(err.Error(), "task 42") {
		t.Fatalf("get of a missing task: %v", err)
	}
}

// The backoff (shardrun_backoff, the one formula): after the n-th failed
// attempt, min(cap, base * 2^(n-1)) scaled by a factor in [0.5, 1).
func TestSQLBackoff(t *testing.T) {
	t.Parallel()
	s := setup(t)
	for attempt, full := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 30: 10 * time.Second} {
		var lo, hi time.Duration
		if err := s.Pool().QueryRow(context.Background(), `
			SELECT min(d), max(d) FROM (SELECT shardrun_backoff($1, 1000, 10000) AS d FROM generate_series(1, 2000)) x`,
			attempt).Scan(&lo, &hi); err != nil {
			t.Fatal(err)
		}
		if lo < full/2 || hi >= full || hi-lo < full/4 {
			t.Errorf("attempt %d: backoff in [%s, %s], want [%s, %s)", attempt, lo, hi, full/2, full)
		}
	}
}

// A batch can carry a stale attempt and the current attempt of one task
// (a late handler of the old epoch and the re-run of the new one): only the
// current one applies, and the stale one is reported as fenced out.
func TestBatchWithStaleAndCurrentAttemptOfOneTask(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	id := enqueue(t, s, insert("k", 6, 3))
	raise(t, s, "a", 6, 1)
	old := claim(t, s, "a", 6, 1, 1)[0]
	raise(t, s, "a", 6, 2)
	cur := claim(t, s, "a", 6, 2, 1)[0]
	rs, err := s.Complete(ctx, "a", []claims.Completion{{Ref: claims.RefOf(old)}, {Ref: claims.RefOf(cur)}})
	if err != nil {
		t.Fatal(err)
	}
	if rs[0].Outcome != claims.FenceLost || rs[1].Outcome != claims.Applied {
		t.Fatalf("stale then current in one batch: %v, %v", rs[0].Outcome, rs[1].Outcome)
	}
	if task := get(t, s, id); task.State != tasks.Completed || task.Attempt != 2 || task.Epoch != 2 {
		t.Fatalf("row: %+v", task)
	}
}

func TestSweepsApplyOnlyUnderTheLeaderFence(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 1, 1)
	enqueue(t, s, insert("k", 1, 3))
	claim(t, s, "a", 1, 1, 1)
	retime(t, s, "claimed_at", "now() - interval '1 hour'")
	retime(t, s, "deadline", "now() - interval '1 second'")
	if ok, err := s.RaiseLeaderFence(ctx, "new-leader", leaderEpoch+10); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if _, err := s.SweepDeadlines(ctx, leaderEpoch, 0, 10); !errors.Is(err, store.ErrNotLeader) {
		t.Fatalf("deposed leader's deadline sweep: %v", err)
	}
	if _, _, err := s.SweepStale(ctx, leaderEpoch, time.Minute, 10, backoff); !errors.Is(err, store.ErrNotLeader) {
		t.Fatalf("deposed leader's stale sweep: %v", err)
	}
	if ok, _ := s.RaiseLeaderFence(ctx, "old-leader", leaderEpoch); ok {
		t.Fatal("an older leadership epoch lowered the fence")
	}
	if counts, _ := s.CountByState(ctx); counts[tasks.Running] != 1 {
		t.Fatalf("a deposed leader changed rows: %v", counts)
	}
	if n, err := s.SweepDeadlines(ctx, leaderEpoch+10, 0, 10); err != nil || n != 1 {
		t.Fatalf("current leader's sweep: %d %v", n, err)
	}
}

// A final failure buries the task whatever attempts it has left; others
// retry.
func TestFinalFailureBuries(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 3, 1)
	final := enqueue(t, s, insert("k", 3, 5))
	again := enqueue(t, s, insert("k", 3, 5))
	got := claim(t, s, "a", 3, 1, 2)
	var fs []claims.Failure
	for _, task := range got {
		fs = append(fs, claims.Failure{Ref: claims.RefOf(task), Error: "no", Backoff: claims.Backoff{Base: time.Millisecond, Cap: time.Millisecond}, Final: task.ID == final})
	}
	if _, err := s.Fail(ctx, "a", fs); err != nil {
		t.Fatal(err)
	}
	if st := get(t, s, final); st.State != tasks.Dead || st.Attempt != 1 {
		t.Errorf("final failure: %s at attempt %d, want dead at 1", st.State, st.Attempt)
	}
	if st := get(t, s, again); st.State != tasks.Ready || st.Attempt != 2 {
		t.Errorf("ordinary failure: %s at attempt %d, want ready at 2", st.State, st.Attempt)
	}
}

// A batch is written in id order whatever order the caller gives it in
// (concurrent heartbeats and writes then lock rows in one order); every
// task still gets its own error text and its own result slot.
func TestFailBatchInAnyOrderKeepsEachTasksColumns(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 2, 1)
	for i := range 5 {
		in := insert("k", 2, 3)
		in.Key = fmt.Sprint("order-", i)
		enqueue(t, s, in)
	}
	claimed := claim(t, s, "a", 2, 1, 5)
	if len(claimed) != 5 {
		t.Fatalf("claimed %d", len(claimed))
	}
	var failed []claims.Failure
	for i := len(claimed) - 1; i >= 0; i-- { // descending ids
		c := claimed[i]
		failed = append(failed, claims.Failure{Ref: claims.RefOf(c), Error: fmt.Sprint("error of ", c.ID), Final: i%2 == 0})
	}
	rs, err := s.Fail(ctx, "a", failed)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range rs {
		want := tasks.Ready
		if failed[i].Final {
			want = tasks.Dead
		}
		if r.Ref != failed[i].Ref || r.State != want {
			t.Fatalf("result %d: %+v, want ref %+v state %s", i, r, failed[i].Ref, want)
		}
		got := get(t, s, r.Ref.ID)
		if got.State != want || got.Errors[len(got.Errors)-1].Error != fmt.Sprint("error of ", got.ID) {
			t.Fatalf("task %d: state %s errors %+v", got.ID, got.State, got.Errors)
		}
	}
}

// Claimed lists exactly the owner's running claims under the given terms.
func TestClaimedListsTheOwnersClaimsUnderItsTerms(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 4, 1)
	raise(t, s, "b", 5, 1)
	for i, shard := range []int{4, 4, 5} {
		in := insert("k", shard, 3)
		in.Key = fmt.Sprint("claimed-", i)
		enqueue(t, s, in)
	}
	mine := claim(t, s, "a", 4, 1, 10)
	claim(t, s, "b", 5, 1, 10)
	if len(mine) != 2 {
		t.Fatalf("claimed %d on shard 4", len(mine))
	}
	got, err := s.Claimed(ctx, "a", []claims.ShardEpoch{{Shard: 4, Epoch: 1}, {Shard: 5, Epoch: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Shard != 4 || got[1].Shard != 4 {
		t.Fatalf("claims of a: %+v", got)
	}
	if got, err := s.Claimed(ctx, "a", []claims.ShardEpoch{{Shard: 4, Epoch: 2}}); err != nil || len(got) != 0 {
		t.Fatalf("under another epoch: %+v %v", got, err)
	}
}

// An expired failure ends the task failed whatever attempts it has left;
// a final one ends it dead.
func TestFailExpiredEndsFailedAndFinalEndsDead(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	raise(t, s, "a", 6, 1)
	for i := range 2 {
		in := insert("k", 6, 5)
		in.Key = fmt.Sprint("expired-", i)
		enqueue(t, s, in)
	}
	c := claim(t, s, "a", 6, 1, 2)
	rs, err := s.Fail(ctx, "a", []claims.Failure{
		{Ref: claims.RefOf(c[0]), Error: "deadline exceeded", Expired: true},
		{Ref: claims.RefOf(c[1]), Error: "bad payload", Final: true},
	})
	if err != nil {
		t.Fatal(err)
	}
	if rs[0].State != tasks.Failed || rs[1].State != tasks.Dead {
		t.Fatalf("states %s and %s, want failed and dead", rs[0].State, rs[1].State)
	}
	if got := get(t, s, c[0].ID); got.FinishedAt == nil || got.Attempt != 1 {
		t.Fatalf("expired task: %+v", got)
	}
}

// listenConn opens a connection of its own to dsn that LISTENs on the enqueue
// channel, closed when the test ends.
func listenConn(ctx context.Context, t testing.TB, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, "LISTEN "+store.NotifyChannel); err != nil {
		t.Fatal(err)
	}
	return conn
}
