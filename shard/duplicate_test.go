package shard

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/testutil"
)

// TestPausedPredecessorLeavesItsSuccessorAlone (issue 39, defect 2): a
// process whose lease expired while it was cut off wakes up after a
// successor with the same --runner-id registered and took the shards. Its
// writes of the id's keys are conditioned on its own lease (or on the key
// being absent), so it neither deletes nor overwrites the successor's
// keys: it finds them held under another lease, says so once at error
// level and stands down, checking with backoff until they are free. It
// used to delete the successor's owner key (the requests it had sent
// while cut off included) and overwrite its runner key, and the two took
// every shard from each other.
func TestPausedPredecessorLeavesItsSuccessorAlone(t *testing.T) {
	const shards = 8
	c := newCluster(t, shards)
	hist := c.record()
	k := keys{testPrefix}
	runnerKey, ownerKey := k.runner("a"), k.owner(testGroup, "a")

	oldLog := &logLines{t: t}
	old := c.add("a", true, withLogger(hclog.New(&hclog.LoggerOptions{Name: "a-old", Level: hclog.Debug, Output: oldLog})))
	c.waitConverged(10 * time.Second)
	oldLease := old.mgr.Status().LeaseID

	// The old process is cut off: its keep-alives stop reaching etcd and
	// whatever it sends now is held, to arrive when it wakes.
	old.proxy.Blackhole()
	c.setAside(old)
	testutil.Until(t, 3*c.ttl, "the old process's lease expired", func() (bool, string) {
		resp, err := c.admin.Get(context.Background(), runnerKey)
		if err != nil {
			return false, err.Error()
		}
		return len(resp.Kvs) == 0, fmt.Sprintf("%s still held under lease %x", runnerKey, oldLease)
	})

	succ := c.add("a", false)
	c.waitConverged(10 * time.Second)
	succLease := succ.mgr.Status().LeaseID
	var since int64 // revision of the successor's registration
	for _, ev := range hist.through(t, c.mark()) {
		if string(ev.Kv.Key) == runnerKey && ev.Kv.Lease == succLease && since == 0 {
			since = ev.Kv.ModRevision
		}
	}
	if since == 0 {
		t.Fatal("the successor's registration is not in the history")
	}

	// touched lists every change of the successor's keys in events, from
	// its registration, made by anyone but the successor.
	touched := func(events []*clientv3.Event) []string {
		var out []string
		for _, ev := range events {
			key := string(ev.Kv.Key)
			if ev.Kv.ModRevision < since || (key != runnerKey && key != ownerKey) {
				continue
			}
			if ev.Type == clientv3.EventTypeDelete {
				out = append(out, fmt.Sprintf("revision %d: %s deleted", ev.Kv.ModRevision, key))
			} else if ev.Kv.Lease != succLease {
				out = append(out, fmt.Sprintf("revision %d: %s written under lease %x (the successor's is %x)", ev.Kv.ModRevision, key, ev.Kv.Lease, succLease))
			}
		}
		return out
	}

	old.proxy.Pass()
	took := testutil.Until(t, 15*time.Second, "the old process stood down", func() (bool, string) {
		if bad := touched(hist.sofar()); len(bad) > 0 {
			return true, ""
		}
		return len(oldLog.matching("[ERROR]", "another live process")) > 0, "no error logged by the old process yet"
	})
	if bad := touched(hist.through(t, c.mark())); len(bad) > 0 {
		t.Fatalf("the old process changed its successor's keys:\n%s", strings.Join(bad, "\n"))
	}
	t.Logf("the old process stood down %s after it woke", took)
	if st := old.mgr.Status(); st.Conflict == "" || st.State != StateDetached || len(st.Owned) != 0 {
		t.Errorf("the old process after standing down: %+v", st)
	}
	// It keeps checking, and the successor keeps everything; the checks
	// back off, so a few of them pass before the successor leaves.
	testutil.Until(t, 10*time.Second, "the old process re-checked its id", func() (bool, string) {
		n := len(oldLog.matching("runner id still held by another process"))
		return n >= 2, fmt.Sprintf("%d checks", n)
	})
	if bad := touched(hist.through(t, c.mark())); len(bad) > 0 {
		t.Fatalf("the old process changed its successor's keys:\n%s", strings.Join(bad, "\n"))
	}
	if st := succ.mgr.Status(); len(st.Owned) != shards || st.State != StateAttached {
		t.Fatalf("the successor after its predecessor woke: %+v", st)
	}
	for _, e := range c.log.Events() {
		if e.Runner == "a" && e.Kind == Lost && e.Epoch >= since {
			t.Errorf("the successor lost shard %d (epoch %d)", e.Shard, e.Epoch)
		}
	}
	if n := len(oldLog.matching("[ERROR]")); n != 1 {
		t.Errorf("the old process logged %d errors, want one:\n%s", n, oldLog.matching("[ERROR]"))
	}

	// Once the successor is gone, the old process takes the id back.
	succ.leave()
	c.mu.Lock()
	c.members[old] = true
	c.mu.Unlock()
	took = c.waitConverged(20 * time.Second)
	t.Logf("the old process owns every shard %s after its successor left", took)
	checkNamedOnce(t, hist.through(t, c.mark()), shards)
}
