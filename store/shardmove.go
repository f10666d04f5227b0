package store

// A shard's online move between two databases (issue 40,
// docs/architecture.md "Several databases", model/moves.pml): the steps
// the move driver (internal/leadership) takes in the databases, each
// idempotent, each under the database's coordinator fence at the
// leader's epoch (locked FOR SHARE for the step's transaction), so that a
// deposed leader's driver changes nothing once the next leader raised
// the fence. The etcd steps (intent, switch, done) are the driver's.
//
//	step     database  what
//	-------  --------  ------------------------------------------------
//	leave    A         placement row FOR UPDATE NOWAIT (a producer holds
//	                   it: ErrPlacementBusy, try later); leaving; the
//	                   fence rows moving (no claim takes from them)
//	copy     A, B      A: fences, claims, records, sequences FOR UPDATE
//	                   (the one lock order), everything of the shard
//	                   read; B, one transaction: leftovers deleted, the
//	                   copy inserted (triggers off: the rows as they
//	                   were), arriving, ids and sequence positions
//	                   raised; commit B
//	commit   A         the same transaction: every row of the shard
//	                   deleted; the placement row FOR UPDATE NOWAIT (a
//	                   few tries: a producer's refused insert holds it a
//	                   moment), gone (peer B); commit A: the commit point
//	arrive   B         held, fences not moving, claims heartbeat_at now
//	rollback A, B      A: held, fences not moving; B: the arriving copy
//	                   deleted (DropArriving)
//
// Which of them a driver takes after a crash is read from A's placement
// row (PlacementOf): gone means the copy committed (finish: switch,
// arrive, done); anything else means it did not (drop B's copy, then
// leave again or roll back). The move's phase in etcd alone cannot say
// which (model/moves.pml, RECOVER_BY_PHASE).

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ShardMove names one move's step: the shard, its source and
// destination databases by name, the map revision the step records in
// the placement rows, and the leader's epoch (the coordinator fence every
// step holds).
type ShardMove struct {
	Shard    int
	From, To string
	MapRev   int64
	Epoch    int64

	// abandon, set by the tests (export_test.go), makes CopyShard stop
	// after B's commit, before A's: a driver that crashed there.
	abandon bool
}

func (m ShardMove) String() string {
	return fmt.Sprintf("shard %d from database %s to %s", m.Shard, m.From, m.To)
}

// ErrPlacementBusy: the leave (or the copy's commit) found the shard's
// placement row locked by another transaction, a producer's insert most
// likely; the step never waits for a producer: try it again later.
var ErrPlacementBusy = errors.New("store: the shard's placement row is locked by another transaction (a producer's); try the move's step again later")

// ErrShardGone: the source database gave the shard away already (its
// move committed): finish the move (switch, arrive, done), never copy
// again.
var ErrShardGone = errors.New("store: the shard is gone from the source database (the move committed)")

// ErrMoveRefused is matched by a step refused for the shard's placement
// (not held at the source, held at the destination, nothing arriving):
// the move as asked cannot be made; roll it back.
var ErrMoveRefused = errors.New("store: the shard's placement does not allow the move")

// moveCopySetting is the transaction setting that lets a move's copy
// insert a shard's rows as they were (sql/shardrun_file_tasks.sql,
// sql/shardrun_check_placement.sql).
const moveCopySetting = `SELECT set_config('shardrun.move_copy', 'on', true)`

// moveLockTimeout bounds how long the commit and the arrival wait for the
// placement row and the copy for its locks when the caller's context does
// not: runners' writes and handlers' transactions (HandlerTxTimeout) end.
const moveLockTimeout = 30 * time.Second

// copyIdleTimeout bounds how long the copy's transaction at the source
// may sit idle while the destination's transaction runs: a driver frozen
// there holds the shard's locks (and the next leader's fence raise at the
// source) this long at most.
const copyIdleTimeout = 2 * time.Minute

// PlacementOf reads shard's placement row; ok false: the database has
// none (it never held the shard).
func (s *Store) PlacementOf(ctx context.Context, shard int) (p ShardPlacement, ok bool, err error) {
	var peer *string
	err = s.pool.QueryRow(ctx, `/* shardrun.placement_of */
		SELECT shard, state, map_rev, peer FROM shardrun_placement WHERE shard = $1`, shard).Scan(&p.Shard, &p.State, &p.MapRev, &peer)
	if errors.Is(err, pgx.ErrNoRows) {
		return ShardPlacement{Shard: shard}, false, nil
	}
	if err != nil {
		return ShardPlacement{}, false, fmt.Errorf("reading the placement of shard %d: %w", shard, err)
	}
	p.Peer = deref(peer)
	return p, true, nil
}

// moveTx runs f in a transaction that holds the coordinator fence FOR
// SHARE at epoch (ErrNotLeader when it holds another), with the move's
// lock timeout.
func moveTx(ctx context.Context, s *Store, epoch int64, f func(tx pgx.Tx) error) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := lockLeaderFence(ctx, tx, epoch); err != nil {
		return err
	}
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// lockLeaderFence locks the coordinator fence FOR SHARE in tx when it
// holds epoch (ErrNotLeader otherwise) and sets the move's lock timeout.
func lockLeaderFence(ctx context.Context, tx pgx.Tx, epoch int64) error {
	if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", moveLockTimeout.Milliseconds())); err != nil {
		return err
	}
	var fenced bool
	if err := tx.QueryRow(ctx, `/* shardrun.move_fence */
		SELECT EXISTS (SELECT 1 FROM coordinator_fence WHERE id = 1 AND epoch = $1 FOR SHARE)`, epoch).Scan(&fenced); err != nil {
		return err
	}
	if !fenced {
		return ErrNotLeader
	}
	return nil
}

// lockPlacement locks shard's placement row FOR UPDATE NOWAIT in tx and
// returns its state ("" when there is none); a lock held by another
// transaction is ErrPlacementBusy.
func lockPlacement(ctx context.Context, tx pgx.Tx, shard int) (state, peer string, err error) {
	var p *string
	err = tx.QueryRow(ctx, `/* shardrun.move_lock_placement */
		SELECT state, peer FROM shardrun_placement WHERE shard = $1 FOR UPDATE NOWAIT`, shard).Scan(&state, &p)
	var pe *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return "", "", nil
	case errors.As(err, &pe) && pe.Code == "55P03":
		return "", "", ErrPlacementBusy
	case err != nil:
		return "", "", err
	}
	return state, deref(p), nil
}

// LeaveShard is the move's leave step at the source database (this
// store): the shard's placement row, locked FOR UPDATE NOWAIT, leaving
// (peer m.To), and its fence rows moving, so that from its commit no
// producer inserts into the shard here and no runner claims from it.
// It never waits for a producer: a placement row a producer's
// transaction holds is ErrPlacementBusy (try again later). It waits for
// the claim statements under way (their fence rows FOR SHARE). Leaving
// already is done; gone is ErrShardGone; not held here is ErrMoveRefused.
func (s *Store) LeaveShard(ctx context.Context, m ShardMove) error {
	err := moveTx(ctx, s, m.Epoch, func(tx pgx.Tx) error {
		state, peer, err := lockPlacement(ctx, tx, m.Shard)
		if err != nil {
			return err
		}
		switch state {
		case PlacementGone:
			return ErrShardGone
		case PlacementLeaving:
			if peer != m.To {
				return fmt.Errorf("%w: it is leaving for database %s", ErrMoveRefused, peer)
			}
		case PlacementHeld:
		default:
			return fmt.Errorf("%w: the source database does not hold it (state %s)", ErrMoveRefused, cmp.Or(state, "none"))
		}
		if _, err := tx.Exec(ctx, `/* shardrun.move_leave */
			UPDATE shardrun_placement SET state = 'leaving', peer = $2, map_rev = $3, changed_at = now() WHERE shard = $1`,
			m.Shard, m.To, m.MapRev); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `/* shardrun.move_leave_fences */
			UPDATE shard_fences SET moving = true WHERE shard = $1 AND NOT moving`, m.Shard)
		return err
	})
	if err != nil {
		return fmt.Errorf("leaving %s: %w", m, err)
	}
	return nil
}

// RollbackShard undoes a move that did not commit, at the source database
// (this store): the shard held again, its fence rows not moving. Held
// already is done; gone is ErrShardGone (the move committed: finish it).
// The destination's copy is DropArriving's.
func (s *Store) RollbackShard(ctx context.Context, m ShardMove) error {
	err := moveTx(ctx, s, m.Epoch, func(tx pgx.Tx) error {
		state, _, err := lockPlacementWait(ctx, tx, m.Shard)
		if err != nil {
			return err
		}
		switch state {
		case PlacementGone:
			return ErrShardGone
		case PlacementHeld, PlacementLeaving:
		default:
			return fmt.Errorf("%w: the source database does not hold it (state %s)", ErrMoveRefused, cmp.Or(state, "none"))
		}
		if _, err := tx.Exec(ctx, `/* shardrun.move_rollback */
			UPDATE shardrun_placement SET state = 'held', peer = NULL, map_rev = $2, changed_at = now()
			WHERE shard = $1 AND state <> 'held'`, m.Shard, m.MapRev); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `/* shardrun.move_rollback_fences */
			UPDATE shard_fences SET moving = false WHERE shard = $1 AND moving`, m.Shard)
		return err
	})
	if err != nil {
		return fmt.Errorf("rolling back the move of %s: %w", m, err)
	}
	return nil
}

// lockPlacementWait locks shard's placement row FOR UPDATE, waiting (up
// to the move's lock timeout), and returns its state ("" when none).
func lockPlacementWait(ctx context.Context, tx pgx.Tx, shard int) (state, peer string, err error) {
	var p *string
	err = tx.QueryRow(ctx, `/* shardrun.move_lock_placement_wait */
		SELECT state, peer FROM shardrun_placement WHERE shard = $1 FOR UPDATE`, shard).Scan(&state, &p)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", "", nil
	}
	return state, deref(p), err
}

// DropArriving deletes, at the destination database (this store), the
// copy of a move that did not commit: every row of the shard and its
// arriving placement row. Nothing arriving is done; the shard held or
// leaving here is ErrMoveRefused (never deleted).
func (s *Store) DropArriving(ctx context.Context, m ShardMove) error {
	err := moveTx(ctx, s, m.Epoch, func(tx pgx.Tx) error {
		state, _, err := lockPlacementWait(ctx, tx, m.Shard)
		if err != nil {
			return err
		}
		switch state {
		case PlacementHeld, PlacementLeaving:
			return fmt.Errorf("%w: the destination database holds it (state %s)", ErrMoveRefused, state)
		case PlacementArriving:
		default:
			return nil
		}
		if _, err := deleteShardRows(ctx, tx, m.Shard); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `/* shardrun.move_drop_placement */
			DELETE FROM shardrun_placement WHERE shard = $1 AND state = 'arriving'`, m.Shard)
		return err
	})
	if err != nil {
		return fmt.Errorf("deleting the uncommitted copy of %s: %w", m, err)
	}
	return nil
}

// ArriveShard is the move's arrive step at the destination database (this
// store), after the map says the shard is there: held, its fence rows not
// moving, and its claims' heartbeat_at now, so that the stale sweep gives
// their runners the time to see the new map. Held already is done; no
// copy here (the move did not commit) is ErrMoveRefused.
func (s *Store) ArriveShard(ctx context.Context, m ShardMove) error {
	err := moveTx(ctx, s, m.Epoch, func(tx pgx.Tx) error {
		state, _, err := lockPlacementWait(ctx, tx, m.Shard)
		if err != nil {
			return err
		}
		switch state {
		case PlacementHeld:
			return nil
		case PlacementArriving:
		default:
			return fmt.Errorf("%w: no copy arrived at the destination database (state %s)", ErrMoveRefused, cmp.Or(state, "none"))
		}
		// The lock order: fences, then claims.
		if _, err := tx.Exec(ctx, `/* shardrun.move_arrive_fences */
			UPDATE shard_fences SET moving = false WHERE shard = $1 AND moving`, m.Shard); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `/* shardrun.move_arrive_claims */
			UPDATE task_claims k SET heartbeat_at = now() FROM (
				SELECT id FROM task_claims WHERE shard = $1 ORDER BY id FOR UPDATE) c
			WHERE k.id = c.id`, m.Shard); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `/* shardrun.move_arrive */
			UPDATE shardrun_placement SET state = 'held', peer = NULL, map_rev = $2, changed_at = now() WHERE shard = $1`,
			m.Shard, m.MapRev)
		return err
	})
	if err != nil {
		return fmt.Errorf("arriving %s: %w", m, err)
	}
	return nil
}

// Copied is what a move's copy moved.
type Copied struct {
	// Tasks is how many task records it copied; MaxID the largest id.
	Tasks int64
	MaxID int64
}

// shardCopy is everything of one shard, each table's rows as a JSON array
// of its rows (to_jsonb: every column, by name).
type shardCopy struct {
	tables map[string]string
	queues string
	tasks  int64
	maxID  int64
	maxPos int64
}

// copyTables are the tables of a shard's rows, in the order the copy
// inserts them, with what selects the shard's rows (n: its task records,
// id, state, unique_key and sequence_key).
var copyTables = []struct{ table, where string }{
	{"tasks", `t.shard = $1`},
	{"task_sequences", `t.key IN (SELECT sequence_key FROM n WHERE sequence_key IS NOT NULL)`},
	{"task_ready", `t.shard = $1`},
	{"task_waiting", `t.id IN (SELECT id FROM n)`},
	{"task_claims", `t.shard = $1`},
	{"task_finished", `(t.state, t.id) IN (SELECT state, id FROM n)`},
	{"task_unique_keys", `(t.unique_key, t.id) IN (SELECT unique_key, id FROM n WHERE unique_key IS NOT NULL)`},
	{"shard_fences", `t.shard = $1`},
}

// overriding is the tables whose identity column the copy sets.
var overriding = map[string]bool{"tasks": true, "task_waiting": true}

// CopyShard is the move's copy and commit (steps 3 and 4) of shard m.Shard
// from database from to database to (m.From and m.To by name):
//
//   - a transaction at from requires the shard's placement leaving for
//     m.To (gone: ErrShardGone, the move committed), locks its fence rows,
//     claim rows, task records and sequences FOR UPDATE, in the one lock
//     order (waiting for the runners' writes under way and the handlers'
//     transactions that hold a CompleteTx mark), and reads every row of
//     the shard;
//   - one transaction at to deletes whatever of the shard an earlier
//     attempt left, inserts the rows as they were (task records, sequences,
//     lanes, waiting lines, claims, finished entries, unique keys, fences,
//     and the queues they name; the claims' heartbeat_at now, so that a
//     stale sweep there leaves them to their runners), sets the shard
//     arriving (peer m.From),
//     raises its task ids and its sequences' positions above those copied,
//     and commits;
//   - the transaction at from, still holding its locks, deletes every row
//     of the shard, locks its placement row FOR UPDATE NOWAIT (tried a
//     few times: a producer's refused insert holds it FOR SHARE until its
//     transaction ends; still held: ErrPlacementBusy, the copy is made
//     again later), sets it gone (peer m.To) and commits: the move's
//     commit point.
//
// No producer waits for the copy: the placement row is locked only for
// the commit, as briefly as the leave locks it. (Locked for the whole
// copy, it would hold back producers' inserts, which then fail; locked
// without NOWAIT at the commit, it could wait for a fence raise that
// holds it FOR SHARE and waits for the copy's fence rows.)
//
// Each transaction holds its database's coordinator fence at m.Epoch FOR
// SHARE (ErrNotLeader). A failure before from's commit leaves the shard
// at from, leaving, and perhaps a copy at to, arriving: DropArriving, then
// CopyShard again (or RollbackShard). A failure of from's commit itself
// leaves either: PlacementOf at from says which.
func CopyShard(ctx context.Context, from, to *Store, m ShardMove) (Copied, error) {
	c, err := copyShard(ctx, from, to, m)
	if err != nil {
		return Copied{}, fmt.Errorf("copying %s: %w", m, err)
	}
	return c, nil
}

func copyShard(ctx context.Context, from, to *Store, m ShardMove) (Copied, error) {
	tx, err := from.pool.Begin(ctx)
	if err != nil {
		return Copied{}, fmt.Errorf("at database %s: %w", m.From, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := lockLeaderFence(ctx, tx, m.Epoch); err != nil {
		return Copied{}, fmt.Errorf("at database %s: %w", m.From, err)
	}
	// The transaction is idle while B's transaction inserts the copy:
	// the pool's idle_in_transaction_session_timeout (seconds: a frozen
	// process holds no lock for long) would end it under a large copy.
	if _, err := tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`,
		strconv.FormatInt(copyIdleTimeout.Milliseconds(), 10)); err != nil {
		return Copied{}, fmt.Errorf("at database %s: %w", m.From, err)
	}
	var state, peer string
	var p *string
	err = tx.QueryRow(ctx, `/* shardrun.move_read_placement */
		SELECT state, peer FROM shardrun_placement WHERE shard = $1`, m.Shard).Scan(&state, &p)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return Copied{}, fmt.Errorf("at database %s: %w", m.From, err)
	}
	peer = deref(p)
	switch {
	case state == PlacementGone:
		return Copied{}, ErrShardGone
	case state != PlacementLeaving || peer != m.To:
		return Copied{}, fmt.Errorf("%w: at database %s the shard is %s (peer %q), not leaving for %s",
			ErrMoveRefused, m.From, cmp.Or(state, "none"), peer, m.To)
	}
	cp, err := readShard(ctx, tx, m.Shard)
	if err != nil {
		return Copied{}, fmt.Errorf("reading the shard at database %s: %w", m.From, err)
	}
	if err := writeCopy(ctx, to, m, cp); err != nil {
		return Copied{}, fmt.Errorf("writing the copy at database %s: %w", m.To, err)
	}
	if m.abandon {
		return Copied{}, errAbandoned
	}
	if _, err := deleteShardRows(ctx, tx, m.Shard); err != nil {
		return Copied{}, fmt.Errorf("deleting the shard's rows at database %s: %w", m.From, err)
	}
	if err := lockPlacementBriefly(ctx, tx, m.Shard); err != nil {
		return Copied{}, fmt.Errorf("locking the shard's placement at database %s: %w", m.From, err)
	}
	if _, err := tx.Exec(ctx, `/* shardrun.move_gone */
		UPDATE shardrun_placement SET state = 'gone', peer = $2, map_rev = $3, changed_at = now() WHERE shard = $1`,
		m.Shard, m.To, m.MapRev); err != nil {
		return Copied{}, fmt.Errorf("recording the shard gone at database %s: %w", m.From, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return Copied{}, fmt.Errorf("committing the move at database %s (whether it committed is A's placement row's to say): %w", m.From, err)
	}
	return Copied{Tasks: cp.tasks, MaxID: cp.maxID}, nil
}

// placementTries and placementPause: how often, and how far apart, the
// copy's commit asks for the placement row without waiting.
const (
	placementTries = 20
	placementPause = 10 * time.Millisecond
)

// lockPlacementBriefly locks shard's placement row FOR UPDATE NOWAIT in
// tx, each try in a savepoint (a refusal would end tx), a few times a
// few milliseconds apart; still held by another transaction:
// ErrPlacementBusy.
func lockPlacementBriefly(ctx context.Context, tx pgx.Tx, shard int) error {
	for try := 1; ; try++ {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		_, _, err = lockPlacement(ctx, sp, shard)
		if err == nil {
			return sp.Commit(ctx)
		}
		if rerr := sp.Rollback(ctx); rerr != nil {
			return rerr
		}
		if !errors.Is(err, ErrPlacementBusy) || try == placementTries {
			return err
		}
		if err := sleepCtx(ctx, placementPause); err != nil {
			return err
		}
	}
}

// errAbandoned is a test's driver that stopped between the two commits.
var errAbandoned = errors.New("store: the copy was abandoned before its commit at the source (a test's crash)")

// readShard locks, in tx, the shard's fence rows, claim rows, task
// records and sequences FOR UPDATE, in the one lock order, and reads
// every row of the shard.
func readShard(ctx context.Context, tx pgx.Tx, shard int) (shardCopy, error) {
	for _, lock := range []string{
		`/* shardrun.move_lock_fences */ SELECT 1 FROM shard_fences WHERE shard = $1 ORDER BY grp, shard FOR UPDATE`,
		`/* shardrun.move_lock_claims */ SELECT 1 FROM task_claims WHERE shard = $1 ORDER BY id FOR UPDATE`,
		`/* shardrun.move_lock_records */ SELECT 1 FROM tasks WHERE shard = $1 ORDER BY id FOR UPDATE`,
		`/* shardrun.move_lock_sequences */ SELECT 1 FROM task_sequences WHERE key IN (
			SELECT sequence_key FROM tasks WHERE shard = $1 AND sequence_key IS NOT NULL) ORDER BY key FOR UPDATE`,
	} {
		if _, err := tx.Exec(ctx, lock, shard); err != nil {
			return shardCopy{}, err
		}
	}
	parts := make([]string, 0, len(copyTables))
	for _, ct := range copyTables {
		parts = append(parts, `(SELECT coalesce(jsonb_agg(to_jsonb(t)), '[]')::text FROM `+ct.table+` t WHERE `+ct.where+`)`)
	}
	cp := shardCopy{tables: make(map[string]string, len(copyTables))}
	vals := make([]string, len(copyTables))
	dest := make([]any, 0, len(copyTables)+4)
	for i := range vals {
		dest = append(dest, &vals[i])
	}
	dest = append(dest, &cp.queues, &cp.tasks, &cp.maxID, &cp.maxPos)
	if err := tx.QueryRow(ctx, `/* shardrun.move_read */
		WITH n AS MATERIALIZED (SELECT id, state, unique_key, sequence_key, queue FROM tasks WHERE shard = $1)
		SELECT `+strings.Join(parts, ",\n")+`,
			(SELECT coalesce(jsonb_agg(DISTINCT queue), '[]')::text FROM n),
			(SELECT count(*) FROM n), (SELECT coalesce(max(id), 0) FROM n),
			(SELECT coalesce(max(pos), 0) FROM task_waiting WHERE id IN (SELECT id FROM n))`, shard).Scan(dest...); err != nil {
		return shardCopy{}, err
	}
	for i, ct := range copyTables {
		cp.tables[ct.table] = vals[i]
	}
	return cp, nil
}

// writeCopy is the copy's transaction at the destination (see CopyShard),
// retried a few times when the identity's lock is not had at once.
func writeCopy(ctx context.Context, to *Store, m ShardMove, cp shardCopy) error {
	for attempt := 0; ; attempt++ {
		err := moveTx(ctx, to, m.Epoch, func(tx pgx.Tx) error { return insertCopy(ctx, to, tx, m, cp) })
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "55P03" && attempt < idLockTries {
			if err := sleepCtx(ctx, time.Duration(attempt+1)*10*time.Millisecond); err != nil {
				return err
			}
			continue
		}
		return err
	}
}

func insertCopy(ctx context.Context, to *Store, tx pgx.Tx, m ShardMove, cp shardCopy) error {
	state, _, err := lockPlacementWait(ctx, tx, m.Shard)
	if err != nil {
		return err
	}
	if state == PlacementHeld || state == PlacementLeaving {
		return fmt.Errorf("%w: the destination database holds it (state %s)", ErrMoveRefused, state)
	}
	if _, err := tx.Exec(ctx, moveCopySetting); err != nil {
		return err
	}
	if _, err := deleteShardRows(ctx, tx, m.Shard); err != nil {
		return fmt.Errorf("deleting an earlier attempt's rows: %w", err)
	}
	if _, err := tx.Exec(ctx, `/* shardrun.move_queues */
		INSERT INTO queues (name) SELECT q FROM jsonb_array_elements_text($1::jsonb) AS q ORDER BY q
		ON CONFLICT (name) DO NOTHING`, cp.queues); err != nil {
		return fmt.Errorf("registering the shard's queues: %w", err)
	}
	for _, ct := range copyTables {
		over := ""
		if overriding[ct.table] {
			over = " OVERRIDING SYSTEM VALUE"
		}
		if _, err := tx.Exec(ctx, `/* shardrun.move_insert */ INSERT INTO `+ct.table+over+`
			SELECT * FROM jsonb_populate_recordset(NULL::`+ct.table+`, $1::jsonb)`, cp.tables[ct.table]); err != nil {
			return fmt.Errorf("inserting the shard's %s: %w", ct.table, err)
		}
	}
	// The copied claims count as alive from the copy on: B's stale sweep
	// must not requeue them before their runners see the new map (the
	// arrival touches them again).
	if _, err := tx.Exec(ctx, `/* shardrun.move_touch_claims */
		UPDATE task_claims SET heartbeat_at = now() WHERE shard = $1`, m.Shard); err != nil {
		return fmt.Errorf("touching the copied claims: %w", err)
	}
	if _, err := tx.Exec(ctx, `/* shardrun.move_arriving */
		INSERT INTO shardrun_placement AS p (shard, state, map_rev, peer) VALUES ($1, 'arriving', $2, $3)
		ON CONFLICT (shard) DO UPDATE SET state = 'arriving', map_rev = excluded.map_rev, peer = excluded.peer, changed_at = now()`,
		m.Shard, m.MapRev, m.From); err != nil {
		return fmt.Errorf("recording the shard arriving: %w", err)
	}
	// The sequences' positions: a task of a copied sequence enqueued here
	// later must wait behind those copied (nextval drawn once, never
	// lowered).
	if _, err := tx.Exec(ctx, `/* shardrun.move_positions */
		SELECT setval(pg_get_serial_sequence('task_waiting', 'pos'),
			greatest($1::bigint, nextval(pg_get_serial_sequence('task_waiting', 'pos'))))`, cp.maxPos); err != nil {
		return fmt.Errorf("raising the sequences' positions: %w", err)
	}
	var slot, databases int
	if err := tx.QueryRow(ctx, `SELECT slot, databases FROM shardrun_cluster WHERE id = 1`).Scan(&slot, &databases); err != nil {
		return fmt.Errorf("reading the database's slot: %w", err)
	}
	if databases == 1 {
		slot = -1
	}
	if err := to.raiseIDs(ctx, tx, slot, cp.maxID); err != nil {
		return fmt.Errorf("raising the task ids above %d: %w", cp.maxID, err)
	}
	return nil
}

// deleteShardRows deletes, in tx, every row of shard: its task records
// and their sequences, lanes, waiting lines, claims, finished entries and
// unique keys, and its fence rows; it returns how many records.
func deleteShardRows(ctx context.Context, tx pgx.Tx, shard int) (int64, error) {
	var n int64
	err := tx.QueryRow(ctx, `/* shardrun.move_delete */
		WITH n AS MATERIALIZED (SELECT id, state, unique_key, sequence_key FROM tasks WHERE shard = $1),
		k AS (DELETE FROM task_unique_keys k WHERE (k.unique_key, k.id) IN (SELECT unique_key, id FROM n WHERE unique_key IS NOT NULL)),
		f AS (DELETE FROM task_finished f WHERE (f.state, f.id) IN (SELECT state, id FROM n)),
		w AS (DELETE FROM task_waiting w WHERE w.id IN (SELECT id FROM n)),
		r AS (DELETE FROM task_ready r WHERE r.shard = $1),
		c AS (DELETE FROM task_claims c WHERE c.shard = $1),
		s AS (DELETE FROM task_sequences s WHERE s.key IN (SELECT sequence_key FROM n WHERE sequence_key IS NOT NULL)),
		fe AS (DELETE FROM shard_fences f WHERE f.shard = $1),
		t AS (DELETE FROM tasks t WHERE t.id IN (SELECT id FROM n) RETURNING 1)
		SELECT count(*) FROM t`, shard).Scan(&n)
	return n, err
}
