package shard

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

func TestGroupOfIgnoresOrderAndRepeats(t *testing.T) {
	a := GroupOf([]string{"emails", "default"}, []string{"send", "noop"})
	if b := GroupOf([]string{"default", "emails", "emails"}, []string{"noop", "send"}); a != b {
		t.Errorf("same capabilities, two groups: %s, %s", a, b)
	}
	// The lists are kept apart: a queue named like a kind is not a kind.
	if GroupOf([]string{"x"}, nil) == GroupOf(nil, []string{"x"}) {
		t.Error("queue x and kind x make one group")
	}
	if GroupOf([]string{"a", "b"}, nil) == GroupOf([]string{"a\x00b"}, nil) {
		t.Error("two queues and one queue holding the separator make one group")
	}
}

func TestRunnableCountsAttachedRunnersOnly(t *testing.T) {
	got := Runnable([]RunnerInfo{
		{ID: "a", State: StateAttached, Queues: []string{"q"}, Kinds: []string{"k", "l"}},
		{ID: "b", State: StateDetached, Queues: []string{"gpu"}, Kinds: []string{"render"}},
	})
	want := map[tasks.Class]bool{{Queue: "q", Kind: "k"}: true, {Queue: "q", Kind: "l"}: true}
	if len(got) != len(want) || !got[tasks.Class{Queue: "q", Kind: "k"}] || !got[tasks.Class{Queue: "q", Kind: "l"}] {
		t.Errorf("Runnable: %v; want %v (a detached runner runs nothing)", got, want)
	}
}

// TestGroupsOwnTheirShardsApart: runners with different queues or kinds
// each own every shard of their group, balanced within it; a runner that
// joins or leaves one group moves no shard of another; the only member of
// a group that dies takes the group's ownership with it when its lease
// ends, and the other groups do not notice.
func TestGroupsOwnTheirShardsApart(t *testing.T) {
	c := newCluster(t, 32)
	w := c.watchShards()
	emails := serving([]string{"emails"}, []string{"send"})
	gpu := serving([]string{"default"}, []string{"render"})
	both := serving([]string{"default", "emails"}, []string{"render", "send"})
	c.add("e1", false, emails)
	c.add("e2", false, emails)
	c.add("g1", false, gpu)
	b1 := c.add("b1", true, both)
	took := c.waitConverged(10 * time.Second)
	t.Logf("three groups (2, 1 and 1 members) converged on 32 shards each in %s", took)

	group := map[string]string{}
	for _, m := range c.live() {
		group[m.id] = m.mgr.Group()
	}
	if group["e1"] != group["e2"] || group["e1"] == group["g1"] || group["g1"] == group["b1"] || group["e1"] == group["b1"] {
		t.Fatalf("groups %v; want e1 and e2 together and g1, b1 apart", group)
	}
	gpuBefore := c.groupOwners(group["g1"])

	// A join to the emails group moves shards inside it only.
	c.add("e3", false, emails)
	c.waitConverged(10 * time.Second)
	if after := c.groupOwners(group["g1"]); !slices.Equal(after, gpuBefore) {
		t.Errorf("a join to another group moved %d of the gpu group's shards", Moved(gpuBefore, after))
	}

	// The only member of a group crashes: its shards stay its own until
	// its lease ends, then the group owns nothing; no other group moves.
	emailsBefore := c.groupOwners(group["e1"])
	b1.proxy.Blackhole()
	testutil.Until(t, 3*c.ttl, "the crashed group's shards freed", func() (bool, string) {
		for s, o := range c.groupOwners(group["b1"]) {
			if o != "" {
				return false, fmt.Sprintf("shard %d still held by %s", s, o)
			}
		}
		return true, ""
	})
	b1.crashStop()
	if after := c.groupOwners(group["e1"]); !slices.Equal(after, emailsBefore) {
		t.Errorf("a crash in another group moved %d of the emails group's shards", Moved(emailsBefore, after))
	}
	if after := c.groupOwners(group["g1"]); !slices.Equal(after, gpuBefore) {
		t.Errorf("a crash in another group moved %d of the gpu group's shards", Moved(gpuBefore, after))
	}

	// A runner that rejoins with the crashed group's capabilities owns
	// all of its shards again.
	c.add("b2", false, both)
	c.waitConverged(10 * time.Second)
	c.checkNoDoubleOwnership()
	t.Logf("checked %d etcd events", w.check(c))
}
