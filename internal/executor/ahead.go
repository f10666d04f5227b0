package executor

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/tasks"
)

// aheadCover is how long the tasks kept claimed ahead should last the
// workers: a worker whose handler is expected to return within it may
// have a task waiting for its slot. Four times the longest claim measured
// under load (10 ms, while completions were being written; bench section
// work), as half the buffer is what is left when a claim starts.
const aheadCover = 40 * time.Millisecond

// aheadPatience is how long a task may wait ahead before the estimate that
// put it there is taken for wrong: it goes back to its lane, where an idle
// runner (of another group sharing the lane, say) can take it, and its
// queue claims nothing ahead until one of its handlers returns and
// measures the queue again. Ten times the cover: a task claimed for a
// worker expected to free up within aheadCover waits less than that.
const aheadPatience = 10 * aheadCover

// ahead is the claim-ahead buffer: tasks claimed before a worker is free
// for them, so that when a handler returns the next task starts on its
// slot at once, instead of after a claim round trip (a claim statement and
// a wake-up: 3 to 5 ms, a fifth of a 20 ms task).
//
// Work taken ahead of need is still work of its term:
//
//   - It starts only under a valid hold. Ownership.Workable is asked at the
//     moment a task would start; a task whose term is not workable then
//     (it is moving, it ended, the runner detached or its lease clock is
//     past the detach point) goes back instead.
//   - It goes back when its term stops taking work, not when a worker
//     frees up: every claim round (the claimer wakes on
//     Ownership.Changes) gives back the tasks of terms no longer workable,
//     so a moving shard's release is not held up by them, and the end of
//     a term's context gives back its tasks at once.
//   - It goes back through the writer, retried like outcomes (while the
//     database is unavailable, and while the claim is Busy), and its hold
//     on its term (done) ends only once the give-back is written.
//   - Its attempt is not spent unless its handler ran. Claims record only
//     the tasks that start at once as started (Claim's startNow); a task
//     that waited ahead is recorded as started by the heartbeater's next
//     beat (Store.Started, one statement beside the beat), or ends with
//     its outcome before that. Until then an orphan requeue or a stale
//     sweep gives it back with its attempt unspent, so a crash between the
//     start and the beat leaves one attempt uncounted although its handler
//     ran: the window is one heartbeat interval, and it errs on the side
//     of running a task once more, never of burying it unrun.
//
// How much waits ahead is bounded by the worker time that frees up soon,
// not by the queues served: at most one task per running handler expected
// to return within aheadCover (budget, pool.soon), in all queues together,
// and for each queue no more than the slots of its own that will be free
// then. One worker serving ten queues holds at most one task ahead.
// Measured on 20 ms tasks with 64 workers (bench section work, one
// runner): every handler is expected to return within the cover, so the
// buffer holds a task per worker, topped up when it is down to half, as
// the time-sized buffer did (0.94 to 0.95 of ideal, about 33 tasks per
// claim statement); before that, a buffer of a quarter of the workers,
// topped up at every freed slot, ran dry whenever a claim took longer than
// its 5 ms of tasks (0.82 to 0.93). Long tasks are not held back from
// other runners: a handler of a 10 s queue is expected to return within
// the cover only in its last 40 ms.
type ahead struct {
	pool *pool
	// workable is Ownership.Workable: whether new work may start on a
	// term now.
	workable func(shard int, epoch int64) bool
	// post hands results to the writer (writer.post); it never blocks.
	post  func(...result)
	clock clock.Clock
	log   hclog.Logger

	mu      sync.Mutex
	list    []*waiting // in the order they came
	byQueue map[string]int
	// wrong marks the queues one of whose tasks outstayed aheadPatience:
	// none of their tasks is claimed ahead until one of their handlers
	// returns.
	wrong map[string]bool
	// closed: the runner stops; nothing more starts from the buffer.
	closed bool
}

// waiting is a task claimed ahead of need, waiting for a free slot.
type waiting struct {
	task    tasks.Task
	termCtx context.Context
	done    func() // ends its hold on the term
	parent  trace.SpanContext
	// stop stops the watch on termCtx.
	stop func() bool
	// since is when it started to wait.
	since time.Time
	// recorded: its claim recorded it as started already (it was claimed
	// to start at once, but an earlier attempt of the same task still ran
	// here), so its start needs no Started write.
	recorded bool
}

func newAhead(p *pool, workable func(int, int64) bool, post func(...result), clk clock.Clock, log hclog.Logger) *ahead {
	return &ahead{pool: p, workable: workable, post: post, clock: clk, log: log,
		byQueue: map[string]int{}, wrong: map[string]bool{}}
}

// room is how many tasks of queue a claim may take now: now to start at
// once on its free slots, and more to wait ahead. b is the round's
// measure of the workers that free up soon.
//
// While tasks wait ahead and no slot of the queue is free, the buffer is
// topped up only once it has fallen to half of what the workers free up
// soon, so that each claim statement (planned at each execution) takes
// many tasks.
func (a *ahead) room(queue string, b budget) (now, more int) {
	now, below := a.pool.free(queue)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || a.wrong[queue] {
		return now, 0
	}
	waiting := len(a.list)
	left := b.total - waiting
	if left <= 0 {
		return now, 0
	}
	if waiting > 0 && now == 0 && left < (b.total+1)/2 {
		return 0, 0
	}
	// The queue's tasks can start only on its own slots: those its
	// handlers free up soon, and those under its limit that only wait for
	// any worker to free up (below-now).
	mine := b.soon[queue] + below - now - a.byQueue[queue]
	return now, max(0, min(left, mine))
}

// add keeps ws until slots of their queues are free, and starts those
// that can start now.
func (a *ahead) add(ws ...*waiting) {
	if len(ws) == 0 {
		return
	}
	now := a.clock.Now()
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		a.giveBack(ws)
		return
	}
	for _, w := range ws {
		w.since = now
		a.list = append(a.list, w)
		a.byQueue[w.task.Queue]++
		// The shard is lost or the runner detaches: the task goes back at
		// once. Set under the lock, because startNext may take w as soon
		// as it is released; AfterFunc runs on a goroutine of its own, so
		// it cannot deadlock on a.mu.
		w.stop = context.AfterFunc(w.termCtx, a.dropEnded)
	}
	a.mu.Unlock()
	a.startNext()
}

// removeLocked takes the i-th task out of the list (a.mu held).
func (a *ahead) removeLocked(i int) *waiting {
	w := a.list[i]
	a.list = slices.Delete(a.list, i, i+1)
	a.byQueue[w.task.Queue]--
	return w
}

// startNext starts the oldest waiting tasks whose queues have a free slot
// and whose earlier attempts' handlers (if any ran here) have returned, as
// many as there are such slots. A task whose term is not workable at that
// moment goes back instead: nothing starts after the lease clock's detach
// point, nor on a term that is moving.
func (a *ahead) startNext() {
	for {
		a.mu.Lock()
		if a.closed {
			a.mu.Unlock()
			return
		}
		var next *waiting
		var back []*waiting
		for i := 0; i < len(a.list); {
			w := a.list[i]
			ok, full := a.pool.take(w.task.Queue, w.task.ID)
			if full {
				break
			}
			if !ok {
				i++
				continue
			}
			if !a.workable(w.task.Shard, w.task.Epoch) {
				a.pool.untake(w.task.Queue, w.task.ID)
				back = append(back, a.removeLocked(i))
				continue
			}
			next = a.removeLocked(i)
			break
		}
		a.mu.Unlock()
		a.giveBack(back)
		if next == nil {
			return
		}
		if !next.stop() {
			// Its term ended meanwhile, and its watch found it taken
			// already: it goes back here, and its slot to the next one.
			a.pool.untake(next.task.Queue, next.task.ID)
			a.giveBack([]*waiting{next})
			continue
		}
		next.stop = nil
		a.pool.startAttempt(next.termCtx, next.task, next.done, next.parent, !next.recorded)
	}
}

// returned is told that a handler of queue returned: its queue is measured
// anew, and its slot may start a waiting task.
func (a *ahead) returned(queue string) {
	a.mu.Lock()
	delete(a.wrong, queue)
	a.mu.Unlock()
	a.startNext()
}

// sweep gives back, in one write, the waiting tasks whose terms are no
// longer workable, and those that waited longer than aheadPatience (their
// queues then claim nothing ahead until one of their handlers returns).
// Every claim round calls it first: the claimer wakes when the terms
// change, so a task of a moving shard goes back within one round.
func (a *ahead) sweep(now time.Time) {
	a.mu.Lock()
	var back []*waiting
	stale := 0
	a.list = slices.DeleteFunc(a.list, func(w *waiting) bool {
		late := now.Sub(w.since) >= aheadPatience
		if late {
			a.wrong[w.task.Queue] = true
			stale++
		}
		if !late && a.workable(w.task.Shard, w.task.Epoch) {
			return false
		}
		a.byQueue[w.task.Queue]--
		back = append(back, w)
		return true
	})
	a.mu.Unlock()
	if stale > 0 {
		a.log.Debug("tasks waited ahead longer than expected; giving them back", "tasks", stale, "patience", aheadPatience)
	}
	a.giveBack(back)
}

// dropEnded gives back every waiting task whose term has ended, in one
// write: a detach ends every term at once. The first of their watches to
// fire takes them all; the others find theirs gone.
func (a *ahead) dropEnded() {
	a.mu.Lock()
	var back []*waiting
	a.list = slices.DeleteFunc(a.list, func(w *waiting) bool {
		if w.termCtx.Err() == nil {
			return false
		}
		a.byQueue[w.task.Queue]--
		back = append(back, w)
		return true
	})
	a.mu.Unlock()
	a.giveBack(back)
}

// giveBack hands the claims of ws, taken out of the list, to the writer,
// which gives them back with their attempts unspent and then ends their
// holds on their terms.
func (a *ahead) giveBack(ws []*waiting) {
	if len(ws) == 0 {
		return
	}
	rs := make([]result, len(ws))
	for i, w := range ws {
		if w.stop != nil {
			w.stop()
		}
		rs[i] = result{task: w.task, giveBack: true, done: w.done}
	}
	a.post(rs...)
	a.pool.freed.Notify()
}

// beatable are the waiting tasks to heartbeat, by ref (see
// pool.beatable): those that have waited since cutoff (a heartbeat
// interval ago) or longer. A younger one's claim was written within the
// interval, as a beat would write it.
func (a *ahead) beatable(cutoff time.Time) map[claims.Ref]*waiting {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[claims.Ref]*waiting, len(a.list))
	for _, w := range a.list {
		if !w.since.After(cutoff) {
			out[claims.RefOf(w.task)] = w
		}
	}
	return out
}

// cancelExact ends the waiting task ref, if it is still want: cancelled by
// an operator (tasks.ErrCancelled) it is recorded cancelled; taken back,
// it is dropped (its claim is gone). It reports whether it found it.
func (a *ahead) cancelExact(ref claims.Ref, want *waiting, cause error) bool {
	a.mu.Lock()
	i := slices.IndexFunc(a.list, func(w *waiting) bool {
		return claims.RefOf(w.task) == ref && (want == nil || w == want)
	})
	if i < 0 {
		a.mu.Unlock()
		return false
	}
	w := a.removeLocked(i)
	a.mu.Unlock()
	w.stop()
	if errors.Is(cause, tasks.ErrCancelled) {
		a.post(result{task: w.task, err: tasks.ErrCancelled, cancelled: true, done: w.done})
	} else {
		w.done()
	}
	a.pool.freed.Notify()
	return true
}

// close starts nothing more and gives back every waiting task: the runner
// stops.
func (a *ahead) close() {
	a.mu.Lock()
	a.closed = true
	ws := a.list
	a.list = nil
	clear(a.byQueue)
	a.mu.Unlock()
	a.giveBack(ws)
}

// refs names the waiting tasks' attempts: they are heartbeated like
// running ones.
func (a *ahead) refs() []claims.Ref {
	a.mu.Lock()
	defer a.mu.Unlock()
	refs := make([]claims.Ref, len(a.list))
	for i, w := range a.list {
		refs[i] = claims.RefOf(w.task)
	}
	return refs
}

// size is how many tasks wait.
func (a *ahead) size() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.list)
}

// nextStale is when the first waiting task outstays aheadPatience (zero:
// none waits), so that the claim round that gives it back comes then. The
// list is in the order the tasks came, so the first waited longest.
func (a *ahead) nextStale() time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.list) == 0 {
		return time.Time{}
	}
	return a.list[0].since.Add(aheadPatience)
}
