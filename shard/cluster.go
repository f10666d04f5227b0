package shard

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// EnsureShardCount writes n to <prefix>meta/shard-count if the cluster is
// new, and returns ErrShardCountMismatch (naming --shard-count) if the
// cluster was created with another count.
func EnsureShardCount(ctx context.Context, client *clientv3.Client, prefix string, n int) (created bool, err error) {
	key := keys{prefix}.meta()
	want := strconv.Itoa(n)
	resp, err := client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, want)).
		Else(clientv3.OpGet(key)).Commit()
	if err != nil {
		return false, fmt.Errorf("connecting to etcd %v (--etcd-endpoints) to check %s: %w", client.Endpoints(), key, err)
	}
	if resp.Succeeded {
		return true, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 1 && string(kvs[0].Value) != want {
		return false, fmt.Errorf("--shard-count: %w: the cluster under %s has %s shards (%s), this process is configured with %d",
			ErrShardCountMismatch, prefix, kvs[0].Value, key, n)
	}
	return false, nil
}

// Cluster is a snapshot of a cluster's membership and ownership in etcd.
type Cluster struct {
	// Revision is the etcd revision of the snapshot.
	Revision int64
	// Runners, sorted by id.
	Runners []RunnerInfo
	// Leases[id] is the lease runners/<id> is attached to, for asking etcd
	// how long the runner's lease has left.
	Leases map[string]int64
	// Owners[s] is the runner holding shard s's key ("" when free) and
	// Epochs[s] the key's CreateRevision.
	Owners []string
	Epochs []int64
	// Assigned[id] lists the shards the assignment gives each attached
	// runner, computed as every runner computes it.
	Assigned map[string][]int
}

// ReadCluster reads runners/ and shards/ under prefix in one request.
func ReadCluster(ctx context.Context, client *clientv3.Client, prefix string, shardCount int) (Cluster, error) {
	resp, err := client.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return Cluster{}, fmt.Errorf("reading cluster state under %s: %w", prefix, err)
	}
	k := keys{prefix}
	v := newView(shardCount)
	v.load(k, resp.Kvs, resp.Header.Revision)
	c := Cluster{Revision: resp.Header.Revision, Owners: v.owners(), Epochs: make([]int64, shardCount),
		Assigned: map[string][]int{}, Leases: map[string]int64{}}
	for s, e := range v.shards {
		c.Epochs[s] = e.createRev
	}
	for id, e := range v.runners {
		c.Runners = append(c.Runners, e.info)
		c.Leases[id] = e.lease
	}
	slices.SortFunc(c.Runners, func(a, b RunnerInfo) int { return strings.Compare(a.ID, b.ID) })
	for s, id := range Assign(v.attached(), c.Owners) {
		if id != "" {
			c.Assigned[id] = append(c.Assigned[id], s)
		}
	}
	return c, nil
}
