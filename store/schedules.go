package store

// Schedules: periodic tasks. Each tick is enqueued by the leader in the
// same transaction that moves the schedule's next_tick past it, under the
// coordinator fence, so a tick is enqueued exactly once across leader
// changes: a deposed leader's transaction either committed before the new
// leader raised the fence (and the new leader sees next_tick moved) or
// applies nothing.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/tasks"
)

// ErrScheduleExists is returned by CreateSchedule for a name in use.
var ErrScheduleExists = errors.New("store: a schedule with this name exists")

// Schedule is one row of the schedules table. Exactly one of Every and
// Cron is set.
type Schedule struct {
	ID   int64
	Name string
	// Task is the task each tick enqueues, as defined: its queue and
	// priority filled with their defaults; an empty Key (a random key for
	// each tick's task) and MaxAttempts 0 (the enqueuing client's default)
	// are chosen at each tick. RunAfter, Deadline and UniqueKey are never
	// set: each tick's task runs at its tick, and is its own.
	Task tasks.NewTask
	// SkipWhileUnfinished: a tick that comes due while the task of the
	// schedule's last enqueued tick is unfinished (ready, waiting or
	// running) is skipped, not enqueued.
	SkipWhileUnfinished bool
	Every               time.Duration
	Cron                string
	Timezone            string
	Start               time.Time
	NextTick            time.Time
	LastTick            *time.Time
	LastTaskID          *int64
	// Skipped counts the ticks not enqueued: missed while no leader ran
	// (the missed-tick policy enqueues the latest only), or skipped while
	// the last tick's task was unfinished (SkipWhileUnfinished).
	Skipped   int64
	CreatedAt time.Time
}

const scheduleColumns = `id, name, kind, key, payload, coalesce(max_attempts, 0), queue, priority, coalesce(sequence_key, ''),
	sequence_blocks, skip_while_unfinished, coalesce(every_ms, 0), coalesce(cron, ''), timezone, start_at, next_tick, last_tick,
	last_task_id, skipped, created_at`

func scanSchedule(r pgx.CollectableRow) (Schedule, error) { return scanScheduleAnd(r) }

// scanScheduleAnd scans scheduleColumns, then the columns after them into
// more.
func scanScheduleAnd(r pgx.CollectableRow, more ...any) (Schedule, error) {
	var sc Schedule
	var everyMS int64
	var blocks bool
	t := &sc.Task
	err := r.Scan(append([]any{&sc.ID, &sc.Name, &t.Kind, &t.Key, &t.Payload, &t.MaxAttempts, &t.Queue, &t.Priority, &t.SequenceKey,
		&blocks, &sc.SkipWhileUnfinished, &everyMS, &sc.Cron, &sc.Timezone, &sc.Start, &sc.NextTick, &sc.LastTick, &sc.LastTaskID,
		&sc.Skipped, &sc.CreatedAt}, more...)...)
	t.SequenceContinue = t.SequenceKey != "" && !blocks
	sc.Every = time.Duration(everyMS) * time.Millisecond
	return sc, err
}

// CreateSchedule stores the schedule prepare returns for the database's
// time (its first tick is computed from now(), never from a process's
// clock) in one transaction, and returns the stored row, whose CreatedAt
// is that same time. ID, LastTick, LastTaskID, Skipped and CreatedAt of
// the prepared schedule are ignored. An error of prepare is returned as
// it is; ErrScheduleExists when the name is taken.
func (s *Store) CreateSchedule(ctx context.Context, prepare func(now time.Time) (Schedule, error)) (Schedule, error) {
	sc, _, err := s.putSchedule(ctx, prepare, false)
	return sc, err
}

// Upserted says what UpsertSchedule did.
type Upserted int

// What UpsertSchedule did.
const (
	// ScheduleUnchanged: the stored schedule was the same.
	ScheduleUnchanged Upserted = iota
	// ScheduleCreated: there was none of the name.
	ScheduleCreated
	// ScheduleUpdated: the stored schedule took the new definition.
	ScheduleUpdated
)

// UpsertSchedule is CreateSchedule for a schedule that may exist already
// (one declared in a program's configuration, stored at every start): the
// stored row takes the prepared task and timing, and keeps its next tick
// unless the timing (interval, start, cron, time zone) changed, so that a
// restart neither skips nor repeats a tick.
func (s *Store) UpsertSchedule(ctx context.Context, prepare func(now time.Time) (Schedule, error)) (Schedule, Upserted, error) {
	return s.putSchedule(ctx, prepare, true)
}

func (s *Store) putSchedule(ctx context.Context, prepare func(now time.Time) (Schedule, error), upsert bool) (Schedule, Upserted, error) {
	var sc Schedule
	var prepErr error
	what := ScheduleUnchanged
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var now time.Time
		if err := tx.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
			return err
		}
		if sc, prepErr = prepare(now); prepErr != nil {
			return prepErr
		}
		var every *int64
		if sc.Every > 0 {
			ms := sc.Every.Milliseconds()
			every = &ms
		}
		var cron, maxAttempts any
		if sc.Cron != "" {
			cron = sc.Cron
		}
		t := sc.Task
		if t.MaxAttempts > 0 {
			maxAttempts = t.MaxAttempts
		}
		payload := string(t.Payload)
		if payload == "" {
			payload = "{}"
		}
		conflict := ""
		if upsert {
			// The row is written only when something differs (xmax = 0 in
			// RETURNING: inserted; the WHERE false of an unchanged row
			// returns nothing, and the row is read after).
			conflict = `ON CONFLICT (name) DO UPDATE SET kind = excluded.kind, key = excluded.key, payload = excluded.payload,
				max_attempts = excluded.max_attempts, queue = excluded.queue, priority = excluded.priority,
				sequence_key = excluded.sequence_key, sequence_blocks = excluded.sequence_blocks,
				skip_while_unfinished = excluded.skip_while_unfinished,
				every_ms = excluded.every_ms, cron = excluded.cron, timezone = excluded.timezone, start_at = excluded.start_at,
				next_tick = CASE WHEN (s.every_ms, s.cron, s.timezone, s.start_at) IS NOT DISTINCT FROM
				                      (excluded.every_ms, excluded.cron, excluded.timezone, excluded.start_at)
				                 THEN s.next_tick ELSE excluded.next_tick END
			WHERE (s.kind, s.key, s.payload, s.max_attempts, s.queue, s.priority, s.sequence_key, s.sequence_blocks,
			       s.skip_while_unfinished, s.every_ms, s.cron, s.timezone, s.start_at)
			      IS DISTINCT FROM
			      (excluded.kind, excluded.key, excluded.payload, excluded.max_attempts, excluded.queue, excluded.priority,
			       excluded.sequence_key, excluded.sequence_blocks, excluded.skip_while_unfinished, excluded.every_ms,
			       excluded.cron, excluded.timezone, excluded.start_at)`
		}
		rows, err := tx.Query(ctx, `
			INSERT INTO schedules AS s (name, kind, key, payload, max_attempts, queue, priority, sequence_key, sequence_blocks,
				skip_while_unfinished, every_ms, cron, timezone, start_at, next_tick)
			VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
			`+conflict+`
			RETURNING `+scheduleColumns+`, s.xmax = 0`,
			sc.Name, t.Kind, t.Key, payload, maxAttempts, t.Queue, t.Priority, nullable(t.SequenceKey), t.SequenceKey != "" && !t.SequenceContinue,
			sc.SkipWhileUnfinished, every, cron, sc.Timezone, sc.Start, sc.NextTick)
		if err != nil {
			return err
		}
		var inserted bool
		got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Schedule, error) { return scanScheduleAnd(r, &inserted) })
		if err != nil {
			return err
		}
		if len(got) == 1 {
			sc, what = got[0], ScheduleUpdated
			if inserted {
				what = ScheduleCreated
			}
			return nil
		}
		rows, err = tx.Query(ctx, `SELECT `+scheduleColumns+` FROM schedules WHERE name = $1`, sc.Name)
		if err != nil {
			return err
		}
		sc, err = pgx.CollectExactlyOneRow(rows, scanSchedule)
		return err
	})
	var pgErr *pgconn.PgError
	switch {
	case prepErr != nil:
		return Schedule{}, 0, prepErr
	case errors.As(err, &pgErr) && pgErr.Code == "23505":
		return Schedule{}, 0, fmt.Errorf("creating schedule %q: %w", sc.Name, ErrScheduleExists)
	case err != nil:
		return Schedule{}, 0, fmt.Errorf("storing schedule %q: %w", sc.Name, err)
	}
	return sc, what, nil
}

// ListSchedules returns up to limit schedules by name, those named after
// after ("": from the first), walking the unique index on name.
func (s *Store) ListSchedules(ctx context.Context, after string, limit int) ([]Schedule, error) {
	return collect(ctx, s.pool, "listing schedules", scanSchedule, `SELECT `+scheduleColumns+` FROM schedules WHERE name > $1 ORDER BY name LIMIT $2`, after, limit)
}

// DeleteSchedule deletes the named schedule and reports whether it
// existed. Tasks it already enqueued stay.
func (s *Store) DeleteSchedule(ctx context.Context, name string) (bool, error) {
	tag, err := s.pool.Exec(ctx, `DELETE FROM schedules WHERE name = $1`, name)
	if err != nil {
		return false, fmt.Errorf("deleting schedule %q: %w", name, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Tick is one tick of a schedule to enqueue, with its task.
type Tick struct {
	At   time.Time
	Task Insert
}

// Due is a schedule whose next tick is due, as EnqueueTicks hands it to
// its plan.
type Due struct {
	Schedule
	// LastTaskUnfinished: the task of the schedule's last enqueued tick is
	// unfinished (ready, waiting or running). Read only for a schedule
	// that SkipWhileUnfinished, in the batch's transaction.
	LastTaskUnfinished bool
}

// TickPlan is what to do with one due schedule: enqueue Ticks (in order),
// move next_tick to Next, and count Skipped ticks not enqueued, of which
// SkippedUnfinished were skipped while the last tick's task was
// unfinished (the rest were missed while no leader ran).
type TickPlan struct {
	Ticks                      []Tick
	Next                       time.Time
	Skipped, SkippedUnfinished int64
}

// TickResult is what one EnqueueTicks batch did.
type TickResult struct {
	// Now is the database's time of the batch.
	Now time.Time
	// TermStart is when the leadership term began: the database's time
	// when the leader raised the coordinator fence to its epoch.
	TermStart time.Time
	// Schedules were due; Enqueued tasks were inserted; Duplicates were
	// refused by the unique (schedule, tick) index; Skipped were left out
	// by the plans, SkippedUnfinished of them while the last tick's task
	// was unfinished.
	Schedules, Enqueued, Duplicates, Skipped, SkippedUnfinished int
	// NextDue is the earliest next tick of any schedule after the batch
	// (zero when there are no schedules).
	NextDue time.Time
}

// EnqueueTicks runs one transaction under the leadership epoch
// (ErrNotLeader otherwise): it locks up to limit schedules whose next tick
// is due by the database clock, asks plan what to enqueue for each (given
// the database's now, the term's start, when the fence was raised to
// epoch, and, for a schedule that skips ticks while its last tick's task
// is unfinished, whether it is), inserts those tasks with their (schedule, tick) and
// moves each schedule's next_tick, all or nothing. The coordinator fence
// row stays locked FOR SHARE until the commit, so a new leader's fence
// raise waits for this transaction and sees its result.
func (s *Store) EnqueueTicks(ctx context.Context, epoch int64, limit int,
	plan func(d Due, now, termStart time.Time) (TickPlan, error)) (TickResult, error) {
	return s.enqueueTicks(ctx, epoch, limit, plan, nil)
}

// enqueueTicks is EnqueueTicks where the tasks of the ticks whose shard
// elsewhere gives another store (a router's other databases; nil: none)
// are inserted there, each database's in a transaction of its own under
// its coordinator fence, committed before this one: a tick whose batch
// is retried is refused there as here by the unique (schedule, tick)
// index.
func (s *Store) enqueueTicks(ctx context.Context, epoch int64, limit int,
	plan func(d Due, now, termStart time.Time) (TickPlan, error), elsewhere func(shard int) (string, *Store)) (TickResult, error) {
	var res TickResult
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var raised *time.Time
		if err := tx.QueryRow(ctx, `
			SELECT (SELECT raised_at FROM coordinator_fence WHERE id = 1 AND epoch = $1 FOR SHARE), now()`,
			epoch).Scan(&raised, &res.Now); err != nil {
			return err
		}
		if raised == nil {
			return ErrNotLeader
		}
		res.TermStart = *raised
		// A task's record says 'ready' from its insert until it finishes
		// (waiting and running included); a task retention deleted is
		// finished.
		rows, err := tx.Query(ctx, `SELECT `+scheduleColumns+`,
				s.skip_while_unfinished AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = s.last_task_id AND t.state = 'ready')
			FROM schedules s WHERE next_tick <= now() ORDER BY next_tick LIMIT $1 FOR UPDATE OF s SKIP LOCKED`, limit)
		if err != nil {
			return err
		}
		due, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Due, error) {
			var d Due
			var err error
			d.Schedule, err = scanScheduleAnd(r, &d.LastTaskUnfinished)
			return d, err
		})
		if err != nil {
			return err
		}
		res.Schedules = len(due)
		r, err := planTicks(due, plan, res.Now, res.TermStart)
		if err != nil {
			return err
		}
		res.Skipped, res.SkippedUnfinished = r.skippedTotal, r.unfinishedTotal
		if len(due) == 0 {
			return tx.QueryRow(ctx, `SELECT coalesce(min(next_tick), 'epoch') FROM schedules`).Scan(&res.NextDue)
		}
		inserted := map[int64]int64{} // schedule -> newest task id inserted
		local, remote := r.splitTicks(s, elsewhere)
		for _, p := range remote {
			n, err := p.st.insertTicksFenced(ctx, epoch, r, p.idx, inserted)
			if err != nil {
				return fmt.Errorf("database %s: %w", p.name, err)
			}
			res.Enqueued += n
		}
		if len(local) > 0 {
			n, err := insertTicks(ctx, tx, r, local, inserted)
			if err != nil {
				return err
			}
			res.Enqueued += n
		}
		res.Duplicates = len(r.tIDs) - res.Enqueued
		lastTask := r.lastTasks(inserted)
		_, err = tx.Exec(ctx, `
			UPDATE schedules s SET next_tick = u.next, skipped = s.skipped + u.skipped,
				last_tick = coalesce(u.last_tick, s.last_tick), last_task_id = coalesce(u.last_task, s.last_task_id)
			FROM unnest($1::bigint[], $2::timestamptz[], $3::timestamptz[], $4::bigint[], $5::bigint[])
				AS u(id, next, last_tick, last_task, skipped)
			WHERE s.id = u.id`, r.schedIDs, r.nexts, r.lastTicks, lastTask, r.skipped)
		if err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT coalesce(min(next_tick), 'epoch') FROM schedules`).Scan(&res.NextDue)
	})
	if errors.Is(err, ErrNotLeader) {
		return TickResult{}, ErrNotLeader
	}
	if err != nil {
		return TickResult{}, fmt.Errorf("enqueueing schedule ticks: %w", err)
	}
	if res.NextDue.Equal(time.Unix(0, 0)) {
		res.NextDue = time.Time{}
	}
	return res, nil
}

// splitTicks splits the indexes of r's ticks into those whose task goes
// to s itself and those elsewhere gives another store, by store.
func (r tickRows) splitTicks(s *Store, elsewhere func(shard int) (string, *Store)) (local []int, remote []part) {
	for i := range r.tIDs {
		if elsewhere != nil {
			if name, st := elsewhere(int(r.shards[i])); st != nil && st != s {
				k := slices.IndexFunc(remote, func(p part) bool { return p.st == st })
				if k < 0 {
					k = len(remote)
					remote = append(remote, part{name: name, st: st})
				}
				remote[k].idx = append(remote[k].idx, i)
				continue
			}
		}
		local = append(local, i)
	}
	return local, remote
}

// insertTicks inserts the tasks of r's ticks idx in q, each refused when
// its (schedule, tick) is there already, adds the ids inserted to
// inserted (schedule -> newest) and returns how many.
func insertTicks(ctx context.Context, q querier, r tickRows, idx []int, inserted map[int64]int64) (int, error) {
	sub := func(i int) int { return idx[i] }
	n := len(idx)
	kinds, keys, payloads, queues, seqKeys := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	shards, maxAttempts, priorities := make([]int32, n), make([]int32, n), make([]int32, n)
	sids, blocks, ticks := make([]int64, n), make([]bool, n), make([]time.Time, n)
	for j := range n {
		i := sub(j)
		kinds[j], keys[j], payloads[j], queues[j], seqKeys[j] = r.kinds[i], r.keys[i], r.payloads[i], r.queues[i], r.seqKeys[i]
		shards[j], maxAttempts[j], priorities[j] = r.shards[i], r.maxAttempts[i], r.priorities[i]
		sids[j], blocks[j], ticks[j] = r.tIDs[i], r.seqBlocks[i], r.tTicks[i]
	}
	rows, err := q.Query(ctx, `
		INSERT INTO tasks (kind, shard, key, payload, max_attempts, run_after, schedule_id, schedule_tick,
			queue, priority, sequence_key, sequence_blocks)
		SELECT kind, shard, key, payload::jsonb, max_attempts, tick, sid, tick, queue, priority, nullif(seq, ''),
			CASE WHEN seq <> '' THEN blocks END
		FROM unnest($1::text[], $2::int[], $3::text[], $4::text[], $5::int[], $6::bigint[], $7::timestamptz[],
			$8::text[], $9::int[], $10::text[], $11::boolean[])
			AS u(kind, shard, key, payload, max_attempts, sid, tick, queue, priority, seq, blocks)
		ON CONFLICT (schedule_id, schedule_tick) WHERE schedule_id IS NOT NULL DO NOTHING
		RETURNING id, schedule_id`, kinds, shards, keys, payloads, maxAttempts, sids, ticks,
		queues, priorities, seqKeys, blocks)
	if err != nil {
		return 0, err
	}
	count := 0
	var id, sid int64
	if _, err := pgx.ForEachRow(rows, []any{&id, &sid}, func() error {
		count++
		inserted[sid] = max(inserted[sid], id)
		return nil
	}); err != nil {
		return 0, err
	}
	return count, nil
}

// insertTicksFenced is insertTicks in a transaction of s's own under its
// coordinator fence at epoch (ErrNotLeader otherwise).
func (s *Store) insertTicksFenced(ctx context.Context, epoch int64, r tickRows, idx []int, inserted map[int64]int64) (int, error) {
	var n int
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var fenced bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM coordinator_fence WHERE id = 1 AND epoch = $1 FOR SHARE)`, epoch).Scan(&fenced); err != nil {
			return err
		}
		if !fenced {
			return ErrNotLeader
		}
		mine := map[int64]int64{}
		var err error
		if n, err = insertTicks(ctx, tx, r, idx, mine); err != nil {
			return err
		}
		for sid, id := range mine {
			inserted[sid] = max(inserted[sid], id)
		}
		return nil
	})
	return n, err
}

// tickRows are the planned ticks of one batch of due schedules, as the
// arrays of the batch's two statements: per schedule its next tick, last
// tick and skipped count; per tick its schedule, time and task.
type tickRows struct {
	schedIDs              []int64
	nexts                 []time.Time
	lastTicks             []*time.Time
	skipped               []int64
	skippedTotal          int
	unfinishedTotal       int
	tIDs                  []int64
	tTicks                []time.Time
	kinds, keys, payloads []string
	shards, maxAttempts   []int32
	queues, seqKeys       []string
	priorities            []int32
	seqBlocks             []bool
}

// planTicks applies plan to each due schedule.
func planTicks(due []Due, plan func(d Due, now, termStart time.Time) (TickPlan, error), now, termStart time.Time) (tickRows, error) {
	r := tickRows{schedIDs: make([]int64, 0, len(due)), nexts: make([]time.Time, 0, len(due)),
		lastTicks: make([]*time.Time, 0, len(due)), skipped: make([]int64, 0, len(due))}
	for _, d := range due {
		sc := d.Schedule
		p, err := plan(d, now, termStart)
		if err != nil {
			return r, fmt.Errorf("planning the ticks of schedule %q: %w", sc.Name, err)
		}
		if !p.Next.After(sc.NextTick) {
			return r, fmt.Errorf("planning the ticks of schedule %q: next tick %s does not move past %s", sc.Name, p.Next, sc.NextTick)
		}
		var last *time.Time
		for _, t := range p.Ticks {
			at := t.At
			last = &at
			r.tIDs, r.tTicks = append(r.tIDs, sc.ID), append(r.tTicks, t.At)
			r.kinds, r.keys, r.payloads = append(r.kinds, t.Task.Kind), append(r.keys, t.Task.Key), append(r.payloads, string(t.Task.Payload))
			r.shards, r.maxAttempts = append(r.shards, int32(t.Task.Shard)), append(r.maxAttempts, int32(t.Task.MaxAttempts))
			r.queues, r.priorities = append(r.queues, t.Task.Queue), append(r.priorities, int32(t.Task.Priority))
			r.seqKeys, r.seqBlocks = append(r.seqKeys, t.Task.SequenceKey), append(r.seqBlocks, !t.Task.SequenceContinue)
		}
		r.schedIDs, r.nexts, r.lastTicks, r.skipped = append(r.schedIDs, sc.ID), append(r.nexts, p.Next), append(r.lastTicks, last), append(r.skipped, p.Skipped)
		r.skippedTotal += int(p.Skipped)
		r.unfinishedTotal += int(p.SkippedUnfinished)
	}
	return r, nil
}

// lastTasks is, per schedule of r, the newest task id inserted for it
// (nil: none).
func (r tickRows) lastTasks(inserted map[int64]int64) []*int64 {
	last := make([]*int64, len(r.schedIDs))
	for i, sid := range r.schedIDs {
		if id, ok := inserted[sid]; ok {
			last[i] = &id
		}
	}
	return last
}
