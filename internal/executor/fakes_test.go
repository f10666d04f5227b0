package executor

import (
	"cmp"
	"context"
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
	return &fakeStore{tasks: map[int64]*tasks.Task{}, fences: map[int]fence{}, failures: map[string]int{}, calls: map[string]int{}}
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

func (s *fakeStore) RaiseFences(_ context.Context, owner, _ string, terms []claims.ShardEpoch) ([]claims.ShardEpoch, int64, int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enter("raise"); err != nil {
		return nil, 0, 0, err
	}
	var raised []claims.ShardEpoch
	for _, t := range terms {
		if f := s.fences[t.Shard]; f.epoch <= t.Epoch {
			s.fences[t.Shard] = fence{t.Epoch, owner}
			raised = append(raised, t)
		}
	}
	// Orphans of the raised terms, in the same step.
	var n int64
	for _, t := range s.tasks {
		for _, term := range raised {
			if t.Shard == term.Shard && t.State == tasks.Running && t.Epoch < term.Epoch && s.fences[t.Shard] == (fence{term.Epoch, owner}) {
				s.retryOrBury(t, "orphaned")
				n++
			}
		}
	}
	return raised, n, 0, nil
}

func (s *fakeStore) Claim(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit int) ([]tasks.Task, error) {
	return s.claim(ctx, owner, terms, queue, kinds, limit, tasks.LeastUrgent)
}

func (s *fakeStore) ClaimUrgent(ctx context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit int) ([]tasks.Task, error) {
	return s.claim(ctx, owner, terms, queue, kinds, limit, tasks.DefaultPriority-1)
}

func (s *fakeStore) claim(_ context.Context, owner string, terms []claims.ShardEpoch, queue string, kinds []string, limit, maxPriority int) ([]tasks.Task, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enter("claim"); err != nil {
		return nil, err
	}
	ids := make([]int64, 0, len(s.tasks))
	for id := range s.tasks {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	var out []tasks.Task
	for _, id := range ids {
		t := s.tasks[id]
		if len(out) == limit {
			break
		}
		if t.State != tasks.Ready || t.Queue != queue || !slices.Contains(kinds, t.Kind) || cmp.Or(t.Priority, tasks.DefaultPriority) > maxPriority {
			continue
		}
		for _, term := range terms {
			if term.Shard == t.Shard && s.fences[t.Shard] == (fence{term.Epoch, owner}) {
				t.State, t.ClaimedBy, t.Epoch = tasks.Running, owner, term.Epoch
				out = append(out, *t)
			}
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
// with the fence still the writer's; it reports the outcome per ref.
func (s *fakeStore) fenced(op, owner string, refs []claims.Ref, write func(t *tasks.Task, i int)) ([]claims.WriteResult, error) {
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
		default:
			write(t, i)
			out[i].State, out[i].CancelRequested = t.State, t.CancelRequestedAt != nil
		}
	}
	return out, nil
}

func (s *fakeStore) Unclaim(_ context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	return s.fenced("unclaim", owner, refs, func(t *tasks.Task, _ int) { t.State, t.ClaimedBy, t.Epoch = tasks.Ready, "", 0 })
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

// fakeOwnership holds terms the test controls.
type fakeOwnership struct {
	mu      sync.Mutex
	terms   map[int]*fakeTerm
	lost    []claims.ShardEpoch
	changes chan struct{}
	// refuseBegin makes Begin fail, as when a term stops taking work
	// between the claim and the start.
	refuseBegin bool
}

type fakeTerm struct {
	epoch    int64
	fenced   bool
	ctx      context.Context
	cancel   context.CancelCauseFunc
	inflight int
}

func newFakeOwnership() *fakeOwnership {
	return &fakeOwnership{terms: map[int]*fakeTerm{}, changes: make(chan struct{}, 1)}
}

func (o *fakeOwnership) own(shard int, epoch int64) {
	ctx, cancel := context.WithCancelCause(context.Background())
	o.mu.Lock()
	o.terms[shard] = &fakeTerm{epoch: epoch, ctx: ctx, cancel: cancel}
	o.mu.Unlock()
	select {
	case o.changes <- struct{}{}:
	default:
	}
}

// lose cancels a term's work as the shard manager does when the runner
// loses the shard.
func (o *fakeOwnership) lose(shard int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if t := o.terms[shard]; t != nil {
		t.cancel(fmt.Errorf("%w: test took shard %d away", tasks.ErrOwnershipLost, shard))
		delete(o.terms, shard)
	}
}

func (o *fakeOwnership) inflight(shard int) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	if t := o.terms[shard]; t != nil {
		return t.inflight
	}
	return -1
}

func (o *fakeOwnership) lostTerms() []claims.ShardEpoch {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.lost)
}

func (o *fakeOwnership) Unfenced() []claims.ShardEpoch {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []claims.ShardEpoch
	for s, t := range o.terms {
		if !t.fenced {
			out = append(out, claims.ShardEpoch{Shard: s, Epoch: t.epoch})
		}
	}
	return out
}

func (o *fakeOwnership) Fenced(terms []claims.ShardEpoch) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, r := range terms {
		if t := o.terms[r.Shard]; t != nil && t.epoch == r.Epoch {
			t.fenced = true
		}
	}
}

func (o *fakeOwnership) FenceLost(shard int, epoch int64) {
	o.mu.Lock()
	o.lost = append(o.lost, claims.ShardEpoch{Shard: shard, Epoch: epoch})
	o.mu.Unlock()
	o.lose(shard)
}

func (o *fakeOwnership) Hold() Hold {
	o.mu.Lock()
	defer o.mu.Unlock()
	h := &fakeHold{o: o, held: map[int]*fakeTerm{}}
	for s, t := range o.terms {
		if t.fenced {
			t.inflight++
			h.held[s] = t
		}
	}
	return h
}

func (o *fakeOwnership) Changes() <-chan struct{} { return o.changes }

func (o *fakeOwnership) Group() string { return "" }

type fakeHold struct {
	o    *fakeOwnership
	held map[int]*fakeTerm
}

func (h *fakeHold) Terms() []claims.ShardEpoch {
	var out []claims.ShardEpoch
	for s, t := range h.held {
		out = append(out, claims.ShardEpoch{Shard: s, Epoch: t.epoch})
	}
	slices.SortFunc(out, func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard })
	return out
}

func (h *fakeHold) Begin(shard int, epoch int64) (context.Context, func(), bool) {
	h.o.mu.Lock()
	defer h.o.mu.Unlock()
	t := h.held[shard]
	if h.o.refuseBegin || t == nil || t.epoch != epoch || t.ctx.Err() != nil {
		return nil, nil, false
	}
	t.inflight++
	var once sync.Once
	return t.ctx, func() { once.Do(func() { h.o.mu.Lock(); t.inflight--; h.o.mu.Unlock() }) }, true
}

func (h *fakeHold) Release() {
	h.o.mu.Lock()
	defer h.o.mu.Unlock()
	for _, t := range h.held {
		t.inflight--
	}
	h.held = nil
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
