package store_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// TestLayoutUnderStress runs random mixes of every move at once — enqueues
// (single, in a producer's transaction, batches, raw SQL; with sequences,
// priorities, unique keys and run_after), claims, heartbeats, completions,
// failures, interruptions, cancelled attempts and unclaims, fence raises of
// a new owner, operators' cancels and retries (one task and in bulk),
// queue pauses and removals, the leader's sweeps, the unhandled-kind rule and
// retention — and checks that no statement deadlocked, and that the
// layout's invariants hold in consistent snapshots taken while it runs
// and at the end (shardrun_layout_violations).
//
// SHARDRUN_STRESS_OPS sets the number of moves (2,000 by default) and
// SHARDRUN_STRESS_SEED the seed (logged, to replay a failure's mix).
func TestLayoutUnderStress(t *testing.T) {
	t.Parallel()
	ops := 2000
	if v := os.Getenv("SHARDRUN_STRESS_OPS"); v != "" {
		var err error
		if ops, err = strconv.Atoi(v); err != nil || ops < 1 {
			t.Fatalf("SHARDRUN_STRESS_OPS=%q: want a positive number", v)
		}
	}
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("SHARDRUN_STRESS_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("SHARDRUN_STRESS_SEED=%q: %v", v, err)
		}
	}
	t.Logf("seed %d (SHARDRUN_STRESS_SEED to replay the mix; the interleaving is the machine's)", seed)
	s := setup(t)
	ctx := context.Background()
	w := &stress{t: t, s: s, ctx: ctx, epochs: map[int]int64{}, owners: map[int]string{}, running: map[int64]tasks.Task{}}
	for sh := range stressShards {
		w.raise(sh)
	}
	var left atomic.Int64
	left.Store(int64(ops))
	var wg sync.WaitGroup
	for g := range 8 {
		rnd := rand.New(rand.NewPCG(seed, uint64(g)))
		wg.Go(func() {
			for left.Add(-1) >= 0 && !t.Failed() {
				w.step(rnd)
			}
		})
	}
	// Consistent snapshots while the moves run: every committed state
	// satisfies the invariants, not only the one at rest.
	checks := make(chan struct{})
	var checked int
	go func() {
		defer close(checks)
		for left.Load() > 0 && !t.Failed() {
			w.checkLayout("while the moves ran")
			checked++
		}
	}()
	wg.Wait()
	<-checks
	w.checkLayout("at the end")
	t.Logf("%d moves, %d layout checks while they ran; %s", ops, checked, w.counts())
}

const stressShards = 4

// stress is the shared state of the stress test's goroutines.
type stress struct {
	t   *testing.T
	s   *store.Store
	ctx context.Context

	mu      sync.Mutex
	ids     []int64
	epochs  map[int]int64
	owners  map[int]string
	running map[int64]tasks.Task
	done    sync.Map // move name -> *atomic.Int64
}

func (w *stress) count(move string) {
	c, _ := w.done.LoadOrStore(move, new(atomic.Int64))
	c.(*atomic.Int64).Add(1)
}

func (w *stress) counts() string {
	out := ""
	w.done.Range(func(k, v any) bool {
		out += fmt.Sprintf("%s %d, ", k, v.(*atomic.Int64).Load())
		return true
	})
	return out
}

// check fails the test on an error a move must not return: a deadlock
// above all. Refusals an operator gets (a conflict, a task gone, a unique
// key held) and a database that cancels a statement are expected.
func (w *stress) check(move string, err error) {
	if err == nil {
		w.count(move)
		return
	}
	var pe *pgconn.PgError
	switch {
	case isDeadlock(err):
		w.t.Errorf("%s deadlocked: %v", move, err)
	case errors.Is(err, tasks.ErrConflict), errors.Is(err, tasks.ErrNotFound):
		w.count(move + " (refused)")
	case errors.As(err, &pe) && pe.Code == "23505":
		w.count(move + " (unique key held)")
	default:
		w.t.Errorf("%s: %v", move, err)
	}
}

func (w *stress) checkLayout(when string) {
	err := pgx.BeginTxFunc(w.ctx, w.s.Pool(), pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		rows, err := tx.Query(w.ctx, `SELECT coalesce(task_id::text, '-'), coalesce(sequence_key, '-'), problem FROM shardrun_layout_violations()`)
		if err != nil {
			return err
		}
		var id, key, problem string
		_, err = pgx.ForEachRow(rows, []any{&id, &key, &problem}, func() error {
			w.t.Errorf("%s: task %s, sequence %s: %s", when, id, key, problem)
			return nil
		})
		return err
	})
	if err != nil {
		w.t.Errorf("checking the layout %s: %v", when, err)
	}
}

func (w *stress) raise(shard int) {
	w.mu.Lock()
	epoch := w.epochs[shard] + 1
	owner := fmt.Sprintf("runner-%d", epoch%3)
	w.mu.Unlock()
	o, err := w.s.RaiseFences(w.ctx, owner, "", []claims.ShardEpoch{{Shard: shard, Epoch: epoch}})
	w.check("raise", err)
	if err != nil || len(o.Raised) != 1 {
		return
	}
	w.mu.Lock()
	if w.epochs[shard] < epoch {
		w.epochs[shard], w.owners[shard] = epoch, owner
	}
	if len(o.Pending) > 0 {
		w.count("raise (orphans pending)")
	}
	w.mu.Unlock()
}

// requeuePending is a new owner coming back to the orphans its raise
// skipped (a claim another transaction held), on every shard it owns.
func (w *stress) requeuePending() {
	w.mu.Lock()
	byOwner := map[string][]claims.ShardEpoch{}
	for sh, owner := range w.owners {
		byOwner[owner] = append(byOwner[owner], claims.ShardEpoch{Shard: sh, Epoch: w.epochs[sh]})
	}
	w.mu.Unlock()
	for owner, terms := range byOwner {
		_, err := w.s.RequeueOrphans(w.ctx, owner, "", terms)
		w.check("requeue orphans", err)
	}
}

func (w *stress) anyID(rnd *rand.Rand) (int64, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.ids) == 0 {
		return 0, false
	}
	return w.ids[rnd.IntN(len(w.ids))], true
}

// takeRunning removes and returns a random running task this test claimed.
func (w *stress) takeRunning(rnd *rand.Rand) (tasks.Task, string, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.running) == 0 {
		return tasks.Task{}, "", false
	}
	n := rnd.IntN(len(w.running))
	for id, task := range w.running {
		if n == 0 {
			delete(w.running, id)
			return task, task.ClaimedBy, true
		}
		n--
	}
	return tasks.Task{}, "", false
}

var (
	// rare gets few tasks, in no sequence, and no runner claims it: a
	// removal that cancels its tasks first often finds it idle while
	// producers and retries race it.
	stressQueues = []string{"default", "mail", "rare"}
	stressKinds  = []string{"k", "other"}
	stressSeqs   = []string{"s1", "s2", "s3", "s4"}
)

// newInsert is a random task: a sequence's task one time in two, an urgent
// one one in four, a unique key one in five, due later one in six.
func (w *stress) newInsert(rnd *rand.Rand) store.Insert {
	in := insert(stressKinds[rnd.IntN(len(stressKinds))], rnd.IntN(stressShards), 1+rnd.IntN(3))
	in.Queue = stressQueues[rnd.IntN(2)]
	rare := rnd.IntN(10) == 0
	in.Priority = 1 + rnd.IntN(5)
	if rnd.IntN(2) == 0 {
		in.SequenceKey, in.SequenceContinue = stressSeqs[rnd.IntN(len(stressSeqs))], rnd.IntN(2) != 0
	}
	if rnd.IntN(5) == 0 {
		in.UniqueKey = fmt.Sprintf("u%d", rnd.IntN(20))
	}
	if rnd.IntN(6) == 0 {
		later := time.Now().Add(time.Duration(rnd.IntN(300)) * time.Millisecond)
		in.RunAfter = later
	}
	if rnd.IntN(8) == 0 {
		soon := time.Now().Add(time.Duration(rnd.IntN(500)) * time.Millisecond)
		in.Deadline = soon
	}
	if rare { // in no sequence: a bulk cancel drains it
		in.Queue, in.SequenceKey, in.SequenceContinue, in.RunAfter = "rare", "", false, time.Time{}
	}
	return in
}

func (w *stress) remember(ids ...int64) {
	w.mu.Lock()
	w.ids = append(w.ids, ids...)
	w.mu.Unlock()
}

func (w *stress) step(rnd *rand.Rand) {
	ctx := w.ctx
	switch rnd.IntN(20) {
	case 0, 1: // one enqueue, on the pool
		e, err := w.s.EnqueueIn(ctx, nil, w.newInsert(rnd))
		w.check("enqueue", err)
		w.remember(e.ID)
	case 2: // a producer's transaction: two tasks and some of its own work
		var ids []int64
		err := pgx.BeginFunc(ctx, w.s.Pool(), func(tx pgx.Tx) error {
			for range 2 {
				e, err := w.s.EnqueueIn(ctx, tx, w.newInsert(rnd))
				if err != nil {
					return err
				}
				ids = append(ids, e.ID)
			}
			_, err := tx.Exec(ctx, `SELECT count(*) FROM tasks WHERE id = ANY ($1)`, ids)
			return err
		})
		w.check("enqueue in a transaction", err)
		if err == nil {
			w.remember(ids...)
		}
	case 3: // a batch
		batch := make([]store.Insert, 1+rnd.IntN(6))
		for i := range batch {
			batch[i] = w.newInsert(rnd)
		}
		_, err := w.s.EnqueueBatch(ctx, batch)
		w.check("enqueue a batch", err)
	case 4: // raw SQL, of a sequence
		var id int64
		err := w.s.Pool().QueryRow(ctx, `INSERT INTO tasks (kind, shard, key, sequence_key, sequence_blocks)
			VALUES ('k', $1, 'raw', $2, false) RETURNING id`, rnd.IntN(stressShards), stressSeqs[rnd.IntN(len(stressSeqs))]).Scan(&id)
		w.check("raw insert", err)
		w.remember(id)
	case 5, 6, 7: // claim
		sh := rnd.IntN(stressShards)
		w.mu.Lock()
		owner, epoch := w.owners[sh], w.epochs[sh]
		w.mu.Unlock()
		claimFn := w.s.Claim
		if rnd.IntN(3) == 0 {
			claimFn = w.s.ClaimUrgent
		}
		n := 1 + rnd.IntN(5)
		// Some of what a claim takes is claimed ahead of need: their
		// attempts are kept by a give-back, a requeue or a sweep.
		got, err := claimFn(ctx, owner, []claims.ShardEpoch{{Shard: sh, Epoch: epoch}}, stressQueues[rnd.IntN(2)], stressKinds, n, rnd.IntN(n+1))
		w.check("claim", err)
		w.mu.Lock()
		for _, task := range got {
			w.running[task.ID] = task
		}
		w.mu.Unlock()
	case 8, 9, 10: // the runner's write
		task, owner, ok := w.takeRunning(rnd)
		if !ok {
			return
		}
		var err error
		switch rnd.IntN(8) {
		case 0, 1:
			_, err = w.s.Complete(ctx, owner, []claims.Completion{{Ref: claims.RefOf(task)}})
		case 2:
			_, err = w.s.Fail(ctx, owner, []claims.Failure{{Ref: claims.RefOf(task), Error: "boom", Final: rnd.IntN(3) == 0,
				Backoff: claims.Backoff{Base: time.Millisecond, Cap: 10 * time.Millisecond}}})
		case 3:
			_, err = w.s.Interrupt(ctx, owner, []claims.Interruption{{Ref: claims.RefOf(task), Reason: "detached"}})
		case 4:
			_, err = w.s.Unclaim(ctx, owner, []claims.Ref{claims.RefOf(task)})
		case 5:
			_, err = w.s.CancelAttempts(ctx, owner, []claims.Cancellation{{Ref: claims.RefOf(task)}})
		case 6: // a task claimed ahead starts (it stays claimed)
			_, err = w.s.Started(ctx, owner, []claims.Ref{claims.RefOf(task)})
			w.mu.Lock()
			w.running[task.ID] = task
			w.mu.Unlock()
		case 7: // a handler's transaction: its own task, its completion, and a commit or a rollback
			err = pgx.BeginFunc(ctx, w.s.Pool(), func(tx pgx.Tx) error {
				if _, err := w.s.EnqueueIn(ctx, tx, w.newInsert(rnd)); err != nil {
					return err
				}
				if _, err := w.s.CompleteTx(ctx, tx, owner, claims.Completion{Ref: claims.RefOf(task)}); err != nil {
					return err
				}
				if rnd.IntN(3) == 0 {
					return errRolledBack
				}
				return nil
			})
			if errors.Is(err, errRolledBack) {
				err = nil
			}
		}
		w.check("write", err)
	case 11: // heartbeat (the task stays claimed)
		task, owner, ok := w.takeRunning(rnd)
		if !ok {
			return
		}
		_, err := w.s.Heartbeat(ctx, owner, []claims.Ref{claims.RefOf(task)})
		w.check("heartbeat", err)
		w.mu.Lock()
		w.running[task.ID] = task
		w.mu.Unlock()
	case 12: // a new owner takes a shard over, or requeues what its raise skipped
		if rnd.IntN(3) == 0 {
			w.requeuePending()
			return
		}
		w.raise(rnd.IntN(stressShards))
	case 13: // an operator cancels a task
		if id, ok := w.anyID(rnd); ok {
			_, err := w.s.CancelTask(ctx, id)
			w.check("cancel", err)
		}
	case 14: // an operator retries a task
		if id, ok := w.anyID(rnd); ok {
			_, err := w.s.RetryTask(ctx, id)
			w.check("retry", err)
		}
	case 15: // bulk operations
		seq := stressSeqs[rnd.IntN(len(stressSeqs))]
		if rnd.IntN(2) == 0 {
			_, err := w.s.CancelMatching(ctx, tasks.Filter{SequenceKey: seq, States: []tasks.State{tasks.Ready}}, 0, time.Second)
			w.check("bulk cancel", err)
		} else {
			_, err := w.s.RetryMatching(ctx, tasks.Filter{Queue: stressQueues[rnd.IntN(len(stressQueues))]}, 0, time.Second)
			w.check("bulk retry", err)
		}
	case 16: // pause or resume a queue, or remove one
		if rnd.IntN(2) == 0 {
			_, err := w.s.SetQueuePaused(ctx, "mail", rnd.IntN(2) == 0)
			w.check("pause", err)
			return
		}
		queue := stressQueues[1+rnd.IntN(len(stressQueues)-1)]
		if queue == "rare" && rnd.IntN(2) == 0 { // no runner claims it: cancel what it holds, then remove it
			_, err := w.s.CancelMatching(ctx, tasks.Filter{Queue: "rare", States: []tasks.State{tasks.Ready}}, 0, time.Second)
			w.check("bulk cancel", err)
		}
		_, err := w.s.DeleteQueue(ctx, queue)
		if e := (*store.QueueInUseError)(nil); errors.As(err, &e) || errors.Is(err, store.ErrNoSuchQueue) {
			w.count("remove a queue (refused)")
			return
		}
		w.check("remove a queue", err)
	case 17: // the leader's sweeps
		_, err := w.s.SweepDeadlines(ctx, leaderEpoch, 0, 50)
		w.check("deadline sweep", err)
		_, _, err = w.s.SweepStale(ctx, leaderEpoch, 200*time.Millisecond, 50, store.Backoff{Base: time.Millisecond, Cap: 10 * time.Millisecond})
		w.check("stale sweep", err)
	case 18: // the unhandled-kind rule
		_, err := w.s.FailUnrunnable(ctx, leaderEpoch, tasks.Class{Queue: "mail", Kind: "other"}, 100*time.Millisecond, 20, "no runner runs it")
		w.check("unhandled rule", err)
	case 19: // retention
		state := []string{"completed", "dead", "failed", "cancelled"}[rnd.IntN(4)]
		_, err := w.s.DeleteFinished(ctx, leaderEpoch, state, 0, 50)
		w.check("retention", err)
	}
}
