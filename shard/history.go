package shard

import (
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// UnitEvent is one change of hands of a unit of ownership (a shard of a
// group), as etcd's history of the owner keys shows it: a runner's key
// starts to name the shard (Acquired, at Epoch), or stops naming it.
type UnitEvent struct {
	Group    string
	Shard    int
	Runner   string
	Epoch    int64
	Acquired bool
	// Rev is the revision of the write that made the change.
	Rev int64
}

// History follows the owner keys of a cluster through its etcd events and
// turns each write of a runner's key into the units it acquired and
// released: for tests and tools that check ownership from outside (no two
// runners hold a unit at once, every completion was made under a term
// etcd recorded).
type History struct {
	keys   keys
	shards int
	// held[owner key] is what the key names now.
	held map[string]map[int]int64
}

// NewHistory follows the cluster under prefix, of shardCount shards.
func NewHistory(prefix string, shardCount int) *History {
	return &History{keys: keys{prefix}, shards: shardCount, held: map[string]map[int]int64{}}
}

// Apply takes one etcd event of the cluster's prefix, in revision order,
// and returns the changes of hands it made (none for other keys), in shard
// order: releases, then acquisitions.
func (h *History) Apply(ev *clientv3.Event) []UnitEvent {
	group, runner, ok := h.keys.parseOwner(ev.Kv.Key)
	if !ok {
		return nil
	}
	key := string(ev.Kv.Key)
	before := h.held[key]
	var after map[int]int64
	if ev.Type == clientv3.EventTypePut {
		after, _ = decodeTerms(ev.Kv.Value, ev.Kv.ModRevision, h.shards)
	}
	h.held[key] = after
	var out []UnitEvent
	for _, s := range slices.Sorted(keysOf(before)) {
		if after[s] != before[s] {
			out = append(out, UnitEvent{Group: group, Shard: s, Runner: runner, Epoch: before[s], Rev: ev.Kv.ModRevision})
		}
	}
	for _, s := range slices.Sorted(keysOf(after)) {
		if after[s] != before[s] {
			out = append(out, UnitEvent{Group: group, Shard: s, Runner: runner, Epoch: after[s], Acquired: true, Rev: ev.Kv.ModRevision})
		}
	}
	return out
}

func keysOf(m map[int]int64) func(func(int) bool) {
	return func(yield func(int) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}
