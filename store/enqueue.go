package store

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

// The producer side: inserting tasks, one by one, by COPY, idempotently by
// unique key, and inside the producer's own transaction.
//
// A task with a unique key first registers the key in task_unique_keys
// (one row per key an unfinished task holds) with ON CONFLICT DO NOTHING,
// under the id the task is then inserted with, in the same statement.
// PostgreSQL makes a second inserter of the same key wait for the first
// one's transaction and then skip its row, so concurrent producers create
// one task; the skipped ones then read the id of the task that holds the
// key. If that task finished in between (the key is free again) the insert
// is simply tried again. The insert trigger files every inserted task into
// its lane of task_ready.

// Insert is a task ready for the store, as client.Config.Prepare makes
// it: the task checked (tasks.NewTask.Check), its options with their
// defaults (tasks.Options.WithDefaults), a key, a payload, and the shard
// of its key (of its sequence key, in a sequence). A zero RunAfter is the
// database's now(), a zero Deadline none.
type Insert struct {
	tasks.NewTask
	Shard int
	// TraceContext is the W3C trace context of the enqueue span
	// (internal/tracing.Inject), stored so that the runner's spans join
	// the producer's trace; empty (NULL, nothing written) with tracing off.
	TraceContext string
}

// querier is where a statement runs: the pool, or a producer's or
// handler's own transaction.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, rows pgx.CopyFromSource) (int64, error)
}

// uniqueTries bounds the insert-or-find rounds of a unique key: each round
// that finds neither a slot nor a holder saw the holder finish in between,
// which needs a task to finish within a few milliseconds, repeatedly.
const uniqueTries = 8

// errHolderInvisible: the insert met a holder of the unique key that the
// lookup could not see. Under READ COMMITTED that cannot persist; under a
// producer's REPEATABLE READ or SERIALIZABLE transaction it does.
var errHolderInvisible = errors.New("another transaction holds the unique key but its task is not visible to this one; " +
	"enqueue with a unique key inside READ COMMITTED transactions, or retry the transaction")

// Enqueue inserts one task and returns its id. A task whose unique key an
// unfinished task holds is not inserted: that task's id is returned.
func (s *Store) Enqueue(ctx context.Context, in Insert) (int64, error) {
	e, err := s.EnqueueIn(ctx, nil, in)
	return e.ID, err
}

// EnqueueIn inserts one task inside tx, the producer's own transaction, so
// that the task commits or rolls back with the producer's other writes; the
// runners are notified only when tx commits (NOTIFY is transactional). A nil
// tx runs on the pool. With a unique key an unfinished task holds, nothing is
// inserted and that task's id is returned with Duplicate set.
func (s *Store) EnqueueIn(ctx context.Context, tx pgx.Tx, in Insert) (tasks.Enqueued, error) {
	var q querier = s.pool
	// In the producer's transaction the trigger notifies at its commit;
	// on the pool too when the insert takes the commit slot, else it is
	// quiet and notified after its commit (see notify.go).
	quiet, afterCommit := "", false
	if tx != nil {
		q = tx
		if err := s.registerQueues(ctx, []Insert{in}); err != nil {
			return tasks.Enqueued{}, err
		}
	} else if s.notify.takeSlot() {
		defer s.notify.releaseSlot()
	} else {
		quiet, afterCommit = " WHERE "+quietSetting+" = 'off'", true
	}
	cols := `kind, shard, key, payload, max_attempts, run_after, deadline, unique_key, queue, priority, sequence_key, sequence_blocks`
	vals := `$1::text, $2::int, $3::text, $4::jsonb, $5::int, coalesce($6::timestamptz, now()), $7::timestamptz, $8::text,
		$9::text, $10::smallint, $11::text, $12::boolean`
	args := []any{in.Kind, in.Shard, in.Key, string(in.Payload), in.MaxAttempts, nullTime(in.RunAfter), nullTime(in.Deadline), nil,
		in.Queue, int16(in.Priority), nullable(in.SequenceKey), sequenceBlocks(in)}
	if in.TraceContext != "" {
		// Only a traced enqueue names the column: with tracing off the
		// statement is the one it always was.
		cols += `, trace_context`
		vals += `, $13::text`
		args = append(args, in.TraceContext)
	}
	done := func(id int64) (tasks.Enqueued, error) {
		if afterCommit {
			s.notifyReady([]Insert{in}, func(int) bool { return true })
		}
		return tasks.Enqueued{ID: id}, nil
	}
	if in.UniqueKey == "" {
		var id int64
		if err := q.QueryRow(ctx, `/* shardrun.enqueue */
			INSERT INTO tasks (`+cols+`) SELECT `+vals+quiet+` RETURNING id`, args...).Scan(&id); err != nil {
			return tasks.Enqueued{}, fmt.Errorf("enqueueing task of kind %q: %w", in.Kind, err)
		}
		return done(id)
	}
	args[7] = in.UniqueKey
	for range uniqueTries {
		var id int64
		err := q.QueryRow(ctx, `/* shardrun.enqueue_unique */
			WITH k AS (
				INSERT INTO task_unique_keys (unique_key, id)
				VALUES ($8::text, nextval(pg_get_serial_sequence('tasks', 'id')))
				ON CONFLICT (unique_key) DO NOTHING
				RETURNING id
			)
			INSERT INTO tasks (id, `+cols+`) OVERRIDING SYSTEM VALUE
			SELECT k.id, `+vals+` FROM k`+quiet+` RETURNING id`, args...).Scan(&id)
		if err == nil {
			return done(id)
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return tasks.Enqueued{}, fmt.Errorf("enqueueing task of kind %q with unique key %q: %w", in.Kind, in.UniqueKey, err)
		}
		holders, err := uniqueHolders(ctx, q, []string{in.UniqueKey})
		if err != nil {
			return tasks.Enqueued{}, fmt.Errorf("enqueueing task of kind %q with unique key %q: %w", in.Kind, in.UniqueKey, err)
		}
		if id, ok := holders[in.UniqueKey]; ok {
			return tasks.Enqueued{ID: id, Duplicate: true}, nil
		}
	}
	return tasks.Enqueued{}, fmt.Errorf("enqueueing task of kind %q with unique key %q: %w", in.Kind, in.UniqueKey, errHolderInvisible)
}

// sequenceBlocks is the sequence_blocks of an insert: NULL outside a
// sequence.
func sequenceBlocks(in Insert) *bool {
	if in.SequenceKey == "" {
		return nil
	}
	blocks := !in.SequenceContinue
	return &blocks
}

// nullTime is t, or NULL when zero.
func nullTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// nullable is s, or NULL when empty.
func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// uniqueHolders returns the ids of the unfinished tasks holding keys.
func uniqueHolders(ctx context.Context, q querier, keys []string) (map[string]int64, error) {
	rows, err := q.Query(ctx, `/* shardrun.unique_holders */
		SELECT unique_key, id FROM task_unique_keys WHERE unique_key = ANY ($1::text[])`, keys)
	if err != nil {
		return nil, fmt.Errorf("finding the tasks that hold %d unique keys: %w", len(keys), err)
	}
	holders := make(map[string]int64, len(keys))
	var key string
	var id int64
	_, err = pgx.ForEachRow(rows, []any{&key, &id}, func() error {
		holders[key] = id
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("finding the tasks that hold %d unique keys: %w", len(keys), err)
	}
	return holders, nil
}

// EnqueueBatch inserts many tasks in one transaction and returns how many
// it inserted (tasks whose unique key an unfinished task holds are not).
// Tasks without RunAfter get the database's now().
func (s *Store) EnqueueBatch(ctx context.Context, ins []Insert) (int64, error) {
	r, err := s.EnqueueBatchIn(ctx, nil, ins)
	return r.Inserted, err
}

// EnqueueBatchIn inserts many tasks inside tx, the producer's own
// transaction (nil: a transaction of its own). A batch without unique keys
// goes by COPY, the fastest path, and reports only its count. A batch with
// any unique key (or whose sequences mix tasks with and without a
// run_after) goes by one INSERT … SELECT FROM unnest … ON CONFLICT DO
// NOTHING (COPY has no ON CONFLICT) and reports every task's id in order,
// the duplicates marked; a unique key given twice in one batch creates one
// task, and the second entry is its duplicate.
func (s *Store) EnqueueBatchIn(ctx context.Context, tx pgx.Tx, ins []Insert) (tasks.BatchEnqueued, error) {
	return s.enqueueBatchIn(ctx, tx, ins, false)
}

// enqueueBatchIn is EnqueueBatchIn; ordered sends the batch by the ordered
// insert whatever it holds (the router's part of a batch that reports
// every task's id).
func (s *Store) enqueueBatchIn(ctx context.Context, tx pgx.Tx, ins []Insert, ordered bool) (tasks.BatchEnqueued, error) {
	if len(ins) == 0 {
		return tasks.BatchEnqueued{}, nil
	}
	ordered = ordered || insertsInOrder(ins)
	var res tasks.BatchEnqueued
	run := func(q querier) error {
		var err error
		if ordered {
			res, err = insertOrdered(ctx, q, ins)
		} else {
			res.Inserted, err = copyTasks(ctx, q, ins)
		}
		return err
	}
	var err error
	if tx != nil {
		if err := s.registerQueues(ctx, ins); err != nil {
			return tasks.BatchEnqueued{}, err
		}
		err = run(tx)
	} else {
		// Notified at the commit when the batch takes the commit slot,
		// else quiet and notified after the commit (see notify.go).
		inTx := s.notify.takeSlot()
		err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if !inTx {
				if _, err := tx.Exec(ctx, `SELECT `+quietSetting); err != nil {
					return err
				}
			}
			return run(tx)
		})
		if inTx {
			s.notify.releaseSlot()
		} else if err == nil {
			s.notifyReady(ins, func(i int) bool { return !ordered || !res.Tasks[i].Duplicate })
		}
	}
	if err != nil {
		how := "COPY"
		if ordered {
			how = "ordered insert"
		}
		return tasks.BatchEnqueued{}, fmt.Errorf("enqueueing %d tasks (%s): %w", len(ins), how, err)
	}
	return res, nil
}

// insertsInOrder reports whether a batch goes by the ordered insert (and
// reports every task's id): it has a unique key, or sequences that mix
// tasks with and without a run_after. COPY goes in two parts (tasks that
// start now, then those with a run_after: COPY cannot default a column
// row by row), so such a batch would be reordered by it: ids decide a
// sequence's order.
func insertsInOrder(ins []Insert) bool {
	unique, sequenced, now, later := false, false, false, false
	for _, in := range ins {
		unique = unique || in.UniqueKey != ""
		sequenced = sequenced || in.SequenceKey != ""
		now, later = now || in.RunAfter.IsZero(), later || !in.RunAfter.IsZero()
	}
	return unique || sequenced && now && later
}

// copyTasks inserts tasks with COPY: one COPY for those that start now and
// one for those with a RunAfter. The trace_context column is copied only
// when some task of the batch has one (tracing on).
func copyTasks(ctx context.Context, q querier, ins []Insert) (int64, error) {
	traced := false
	for _, in := range ins {
		traced = traced || in.TraceContext != ""
	}
	var now, later [][]any
	for _, in := range ins {
		row := []any{in.Kind, int32(in.Shard), in.Key, string(in.Payload), int32(in.MaxAttempts), nullTime(in.Deadline),
			in.Queue, int16(in.Priority), nullable(in.SequenceKey), sequenceBlocks(in)}
		if traced {
			row = append(row, nullable(in.TraceContext))
		}
		if in.RunAfter.IsZero() {
			now = append(now, row)
		} else {
			later = append(later, append(row, in.RunAfter))
		}
	}
	cols := []string{"kind", "shard", "key", "payload", "max_attempts", "deadline", "queue", "priority", "sequence_key", "sequence_blocks"}
	if traced {
		cols = append(cols, "trace_context")
	}
	var total int64
	if len(now) > 0 {
		n, err := q.CopyFrom(ctx, pgx.Identifier{"tasks"}, cols, pgx.CopyFromRows(now))
		if err != nil {
			return 0, err
		}
		total += n
	}
	if len(later) > 0 {
		n, err := q.CopyFrom(ctx, pgx.Identifier{"tasks"}, append(cols, "run_after"), pgx.CopyFromRows(later))
		if err != nil {
			return 0, err
		}
		total += n
	}
	return total, nil
}

// insertOrdered inserts a batch in its order (ids follow the input), with
// or without unique keys. The ids are drawn from the table's identity
// sequence before the insert, so that each input row's id is known whether
// or not it was inserted (RETURNING cannot name the input row), then the
// holders of the keys not inserted are looked up. Keys whose holder
// finished in between are inserted again, in the next round, under the
// ids drawn for them in the first: a later round must not put a task after
// the ones that followed it in the batch (a sequence's order is its ids').
func insertOrdered(ctx context.Context, q querier, ins []Insert) (tasks.BatchEnqueued, error) {
	res := tasks.BatchEnqueued{Tasks: make([]tasks.Enqueued, len(ins))}
	todo := make([]int, len(ins)) // indexes of ins still to insert
	for i := range todo {
		todo[i] = i
	}
	drawn := make([]*int64, len(ins)) // the id drawn for each task in the first round
	for range uniqueTries {
		rows, err := q.Query(ctx, `/* shardrun.enqueue_batch_unique */
			WITH u AS MATERIALIZED (
				SELECT coalesce(x.drawn, nextval(pg_get_serial_sequence('tasks', 'id'))) AS id, x.*
				FROM unnest($1::text[], $2::int[], $3::text[], $4::text[], $5::int[], $6::timestamptz[], $7::timestamptz[], $8::text[],
						$9::text[], $10::smallint[], $11::text[], $12::boolean[], $13::text[], $14::bigint[])
					WITH ORDINALITY AS x(kind, shard, key, payload, max_attempts, run_after, deadline, unique_key,
						queue, priority, sequence_key, sequence_blocks, trace_context, drawn, n)
			), k AS (
				INSERT INTO task_unique_keys (unique_key, id)
				SELECT unique_key, id FROM u WHERE unique_key IS NOT NULL ORDER BY unique_key, n
				ON CONFLICT (unique_key) DO NOTHING
				RETURNING id
			), ins AS (
				INSERT INTO tasks (id, kind, shard, key, payload, max_attempts, run_after, deadline, unique_key,
					queue, priority, sequence_key, sequence_blocks, trace_context)
				OVERRIDING SYSTEM VALUE
				SELECT id, kind, shard, key, payload::jsonb, max_attempts, coalesce(run_after, now()), deadline, unique_key,
					queue, priority, sequence_key, sequence_blocks, trace_context
				FROM u WHERE unique_key IS NULL OR id = ANY (ARRAY(SELECT id FROM k))
				ORDER BY n
				RETURNING id
			)
			SELECT u.id, ins.id IS NOT NULL FROM u LEFT JOIN ins ON ins.id = u.id ORDER BY u.n`,
			uniqueArgs(ins, todo, drawn)...)
		if err != nil {
			return tasks.BatchEnqueued{}, err
		}
		var missed []int
		var missedKeys []string
		j := 0
		var id int64
		var inserted bool
		_, err = pgx.ForEachRow(rows, []any{&id, &inserted}, func() error {
			i := todo[j]
			j++
			v := id
			drawn[i] = &v
			if inserted {
				res.Tasks[i] = tasks.Enqueued{ID: id}
				res.Inserted++
				return nil
			}
			missed = append(missed, i)
			missedKeys = append(missedKeys, ins[i].UniqueKey)
			return nil
		})
		if err != nil {
			return tasks.BatchEnqueued{}, err
		}
		if len(missed) == 0 {
			return res, nil
		}
		holders, err := uniqueHolders(ctx, q, missedKeys)
		if err != nil {
			return tasks.BatchEnqueued{}, err
		}
		todo = todo[:0]
		for _, i := range missed {
			if id, ok := holders[ins[i].UniqueKey]; ok {
				res.Tasks[i] = tasks.Enqueued{ID: id, Duplicate: true}
				res.Duplicates++
			} else {
				todo = append(todo, i)
			}
		}
		if len(todo) == 0 {
			return res, nil
		}
	}
	return tasks.BatchEnqueued{}, errHolderInvisible
}

// uniqueArgs are the arrays of insertOrdered's statement for the tasks
// ins[todo]: kinds, shards, keys, payloads, max_attempts, run_after,
// deadlines, unique keys, queues, priorities, sequence keys and blocks, trace
// contexts (NULL with tracing off), and the ids drawn for them in an
// earlier round (NULL: draw one).
func uniqueArgs(ins []Insert, todo []int, drawn []*int64) []any {
	n := len(todo)
	kinds, keys, payloads, queues := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	shards, maxAttempts := make([]int32, n), make([]int32, n)
	priorities := make([]int16, n)
	runAfters, deadlines := make([]*time.Time, n), make([]*time.Time, n)
	uniqueKeys, sequenceKeys := make([]*string, n), make([]*string, n)
	blocks := make([]*bool, n)
	ids := make([]*int64, n)
	// NULL, not an array of NULLs, when no task is traced: unnest pads
	// a shorter (or NULL) array with NULLs.
	var traceContexts []*string
	for _, i := range todo {
		if ins[i].TraceContext != "" {
			traceContexts = make([]*string, n)
			break
		}
	}
	for j, i := range todo {
		in := ins[i]
		kinds[j], shards[j], keys[j], payloads[j], maxAttempts[j] = in.Kind, int32(in.Shard), in.Key, string(in.Payload), int32(in.MaxAttempts)
		runAfters[j], deadlines[j] = nullTime(in.RunAfter), nullTime(in.Deadline)
		uniqueKeys[j], sequenceKeys[j] = nullable(in.UniqueKey), nullable(in.SequenceKey)
		queues[j], priorities[j], blocks[j] = in.Queue, int16(in.Priority), sequenceBlocks(in)
		if traceContexts != nil {
			traceContexts[j] = nullable(in.TraceContext)
		}
		ids[j] = drawn[i]
	}
	return []any{kinds, shards, keys, payloads, maxAttempts, runAfters, deadlines, uniqueKeys, queues, priorities, sequenceKeys, blocks, traceContexts, ids}
}

// registerQueues gives the queues of ins their rows (queues) before a
// producer's own transaction inserts tasks in them, in a statement of the
// store's own that commits at once. The insert trigger files a queue's row
// when its transaction cannot see one (shardrun_register_queues), and a new
// row is held by its transaction until it ends: every other producer of
// that queue would wait for the producer's transaction, however long it
// stays open. Queues known to have a row are not asked again.
//
// The statement itself waits for no transaction: a row another open
// transaction is inserting (after an operator removed the queue a moment
// before; possibly the very transaction this enqueue belongs to, which
// would then wait for this statement forever) makes it give up at once,
// and the insert trigger files the row in the producer's transaction.
func (s *Store) registerQueues(ctx context.Context, ins []Insert) error {
	var names []string
	for _, in := range ins {
		q := in.Queue
		if _, known := s.queues.Load(q); !known && q != tasks.DefaultQueue && !slices.Contains(names, q) {
			names = append(names, q)
		}
	}
	if len(names) == 0 {
		return nil
	}
	slices.Sort(names)
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '50ms'`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `/* shardrun.register_queues */
			INSERT INTO queues (name) SELECT n FROM unnest($1::text[]) n ORDER BY n ON CONFLICT (name) DO NOTHING`, names)
		return err
	})
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "55P03" {
		return nil // an open transaction is inserting one of the rows
	}
	if err != nil {
		return fmt.Errorf("registering queues %v: %w", names, err)
	}
	for _, q := range names {
		s.queues.Store(q, true)
	}
	return nil
}
