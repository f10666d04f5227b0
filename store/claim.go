package store

// Claims and the writes about claimed tasks (heartbeat, complete, fail,
// interrupt, cancel, unclaim).
//
// A claim moves a task's entry from task_ready to task_claims; every later
// write about the attempt matches that claim row on the whole claim (task,
// owner, epoch, attempt) and ends it, or touches it for a heartbeat. The
// next owner of a shard raises its fence and requeues the shard's claims of
// older epochs in one transaction (fence.go), so a claim row that still
// matches is one no newer owner has taken over: the writes need no lock on
// the fence. The claim itself locks the fence rows of the shards it takes
// from, so that a raise waits for it and then sees what it claimed.

import (
	"cmp"
	"context"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// Plans must not depend on fresh statistics: the queue tables are
// bulk-loaded and churned faster than autovacuum analyses them, and the
// planner then estimates their CTEs and scans at a row or two. So the rows
// of the claim path are found by primary key from input arrays (unnest,
// or id = ANY(ARRAY(...))), by ctid, or by an ordered walk of one lane of
// task_ready's primary key; docs/architecture.md has what a join cost.

// claimSQL is the claim statement for each number of kinds (the lanes of
// a shard are one index range per kind, merged in priority order).
var claimSQL sync.Map

// claimQuery returns the claim statement for n kinds ($7: the least urgent
// priority to take).
func claimQuery(n int) string {
	if q, ok := claimSQL.Load(n); ok {
		return q.(string)
	}
	lane := func(k int) string {
		return `SELECT r.ctid AS tid, r.priority, r.run_after, r.id FROM task_ready r
				WHERE r.shard = s.shard AND r.queue = $6 AND r.kind = ($4::text[])[` + strconv.Itoa(k) + `]
				  AND r.priority <= $7 AND r.run_after <= now() AND (r.deadline IS NULL OR r.deadline > now())
				ORDER BY r.priority, r.run_after, r.id`
	}
	lanes := lane(1) + ` LIMIT $5`
	if n > 1 {
		parts := make([]string, n)
		for k := range parts {
			parts[k] = "(" + lane(k+1) + ")"
		}
		lanes = `SELECT x.tid FROM (` + strings.Join(parts, " UNION ALL ") + `) x ORDER BY x.priority, x.run_after, x.id LIMIT $5`
	}
	q := `/* shardrun.claim */
		WITH cand AS (
			SELECT c.tid, s.shard FROM unnest($2::int[]) AS s(shard)
			CROSS JOIN LATERAL (` + lanes + `) c
			WHERE NOT EXISTS (SELECT 1 FROM queues q WHERE q.name = $6 AND q.paused_at IS NOT NULL)
			LIMIT $5
		), fence AS (
			SELECT f.shard FROM shard_fences f
			WHERE f.shard = ANY (ARRAY(SELECT DISTINCT shard FROM cand)) AND f.owner = $1
			  AND f.epoch = ($3::bigint[])[array_position($2::int[], f.shard)]
			ORDER BY f.shard
			FOR SHARE
		), del AS (
			DELETE FROM task_ready r
			WHERE r.ctid = ANY (ARRAY(SELECT tid FROM cand WHERE shard = ANY (ARRAY(SELECT shard FROM fence))))
			RETURNING r.id
		), picked AS MATERIALIZED (
			SELECT ` + claimColumns + `, ($3::bigint[])[array_position($2::int[], t.shard)] AS epoch
			FROM tasks t WHERE t.id = ANY (ARRAY(SELECT id FROM del ORDER BY id)) AND t.state = 'ready'
		), ins AS (
			INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt, deadline)
			SELECT id, shard, queue, epoch, $1, attempt, deadline FROM picked
		)
		SELECT id, kind, shard, key, queue, priority, coalesce(sequence_key, ''), coalesce(sequence_blocks, false), payload,
			attempt, max_attempts, coalesce(attempt_budget, 0), run_after, deadline, epoch, now(), created_at,
			coalesce(trace_context, '')
		FROM picked ORDER BY priority, run_after, id`
	claimSQL.Store(n, q)
	return q
}

// claimExecMode is how the claim statement is sent: with the unnamed
// statement (its description cached), so that PostgreSQL plans it for each
// execution against the tables as they are, and never reuses a plan made
// while they were empty. The idle runners' polls run the claim on empty
// tables; once a prepared statement has run five times, PostgreSQL settles
// on its generic plan and keeps it until the tables' statistics change.
// Where autovacuum had analysed the tables empty (relpages 0, reltuples 0:
// "empty", not "never measured"), that plan found the claimed tasks'
// records through tasks_kind_id_idx (kind, id), id being its second column,
// so one walk of the whole index per claimed task: 4x slower burn-downs of
// a burst after an idle period until autovacuum analysed the tables again,
// a minute later (TestClaimAfterIdleAnalyze). Planning costs about 0.5 ms
// a claim. The leader's statements, which run at idle too, are planned at
// each execution by the coordinator's pool (Options.PlanEachExecution).
const claimExecMode = pgx.QueryExecModeCacheDescribe

// claimColumns are the fields of a claimed task, as scanClaimed reads them.
const claimColumns = `t.id, t.kind, t.shard, t.key, t.queue, t.priority, t.sequence_key, t.sequence_blocks, t.payload,
	t.attempt, t.max_attempts, t.attempt_budget, t.run_after, t.deadline, t.created_at, t.trace_context`

// Claim moves up to limit ready tasks of queue and of the given kinds, due
// by the database clock, from the shards the runner holds the fence of to
// running under that shard's epoch; nothing while the queue is paused. It visits the shards in the order given and
// takes each one's tasks in (priority, run_after, id) order until it has
// limit: the caller rotates the order so that every shard is served, and
// leaves out shards it knows to be empty. Shards whose fence is not
// (owner, epoch) yield nothing.
//
// A claim reads only the lanes (shard, queue, kind) of the shards it visits
// and the kinds it handles: other runners' tasks and kinds nobody handles
// are never read, however many there are. It locks the fence rows of the
// shards it takes from FOR SHARE, so a new owner's fence raise waits for it.
func (s *Store) Claim(ctx context.Context, owner string, owned []tasks.ShardEpoch, queue string, kinds []string, limit int) ([]tasks.Task, error) {
	return s.claim(ctx, owner, owned, queue, kinds, limit, tasks.LeastUrgent)
}

// ClaimUrgent is Claim of the tasks more urgent than the default priority
// only. The executor sends it first to the shards whose enqueue
// notifications said they got such tasks: Claim fills its limit from the
// first shard it visits, default-priority backlog included, so a round
// would serve one urgent shard and leave the others' urgent tasks behind
// whole backlogs.
func (s *Store) ClaimUrgent(ctx context.Context, owner string, owned []tasks.ShardEpoch, queue string, kinds []string, limit int) ([]tasks.Task, error) {
	return s.claim(ctx, owner, owned, queue, kinds, limit, tasks.DefaultPriority-1)
}

// claim is Claim of the tasks of priority maxPriority or more urgent.
func (s *Store) claim(ctx context.Context, owner string, owned []tasks.ShardEpoch, queue string, kinds []string, limit, maxPriority int) ([]tasks.Task, error) {
	if len(owned) == 0 || len(kinds) == 0 || limit <= 0 {
		return nil, nil
	}
	shards := make([]int32, len(owned))
	epochs := make([]int64, len(owned))
	for i, se := range owned {
		shards[i], epochs[i] = int32(se.Shard), se.Epoch
	}
	rows, err := s.pool.Query(ctx, claimQuery(len(kinds)), claimExecMode, owner, shards, epochs, kinds, limit, queue, maxPriority)
	if err != nil {
		return nil, fmt.Errorf("claiming tasks on %d shards: %w", len(owned), err)
	}
	claimed, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (tasks.Task, error) {
		t := tasks.Task{State: tasks.Running, ClaimedBy: owner}
		var priority int16
		err := r.Scan(&t.ID, &t.Kind, &t.Shard, &t.Key, &t.Queue, &priority, &t.SequenceKey, &t.SequenceBlocks, &t.Payload,
			&t.Attempt, &t.MaxAttempts, &t.AttemptBudget, &t.RunAfter, &t.Deadline, &t.Epoch, &t.ClaimedAt, &t.CreatedAt,
			&t.TraceContext)
		t.Priority = int(priority)
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("claiming tasks on %d shards: %w", len(owned), err)
	}
	return claimed, nil
}

// inputCol is an extra per-task column of a claim write, visible to its SET
// list as k.<name>.
type inputCol struct {
	name, sqlType string
	values        any
}

// permuted returns a copy of the slice values with out[i] = values[order[i]].
func permuted(values any, order []int) any {
	in := reflect.ValueOf(values)
	out := reflect.MakeSlice(in.Type(), len(order), len(order))
	for i, o := range order {
		out.Index(i).Set(in.Index(o))
	}
	return out.Interface()
}

// claimMatch is how a write finds the claims of refs: the arguments $1
// (the owner), $2 (the ids, sorted: two statements that lock the same claim
// rows in different orders would deadlock, and a runner's heartbeats and
// outcome writes do run concurrently), $3 and $4 (attempts and epochs) and
// one array per extra column; where, the condition over task_claims k (the
// rows are found by primary key from $2, whatever the statistics of
// task_claims say, and each must be the claim named: owner, epoch and
// attempt); and the extra columns as RETURNING items of k's delete, named
// as the columns. The per-row values are looked up by the id's position in
// $2 rather than joined: a join of the claims to the input table was
// planned as a nested loop over a rescanned function (32ms for 256 rows).
func claimMatch(owner string, refs []tasks.Ref, extra []inputCol) (where, returning string, args []any) {
	order := make([]int, len(refs))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(refs[a].ID, refs[b].ID) })
	ids := make([]int64, len(refs))
	attempts := make([]int32, len(refs))
	epochs := make([]int64, len(refs))
	for i, o := range order {
		r := refs[o]
		ids[i], attempts[i], epochs[i] = r.ID, int32(r.Attempt), r.Epoch
	}
	args = []any{owner, ids, attempts, epochs}
	const pos = "array_position($2::bigint[], k.id)"
	for _, col := range extra {
		args = append(args, permuted(col.values, order))
		returning += fmt.Sprintf(", ($%d::%s[])[%s] AS %s", len(args), col.sqlType, pos, col.name)
	}
	where = `k.id = ANY ($2::bigint[]) AND k.owner = $1
		AND k.epoch = ($4::bigint[])[` + pos + `] AND k.attempt = ($3::int[])[` + pos + `]`
	return where, returning, args
}

// endClaims is the tail of every statement that ends claims. Given the CTE
// k of the task_claims rows the statement deleted (k.*, plus the columns
// it computed), it updates their tasks with set (which reads k), files the
// tasks it left ready back into their lanes, records the finished ones in
// task_finished and frees their unique keys. It defines the CTE t: the
// tasks as updated, with the claim's attempt and epoch.
func endClaims(set string) string {
	return `, t AS (
			UPDATE tasks t SET ` + set + `
			FROM k WHERE t.id = k.id AND t.state = 'ready'
			RETURNING t.id, t.shard, t.queue, t.kind, t.priority, t.run_after, t.deadline, t.state, t.unique_key,
				t.finished_at, t.cancel_requested_at, k.attempt AS claim_attempt, k.epoch AS claim_epoch
		)` + fileTail("t")
}

// fileTail is what follows a CTE (named t) of updated tasks: the ready ones
// back into their lanes, the finished ones into task_finished, and their
// unique keys freed.
func fileTail(t string) string {
	return `, refiled AS (
			INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
			SELECT shard, queue, kind, priority, run_after, id, deadline FROM ` + t + ` WHERE state = 'ready'
		), finished AS (
			INSERT INTO task_finished (state, id, finished_at, queue)
			SELECT state, id, finished_at, queue FROM ` + t + ` WHERE state <> 'ready'
		), freed AS (
			DELETE FROM task_unique_keys u USING ` + t + ` f
			WHERE f.state <> 'ready' AND f.unique_key IS NOT NULL AND u.unique_key = f.unique_key AND u.id = f.id
		)`
}

// claimEvidence is the SET list that records the claim in a task that
// finishes: who ran its last attempt, under which epoch, and when.
const claimEvidence = `claimed_by = k.owner, claim_epoch = k.epoch, claimed_at = k.claimed_at,
	heartbeat_at = coalesce(k.heartbeat_at, k.claimed_at)`

// endClaimsOf is the shape of the runner's own writes that end attempts:
// its claims matching refs (task, owner, epoch, attempt) are deleted, and
// their tasks updated with set (see endClaims), in one statement.
func (s *Store) endClaimsOf(ctx context.Context, what, name, owner string, refs []tasks.Ref,
	set string, extra ...inputCol) ([]claims.WriteResult, error) {
	if len(refs) == 0 {
		return nil, nil
	}
	if rounds := distinctRounds(refs); len(rounds) > 1 {
		return s.inRounds(ctx, refs, extra, rounds, func(refs []tasks.Ref, extra []inputCol) ([]claims.WriteResult, error) {
			return s.endClaimsOf(ctx, what, name, owner, refs, set, extra...)
		})
	}
	where, returning, args := claimMatch(owner, refs, extra)
	sql := `/* shardrun.` + name + ` */
		WITH k AS (
			DELETE FROM task_claims k WHERE ` + where + `
			RETURNING k.*` + returning + `
		)` + endClaims(set) + `
		SELECT id, claim_attempt, claim_epoch, state, cancel_requested_at IS NOT NULL FROM t`
	return s.claimResults(ctx, what, owner, refs, sql, args)
}

// distinctRounds splits refs (by index) into rounds in which no task
// appears twice: claimMatch looks each claim's values up by its id, and a
// batch may hold a stale attempt and the current one of the same task (a
// handler of an old epoch that returned late), of which at most one can
// match. Almost every batch is one round.
func distinctRounds(refs []tasks.Ref) [][]int {
	var rounds [][]int
	seen := make([]map[int64]bool, 0, 1)
	for i, r := range refs {
		k := 0
		for k < len(rounds) && seen[k][r.ID] {
			k++
		}
		if k == len(rounds) {
			rounds, seen = append(rounds, nil), append(seen, map[int64]bool{})
		}
		rounds[k], seen[k][r.ID] = append(rounds[k], i), true
	}
	return rounds
}

// inRounds runs write once per round of refs (and of the extra columns'
// values) and puts the results back in refs' order.
func (s *Store) inRounds(ctx context.Context, refs []tasks.Ref, extra []inputCol, rounds [][]int,
	write func([]tasks.Ref, []inputCol) ([]claims.WriteResult, error)) ([]claims.WriteResult, error) {
	results := make([]claims.WriteResult, len(refs))
	for _, round := range rounds {
		sub := make([]tasks.Ref, len(round))
		for j, i := range round {
			sub[j] = refs[i]
		}
		subExtra := make([]inputCol, len(extra))
		for j, col := range extra {
			subExtra[j] = inputCol{col.name, col.sqlType, permuted(col.values, round)}
		}
		res, err := write(sub, subExtra)
		if err != nil {
			return nil, err
		}
		for j, i := range round {
			results[i] = res[j]
		}
	}
	return results, nil
}

// claimResults runs a write about the claims of refs and says, for each,
// whether it applied and why not.
func (s *Store) claimResults(ctx context.Context, what, owner string, refs []tasks.Ref, sql string, args []any) ([]claims.WriteResult, error) {
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("%s %d tasks: %w", what, len(refs), err)
	}
	// Keyed by the whole claim: a batch may hold a stale attempt and the
	// current one of the same task, and only the current one can apply.
	type claim struct {
		id      int64
		attempt int32
		epoch   int64
	}
	type after struct {
		state           tasks.State
		cancelRequested bool
	}
	applied := make(map[claim]after, len(refs))
	var c claim
	var state string
	var cancelRequested bool
	_, err = pgx.ForEachRow(rows, []any{&c.id, &c.attempt, &c.epoch, &state, &cancelRequested}, func() error {
		applied[c] = after{tasks.State(state), cancelRequested}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%s %d tasks: %w", what, len(refs), err)
	}
	results := make([]claims.WriteResult, len(refs))
	var missed []int
	for i, r := range refs {
		results[i].Ref = r
		if a, ok := applied[claim{r.ID, int32(r.Attempt), r.Epoch}]; ok {
			results[i].State, results[i].CancelRequested = a.state, a.cancelRequested
		} else {
			missed = append(missed, i)
		}
	}
	if len(missed) > 0 {
		if err := s.classify(ctx, owner, results, missed); err != nil {
			return nil, fmt.Errorf("%s %d tasks: %w", what, len(refs), err)
		}
	}
	return results, nil
}

// classify explains why writes did not apply: the fence moved (or was never
// ours), the task is gone, or the task moved on.
func (s *Store) classify(ctx context.Context, owner string, results []claims.WriteResult, missed []int) error {
	ids := make([]int64, len(missed))
	shards := make([]int32, len(missed))
	for i, m := range missed {
		ids[i], shards[i] = results[m].Ref.ID, int32(results[m].Ref.Shard)
	}
	rows, err := s.pool.Query(ctx, `/* shardrun.classify */
		SELECT c.id, t.id IS NOT NULL, coalesce(f.epoch, 0), coalesce(f.owner, '')
		FROM unnest($1::bigint[], $2::int[]) WITH ORDINALITY AS c(id, shard, n)
		LEFT JOIN tasks t ON t.id = c.id
		LEFT JOIN shard_fences f ON f.shard = c.shard
		ORDER BY c.n`, ids, shards)
	if err != nil {
		return fmt.Errorf("classifying rejected writes: %w", err)
	}
	i := 0
	var id, fenceEpoch int64
	var exists bool
	var fenceOwner string
	_, err = pgx.ForEachRow(rows, []any{&id, &exists, &fenceEpoch, &fenceOwner}, func() error {
		res := &results[missed[i]]
		i++
		switch {
		case fenceEpoch != res.Ref.Epoch || fenceOwner != owner:
			res.Outcome = claims.FenceLost
		case !exists:
			res.Outcome = claims.TaskGone
		default:
			res.Outcome = claims.TaskMoved
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("classifying rejected writes: %w", err)
	}
	return nil
}

// Heartbeat records that the runner is still working on these attempts, in
// one statement that touches only their claim rows. Each result says
// whether an operator asked to cancel the task meanwhile (CancelRequested):
// that is how a cancel request reaches whichever runner runs the task,
// within one heartbeat interval.
func (s *Store) Heartbeat(ctx context.Context, owner string, refs []tasks.Ref) ([]claims.WriteResult, error) {
	if len(refs) == 0 {
		return nil, nil
	}
	if rounds := distinctRounds(refs); len(rounds) > 1 {
		return s.inRounds(ctx, refs, nil, rounds, func(refs []tasks.Ref, _ []inputCol) ([]claims.WriteResult, error) {
			return s.Heartbeat(ctx, owner, refs)
		})
	}
	where, _, args := claimMatch(owner, refs, nil)
	return s.claimResults(ctx, "heartbeating", owner, refs, `/* shardrun.heartbeat */
		UPDATE task_claims k SET heartbeat_at = now()
		WHERE `+where+`
		RETURNING k.id, k.attempt, k.epoch, 'running',
			(SELECT t.cancel_requested_at IS NOT NULL FROM tasks t WHERE t.id = k.id)`, args)
}

// Claimed lists the running tasks claimed by owner under the given terms.
// After a claim statement whose answer was lost (it may have committed),
// the runner gives back those it is not running, with Unclaim, instead of
// leaving them to go stale and spend an attempt.
func (s *Store) Claimed(ctx context.Context, owner string, terms []tasks.ShardEpoch) ([]tasks.Ref, error) {
	if len(terms) == 0 {
		return nil, nil
	}
	shards, epochs := splitSorted(terms)
	rows, err := s.pool.Query(ctx, `/* shardrun.claimed */
		SELECT k.id, k.shard, k.attempt, k.epoch FROM task_claims k
		WHERE k.owner = $1 AND k.shard = ANY ($2::int[]) AND k.epoch = ($3::bigint[])[array_position($2::int[], k.shard)]`,
		owner, shards, epochs)
	if err != nil {
		return nil, fmt.Errorf("listing the claims of %d shards: %w", len(terms), err)
	}
	refs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (tasks.Ref, error) {
		var ref tasks.Ref
		return ref, r.Scan(&ref.ID, &ref.Shard, &ref.Attempt, &ref.Epoch)
	})
	if err != nil {
		return nil, fmt.Errorf("listing the claims of %d shards: %w", len(terms), err)
	}
	return refs, nil
}

// requeueOrCancel is the SET list of an attempt given back without being
// spent (unclaim, interrupt): the task is ready again with the same
// attempt, or cancelled when an operator asked to cancel it meanwhile,
// since nothing would run it again.
func requeueOrCancel(runAfter string) string {
	return `
		state       = CASE WHEN t.cancel_requested_at IS NULL THEN 'ready' ELSE 'cancelled' END,
		run_after   = ` + runAfter + `,
		finished_at = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE now() END,
		claimed_by   = CASE WHEN t.cancel_requested_at IS NULL THEN t.claimed_by ELSE k.owner END,
		claim_epoch  = CASE WHEN t.cancel_requested_at IS NULL THEN t.claim_epoch ELSE k.epoch END,
		claimed_at   = CASE WHEN t.cancel_requested_at IS NULL THEN t.claimed_at ELSE k.claimed_at END,
		heartbeat_at = CASE WHEN t.cancel_requested_at IS NULL THEN t.heartbeat_at ELSE k.heartbeat_at END`
}

// Unclaim gives back claims whose handler never started (the shard began
// to move between the claim and the start): ready again with the same
// attempt, since no attempt was made; or cancelled when an operator asked
// to cancel the task meanwhile.
func (s *Store) Unclaim(ctx context.Context, owner string, refs []tasks.Ref) ([]claims.WriteResult, error) {
	return s.endClaimsOf(ctx, "unclaiming", "unclaim", owner, refs, requeueOrCancel("t.run_after"))
}

// CancelAttempts records attempts cancelled on request (the heartbeat
// reported the request, the runner cancelled the handler's context and the
// handler returned an error; a success is recorded by Complete): cancelled
// under the same claim. A completion or failure that landed first wins: the claim is then gone and
// the cancellation changes nothing, so each attempt has exactly one
// outcome. The attempt is recorded in the task's errors with what the
// handler returned.
func (s *Store) CancelAttempts(ctx context.Context, owner string, cancelled []claims.Cancellation) ([]claims.WriteResult, error) {
	refs := make([]tasks.Ref, len(cancelled))
	msgs := make([]string, len(cancelled))
	for i, c := range cancelled {
		refs[i], msgs[i] = c.Ref, "cancelled on request"
		if c.Error != "" {
			msgs[i] = StorableText(msgs[i] + "; the handler returned: " + c.Error)
		}
	}
	return s.endClaimsOf(ctx, "recording cancelled", "cancel_attempts", owner, refs, `
		state = 'cancelled', finished_at = now(), `+claimEvidence+`,
		errors = t.errors || jsonb_build_array(jsonb_build_object(
			'attempt', t.attempt, 'at', now(), 'runner', k.owner, 'error', k.msg))`,
		inputCol{"msg", "text", msgs})
}

// Interrupt records attempts cut short because the runner lost the shard
// (detached, handoff timeout, fence lost, shutdown): back to ready with the
// same attempt, since the handler did not fail, and the interruption
// appended to the task's history. If a newer owner has the shard already,
// its orphan requeue took the claim and this changes nothing.
func (s *Store) Interrupt(ctx context.Context, owner string, cut []claims.Interruption) ([]claims.WriteResult, error) {
	refs := make([]tasks.Ref, len(cut))
	msgs := make([]string, len(cut))
	for i, c := range cut {
		refs[i], msgs[i] = c.Ref, StorableText(c.Reason)
	}
	return s.endClaimsOf(ctx, "interrupting", "interrupt", owner, refs, requeueOrCancel("now()")+`,
		errors = t.errors || jsonb_build_array(jsonb_build_object(
			'attempt', t.attempt, 'at', now(), 'runner', k.owner, 'error', k.msg, 'interrupted', true))`,
		inputCol{"msg", "text", msgs})
}

// Complete records successful attempts, in one statement.
func (s *Store) Complete(ctx context.Context, owner string, done []claims.Completion) ([]claims.WriteResult, error) {
	refs := make([]tasks.Ref, len(done))
	results := make([]*string, len(done))
	for i, d := range done {
		refs[i] = d.Ref
		if d.Result != nil {
			r := string(d.Result)
			results[i] = &r
		}
	}
	return s.endClaimsOf(ctx, "completing", "complete", owner, refs,
		`state = 'completed', result = k.result::jsonb, finished_at = now(), `+claimEvidence,
		inputCol{"result", "text", results})
}

// Fail records failed attempts, in one statement: each task goes back to
// ready with attempt+1 after its RetryAfter, or to dead when its attempts are
// used up (or the failure is Final), or to failed when its deadline passed
// (Expired). The error text is appended to the task's errors.
func (s *Store) Fail(ctx context.Context, owner string, failed []claims.Failure) ([]claims.WriteResult, error) {
	refs := make([]tasks.Ref, len(failed))
	msgs := make([]string, len(failed))
	delays := make([]int64, len(failed))
	finals := make([]bool, len(failed))
	expired := make([]bool, len(failed))
	for i, f := range failed {
		refs[i], msgs[i], delays[i], finals[i], expired[i] = f.Ref, StorableText(f.Error), f.RetryAfter.Milliseconds(), f.Final, f.Expired
	}
	return s.endClaimsOf(ctx, "failing", "fail", owner, refs,
		retryOrBuryUnless("k.final", "k.expired", "now() + k.delay_ms * interval '1 millisecond'", "k.msg"),
		inputCol{"msg", "text", msgs}, inputCol{"delay_ms", "bigint", delays}, inputCol{"final", "boolean", finals},
		inputCol{"expired", "boolean", expired})
}

// retryOrBury is the SET list of every statement that ends a claimed
// attempt in failure (k is the claim): back to ready with attempt+1 at
// runAfter, or to dead when the attempts are used up, recording the claim
// as evidence. A task whose cancel was requested goes to cancelled instead
// of either: it must not run again. The error (an SQL expression) is
// appended to the task's errors under the attempt that failed.
func retryOrBury(runAfter, errExpr string) string {
	return retryOrBuryUnless("false", "false", runAfter, errExpr)
}

// retryOrBuryUnless is retryOrBury where final (an SQL boolean) buries the
// task whatever attempts it has left (a handler's permanent failure), and
// expired ends it failed (its deadline passed).
func retryOrBuryUnless(final, expired, runAfter, errExpr string) string {
	again := `t.attempt < t.max_attempts AND t.cancel_requested_at IS NULL AND NOT (` + final + `) AND NOT (` + expired + `)`
	keep := func(col, claim string) string {
		return col + ` = CASE WHEN ` + again + ` THEN t.` + col + ` ELSE ` + claim + ` END`
	}
	return `
		state        = CASE WHEN ` + again + ` THEN 'ready'
		                    WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'
		                    WHEN ` + expired + ` THEN 'failed' ELSE 'dead' END,
		attempt      = CASE WHEN ` + again + ` THEN t.attempt + 1 ELSE t.attempt END,
		run_after    = CASE WHEN ` + again + ` THEN ` + runAfter + ` ELSE t.run_after END,
		finished_at  = CASE WHEN ` + again + ` THEN NULL ELSE now() END,
		` + keep("claimed_by", "k.owner") + `,
		` + keep("claim_epoch", "k.epoch") + `,
		` + keep("claimed_at", "k.claimed_at") + `,
		` + keep("heartbeat_at", "coalesce(k.heartbeat_at, k.claimed_at)") + `,
		errors       = t.errors || jsonb_build_array(jsonb_build_object(
			'attempt', t.attempt, 'at', now(), 'runner', k.owner, 'error', ` + errExpr + `))`
}

// countStates counts the requeued (ready) and dead tasks a statement
// returned; tasks it cancelled (their cancel was requested) are neither.
func countStates(rows pgx.Rows, what string) (ready, dead int64, err error) {
	var state string
	_, err = pgx.ForEachRow(rows, []any{&state}, func() error {
		switch tasks.State(state) {
		case tasks.Dead:
			dead++
		case tasks.Ready:
			ready++
		}
		return nil
	})
	if err != nil {
		return 0, 0, fmt.Errorf("%s: %w", what, err)
	}
	return ready, dead, nil
}
