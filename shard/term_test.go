package shard

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/tasks"
)

func newTestLedger() (*ledger, *testsignal.Signal[Event]) {
	events := testsignal.New[Event]()
	l := newLedger("me", clock.NewFake(), hclog.NewNullLogger(), NewMetrics(nil))
	l.events = events
	return l, events
}

// TestTermMoves: exactly the moves in the termState table are accepted;
// entering cancelled, released or lost cancels the term's work with a
// cause wrapping tasks.ErrOwnershipLost, and released or lost end the term.
func TestTermMoves(t *testing.T) {
	all := []termState{acquired, fenced, releasing, cancelled, released, lost}
	for _, from := range all {
		for _, to := range all {
			l, events := newTestLedger()
			l.adopt(3, 42, l.clock.Now(), 0)
			tm := l.terms[3]
			tm.state = from
			l.mu.Lock()
			ok := l.move(tm, to, l.clock.Now(), "test")
			l.mu.Unlock()
			if want := slices.Contains(legalMoves[from], to); ok != want {
				t.Errorf("%s -> %s accepted %v, want %v", from, to, ok, want)
				continue
			}
			if !ok {
				continue
			}
			stopped := to == cancelled || to == released || to == lost
			if (tm.ctx.Err() != nil) != stopped {
				t.Errorf("%s -> %s: work cancelled %v, want %v", from, to, tm.ctx.Err() != nil, stopped)
			}
			if stopped && !errors.Is(context.Cause(tm.ctx), tasks.ErrOwnershipLost) {
				t.Errorf("%s -> %s: cause %v", from, to, context.Cause(tm.ctx))
			}
			ended := to == released || to == lost
			if _, still := l.terms[3]; still == ended {
				t.Errorf("%s -> %s: term still in the ledger %v", from, to, still)
			}
			if ended {
				last := events.Events()[len(events.Events())-1]
				if (to == released && last.Kind != Released) || (to == lost && last.Kind != Lost) {
					t.Errorf("%s -> %s: last event %s", from, to, last.Kind)
				}
			}
		}
	}
}

// TestHoldPinsFencedTermsOnly: a hold pins fenced terms; work begins on a
// held term even once it is releasing, never once cancelled, never when
// the runner may not work.
func TestHoldPinsFencedTermsOnly(t *testing.T) {
	l, _ := newTestLedger()
	now := l.clock.Now()
	l.adopt(1, 10, now, 0)
	l.adopt(2, 20, now, 0)
	l.adopt(3, 30, now, 0)
	l.markFenced([]claims.ShardEpoch{{Shard: 1, Epoch: 10}, {Shard: 2, Epoch: 20}})
	if got := l.unfenced(); len(got) != 1 || got[0].Shard != 3 {
		t.Fatalf("unfenced %v, want shard 3", got)
	}
	may := true
	h := l.hold(func() bool { return may }, 0)
	if got := h.Terms(); len(got) != 2 || got[0].Shard != 1 || got[1].Shard != 2 {
		t.Fatalf("held %v, want shards 1 and 2", got)
	}
	l.mu.Lock()
	l.move(l.terms[1], releasing, now, "test")
	l.mu.Unlock()
	if _, done, ok := h.Begin(1, 10); !ok {
		t.Error("work must begin on a held term whose release started after the hold")
	} else {
		done()
	}
	l.cancelTerm(2, 20, "test")
	if _, _, ok := h.Begin(2, 20); ok {
		t.Error("work began on a cancelled term")
	}
	if _, _, ok := h.Begin(1, 11); ok {
		t.Error("work began under another epoch")
	}
	may = false
	if _, _, ok := h.Begin(1, 10); ok {
		t.Error("work began although the runner may not work")
	}
	h.Release()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.terms[1].inflight != 0 || l.terms[2].inflight != 0 {
		t.Errorf("holds left: %d %d", l.terms[1].inflight, l.terms[2].inflight)
	}
}

// TestNoTermOfAnotherLeaseWorks: a key whose creating Txn was answered
// after the runner detached is adopted cancelled (the detach's cancel-all
// ran before it existed), and a term created under an earlier lease is
// never held under the next one, even before the watch shows its key gone.
func TestNoTermOfAnotherLeaseWorks(t *testing.T) {
	l, _ := newTestLedger()
	detached := true
	l.detached = func() bool { return detached }
	now := l.clock.Now()
	l.adopt(1, 10, now, 1)
	l.mu.Lock()
	if st := l.terms[1].state; st != cancelled || l.terms[1].ctx.Err() == nil {
		t.Errorf("a term adopted while detached is %s, its work cancelled: %v", st, l.terms[1].ctx.Err())
	}
	l.mu.Unlock()
	detached = false
	l.adopt(2, 20, now, 1)
	l.markFenced([]claims.ShardEpoch{{Shard: 1, Epoch: 10}, {Shard: 2, Epoch: 20}})
	always := func() bool { return true }
	if got := l.hold(always, 1).Terms(); len(got) != 1 || got[0].Shard != 2 {
		t.Fatalf("held %v under lease 1, want shard 2 only", got)
	}
	if got := l.hold(always, 2).Terms(); len(got) != 0 {
		t.Fatalf("held %v, terms of lease 1, under lease 2", got)
	}
}

// TestNoWorkPastTheDetachPoint: a runner whose lease clock has passed its
// detach point takes no new work even before its keep-alive loop has
// detached it (a process woken from a pause): holds are empty and Begin
// refuses.
func TestNoWorkPastTheDetachPoint(t *testing.T) {
	c := clock.NewFake()
	m, err := New(Config{Client: &clientv3.Client{}, Detach: detach.New(detach.Config{Clock: c}), Prefix: "/p/",
		RunnerID: "r", ShardCount: 4, LeaseTTL: 3 * time.Second, Clock: c})
	if err != nil {
		t.Fatal(err)
	}
	m.keeper.lc = detach.NewLeaseClock(c.Now(), 3*time.Second, time.Second, 2)
	m.ledger.adopt(1, 7, c.Now(), 0)
	m.Fenced([]claims.ShardEpoch{{Shard: 1, Epoch: 7}})
	h := m.Hold()
	if len(h.Terms()) != 1 {
		t.Fatalf("held %v before the detach point", h.Terms())
	}
	c.Advance(2 * time.Second) // the detach point: TTL − margin
	if _, _, ok := h.Begin(1, 7); ok {
		t.Error("work began past the detach point")
	}
	h.Release()
	if m.machine.IsDetached() {
		t.Fatal("the test needs the runner still attached: the keep-alive loop has not run")
	}
	if again := m.Hold(); len(again.Terms()) != 0 {
		t.Errorf("a hold past the detach point pins %v", again.Terms())
	}
}

// flakyKV fails every Txn while failing is set and counts the Txns sent: the
// fault injection of an etcd that refuses writes while the lease holds.
type flakyKV struct {
	clientv3.KV
	failing bool
	sent    int
}

func (k *flakyKV) Txn(context.Context) clientv3.Txn { return &flakyTxn{k: k} }

type flakyTxn struct {
	k   *flakyKV
	ops []clientv3.Op
}

func (t *flakyTxn) If(...clientv3.Cmp) clientv3.Txn  { return t }
func (t *flakyTxn) Else(...clientv3.Op) clientv3.Txn { return t }
func (t *flakyTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.ops = ops
	return t
}

func (t *flakyTxn) Commit() (*clientv3.TxnResponse, error) {
	t.k.sent++
	if t.k.failing {
		return nil, errors.New("etcdserver: request timed out")
	}
	// The comparison holds: the Then branch applies.
	resp := &clientv3.TxnResponse{Header: &etcdserverpb.ResponseHeader{Revision: 100}, Succeeded: true}
	for _, op := range t.ops {
		if op.IsGet() {
			resp.Responses = append(resp.Responses, &etcdserverpb.ResponseOp{
				Response: &etcdserverpb.ResponseOp_ResponseRange{ResponseRange: &etcdserverpb.RangeResponse{}}})
			continue
		}
		resp.Responses = append(resp.Responses, &etcdserverpb.ResponseOp{
			Response: &etcdserverpb.ResponseOp_ResponsePut{ResponsePut: &etcdserverpb.PutResponse{}}})
	}
	return resp, nil
}

// TestFailedReleaseBacksOff: after an etcd call fails, the reconcile loop
// neither sends the release again nor wakes before the backoff (it used to
// spin every millisecond on a release that was due), and a later success
// ends the backoff.
func TestFailedReleaseBacksOff(t *testing.T) {
	c := clock.NewFake()
	kv := &flakyKV{failing: true}
	m, err := New(Config{Client: &clientv3.Client{KV: kv}, Detach: detach.New(detach.Config{Clock: c}), Prefix: "/p/",
		RunnerID: "r", ShardCount: 4, LeaseTTL: 3 * time.Second, Clock: c})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	m.keeper.lc = detach.NewLeaseClock(c.Now(), 3*time.Second, time.Second, 2)
	m.ledger.adopt(1, 7, c.Now(), 0)
	p := plan{now: c.Now(), target: make([]string, 4)} // shard 1 assigned to nobody: release it
	m.releaseStep(ctx, p)
	if kv.sent != 1 || !m.holds(1) {
		t.Fatalf("first release: %d sent, held %v", kv.sent, m.holds(1))
	}
	for range 3 {
		m.releaseStep(ctx, p)
	}
	if kv.sent != 1 {
		t.Fatalf("%d releases sent inside the backoff", kv.sent)
	}
	if d := m.nextWake(time.Time{}); d < 100*time.Millisecond || d > 200*time.Millisecond {
		t.Fatalf("the loop would wake in %s, want the storage backoff (100–200ms)", d)
	}
	c.Advance(200 * time.Millisecond)
	p.now = c.Now()
	kv.failing = false
	m.releaseStep(ctx, p)
	if kv.sent != 2 || m.holds(1) {
		t.Fatalf("release after the backoff: %d sent, held %v", kv.sent, m.holds(1))
	}
	if !m.storageRetryAt.IsZero() {
		t.Fatal("a successful call did not end the backoff")
	}
}
