package shard

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// view is the Run loop's copy of runners/ and owners/, fed by the watch and
// by the results of the runner's own transactions. Every entry remembers the
// revision it reflects, so an older event never overwrites newer knowledge.
type view struct {
	shardCount int
	runners    map[string]runnerEntry
	// owners[group][runner] is what runner's owners/<group>/<runner> key
	// says it holds.
	owners map[string]map[string]ownerEntry
	// gone remembers, per owner key, the revision of its deletion, so that
	// an older put seen later does not bring it back.
	gone map[string]int64
}

type runnerEntry struct {
	info   RunnerInfo
	modRev int64
	lease  int64
}

// ownerEntry is one owners/<group>/<runner> key: the shards its runner
// holds in the group, each with its epoch (the revision of the put that
// added it).
type ownerEntry struct {
	terms  map[int]int64
	modRev int64
	lease  int64
}

// watchUpdate is a batch of watch events, or a full snapshot after the
// watch had to be re-established; rev is the revision up to which it
// reports every change.
type watchUpdate struct {
	events      []*clientv3.Event
	snapshot    []*mvccpb.KeyValue
	snapshotRev int64
	rev         int64
}

func newView(shards int) view {
	return view{shardCount: shards, runners: map[string]runnerEntry{}, owners: map[string]map[string]ownerEntry{}, gone: map[string]int64{}}
}

// load replaces the view with a snapshot taken at rev, keeping entries the
// runner learnt at a newer revision.
func (v *view) load(k keys, kvs []*mvccpb.KeyValue, rev int64) {
	seenRunners := map[string]bool{}
	seenOwners := map[string]bool{}
	for _, kv := range kvs {
		if id, ok := k.parseRunner(kv.Key); ok {
			seenRunners[id] = true
		} else if g, id, ok := k.parseOwner(kv.Key); ok {
			seenOwners[g+"/"+id] = true
		}
		v.set(k, kv, false)
	}
	for id, e := range v.runners {
		if !seenRunners[id] && e.modRev <= rev {
			delete(v.runners, id)
		}
	}
	for g, byRunner := range v.owners {
		for id, e := range byRunner {
			if !seenOwners[g+"/"+id] && e.modRev <= rev {
				delete(byRunner, id)
				v.gone[g+"/"+id] = rev
			}
		}
	}
}

// loadKey takes into the view what a read of one key (a runner's or an
// owner key) at rev found: its version, or its absence.
func (v *view) loadKey(k keys, key string, kvs []*mvccpb.KeyValue, rev int64) {
	if len(kvs) > 0 {
		v.set(k, kvs[0], false)
		return
	}
	if id, ok := k.parseRunner([]byte(key)); ok {
		if e, ok := v.runners[id]; ok && e.modRev <= rev {
			delete(v.runners, id)
		}
	} else if g, id, ok := k.parseOwner([]byte(key)); ok {
		if e, ok := v.owners[g][id]; ok && e.modRev <= rev {
			delete(v.owners[g], id)
			v.gone[g+"/"+id] = rev
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
	g, id, ok := k.parseOwner(kv.Key)
	if !ok {
		return
	}
	byRunner := v.owners[g]
	if kv.ModRevision < byRunner[id].modRev || kv.ModRevision <= v.gone[g+"/"+id] {
		return
	}
	if deleted {
		delete(byRunner, id)
		v.gone[g+"/"+id] = kv.ModRevision
		return
	}
	terms, err := decodeTerms(kv.Value, kv.ModRevision, v.shardCount)
	if err != nil {
		terms = map[int]int64{} // unreadable: holds nothing we can name
	}
	if byRunner == nil {
		byRunner = map[string]ownerEntry{}
		v.owners[g] = byRunner
	}
	byRunner[id] = ownerEntry{terms: terms, modRev: kv.ModRevision, lease: kv.Lease}
}

// attached returns the ids of runners whose key says attached, in group
// (all groups when group is "").
func (v *view) attached(group string) []string {
	var ids []string
	for id, e := range v.runners {
		if e.info.State == StateAttached && (group == "" || e.info.Group == group) {
			ids = append(ids, id)
		}
	}
	return ids
}

// owners returns, for every shard of group, the runner holding it ("" when
// free) and its epoch. A shard two keys name (a release not yet seen, an
// acquisition racing a watch) goes to the higher epoch: the newer term.
func (v *view) holders(group string) (owners []string, epochs []int64) {
	owners = make([]string, v.shardCount)
	epochs = make([]int64, v.shardCount)
	for id, e := range v.owners[group] {
		for s, epoch := range e.terms {
			if epoch > epochs[s] {
				owners[s], epochs[s] = id, epoch
			}
		}
	}
	return owners, epochs
}

func (k keys) parseRunner(key []byte) (string, bool) {
	id, ok := strings.CutPrefix(string(key), k.runners())
	return id, ok && id != ""
}

func (k keys) parseOwner(key []byte) (group, id string, ok bool) {
	rest, ok := strings.CutPrefix(string(key), k.prefix+"owners/")
	if !ok {
		return "", "", false
	}
	group, id, ok = strings.Cut(rest, "/")
	return group, id, ok && group != "" && id != ""
}

// ownerValue is the JSON value of owners/<group>/<runner>: the terms a
// runner holds, grouped by epoch, each group's shards as ranges ("0-12,40").
// Epoch 0 means the revision of the put that wrote the value: a term's
// epoch is the revision of the put that added it, which the put cannot
// know; the runner's next put writes it out.
type ownerValue struct {
	Terms []termRun `json:"terms"`
}

type termRun struct {
	Epoch  int64  `json:"epoch"`
	Shards string `json:"shards"`
}

// encodeTerms is the value of an owner key holding terms (epoch 0: added
// by this put).
func encodeTerms(terms map[int]int64) string {
	byEpoch := map[int64][]int{}
	for s, e := range terms {
		byEpoch[e] = append(byEpoch[e], s)
	}
	var v ownerValue
	for _, e := range slices.Sorted(func(yield func(int64) bool) {
		for e := range byEpoch {
			if !yield(e) {
				return
			}
		}
	}) {
		shards := byEpoch[e]
		slices.Sort(shards)
		v.Terms = append(v.Terms, termRun{Epoch: e, Shards: ranges(shards)})
	}
	b, _ := json.Marshal(v)
	return string(b)
}

// decodeTerms reads an owner key's value written at revision rev.
func decodeTerms(value []byte, rev int64, shardCount int) (map[int]int64, error) {
	var v ownerValue
	if err := json.Unmarshal(value, &v); err != nil {
		return nil, fmt.Errorf("decoding owner key: %w", err)
	}
	terms := map[int]int64{}
	for _, run := range v.Terms {
		shards, err := parseRanges(run.Shards, shardCount)
		if err != nil {
			return nil, err
		}
		epoch := run.Epoch
		if epoch == 0 {
			epoch = rev
		}
		for _, s := range shards {
			terms[s] = epoch
		}
	}
	return terms, nil
}

// ranges writes sorted shards as "a-b,c,…".
func ranges(shards []int) string {
	var b strings.Builder
	for i := 0; i < len(shards); {
		j := i
		for j+1 < len(shards) && shards[j+1] == shards[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(shards[i]))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(shards[j]))
		}
		i = j + 1
	}
	return b.String()
}

// parseRanges reads ranges' output, refusing shards outside [0, n).
func parseRanges(s string, n int) ([]int, error) {
	if s == "" {
		return nil, nil
	}
	var out []int
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && isRange {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a || b >= n {
			return nil, fmt.Errorf("bad shard range %q (the cluster has %d shards)", part, n)
		}
		for s := a; s <= b; s++ {
			out = append(out, s)
		}
	}
	return out, nil
}
