package store

// Operators' statements: cancel, retry, list and count tasks.
//
// None of them is made under a claim, so none is fenced by a shard epoch;
// each re-checks the state it acts on in its WHERE clause. Cancelling a
// ready task moves a row nobody has claimed (a claim that got there first
// makes it running, and the statement, re-evaluated on the new row version,
// then records a cancel request instead). Cancelling a running task only
// records the request (cancel_requested_at): the state, attempt and claim
// of a running task change only by the fenced writes of the runner that
// runs it (CancelAttempts), by the leader's sweeps and by the next owner's
// orphan requeue, each of which turns a requested cancel into cancelled.
//
// Listing and bulk operations walk one ordered stream of candidate ids from
// the index that matches the filter best (see stream) and apply the rest of
// the filter to the rows they fetch by primary key, examining a bounded
// number of candidates per statement. Each stream orders by every column of
// its index, so no plan but a walk of that index can produce the order
// without sorting the whole match: the plans do not depend on statistics.

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

	"github.com/shardrun/shardrun/tasks"
)

// Bounds of the operators' statements.
const (
	// ListScan bounds the candidate rows one listing statement examines
	// when part of the filter is applied to fetched rows: about 80ms on two
	// cores when all of them must be fetched from a table of 10 million.
	ListScan = 10_000
	// BulkBatch bounds the candidates one bulk cancel or retry statement
	// examines, and so the rows it locks.
	BulkBatch = 1000
	// bulkPasses bounds how often one batch is tried again because some of
	// its rows were locked by a runner's write at that instant.
	bulkPasses = 100
)

// CancelTask cancels task id: a ready task at once (state cancelled), a
// running one by recording the request that its runner's next heartbeat
// picks up; the task is returned as it is after the statement (ready ->
// cancelled, running with CancelRequestedAt set). Cancelling a running task
// twice is harmless. A finished task gives a *tasks.ConflictError naming its
// state, a missing one a *tasks.NotFoundError.
func (s *Store) CancelTask(ctx context.Context, id int64) (tasks.Task, error) {
	t, err := scanTask(s.pool.QueryRow(ctx, `
		UPDATE tasks t SET `+cancelSet+`
		WHERE t.id = $1 AND t.state IN ('ready', 'running')
		RETURNING `+taskColumns, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return tasks.Task{}, s.refusal(ctx, id, "cancel", "it is finished")
	}
	if err != nil {
		return tasks.Task{}, fmt.Errorf("cancelling task %d: %w", id, err)
	}
	return t, nil
}

// cancelSet is the SET list of a cancel: ready tasks end now, running ones
// get the request (the first request's time is kept).
const cancelSet = `
		state               = CASE WHEN t.state = 'ready' THEN 'cancelled' ELSE t.state END,
		finished_at         = CASE WHEN t.state = 'ready' THEN now() ELSE t.finished_at END,
		cancel_requested_at = coalesce(t.cancel_requested_at, now())`

// retrySet is the SET list of a retry. The attempt number moves on (it only
// ever grows, so that a late write of an earlier attempt can never match
// the new one) and the task gets as many further attempts as it was
// enqueued with: attempt_budget records max_attempts at the first retry.
// A deadline that has passed is dropped, since it would fail the task
// again at once; the history (errors) is kept.
const retrySet = `
		state               = 'ready',
		attempt             = t.attempt + 1,
		attempt_budget      = coalesce(t.attempt_budget, t.max_attempts),
		max_attempts        = t.attempt + coalesce(t.attempt_budget, t.max_attempts),
		run_after           = now(),
		deadline            = CASE WHEN t.deadline <= now() THEN NULL ELSE t.deadline END,
		finished_at         = NULL,
		claimed_by          = NULL,
		claim_epoch         = NULL,
		claimed_at          = NULL,
		heartbeat_at        = NULL,
		cancel_requested_at = NULL,
		result              = NULL`

// RetryTask puts a dead, failed or cancelled task back to ready (see
// retrySet for the attempt budget) and wakes the runners of its shard. A
// task in another state, or whose unique key another unfinished task holds
// now, gives a *tasks.ConflictError; a missing one a *tasks.NotFoundError.
func (s *Store) RetryTask(ctx context.Context, id int64) (tasks.Task, error) {
	var t tasks.Task
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var err error
		t, err = scanTask(tx.QueryRow(ctx, `
			UPDATE tasks t SET `+retrySet+`
			WHERE t.id = $1 AND t.state IN ('failed', 'dead', 'cancelled')
			RETURNING `+taskColumns, id))
		if err != nil {
			return err
		}
		return notifyShards(ctx, tx, []int{t.Shard})
	})
	var pe *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return tasks.Task{}, s.refusal(ctx, id, "retry", "only dead, failed and cancelled tasks can be retried")
	case errors.As(err, &pe) && pe.Code == "23505" && pe.ConstraintName == "tasks_unique_key_idx":
		cur, gerr := s.Get(ctx, id)
		if gerr != nil {
			return tasks.Task{}, fmt.Errorf("retrying task %d: %w", id, gerr)
		}
		holders, herr := uniqueHolders(ctx, s.pool, []string{cur.UniqueKey})
		if herr != nil {
			return tasks.Task{}, fmt.Errorf("retrying task %d: %w", id, herr)
		}
		return tasks.Task{}, &tasks.ConflictError{ID: id, Op: "retry", State: cur.State,
			Reason: fmt.Sprintf("its unique key %q is held by unfinished task %d", cur.UniqueKey, holders[cur.UniqueKey])}
	case err != nil:
		return tasks.Task{}, fmt.Errorf("retrying task %d: %w", id, err)
	}
	return t, nil
}

// refusal explains why an operation on task id changed nothing: it does not
// exist, or its state does not allow the operation.
func (s *Store) refusal(ctx context.Context, id int64, op, why string) error {
	t, err := s.Get(ctx, id)
	if err != nil {
		return fmt.Errorf("%s task %d: %w", op, id, err)
	}
	return &tasks.ConflictError{ID: id, Op: op, State: t.State, Reason: why}
}

// notifyShards wakes the runners of shards, as the insert trigger does:
// NOTIFY is sent when tx commits.
func notifyShards(ctx context.Context, tx pgx.Tx, shards []int) error {
	if len(shards) == 0 {
		return nil
	}
	slices.Sort(shards)
	shards = slices.Compact(shards)
	parts := make([]string, len(shards))
	for i, s := range shards {
		parts[i] = strconv.Itoa(s)
	}
	payload := strings.Join(parts, ",")
	if len(payload) > 7000 { // the trigger's limit: NOTIFY payloads are bounded
		payload = "*"
	}
	if _, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, NotifyChannel, payload); err != nil {
		return fmt.Errorf("notifying runners: %w", err)
	}
	return nil
}

// sqlBuilder collects positional arguments.
type sqlBuilder struct {
	args []any
	// streamArgs is how many of args the last stream's SQL uses: those of
	// its rest predicate come after them.
	streamArgs int
}

func (b *sqlBuilder) arg(v any) string {
	b.args = append(b.args, v)
	return "$" + strconv.Itoa(len(b.args))
}

// stream returns the SQL of an ordered stream of at most n candidate ids
// (column id) of tasks matching the driving part of f, after the cursor
// (below it when desc), and the predicate over alias t of the rest of f,
// which callers apply to the rows they fetch.
//
// The driving index, by precedence: tasks_key_id_idx for a key (keys are
// the most selective); tasks_kind_state_id_idx for a kind, one range per
// state merged in id order (a Merge Append of index walks); tasks_state_id_idx
// for states, likewise; the primary key otherwise.
func (b *sqlBuilder) stream(f tasks.Filter, after int64, desc bool, n int) (stream, rest string) {
	states := f.States
	dir, cmp := "", ">"
	if desc {
		dir, cmp = " DESC", "<"
	}
	cursor := ""
	if after > 0 {
		cursor = " AND id " + cmp + " " + b.arg(after)
	}
	limit := " LIMIT " + strconv.Itoa(n)
	restArgs := 0
	defer func() { b.streamArgs = len(b.args) - restArgs }()
	var restParts []string
	restArg := func(v any) string { restArgs++; return b.arg(v) }
	// The driving values are hidden from the planner in sub-selects, and
	// compared as arrays on the index's first column. A value the planner
	// sees would let it prove a partial index's predicate (state = 'ready'
	// matches tasks_ready_idx, ordered by kind and run_after) and prefer it, with a
	// sort of every match, when stale statistics call the state rare. And
	// a column equated to a value drops out of the ORDER BY, after which
	// the primary key yields the same order; an array comparison on the
	// first column keeps the ORDER BY whole, and only this index produces
	// it without reading and sorting every match.
	first := func(col, v string) string {
		return col + " = ANY ((SELECT " + b.arg([]string{v}) + "::text[])::text[])"
	}
	hidden := func(v string) string { return "(SELECT " + b.arg(v) + "::text)" }
	union := func(drive func(st tasks.State) string, order string) string {
		parts := make([]string, len(states))
		for i, st := range states {
			parts[i] = "SELECT id FROM tasks WHERE " + drive(st) + cursor + " ORDER BY " + order + limit
		}
		if len(parts) == 1 {
			return parts[0]
		}
		return "SELECT id FROM ((" + strings.Join(parts, ") UNION ALL (") + ")) u ORDER BY id" + dir + limit
	}
	switch {
	case f.Key != "":
		stream = "SELECT id FROM tasks WHERE " + first("key", f.Key) + cursor + " ORDER BY key" + dir + ", id" + dir + limit
		if len(states) > 0 {
			restParts = append(restParts, "t.state = ANY ("+restArg(stateStrings(states))+"::text[])")
		}
		if f.Kind != "" {
			restParts = append(restParts, "t.kind = "+restArg(f.Kind))
		}
	case f.Kind != "":
		if len(states) == 0 {
			states = tasks.States
		}
		kind := first("kind", f.Kind)
		stream = union(func(st tasks.State) string { return kind + " AND state = " + hidden(string(st)) },
			"kind"+dir+", state"+dir+", id"+dir)
	case len(states) > 0:
		stream = union(func(st tasks.State) string { return first("state", string(st)) }, "state"+dir+", id"+dir)
	default:
		stream = "SELECT id FROM tasks WHERE true" + cursor + " ORDER BY id" + dir + limit
	}
	if f.Shard != nil {
		restParts = append(restParts, "t.shard = "+restArg(*f.Shard))
	}
	if !f.CreatedBefore.IsZero() {
		restParts = append(restParts, "t.created_at < "+restArg(f.CreatedBefore))
	}
	return stream, strings.Join(restParts, " AND ")
}

func stateStrings(states []tasks.State) []string {
	out := make([]string, len(states))
	for i, s := range states {
		out[i] = string(s)
	}
	return out
}

// summaryColumns are the columns of a tasks.Summary, as scanSummary reads
// them.
const summaryColumns = `t.id, t.kind, t.shard, t.key, t.unique_key, t.state, t.attempt, t.max_attempts, t.run_after,
	t.deadline, t.claimed_by, t.claimed_at, t.heartbeat_at, t.cancel_requested_at, t.errors -> -1 ->> 'error',
	t.created_at, t.finished_at`

func scanSummary(r pgx.CollectableRow) (tasks.Summary, error) {
	var t tasks.Summary
	var state string
	var uniqueKey, claimedBy, lastError *string
	err := r.Scan(&t.ID, &t.Kind, &t.Shard, &t.Key, &uniqueKey, &state, &t.Attempt, &t.MaxAttempts, &t.RunAfter,
		&t.Deadline, &claimedBy, &t.ClaimedAt, &t.HeartbeatAt, &t.CancelRequestedAt, &lastError, &t.CreatedAt, &t.FinishedAt)
	t.State = tasks.State(state)
	for _, p := range []struct {
		from *string
		to   *string
	}{{uniqueKey, &t.UniqueKey}, {claimedBy, &t.ClaimedBy}, {lastError, &t.LastError}} {
		if p.from != nil {
			*p.to = *p.from
		}
	}
	return t, err
}

// ListQuery returns the statement and arguments of one page of List: the
// plans test and the benchmark explain it.
func ListQuery(req tasks.ListRequest) (string, []any) {
	sql, args, _ := listQuery(req)
	return sql, args
}

// byID fetches the rows of a stream of ids by primary key, in id order.
// OFFSET 0 keeps the conditions callers apply to these rows out of this
// scan: pushed into it, a condition on the state would let the planner walk
// a state's index instead and filter by the ids, reading every task in that
// state.
func byID(stream, dir string) string {
	return `SELECT * FROM tasks WHERE id = ANY (ARRAY(` + stream + `)) ORDER BY id` + dir + ` OFFSET 0`
}

// filtersFetchedRows reports whether part of f is applied to fetched rows
// rather than by the driving index of stream.
func filtersFetchedRows(f tasks.Filter) bool {
	return f.Shard != nil || !f.CreatedBefore.IsZero() || (f.Key != "" && (len(f.States) > 0 || f.Kind != ""))
}

// listScan is how many candidates one listing statement examines.
func listScan(req tasks.ListRequest) int {
	if filtersFetchedRows(req.Filter) {
		return max(ListScan, req.Limit)
	}
	return req.Limit
}

func listQuery(req tasks.ListRequest) (sql string, args []any, filtered bool) {
	var b sqlBuilder
	stream, rest := b.stream(req.Filter, req.After, req.Desc, listScan(req))
	dir, where := "", ""
	if req.Desc {
		dir = " DESC"
	}
	if rest != "" {
		where = " WHERE " + rest
	}
	return `SELECT ` + summaryColumns + ` FROM (` + byID(stream, dir) + `) t` + where +
		` ORDER BY t.id` + dir + ` LIMIT ` + strconv.Itoa(req.Limit), b.args, rest != ""
}

// List returns one page of the tasks matching req's filter, in id order
// (descending with Desc), after req.After. See tasks.Page for the cursor.
func (s *Store) List(ctx context.Context, req tasks.ListRequest) (tasks.Page, error) {
	if req.Limit <= 0 {
		req.Limit = tasks.DefaultListLimit
	}
	req.Limit = min(req.Limit, tasks.MaxListLimit)
	sql, args, filtered := listQuery(req)
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return tasks.Page{}, fmt.Errorf("listing tasks: %w", err)
	}
	list, err := pgx.CollectRows(rows, scanSummary)
	if err != nil {
		return tasks.Page{}, fmt.Errorf("listing tasks: %w", err)
	}
	page := tasks.Page{Tasks: list}
	switch {
	case len(list) == req.Limit:
		page.Next = list[len(list)-1].ID
	case filtered:
		// A short page of a filtered listing: more may match beyond the
		// candidates this statement examined. Continue after the last of
		// them, if the stream was not exhausted.
		var b sqlBuilder
		stream, _ := b.stream(req.Filter, req.After, req.Desc, listScan(req))
		last := "max"
		if req.Desc {
			last = "min"
		}
		var n, lastID int64
		if err := s.pool.QueryRow(ctx, `SELECT count(*), coalesce(`+last+`(id), 0) FROM (`+stream+`) c`, b.args[:b.streamArgs]...).Scan(&n, &lastID); err != nil {
			return tasks.Page{}, fmt.Errorf("listing tasks: %w", err)
		}
		if n == int64(listScan(req)) {
			page.Next = lastID
		}
	}
	if page.Tasks == nil {
		page.Tasks = []tasks.Summary{}
	}
	return page, nil
}

// bulkOp is one kind of bulk operation.
type bulkOp struct {
	name string
	// states it applies to, and the default filter.
	states []tasks.State
	// pass runs one pass of one batch in tx: candidates is the stream,
	// rest the rest of the filter over t. It returns how many candidates
	// the stream yielded and the last of them, the counts, how many
	// eligible rows were locked by someone else (the pass is run again).
	pass func(ctx context.Context, tx pgx.Tx, b *sqlBuilder, candidates, rest string) (bulkPass, error)
}

type bulkPass struct {
	candidates, last int64
	res              tasks.BulkResult
	locked           int64
	shards           []int
}

// CancelMatching cancels the tasks matching f (ready ones at once, running
// ones by request), in batches of BulkBatch candidates from the cursor after,
// until none are left or budget has passed; then Done is false and Next is
// the cursor to continue from. f.States may hold only ready and running.
func (s *Store) CancelMatching(ctx context.Context, f tasks.Filter, after int64, budget time.Duration) (tasks.BulkResult, error) {
	return s.bulk(ctx, bulkOp{name: "cancel", states: []tasks.State{tasks.Ready, tasks.Running}, pass: cancelPass}, f, after, budget)
}

// RetryMatching retries the dead, failed and cancelled tasks matching f,
// like RetryTask, in batches as CancelMatching. Of several matching tasks
// with the same unique key only the newest is retried, and none whose key
// another unfinished task holds: those are counted as Skipped.
func (s *Store) RetryMatching(ctx context.Context, f tasks.Filter, after int64, budget time.Duration) (tasks.BulkResult, error) {
	return s.bulk(ctx, bulkOp{name: "retry", states: []tasks.State{tasks.Failed, tasks.Dead, tasks.Cancelled}, pass: retryPass}, f, after, budget)
}

func (s *Store) bulk(ctx context.Context, op bulkOp, f tasks.Filter, after int64, budget time.Duration) (tasks.BulkResult, error) {
	for _, st := range f.States {
		if !slices.Contains(op.states, st) {
			return tasks.BulkResult{}, &tasks.FieldError{Field: "state",
				Problem: fmt.Sprintf("%s applies to %s tasks, not %s", op.name, joinStates(op.states), st)}
		}
	}
	if f.Empty() {
		return tasks.BulkResult{}, &tasks.FieldError{Field: "filter",
			Problem: fmt.Sprintf("a bulk %s needs at least one filter (state, kind, shard, key, created_before)", op.name)}
	}
	states := f.States
	if len(states) == 0 {
		states = op.states
	}
	f.States = states
	start := time.Now()
	var total tasks.BulkResult
	for {
		p, err := s.bulkBatch(ctx, op, f, after)
		if err != nil {
			return total, fmt.Errorf("bulk %s after task %d: %w", op.name, after, err)
		}
		total.Add(p.res)
		if p.candidates < BulkBatch {
			total.Done = true
			return total, nil
		}
		after = p.last
		if time.Since(start) >= budget {
			total.Next = after
			return total, nil
		}
	}
}

// bulkBatch runs one batch, again while some of its rows were locked.
func (s *Store) bulkBatch(ctx context.Context, op bulkOp, f tasks.Filter, after int64) (bulkPass, error) {
	for i := 0; ; i++ {
		var p bulkPass
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			var b sqlBuilder
			candidates, rest := b.stream(f, after, false, BulkBatch)
			// The state may have changed since the stream read it.
			if rest != "" {
				rest += " AND "
			}
			rest += "t.state = ANY (" + b.arg(stateStrings(f.States)) + "::text[])"
			var err error
			if p, err = op.pass(ctx, tx, &b, candidates, rest); err != nil {
				return err
			}
			return notifyShards(ctx, tx, p.shards)
		})
		var pe *pgconn.PgError
		retry := errors.As(err, &pe) && pe.Code == "23505" // a concurrent enqueue took a unique key
		if err != nil && !retry {
			return bulkPass{}, err
		}
		if !retry && p.locked == 0 {
			return p, nil
		}
		if i == bulkPasses {
			return bulkPass{}, fmt.Errorf("rows stayed locked by concurrent writes over %d passes", bulkPasses)
		}
		wait := time.NewTimer(time.Duration(min(i+1, 20)) * 5 * time.Millisecond)
		select {
		case <-ctx.Done():
			wait.Stop()
			return bulkPass{}, ctx.Err()
		case <-wait.C:
		}
	}
}

// cancelPass: running tasks already asked to cancel are not asked again,
// so that a pass run again counts each task once. Rows are locked SKIP
// LOCKED in id order: waiting on rows a heartbeat or completion holds, in
// whatever order that statement took them, could deadlock; a locked row
// makes the pass run again instead.
func cancelPass(ctx context.Context, tx pgx.Tx, b *sqlBuilder, candidates, rest string) (bulkPass, error) {
	var p bulkPass
	err := tx.QueryRow(ctx, `
		WITH c AS MATERIALIZED (`+candidates+`),
		elig AS (
			SELECT t.id FROM (`+byID("SELECT id FROM c", "")+`) t
			WHERE `+rest+` AND (t.state = 'ready' OR (t.state = 'running' AND t.cancel_requested_at IS NULL))
		),
		locked AS (
			SELECT id FROM tasks WHERE id = ANY (ARRAY(SELECT id FROM elig))
			  AND (state = 'ready' OR (state = 'running' AND cancel_requested_at IS NULL))
			ORDER BY id FOR UPDATE SKIP LOCKED
		),
		upd AS (
			UPDATE tasks t SET `+cancelSet+`
			WHERE t.id = ANY (ARRAY(SELECT id FROM locked))
			  AND (t.state = 'ready' OR (t.state = 'running' AND t.cancel_requested_at IS NULL))
			RETURNING t.state
		)
		SELECT (SELECT count(*) FROM c), (SELECT coalesce(max(id), 0) FROM c),
		       (SELECT count(*) FROM elig) - (SELECT count(*) FROM locked),
		       (SELECT count(*) FROM upd WHERE state = 'cancelled'),
		       (SELECT count(*) FROM upd WHERE state = 'running')`, b.args...).Scan(
		&p.candidates, &p.last, &p.locked, &p.res.Cancelled, &p.res.CancelRequested)
	return p, err
}

// retryPass retries the newest candidate of each unique key whose key no
// unfinished task holds, and every candidate without a unique key.
func retryPass(ctx context.Context, tx pgx.Tx, b *sqlBuilder, candidates, rest string) (bulkPass, error) {
	var p bulkPass
	var shards []int32
	err := tx.QueryRow(ctx, `
		WITH c AS MATERIALIZED (`+candidates+`),
		elig AS MATERIALIZED (
			SELECT t.id, t.unique_key FROM (`+byID("SELECT id FROM c", "")+`) t
			WHERE `+rest+` AND t.state IN ('failed', 'dead', 'cancelled')
		),
		pick AS (
			SELECT id FROM elig WHERE unique_key IS NULL
			UNION ALL
			SELECT id FROM (
				SELECT DISTINCT ON (unique_key) id, unique_key FROM elig
				WHERE unique_key IS NOT NULL ORDER BY unique_key, id DESC
			) k
			WHERE NOT EXISTS (
				SELECT 1 FROM tasks o WHERE o.unique_key = k.unique_key AND o.state IN ('ready', 'running'))
		),
		locked AS (
			SELECT id FROM tasks WHERE id = ANY (ARRAY(SELECT id FROM pick)) AND state IN ('failed', 'dead', 'cancelled')
			ORDER BY id FOR UPDATE SKIP LOCKED
		),
		upd AS (
			UPDATE tasks t SET `+retrySet+`
			WHERE t.id = ANY (ARRAY(SELECT id FROM locked)) AND t.state IN ('failed', 'dead', 'cancelled')
			RETURNING t.shard
		)
		SELECT (SELECT count(*) FROM c), (SELECT coalesce(max(id), 0) FROM c),
		       (SELECT count(*) FROM pick) - (SELECT count(*) FROM locked),
		       (SELECT count(*) FROM elig) - (SELECT count(*) FROM pick),
		       (SELECT count(*) FROM upd),
		       ARRAY(SELECT DISTINCT shard FROM upd)`, b.args...).Scan(
		&p.candidates, &p.last, &p.locked, &p.res.Skipped, &p.res.Retried, &shards)
	for _, s := range shards {
		p.shards = append(p.shards, int(s))
	}
	return p, err
}

func joinStates(states []tasks.State) string {
	return strings.Join(stateStrings(states), ", ")
}

// CountCap is where CountByStateCapped stops counting a state.
const CountCap = 100_000

// CountByStateCapped counts the tasks of each state (every state present)
// up to limit: a count of limit means "limit or more". Each state's count
// walks tasks_state_id_idx and stops at limit, so the statement costs at
// most len(States) × limit index entries however large the table: about
// 50ms with limit 100,000 at 10 million rows, where CountByState takes
// 1.3s.
func (s *Store) CountByStateCapped(ctx context.Context, limit int) (map[tasks.State]int64, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT s.state, (SELECT count(*) FROM (
			SELECT 1 FROM tasks t WHERE t.state = ANY (ARRAY[s.state]) ORDER BY t.state, t.id LIMIT $1) x)
		FROM unnest($2::text[]) AS s(state)`, limit, stateStrings(tasks.States))
	if err != nil {
		return nil, fmt.Errorf("counting tasks by state up to %d: %w", limit, err)
	}
	counts := make(map[tasks.State]int64, len(tasks.States))
	var state string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&state, &n}, func() error {
		counts[tasks.State(state)] = n
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("counting tasks by state up to %d: %w", limit, err)
	}
	return counts, nil
}

// LongestRunning returns up to n running tasks, longest running first.
// Running tasks are bounded by the runners' workers, so sorting them is
// cheap.
func (s *Store) LongestRunning(ctx context.Context, n int) ([]tasks.Summary, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT `+summaryColumns+` FROM tasks t WHERE t.state = 'running'
		ORDER BY t.claimed_at, t.id LIMIT $1`, n)
	if err != nil {
		return nil, fmt.Errorf("listing the longest running tasks: %w", err)
	}
	list, err := pgx.CollectRows(rows, scanSummary)
	if err != nil {
		return nil, fmt.Errorf("listing the longest running tasks: %w", err)
	}
	return list, nil
}
