package store_test

import (
	"context"
	"errors"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/faultproxy"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// A database that is down does not stop the others: the runner's writes
// for its claims are answered Busy while the other database's land, its
// fences are left to raise later, claims go on at the other database, the
// poll's probe reads the other database and reports its shards unread, a
// producer of its shards gets an error naming it; and once it is back its
// writes land again.
func TestADatabaseDownDoesNotStopTheOthers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, _ := pgtest.NewStore(t, store.Options{MaxConns: 10})
	// b is reached through a proxy that can cut it off.
	dsn := pgtest.NewDatabase(t)
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := faultproxy.New(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	u.Host = proxy.Addr()
	b, err := store.Open(ctx, u.String(), store.Options{MaxConns: 10, ConnectTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	m := store.NewMap([]string{"a", "b"}, 8)
	m.Rev = 1
	for _, st := range []*store.Store{a, b} {
		if _, err := st.EnsureShardCount(ctx, 8); err != nil {
			t.Fatal(err)
		}
	}
	r, err := store.NewRouter(map[string]*store.Store{"a": a, "b": b}, m, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	if err := r.Register(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, err := r.RaiseLeaderFence(ctx, "test-coordinator", leaderEpoch); err != nil || !ok {
		t.Fatalf("raising the coordinator fence: %v %v", ok, err)
	}
	for i, shard := range []int{1, 5, 2, 6} {
		if _, err := r.Enqueue(ctx, insert("k", shard, 3)); err != nil {
			t.Fatalf("task %d: %v", i, err)
		}
	}
	terms := []claims.ShardEpoch{{Shard: 1, Epoch: 1}, {Shard: 5, Epoch: 1}}
	if o, err := r.RaiseFences(ctx, "r1", "", terms); err != nil || len(o.Raised) != 2 {
		t.Fatalf("raise: %+v %v", o, err)
	}
	got, err := r.Claim(ctx, "r1", terms, tasks.DefaultQueue, []string{"k"}, 10, 10)
	if err != nil || len(got) != 2 {
		t.Fatalf("claim: %d %v", len(got), err)
	}
	refs := []claims.Ref{claims.RefOf(got[0]), claims.RefOf(got[1])}
	slices.SortFunc(refs, func(x, y claims.Ref) int { return x.Shard - y.Shard })

	proxy.Reset() // b is down
	if got := outcomes(t)(r.Heartbeat(ctx, "r1", refs)); !slices.Equal(got, []claims.Outcome{claims.Applied, claims.Busy}) {
		t.Fatalf("heartbeat with b down: %v, want a's applied and b's busy", got)
	}
	if got := outcomes(t)(r.Complete(ctx, "r1", []claims.Completion{{Ref: refs[0]}, {Ref: refs[1]}})); !slices.Equal(got, []claims.Outcome{claims.Applied, claims.Busy}) {
		t.Fatalf("completions with b down: %v, want a's applied and b's busy", got)
	}
	if got := outcomes(t)(r.Heartbeat(ctx, "r1", refs[1:])); got[0] != claims.Busy {
		t.Fatalf("a write of b's alone with b down: %v, want busy (not an error that holds up the writer)", got)
	}
	more := []claims.ShardEpoch{{Shard: 2, Epoch: 1}, {Shard: 6, Epoch: 1}}
	o, err := r.RaiseFences(ctx, "r1", "", more)
	if err != nil || !slices.Equal(o.Raised, more[:1]) || !slices.Equal(o.Unreached, more[1:]) {
		t.Fatalf("raise with b down: %+v %v, want shard 2 raised and shard 6 unreached", o, err)
	}
	claimed, err := r.Claim(ctx, "r1", more[:1], tasks.DefaultQueue, []string{"k"}, 10, 10)
	if err != nil || len(claimed) != 1 || claimed[0].Shard != 2 {
		t.Fatalf("claim at a with b down: %+v %v", claimed, err)
	}
	claimed, err = r.Claim(ctx, "r1", []claims.ShardEpoch{{Shard: 6, Epoch: 1}, {Shard: 1, Epoch: 1}}, tasks.DefaultQueue, []string{"k"}, 10, 10)
	var partial *claims.PartialError
	if err != nil && !errors.As(err, &partial) || len(claimed) != 0 {
		t.Fatalf("claim over both with b down: %+v %v", claimed, err)
	}
	if _, err := r.Enqueue(ctx, insert("k", 7, 3)); err == nil || !strings.Contains(err.Error(), "database b") || !r.Unavailable(err) {
		t.Fatalf("enqueue into b while it is down: %v, want unavailability naming database b", err)
	}
	if _, err := r.Enqueue(ctx, insert("k", 3, 3)); err != nil {
		t.Fatalf("enqueue into a while b is down: %v", err)
	}
	// The poll's probe (issue 41) reads a's lanes and reports b's shards
	// unread, so that the runner claims there as it would without a probe.
	found, unreadFrom, err := r.ReadyQueues(ctx, []int{3, 6}, []string{tasks.DefaultQueue}, []string{"k"})
	if err != nil || !slices.Equal(found[tasks.DefaultQueue], []int{3}) || unreadFrom != 6 {
		t.Fatalf("probe over a and b with b down: %v, unread from %d, %v; want shard 3 found and b's shard 6 unread", found, unreadFrom, err)
	}
	if n, err := r.SweepDeadlines(ctx, leaderEpoch, store.SkipRunning, 10); err == nil || !strings.Contains(err.Error(), "database b") || n != 0 {
		t.Fatalf("a leader pass with b down: %d %v, want a's done and b's error naming it", n, err)
	}

	proxy.Pass() // b is back
	// A ping of the health watcher that reached b makes it usable at
	// once, whenever its prober's next ping is due. (The pool's
	// connections the outage broke are closed first: pgx pings a
	// connection idle for over a second before using it, and this
	// outage was shorter.)
	b.Pool().Reset()
	r.Reached("b")
	if _, err := r.Enqueue(ctx, insert("k", 7, 3)); err != nil {
		t.Fatalf("enqueue into b once a ping reached it: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := r.Complete(ctx, "r1", []claims.Completion{{Ref: refs[1]}})
		if err != nil {
			t.Fatal(err)
		}
		if res[0].Outcome == claims.Applied {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("b's completion still %v 30s after b came back", res[0].Outcome)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if task := get(t, b, refs[1].ID); task.State != tasks.Completed {
		t.Fatalf("b's task %+v", task)
	}
}
