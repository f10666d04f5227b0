package executor

import (
	"slices"
	"testing"
	"time"

	"github.com/shardrun/shardrun/tasks"
)

func shards(terms []tasks.ShardEpoch) []int {
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
// ones go first; the poll makes every shard pending.
func TestPendingShardsOrder(t *testing.T) {
	now := time.Unix(0, 0)
	p := newPending(now)
	held := []tasks.ShardEpoch{{Shard: 1, Epoch: 1}, {Shard: 2, Epoch: 1}, {Shard: 3, Epoch: 1}, {Shard: 4, Epoch: 1}}
	order := p.order(held, now, time.Second)
	if got := shards(order); !slices.Equal(got, []int{1, 2, 3, 4}) {
		t.Fatalf("first order %v, want every held shard", got)
	}
	// The claim took its limit of 2, the last from shard 2: shard 1 is
	// drained, shard 2 may have more, the next claim starts at 3.
	p.claimed(order, []tasks.Task{{Shard: 1}, {Shard: 2}}, 2)
	if got := shards(p.order(held, now, time.Second)); !slices.Equal(got, []int{3, 4, 2}) {
		t.Fatalf("after a full claim %v, want [3 4 2]", got)
	}
	// A claim that took fewer than it asked drained all it visited.
	p.claimed([]tasks.ShardEpoch{{Shard: 3, Epoch: 1}, {Shard: 4, Epoch: 1}, {Shard: 2, Epoch: 1}}, []tasks.Task{{Shard: 4}}, 5)
	if got := p.order(held, now, time.Second); len(got) != 0 || p.any() {
		t.Fatalf("after a short claim %v, want nothing pending", shards(got))
	}
	// Notifications: shard 3 plain, shard 1 urgent: 1 goes first.
	p.notify(false, []int{3}, []int{1})
	if got := shards(p.order(held, now, time.Second)); !slices.Equal(got, []int{1, 3}) {
		t.Fatalf("after notifications %v, want the urgent shard first: [1 3]", got)
	}
	p.claimed([]tasks.ShardEpoch{{Shard: 1, Epoch: 1}, {Shard: 3, Epoch: 1}}, nil, 5)
	// The poll makes every held shard pending; a shard no longer held is
	// forgotten, a newly held one is pending.
	held = append(held[1:], tasks.ShardEpoch{Shard: 9, Epoch: 1})
	if got := shards(p.order(held, now.Add(time.Second), time.Second)); len(got) != 4 || !slices.Contains(got, 9) || slices.Contains(got, 1) {
		t.Fatalf("after the poll %v, want 2, 3, 4 and 9", got)
	}
}
