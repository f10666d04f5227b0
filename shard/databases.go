package shard

// The cluster's databases (issue 40): the map shard → database lives in
// etcd under <prefix>meta/databases, as JSON, and its ModRevision is the
// map's revision. It is written with the cluster, in meta/shard-count's
// transaction (EnsureCluster), and changed only by a shard's move
// (PutDatabases, conditioned on the revision it read). A cluster created
// before the map existed has no key: its map is implicit, every shard in
// the database named main, at revision 0.

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/store"
)

// MainDatabase is the database of a cluster created with one database
// (--database-url), and of a cluster created before the map existed.
const MainDatabase = store.MainDatabase

func (k keys) databases() string { return k.prefix + "meta/databases" }

// DatabasesKey is the key of the cluster's map of databases under prefix.
func DatabasesKey(prefix string) string { return keys{prefix}.databases() }

// mapValue is the map as etcd stores it: the databases in order, each
// shard's database by name, and the moves under way.
type mapValue struct {
	Databases []string    `json:"databases"`
	Shards    []string    `json:"shards"`
	Moves     []moveValue `json:"moves,omitempty"`
}

type moveValue struct {
	Shard int    `json:"shard"`
	From  string `json:"from"`
	To    string `json:"to"`
	Phase string `json:"phase"`
}

func encodeMap(m store.Map) (string, error) {
	v := mapValue{Databases: m.Databases, Shards: m.Shards}
	for _, mv := range m.Moves {
		v.Moves = append(v.Moves, moveValue{Shard: mv.Shard, From: mv.From, To: mv.To, Phase: mv.Phase})
	}
	b, err := json.Marshal(v)
	return string(b), err
}

// decodeMap reads the map stored at rev, checking that it names a
// database for each of shardCount shards, each one of its databases.
func decodeMap(key string, b []byte, rev int64, shardCount int) (store.Map, error) {
	var v mapValue
	if err := json.Unmarshal(b, &v); err != nil {
		return store.Map{}, fmt.Errorf("the cluster's map of databases (%s) is not JSON: %w", key, err)
	}
	m := store.Map{Rev: rev, Databases: v.Databases, Shards: v.Shards}
	for _, mv := range v.Moves {
		m.Moves = append(m.Moves, store.Move{Shard: mv.Shard, From: mv.From, To: mv.To, Phase: mv.Phase})
	}
	if err := checkMap(m, shardCount); err != nil {
		return store.Map{}, fmt.Errorf("the cluster's map of databases (%s, revision %d): %w", key, rev, err)
	}
	return m, nil
}

func checkMap(m store.Map, shardCount int) error {
	if err := m.Check(); err != nil {
		return err
	}
	if shardCount > 0 && len(m.Shards) != shardCount {
		return fmt.Errorf("the map places %d shards, the cluster has %d", len(m.Shards), shardCount)
	}
	return nil
}

// ImplicitMap is the map of a cluster created before the map existed:
// every shard in main, revision 0.
func ImplicitMap(shardCount int) store.Map { return store.NewMap([]string{MainDatabase}, shardCount) }

// EnsureCluster creates the cluster under prefix if it is new: its shard
// count n and its map, the shards spread over databases in contiguous
// ranges in the order given (store.NewMap), in one transaction. For a
// cluster that exists it checks the shard count (ErrShardCountMismatch,
// naming --shard-count) and returns its map as stored (the implicit map
// of one database, main, when it has none). created says this call
// created the cluster.
func EnsureCluster(ctx context.Context, client *clientv3.Client, prefix string, n int, databases []string) (m store.Map, created bool, err error) {
	k := keys{prefix}
	m = store.NewMap(databases, n)
	value, err := encodeMap(m)
	if err != nil {
		return store.Map{}, false, fmt.Errorf("encoding the map of databases: %w", err)
	}
	resp, err := client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(k.meta()), "=", 0)).
		Then(clientv3.OpPut(k.meta(), strconv.Itoa(n)), clientv3.OpPut(k.databases(), value)).
		Else(clientv3.OpGet(k.meta()), clientv3.OpGet(k.databases())).Commit()
	if err != nil {
		return store.Map{}, false, fmt.Errorf("connecting to etcd %v (--etcd-endpoints) to check %s: %w", client.Endpoints(), k.meta(), err)
	}
	if resp.Succeeded {
		m.Rev = resp.Header.Revision
		return m, true, nil
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) == 1 && string(kvs[0].Value) != strconv.Itoa(n) {
		return store.Map{}, false, fmt.Errorf("--shard-count: %w: the cluster under %s has %s shards (%s), this process is configured with %d",
			ErrShardCountMismatch, prefix, kvs[0].Value, k.meta(), n)
	}
	kvs := resp.Responses[1].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return ImplicitMap(n), false, nil
	}
	m, err = decodeMap(k.databases(), kvs[0].Value, kvs[0].ModRevision, n)
	return m, false, err
}

// ReadDatabases reads the cluster's map (the implicit map when it has
// none), checked against shardCount unless it is 0.
func ReadDatabases(ctx context.Context, client *clientv3.Client, prefix string, shardCount int) (store.Map, error) {
	key := keys{prefix}.databases()
	resp, err := client.Get(ctx, key)
	if err != nil {
		return store.Map{}, fmt.Errorf("reading the cluster's map of databases (%s): %w", key, err)
	}
	if len(resp.Kvs) == 0 {
		return ImplicitMap(shardCount), nil
	}
	return decodeMap(key, resp.Kvs[0].Value, resp.Kvs[0].ModRevision, shardCount)
}

// PutDatabases writes m as the cluster's map if the map is still at
// m.Rev (0: the implicit map, no key yet) and every one of cmps holds
// (the move driver adds its leader key's): ok false means the map or a
// compared key changed meanwhile; re-read and decide again. rev is the
// new map's revision.
func PutDatabases(ctx context.Context, client *clientv3.Client, prefix string, m store.Map, cmps ...clientv3.Cmp) (rev int64, ok bool, err error) {
	key := keys{prefix}.databases()
	if err := checkMap(m, 0); err != nil {
		return 0, false, fmt.Errorf("writing the map of databases: %w", err)
	}
	value, err := encodeMap(m)
	if err != nil {
		return 0, false, fmt.Errorf("encoding the map of databases: %w", err)
	}
	cmp := clientv3.Compare(clientv3.ModRevision(key), "=", m.Rev)
	if m.Rev == 0 {
		cmp = clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
	}
	resp, err := client.Txn(ctx).If(append([]clientv3.Cmp{cmp}, cmps...)...).Then(clientv3.OpPut(key, value)).Commit()
	if err != nil {
		return 0, false, fmt.Errorf("writing the map of databases (%s): %w", key, err)
	}
	return resp.Header.Revision, resp.Succeeded, nil
}

// CheckDatabases says, in one line naming the database, when the
// databases a process is given are not the map's: one the map does not
// name, or one it names that is missing. The order given does not
// matter once the cluster exists.
func CheckDatabases(m store.Map, given []string) error {
	for _, name := range given {
		if !slices.Contains(m.Databases, name) {
			return fmt.Errorf("--database: the database %s is not one of the cluster's (its map names %s): "+
				"the databases are fixed when the cluster is created", name, strings.Join(m.Databases, ", "))
		}
	}
	for _, name := range m.Databases {
		if !slices.Contains(given, name) {
			return fmt.Errorf("--database: the cluster's map names the database %s, which this process is not given (--database %s=URL; it is given %s)",
				name, name, strings.Join(given, ", "))
		}
	}
	return nil
}

// MapWatch follows the cluster's map from a revision on and hands every
// new map to OnChange, in order. When the watch breaks (compaction, a
// lost etcd leader) it re-reads the key and goes on from there.
type MapWatch struct {
	Client     *clientv3.Client
	Prefix     string
	ShardCount int
	// Rev is the revision of the map the process has; newer ones are
	// handed on.
	Rev      int64
	OnChange func(store.Map)
	Clock    clock.Clock
	Logger   hclog.Logger
}

// Run watches until ctx ends.
func (w *MapWatch) Run(ctx context.Context) {
	clk := w.Clock
	if clk == nil {
		clk = clock.Real()
	}
	log := w.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	key := keys{w.Prefix}.databases()
	backoff := clock.Backoff{Min: 100 * time.Millisecond, Max: 2 * time.Second}
	from := w.Rev
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for resp := range w.Client.Watch(wctx, key, clientv3.WithRev(from+1)) {
			if err := resp.Err(); err != nil || resp.CompactRevision != 0 {
				if ctx.Err() == nil {
					log.Debug("watch of the map interrupted; re-reading it", "error", err, "compacted", resp.CompactRevision)
				}
				break
			}
			for _, ev := range resp.Events {
				from = ev.Kv.ModRevision
				if ev.Type != clientv3.EventTypePut {
					log.Warn("the cluster's map of databases was deleted; keeping the last one", "key", key, "revision", from)
					continue
				}
				m, err := decodeMap(key, ev.Kv.Value, ev.Kv.ModRevision, w.ShardCount)
				if err != nil {
					log.Error("ignoring a map of databases that does not decode", "error", err)
					continue
				}
				w.deliver(m, log)
			}
			backoff.Reset()
		}
		cancel()
		for ctx.Err() == nil {
			gctx, gcancel := context.WithTimeout(ctx, 5*time.Second)
			resp, err := w.Client.Get(gctx, key)
			gcancel()
			if err == nil {
				from = resp.Header.Revision
				if len(resp.Kvs) == 1 && resp.Kvs[0].ModRevision > w.Rev {
					if m, err := decodeMap(key, resp.Kvs[0].Value, resp.Kvs[0].ModRevision, w.ShardCount); err == nil {
						w.deliver(m, log)
					} else {
						log.Error("ignoring a map of databases that does not decode", "error", err)
					}
				}
				break
			}
			if !clock.Sleep(clk, backoff.Next(), ctx.Done()) {
				return
			}
		}
	}
}

func (w *MapWatch) deliver(m store.Map, log hclog.Logger) {
	if m.Rev <= w.Rev {
		return
	}
	log.Info("the map of databases changed", "revision", m.Rev, "moves", len(m.Moves))
	w.Rev = m.Rev
	w.OnChange(m)
}
