package executor

import (
	"testing"
	"time"

	"github.com/shardrun/shardrun/tasks"
)

// listings counts the listings of claims (Store.Claimed) so far.
func (s *partialStore) listings() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.listed)
}

// Issue 40: while a database is down, the listing of its terms' claims
// (the recovery after a claim that failed there) fails too. It is tried
// again on a backoff (dbRetry), not at every claim round — under load a
// round comes at nearly every handler's return — while the claims at the
// other databases go on each round. Before, each round listed again: a
// statement and a warning a round, and a pass over every attempt whose
// outcome waits for its write.
func TestListingAfterAClaimFailedAtADownDatabaseIsPaced(t *testing.T) {
	t.Parallel()
	e, st := newPartialEnv(t)
	e.store.add(1, "noop", 1, 3)
	e.own.own(0, 4)
	e.own.own(1, 4)
	e.run()
	e.until("a claim failed at the down database", func() bool { return st.claimed.Load() > 0 })
	e.until("the listing tried there", func() bool { return st.listings() > 0 })
	listed := st.listings()
	const rounds = 30
	for i := range rounds {
		// A round, with no move of the clock: a task at the healthy
		// database claimed (its outcome waits for the writer's flush
		// delay), and a claim at the down database.
		id := int64(100 + i)
		e.store.add(id, "noop", 0, 3)
		before := st.claimed.Load()
		e.exec.Wake(true, nil, nil)
		deadline := time.Now().Add(10 * time.Second)
		for e.state(id) == tasks.Ready || st.claimed.Load() == before {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: task %d %s, claims at the down database %d (%d before), within 10s", i, id, e.state(id), st.claimed.Load(), before)
			}
			time.Sleep(time.Millisecond)
		}
	}
	if n := st.listings() - listed; n > 1 {
		t.Fatalf("%d listings at the down database over %d claim rounds with no move of the clock; want at most 1 (paced by dbRetry)", n, rounds)
	}
	listed = st.listings()
	e.until("the healthy database's tasks completed", func() bool { return e.state(100+rounds-1) == tasks.Completed })
	e.until("the listing tried again after its backoff", func() bool { return st.listings() > listed })
	st.down.Store(false)
	e.exec.Wake(true, nil, nil)
	e.until("the down database's task completed once it is back", func() bool { return e.state(1) == tasks.Completed })
}
