package store

// Claims and the writes about claimed tasks (heartbeat, complete, fail,
// unclaim, orphan requeue), each fenced by the shard's epoch.

import (
	"cmp"
	"context"
	"fmt"
	"reflect"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// RequeueOrphans moves the running tasks of the given shards whose claim
// epoch is older than the shard's epoch back to ready (attempt+1), or to dead
// when their attempts are used up. Their owner is gone by construction: the
// shard changed hands. It applies only to shards whose fence the caller holds.
func (s *Store) RequeueOrphans(ctx context.Context, owner string, owned []tasks.ShardEpoch) (requeued, dead int64, err error) {
	if len(owned) == 0 {
		return 0, 0, nil
	}
	shards, epochs := splitSorted(owned)
	rows, err := s.pool.Query(ctx, `
		WITH `+fenceCTE("$3", "SELECT * FROM unnest($1::int[], $2::bigint[])")+`
		UPDATE tasks t SET
		`+retryOrBury("now()", "t.claimed_by", `format('orphaned: shard %s moved from epoch %s to %s', t.shard, t.claim_epoch,
			($2::bigint[])[array_position($1::int[], t.shard)])`)+`
		WHERE t.shard = ANY (ARRAY(SELECT shard FROM fence)) AND t.state = 'running'
		  AND t.claim_epoch < ($2::bigint[])[array_position($1::int[], t.shard)]
		RETURNING t.state`, shards, epochs, owner)
	if err != nil {
		return 0, 0, fmt.Errorf("requeueing orphans of %d shards: %w", len(owned), err)
	}
	return countStates(rows, "requeueing orphans")
}

// claimColumns are the fields a handler needs.
const claimColumns = `t.id, t.kind, t.shard, t.key, t.payload, t.state, t.attempt, t.max_attempts,
	t.run_after, t.deadline, t.claimed_by, t.claim_epoch, t.claimed_at, t.created_at`

// Plans must not depend on fresh statistics: a queue table is often
// bulk-loaded and churned faster than autovacuum analyses it, and the
// planner then estimates its CTEs and scans at a row or two. So rows of
// tasks are found only by primary key from input arrays (unnest, or
// id = ANY(ARRAY(...))) or by an index scan whose filter is an array
// (shard = ANY(ARRAY(SELECT shard FROM fence)), the epoch looked up in the
// input arrays), never by joining a scan of tasks to a CTE.
// docs/architecture.md has what the join cost.

// Claim moves up to limit ready tasks of the given kinds, in run_after order,
// from the shards the runner holds the fence of, to running under that
// shard's epoch. Shards whose fence is not (owner, epoch) yield nothing.
//
// The ready index is keyed by kind first (tasks_ready_idx: kind, run_after,
// id), and the claim walks one range of it per kind it handles, taking at
// most limit candidates from each, then the oldest limit of those. Ready
// tasks of kinds the runner does not handle are never visited, however many
// there are. The candidates are locked in a second step, by primary key,
// skipping rows another transaction holds; PostgreSQL re-checks the
// state, run_after and deadline on the newest version of each row it locks.
func (s *Store) Claim(ctx context.Context, owner string, owned []tasks.ShardEpoch, kinds []string, limit int) ([]tasks.Task, error) {
	if len(owned) == 0 || len(kinds) == 0 || limit <= 0 {
		return nil, nil
	}
	shards, epochs := splitSorted(owned)
	rows, err := s.pool.Query(ctx, `
		WITH `+fenceCTE("$1", "SELECT * FROM unnest($2::int[], $3::bigint[])")+`, candidates AS (
			SELECT c.id FROM unnest($4::text[]) AS k(kind)
			CROSS JOIN LATERAL (
				SELECT t.id, t.run_after FROM tasks t
				WHERE t.state = 'ready' AND t.kind = k.kind AND t.run_after <= now()
				  AND (t.deadline IS NULL OR t.deadline > now())
				  AND t.shard = ANY (ARRAY(SELECT shard FROM fence))
				ORDER BY t.run_after, t.id
				LIMIT $5
			) c
			ORDER BY c.run_after, c.id
			LIMIT $5
		), picked AS (
			SELECT t.id, ($3::bigint[])[array_position($2::int[], t.shard)] AS epoch
			FROM tasks t
			WHERE t.id = ANY (ARRAY(SELECT id FROM candidates)) AND t.state = 'ready' AND t.run_after <= now()
			  AND (t.deadline IS NULL OR t.deadline > now())
			  AND t.shard = ANY (ARRAY(SELECT shard FROM fence))
			FOR UPDATE OF t SKIP LOCKED
		)
		UPDATE tasks t SET state = 'running', claimed_by = $1, claim_epoch = p.epoch,
			claimed_at = now(), heartbeat_at = NULL
		FROM unnest(ARRAY(SELECT id FROM picked ORDER BY id), ARRAY(SELECT epoch FROM picked ORDER BY id)) AS p(id, epoch)
		WHERE t.id = p.id
		RETURNING `+claimColumns, owner, shards, epochs, kinds, limit)
	if err != nil {
		return nil, fmt.Errorf("claiming tasks on %d shards: %w", len(owned), err)
	}
	claimed, err := pgx.CollectRows(rows, scanClaimed)
	if err != nil {
		return nil, fmt.Errorf("claiming tasks on %d shards: %w", len(owned), err)
	}
	return claimed, nil
}

func scanClaimed(r pgx.CollectableRow) (tasks.Task, error) {
	var t tasks.Task
	var state string
	var claimedBy *string
	var epoch *int64
	err := r.Scan(&t.ID, &t.Kind, &t.Shard, &t.Key, &t.Payload, &state, &t.Attempt, &t.MaxAttempts,
		&t.RunAfter, &t.Deadline, &claimedBy, &epoch, &t.ClaimedAt, &t.CreatedAt)
	t.State = tasks.State(state)
	if claimedBy != nil {
		t.ClaimedBy = *claimedBy
	}
	if epoch != nil {
		t.Epoch = *epoch
	}
	return t, err
}

// inputCol is an extra per-task column of a fenced write, visible to its SET
// list as c.<name>.
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

// fencedWrite is the common shape of heartbeat, complete and fail: an input
// table of refs (plus extra columns), the caller's fence rows locked FOR
// SHARE, and an UPDATE that applies only to rows still running under exactly
// that claim.
func (s *Store) fencedWrite(ctx context.Context, what, owner string, refs []tasks.Ref,
	set string, extra ...inputCol) ([]tasks.WriteResult, error) {
	if len(refs) == 0 {
		return nil, nil
	}
	// The rows are sent, and so locked, in id order: the heartbeats and the
	// outcome writes of one runner touch the same rows concurrently, and
	// two statements locking them in different orders would deadlock.
	order := make([]int, len(refs))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(refs[a].ID, refs[b].ID) })
	ids := make([]int64, len(refs))
	shards := make([]int32, len(refs))
	attempts := make([]int32, len(refs))
	epochs := make([]int64, len(refs))
	for i, o := range order {
		r := refs[o]
		ids[i], shards[i], attempts[i], epochs[i] = r.ID, int32(r.Shard), int32(r.Attempt), r.Epoch
	}
	args := []any{owner, ids, shards, attempts, epochs}
	arrays := "$2::bigint[], $3::int[], $4::int[], $5::bigint[]"
	names := "id, shard, attempt, epoch"
	for _, col := range extra {
		args = append(args, permuted(col.values, order))
		arrays += fmt.Sprintf(", $%d::%s[]", len(args), col.sqlType)
		names += ", " + col.name
	}
	sql := `
		WITH c AS (
			SELECT * FROM unnest(` + arrays + `) AS u(` + names + `)
		), ` + fenceCTE("$1", "SELECT DISTINCT shard, epoch FROM c") + `
		UPDATE tasks t SET ` + set + `
		FROM c JOIN fence ON fence.shard = c.shard AND fence.epoch = c.epoch
		WHERE t.id = c.id AND t.shard = c.shard AND t.state = 'running'
		  AND t.claimed_by = $1 AND t.claim_epoch = c.epoch AND t.attempt = c.attempt
		RETURNING t.id, c.attempt, c.epoch, t.state, t.cancel_requested_at IS NOT NULL`
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
	results := make([]tasks.WriteResult, len(refs))
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
func (s *Store) classify(ctx context.Context, owner string, results []tasks.WriteResult, missed []int) error {
	ids := make([]int64, len(missed))
	shards := make([]int32, len(missed))
	for i, m := range missed {
		ids[i], shards[i] = results[m].Ref.ID, int32(results[m].Ref.Shard)
	}
	rows, err := s.pool.Query(ctx, `
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
			res.Outcome = tasks.FenceLost
		case !exists:
			res.Outcome = tasks.TaskGone
		default:
			res.Outcome = tasks.TaskMoved
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("classifying rejected writes: %w", err)
	}
	return nil
}

// Heartbeat records that the runner is still working on these attempts, in
// one statement. Each result says whether an operator asked to cancel the
// task meanwhile (CancelRequested): that is how a cancel request reaches
// whichever runner runs the task, within one heartbeat interval.
func (s *Store) Heartbeat(ctx context.Context, owner string, refs []tasks.Ref) ([]tasks.WriteResult, error) {
	return s.fencedWrite(ctx, "heartbeating", owner, refs, `heartbeat_at = now()`)
}

// Claimed lists the running tasks claimed by owner under the given terms.
// After a claim statement whose answer was lost (it may have committed),
// the runner gives back those it is not running, with Unclaim, instead of
// leaving them to go stale and spend an attempt.
func (s *Store) Claimed(ctx context.Context, owner string, terms []tasks.ShardEpoch) ([]tasks.Ref, error) {
	if len(terms) == 0 {
		return nil, nil
	}
	shards := make([]int32, len(terms))
	epochs := make([]int64, len(terms))
	for i, t := range terms {
		shards[i], epochs[i] = int32(t.Shard), t.Epoch
	}
	rows, err := s.pool.Query(ctx, `
		SELECT t.id, t.shard, t.attempt, t.claim_epoch FROM tasks t
		JOIN unnest($2::int[], $3::bigint[]) AS o(shard, epoch) ON t.shard = o.shard AND t.claim_epoch = o.epoch
		WHERE t.state = 'running' AND t.claimed_by = $1`, owner, shards, epochs)
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

// Unclaim gives back claims whose handler never started (the shard began
// to move between the claim and the start): running -> ready with the same
// attempt, since no attempt was made; or to cancelled when an operator asked
// to cancel the task meanwhile, since nothing would run it again.
func (s *Store) Unclaim(ctx context.Context, owner string, refs []tasks.Ref) ([]tasks.WriteResult, error) {
	return s.fencedWrite(ctx, "unclaiming", owner, refs, `
		state        = CASE WHEN t.cancel_requested_at IS NULL THEN 'ready' ELSE 'cancelled' END,
		finished_at  = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE now() END,
		claimed_by   = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE t.claimed_by END,
		claim_epoch  = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE t.claim_epoch END,
		claimed_at   = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE t.claimed_at END,
		heartbeat_at = NULL`)
}

// CancelAttempts records attempts cancelled on request (the heartbeat
// reported the request and the runner cancelled the handler's context):
// running -> cancelled under the same claim, whatever the handler returned.
// A completion or failure that landed first wins: the task is then no
// longer running under this claim and the cancellation changes nothing, so
// each attempt has exactly one outcome. The attempt is recorded in the
// task's errors with what the handler returned.
func (s *Store) CancelAttempts(ctx context.Context, owner string, cancelled []tasks.Cancellation) ([]tasks.WriteResult, error) {
	refs := make([]tasks.Ref, len(cancelled))
	msgs := make([]string, len(cancelled))
	for i, c := range cancelled {
		refs[i], msgs[i] = c.Ref, "cancelled on request"
		if c.Error != "" {
			msgs[i] = StorableText(msgs[i] + "; the handler returned: " + c.Error)
		}
	}
	return s.fencedWrite(ctx, "recording cancelled", owner, refs, `
		state = 'cancelled', finished_at = now(), heartbeat_at = now(),
		errors = t.errors || jsonb_build_array(jsonb_build_object(
			'attempt', t.attempt, 'at', now(), 'runner', $1::text, 'error', c.msg))`,
		inputCol{"msg", "text", msgs})
}

// Interrupt records attempts cut short because the runner lost the shard
// (detached, handoff timeout, fence lost, shutdown): back to ready with the
// same attempt, since the handler did not fail, and the interruption
// appended to the task's history. Fenced like every write: if a newer owner
// has the shard already, it requeues the task instead.
func (s *Store) Interrupt(ctx context.Context, owner string, cut []tasks.Interruption) ([]tasks.WriteResult, error) {
	refs := make([]tasks.Ref, len(cut))
	msgs := make([]string, len(cut))
	for i, c := range cut {
		refs[i], msgs[i] = c.Ref, StorableText(c.Reason)
	}
	// A task whose cancel was requested is cancelled instead: nothing would
	// run it again.
	return s.fencedWrite(ctx, "interrupting", owner, refs, `
		state        = CASE WHEN t.cancel_requested_at IS NULL THEN 'ready' ELSE 'cancelled' END,
		run_after    = now(),
		finished_at  = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE now() END,
		claimed_by   = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE t.claimed_by END,
		claim_epoch  = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE t.claim_epoch END,
		claimed_at   = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE t.claimed_at END,
		heartbeat_at = NULL,
		errors = t.errors || jsonb_build_array(jsonb_build_object(
			'attempt', t.attempt, 'at', now(), 'runner', $1::text, 'error', c.msg, 'interrupted', true))`,
		inputCol{"msg", "text", msgs})
}

// Complete records successful attempts, in one statement.
func (s *Store) Complete(ctx context.Context, owner string, done []tasks.Completion) ([]tasks.WriteResult, error) {
	refs := make([]tasks.Ref, len(done))
	results := make([]*string, len(done))
	for i, d := range done {
		refs[i] = d.Ref
		if d.Result != nil {
			r := string(d.Result)
			results[i] = &r
		}
	}
	return s.fencedWrite(ctx, "completing", owner, refs,
		`state = 'completed', result = c.result::jsonb, finished_at = now(), heartbeat_at = now()`,
		inputCol{"result", "text", results})
}

// Fail records failed attempts, in one statement: each task goes back to
// ready with attempt+1 after its RetryAfter, or to dead when its attempts are
// used up (or the failure is Final), or to failed when its deadline passed
// (Expired). The error text is appended to the task's errors.
func (s *Store) Fail(ctx context.Context, owner string, failed []tasks.Failure) ([]tasks.WriteResult, error) {
	refs := make([]tasks.Ref, len(failed))
	msgs := make([]string, len(failed))
	delays := make([]int64, len(failed))
	finals := make([]bool, len(failed))
	expired := make([]bool, len(failed))
	for i, f := range failed {
		refs[i], msgs[i], delays[i], finals[i], expired[i] = f.Ref, StorableText(f.Error), f.RetryAfter.Milliseconds(), f.Final, f.Expired
	}
	return s.fencedWrite(ctx, "failing", owner, refs,
		retryOrBuryUnless("c.final", "c.expired", "now() + c.delay_ms * interval '1 millisecond'", "$1::text", "c.msg"),
		inputCol{"msg", "text", msgs}, inputCol{"delay_ms", "bigint", delays}, inputCol{"final", "boolean", finals},
		inputCol{"expired", "boolean", expired})
}

// retryOrBury is the SET list of every statement that ends an attempt in
// failure: back to ready with attempt+1 at runAfter and the claim cleared, or
// to dead when the attempts are used up, keeping the claim as evidence. A
// task whose cancel was requested goes to cancelled instead of either: it
// must not run again. The error (an SQL expression, as is runner) is
// appended to the task's errors under the attempt that failed.
func retryOrBury(runAfter, runner, errExpr string) string {
	return retryOrBuryUnless("false", "false", runAfter, runner, errExpr)
}

// retryOrBuryUnless is retryOrBury where final (an SQL boolean) buries the
// task whatever attempts it has left (a handler's permanent failure), and
// expired ends it failed (its deadline passed).
func retryOrBuryUnless(final, expired, runAfter, runner, errExpr string) string {
	again := `t.attempt < t.max_attempts AND t.cancel_requested_at IS NULL AND NOT (` + final + `) AND NOT (` + expired + `)`
	return `
		state        = CASE WHEN ` + again + ` THEN 'ready'
		                    WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'
		                    WHEN ` + expired + ` THEN 'failed' ELSE 'dead' END,
		attempt      = CASE WHEN ` + again + ` THEN t.attempt + 1 ELSE t.attempt END,
		run_after    = CASE WHEN ` + again + ` THEN ` + runAfter + ` ELSE t.run_after END,
		finished_at  = CASE WHEN ` + again + ` THEN NULL ELSE now() END,
		claimed_by   = CASE WHEN ` + again + ` THEN NULL ELSE t.claimed_by END,
		claim_epoch  = CASE WHEN ` + again + ` THEN NULL ELSE t.claim_epoch END,
		claimed_at   = CASE WHEN ` + again + ` THEN NULL ELSE t.claimed_at END,
		heartbeat_at = CASE WHEN ` + again + ` THEN NULL ELSE t.heartbeat_at END,
		errors       = t.errors || jsonb_build_array(jsonb_build_object(
			'attempt', t.attempt, 'at', now(), 'runner', ` + runner + `, 'error', ` + errExpr + `))`
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
