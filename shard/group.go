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
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/tasks"
	clientv3 "go.etcd.io/etcd/client/v3"
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

// Capabilities reads what the attached runners of a cluster can run from
// their runners/ keys, at most once per MaxAge (default one second), so
// that a burst of enqueues costs etcd one read. Producers use it to warn
// about tasks no runner can run yet; it is advice, never a gate.
type Capabilities struct {
	Client *clientv3.Client
	// Prefix is the cluster's key prefix.
	Prefix string
	MaxAge time.Duration
	Clock  clock.Clock

	mu       sync.Mutex
	runnable map[tasks.Class]bool
	at       time.Time
}

// Runnable returns the classes (queue, kind) some attached runner can run.
func (c *Capabilities) Runnable(ctx context.Context) (map[tasks.Class]bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	clk := cmp.Or(c.Clock, clock.Real())
	if c.runnable != nil && clk.Now().Sub(c.at) < cmp.Or(c.MaxAge, time.Second) {
		return c.runnable, nil
	}
	resp, err := c.Client.Get(ctx, keys{c.Prefix}.runners(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading what the runners run: %w", err)
	}
	var runners []RunnerInfo
	for _, kv := range resp.Kvs {
		var info RunnerInfo
		if json.Unmarshal(kv.Value, &info) == nil {
			runners = append(runners, info)
		}
	}
	c.runnable, c.at = Runnable(runners), clk.Now()
	return c.runnable, nil
}
