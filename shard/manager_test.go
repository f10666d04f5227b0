package shard

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

func TestJoinRebalanceAndGracefulLeave(t *testing.T) {
	c := newCluster(t, 64)
	w := c.watchShards()
	for _, id := range []string{"a", "b", "c"} {
		c.add(id, false)
	}
	took := c.waitConverged(10 * time.Second)
	t.Logf("3 members converged on 64 shards in %s", took)
	before := c.etcdOwners()

	c.add("d", false)
	took = c.waitConverged(10 * time.Second)
	moved := Moved(before, c.etcdOwners())
	t.Logf("4th member joined: %d of 64 shards moved, converged in %s", moved, took)
	if bound := 16 + 3; moved > bound {
		t.Fatalf("%d shards moved when the 4th member joined; about a quarter (at most %d) should", moved, bound)
	}

	// A graceful leave: the leaver's shards are owned elsewhere within a
	// watch round trip, not a lease TTL.
	leaver := c.live()[1]
	its := map[int]bool{}
	for _, se := range leaver.mgr.Status().Owned {
		its[se.Shard] = true
	}
	go leaver.cancel()
	handoff := testutil.Until(t, c.ttl, "leaver's shards owned by others", func() (bool, string) {
		owners := c.etcdOwners()
		for s := range its {
			if owners[s] == "" || owners[s] == leaver.id {
				return false, "shard still free or held by the leaver"
			}
		}
		return true, ""
	})
	<-leaver.done
	leaver.forget()
	t.Logf("graceful leave: %d shards owned by others %s after the leave began (lease TTL %s)", len(its), handoff, c.ttl)
	if handoff >= time.Second {
		t.Fatalf("handoff took %s; it must not wait for the lease to expire", handoff)
	}
	c.waitConverged(10 * time.Second)
	c.checkNoDoubleOwnership()
	if n := w.check(c); n == 0 {
		t.Fatal("the etcd watcher saw no events")
	}
}

func TestBlackholedMemberDetachesBeforeOthersTakeOver(t *testing.T) {
	c := newCluster(t, 32)
	c.add("a", false)
	c.add("b", false)
	z := c.add("z", true)
	c.waitConverged(10 * time.Second)
	zShards := map[int]bool{}
	for _, se := range z.mgr.Status().Owned {
		zShards[se.Shard] = true
	}

	cut := time.Now()
	z.proxy.Blackhole()
	testutil.Until(t, 3*c.ttl, "others own z's shards", func() (bool, string) {
		owners := c.etcdOwners()
		for s := range zShards {
			if owners[s] == "" || owners[s] == "z" {
				return false, "not yet"
			}
		}
		return true, ""
	})
	var detachedAt, firstTakeover time.Time
	var takeover Event
	// A member records its acquisition after etcd has committed it: on a
	// loaded machine the key can be seen before the event.
	testutil.Until(t, 5*time.Second, "the takeover in the event log", func() (bool, string) {
		detachedAt, firstTakeover, takeover = time.Time{}, time.Time{}, Event{}
		for _, e := range c.log.Events() {
			switch {
			case e.Runner == "z" && e.Kind == Detached && e.At.After(cut) && detachedAt.IsZero():
				detachedAt = e.At
			case e.Runner != "z" && e.Kind == Acquired && zShards[e.Shard] && e.At.After(cut) && firstTakeover.IsZero():
				firstTakeover, takeover = e.Sent, e
			}
		}
		return !takeover.At.IsZero(), "no acquisition of z's shards recorded yet"
	})
	if firstTakeover.IsZero() {
		t.Fatalf("the first takeover has no send time: %+v", takeover)
	}
	if detachedAt.IsZero() {
		t.Fatal("z never detached")
	}
	t.Logf("blackhole: z detached %s after the cut; the first takeover Txn was sent %s after the cut (gap %s)",
		detachedAt.Sub(cut), firstTakeover.Sub(cut), firstTakeover.Sub(detachedAt))
	if !detachedAt.Before(firstTakeover) {
		t.Fatalf("z detached at %s, not before another member sent its takeover at %s", detachedAt, firstTakeover)
	}

	healed := time.Now()
	z.proxy.Pass()
	c.waitConverged(15 * time.Second)
	var attachedAt time.Time
	for _, e := range c.log.Events() {
		if e.Runner == "z" && e.Kind == Attached && e.At.After(healed) {
			attachedAt = e.At
		}
	}
	if attachedAt.IsZero() {
		t.Fatal("z did not re-attach")
	}
	t.Logf("z re-attached %s after the heal and took back %d shards", attachedAt.Sub(healed), len(z.mgr.Status().Owned))
	if attachedAt.Sub(healed) < 500*time.Millisecond {
		t.Fatalf("z re-attached %s after the heal, before its 500ms recovery window", attachedAt.Sub(healed))
	}
	c.checkNoDoubleOwnership()
}

func TestLeaseRevokedFromOutside(t *testing.T) {
	c := newCluster(t, 16)
	a := c.add("a", false)
	c.add("b", false)
	c.waitConverged(10 * time.Second)
	if _, err := c.admin.Revoke(context.Background(), clientv3.LeaseID(a.mgr.Status().LeaseID)); err != nil {
		t.Fatal(err)
	}
	testutil.Until(t, 5*time.Second, "a detached for its lease", func() (bool, string) {
		st := a.machine.Status()
		return st.Detached || len(a.mgr.Status().Owned) == 0, "still attached"
	})
	lost := false
	for _, e := range c.log.Events() {
		lost = lost || (e.Runner == "a" && e.Kind == Lost)
	}
	if !lost {
		t.Fatal("a never dropped the shards whose keys vanished")
	}
	testutil.Until(t, 5*time.Second, "a detached", func() (bool, string) {
		for _, e := range c.log.Events() {
			if e.Runner == "a" && e.Kind == Detached {
				return true, ""
			}
		}
		return false, "no detach event"
	})
	// a gets a new lease, waits out the recovery window and comes back.
	c.waitConverged(15 * time.Second)
	if got := a.mgr.Status().LeaseID; got == 0 {
		t.Fatal("no new lease")
	}
}

func TestConcurrentLeavesAndJoins(t *testing.T) {
	c := newCluster(t, 64)
	w := c.watchShards()
	for _, id := range []string{"a", "b", "c", "d", "e"} {
		c.add(id, false)
	}
	c.waitConverged(10 * time.Second)
	ms := c.live()
	done := make(chan struct{}, 4)
	for _, m := range ms[:2] {
		go func() { m.leave(); done <- struct{}{} }()
	}
	for _, id := range []string{"f", "g"} {
		go func() { c.add(id, false); done <- struct{}{} }()
	}
	for range 4 {
		<-done
	}
	took := c.waitConverged(15 * time.Second)
	t.Logf("two leaves and two joins at once converged in %s", took)
	c.checkNoDoubleOwnership()
	t.Logf("checked %d etcd events", w.check(c))
}

func TestManualDetachReleasesAndAttachReturns(t *testing.T) {
	c := newCluster(t, 16)
	a := c.add("a", false)
	b := c.add("b", false)
	c.waitConverged(10 * time.Second)
	a.machine.Detach(detach.Reason{Kind: detach.Manual, Detail: "test"})
	took := testutil.Until(t, 5*time.Second, "b owns every shard", func() (bool, string) {
		for _, o := range c.etcdOwners() {
			if o != "b" {
				return false, "a shard is not b's"
			}
		}
		return len(b.mgr.Status().Owned) == 16, "b's view lags"
	})
	t.Logf("manual detach: all of a's shards owned by b %s later", took)
	if st := a.mgr.Status(); st.State != StateDetached || len(st.Owned) != 0 {
		t.Fatalf("a after manual detach: %+v", st)
	}
	attach := time.Now()
	a.machine.Attach()
	c.waitConverged(10 * time.Second)
	if since := time.Since(attach); since < 500*time.Millisecond {
		t.Fatalf("a re-attached %s after attach, inside its recovery window", since)
	}
	c.checkNoDoubleOwnership()
}

// work marks every term of m fenced (as the executor does once it raised
// the fences) and returns a hold on them.
func work(t *testing.T, m *member) *Hold {
	t.Helper()
	m.mgr.Fenced(m.mgr.Unfenced())
	return m.mgr.Hold()
}

func TestHandoffWaitsForInflightWork(t *testing.T) {
	c := newCluster(t, 8)
	a := c.add("a", false, withHandoff(time.Minute))
	c.waitConverged(10 * time.Second)
	hold := work(t, a)
	owned := hold.Terms()
	if len(owned) != 8 {
		t.Fatalf("a holds %d terms, want 8", len(owned))
	}
	// Work on every shard, then let b join: the shards b gets must not be
	// released while the work runs.
	dones := map[int]func(){}
	for _, se := range owned {
		ctx, done, ok := hold.Begin(se.Shard, se.Epoch)
		if !ok || ctx.Err() != nil {
			t.Fatalf("Begin on held shard %d failed", se.Shard)
		}
		dones[se.Shard] = done
	}
	if _, _, ok := hold.Begin(owned[0].Shard, owned[0].Epoch+1); ok {
		t.Fatal("Begin with a wrong epoch succeeded")
	}
	hold.Release()
	b := c.add("b", false)
	testutil.Until(t, 5*time.Second, "a marks shards for release", func() (bool, string) {
		return len(a.mgr.Status().Releasing) == 4, "releasing not yet 4"
	})
	releasing := a.mgr.Status().Releasing
	again := a.mgr.Hold()
	if slices.ContainsFunc(again.Terms(), func(se claims.ShardEpoch) bool { return se.Shard == releasing[0] }) {
		t.Fatal("a new hold pins a shard being released")
	}
	again.Release()
	owners := c.etcdOwners()
	for _, s := range releasing {
		if owners[s] != "a" {
			t.Fatalf("shard %d released while work was in flight", s)
		}
	}
	for _, s := range releasing {
		dones[s]()
	}
	c.waitConverged(5 * time.Second)
	if len(b.mgr.Status().Owned) != 4 {
		t.Fatal("b did not get its shards after the work finished")
	}
	for _, se := range a.mgr.Status().Owned {
		dones[se.Shard]()
	}
}

func TestHandoffTimeoutCancelsWork(t *testing.T) {
	c := newCluster(t, 2)
	a := c.add("a", false, withHandoff(300*time.Millisecond))
	c.waitConverged(10 * time.Second)
	hold := work(t, a)
	var ctxs []context.Context
	for _, se := range hold.Terms() {
		ctx, done, _ := hold.Begin(se.Shard, se.Epoch)
		defer done()
		ctxs = append(ctxs, ctx)
	}
	hold.Release()
	c.add("b", false)
	took := testutil.Until(t, 5*time.Second, "one shard's work cancelled", func() (bool, string) {
		n := 0
		for _, ctx := range ctxs {
			if ctx.Err() != nil {
				n++
			}
		}
		return n == 1, "no cancellation yet"
	})
	for _, ctx := range ctxs {
		if ctx.Err() != nil && !errors.Is(context.Cause(ctx), tasks.ErrOwnershipLost) {
			t.Errorf("a cancelled term's cause is %v, want one wrapping tasks.ErrOwnershipLost", context.Cause(ctx))
		}
	}
	t.Logf("work on the moving shard cancelled %s after the join (handoff timeout 300ms)", took)
	c.waitConverged(5 * time.Second)
}

func TestStartRefusesAMismatchedShardCount(t *testing.T) {
	c := newCluster(t, 16)
	c.add("a", false)
	c.shards = 32
	_, err := c.start("b", false)
	if !errors.Is(err, ErrShardCountMismatch) || !strings.Contains(err.Error(), "--shard-count") ||
		!strings.Contains(err.Error(), "16 shards") {
		t.Fatalf("start with another shard count: %v", err)
	}
}

func TestStartRefusesADuplicateRunnerID(t *testing.T) {
	c := newCluster(t, 4)
	c.ttl = time.Second
	c.add("a", false)
	_, err := c.start("a", false)
	if err == nil || !strings.Contains(err.Error(), "--runner-id") {
		t.Fatalf("second runner with the same id: %v", err)
	}
}

func TestConfigValidation(t *testing.T) {
	base := func() Config {
		return Config{Client: &clientv3.Client{}, Detach: detach.New(detach.Config{}), Prefix: "/p/", RunnerID: "r", ShardCount: 4}
	}
	for flag, mutate := range map[string]func(*Config){
		"--etcd-prefix":        func(c *Config) { c.Prefix = "/p" },
		"--runner-id":          func(c *Config) { c.RunnerID = "a/b" },
		"--shard-count":        func(c *Config) { c.ShardCount = -1 },
		"--lease-ttl":          func(c *Config) { c.LeaseTTL = 1500 * time.Millisecond },
		"--detach-margin":      func(c *Config) { c.LeaseTTL, c.DetachMargin = 3*time.Second, 3*time.Second },
		"--keepalive-failures": func(c *Config) { c.FailureThreshold = -1 },
	} {
		cfg := base()
		mutate(&cfg)
		if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s: got %v", flag, err)
		}
	}
}
