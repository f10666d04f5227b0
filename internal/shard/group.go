package shard

// Capability groups: the unit of ownership is a shard of a group.
//
// A runner can run a task when it serves the task's queue and handles its
// kind. Runners that serve the same queues and handle the same kinds form
// a group; every group owns the cluster's shards on its own (a unit is
// (group, shard)), balanced among the group's attached members by the same
// assignment as before (Assign), and claims, in the shards it owns, only
// the lanes of its queues and kinds. Two groups that can both run a kind
// both claim its lanes: a task is taken by one claim (its lane entry is
// deleted once), under the fence of the unit that claimed it. So a ready
// task runs as soon as one attached runner can run it, whatever the mix of
// runners, and adding a runner to a group adds throughput to everything
// the group runs. docs/architecture.md ("Mixed fleets") has the decision
// and the alternatives.

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"slices"

	"github.com/shardrun/shardrun/tasks"
)

// GroupOf names the group of runners that serve queues and handle kinds:
// "g" and 16 hex digits of a hash of both lists (order and repeats do not
// matter), a stable etcd key segment and fence column whatever the names.
func GroupOf(queues, kinds []string) string {
	h := sha256.New()
	for _, list := range [][]string{queues, kinds} {
		l := slices.Clone(list)
		slices.Sort(l)
		l = slices.Compact(l)
		// Each name length-prefixed, each list counted: no two pairs of
		// lists write the same bytes.
		h.Write(binary.AppendUvarint(nil, uint64(len(l))))
		for _, name := range l {
			h.Write(binary.AppendUvarint(nil, uint64(len(name))))
			h.Write([]byte(name))
		}
	}
	return "g" + hex.EncodeToString(h.Sum(nil))[:16]
}

// CanRun reports whether a runner with info can run tasks of kind in queue.
func (info RunnerInfo) CanRun(queue, kind string) bool {
	return slices.Contains(info.Queues, queue) && slices.Contains(info.Kinds, kind)
}

// Runnable returns the classes (queue and kind) that some attached runner
// of runners can run.
func Runnable(runners []RunnerInfo) map[tasks.Class]bool {
	out := map[tasks.Class]bool{}
	for _, r := range runners {
		if r.State != StateAttached {
			continue
		}
		for _, q := range r.Queues {
			for _, k := range r.Kinds {
				out[tasks.Class{Queue: q, Kind: k}] = true
			}
		}
	}
	return out
}
