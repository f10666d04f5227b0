package shard

import (
	"encoding/json"
	"strconv"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// view is the Run loop's copy of runners/ and shards/, fed by the watch and
// by the results of the runner's own transactions. Every entry remembers the
// revision it reflects, so an older event never overwrites newer knowledge.
type view struct {
	runners map[string]runnerEntry
	shards  []shardEntry
}

type runnerEntry struct {
	info   RunnerInfo
	modRev int64
	lease  int64
}

// shardEntry is one shard key; owner "" means no key (free).
type shardEntry struct {
	owner     string
	createRev int64
	modRev    int64
	lease     int64
}

// watchUpdate is a batch of watch events, or a full snapshot after the
// watch had to be re-established.
type watchUpdate struct {
	events      []*clientv3.Event
	snapshot    []*mvccpb.KeyValue
	snapshotRev int64
}

func newView(shards int) view {
	return view{runners: map[string]runnerEntry{}, shards: make([]shardEntry, shards)}
}

// load replaces the view with a snapshot taken at rev, keeping entries the
// runner learnt at a newer revision.
func (v *view) load(k keys, kvs []*mvccpb.KeyValue, rev int64) {
	seenRunners := map[string]bool{}
	seenShards := map[int]bool{}
	for _, kv := range kvs {
		if id, ok := k.parseRunner(kv.Key); ok {
			seenRunners[id] = true
		} else if s, ok := k.parseShard(kv.Key, len(v.shards)); ok {
			seenShards[s] = true
		}
		v.set(k, kv, false)
	}
	for id, e := range v.runners {
		if !seenRunners[id] && e.modRev <= rev {
			delete(v.runners, id)
		}
	}
	for s, e := range v.shards {
		if !seenShards[s] && e.modRev <= rev && e.owner != "" {
			v.shards[s] = shardEntry{modRev: rev}
		}
	}
}

func (v *view) apply(k keys, u watchUpdate) {
	if u.snapshot != nil || u.snapshotRev != 0 {
		v.load(k, u.snapshot, u.snapshotRev)
		return
	}
	for _, ev := range u.events {
		v.set(k, ev.Kv, ev.Type == clientv3.EventTypeDelete)
	}
}

// set applies one key version (a put, or a delete at kv.ModRevision).
func (v *view) set(k keys, kv *mvccpb.KeyValue, deleted bool) {
	if id, ok := k.parseRunner(kv.Key); ok {
		if kv.ModRevision < v.runners[id].modRev {
			return
		}
		if deleted {
			delete(v.runners, id)
			return
		}
		var info RunnerInfo
		if err := json.Unmarshal(kv.Value, &info); err != nil {
			info = RunnerInfo{ID: id, State: "unknown"}
		}
		v.runners[id] = runnerEntry{info: info, modRev: kv.ModRevision, lease: kv.Lease}
		return
	}
	s, ok := k.parseShard(kv.Key, len(v.shards))
	if !ok || kv.ModRevision < v.shards[s].modRev {
		return
	}
	if deleted {
		v.shards[s] = shardEntry{modRev: kv.ModRevision}
		return
	}
	v.shards[s] = shardEntry{owner: string(kv.Value), createRev: kv.CreateRevision, modRev: kv.ModRevision, lease: kv.Lease}
}

// attached returns the ids of runners whose key says attached.
func (v *view) attached() []string {
	var ids []string
	for id, e := range v.runners {
		if e.info.State == StateAttached {
			ids = append(ids, id)
		}
	}
	return ids
}

func (v *view) owners() []string {
	out := make([]string, len(v.shards))
	for s, e := range v.shards {
		out[s] = e.owner
	}
	return out
}

func (k keys) parseRunner(key []byte) (string, bool) {
	id, ok := strings.CutPrefix(string(key), k.runners())
	return id, ok && id != ""
}

func (k keys) parseShard(key []byte, n int) (int, bool) {
	rest, ok := strings.CutPrefix(string(key), k.shards())
	if !ok {
		return 0, false
	}
	s, err := strconv.Atoi(rest)
	return s, err == nil && s >= 0 && s < n
}
