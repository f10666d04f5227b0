package store

// Operators' statements: cancel, retry, list and count tasks.
//
// None of them is made under a claim, so none is fenced by a shard epoch;
// each re-checks the state it acts on. Cancelling a ready task takes its
// entry out of task_ready, which a claim that got there first has taken
// out already (the task is then running and the statement records a
// cancel request instead). Cancelling a running task only records the
// request (cancel_requested_at): the state, attempt and claim of a running
// task change only by the writes of the runner that holds the claim
// (CancelAttempts), by the leader's sweeps and by the next owner's orphan
// requeue, each of which turns a requested cancel into cancelled. Each
// statement locks the tasks row before its task_ready entry, and no
// statement that holds a task_ready entry or a claim waits for a tasks row
// another holds while wanting its entry or claim, so they cannot deadlock.
//
// Listing and bulk operations walk one ordered stream of candidate ids from
// the index that matches the filter best (see stream) and apply the rest of
// the filter to the rows they fetch by primary key from task_view,
// examining a bounded number of candidates per statement. Each stream
// orders by every column of its index, so no plan but a walk of that index
// can produce the order without sorting the whole match: the plans do not
// depend on statistics.

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

// streamable reports whether every state of states has an index of its own
// in id order: running tasks (task_claims) and each final state
// (task_finished). Ready tasks have none (task_ready is ordered for claims).
func streamable(states []tasks.State) bool {
	for _, st := range states {
		if st == tasks.Ready {
			return false
		}
	}
	return len(states) > 0
}

// stream returns the SQL of an ordered stream of at most n candidate ids
// (column id) of tasks matching the driving part of f, after the cursor
// (below it when desc), and the predicate over alias t (a row of
// task_view) of the rest of f, which callers apply to the rows they fetch.
//
// The driving index, by precedence: tasks_key_id_idx for a key (keys are
// the most selective); tasks_kind_id_idx for a kind; for states that all
// have one, the primary keys of task_claims (running) and task_finished
// (each final state), merged in id order (a Merge Append of index walks);
// the primary key of tasks otherwise. A sequence key drives by
// tasks_sequence_id_idx after a key.
func (b *sqlBuilder) stream(f tasks.Filter, after int64, desc bool, n int) (stream, rest string) {
	dir, cmp := "", ">"
	if desc {
		dir, cmp = " DESC", "<"
	}
	cursor := ""
	if after > 0 {
		cursor = " AND id " + cmp + " " + b.arg(after)
	}
	limit := " LIMIT " + strconv.Itoa(n)
	var restParts []string
	// The driving values are hidden from the planner in sub-selects, and
	// compared as arrays on the index's first column: a column equated to
	// a value drops out of the ORDER BY, after which another index (the
	// primary key) yields the same order and the planner may prefer it,
	// filtering every row; an array comparison on the first column keeps
	// the ORDER BY whole, and only the intended index produces it without
	// reading and sorting every match.
	first := func(col, v string) string {
		return col + " = ANY ((SELECT " + b.arg([]string{v}) + "::text[])::text[])"
	}
	states := f.States
	switch {
	case f.Key != "":
		stream = "SELECT id FROM tasks WHERE " + first("key", f.Key) + cursor + " ORDER BY key" + dir + ", id" + dir + limit
	case f.SequenceKey != "":
		stream = "SELECT id FROM tasks WHERE " + first("sequence_key", f.SequenceKey) + cursor +
			" ORDER BY sequence_key" + dir + ", id" + dir + limit
	case f.Kind != "":
		stream = "SELECT id FROM tasks WHERE " + first("kind", f.Kind) + cursor + " ORDER BY kind" + dir + ", id" + dir + limit
	case streamable(states):
		parts := make([]string, len(states))
		for i, st := range states {
			if st == tasks.Running {
				parts[i] = "SELECT id FROM task_claims WHERE true" + cursor + " ORDER BY id" + dir + limit
			} else {
				// The primary key (state, id) is the only index in id
				// order within a state, so an equality keeps the plan.
				parts[i] = "SELECT id FROM task_finished WHERE state = " + b.arg(string(st)) + "::text" + cursor +
					" ORDER BY id" + dir + limit
			}
		}
		stream = parts[0]
		if len(parts) > 1 {
			stream = "SELECT id FROM ((" + strings.Join(parts, ") UNION ALL (") + ")) u ORDER BY id" + dir + limit
		}
		states = nil
	default:
		stream = "SELECT id FROM tasks WHERE true" + cursor + " ORDER BY id" + dir + limit
	}
	b.streamArgs = len(b.args)
	if (f.Key != "" || f.SequenceKey != "") && f.Kind != "" {
		restParts = append(restParts, "t.kind = "+b.arg(f.Kind))
	}
	if f.Key != "" && f.SequenceKey != "" {
		restParts = append(restParts, "t.sequence_key = "+b.arg(f.SequenceKey))
	}
	if f.Queue != "" {
		restParts = append(restParts, "t.queue = "+b.arg(f.Queue))
	}
	if f.Priority != 0 {
		restParts = append(restParts, "t.priority = "+b.arg(f.Priority))
	}
	if len(states) > 0 {
		restParts = append(restParts, "t.state = ANY ("+b.arg(stateStrings(states))+"::text[])")
	}
	if f.Shard != nil {
		restParts = append(restParts, "t.shard = "+b.arg(*f.Shard))
	}
	if !f.CreatedBefore.IsZero() {
		restParts = append(restParts, "t.created_at < "+b.arg(f.CreatedBefore))
	}
	if !f.CreatedSince.IsZero() {
		restParts = append(restParts, "t.created_at >= "+b.arg(f.CreatedSince))
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
// them, over a row t of task_view.
const summaryColumns = `t.id, t.kind, t.shard, t.key, t.queue, t.priority, coalesce(t.sequence_key, ''), t.unique_key, t.state, t.attempt, t.max_attempts, t.run_after,
	t.deadline, t.claimed_by, t.claimed_at, t.heartbeat_at, t.cancel_requested_at, t.errors -> -1 ->> 'error',
	t.created_at, t.finished_at`

func scanSummary(r pgx.CollectableRow) (tasks.Summary, error) { return scanSummaryAnd(r) }

// scanSummaryAnd scans summaryColumns, then the columns after them into
// more.
func scanSummaryAnd(r pgx.CollectableRow, more ...any) (tasks.Summary, error) {
	var t tasks.Summary
	var state string
	var uniqueKey, claimedBy, lastError *string
	var priority int16
	err := r.Scan(append([]any{&t.ID, &t.Kind, &t.Shard, &t.Key, &t.Queue, &priority, &t.SequenceKey, &uniqueKey, &state, &t.Attempt,
		&t.MaxAttempts, &t.RunAfter, &t.Deadline, &claimedBy, &t.ClaimedAt, &t.HeartbeatAt, &t.CancelRequestedAt, &lastError,
		&t.CreatedAt, &t.FinishedAt}, more...)...)
	t.State, t.Priority = tasks.State(state), int(priority)
	t.UniqueKey, t.ClaimedBy, t.LastError = deref(uniqueKey), deref(claimedBy), deref(lastError)
	return t, err
}

// ListQuery returns the statement and arguments of one page of List: the
// plans test and the benchmark explain it.
func ListQuery(req tasks.ListRequest) (string, []any) {
	sql, args, _ := listQuery(req)
	return sql, args
}

// byID fetches the rows of a stream of ids from task_view by primary key,
// in id order. OFFSET 0 keeps the conditions callers apply to these rows
// out of this scan: pushed into it, a condition could let the planner walk
// another index filtered by the ids.
func byID(stream, dir string) string {
	return `SELECT * FROM task_view WHERE id = ANY (ARRAY(` + stream + `)) ORDER BY id` + dir + ` OFFSET 0`
}

// listScan is how many candidates one listing statement examines: the
// page's size when the stream is exact, ListScan when part of the filter
// is applied to fetched rows.
func listScan(req tasks.ListRequest, filtered bool) int {
	if filtered {
		return max(ListScan, req.Limit)
	}
	return req.Limit
}

func listQuery(req tasks.ListRequest) (sql string, args []any, filtered bool) {
	var probe sqlBuilder
	_, rest := probe.stream(req.Filter, req.After, req.Desc, 1)
	filtered = rest != ""
	var b sqlBuilder
	stream, rest := b.stream(req.Filter, req.After, req.Desc, listScan(req, filtered))
	dir, where := "", ""
	if req.Desc {
		dir = " DESC"
	}
	if rest != "" {
		where = " WHERE " + rest
	}
	last := "max"
	if req.Desc {
		last = "min"
	}
	// The page and what the stream yielded, from one snapshot: a second
	// statement would see the runners' claims since, and a cursor computed
	// there could pass tasks the page never saw.
	return `/* shardrun.list */
		WITH c AS MATERIALIZED (` + stream + `)
		SELECT ` + summaryColumns + `, (SELECT count(*) FROM c), (SELECT coalesce(` + last + `(id), 0) FROM c)
		FROM (` + byID("SELECT id FROM c", dir) + `) t` + where + `
		ORDER BY t.id` + dir + ` LIMIT ` + strconv.Itoa(req.Limit), b.args, filtered
}

// List returns one page of the tasks matching req's filter, in id order
// (descending with Desc), after req.After. See tasks.Page for the cursor.
func (s *Store) List(ctx context.Context, req tasks.ListRequest) (tasks.Page, error) {
	if req.Limit <= 0 {
		req.Limit = tasks.DefaultListLimit
	}
	req.Limit = min(req.Limit, tasks.MaxListLimit)
	sql, args, filtered := listQuery(req)
	// A short page of a filtered listing carries, in every row, how many
	// candidates the statement examined and the last of them; an empty
	// one carries nothing, so the listing runs in one snapshot with a
	// statement that asks for them alone.
	var page tasks.Page
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, sql, args...)
		if err != nil {
			return err
		}
		var examined, last int64
		list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (tasks.Summary, error) {
			var t tasks.Summary
			var state string
			var priority int16
			var uniqueKey, claimedBy, lastError *string
			err := r.Scan(&t.ID, &t.Kind, &t.Shard, &t.Key, &t.Queue, &priority, &t.SequenceKey, &uniqueKey, &state, &t.Attempt,
				&t.MaxAttempts, &t.RunAfter, &t.Deadline, &claimedBy, &t.ClaimedAt, &t.HeartbeatAt, &t.CancelRequestedAt, &lastError,
				&t.CreatedAt, &t.FinishedAt, &examined, &last)
			t.State, t.Priority = tasks.State(state), int(priority)
			t.UniqueKey, t.ClaimedBy, t.LastError = deref(uniqueKey), deref(claimedBy), deref(lastError)
			return t, err
		})
		if err != nil {
			return err
		}
		page.Tasks = list
		switch {
		case len(list) == req.Limit:
			page.Next = list[len(list)-1].ID
		case filtered:
			if len(list) == 0 {
				if betweenListStatements != nil {
					betweenListStatements()
				}
				var b sqlBuilder
				stream, _ := b.stream(req.Filter, req.After, req.Desc, listScan(req, true))
				lastFn := "max"
				if req.Desc {
					lastFn = "min"
				}
				if err := tx.QueryRow(ctx, `/* shardrun.list_cursor */ SELECT count(*), coalesce(`+lastFn+`(id), 0) FROM (`+stream+`) c`,
					b.args[:b.streamArgs]...).Scan(&examined, &last); err != nil {
					return err
				}
			}
			// More may match beyond the candidates this statement
			// examined: continue after the last of them, if the stream
			// was not exhausted.
			if examined == int64(listScan(req, true)) {
				page.Next = last
			}
		}
		return nil
	})
	if err != nil {
		return tasks.Page{}, fmt.Errorf("listing tasks: %w", err)
	}
	if page.Tasks == nil {
		page.Tasks = []tasks.Summary{}
	}
	return page, nil
}

// betweenListStatements, when set (by a test), runs between a listing's
// page and its cursor statement.
var betweenListStatements func()

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// bulkOp is one kind of bulk operation.
type bulkOp struct {
	name string
	// states it applies to, and the default filter.
	states []tasks.State
	// pass runs one pass of one batch of the tasks matching f in tx:
	// candidates is the stream, rest the rest of the filter over t (a row
	// of task_view). It returns how many candidates the stream yielded
	// and the last of them, the counts, how many eligible rows were locked
	// by someone else (the pass is run again).
	pass func(ctx context.Context, tx pgx.Tx, b *sqlBuilder, f tasks.Filter, candidates, rest string) (bulkPass, error)
}

type bulkPass struct {
	candidates, last int64
	res              tasks.BulkResult
	locked           int64
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
// with the same unique key only the newest is retried, wherever the batches
// fall, and none whose key another unfinished task holds: those are counted
// as Skipped.
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
			Problem: fmt.Sprintf("a bulk %s needs at least one filter (state, kind, shard, key, queue, priority, sequence_key, created_before, created_since)", op.name)}
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

// matches is the whole of f as a predicate over alias (a row of
// task_view): the driving part of a stream and its rest.
func (b *sqlBuilder) matches(f tasks.Filter, alias string) string {
	a := alias + "."
	parts := []string{a + "state = ANY (" + b.arg(stateStrings(f.States)) + "::text[])"}
	if f.Key != "" {
		parts = append(parts, a+"key = "+b.arg(f.Key))
	}
	if f.SequenceKey != "" {
		parts = append(parts, a+"sequence_key = "+b.arg(f.SequenceKey))
	}
	if f.Queue != "" {
		parts = append(parts, a+"queue = "+b.arg(f.Queue))
	}
	if f.Priority != 0 {
		parts = append(parts, a+"priority = "+b.arg(f.Priority))
	}
	if f.Kind != "" {
		parts = append(parts, a+"kind = "+b.arg(f.Kind))
	}
	if f.Shard != nil {
		parts = append(parts, a+"shard = "+b.arg(*f.Shard))
	}
	if !f.CreatedBefore.IsZero() {
		parts = append(parts, a+"created_at < "+b.arg(f.CreatedBefore))
	}
	if !f.CreatedSince.IsZero() {
		parts = append(parts, a+"created_at >= "+b.arg(f.CreatedSince))
	}
	return strings.Join(parts, " AND ")
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
			p, err = op.pass(ctx, tx, &b, f, candidates, rest)
			return err
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

func joinStates(states []tasks.State) string {
	return strings.Join(stateStrings(states), ", ")
}

// CountCap is where CountByStateCapped stops counting a state.
const CountCap = 100_000

// CountByStateCapped counts the tasks of each state (every state present)
// up to limit: a count of limit means "limit or more". Ready tasks are
// counted in task_ready and task_waiting, running ones in task_claims,
// finished ones per state in task_finished, each walk stopping at limit,
// so the statement costs at most len(States) × limit index entries however
// large the table.
func (s *Store) CountByStateCapped(ctx context.Context, limit int) (map[tasks.State]int64, error) {
	return s.countByState(ctx, "counting tasks by state up to "+strconv.Itoa(limit), `/* shardrun.count_capped */
		SELECT 'ready', (SELECT count(*) FROM (SELECT 1 FROM task_ready LIMIT $1) x) +
			(SELECT count(*) FROM (SELECT 1 FROM task_waiting WHERE NOT ended LIMIT $1) y)
		UNION ALL
		SELECT 'running', (SELECT count(*) FROM (SELECT 1 FROM task_claims LIMIT $1) x)
		UNION ALL
		SELECT s.state, (SELECT count(*) FROM (
			SELECT 1 FROM task_finished f WHERE f.state = ANY (ARRAY[s.state]) ORDER BY f.state, f.id LIMIT $1) x)
		FROM unnest($2::text[]) AS s(state)`, limit, stateStrings(tasks.FinalStates))
}

// countByState runs a statement of (state, count) rows into a map holding
// every state.
func (s *Store) countByState(ctx context.Context, what, sql string, args ...any) (map[tasks.State]int64, error) {
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	counts := make(map[tasks.State]int64, len(tasks.States))
	for _, st := range tasks.States {
		counts[st] = 0
	}
	var state string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&state, &n}, func() error {
		counts[tasks.State(state)] = n
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return counts, nil
}

// LongestRunning returns up to n running tasks, longest running first:
// a sort of task_claims, one row per running task.
func (s *Store) LongestRunning(ctx context.Context, n int) ([]tasks.Summary, error) {
	return collect(ctx, s.pool, "listing the longest running tasks", scanSummary, `/* shardrun.longest_running */
		SELECT `+summaryColumns+` FROM task_view t
		WHERE t.id = ANY (ARRAY(SELECT id FROM task_claims ORDER BY claimed_at, id LIMIT $1))
		ORDER BY t.claimed_at, t.id`, n)
}
