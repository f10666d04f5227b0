package store

// A database's place in a cluster of several databases (issue 40,
// docs/architecture.md "Several databases"): its name in the shard →
// database map, its slot (its index in the map, the residue of its task
// ids), the cluster's database count, and which shards it holds
// (shardrun_placement), so that a write for a shard it does not hold is
// refused in the database itself, whoever sends it.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// IDStride is how far apart the task ids of one database are in a cluster
// of several databases: each database's identity takes every IDStride-th
// value, from its own residue (its slot), so that ids are unique across
// the databases and a listing merged from them keeps one id cursor. It
// bounds a cluster's database count. A cluster of one database keeps
// ids one apart.
const IDStride = 1024

// MaxDatabases is the most databases a cluster may have: one id residue
// each.
const MaxDatabases = IDStride

// Placement states (shardrun_placement.state).
const (
	// PlacementHeld: producers insert, runners claim.
	PlacementHeld = "held"
	// PlacementLeaving: a move copies the shard out: no insert, no claim.
	PlacementLeaving = "leaving"
	// PlacementArriving: a move's copy landed, not committed: inert.
	PlacementArriving = "arriving"
	// PlacementGone: moved away to Peer: every write refused.
	PlacementGone = "gone"
)

// ErrRegistration is matched (errors.Is) by Register's refusals: the
// database was registered as another member of the cluster, or holds
// tasks of shards the map gives to other databases.
var ErrRegistration = errors.New("store: the database does not match the cluster's map of databases")

// CodeNotHeld is the SQLSTATE of an insert into a shard the database does
// not hold (sql/shardrun_check_placement.sql).
const CodeNotHeld = "SR001"

// NotHeld reports whether err is the database's refusal of an insert into
// a shard it does not hold (SQLSTATE SR001): the map the producer used is
// stale.
func NotHeld(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == CodeNotHeld
}

// ShardPlacement is one row of shardrun_placement.
type ShardPlacement struct {
	Shard int
	State string
	// MapRev is the map revision the row was last set at.
	MapRev int64
	// Peer is the other database of a move (gone: where the shard went).
	Peer string
}

// Membership is what a database records of its place in the cluster
// (shardrun_cluster).
type Membership struct {
	// Name is the database's name in the map ("main" until registered).
	Name string
	// Slot is its index in the map's databases: its task ids are
	// Slot modulo IDStride in a cluster of several databases.
	Slot int
	// Databases is the cluster's database count.
	Databases int
	// ShardCount is the cluster's shard count (0: not recorded yet).
	ShardCount int
	// Registered says whether Register recorded the above (false: the
	// defaults of a database of a one-database cluster).
	Registered bool
}

// Membership reads what the database records of its place in the cluster;
// a database where no count is recorded yet answers the defaults.
func (s *Store) Membership(ctx context.Context) (Membership, error) {
	m := Membership{Name: MainDatabase, Databases: 1}
	var registered *time.Time
	err := s.pool.QueryRow(ctx, `/* shardrun.membership */
		SELECT db_name, slot, databases, shard_count, registered_at FROM shardrun_cluster WHERE id = 1`).
		Scan(&m.Name, &m.Slot, &m.Databases, &m.ShardCount, &registered)
	if errors.Is(err, pgx.ErrNoRows) {
		return m, nil
	}
	if err != nil {
		return Membership{}, fmt.Errorf("reading the database's place in the cluster: %w", err)
	}
	m.Registered = registered != nil
	return m, nil
}

// MainDatabase is the name of a cluster's only database when no map
// names it (--database-url).
const MainDatabase = "main"

// Placement lists the database's placement rows, in shard order.
func (s *Store) Placement(ctx context.Context) ([]ShardPlacement, error) {
	return collect(ctx, s.pool, "reading the shards the database holds", func(r pgx.CollectableRow) (ShardPlacement, error) {
		var p ShardPlacement
		var peer *string
		err := r.Scan(&p.Shard, &p.State, &p.MapRev, &peer)
		p.Peer = deref(peer)
		return p, err
	}, `/* shardrun.placement */ SELECT shard, state, map_rev, peer FROM shardrun_placement ORDER BY shard`)
}

// RegisterOpts is a database's place in the map, as Register records it.
type RegisterOpts struct {
	// Name is the database's name in the map.
	Name string
	// Shards are the shards the map gives it.
	Shards []int
	// Databases is the cluster's database count, 1 to MaxDatabases.
	Databases int
	// MapRev is the map's revision (etcd ModRevision of meta/databases; 0
	// for the implicit map of a one-database cluster).
	MapRev int64
	// Slot is the database's index in the map's databases.
	Slot int
}

// Register records the database's place in the cluster: its name, slot
// and the cluster's database count (shardrun_cluster), and, the first
// time, that it holds Shards (shardrun_placement, every other shard's row
// of a database registered before removed). With more than one database
// it also makes the database refuse inserts into shards it does not hold
// (the trigger tasks_placement, sql/shardrun_check_placement.sql) and its
// task ids take every IDStride-th value from Slot (the identity's
// sequence; ids already drawn are passed, never reused).
//
// EnsureShardCount must have recorded the shard count first. Register is
// idempotent: registering again with the same name, slot and count
// changes nothing (the shards are not checked again: moves change them).
// A database registered as another name, slot or count, or holding tasks
// of shards outside Shards when first registered, is refused with an
// error naming the database (ErrRegistration).
func (s *Store) Register(ctx context.Context, o RegisterOpts) error {
	switch {
	case o.Name == "":
		return errors.New("store: registering a database: no name")
	case o.Databases < 1 || o.Databases > MaxDatabases:
		return fmt.Errorf("store: registering database %s: the database count must be 1 to %d, got %d", o.Name, MaxDatabases, o.Databases)
	case o.Slot < 0 || o.Slot >= o.Databases:
		return fmt.Errorf("store: registering database %s: slot %d is not one of %d databases", o.Name, o.Slot, o.Databases)
	}
	shards := make([]int32, len(o.Shards))
	for i, sh := range o.Shards {
		shards[i] = int32(sh)
	}
	slices.Sort(shards)
	// A database registered already (every start but the cluster's first)
	// is checked without the row lock: the processes that start together
	// took turns at it, each a commit of the lock (bench section startup).
	var name string
	var slot, databases, shardCount int
	var registered *time.Time
	err := s.pool.QueryRow(ctx, `/* shardrun.registered */
		SELECT db_name, slot, databases, shard_count, registered_at FROM shardrun_cluster WHERE id = 1`).
		Scan(&name, &slot, &databases, &shardCount, &registered)
	if err == nil && registered != nil {
		return o.registeredAs(name, slot, databases)
	}
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, `/* shardrun.register_lock */
			SELECT db_name, slot, databases, shard_count, registered_at FROM shardrun_cluster WHERE id = 1 FOR UPDATE`).
			Scan(&name, &slot, &databases, &shardCount, &registered)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("the shard count is not recorded yet (EnsureShardCount first)")
		}
		if err != nil {
			return err
		}
		if registered != nil {
			return o.registeredAs(name, slot, databases)
		}
		for _, sh := range shards {
			if int(sh) >= shardCount {
				return fmt.Errorf("%w: database %s: shard %d is outside the cluster's %d shards", ErrRegistration, o.Name, sh, shardCount)
			}
		}
		var stray *int32
		if err := tx.QueryRow(ctx, `/* shardrun.register_stray */
			SELECT min(shard) FROM (SELECT DISTINCT shard FROM tasks WHERE shard <> ALL ($1::int[]) LIMIT 1) x`, shards).Scan(&stray); err != nil {
			return err
		}
		if stray != nil {
			return fmt.Errorf("%w: database %s holds tasks of shard %d, which the map gives to another database (SELECT id FROM tasks WHERE shard = %d)",
				ErrRegistration, o.Name, *stray, *stray)
		}
		if _, err := tx.Exec(ctx, `/* shardrun.register */
			WITH c AS (
				UPDATE shardrun_cluster SET db_name = $1, slot = $2, databases = $3, registered_at = now() WHERE id = 1
			), d AS (
				DELETE FROM shardrun_placement WHERE shard <> ALL ($4::int[])
			)
			INSERT INTO shardrun_placement (shard, state, map_rev)
			SELECT s, 'held', $5 FROM unnest($4::int[]) AS s ORDER BY s
			ON CONFLICT (shard) DO UPDATE SET state = 'held', map_rev = excluded.map_rev, peer = NULL, changed_at = now()`,
			o.Name, o.Slot, o.Databases, shards, o.MapRev); err != nil {
			return err
		}
		if o.Databases == 1 {
			return nil
		}
		if _, err := tx.Exec(ctx, `/* shardrun.register_trigger */
			CREATE OR REPLACE TRIGGER tasks_placement AFTER INSERT ON tasks
				REFERENCING NEW TABLE AS new_rows
				FOR EACH STATEMENT EXECUTE FUNCTION shardrun_check_placement()`); err != nil {
			return fmt.Errorf("adding the placement check: %w", err)
		}
		return s.raiseIDs(ctx, tx, o.Slot, 0)
	})
	if err != nil {
		if errors.Is(err, ErrRegistration) {
			return err
		}
		return fmt.Errorf("registering database %s (slot %d of %d databases, map revision %d): %w", o.Name, o.Slot, o.Databases, o.MapRev, err)
	}
	return nil
}

// RaiseIDsAbove makes every task id the database draws from now on larger
// than id, keeping its residue (its slot, modulo IDStride, in a cluster
// of several databases): a move's copy into this database raises it above
// the largest id it copied, so that no id is drawn twice.
//
// The identity's sequence is locked (ALTER SEQUENCE, which every draw
// waits for) while it is read and set, so that no draw passes the new
// value unseen; the lock is asked for with a short lock_timeout (a
// producer's open transaction that drew an id holds the sequence until
// it ends), and the call is retried while it times out.
func (s *Store) RaiseIDsAbove(ctx context.Context, id int64) error {
	for attempt := 0; ; attempt++ {
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			var slot, databases int
			err := tx.QueryRow(ctx, `SELECT slot, databases FROM shardrun_cluster WHERE id = 1`).Scan(&slot, &databases)
			if errors.Is(err, pgx.ErrNoRows) {
				slot, databases = 0, 1
			} else if err != nil {
				return err
			}
			if databases == 1 {
				slot = -1 // any residue
			}
			return s.raiseIDs(ctx, tx, slot, id)
		})
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "55P03" && attempt < idLockTries {
			if err := sleepCtx(ctx, time.Duration(attempt+1)*10*time.Millisecond); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("raising the task ids above %d: %w", id, err)
		}
		return nil
	}
}

// idLockTries bounds how often RaiseIDsAbove asks for the sequence's lock.
const idLockTries = 50

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// raiseIDs, in tx, locks the identity's sequence of tasks.id and sets it
// so that the next id drawn is above both id and every id drawn or stored
// already, with residue slot modulo IDStride (slot -1: increment 1, any
// residue).
func (s *Store) raiseIDs(ctx context.Context, tx pgx.Tx, slot int, id int64) error {
	step := int64(IDStride)
	if slot < 0 {
		step = 1
	}
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
		return err
	}
	var seq string
	if err := tx.QueryRow(ctx, `SELECT pg_get_serial_sequence('tasks', 'id')`).Scan(&seq); err != nil {
		return err
	}
	// ALTER SEQUENCE locks the sequence against every draw (nextval) until
	// the commit; the value read below is then the last one drawn.
	quoted := pgx.Identifier(strings.Split(seq, ".")).Sanitize()
	if _, err := tx.Exec(ctx, `ALTER SEQUENCE `+quoted+` INCREMENT BY `+strconv.FormatInt(step, 10)); err != nil {
		return err
	}
	var last int64
	var called bool
	if err := tx.QueryRow(ctx, `SELECT last_value, is_called FROM `+quoted).Scan(&last, &called); err != nil {
		return err
	}
	var stored int64
	if err := tx.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM tasks`).Scan(&stored); err != nil {
		return err
	}
	floor := max(id, stored) + 1 // the next id must be at least this
	if called {
		floor = max(floor, last+1)
	} else {
		floor = max(floor, last)
	}
	next := floor
	if slot >= 0 {
		next = nextWithResidue(floor, int64(slot))
	}
	if !called && next == last {
		return nil
	}
	_, err := tx.Exec(ctx, `SELECT setval($1::regclass, $2, false)`, seq, next)
	return err
}

// nextWithResidue is the least value at least floor (and at least 1)
// whose residue modulo IDStride is slot.
func nextWithResidue(floor, slot int64) int64 {
	floor = max(floor, 1)
	v := floor - floor%IDStride + slot
	if v < floor {
		v += IDStride
	}
	return v
}

// SlotOf is the slot of the database that drew task id in a cluster of
// several databases (its residue modulo IDStride): where Get looks first.
func SlotOf(id int64) int { return int(id % IDStride) }

// registeredAs checks a database's registration (its name, slot and the
// cluster's database count) against o.
func (o RegisterOpts) registeredAs(name string, slot, databases int) error {
	if name != o.Name || slot != o.Slot || databases != o.Databases {
		return fmt.Errorf("%w: database %s is registered as database %s, slot %d of %d databases; this process has it as %s, slot %d of %d",
			ErrRegistration, o.Name, name, slot, databases, o.Name, o.Slot, o.Databases)
	}
	return nil
}
