package executor

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// fakeStore is an in-memory tasks table and fence table with the store's
// rules: claims only from shards whose fence is (owner, epoch), and every
// write conditioned on the claim it names. Writes can be made to fail.
type fakeStore struct {
	mu     sync.Mutex
	tasks  map[int64]*tasks.Task
	fences map[int]fence
	// failures[op] makes the next n calls of op fail with errDown.
	failures map[string]int
	calls    map[string]int
	beats    []claims.Ref
	// completing, when set, runs before a completion, outside the lock,
	// with the statement's context.
	completing func(ctx context.Context) error
	// refuse: a completion batch holding one of these tasks is refused
	// with errRefused.
	refuse map[int64]bool
	// claimAnswersLost: that many claims commit, then fail as if the
	// connection dropped before the answer.
	claimAnswersLost int
	// failed records every failure written.
	failed []claims.Failure
	// ahead marks the claims recorded as waiting ahead of need (Claim's
	// startNow, Started): losing them never spends their attempt.
	ahead map[int64]bool
	// locked counts, per task, the open transactions that hold its claim
	// row (LockClaim, CompleteInTx): every write naming it answers Busy,
	// and raises, requeues and sweeps skip it.
	locked map[int64]int
	// marked are the completions that handlers recorded in their own
	// committed transactions (CompleteTx): whatever ends the claim next
	// completes the task with it.
	marked map[int64]json.RawMessage
}

type fence struct {
	epoch int64
	owner string
}

var errDown = errors.New("database unreachable")

// errRefused is the database refusing a value: retrying cannot help.
var errRefused = errors.New("invalid input syntax for type json (SQLSTATE 22P02)")

// Unavailable is true for errDown only, as the store's classification is
// for an unreachable database.
func (s *fakeStore) Unavailable(err error) bool { return errors.Is(err, errDown) }

func newFakeStore() *fakeStore {
	return &fakeStore{tasks: map[int64]*tasks.Task{}, fences: map[int]fence{}, failures: map[string]int{}, calls: map[string]int{},
		ahead: map[int64]bool{}, locked: map[int64]int{}, marked: map[int64]json.RawMessage{}}
}

func (s *fakeStore) add(id int64, kind string, shard, maxAttempts int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tasks[id] = &tasks.Task{ID: id, Kind: kind, Shard: shard, Queue: tasks.DefaultQueue, State: tasks.Ready, Attempt: 1,
		MaxAttempts: maxAttempts, Payload: []byte("{}")}
}

func (s *fakeStore) get(id int64) tasks.Task {
	s.mu.Lock()
	defer s.mu.Unlock()
	return *s.tasks[id]
}

func (s *fakeStore) setFence(shard int, epoch int64, owner string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fences[shard] = fence{epoch, owner}
}

func (s *fakeStore) failNext(op string, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failures[op] = n
}

func (s *fakeStore) count(op string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[op]
}

// enter records a call of op and says whether it must fail (s.mu held).
func (s *fakeStore) enter(op string) error {
	s.calls[op]++
	if s.failures[op] > 0 {
		s.failures[op]--
		return fmt.Errorf("%s: %w", op, errDown)
	}
	return nil
}

func (s *fakeStore) RaiseFences(_ context.Context, owner, _ string, terms []claims.ShardEpoch) (claims.Orphans, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enter("raise"); err != nil {
		return claims.Orphans{}, err
	}
	var o claims.Orphans
	for _, t := range terms {
		if f := s.fences[t.Shard]; f.epoch <= t.Epoch {
			s.fences[t.Shard] = fence{t.Epoch, owner}
			o.Raised = append(o.Raised, t)
		}
	}
	// Orphans of the raised terms, in the same step.
	s.requeueOrphans(owner, o.Raised, &o)
	return o, nil
}

func (s *fakeStore) RequeueOrphans(_ context.Context, owner, _ string, terms []claims.ShardEpoch) (claims.Orphans, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enter("requeue_orphans"); err != nil {
		return claims.Orphans{}, err
	}
	var o claims.Orphans
	s.requeueOrphans(owner, terms, &o)
	return o, nil
}

// requeueOrphans ends the earlier owners' claims on terms whose fence is
// owner's at their epoch: locked ones are skipped and their terms named
// pending (s.mu held).
func (s *fakeStore) requeueOrphans(owner string, terms []claims.ShardEpoch, o *claims.Orphans) {
	for _, term := range terms {
		if s.fences[term.Shard] != (fence{term.Epoch, owner}) {
			continue
		}
		pending := false
		for _, id := range s.ids() {
			t := s.tasks[id]
			if t.Shard != term.Shard || t.State != tasks.Running || t.Epoch >= term.Epoch {
				continue
			}
			if s.locked[id] > 0 {
				pending = true
				continue
			}
			switch s.endClaim(t, "orphaned") {
			case tasks.Completed:
				o.Completed++
			case tasks.Dead:
				o.Dead++
			default:
				o.Requeued++
			}
		}
		if pending {
			o.Pending = append(o.Pending, term)
		}
	}
}

// endClaim ends a claim nobody will write again (an orphan, a stale
// claim): completed with the handler's own completion when it recorded
// one, back with the same attempt when its handler never started, else
// the attempt is spent (s.mu held). It returns the task's new state.
func (s *fakeStore) endClaim(t *tasks.Task, msg string) tasks.State {
	if res, ok := s.marked[t.ID]; ok {
		t.State, t.Result = tasks.Completed, res
		delete(s.marked, t.ID)
	} else if s.ahead[t.ID] {
		t.State, t.ClaimedBy, t.Epoch = tasks.Ready, "", 0
		if t.CancelRequestedAt != nil {
			t.State = tasks.Cancelled
		}
	} else {
		s.retryOrBury(t, msg)
	}
	delete(s.ahead, t.ID)
	return t.State
}

// hasMark reports whether a handler's transaction recorded the completion
// of task id (s.mu held).
func (s *fakeStore) hasMark(id int64) bool {
	_, ok := s.marked[id]
	return ok
}

// sweepStale is the sweeper's stale rule for one task, as if its claim's
// heartbeat were older than the threshold; a locked claim is skipped.
func (s *fakeStore) sweepStale(id int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tasks[id]
	if t == nil || t.State != tasks.Running || s.locked[id] > 0 {
		return false
	}
	s.endClaim(t, "stale")
	return true
}

// ids are the tasks' ids in order (s.mu held).
func (s *fakeStore) ids() []int64 {
	ids := make([]int64, 0, len(s.tasks))
	for id := range s.tasks {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// lockClaim holds the claim row of task id in a transaction that stays
// open until unlock is called.
func (s *fakeStore) lockClaim(id int64) (unlock func()) {
	s.mu.Lock()
	s.locked[id]++
	s.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			s.locked[id]--
			s.mu.Unlock()
		})
	}
}

// completeInTx records the attempt's completion in a transaction of its
// own (CompleteTx), which holds the claim row until commit is called.
func (s *fakeStore) completeInTx(ref claims.Ref, result json.RawMessage) (commit func(), err error) {
	s.mu.Lock()
	t := s.tasks[ref.ID]
	if t == nil || t.State != tasks.Running || t.Attempt != ref.Attempt || t.Epoch != ref.Epoch || s.locked[ref.ID] > 0 {
		s.mu.Unlock()
		return nil, fmt.Errorf("completing task %d in a transaction: not this running attempt", ref.ID)
	}
	s.locked[ref.ID]++
	s.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			s.locked[ref.ID]--
			s.marked[ref.ID] = result
			s.mu.Unlock()
		})
	}, nil
}

func (s *fakeStore) Claim(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error) {
	return s.claim(ctx, owner, terms, queue, kinds, limit, startNow, tasks.LeastUrgent)
}

func (s *fakeStore) ClaimUrgent(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error) {
	return s.claim(ctx, owner, terms, queue, kinds, limit, startNow, tasks.DefaultPriority-1)
}

func (s *fakeStore) claim(_ context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, startNow, maxPriority int) ([]tasks.Task, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enter("claim"); err != nil {
		return nil, err
	}
	// The shards of terms in the order given, each drained (by id) before
	// the next, as the store's claim visits them.
	ids := s.ids()
	var out []tasks.Task
	for _, term := range terms {
		if s.fences[term.Shard] != (fence{term.Epoch, owner}) {
			continue
		}
		for _, id := range ids {
			t := s.tasks[id]
			if len(out) == limit {
				break
			}
			if t.Shard != term.Shard || t.State != tasks.Ready || t.Queue != queue || !slices.Contains(kinds, t.Kind) ||
				cmp.Or(t.Priority, tasks.DefaultPriority) > maxPriority {
				continue
			}
			t.State, t.ClaimedBy, t.Epoch = tasks.Running, owner, term.Epoch
			s.ahead[id] = len(out) >= startNow
			out = append(out, *t)
		}
	}
	if s.claimAnswersLost > 0 {
		s.claimAnswersLost--
		return nil, fmt.Errorf("claim: the answer was lost: %w", errDown)
	}
	return out, nil
}

func (s *fakeStore) ReadyQueues(_ context.Context, shards []int, queues, kinds []string) (map[string][]int, int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enter("probe"); err != nil {
		return nil, -1, err
	}
	found := map[string][]int{}
	for _, t := range s.tasks {
		if t.State == tasks.Ready && slices.Contains(shards, t.Shard) && slices.Contains(queues, t.Queue) &&
			slices.Contains(kinds, t.Kind) && !slices.Contains(found[t.Queue], t.Shard) {
			found[t.Queue] = append(found[t.Queue], t.Shard)
		}
	}
	for _, shards := range found {
		slices.Sort(shards)
	}
	return found, -1, nil
}

func (s *fakeStore) Claimed(_ context.Context, owner string, terms []claims.ShardEpoch) ([]claims.Ref, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enter("claimed"); err != nil {
		return nil, err
	}
	var out []claims.Ref
	for _, t := range s.tasks {
		if t.State == tasks.Running && t.ClaimedBy == owner && slices.Contains(terms, claims.ShardEpoch{Shard: t.Shard, Epoch: t.Epoch}) {
			out = append(out, claims.RefOf(*t))
		}
	}
	return out, nil
}

// fenced applies write to each ref still running under exactly that claim
// with the fence still the writer's; it reports the outcome per ref. A
// claim held by an open transaction is Busy; one whose handler recorded
// its completion (CompleteTx) is completed by any write that ends the
// claim (ends), and Completed.
func (s *fakeStore) fenced(op, owner string, refs []claims.Ref, write func(t *tasks.Task, i int)) ([]claims.WriteResult, error) {
	return s.fencedWrite(op, owner, refs, op != "heartbeat" && op != "started", write)
}

func (s *fakeStore) fencedWrite(op, owner string, refs []claims.Ref, ends bool, write func(t *tasks.Task, i int)) ([]claims.WriteResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enter(op); err != nil {
		return nil, err
	}
	out := make([]claims.WriteResult, len(refs))
	for i, r := range refs {
		out[i].Ref = r
		t := s.tasks[r.ID]
		switch {
		case s.fences[r.Shard] != (fence{r.Epoch, owner}):
			out[i].Outcome = claims.FenceLost
		case t == nil:
			out[i].Outcome = claims.TaskGone
		case t.State != tasks.Running || t.ClaimedBy != owner || t.Epoch != r.Epoch || t.Attempt != r.Attempt:
			out[i].Outcome = claims.TaskMoved
		case s.locked[r.ID] > 0:
			out[i].Outcome = claims.Busy
			s.calls[op+" busy"]++
		case ends && s.hasMark(r.ID):
			t.State, t.Result = tasks.Completed, s.marked[r.ID]
			delete(s.marked, r.ID)
			delete(s.ahead, r.ID)
			out[i].Outcome, out[i].State = claims.Completed, t.State
		default:
			write(t, i)
			if t.State != tasks.Running {
				delete(s.ahead, r.ID)
			}
			out[i].State, out[i].CancelRequested = t.State, t.CancelRequestedAt != nil
		}
	}
	return out, nil
}

func (s *fakeStore) Unclaim(_ context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	return s.fenced("unclaim", owner, refs, func(t *tasks.Task, _ int) {
		t.State, t.ClaimedBy, t.Epoch = tasks.Ready, "", 0
		if t.CancelRequestedAt != nil {
			t.State = tasks.Cancelled // nothing would run it again
		}
	})
}

func (s *fakeStore) Started(_ context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	return s.fenced("started", owner, refs, func(t *tasks.Task, _ int) { delete(s.ahead, t.ID) })
}

func (s *fakeStore) Heartbeat(_ context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	return s.fenced("heartbeat", owner, refs, func(t *tasks.Task, _ int) { s.beats = append(s.beats, claims.RefOf(*t)) })
}

func (s *fakeStore) Complete(ctx context.Context, owner string, done []claims.Completion) ([]claims.WriteResult, error) {
	if s.completing != nil {
		if err := s.completing(ctx); err != nil {
			return nil, err
		}
	}
	refs := make([]claims.Ref, len(done))
	for i, d := range done {
		refs[i] = d.Ref
		if s.refuse[d.Ref.ID] {
			s.mu.Lock()
			s.calls["complete"]++
			s.mu.Unlock()
			return nil, fmt.Errorf("completing: %w", errRefused)
		}
	}
	return s.fenced("complete", owner, refs, func(t *tasks.Task, i int) { t.State, t.Result = tasks.Completed, done[i].Result })
}

func (s *fakeStore) Fail(_ context.Context, owner string, failed []claims.Failure) ([]claims.WriteResult, error) {
	refs := make([]claims.Ref, len(failed))
	for i, f := range failed {
		refs[i] = f.Ref
	}
	s.mu.Lock()
	s.failed = append(s.failed, failed...)
	s.mu.Unlock()
	return s.fenced("fail", owner, refs, func(t *tasks.Task, i int) {
		if failed[i].Expired && t.CancelRequestedAt == nil {
			t.State = tasks.Failed
			t.Errors = append(t.Errors, tasks.AttemptError{Attempt: t.Attempt, Error: failed[i].Error})
			return
		}
		if failed[i].Final {
			t.MaxAttempts = t.Attempt // buried whatever attempts are left
		}
		s.retryOrBury(t, failed[i].Error)
	})
}

func (s *fakeStore) Interrupt(_ context.Context, owner string, cut []claims.Interruption) ([]claims.WriteResult, error) {
	refs := make([]claims.Ref, len(cut))
	for i, c := range cut {
		refs[i] = c.Ref
	}
	return s.fenced("interrupt", owner, refs, func(t *tasks.Task, i int) {
		t.Errors = append(t.Errors, tasks.AttemptError{Attempt: t.Attempt, Error: cut[i].Reason, Interrupted: true})
		if t.CancelRequestedAt != nil {
			t.State = tasks.Cancelled
			return
		}
		t.State, t.ClaimedBy, t.Epoch = tasks.Ready, "", 0
	})
}

func (s *fakeStore) CancelAttempts(_ context.Context, owner string, cancelled []claims.Cancellation) ([]claims.WriteResult, error) {
	refs := make([]claims.Ref, len(cancelled))
	for i, c := range cancelled {
		refs[i] = c.Ref
	}
	return s.fenced("cancel", owner, refs, func(t *tasks.Task, i int) {
		t.State = tasks.Cancelled
		t.Errors = append(t.Errors, tasks.AttemptError{Attempt: t.Attempt, Error: "cancelled on request; the handler returned: " + cancelled[i].Error})
	})
}

// requestCancel is an operator's cancel of a running task.
func (s *fakeStore) requestCancel(id int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	s.tasks[id].CancelRequestedAt = &now
}

// retryOrBury is the store's failure rule (s.mu held).
func (s *fakeStore) retryOrBury(t *tasks.Task, msg string) {
	t.Errors = append(t.Errors, tasks.AttemptError{Attempt: t.Attempt, Error: msg})
	if t.CancelRequestedAt != nil {
		t.State = tasks.Cancelled
		return
	}
	if t.Attempt < t.MaxAttempts {
		t.State, t.Attempt, t.ClaimedBy, t.Epoch = tasks.Ready, t.Attempt+1, "", 0
		return
	}
	t.State = tasks.Dead
}

// fakeOwnership holds terms the test controls, with the real manager's
// term states (shard/term.go): acquired, fenced, releasing, cancelled;
// released and lost terms leave the map.
//
//   - A move (move) is what a rebalance does: the term goes releasing,
//     Changes is signalled, it leaves Hold and Workable, and its context
//     is NOT cancelled; its begun work runs on, and the term is released
//     (context cancelled, term gone) once no hold or work is left on it.
//   - A loss (lose: a newer owner's fence, the handoff timeout) cancels the
//     term's context at once; the term is gone once its work ended.
//   - A detach cancels every term and holds nothing; a pause (the lease
//     clock past its detach point, the process not yet aware) holds
//     nothing and makes nothing workable, but cancels nothing.
type fakeOwnership struct {
	mu       sync.Mutex
	terms    map[int]*fakeTerm
	lost     []claims.ShardEpoch
	changes  chan struct{}
	detached bool
	paused   bool
	// refuseBegin makes Begin fail, as when a term stops taking work
	// between the claim and the start.
	refuseBegin bool
}

type fakeTermState int

const (
	fakeAcquired fakeTermState = iota
	fakeFenced
	fakeReleasing
	fakeCancelled
)

type fakeTerm struct {
	shard    int
	epoch    int64
	state    fakeTermState
	ctx      context.Context
	cancel   context.CancelCauseFunc
	inflight int
}

func newFakeOwnership() *fakeOwnership {
	return &fakeOwnership{terms: map[int]*fakeTerm{}, changes: make(chan struct{}, 1)}
}

func (o *fakeOwnership) notify() {
	select {
	case o.changes <- struct{}{}:
	default:
	}
}

// own starts a term (acquired: the executor raises its fence).
func (o *fakeOwnership) own(shard int, epoch int64) {
	ctx, cancel := context.WithCancelCause(context.Background())
	o.mu.Lock()
	o.terms[shard] = &fakeTerm{shard: shard, epoch: epoch, ctx: ctx, cancel: cancel}
	if o.detached {
		o.terms[shard].state = fakeCancelled
		cancel(fmt.Errorf("%w: acquired while detached", tasks.ErrOwnershipLost))
	}
	o.mu.Unlock()
	o.notify()
}

// move assigns the shard elsewhere, as a rebalance does: releasing.
func (o *fakeOwnership) move(shard int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	t := o.terms[shard]
	if t == nil || (t.state != fakeAcquired && t.state != fakeFenced) {
		return
	}
	t.state = fakeReleasing
	o.releaseIfIdle(t)
	o.notify()
}

// lose cancels a term's work as the shard manager does when the runner
// loses the shard (a newer owner's fence, the handoff timeout).
func (o *fakeOwnership) lose(shard int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if t := o.terms[shard]; t != nil && t.state != fakeCancelled {
		o.cancelTerm(t, fmt.Sprintf("test took shard %d away", shard))
		o.notify()
	}
}

// detach cancels every term, as the detach machine's subscriber does.
func (o *fakeOwnership) detach() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.detached = true
	for _, t := range o.terms {
		if t.state != fakeCancelled {
			o.cancelTerm(t, "detached")
		}
	}
	o.notify()
}

// pause is the lease clock passing its detach point while the runner has
// not noticed yet: nothing may start, nothing is cancelled, and nobody is
// told.
func (o *fakeOwnership) pause() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.paused = true
}

// cancelTerm moves t to cancelled (o.mu held).
func (o *fakeOwnership) cancelTerm(t *fakeTerm, why string) {
	t.state = fakeCancelled
	t.cancel(fmt.Errorf("%w: shard %d epoch %d: %s", tasks.ErrOwnershipLost, t.shard, t.epoch, why))
	o.releaseIfIdle(t)
}

// releaseIfIdle ends a releasing or cancelled term without work left
// (o.mu held): its key is deleted.
func (o *fakeOwnership) releaseIfIdle(t *fakeTerm) {
	if t.inflight > 0 || (t.state != fakeReleasing && t.state != fakeCancelled) {
		return
	}
	t.cancel(fmt.Errorf("%w: shard %d epoch %d released", tasks.ErrOwnershipLost, t.shard, t.epoch))
	if o.terms[t.shard] == t {
		delete(o.terms, t.shard)
	}
}

// end ends one hold or one unit of work on t.
func (o *fakeOwnership) end(t *fakeTerm) {
	o.mu.Lock()
	defer o.mu.Unlock()
	t.inflight--
	o.releaseIfIdle(t)
}

// inflight is the holds and work on the shard's term; -1 when there is no
// term (never owned, or released).
func (o *fakeOwnership) inflight(shard int) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	if t := o.terms[shard]; t != nil {
		return t.inflight
	}
	return -1
}

// held reports whether the shard has a term, in whatever state.
func (o *fakeOwnership) held(shard int) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.terms[shard] != nil
}

func (o *fakeOwnership) lostTerms() []claims.ShardEpoch {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.lost)
}

func (o *fakeOwnership) Unfenced() []claims.ShardEpoch {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.detached {
		return nil
	}
	var out []claims.ShardEpoch
	for s, t := range o.terms {
		if t.state == fakeAcquired {
			out = append(out, claims.ShardEpoch{Shard: s, Epoch: t.epoch})
		}
	}
	slices.SortFunc(out, func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard })
	return out
}

func (o *fakeOwnership) Fenced(terms []claims.ShardEpoch) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, r := range terms {
		if t := o.terms[r.Shard]; t != nil && t.epoch == r.Epoch && t.state == fakeAcquired {
			t.state = fakeFenced
			o.notify()
		}
	}
}

func (o *fakeOwnership) FenceLost(shard int, epoch int64) {
	o.mu.Lock()
	o.lost = append(o.lost, claims.ShardEpoch{Shard: shard, Epoch: epoch})
	t := o.terms[shard]
	if t != nil && t.epoch == epoch && t.state != fakeCancelled {
		o.cancelTerm(t, "a newer owner's fence refused a write")
		o.notify()
	}
	o.mu.Unlock()
}

func (o *fakeOwnership) Workable(shard int, epoch int64) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	t := o.terms[shard]
	return !o.detached && !o.paused && t != nil && t.epoch == epoch && t.state == fakeFenced
}

func (o *fakeOwnership) Hold() Hold {
	o.mu.Lock()
	defer o.mu.Unlock()
	h := &fakeHold{o: o, held: map[int]*fakeTerm{}}
	if o.detached || o.paused {
		return h
	}
	for s, t := range o.terms {
		if t.state == fakeFenced {
			t.inflight++
			h.held[s] = t
		}
	}
	return h
}

func (o *fakeOwnership) Changes() <-chan struct{} { return o.changes }

func (o *fakeOwnership) Group() string { return "" }

type fakeHold struct {
	o        *fakeOwnership
	held     map[int]*fakeTerm
	released bool
}

func (h *fakeHold) Terms() []claims.ShardEpoch {
	var out []claims.ShardEpoch
	for s, t := range h.held {
		out = append(out, claims.ShardEpoch{Shard: s, Epoch: t.epoch})
	}
	slices.SortFunc(out, func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard })
	return out
}

// Begin admits work on a held term that is fenced or releasing (a release
// that started after the hold was taken waits for it), unless the term
// was cancelled or the runner may not work now.
func (h *fakeHold) Begin(shard int, epoch int64) (context.Context, func(), bool) {
	h.o.mu.Lock()
	defer h.o.mu.Unlock()
	t := h.held[shard]
	if h.o.refuseBegin || h.o.detached || h.o.paused || t == nil || t.epoch != epoch ||
		(t.state != fakeFenced && t.state != fakeReleasing) {
		return nil, nil, false
	}
	t.inflight++
	var once sync.Once
	return t.ctx, func() { once.Do(func() { h.o.end(t) }) }, true
}

func (h *fakeHold) Release() {
	h.o.mu.Lock()
	if h.released {
		h.o.mu.Unlock()
		return
	}
	h.released = true
	held := h.held
	h.o.mu.Unlock()
	for _, t := range held {
		h.o.end(t)
	}
}

// settle polls cond, advancing the fake clock a little each time, until it
// holds or a real-time bound passes.
func settle(advance func(time.Duration), cond func() bool) bool {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if cond() {
			return true
		}
		advance(5 * time.Millisecond)
		time.Sleep(time.Millisecond)
	}
	return cond()
}
