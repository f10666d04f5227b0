package shard

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testutil"
)

// stepper holds a member's watcher so that its Run loop reconciles after
// every watch update before it gets the next one: the interleaving in
// which a view that is ahead of what it received would act.
type stepper struct {
	mu sync.Mutex
	// delivered counts the updates handed over, applied those in the view;
	// reconciledAfter is how many were applied at the last reconcile pass.
	delivered, applied, reconciledAfter int
	// appliedLast is the revision of the last event applied, reconciledLast
	// its value at the last pass; firstLast is the revision of the last
	// event of the first update.
	appliedLast, reconciledLast int64
	firstLast                   int64
	changed                     chan struct{}
}

func newStepper() *stepper { return &stepper{changed: make(chan struct{})} }

func (s *stepper) set(h *hooks) {
	h.delivering = s.delivering
	h.applied = s.applyDone
	h.reconciled = s.reconciled
}

func (s *stepper) delivering(ctx context.Context, u watchUpdate) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.delivered > 0 && s.reconciledAfter < s.delivered {
		changed := s.changed
		s.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
		}
		s.mu.Lock()
		if ctx.Err() != nil {
			break
		}
	}
	if s.delivered == 0 && len(u.events) > 0 {
		s.firstLast = u.events[len(u.events)-1].Kv.ModRevision
	}
	s.delivered++
}

func (s *stepper) applyDone(u watchUpdate) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.applied++
	if len(u.events) > 0 {
		s.appliedLast = u.events[len(u.events)-1].Kv.ModRevision
	}
}

func (s *stepper) reconciled() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reconciledAfter, s.reconciledLast = s.applied, s.appliedLast
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *stepper) state() (delivered int, reconciledLast, firstLast int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.delivered, s.reconciledLast, s.firstLast
}

// TestLaggingWatchNeverNamesAUnitTwice (issue 39, defect 1): a member whose
// watch is more than 1,000 revisions behind receives its backlog in
// batches, each with the store's current revision in its header (etcd's
// syncWatchers). Its view of the group is complete only up to the last
// event it received: a member that took the header for that acquired
// units another member's key, not delivered yet, already named, and two
// keys named them at once.
//
// The other member, z, is played by the test through its keys, so that
// its key changes exactly while a's watch is behind: z gives up the units
// the assignment moves to a, more than 1,000 revisions pass under the
// cluster prefix, and z names those units again. a's watch opens only
// then, from the revision of its start, and a reconciles after each batch.
func TestLaggingWatchNeverNamesAUnitTwice(t *testing.T) {
	const shards = 8
	c := newCluster(t, shards)
	ctx := context.Background()
	hist := c.record()

	lease, err := c.admin.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	info, _ := json.Marshal(RunnerInfo{ID: "z", State: StateAttached, Group: testGroup, StartedAt: time.Now()})
	if _, err := c.admin.Put(ctx, testPrefix+"runners/z", string(info), clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	zKey := keys{testPrefix}.owner(testGroup, "z")
	all := map[int]int64{}
	for s := range shards {
		all[s] = 0
	}
	resp, err := c.admin.Put(ctx, zKey, encodeTerms(all), clientv3.WithLease(lease.ID))
	if err != nil {
		t.Fatal(err)
	}
	zEpoch := resp.Header.Revision

	open := make(chan struct{})
	st := newStepper()
	c.add("a", false, withClock(clock.NewFake()), withoutJoinSettle(), withLeaseTTL(60*time.Second),
		withHooks(func(h *hooks) {
			st.set(h)
			h.watchOpening = func(ctx context.Context) {
				select {
				case <-open:
				case <-ctx.Done():
				}
			}
		}))

	// What a's view computes: half of the shards move to a.
	owners := make([]string, shards)
	for s := range owners {
		owners[s] = "z"
	}
	keeps, moved := map[int]int64{}, map[int]int64{}
	for s, to := range Assign([]string{"a", "z"}, owners) {
		if to == "z" {
			keeps[s] = zEpoch
		} else {
			moved[s] = 0
		}
	}
	if len(moved) == 0 {
		t.Fatal("the assignment moves nothing to a")
	}
	// z gives the moved shards up...
	if _, err := c.admin.Put(ctx, zKey, encodeTerms(keeps), clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	// ...1,100 revisions pass under the prefix...
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for w := range 4 {
		wg.Go(func() {
			for i := range 275 {
				if _, err := c.admin.Put(ctx, fmt.Sprintf("%sunrelated/%d", testPrefix, w), fmt.Sprint(i)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// ...and z names them again.
	again := map[int]int64{}
	for s, e := range keeps {
		again[s] = e
	}
	for s := range moved {
		again[s] = 0
	}
	resp, err = c.admin.Put(ctx, zKey, encodeTerms(again), clientv3.WithLease(lease.ID))
	if err != nil {
		t.Fatal(err)
	}
	retaken := resp.Header.Revision

	close(open)
	var delivered int
	var firstLast int64
	took := testutil.Until(t, 10*time.Second, "a reconciled after its watch caught up", func() (bool, string) {
		var rev int64
		delivered, rev, firstLast = st.state()
		return rev >= retaken, fmt.Sprintf("a reconciled after events up to revision %d of %d", rev, retaken)
	})
	if delivered < 2 || firstLast >= retaken {
		t.Fatalf("the backlog came in %d batches, the first ending at revision %d (z re-took its shards at %d): the test needs etcd's batches", delivered, firstLast, retaken)
	}
	t.Logf("a caught up in %d batches in %s; the first ended at revision %d, z re-took %d shards at %d", delivered, took, firstLast, len(moved), retaken)

	// Every revision of the owner keys, up to now.
	checkNamedOnce(t, hist.through(t, c.mark()), shards)
}
