package shard

import (
	"context"
	"errors"
	"fmt"
	"maps"
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
	// Groups are the capability groups with a member or an owner key,
	// sorted by name.
	Groups []Group
}

// Group is one capability group's part of a Cluster: the runners that
// serve the same queues and handle the same kinds, and the group's shards.
type Group struct {
	// Name is GroupOf(Queues, Kinds).
	Name   string   `json:"group"`
	Queues []string `json:"queues"`
	Kinds  []string `json:"kinds"`
	// Members are the group's attached runners, sorted.
	Members []string `json:"members"`
	// Owners[s] is the runner holding the group's shard s ("" when free)
	// and Epochs[s] the epoch of its term.
	Owners []string `json:"owners"`
	Epochs []int64  `json:"epochs"`
	// Assigned[id] lists the shards the assignment gives each member,
	// computed as every member computes it.
	Assigned map[string][]int `json:"-"`
}

// ReadCluster reads runners/ and owners/ under prefix in one request.
func ReadCluster(ctx context.Context, client *clientv3.Client, prefix string, shardCount int) (Cluster, error) {
	resp, err := client.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return Cluster{}, fmt.Errorf("reading cluster state under %s: %w", prefix, err)
	}
	k := keys{prefix}
	v := newView(shardCount)
	v.load(k, resp.Kvs, resp.Header.Revision)
	c := Cluster{Revision: resp.Header.Revision, Leases: map[string]int64{}}
	groups := map[string]*Group{}
	group := func(name string) *Group {
		if g := groups[name]; g != nil {
			return g
		}
		g := &Group{Name: name, Assigned: map[string][]int{}}
		groups[name] = g
		return g
	}
	for id, e := range v.runners {
		c.Runners = append(c.Runners, e.info)
		c.Leases[id] = e.lease
		if e.info.Group == "" {
			continue
		}
		g := group(e.info.Group)
		if g.Queues == nil {
			g.Queues, g.Kinds = e.info.Queues, e.info.Kinds
		}
		if e.info.State == StateAttached {
			g.Members = append(g.Members, id)
		}
	}
	for name := range v.owners {
		if len(v.owners[name]) > 0 {
			group(name)
		}
	}
	slices.SortFunc(c.Runners, func(a, b RunnerInfo) int { return strings.Compare(a.ID, b.ID) })
	for _, name := range slices.Sorted(maps.Keys(groups)) {
		g := groups[name]
		slices.Sort(g.Members)
		g.Owners, g.Epochs = v.holders(name)
		for s, id := range Assign(g.Members, g.Owners) {
			if id != "" {
				g.Assigned[id] = append(g.Assigned[id], s)
			}
		}
		c.Groups = append(c.Groups, *g)
	}
	return c, nil
}

// ClusterShardCount returns the shard count of the cluster under prefix,
// creating the cluster with want shards (DefaultShardCount when 0) spread
// over databases (EnsureCluster) if it is new; ErrShardCountMismatch when
// want is set and differs from the cluster's.
func ClusterShardCount(ctx context.Context, client *clientv3.Client, prefix string, want int, databases []string) (int, error) {
	key := keys{prefix}.meta()
	resp, err := client.Get(ctx, key)
	if err != nil {
		return 0, fmt.Errorf("reading the cluster's shard count (%s): %w", key, err)
	}
	if len(resp.Kvs) == 1 {
		n, err := strconv.Atoi(string(resp.Kvs[0].Value))
		if err != nil {
			return 0, fmt.Errorf("the cluster's shard count (%s) is %q, not a number", key, resp.Kvs[0].Value)
		}
		if want != 0 && want != n {
			return 0, fmt.Errorf("shard count: %w: the cluster under %s has %d shards (%s), this process is configured with %d",
				ErrShardCountMismatch, prefix, n, key, want)
		}
		return n, nil
	}
	n := want
	if n == 0 {
		n = DefaultShardCount
	}
	_, _, err = EnsureCluster(ctx, client, prefix, n, databases)
	if errors.Is(err, ErrShardCountMismatch) && want == 0 {
		return ClusterShardCount(ctx, client, prefix, 0, databases) // created meanwhile by another process: its count
	}
	if err != nil {
		return 0, err
	}
	return n, nil
}
