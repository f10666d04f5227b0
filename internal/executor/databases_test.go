package executor

// The executor in a cluster of several databases (issue 40): a handler
// whose shard moved to another database is interrupted, a fence its
// database no longer holds is raised again rather than lost, and a claim
// that failed at one database leaves only that database's terms unsure.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// A handler whose CompleteTx was refused because the task's shard moved to
// another database (tasks.ErrShardMoved) is interrupted: the attempt is
// given back unspent, never failed.
func TestAHandlerRefusedForAMovedShardIsInterrupted(t *testing.T) {
	t.Parallel()
	for _, cause := range []error{tasks.ErrShardMoved, tasks.ErrOwnershipLost} {
		t.Run(cause.Error(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, map[string]tasks.Handler{"tx": func(context.Context, *tasks.Task) error {
				return fmt.Errorf("shardrun: completing task 1: %w", cause)
			}})
			e.store.add(1, "tx", 0, 1)
			e.own.own(0, 1)
			e.run()
			e.until("interruption written", func() bool { return e.store.count("interrupt") == 1 })
			task := e.store.get(1)
			if task.State != tasks.Ready || task.Attempt != 1 || len(task.Errors) != 1 || !task.Errors[0].Interrupted {
				t.Fatalf("task %+v: want ready at attempt 1 (its only attempt unspent) with the interruption in its history", task)
			}
			if e.store.count("fail") != 0 {
				t.Fatal("a refusal for a moved shard was written as a failed attempt")
			}
		})
	}
}

// movedStore is the fake store where the raises of some shards answer
// claims.Orphans.Moved (or Unreached) while their database does not hold
// them.
type movedStore struct {
	*fakeStore
	unreached bool
	mu        sync.Mutex
	moved     map[int]bool
}

func (s *movedStore) RaiseFences(ctx context.Context, owner, group string, terms []claims.ShardEpoch) (claims.Orphans, error) {
	s.mu.Lock()
	var here, away []claims.ShardEpoch
	for _, t := range terms {
		if s.moved[t.Shard] {
			away = append(away, t)
		} else {
			here = append(here, t)
		}
	}
	s.mu.Unlock()
	o, err := s.fakeStore.RaiseFences(ctx, owner, group, here)
	if s.unreached {
		o.Unreached = append(o.Unreached, away...)
	} else {
		o.Moved = append(o.Moved, away...)
	}
	return o, err
}

// A raise at a database that does not hold the shard (claims.Orphans.Moved)
// or cannot be reached (Unreached) neither reports the term lost nor
// claims there; the raise is tried again, and succeeds once the shard's
// database answers.
func TestAFenceNotRaisedAtItsDatabaseIsRaisedAgain(t *testing.T) {
	t.Parallel()
	for _, unreached := range []bool{false, true} {
		t.Run(fmt.Sprint("unreached=", unreached), func(t *testing.T) {
			t.Parallel()
			var st *movedStore
			e := newEnv(t, map[string]tasks.Handler{"noop": noop}, func(c *Config) {
				st = &movedStore{fakeStore: c.Store.(*fakeStore), unreached: unreached, moved: map[int]bool{1: true}}
				c.Store = st
			})
			e.store.add(1, "noop", 0, 3)
			e.store.add(2, "noop", 1, 3)
			e.own.own(0, 4)
			e.own.own(1, 4)
			e.run()
			e.until("the held shard's task completed", func() bool { return e.state(1) == tasks.Completed })
			e.until("the raise tried again", func() bool { return e.store.count("raise") >= 3 })
			if lost := e.own.lostTerms(); len(lost) > 0 {
				t.Fatalf("terms %v reported lost: a moved or unreached fence is not a lost one", lost)
			}
			if e.state(2) != tasks.Ready {
				t.Fatal("claimed from a shard whose fence was not raised")
			}
			st.mu.Lock()
			st.moved = nil
			st.mu.Unlock()
			e.until("the moved shard's task completed once raised", func() bool { return e.state(2) == tasks.Completed })
			if lost := e.own.lostTerms(); len(lost) > 0 {
				t.Fatalf("terms %v reported lost", lost)
			}
		})
	}
}

// partialStore is the fake store where claims on shard 1 fail as at a
// database that cannot be reached, after the rest of the claim ran:
// the answer is the others' tasks with a *claims.PartialError.
type partialStore struct {
	*fakeStore
	down    atomic.Bool
	mu      sync.Mutex
	listed  [][]claims.ShardEpoch
	claimed atomic.Int32
}

var errDatabaseDown = fmt.Errorf("database second: %w", errDown)

func (s *partialStore) split(terms []claims.ShardEpoch) (up, down []claims.ShardEpoch) {
	for _, t := range terms {
		if t.Shard == 1 && s.down.Load() {
			down = append(down, t)
		} else {
			up = append(up, t)
		}
	}
	return up, down
}

func (s *partialStore) Claim(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error) {
	up, down := s.split(terms)
	got, err := s.fakeStore.Claim(ctx, owner, up, queue, kinds, limit, startNow)
	if err != nil || len(down) == 0 {
		return got, err
	}
	s.claimed.Add(1)
	return got, &claims.PartialError{Terms: down, Err: errDatabaseDown}
}

func (s *partialStore) Claimed(ctx context.Context, owner string, terms []claims.ShardEpoch) ([]claims.Ref, error) {
	s.mu.Lock()
	s.listed = append(s.listed, slices.Clone(terms))
	s.mu.Unlock()
	up, down := s.split(terms)
	got, err := s.fakeStore.Claimed(ctx, owner, up)
	if err != nil || len(down) == 0 {
		return got, err
	}
	if len(up) == 0 {
		return nil, errDatabaseDown
	}
	return got, &claims.PartialError{Terms: down, Err: errDatabaseDown}
}

// newPartialEnv is an executor over a store of two databases, the one of
// shard 1 down (partialStore).
func newPartialEnv(t *testing.T) (*env, *partialStore) {
	var st *partialStore
	e := newEnv(t, map[string]tasks.Handler{"noop": noop}, func(c *Config) {
		st = &partialStore{fakeStore: c.Store.(*fakeStore)}
		c.Store = st
	})
	st.down.Store(true)
	return e, st
}

// A claim that failed at one database only (claims.PartialError) runs what
// the others claimed, goes on claiming there, and lists the claims (the
// "unsure" recovery) of the failed database's terms only.
func TestAClaimThatFailedAtOneDatabaseRunsTheOthers(t *testing.T) {
	t.Parallel()
	e, st := newPartialEnv(t)
	e.store.add(1, "noop", 0, 3)
	e.store.add(2, "noop", 1, 3)
	e.own.own(0, 4)
	e.own.own(1, 4)
	e.run()
	e.until("the reachable database's task completed", func() bool { return e.state(1) == tasks.Completed })
	e.until("a claim failed at the other database", func() bool { return st.claimed.Load() > 0 })
	e.store.add(3, "noop", 0, 3)
	e.exec.Wake(true, nil, nil)
	e.until("claims go on at the reachable database", func() bool { return e.state(3) == tasks.Completed })
	st.down.Store(false)
	e.exec.Wake(true, nil, nil)
	e.until("the other database's task completed once it is back", func() bool { return e.state(2) == tasks.Completed })
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(st.listed) == 0 {
		t.Fatal("the claims of the failed database's terms were never listed")
	}
	for _, terms := range st.listed {
		for _, term := range terms {
			if term.Shard != 1 {
				t.Fatalf("listed the claims of %v after a claim that failed at shard 1's database only", terms)
			}
		}
	}
}
