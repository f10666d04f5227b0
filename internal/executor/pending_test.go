package executor

import (
	"slices"
	"testing"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

func shards(terms []claims.ShardEpoch) []int {
	out := make([]int, len(terms))
	for i, t := range terms {
		out[i] = t.Shard
	}
	return out
}

// The order a claim visits shards in: all pending at first; a claim that
// took fewer than it asked drains every shard it visited; a claim that
// filled its limit drains those before its last shard and the next one
// starts after it; notifications make shards pending again, and urgent
// ones are also handed out first, for a claim of urgent tasks only; a
// notification of every shard makes every shard pending.
func TestPendingShardsOrder(t *testing.T) {
	p := newPending(false)
	held := []claims.ShardEpoch{{Shard: 1, Epoch: 1}, {Shard: 2, Epoch: 1}, {Shard: 3, Epoch: 1}, {Shard: 4, Epoch: 1}}
	first, order := p.order(held)
	if got := shards(order); !slices.Equal(got, []int{1, 2, 3, 4}) || len(first) != 0 {
		t.Fatalf("first order %v (urgent %v), want every held shard and none urgent", got, shards(first))
	}
	// The claim took its limit of 2, the last from shard 2: shard 1 is
	// drained, shard 2 may have more, the next claim starts at 3.
	p.claimed(order, []tasks.Task{{Shard: 1}, {Shard: 2}}, 2)
	if _, got := p.order(held); !slices.Equal(shards(got), []int{3, 4, 2}) {
		t.Fatalf("after a full claim %v, want [3 4 2]", shards(got))
	}
	// A claim that took fewer than it asked drained all it visited.
	p.claimed([]claims.ShardEpoch{{Shard: 3, Epoch: 1}, {Shard: 4, Epoch: 1}, {Shard: 2, Epoch: 1}}, []tasks.Task{{Shard: 4}}, 5)
	if _, got := p.order(held); len(got) != 0 || p.any() {
		t.Fatalf("after a short claim %v, want nothing pending", shards(got))
	}
	// Notifications: shard 3 plain, shards 1 and 4 urgent: both are handed
	// out for the urgent claim, and all three stay in the rotation (they
	// may have tasks of every priority), which goes on from shard 3.
	p.notify(false, []int{3}, []int{4, 1})
	first, order = p.order(held)
	if !slices.Equal(shards(first), []int{1, 4}) || !slices.Equal(shards(order), []int{3, 4, 1}) {
		t.Fatalf("after notifications urgent %v, rotation %v; want [1 4] and [3 4 1]", shards(first), shards(order))
	}
	// The urgent claim filled its limit from shard 1: shard 1 may have
	// more urgent tasks, shard 4 was not reached; both stay urgent, and
	// the next urgent claim starts after shard 1.
	p.urgentClaimed(first, []tasks.Task{{Shard: 1}, {Shard: 1}}, 2)
	if first, _ = p.order(held); !slices.Equal(shards(first), []int{4, 1}) {
		t.Fatalf("after a full urgent claim from shard 1: urgent %v, want [4 1]", shards(first))
	}
	// A short urgent claim drained both of urgent tasks; the rotation
	// still visits them.
	p.urgentClaimed(first, []tasks.Task{{Shard: 4}}, 5)
	if first, order = p.order(held); len(first) != 0 || !slices.Equal(shards(order), []int{3, 4, 1}) {
		t.Fatalf("after a short urgent claim: urgent %v, rotation %v; want none and [3 4 1]", shards(first), shards(order))
	}
	p.claimed(order, nil, 5)
	// A notification of every shard (the listener reconnected, or the
	// poll's probe failed) makes every held shard pending; a shard no
	// longer held is forgotten, a newly held one is pending.
	held = append(held[1:], claims.ShardEpoch{Shard: 9, Epoch: 1})
	p.notify(true, nil, nil)
	if _, got := p.order(held); len(got) != 4 || !slices.Contains(shards(got), 9) || slices.Contains(shards(got), 1) {
		t.Fatalf("after a notification of every shard %v, want 2, 3, 4 and 9", shards(got))
	}
}

// Urgent claims rotate between shards as the rotation's claims do: a
// shard with a backlog of urgent tasks must not take every urgent claim
// while another shard's urgent tasks wait (issue 32, defect 10: the
// lowest-numbered shard with urgent work starved the others).
func TestUrgentClaimsRotate(t *testing.T) {
	p := newPending(false)
	held := []claims.ShardEpoch{{Shard: 0, Epoch: 1}, {Shard: 5, Epoch: 1}, {Shard: 7, Epoch: 1}}
	p.notify(false, nil, []int{0, 5, 7})
	var served []int
	for range 6 {
		first, _ := p.order(held)
		if len(first) == 0 {
			t.Fatal("no urgent shard left")
		}
		// Each urgent claim fills its limit (1) from the first shard it
		// visits: every shard has a backlog of urgent tasks.
		served = append(served, first[0].Shard)
		p.urgentClaimed(first, []tasks.Task{{Shard: first[0].Shard}}, 1)
	}
	if !slices.Equal(served, []int{0, 5, 7, 0, 5, 7}) {
		t.Fatalf("urgent claims served shards %v, want each in turn: [0 5 7 0 5 7]", served)
	}
}

// TestAFullClaimSplitBetweenDatabasesDrainsPerDatabase: a claim split
// between two databases (shards 0-3 in one, 4-7 in the other) that filled
// its limit, taking from shards 1 and 5, drained shards 0 and 4 only:
// judged over the whole order it also marked 2 and 3 drained, the first
// database's backlog left unclaimed until the next poll.
func TestAFullClaimSplitBetweenDatabasesDrainsPerDatabase(t *testing.T) {
	p := newPending(false)
	p.partOf = func(shard int) int { return shard / 4 }
	held := make([]claims.ShardEpoch, 8)
	for i := range held {
		held[i] = claims.ShardEpoch{Shard: i, Epoch: 1}
	}
	_, order := p.order(held)
	p.claimed(order, []tasks.Task{{Shard: 1}, {Shard: 1}, {Shard: 5}, {Shard: 5}}, 4)
	_, got := p.order(held)
	if want := []int{2, 3, 1, 6, 7, 5}; !slices.Equal(shards(got), want) {
		t.Fatalf("after a full claim split between two databases: %v, want %v (0 and 4 drained, each database's rotation after its last shard: 1 and 5)", shards(got), want)
	}
	// One database: the shards before the last one taken from are drained,
	// as before.
	p = newPending(false)
	_, order = p.order(held)
	p.claimed(order, []tasks.Task{{Shard: 1}, {Shard: 5}}, 2)
	if _, got := p.order(held); !slices.Equal(shards(got), []int{6, 7, 5}) {
		t.Fatalf("after a full claim at one database: %v, want [6 7 5]", shards(got))
	}
}

// A claim split between parts (databases) fills each part's share from
// the first shards of the part it reaches: every part rotates through its
// own shards, whatever the other parts' claims took. With one position for
// the whole order, set after the part whose claim went furthest, the
// other part started again from the same shards round after round while
// they had a backlog, and a shard moved into it with a backlog of its own
// waited until they drained (bench section databases: a moved shard's
// copied backlog started 15.8-27.5 s after the move). Here every shard
// has a deep backlog, the claim takes one task a part, and shard 2 has
// moved to the second part: within one turn of each part's shards every
// shard is served.
func TestPendingRotatesEachPart(t *testing.T) {
	partOf := func(s int) int {
		if s >= 4 || s == 2 {
			return 1
		}
		return 0
	}
	p := newPending(false)
	p.partOf = partOf
	var held []claims.ShardEpoch
	for s := range 8 {
		held = append(held, claims.ShardEpoch{Shard: s, Epoch: 1})
	}
	served := map[int]int{}
	const rounds = 5 // the second part's shards: 2, 4, 5, 6, 7
	for range rounds {
		_, order := p.order(held)
		var got []tasks.Task
		for part := range 2 {
			for _, se := range order {
				if partOf(se.Shard) == part {
					got = append(got, tasks.Task{Shard: se.Shard})
					served[se.Shard]++
					break
				}
			}
		}
		p.claimed(order, got, len(got))
	}
	for s := range 8 {
		if served[s] == 0 {
			t.Errorf("shard %d (part %d) not served in %d claims, each taking a task a part from the first shard it reached: served %v",
				s, partOf(s), rounds, served)
		}
	}
}
