package shard

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/enum"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/internal/wake"
	"github.com/shardrun/shardrun/tasks"
)

// termState is where one ownership term is. A term is this runner's
// ownership of one shard (of its group) from the write of its owner key
// that added the shard (the term's epoch is that write's revision) until a
// write of the key drops the shard or the key stops naming it.
// Every change goes through ledger.move; the legal moves are:
//
//	acquired  --fence raised, orphans requeued (Fenced)-->  fenced
//	acquired  --assigned elsewhere, or draining-->          releasing
//	fenced    --assigned elsewhere, or draining-->          releasing
//	acquired|fenced|releasing --work cancelled-->           cancelled
//	          (detached, fence lost, handoff timeout, orphaned, shutdown,
//	          another process holding the runner id)
//	releasing|cancelled --our write dropping it applied-->  released   (term ends)
//	any       --the key stopped naming it otherwise-->      lost       (term ends)
//	          (lease expired or revoked, deleted by someone else, the
//	          key under another lease)
//
// Invariants:
//   - Claims are made only on fenced terms of the current lease (Hold);
//     claimed work begins only on held terms that are fenced or releasing,
//     never once cancelled. A term adopted while detached starts cancelled.
//   - The shard is dropped from the key only from releasing with no work
//     in flight, or from cancelled once its work returned or the cancel
//     grace passed.
//   - The term's context is cancelled, with a cause wrapping
//     tasks.ErrOwnershipLost, on entering cancelled, released or lost.
type termState int

const (
	acquired termState = iota + 1
	fenced
	releasing
	cancelled
	released
	lost
)

var termStateNames = []string{acquired: "acquired", fenced: "fenced", releasing: "releasing", cancelled: "cancelled", released: "released", lost: "lost"}

func (s termState) String() string { return enum.Name(s, termStateNames, "termState") }

// legalMoves is the table above.
var legalMoves = map[termState][]termState{
	acquired:  {fenced, releasing, cancelled, lost},
	fenced:    {releasing, cancelled, lost},
	releasing: {cancelled, released, lost},
	cancelled: {released, lost},
}

// term is one ownership term.
type term struct {
	shard  int
	epoch  int64
	state  termState
	ctx    context.Context
	cancel context.CancelCauseFunc
	// inflight counts holds and begun work: a releasing term's key is
	// deleted only when it is zero.
	inflight int
	// since is when the term entered its state: the handoff timeout counts
	// from releasing, the cancel grace from cancelled.
	since time.Time
	// gen is the generation of the runner lease the key was created
	// under: a term of an earlier lease is never held, even before the
	// watch shows its key gone with that lease.
	gen int
}

func (t *term) ref() claims.ShardEpoch { return claims.ShardEpoch{Shard: t.shard, Epoch: t.epoch} }

// ended reports whether the term's work can no longer run.
func (t *term) ended() bool { return t.state == cancelled || t.state == released || t.state == lost }

// ledger is the runner's ownership terms, one per shard it holds a key of,
// under one lock. The Run loop adds and ends terms; the executor fences,
// holds and reports lost fences; the detach machine cancels them all.
type ledger struct {
	runner  string
	clock   clock.Clock
	log     hclog.Logger
	metrics *Metrics
	// events, when a test sets it before the manager starts, receives
	// every ownership event as it happens; tests share one among members
	// to check invariants on one timeline. Nil in production.
	events *testsignal.Signal[Event]
	// changes wakes the executor when the claimable terms change; kick
	// wakes the Run loop when a term needs its attention.
	changes wake.Signal
	kick    wake.Signal

	// detached reports whether the runner is detached; a term adopted
	// then starts cancelled. Nil: attached.
	detached func() bool

	mu       sync.Mutex
	terms    map[int]*term
	assigned []int
}

func newLedger(runner string, clk clock.Clock, log hclog.Logger, m *Metrics) *ledger {
	return &ledger{runner: runner, clock: clk, log: log, metrics: m,
		changes: wake.New(), kick: wake.New(), terms: map[int]*term{}}
}

// move changes t's state (l.mu held), with the side effects of entering the
// new state. An illegal move is a bug: it is logged and refused.
func (l *ledger) move(t *term, to termState, now time.Time, why string) bool {
	if !slices.Contains(legalMoves[t.state], to) {
		l.log.Error("illegal ownership term move refused", "shard", t.shard, "epoch", t.epoch, "from", t.state.String(), "to", to.String(), "why", why)
		return false
	}
	from := t.state
	t.state, t.since = to, now
	switch to {
	case cancelled, released, lost:
		t.cancel(fmt.Errorf("%w: shard %d epoch %d %s: %s", tasks.ErrOwnershipLost, t.shard, t.epoch, to, why))
	}
	switch to {
	case released:
		delete(l.terms, t.shard)
		l.metrics.Releases.Inc()
		l.events.Emit(Event{Kind: Released, Runner: l.runner, Shard: t.shard, Epoch: t.epoch, At: now})
	case lost:
		delete(l.terms, t.shard)
		l.events.Emit(Event{Kind: Lost, Runner: l.runner, Shard: t.shard, Epoch: t.epoch, At: now})
	}
	l.log.Trace("ownership term moved", "shard", t.shard, "epoch", t.epoch, "from", from.String(), "to", to.String(), "why", why)
	if from == fenced || to == fenced {
		l.changes.Notify()
	}
	if to == cancelled || to == releasing {
		l.kick.Notify()
	}
	return true
}

// adopt starts a term for a key this runner created at epoch under the
// lease of generation gen; sent is when the creating Txn was sent
// (ownership began no earlier). A term adopted while the runner is
// detached — the Txn was sent attached, its answer came after the detach —
// is cancelled at once, so that its key is released and it never works:
// the detach's cancelAll has already run.
func (l *ledger) adopt(shard int, epoch int64, sent time.Time, gen int) {
	ctx, cancel := context.WithCancelCause(context.Background())
	now := l.clock.Now()
	t := &term{shard: shard, epoch: epoch, state: acquired, ctx: ctx, cancel: cancel, since: now, gen: gen}
	l.mu.Lock()
	l.terms[shard] = t
	l.metrics.Acquisitions.Inc()
	l.events.Emit(Event{Kind: Acquired, Runner: l.runner, Shard: shard, Epoch: epoch, At: now, Sent: sent})
	// Checked under l.mu: the machine marks itself detached before its
	// cancelAll takes l.mu, so either this sees it or cancelAll sees t.
	if l.detached != nil && l.detached() {
		l.move(t, cancelled, now, "acquired while detached")
	}
	l.mu.Unlock()
	l.changes.Notify()
}

// get returns the term of shard at epoch, or nil (l.mu held).
func (l *ledger) get(shard int, epoch int64) *term {
	if t := l.terms[shard]; t != nil && t.epoch == epoch {
		return t
	}
	return nil
}

// unfenced lists the acquired terms, ordered by shard.
func (l *ledger) unfenced() []claims.ShardEpoch { return l.list(acquired) }

// list returns the terms in one of states, ordered by shard.
func (l *ledger) list(states ...termState) []claims.ShardEpoch {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []claims.ShardEpoch
	for _, t := range l.terms {
		if slices.Contains(states, t.state) {
			out = append(out, t.ref())
		}
	}
	slices.SortFunc(out, func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard })
	return out
}

// current returns the shards of the terms of the lease of generation gen
// that have not ended in release or loss, with their epochs: what the
// runner's owner key must name. A term of an earlier lease is never
// written again: its key went with that lease, and another runner may hold
// the shard now.
func (l *ledger) current(gen int) map[int]int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[int]int64, len(l.terms))
	for s, t := range l.terms {
		if t.gen == gen {
			out[s] = t.epoch
		}
	}
	return out
}

// markFenced moves acquired terms to fenced.
func (l *ledger) markFenced(refs []claims.ShardEpoch) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range refs {
		if t := l.get(r.Shard, r.Epoch); t != nil && t.state == acquired {
			l.move(t, fenced, now, "fence raised")
		}
	}
}

// cancelTerm cancels the work of one term, if it has not ended.
func (l *ledger) cancelTerm(shard int, epoch int64, why string) bool {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	t := l.get(shard, epoch)
	return t != nil && !t.ended() && l.move(t, cancelled, now, why)
}

// cancelAll cancels the work of every term that has not ended.
func (l *ledger) cancelAll(now time.Time, why string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, t := range l.terms {
		if !t.ended() && l.move(t, cancelled, now, why) {
			n++
		}
	}
	return n
}

// hold pins the fenced terms of the lease of generation gen for one claim.
func (l *ledger) hold(may func() bool, gen int) *Hold {
	h := &Hold{l: l, may: may, held: map[int]*term{}}
	if !may() {
		return h
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, t := range l.terms {
		if t.state == fenced && t.gen == gen {
			t.inflight++
			h.held[t.shard] = t
		}
	}
	return h
}

// workable reports whether shard's term at epoch is fenced under the
// lease of generation gen: one lookup under the lock, no allocation.
func (l *ledger) workable(shard int, epoch int64, gen int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	t := l.terms[shard]
	return t != nil && t.epoch == epoch && t.gen == gen && t.state == fenced
}

// end ends one unit of work or one hold on t.
func (l *ledger) end(t *term) {
	l.mu.Lock()
	t.inflight--
	idle := t.inflight == 0 && (t.state == releasing || t.state == cancelled)
	l.mu.Unlock()
	if idle {
		l.kick.Notify()
	}
}

// Hold pins the fenced terms while one claim runs (the executor's Hold):
// their keys are not released before Release, and tasks claimed under it
// may begin even if a release of their shard started meanwhile.
type Hold struct {
	l    *ledger
	may  func() bool // whether work may begin now (attached, lease trusted)
	once sync.Once
	held map[int]*term
}

// Terms are the held terms, ordered by shard.
func (h *Hold) Terms() []claims.ShardEpoch {
	out := make([]claims.ShardEpoch, 0, len(h.held))
	for _, t := range h.held {
		out = append(out, t.ref())
	}
	slices.SortFunc(out, func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard })
	return out
}

// Begin starts work on a held term, even if its release started after the
// hold was taken, unless its work was cancelled or the runner may no longer
// work (detached, lease past its detach point).
func (h *Hold) Begin(shard int, epoch int64) (context.Context, func(), bool) {
	if !h.may() {
		return nil, nil, false
	}
	h.l.mu.Lock()
	defer h.l.mu.Unlock()
	t := h.held[shard]
	if t == nil || t.epoch != epoch || t.ended() {
		return nil, nil, false
	}
	t.inflight++
	var once sync.Once
	return t.ctx, func() { once.Do(func() { h.l.end(t) }) }, true
}

// Release ends the hold.
func (h *Hold) Release() {
	h.once.Do(func() {
		for _, t := range h.held {
			h.l.end(t)
		}
	})
}

// loseVanished ends, as lost, the terms for which ours says the owner key
// no longer names them at their epoch (deleted, rewritten without them,
// or under another lease), and returns them.
func (l *ledger) loseVanished(now time.Time, ours func(shard int, epoch int64) bool) []*term {
	l.mu.Lock()
	defer l.mu.Unlock()
	var gone []*term
	for s, t := range l.terms {
		if !ours(s, t.epoch) && l.move(t, lost, now, "the owner key no longer names it") {
			gone = append(gone, t)
		}
	}
	return gone
}

// loseAll ends every term as lost (the lease was revoked) and returns how
// many there were.
func (l *ledger) loseAll(now time.Time, why string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.terms)
	for _, t := range l.terms {
		l.move(t, lost, now, why)
	}
	return n
}

// nextDeadline is the earliest time a releasing term's handoff times out
// or a cancelled term's grace ends, after the zero time when none; a
// deadline already due is left out when skipDue (only a failed etcd call
// holds it, and that has a backoff of its own).
func (l *ledger) nextDeadline(now time.Time, handoff time.Duration, skipDue bool) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	var next time.Time
	for _, t := range l.terms {
		var at time.Time
		switch t.state {
		case releasing:
			at = t.since.Add(handoff)
		case cancelled:
			at = t.since.Add(cancelGrace)
		default:
			continue
		}
		if skipDue && !at.After(now) {
			continue
		}
		if next.IsZero() || at.Before(next) {
			next = at
		}
	}
	return next
}

// empty reports whether no term is left.
func (l *ledger) empty() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.terms) == 0
}

// holds reports whether there is a term on shard s.
func (l *ledger) holds(s int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.terms[s] != nil
}

// setAssigned records the shards the assignment gives this runner.
func (l *ledger) setAssigned(shards []int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.assigned = shards
}

// snapshot returns the assigned shards, the terms that may work (acquired
// or fenced) ordered by shard, and the shards of the others.
func (l *ledger) snapshot() (assigned []int, owned []claims.ShardEpoch, releasing []int) {
	l.mu.Lock()
	assigned = slices.Clone(l.assigned)
	for _, t := range l.terms {
		switch t.state {
		case acquired, fenced:
			owned = append(owned, t.ref())
		default:
			releasing = append(releasing, t.shard)
		}
	}
	l.mu.Unlock()
	slices.Sort(releasing)
	slices.SortFunc(owned, func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard })
	return assigned, owned, releasing
}

// releaseStep moves the terms leaving gives a reason to release (not "")
// to releasing,
// cancels the work of releasing terms whose handoff timed out, and
// returns the terms whose key may be deleted now: releasing with no work
// in flight, or cancelled with none or past the cancel grace.
func (l *ledger) releaseStep(now time.Time, handoff time.Duration, leaving func(shard int) string) []*term {
	l.mu.Lock()
	defer l.mu.Unlock()
	var ready []*term
	var timedOut []int
	inflight := 0
	for s, t := range l.terms {
		if t.state == acquired || t.state == fenced {
			if why := leaving(s); why != "" {
				l.move(t, releasing, now, why)
			}
		}
		if t.state == releasing && t.inflight > 0 && now.Sub(t.since) >= handoff {
			timedOut = append(timedOut, s)
			inflight += t.inflight
			l.log.Debug("handoff timeout: cancelling in-flight work", "shard", s, "inflight", t.inflight)
			l.move(t, cancelled, now, "handoff timeout")
		}
		if (t.state == releasing && t.inflight == 0) ||
			(t.state == cancelled && (t.inflight == 0 || now.Sub(t.since) >= cancelGrace)) {
			ready = append(ready, t)
		}
	}
	if len(timedOut) > 0 {
		l.log.Warn("handoff timeout: cancelling in-flight work", "shards", len(timedOut), "first", firstShards(timedOut), "inflight", inflight)
	}
	return ready
}

// released ends t after the write of the owner key dropping it was
// answered: released when the write applied, lost when the key was no
// longer this term's. A term the ledger no longer has ends nothing.
func (l *ledger) released(t *term, deleted bool, sent time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.terms[t.shard] != t {
		return
	}
	if deleted {
		l.move(t, released, sent, "key deleted")
	} else {
		l.move(t, lost, sent, "the key was no longer this term's")
	}
}
