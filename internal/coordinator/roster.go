package coordinator

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/shard"
)

// Runner health as the status page and /api/cluster show it. etcd alone
// cannot tell a paused or cut-off runner from a healthy one until its lease
// expires, and a runner whose key expired simply vanishes from runners/; the
// roster fills both gaps.
const (
	// HealthOK: the runner's key is there and its lease is being renewed.
	HealthOK = "ok"
	// HealthUnresponsive: the key is still there but etcd has not seen a
	// keep-alive for over half the lease TTL (a healthy runner renews every
	// eighth of it): the runner is paused, overloaded or cut off from etcd,
	// and will lose its shards when the lease runs out.
	HealthUnresponsive = "unresponsive"
	// HealthLeft: the key is gone after the runner announced it was
	// draining (a graceful stop).
	HealthLeft = "left"
	// HealthLost: the key vanished without a drain: the lease expired or
	// was revoked (kill -9, a long pause or partition).
	HealthLost = "lost"
)

// DefaultGoneFor is how long a runner that left or was lost stays listed.
const DefaultGoneFor = 10 * time.Minute

// roster follows runners/ with a watch and remembers the runners that went
// away, so that the page lists runners which left or were lost for a while
// instead of letting them disappear. A watch, not the page's polls, because
// a draining runner deletes its key milliseconds after announcing the drain:
// only the event stream tells a graceful leave from a lost lease. Each
// coordinator keeps its own memory, which starts empty.
type roster struct {
	client *clientv3.Client
	prefix string // <cluster prefix>runners/
	clock  clock.Clock
	log    hclog.Logger

	mu   sync.Mutex
	last map[string]shard.RunnerInfo // latest value of every key seen
	gone map[string]goneRunner
}

type goneRunner struct {
	info shard.RunnerInfo
	at   time.Time
}

func newRoster(client *clientv3.Client, clusterPrefix string, clk clock.Clock, log hclog.Logger) *roster {
	return &roster{client: client, prefix: clusterPrefix + "runners/", clock: clk, log: log,
		last: map[string]shard.RunnerInfo{}, gone: map[string]goneRunner{}}
}

// Run follows runners/ until ctx ends, re-reading it whenever the watch
// breaks.
func (r *roster) Run(ctx context.Context) {
	backoff := clock.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for ctx.Err() == nil {
		rev, err := r.snapshot(ctx)
		if err != nil {
			wait := backoff.Next()
			if ctx.Err() == nil {
				r.log.Debug("reading runners failed", "error", err, "backoff", wait)
			}
			if !clock.Sleep(r.clock, wait, ctx.Done()) {
				return
			}
			continue
		}
		backoff.Reset()
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for resp := range r.client.Watch(wctx, r.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1)) {
			if resp.Err() != nil || resp.CompactRevision != 0 {
				break
			}
			for _, ev := range resp.Events {
				r.apply(string(ev.Kv.Key), ev.Kv.Value, ev.Type == clientv3.EventTypeDelete)
			}
		}
		cancel()
	}
}

func (r *roster) snapshot(ctx context.Context) (int64, error) {
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := r.client.Get(gctx, r.prefix, clientv3.WithPrefix())
	if err != nil {
		return 0, err
	}
	present := map[string]bool{}
	for _, kv := range resp.Kvs {
		present[strings.TrimPrefix(string(kv.Key), r.prefix)] = true
		r.apply(string(kv.Key), kv.Value, false)
	}
	r.mu.Lock()
	ids := make([]string, 0, len(r.last))
	for id := range r.last {
		if !present[id] {
			ids = append(ids, id)
		}
	}
	r.mu.Unlock()
	for _, id := range ids { // deleted while the watch was broken
		r.apply(r.prefix+id, nil, true)
	}
	return resp.Header.Revision, nil
}

func (r *roster) apply(key string, value []byte, deleted bool) {
	id := strings.TrimPrefix(key, r.prefix)
	r.mu.Lock()
	defer r.mu.Unlock()
	if !deleted {
		var info shard.RunnerInfo
		if json.Unmarshal(value, &info) != nil {
			info = shard.RunnerInfo{ID: id, State: "unknown"}
		}
		r.last[id] = info
		delete(r.gone, id)
		return
	}
	if info, ok := r.last[id]; ok {
		r.gone[id] = goneRunner{info: info, at: r.clock.Now()}
		delete(r.last, id)
	}
}

// Gone returns the runners that went away within goneFor, most recent
// first: left when their last state was draining, lost otherwise.
func (r *roster) Gone(goneFor time.Duration) []RunnerView {
	now := r.clock.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	out := []RunnerView{}
	for id, g := range r.gone {
		if now.Sub(g.at) > goneFor {
			delete(r.gone, id)
			continue
		}
		v := RunnerView{RunnerInfo: g.info, Health: HealthLost, LastSeen: g.at.UTC()}
		if g.info.State == shard.StateDraining {
			v.Health = HealthLeft
		}
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b RunnerView) int {
		if c := b.LastSeen.Compare(a.LastSeen); c != 0 {
			return c
		}
		return strings.Compare(a.ID, b.ID)
	})
	return out
}

// leaseHealth asks etcd how much time each runner's lease has left. A
// runner renews every eighth of its TTL, so less than half left means its
// keep-alives stopped arriving. Errors leave the runner's health unknown
// (ok): the page must not cry wolf when only etcd is slow.
func leaseHealth(ctx context.Context, client *clientv3.Client, v *RunnerView, lease int64) {
	if lease == 0 {
		return
	}
	resp, err := client.TimeToLive(ctx, clientv3.LeaseID(lease))
	if err != nil || resp.GrantedTTL <= 0 {
		return
	}
	left := float64(max(resp.TTL, 0))
	v.LeaseLeft = &left
	if resp.TTL*2 < resp.GrantedTTL {
		v.Health = HealthUnresponsive
	}
}
