package store

import (
	"context"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/tasks"
)

// Enqueue notifications.
//
// The tasks table's insert trigger notifies the runners of every insert, in
// the inserting transaction: that is what makes raw SQL and a producer's own
// transaction (EnqueueIn) wake the runners at its commit. But PostgreSQL
// serialises the commits of transactions that notified (the notify queue
// is locked from before the commit record is flushed until after), so
// concurrent single-row producers cannot share a WAL flush: measured by the
// bench's notify section. The store's own inserts outside a producer's
// transaction are therefore quiet (quietInsert: the trigger skips them) and
// notified after their commit by a notifier, which sends one pg_notify for
// all the shards that got tasks while its previous one was on the wire.
//
// That notification comes a round trip (and up to notifyGap) after the
// commit: the wake-up path's longest hop at low rates (bench section
// wakeup). So one of the store's own inserts at a time is not quiet: the
// one that takes the commit slot (notifier.takeSlot) notifies in its own
// transaction, delivered at its commit as a producer's transaction is.
// One at a time, its commit holds PostgreSQL's notify lock alone, so no
// other producer's commit waits behind it; the inserts that commit
// meanwhile go by the notifier. An idle store's every insert notifies at
// its commit.

// quietSetting is the transaction-local setting the insert trigger checks
// (migration 00006): 'off' skips the trigger's NOTIFY.
const quietSetting = `set_config('shardrun.notify', 'off', true)`

// notifyTimeout bounds one notification: runners poll anyway, so a lost
// notification costs at most a poll interval. It also bounds how long
// closing the store waits for the pending ones.
const notifyTimeout = 5 * time.Second

// notifyGap is the least time between two notifications of one store: the
// shards that get tasks meanwhile go in the next one. Measured by the
// bench's notify section: sending one as soon as the last was answered
// (one per insert at a few producers, each a transaction) cost 2 to 4
// single-row producers 16-25% of their inserts; 2 ms and 50 ms apart
// measured alike, so the shorter gap is kept: it is at most what it adds to
// the wake-up of a task's runner.
const notifyGap = 2 * time.Millisecond

// notifier sends the notifications of committed quiet inserts. It coalesces:
// at most one pg_notify per store is in flight, at most one per gap, and
// the shards that arrive meanwhile go in the next one. Its goroutine runs
// only while there is something to send, so an idle store has none; close
// lets it send what is pending, for at most closeTimeout.
type notifier struct {
	exec         func(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	log          hclog.Logger
	gap          time.Duration
	closeTimeout time.Duration
	// stop ends the notification on the wire when close has waited
	// closeTimeout; nothing is sent after it.
	stop       context.Context
	cancelStop context.CancelFunc

	// slot is held by the one insert that notifies in its own transaction.
	slot atomic.Bool
	// sent counts the notifications sent (for tests).
	sent atomic.Int64

	mu sync.Mutex
	// pending maps the shards to notify to whether one of them got a task
	// more urgent than the default priority.
	pending map[int]bool
	sending bool
	closed  bool
	wg      sync.WaitGroup
}

func newNotifier(exec func(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error), log hclog.Logger) *notifier {
	stop, cancel := context.WithCancel(context.Background())
	return &notifier{exec: exec, log: log, gap: notifyGap, closeTimeout: notifyTimeout,
		stop: stop, cancelStop: cancel, pending: map[int]bool{}}
}

// takeSlot reports whether the caller may notify in its own transaction
// (no other insert of the store does now); it then calls releaseSlot when
// its statement has returned.
func (n *notifier) takeSlot() bool { return n.slot.CompareAndSwap(false, true) }

func (n *notifier) releaseSlot() { n.slot.Store(false) }

// add schedules a notification for shards, which got ready tasks in a
// transaction that has committed (urgent: tasks more urgent than the
// default priority, which the notification marks so that runners claim
// there first). It never blocks on the database.
func (n *notifier) add(urgent bool, shards ...int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return
	}
	for _, s := range shards {
		n.pending[s] = n.pending[s] || urgent
	}
	if n.sending || len(n.pending) == 0 {
		return
	}
	n.sending = true
	n.wg.Go(n.send)
}

// send notifies until nothing is pending (also once closed: close waits
// for it) or close stopped it.
func (n *notifier) send() {
	for {
		n.mu.Lock()
		if len(n.pending) == 0 || n.stop.Err() != nil {
			n.sending = false
			n.mu.Unlock()
			return
		}
		closed := n.closed
		shards := maps.Clone(n.pending)
		clear(n.pending)
		n.mu.Unlock()
		ctx, cancel := context.WithTimeout(n.stop, notifyTimeout)
		// Committed asynchronously: the notification's transaction has
		// nothing worth a WAL flush (a crash loses nothing a poll would not
		// find), and without the flush it holds PostgreSQL's notify lock
		// only briefly, so the producers' commits are not held up.
		ids, urgent := notifyArgs(shards)
		_, err := n.exec(ctx, `SELECT set_config('synchronous_commit', 'off', true), shardrun_notify($1, $2)`, ids, urgent)
		cancel()
		n.sent.Add(1)
		if err != nil {
			n.log.Warn("notifying runners of new tasks failed; they find them when they next poll", "shards", len(shards), "error", err)
		}
		if !closed {
			time.Sleep(n.gap)
		}
	}
}

// close refuses further shards, lets the sender send what is pending, and
// waits for it: at most closeTimeout, after which the notification on the
// wire is abandoned (the runners find its tasks when they next poll).
func (n *notifier) close() {
	n.mu.Lock()
	n.closed = true
	n.mu.Unlock()
	done := make(chan struct{})
	go func() { n.wg.Wait(); close(done) }()
	t := time.NewTimer(n.closeTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		n.log.Warn("notifying runners of new tasks at close took too long; they find them when they next poll", "timeout", n.closeTimeout)
		n.cancelStop()
		<-done
	}
	n.cancelStop()
}

// notifyArgs are the arguments of shardrun_notify (the one encoder of the
// notification) for shards: their numbers, sorted, and whether each got
// an urgent task.
func notifyArgs(shards map[int]bool) ([]int32, []bool) {
	ids := make([]int32, 0, len(shards))
	urgent := make([]bool, 0, len(shards))
	for _, s := range slices.Sorted(maps.Keys(shards)) {
		ids, urgent = append(ids, int32(s)), append(urgent, shards[s])
	}
	return ids, urgent
}

// notifyReady notifies the shards of committed quiet inserts whose tasks
// are ready now; a task due later is found by polling.
func (s *Store) notifyReady(ins []Insert, inserted func(i int) bool) {
	now := time.Now()
	var shards, urgent []int
	for i, in := range ins {
		if !inserted(i) || in.RunAfter.After(now) {
			continue
		}
		if tasks.Urgent(in.Priority) {
			urgent = append(urgent, in.Shard)
		} else {
			shards = append(shards, in.Shard)
		}
	}
	if len(shards) > 0 {
		s.notify.add(false, shards...)
	}
	if len(urgent) > 0 {
		s.notify.add(true, urgent...)
	}
}
