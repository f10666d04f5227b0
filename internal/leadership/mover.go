package leadership

// The move driver (issue 40, docs/architecture.md "Several databases",
// model/moves.pml): while this process leads, it drives every move the
// cluster's map lists, one idempotent step at a time:
//
//	1. intent  (etcd, RequestMove: the API's)  the move in the map, leaving
//	2. leave   (A)  store.LeaveShard
//	3. copy    (A, B)  store.CopyShard ...
//	4. commit  (A)  ... whose commit at A is the move's commit point
//	5. switch  (etcd)  the shard in B, the move switched
//	6. arrive  (B)  store.ArriveShard
//	7. done    (etcd)  the move leaves the map
//
// Every database step holds the database's coordinator fence at the
// term's epoch, and every etcd step compares the term's election key
// (and the map's revision), so a deposed leader's driver changes
// nothing. What to do next is read, each pass, from A's placement row,
// never from memory or the move's phase alone: A's shard gone means the
// move committed (finish 5 to 7); anything else means it did not (B's
// arriving copy is deleted, then the move resumes at the leave). A move
// that cannot be made (A does not hold the shard, B holds it) is rolled
// back: A's shard held again, B's copy deleted, the move dropped from the
// map. A new leader does the same from its first pass, once its fence is
// raised at both databases (model/moves.pml's recovery).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Move phases, as the map records them (store.Move.Phase).
const (
	// PhaseLeaving: the intent; the move has not committed, or its
	// commit is not recorded in the map yet.
	PhaseLeaving = "leaving"
	// PhaseSwitched: the move committed and the map says the shard is at
	// its destination; the arrival and the end remain.
	PhaseSwitched = "switched"
)

// movePoll is how often the driver reads the map for moves, and retries
// a step that could not be taken (a producer held the placement row, a
// database did not answer).
const movePoll = 500 * time.Millisecond

// moveBackoffMax bounds the wait after failed passes.
const moveBackoffMax = 10 * time.Second

// moveStepTimeout bounds one database step (the copy waits for the
// runners' writes and the handlers' transactions that hold its rows).
const moveStepTimeout = 2 * time.Minute

// mover drives the cluster's moves during one leadership term.
type mover struct {
	l *Leader
	// epoch is the term's: the coordinator fence's, and the leader key's
	// create revision.
	epoch     int64
	leaderKey string
}

// Run drives the moves until ctx (the term) ends: a pass every movePoll,
// and after a failed step (a database or etcd away) again with a backoff
// up to moveBackoffMax.
func (mv *mover) Run(ctx context.Context) {
	log := mv.l.cfg.Logger
	backoff := clock.Backoff{Min: movePoll, Max: moveBackoffMax}
	for {
		wait := movePoll
		if err := mv.pass(ctx); err != nil && ctx.Err() == nil {
			wait = backoff.Next()
			log.Warn("a move's step failed; retrying", "error", err, "backoff", wait)
		} else {
			backoff.Reset()
		}
		if !clock.Sleep(mv.l.cfg.Clock, wait, ctx.Done()) {
			return
		}
	}
}

// pass reads the map and drives each of its moves as far as it goes now.
func (mv *mover) pass(ctx context.Context) error {
	m, err := shard.ReadDatabases(ctx, mv.l.etcd, mv.l.cfg.Prefix, mv.l.cfg.ShardCount)
	if err != nil {
		return err
	}
	var errs []error
	for _, move := range m.Moves {
		if err := mv.drive(ctx, move); err != nil {
			errs = append(errs, fmt.Errorf("moving shard %d from database %s to %s: %w", move.Shard, move.From, move.To, err))
		}
	}
	return errors.Join(errs...)
}

// raised reports whether the term's fence is raised at database name.
func (mv *mover) raised(name string) bool {
	for _, db := range mv.l.databases {
		if db.name == name {
			return db.raised.Load() == mv.epoch
		}
	}
	return false
}

// drive takes the move's steps from where its databases say it is.
func (mv *mover) drive(ctx context.Context, move store.Move) error {
	log := mv.l.cfg.Logger.With("shard", move.Shard, "from", move.From, "to", move.To)
	a, b := mv.l.router.Store(move.From), mv.l.router.Store(move.To)
	if a == nil || b == nil || move.From == move.To {
		log.Warn("dropping a move between databases the cluster does not have")
		return mv.endMove(ctx, move, false)
	}
	if !mv.raised(move.From) || !mv.raised(move.To) {
		return nil // the fence is raised at both first (recovery reads after it)
	}
	rev, err := mv.mapRev(ctx)
	if err != nil {
		return err
	}
	sm := store.ShardMove{Shard: move.Shard, From: move.From, To: move.To, MapRev: rev, Epoch: mv.epoch}
	src, err := step(ctx, func(ctx context.Context) (store.ShardPlacement, error) {
		p, _, err := a.PlacementOf(ctx, move.Shard)
		return p, err
	})
	if err != nil {
		return err
	}
	if src.State == store.PlacementGone && src.Peer != move.To {
		// Never finish a move toward where the shard did not go.
		return fmt.Errorf("database %s gave the shard to %s, not %s: the map and the databases disagree; the move waits for an operator",
			move.From, src.Peer, move.To)
	}
	if src.State != store.PlacementGone {
		// Not committed: B's copy of an earlier attempt goes, then the
		// leave (again: it is idempotent) and the copy.
		err := do(ctx, func(ctx context.Context) error { return b.DropArriving(ctx, sm) })
		if err == nil {
			err = do(ctx, func(ctx context.Context) error { return a.LeaveShard(ctx, sm) })
		}
		if err == nil {
			var c store.Copied
			c, err = step(ctx, func(ctx context.Context) (store.Copied, error) { return store.CopyShard(ctx, a, b, sm) })
			if err == nil {
				log.Info("a move committed", "tasks", c.Tasks)
			}
		}
		switch {
		case errors.Is(err, store.ErrPlacementBusy):
			log.Debug("a producer holds the shard's placement row; the move's step waits for the next pass")
			return nil
		case errors.Is(err, store.ErrMoveRefused):
			log.Warn("the move cannot be made; rolling it back", "error", err)
			return mv.rollback(ctx, move, sm)
		case errors.Is(err, store.ErrShardGone):
			// committed meanwhile (an earlier attempt's commit answered late)
		case err != nil:
			return err
		}
	}
	return mv.finish(ctx, move, sm)
}

// finish takes a committed move's steps 5 to 7.
func (mv *mover) finish(ctx context.Context, move store.Move, sm store.ShardMove) error {
	rev, err := mv.update(ctx, func(m *store.Map) bool {
		i := moveIndex(m.Moves, move)
		if i < 0 {
			return false
		}
		m.Shards[move.Shard] = move.To
		m.Moves[i].Phase = PhaseSwitched
		return true
	})
	if err != nil {
		return fmt.Errorf("switching the map: %w", err)
	}
	if rev != 0 {
		sm.MapRev = rev
	}
	b := mv.l.router.Store(move.To)
	if err := do(ctx, func(ctx context.Context) error { return b.ArriveShard(ctx, sm) }); err != nil {
		return err
	}
	if err := mv.endMove(ctx, move, true); err != nil {
		return err
	}
	mv.l.cfg.Logger.Info("moved a shard", "shard", move.Shard, "from", move.From, "to", move.To)
	return nil
}

// rollback undoes a move that did not commit: A holds the shard again,
// B's copy goes, the move leaves the map.
func (mv *mover) rollback(ctx context.Context, move store.Move, sm store.ShardMove) error {
	a, b := mv.l.router.Store(move.From), mv.l.router.Store(move.To)
	err := do(ctx, func(ctx context.Context) error { return a.RollbackShard(ctx, sm) })
	switch {
	case errors.Is(err, store.ErrShardGone):
		return mv.finish(ctx, move, sm)
	case errors.Is(err, store.ErrMoveRefused):
		// A does not hold it (a move asked of the wrong database): B's
		// copy, if any, goes all the same.
	case err != nil:
		return err
	}
	if err := do(ctx, func(ctx context.Context) error { return b.DropArriving(ctx, sm) }); err != nil && !errors.Is(err, store.ErrMoveRefused) {
		return err
	}
	if err := mv.endMove(ctx, move, false); err != nil {
		return err
	}
	mv.l.cfg.Logger.Warn("rolled a move back", "shard", move.Shard, "from", move.From, "to", move.To)
	return nil
}

// endMove drops the move from the map; moved says the shard is at its
// destination (the map says so, as the switch left it).
func (mv *mover) endMove(ctx context.Context, move store.Move, moved bool) error {
	_, err := mv.update(ctx, func(m *store.Map) bool {
		i := moveIndex(m.Moves, move)
		if i < 0 {
			return false
		}
		m.Moves = slices.Delete(m.Moves, i, i+1)
		if moved {
			m.Shards[move.Shard] = move.To
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("ending the move in the map: %w", err)
	}
	return nil
}

// moveIndex is the index of move (by shard and databases) in moves, -1
// when it is not there.
func moveIndex(moves []store.Move, move store.Move) int {
	return slices.IndexFunc(moves, func(x store.Move) bool {
		return x.Shard == move.Shard && x.From == move.From && x.To == move.To
	})
}

// mapRev reads the map's revision now.
func (mv *mover) mapRev(ctx context.Context) (int64, error) {
	m, err := shard.ReadDatabases(ctx, mv.l.etcd, mv.l.cfg.Prefix, mv.l.cfg.ShardCount)
	return m.Rev, err
}

// errDeposed: an etcd step found the leader key is not this term's.
var errDeposed = errors.New("the leader key is not this term's (deposed)")

// update changes the map with f, conditioned on the revision read and
// the term's leader key; f false: nothing to change (rev 0). A map
// changed meanwhile is read again.
func (mv *mover) update(ctx context.Context, f func(m *store.Map) bool) (rev int64, err error) {
	leader := clientv3.Compare(clientv3.CreateRevision(mv.leaderKey), "=", mv.epoch)
	for range 10 {
		m, err := shard.ReadDatabases(ctx, mv.l.etcd, mv.l.cfg.Prefix, mv.l.cfg.ShardCount)
		if err != nil {
			return 0, err
		}
		m.Shards = slices.Clone(m.Shards)
		m.Moves = slices.Clone(m.Moves)
		if !f(&m) {
			return 0, nil
		}
		rev, ok, err := shard.PutDatabases(ctx, mv.l.etcd, mv.l.cfg.Prefix, m, leader)
		if err != nil {
			return 0, err
		}
		if ok {
			return rev, nil
		}
		resp, err := mv.l.etcd.Get(ctx, mv.leaderKey)
		if err != nil {
			return 0, fmt.Errorf("reading the leader key: %w", err)
		}
		if len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != mv.epoch {
			return 0, errDeposed
		}
	}
	return 0, errors.New("the map kept changing under the move's step")
}

// do runs a database step under the step's timeout.
func do(ctx context.Context, f func(ctx context.Context) error) error {
	sctx, cancel := context.WithTimeout(ctx, moveStepTimeout)
	defer cancel()
	return f(sctx)
}

// step is do for a step with a result.
func step[T any](ctx context.Context, f func(ctx context.Context) (T, error)) (T, error) {
	sctx, cancel := context.WithTimeout(ctx, moveStepTimeout)
	defer cancel()
	return f(sctx)
}

// RequestMove records the intent to move shard to database to in the
// cluster's map under prefix (step 1: the move, phase leaving, conditioned
// on the map's revision), for the leader's driver to make; it returns the
// map with the move. A request that cannot be made (an unknown database,
// a shard outside the cluster, a shard already there or moving) is a
// *tasks.FieldError naming the field (shard or to) and what is wrong.
func RequestMove(ctx context.Context, etcd *clientv3.Client, prefix string, shardCount, shardID int, to string) (store.Map, error) {
	for range 10 {
		m, err := shard.ReadDatabases(ctx, etcd, prefix, shardCount)
		if err != nil {
			return store.Map{}, err
		}
		switch {
		case shardID < 0 || shardID >= len(m.Shards):
			return store.Map{}, &tasks.FieldError{Field: "shard", Problem: fmt.Sprintf("%d is not one of the cluster's %d shards (0-%d)", shardID, len(m.Shards), len(m.Shards)-1)}
		case !slices.Contains(m.Databases, to):
			return store.Map{}, &tasks.FieldError{Field: "to", Problem: fmt.Sprintf("the cluster has no database %q (its databases: %s)", to, strings.Join(m.Databases, ", "))}
		case m.Shards[shardID] == to:
			return store.Map{}, &tasks.FieldError{Field: "to", Problem: fmt.Sprintf("shard %d is in database %s already", shardID, to)}
		}
		for _, mv := range m.Moves {
			if mv.Shard == shardID {
				return store.Map{}, &tasks.FieldError{Field: "shard", Problem: fmt.Sprintf("shard %d is moving already (from %s to %s, %s)", shardID, mv.From, mv.To, mv.Phase)}
			}
		}
		m.Moves = append(slices.Clone(m.Moves), store.Move{Shard: shardID, From: m.Shards[shardID], To: to, Phase: PhaseLeaving})
		rev, ok, err := shard.PutDatabases(ctx, etcd, prefix, m)
		if err != nil {
			return store.Map{}, fmt.Errorf("recording the move of shard %d to database %s: %w", shardID, to, err)
		}
		if ok {
			m.Rev = rev
			return m, nil
		}
	}
	return store.Map{}, fmt.Errorf("recording the move of shard %d to database %s: the map kept changing", shardID, to)
}
