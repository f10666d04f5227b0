package store

// Every move of a task between the layout's tables, in one place.
//
// A task's record (tasks) says 'ready' until it finishes; where an
// unfinished task is lives in exactly one of three places, and a finished
// one in one:
//
//	task_ready     its lane (shard, queue, kind, priority, run_after, id):
//	               claimable once due
//	task_claims    running: a runner's claim under a shard's epoch
//	task_waiting   its sequence's waiting line: not its turn yet
//	task_finished  finished, under its final state
//
// The rule of where a task goes once its record changed is one SQL
// function, shardrun_file (sql/shardrun_file.sql), and the rule of a
// sequence is another, shardrun_settle; every move below ends with them.
//
//	move              from -> to                        statement            locks, in order
//	----------------  --------------------------------  -------------------  ------------------------------------------
//	insert            -> lane | waiting | finished      INSERT INTO tasks    records (new), keys, queue (removal lock
//	                                                    (trigger, at commit: shared, row); at commit: sequences,
//	                                                    tasks_settle)        waiting, lanes
//	claim             lane -> claim                     Claim, ClaimUrgent   queue row (key share), fences (share),
//	                                                                         lanes, claims (new)
//	heartbeat         claim (touched)                   Heartbeat            claims
//	complete, fail,   claim -> finished | lane |        endClaimsOf          claims, records, sequences, lanes and
//	interrupt,        waiting (a sequence moves on)                          waiting, finished and keys
//	cancel attempt,
//	unclaim
//	orphan requeue    claim -> lane | finished          RaiseFences          fences, claims, records, sequences, ...
//	stale sweep,      claim -> lane | finished          SweepStale,          leader fence (share), claims, records, ...
//	running deadline                                    SweepDeadlines
//	ready deadline,   lane | waiting -> finished        shardrun_expire      leader fence (share), records, sequences,
//	unrunnable rule                                                          lanes, waiting, finished and keys
//	cancel            lane | waiting -> finished;       shardrun_cancel      records, sequences, lanes, waiting,
//	                  claim: a request                                       finished and keys
//	retry             finished -> lane | waiting        shardrun_retry       records, finished, keys, queue (removal
//	                                                                         lock shared, row), sequences, lanes
//	retention         finished -> (deleted)             DeleteFinished       leader fence (share), records, finished
//	promotion         waiting -> lane                   shardrun_settle      sequences, waiting, lanes
//	(pause, resume)   no task moves                     SetQueuePaused       queue row
//	(queue removal)   no task moves                     shardrun_remove_     queue row, then its removal lock, never
//	                                                    queue                waiting for it
//
// The one lock order: shard fences, then claims, then records, then
// sequences, then lanes and waiting lines, then finished entries and the
// unique keys an unfinished task held; within a table, in key order (claims
// and records by id, sequences and unique keys by key, fences by shard).
// Every statement takes what it locks in that order, explicitly (ORDER BY
// … FOR UPDATE), never in the order a plan happens to read rows. A row a
// statement inserts is no lock another waits for (nobody else can see it),
// so the claim's new claim rows and new lane entries follow no order — but
// a new unique key is: a second insert of the key waits for the first
// one's transaction. So whoever takes a new unique key takes it before
// any sequence: a producer takes its keys at the insert and its sequences
// at the commit, a retry its keys before shardrun_file settles its
// sequences. Two statements that lock in one order cannot deadlock
// (TestLayoutUnderStress runs them all at once and fails on a deadlock).
// Within a producer's own transaction the order of its inserts is the
// producer's: two transactions that insert the same unique keys in
// opposite orders can deadlock, as with any unique index (a batch takes
// its keys in key order).
//
// A queue's row (queues) is locked by a claim FOR KEY SHARE before anything
// else, and by a pause or a removal FOR UPDATE, holding nothing else.
// Producers and retries take the queue's removal lock (an advisory lock,
// shared) and insert its row if it is missing (shardrun_register_queues)
// after their unique keys; a removal takes the removal lock after the row,
// without waiting (refusing when it is held), and then waits for nothing:
// it never holds what another waits for while it waits itself. A missing
// row inserted by a producer whose transaction is still open is waited for
// by every other insert of it, as any new unique row is.
//
// Operators' and the leader's moves of tasks no runner holds lock the
// records first and then look (shardrun_lock_tasks): a look before the
// lock sees a snapshot, and the task may have moved since (a cancel once
// decided "waiting" from such a look and cancelled a task that was being
// claimed). The runners' writes need no lock on a record to know where it
// is: they hold its claim.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// placeOf is a row of CTE t, a tasks-shaped relation just updated, as the
// shardrun_place that shardrun_file files.
const placeOf = `row(t.id, t.shard, t.queue, t.kind, t.priority, t.run_after, t.deadline, t.state,
	t.unique_key, t.finished_at, t.sequence_key)::shardrun_place`

// fileTail is what follows a CTE t of tasks a move just updated: file
// them (shardrun_file, settling their sequences now). It defines the CTE
// filed, which the statement must read where it is sure to be evaluated:
// an unread CTE without a write is not run, and one read beside t, or
// under a condition, is not run when the plan finds nothing to join it
// to. So every statement ends "SELECT (SELECT count(*) FROM filed), …
// aggregates … FROM t": an aggregate yields one row whatever t holds, and
// its select list is evaluated for it.
const fileTail = `, filed AS (
			SELECT shardrun_file(ARRAY(SELECT ` + placeOf + ` FROM t), true)
		)`

// filedOnce is the first item of the select list of fileTail's statements.
const filedOnce = `(SELECT count(*) FROM filed)`

// ---- claim: lane -> claim ----

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
		WITH queue AS (
			SELECT q.paused_at FROM queues q WHERE q.name = $6 FOR KEY SHARE
		), cand AS MATERIALIZED (
			SELECT c.tid, s.shard, s.epoch FROM unnest($2::int[], $3::bigint[]) AS s(shard, epoch)
			CROSS JOIN LATERAL (` + lanes + `) c
			WHERE NOT EXISTS (SELECT 1 FROM queue WHERE paused_at IS NOT NULL)
			LIMIT $5
		), fence AS (
			-- The fences of the shards the candidates came from, found by
			-- (shard, epoch) (an epoch names one unit: shard_fences_unit_idx),
			-- whatever the runner holds: a runner of a small group holds
			-- thousands of shards.
			SELECT f.grp, f.shard, f.epoch FROM shard_fences f
			-- A fence row of a shard being moved to another database
			-- (moving) yields nothing: its tasks stay where they are for
			-- the move's copy.
			WHERE (f.shard, f.epoch) IN (SELECT DISTINCT shard, epoch FROM cand) AND f.owner = $1 AND NOT f.moving
			ORDER BY f.grp, f.shard
			FOR SHARE
		), del AS (
			DELETE FROM task_ready r
			WHERE r.ctid = ANY (ARRAY(SELECT tid FROM cand WHERE shard = ANY (ARRAY(SELECT shard FROM fence))))
			RETURNING r.id
		), units AS (
			-- Each fenced shard's epoch and group, looked up by the shard
			-- (a jsonb object: a binary search): a join of the claimed
			-- tasks to a CTE is planned as a nested loop that rescans the
			-- CTE for every task, quadratic in the claim (a claim of 500
			-- tasks took 4 times as long).
			SELECT jsonb_object_agg(f.shard::text, jsonb_build_array(f.epoch, f.grp)) AS m FROM fence f
		), picked AS MATERIALIZED (
			SELECT ` + claimColumns + `, ((SELECT m FROM units) -> t.shard::text ->> 0)::bigint AS epoch,
				(SELECT m FROM units) -> t.shard::text ->> 1 AS grp
			FROM tasks t
			WHERE t.id = ANY (ARRAY(SELECT id FROM del ORDER BY id)) AND t.state = 'ready'
		), ins AS (
			-- The first $8 tasks, in the order the claim returns them,
			-- start at once; the rest wait ahead of need (ahead: their
			-- handler has not started).
			INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt, deadline, grp, ahead)
			SELECT p.id, p.shard, p.queue, p.epoch, $1, p.attempt, p.deadline, p.grp,
				row_number() OVER (ORDER BY p.priority, p.run_after, p.id) > $8
			FROM picked p
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
// running under that shard's epoch; nothing while the queue is paused. It
// visits the shards in the order given and takes each one's tasks in
// (priority, run_after, id) order until it has limit: the caller rotates
// the order so that every shard is served, and leaves out shards it knows
// to be empty. Shards whose fence is not (owner, epoch) yield nothing.
//
// A claim reads only the lanes (shard, queue, kind) of the shards it visits
// and the kinds it handles: other runners' tasks and kinds nobody handles
// are never read, however many there are. It locks the fence rows of the
// shards it takes from FOR SHARE, so a new owner's fence raise waits for it,
// and its queue's row FOR KEY SHARE, so that a pause (SetQueuePaused, which
// locks the row FOR UPDATE) is a barrier: it waits for the claims under way,
// and a claim that locks the row after it sees the queue paused (the lock
// reads the row's newest version) and takes nothing. A queue without a row
// is not paused: the claim does not need the row to exist, so that no task
// can be stranded by a row removed under it (finding 7 of the hostile-input
// review: a producer's task committed after a removal that could not see
// it was never claimed). DeleteQueue and the producers keep a row for
// every queue with unfinished tasks anyway (shardrun_register_queues).
//
// The first startNow tasks of the result start at once; the others are
// claimed ahead of need (task_claims.ahead) until Started says their
// handler began: given back, requeued as orphans or swept stale before
// that, they keep their attempt, since no handler ran.
func (s *Store) Claim(ctx context.Context, owner string, owned []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error) {
	return s.claim(ctx, owner, owned, queue, kinds, limit, startNow, tasks.LeastUrgent)
}

// ClaimUrgent is Claim of the urgent tasks only (tasks.Urgent). The
// executor sends it first to the shards whose enqueue notifications said
// they got such tasks: Claim fills its limit from the first shard it
// visits, default-priority backlog included, so a round would serve one
// urgent shard and leave the others' urgent tasks behind whole backlogs.
func (s *Store) ClaimUrgent(ctx context.Context, owner string, owned []claims.ShardEpoch, queue string, kinds []string, limit, startNow int) ([]tasks.Task, error) {
	return s.claim(ctx, owner, owned, queue, kinds, limit, startNow, tasks.DefaultPriority-1)
}

// claim is Claim of the tasks of priority maxPriority or more urgent.
func (s *Store) claim(ctx context.Context, owner string, owned []claims.ShardEpoch, queue string, kinds []string, limit, startNow, maxPriority int) ([]tasks.Task, error) {
	if len(owned) == 0 || len(kinds) == 0 || limit <= 0 {
		return nil, nil
	}
	shards := make([]int32, len(owned))
	epochs := make([]int64, len(owned))
	for i, se := range owned {
		shards[i], epochs[i] = int32(se.Shard), se.Epoch
	}
	rows, err := s.pool.Query(ctx, claimQuery(len(kinds)), claimExecMode, owner, shards, epochs, kinds, limit, queue, maxPriority, max(startNow, 0))
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

// ---- the runner's writes about its claims ----

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
// (the owner), $2 (the ids, sorted) and $3 (a jsonb object from each id
// to [attempt, epoch, the extra columns' values]); locked, an array of the
// ids of the matching claim rows, locked in id order (the one lock order,
// whatever the plan), skipping those another transaction holds (a
// handler's transaction that recorded its completion, CompleteTx, and has
// not ended: no write of the runner waits for a transaction it does not
// control; the skipped claims are reported claims.Busy, and written again
// later); and the extra columns as RETURNING items of k,
// named as the columns. Each claim must be the one named: owner, epoch and
// attempt. The claims are found by primary key (k.id = ANY: a range of the
// batch's ids, never the table), and each one's values by its id in $3, a
// binary search over the object's keys. Looking them up by position in
// arrays (array_position) made a batch quadratic (a completion of 5,000
// tasks took 0.6 to 1.9 s), and so did a join to the input unnested in a
// CTE, planned as a nested loop that rescanned the CTE for every claim (a
// completion of 1,000 tasks took 266 ms instead of 70: noop throughput
// fell to a third, bench section throughput).
func claimMatch(owner string, refs []claims.Ref, extra []inputCol) (locked, returning string, args []any, err error) {
	order := make([]int, len(refs))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(refs[a].ID, refs[b].ID) })
	ids := make([]int64, len(refs))
	values := make(map[string][]any, len(refs))
	cols := make([]reflect.Value, len(extra))
	for j, col := range extra {
		cols[j] = reflect.ValueOf(col.values)
	}
	for i, o := range order {
		r := refs[o]
		ids[i] = r.ID
		v := make([]any, 2, 2+len(extra))
		v[0], v[1] = r.Attempt, r.Epoch
		for j := range extra {
			v = append(v, cols[j].Index(o).Interface())
		}
		values[strconv.FormatInt(r.ID, 10)] = v
	}
	m, err := json.Marshal(values)
	if err != nil {
		return "", "", nil, fmt.Errorf("encoding the values of %d claims: %w", len(refs), err)
	}
	args = []any{owner, ids, string(m)}
	for j, col := range extra {
		returning += fmt.Sprintf(", (($3::jsonb -> k.id::text) ->> %d)::%s AS %s", 2+j, col.sqlType, col.name)
	}
	locked = `ARRAY(SELECT k.id FROM task_claims k
		WHERE k.id = ANY ($2::bigint[]) AND k.owner = $1
		  AND k.attempt = (($3::jsonb -> k.id::text) ->> 0)::int AND k.epoch = (($3::jsonb -> k.id::text) ->> 1)::bigint
		  AND EXISTS (` + fenceHolds + `)
		ORDER BY k.id FOR UPDATE SKIP LOCKED)`
	return locked, returning, args, nil
}

// fenceHolds is a condition over the claim k: its unit's fence still holds
// its epoch. It is read, not locked: a raise that committed before the
// statement began refuses the write (FenceLost); one that commits while
// it runs has skipped the claim the write holds (RaiseFences), so the
// write is still the only one to end it.
const fenceHolds = `SELECT 1 FROM shard_fences f WHERE f.grp = k.grp AND f.shard = k.shard AND f.epoch = k.epoch`

// endClaims is the tail of every statement that ends claims. Given the CTE
// k of the task_claims rows the statement deleted (k.*, plus the columns
// it computed), it locks their tasks' records in id order, updates them
// with set (which reads k), and files them (fileTail). It defines the CTE
// t: the tasks as updated, with the claim's attempt and epoch, and marked,
// true for the claims whose handler had recorded its completion in its own
// transaction (CompleteTx: k.completed_at). Those are completed with the
// recorded result whatever set says: the handler's writes committed with
// that mark, so the attempt succeeded, whoever ends its claim — the
// runner, the next owner's orphan requeue or a sweep.
func endClaims(set string) string { return endClaimsOr(set, "") }

// endClaimsOr is endClaims where the claims of tasks claimed ahead of need
// whose handler never started (k.ahead) are updated with aheadSet instead
// of set (when aheadSet is not ""): the next owner's orphan requeue and the
// stale sweep give those back without spending their attempt.
func endClaimsOr(set, aheadSet string) string {
	// r locks the records in id order before the updates (an InitPlan of
	// it, run once): each update's own order is its plan's. The updates
	// change disjoint rows.
	plain := "k.completed_at IS NULL"
	branches := []struct{ cond, set, marked string }{{plain, set, "false"}}
	if aheadSet != "" {
		branches[0].cond = plain + " AND NOT k.ahead"
		branches = append(branches, struct{ cond, set, marked string }{plain + " AND k.ahead", aheadSet, "false"})
	}
	branches = append(branches, struct{ cond, set, marked string }{"k.completed_at IS NOT NULL", completedBy("k.completed_result"), "true"})
	out := `, r AS (
			SELECT id FROM tasks WHERE id = ANY (ARRAY(SELECT id FROM k)) ORDER BY id FOR UPDATE
		)`
	var names []string
	for i, b := range branches {
		name := "t" + strconv.Itoa(i)
		names = append(names, "SELECT * FROM "+name)
		out += `, ` + name + ` AS (
			UPDATE tasks t SET ` + b.set + `
			FROM k WHERE t.id = k.id AND ` + b.cond + ` AND t.state = 'ready' AND (SELECT count(*) FROM r) >= 0
			RETURNING t.*, k.attempt AS k_attempt, k.epoch AS k_epoch, ` + b.marked + ` AS marked
		)`
	}
	return out + `, t AS (
			` + strings.Join(names, " UNION ALL ") + `
		)` + fileTail
}

// completedBy is the SET list of a completion of claim k with result (an
// SQL expression of jsonb).
func completedBy(result string) string {
	return `state = 'completed', result = ` + result + `, finished_at = now(), ` + claimEvidence
}

// claimEvidence is the SET list that records the claim in a task that
// finishes: who ran its last attempt, under which epoch, and when.
const claimEvidence = `claimed_by = k.owner, claim_epoch = k.epoch, claimed_at = k.claimed_at,
	heartbeat_at = coalesce(k.heartbeat_at, k.claimed_at)`

// endClaimsOf is the shape of the runner's own writes that end attempts:
// its claims matching refs (task, owner, epoch, attempt) are deleted, and
// their tasks updated with set (see endClaims), in one statement.
func (s *Store) endClaimsOf(ctx context.Context, what, name, owner string, refs []claims.Ref,
	set string, extra ...inputCol) ([]claims.WriteResult, error) {
	return s.endClaimsOn(ctx, s.pool, what, name, owner, refs, set, extra...)
}

func (s *Store) endClaimsOn(ctx context.Context, q querier, what, name, owner string, refs []claims.Ref,
	set string, extra ...inputCol) ([]claims.WriteResult, error) {
	if len(refs) == 0 {
		return nil, nil
	}
	if rounds := distinctRounds(refs); len(rounds) > 1 {
		return s.inRounds(ctx, refs, extra, rounds, func(refs []claims.Ref, extra []inputCol) ([]claims.WriteResult, error) {
			return s.endClaimsOn(ctx, q, what, name, owner, refs, set, extra...)
		})
	}
	locked, returning, args, err := claimMatch(owner, refs, extra)
	if err != nil {
		return nil, err
	}
	sql := `/* shardrun.` + name + ` */
		WITH k AS (
			DELETE FROM task_claims k WHERE k.id = ANY (` + locked + `)
			RETURNING k.*` + returning + `
		)` + endClaims(set) + `
		SELECT ` + filedOnce + `, coalesce(array_agg(t.id), '{}'), coalesce(array_agg(t.k_attempt), '{}'),
			coalesce(array_agg(t.k_epoch), '{}'), coalesce(array_agg(t.state), '{}'),
			coalesce(array_agg(t.cancel_requested_at IS NOT NULL), '{}'), coalesce(array_agg(t.marked), '{}')
		FROM t`
	return s.claimResultsOn(ctx, q, what, owner, refs, sql, args)
}

// distinctRounds splits refs (by index) into rounds in which no task
// appears twice: claimMatch looks each claim's values up by its id, and a
// batch may hold a stale attempt and the current one of the same task (a
// handler of an old epoch that returned late), of which at most one can
// match. Almost every batch is one round.
func distinctRounds(refs []claims.Ref) [][]int {
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
func (s *Store) inRounds(ctx context.Context, refs []claims.Ref, extra []inputCol, rounds [][]int,
	write func([]claims.Ref, []inputCol) ([]claims.WriteResult, error)) ([]claims.WriteResult, error) {
	results := make([]claims.WriteResult, len(refs))
	for _, round := range rounds {
		sub := make([]claims.Ref, len(round))
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

// claimResults runs a write about the claims of refs, which answers one
// row: a count to ignore, then the ids, attempts, epochs, states, cancel
// requests and completion marks (the handler had recorded its completion:
// CompleteTx) of the claims it applied to, as arrays; and says, for each
// of refs, whether it applied and why not. A claim whose mark completed it
// is reported claims.Completed, whatever the write asked.
func (s *Store) claimResults(ctx context.Context, what, owner string, refs []claims.Ref, sql string, args []any) ([]claims.WriteResult, error) {
	return s.claimResultsOn(ctx, s.pool, what, owner, refs, sql, args)
}

func (s *Store) claimResultsOn(ctx context.Context, q querier, what, owner string, refs []claims.Ref, sql string, args []any) ([]claims.WriteResult, error) {
	var filed int64
	var ids, epochs []int64
	var attempts []int32
	var states []string
	var requested, marked []bool
	if err := q.QueryRow(ctx, sql, args...).Scan(&filed, &ids, &attempts, &epochs, &states, &requested, &marked); err != nil {
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
		marked          bool
	}
	applied := make(map[claim]after, len(refs))
	for i := range ids {
		applied[claim{ids[i], attempts[i], epochs[i]}] = after{tasks.State(states[i]), requested[i], marked[i]}
	}
	results := make([]claims.WriteResult, len(refs))
	var missed []int
	for i, r := range refs {
		results[i].Ref = r
		if a, ok := applied[claim{r.ID, int32(r.Attempt), r.Epoch}]; ok {
			results[i].State, results[i].CancelRequested = a.state, a.cancelRequested
			if a.marked {
				results[i].Outcome = claims.Completed
			}
		} else {
			missed = append(missed, i)
		}
	}
	if len(missed) > 0 {
		if _, err := s.classify(ctx, owner, results, missed); err != nil {
			return nil, fmt.Errorf("%s %d tasks: %w", what, len(refs), err)
		}
	}
	return results, nil
}

// classify explains why writes did not apply: the attempt's completion is
// recorded already, the fence moved (or was never ours), the claim is
// still there but another transaction holds it (Busy: the write skipped
// it), the task is gone, or the task moved on. A fence that moved wins
// over a claim still held: the writer must stop working on the shard,
// and the new owner requeues the claim once it is free.
//
// A write at a shard the database does not hold (its placement row is
// not held: the shard moved, or is moving, to another database) is Busy,
// whatever else is true, never FenceLost: the fence rows left with the
// shard (or are the move's to copy), and the writer writes again once the
// shard → database map sends the write to the shard's database. moved
// lists those results (indexes of results).
func (s *Store) classify(ctx context.Context, owner string, results []claims.WriteResult, missed []int) (moved []int, err error) {
	ids := make([]int64, len(missed))
	shards := make([]int32, len(missed))
	epochs := make([]int64, len(missed))
	attempts := make([]int32, len(missed))
	for i, m := range missed {
		r := results[m].Ref
		ids[i], shards[i], epochs[i], attempts[i] = r.ID, int32(r.Shard), r.Epoch, int32(r.Attempt)
	}
	// A fence still holds the writer's term when a fence row of the shard
	// has its epoch and owner: an epoch is an etcd revision, so it names one
	// unit (group and shard) and one term of it.
	rows, err := s.pool.Query(ctx, `/* shardrun.classify */
		SELECT c.id, t.id IS NOT NULL,
			EXISTS (SELECT 1 FROM shard_fences f WHERE f.shard = c.shard AND f.epoch = c.epoch AND f.owner = $4),
			coalesce(t.state = 'completed' AND t.claimed_by = $4 AND t.claim_epoch = c.epoch AND t.attempt = c.attempt, false),
			EXISTS (SELECT 1 FROM task_claims k WHERE k.id = c.id AND k.owner = $4 AND k.epoch = c.epoch AND k.attempt = c.attempt),
			`+placedHere("c.shard")+`
		FROM unnest($1::bigint[], $2::int[], $3::bigint[], $5::int[]) WITH ORDINALITY AS c(id, shard, epoch, attempt, n)
		LEFT JOIN tasks t ON t.id = c.id
		ORDER BY c.n`, ids, shards, epochs, owner, attempts)
	if err != nil {
		return nil, fmt.Errorf("classifying rejected writes: %w", err)
	}
	i := 0
	var id int64
	var exists, fenced, completed, held, placed bool
	_, err = pgx.ForEachRow(rows, []any{&id, &exists, &fenced, &completed, &held, &placed}, func() error {
		res := &results[missed[i]]
		i++
		switch {
		case completed:
			res.Outcome, res.State = claims.Completed, tasks.Completed
		case !placed:
			res.Outcome = claims.Busy
			moved = append(moved, missed[i-1])
		case !fenced:
			res.Outcome = claims.FenceLost
		case held:
			res.Outcome = claims.Busy
		case !exists:
			res.Outcome = claims.TaskGone
		default:
			res.Outcome = claims.TaskMoved
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("classifying rejected writes: %w", err)
	}
	return moved, nil
}

// placedHere is an SQL condition over a shard (an SQL expression): the
// database holds it. A shard without a placement row is held in a
// database of a cluster of one database (or not registered yet: the rows
// are filled where the shard count becomes known), and not held in one
// of several databases.
func placedHere(shard string) string {
	return `coalesce((SELECT p.state = 'held' FROM shardrun_placement p WHERE p.shard = ` + shard + `),
				coalesce((SELECT c.databases FROM shardrun_cluster c WHERE c.id = 1), 1) = 1)`
}

// Heartbeat records that the runner is still working on these attempts, in
// one statement that touches only their claim rows. Each result says
// whether an operator asked to cancel the task meanwhile (CancelRequested):
// that is how a cancel request reaches whichever runner runs the task,
// within one heartbeat interval. A claim another transaction holds (a
// handler's, after CompleteTx) is skipped and reported claims.Busy: one
// slow transaction never holds up the heartbeats of the runner's other
// attempts, and a sweep skips a claim held so too.
func (s *Store) Heartbeat(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	return s.touchClaims(ctx, "heartbeating", "heartbeat", owner, refs, "heartbeat_at = now()")
}

// Started records that the handlers of these attempts, claimed ahead of
// need (Claim's startNow), have started: from now on an orphan requeue or
// a stale sweep of their claims spends their attempt. Claims another
// transaction holds are reported claims.Busy.
func (s *Store) Started(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	return s.touchClaims(ctx, "recording the start of", "started", owner, refs, "ahead = false")
}

// touchClaims updates the claim rows of refs with set, leaving their tasks
// where they are (running), in one statement.
func (s *Store) touchClaims(ctx context.Context, what, name, owner string, refs []claims.Ref, set string) ([]claims.WriteResult, error) {
	if len(refs) == 0 {
		return nil, nil
	}
	if rounds := distinctRounds(refs); len(rounds) > 1 {
		return s.inRounds(ctx, refs, nil, rounds, func(refs []claims.Ref, _ []inputCol) ([]claims.WriteResult, error) {
			return s.touchClaims(ctx, what, name, owner, refs, set)
		})
	}
	locked, _, args, err := claimMatch(owner, refs, nil)
	if err != nil {
		return nil, err
	}
	return s.claimResults(ctx, what, owner, refs, `/* shardrun.`+name+` */
		WITH k AS (
			UPDATE task_claims k SET `+set+`
			WHERE k.id = ANY (`+locked+`)
			RETURNING k.id, k.attempt, k.epoch, (SELECT t.cancel_requested_at IS NOT NULL FROM tasks t WHERE t.id = k.id) AS requested
		)
		SELECT 0, coalesce(array_agg(k.id), '{}'), coalesce(array_agg(k.attempt), '{}'), coalesce(array_agg(k.epoch), '{}'),
			coalesce(array_agg('running'::text), '{}'), coalesce(array_agg(k.requested), '{}'), coalesce(array_agg(false), '{}')
		FROM k`, args)
}

// Claimed lists the running tasks claimed by owner under the given terms.
// After a claim statement whose answer was lost (it may have committed),
// the runner gives back those it is not running, with Unclaim, instead of
// leaving them to go stale and spend an attempt.
func (s *Store) Claimed(ctx context.Context, owner string, terms []claims.ShardEpoch) ([]claims.Ref, error) {
	if len(terms) == 0 {
		return nil, nil
	}
	shards, epochs := splitSorted(terms)
	rows, err := s.pool.Query(ctx, `/* shardrun.claimed */
		SELECT k.id, k.shard, k.attempt, k.epoch FROM unnest($2::int[], $3::bigint[]) AS o(shard, epoch)
		JOIN task_claims k ON k.shard = o.shard AND k.epoch = o.epoch
		WHERE k.owner = $1`,
		owner, shards, epochs)
	if err != nil {
		return nil, fmt.Errorf("listing the claims of %d shards: %w", len(terms), err)
	}
	refs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (claims.Ref, error) {
		var ref claims.Ref
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
func (s *Store) Unclaim(ctx context.Context, owner string, refs []claims.Ref) ([]claims.WriteResult, error) {
	return s.endClaimsOf(ctx, "unclaiming", "unclaim", owner, refs, requeueOrCancel("t.run_after"))
}

// CancelAttempts records attempts cancelled on request (the heartbeat
// reported the request, the runner cancelled the handler's context and the
// handler returned an error; a success is recorded by Complete): cancelled
// under the same claim. A completion or failure that landed first wins:
// the claim is then gone and the cancellation changes nothing, so each
// attempt has exactly one outcome. The attempt is recorded in the task's
// errors with what the handler returned.
func (s *Store) CancelAttempts(ctx context.Context, owner string, cancelled []claims.Cancellation) ([]claims.WriteResult, error) {
	refs := make([]claims.Ref, len(cancelled))
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
	refs := make([]claims.Ref, len(cut))
	msgs := make([]string, len(cut))
	for i, c := range cut {
		refs[i], msgs[i] = c.Ref, StorableText(c.Reason)
	}
	return s.endClaimsOf(ctx, "interrupting", "interrupt", owner, refs, interrupted("k.msg"), inputCol{"msg", "text", msgs})
}

// interrupted is the SET list of an attempt given back without being spent
// (requeueOrCancel), with why (an SQL expression of text) appended to the
// task's history as an interruption.
func interrupted(why string) string {
	return requeueOrCancel("now()") + `,
		errors = t.errors || jsonb_build_array(jsonb_build_object(
			'attempt', t.attempt, 'at', now(), 'runner', k.owner, 'error', ` + why + `, 'interrupted', true))`
}

// Complete records successful attempts, in one statement.
func (s *Store) Complete(ctx context.Context, owner string, done []claims.Completion) ([]claims.WriteResult, error) {
	return s.complete(ctx, s.pool, owner, done)
}

// CompleteTx records a successful attempt inside tx, a handler's own
// transaction, so that the handler's writes and the task's completion
// commit together or not at all. It is a fenced write: it applies only
// while the attempt's claim is the runner's (owner, epoch, attempt), and
// otherwise says why (FenceLost, TaskMoved…; the caller rolls tx back).
//
// It writes one thing in tx: a mark on the attempt's claim row
// (completed_at, completed_result). That row is the only one tx locks, and
// nothing but the task's own completion waits for it: the runner's
// heartbeats and writes, the next owner's fence raise and orphan requeue
// and the sweeps skip a claim another transaction holds and come back to
// it. Whoever ends the claim afterwards completes the task with the mark
// (endClaims): the runner's own completion when the handler returns, or,
// if the runner is gone, the next owner's orphan requeue or a sweep.
//
// Marking bounds the rest of tx (bound: HandlerTxTimeout): each later
// statement by statement_timeout, each pause between them by
// idle_in_transaction_session_timeout, and a lock wait of the mark itself
// by lock_timeout, all SET LOCAL. A transaction that overruns is ended by
// PostgreSQL, its writes and the mark rolled back, and the attempt is
// retried like any lost one, so a handler that leaves its transaction
// open, or a process frozen inside it, holds the task's claim no longer
// than that.
//
// Marking the same attempt again in tx is harmless (Applied); a mark
// committed by an earlier transaction is reported claims.Completed, and
// tx must not commit its writes a second time.
func (s *Store) CompleteTx(ctx context.Context, tx pgx.Tx, owner string, done claims.Completion) (claims.WriteResult, error) {
	ms := max(s.handlerTxTimeout.Milliseconds(), 1)
	if _, err := tx.Exec(ctx, `/* shardrun.complete_tx_bounds */
		SELECT set_config('statement_timeout', $1, true), set_config('idle_in_transaction_session_timeout', $1, true),
			set_config('lock_timeout', $1, true)`, strconv.FormatInt(ms, 10)); err != nil {
		return claims.WriteResult{}, fmt.Errorf("bounding the transaction that completes task %d: %w", done.Ref.ID, err)
	}
	r := done.Ref
	var result *string
	if done.Result != nil {
		v := string(done.Result)
		result = &v
	}
	// This transaction's marks are listed in a setting local to it (and
	// to its savepoints), so that marking again here is told from a mark
	// an earlier transaction committed.
	var earlier bool
	err := tx.QueryRow(ctx, `/* shardrun.complete_tx */
		WITH m AS (
			SELECT k.id, k.completed_at IS NOT NULL
				AND strpos(coalesce(current_setting('shardrun.completed', true), ''), ',' || k.id || ':' || k.attempt || ',') = 0 AS earlier
			FROM task_claims k
			WHERE k.id = $1 AND k.owner = $2 AND k.epoch = $3 AND k.attempt = $4 AND EXISTS (`+fenceHolds+`)
			FOR NO KEY UPDATE
		), u AS (
			UPDATE task_claims k SET completed_at = now(), completed_result = $5::jsonb
			FROM m WHERE k.id = m.id AND NOT m.earlier
			RETURNING set_config('shardrun.completed',
				coalesce(nullif(current_setting('shardrun.completed', true), ''), ',') || k.id || ':' || k.attempt || ',', true)
		)
		SELECT m.earlier FROM m WHERE (SELECT count(*) FROM u) >= 0`, r.ID, owner, r.Epoch, r.Attempt, result).Scan(&earlier)
	res := claims.WriteResult{Ref: r, State: tasks.Running}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		results := []claims.WriteResult{{Ref: r}}
		moved, err := s.classify(ctx, owner, results, []int{0})
		if err != nil {
			return claims.WriteResult{}, fmt.Errorf("completing task %d in a transaction: %w", r.ID, err)
		}
		if len(moved) > 0 {
			// The claim is not here to mark: the shard moved on to
			// another database (or is arriving, not yet held). The
			// handler's transaction must not commit its writes here; the
			// attempt is interrupted, not spent (its runner writes the
			// interruption at the shard's database).
			return claims.WriteResult{}, fmt.Errorf("completing task %d in a transaction: shard %d is not held by this database: %w",
				r.ID, r.Shard, tasks.ErrShardMoved)
		}
		return results[0], nil
	case err != nil:
		return claims.WriteResult{}, fmt.Errorf("completing task %d in a transaction: %w", r.ID, err)
	case earlier:
		res.Outcome = claims.Completed
	}
	return res, nil
}

func (s *Store) complete(ctx context.Context, q querier, owner string, done []claims.Completion) ([]claims.WriteResult, error) {
	refs := make([]claims.Ref, len(done))
	results := make([]*string, len(done))
	for i, d := range done {
		refs[i] = d.Ref
		if d.Result != nil {
			r := string(d.Result)
			results[i] = &r
		}
	}
	return s.endClaimsOn(ctx, q, "completing", "complete", owner, refs,
		`state = 'completed', result = k.result::jsonb, finished_at = now(), `+claimEvidence,
		inputCol{"result", "text", results})
}

// Fail records failed attempts, in one statement: each task goes back to
// ready with attempt+1 after its backoff (shardrun_backoff with the
// failure's Backoff), or to dead when its attempts are used up (or the
// failure is Final), or to failed when its deadline passed (Expired). The
// error text is appended to the task's errors.
func (s *Store) Fail(ctx context.Context, owner string, failed []claims.Failure) ([]claims.WriteResult, error) {
	refs := make([]claims.Ref, len(failed))
	msgs := make([]string, len(failed))
	bases, caps := make([]int64, len(failed)), make([]int64, len(failed))
	finals := make([]bool, len(failed))
	expired := make([]bool, len(failed))
	for i, f := range failed {
		refs[i], msgs[i], finals[i], expired[i] = f.Ref, StorableText(f.Error), f.Final, f.Expired
		bases[i], caps[i] = f.Backoff.Base.Milliseconds(), f.Backoff.Cap.Milliseconds()
	}
	return s.endClaimsOf(ctx, "failing", "fail", owner, refs,
		retryOrBuryUnless("k.final", "k.expired", "now() + shardrun_backoff("+budgetAttempt+", k.base_ms, k.cap_ms)", "k.msg"),
		inputCol{"msg", "text", msgs}, inputCol{"base_ms", "bigint", bases}, inputCol{"cap_ms", "bigint", caps},
		inputCol{"final", "boolean", finals}, inputCol{"expired", "boolean", expired})
}

// budgetAttempt is the number of the failing attempt within the task's
// current attempt budget (SQL over the task t): a retry grants a fresh
// budget, and the backoff counts from its start, not from the task's
// first attempt ever.
const budgetAttempt = `(t.attempt - (t.max_attempts - coalesce(t.attempt_budget, t.max_attempts)))`

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

// ---- orphan requeue: claim -> lane | finished ----

// RaiseFences records the runner's ownership of the shards of its group at
// the given epochs (each unit, group and shard, has its fence), returns
// those whose fence now holds that epoch (Raised), and in the same
// transaction requeues the claims earlier owners of the units left on them
// (their owner is gone by construction): to ready with attempt+1, or dead
// when the attempts are used up; with the same attempt when their handler
// never started (claimed ahead); completed when their handler had recorded
// its completion (CompleteTx). A shard whose fence is already newer is left
// alone and not returned: the caller no longer owns it. Raising the epoch
// the fence already holds is idempotent.
//
// The requeue skips claims another transaction holds — an old owner's
// write under way, or a handler's transaction that recorded its
// completion and has not ended — and reports their terms Pending: the
// raise never waits for a transaction it does not control, so one open
// transaction cannot hold up the new owner's claims on any shard. The
// caller requeues them later (RequeueOrphans). Whichever of the held
// claim's transaction and the later requeue comes first ends the claim;
// the other finds it gone, so each attempt still has one outcome, and no
// task of a held claim is in a lane meanwhile: nothing claims it twice.
//
// Claims lock the fence rows of the shards they take from FOR SHARE, so
// the raise waits for a claim under the old epoch (a statement, never a
// transaction of a program's) and the requeue then sees what it claimed.
//
// A term whose shard the database does not hold (placement not held: it
// moved, or is moving, to another database) is neither raised nor lost:
// it is named in Orphans.Moved, to raise again once the map says where
// the shard is.
func (s *Store) RaiseFences(ctx context.Context, owner, group string, owned []claims.ShardEpoch) (claims.Orphans, error) {
	var out claims.Orphans
	if len(owned) == 0 {
		return out, nil
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		held, moved, err := placeTerms(ctx, tx, owned)
		if err != nil {
			return err
		}
		out.Moved = moved
		if len(held) == 0 {
			return nil
		}
		shards, epochs := splitSorted(held)
		rows, err := tx.Query(ctx, `/* shardrun.raise_fences */
			INSERT INTO shard_fences AS f (grp, shard, epoch, owner)
			SELECT $4, shard, epoch, $3 FROM unnest($1::int[], $2::bigint[]) AS o(shard, epoch) ORDER BY shard
			ON CONFLICT (grp, shard) DO UPDATE SET epoch = excluded.epoch, owner = excluded.owner, raised_at = now()
			WHERE f.epoch <= excluded.epoch
			RETURNING shard, epoch`, shards, epochs, owner, group)
		if err != nil {
			return err
		}
		out.Raised, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (claims.ShardEpoch, error) {
			var se claims.ShardEpoch
			err := r.Scan(&se.Shard, &se.Epoch)
			return se, err
		})
		if err != nil || len(out.Raised) == 0 {
			return err
		}
		return requeueOrphans(ctx, tx, owner, group, out.Raised, false, &out)
	})
	if err != nil {
		return claims.Orphans{}, fmt.Errorf("raising fences of %d shards: %w", len(owned), err)
	}
	return out, nil
}

// RequeueOrphans requeues the earlier owners' claims of terms, raised
// already, that a RaiseFences or an earlier RequeueOrphans skipped because
// a transaction held them (Orphans.Pending), as RaiseFences does, and says
// which terms still have some. Terms whose fence no longer holds the
// runner's epoch are left to their newer owner. Terms whose shard the
// database does not hold are named Moved and Pending: requeue them again
// once the map says where the shard is.
func (s *Store) RequeueOrphans(ctx context.Context, owner, group string, terms []claims.ShardEpoch) (claims.Orphans, error) {
	var out claims.Orphans
	if len(terms) == 0 {
		return out, nil
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		held, moved, err := placeTerms(ctx, tx, terms)
		if err != nil {
			return err
		}
		out.Moved = moved
		out.Pending = append(out.Pending, moved...)
		if len(held) == 0 {
			return nil
		}
		return requeueOrphans(ctx, tx, owner, group, held, true, &out)
	})
	if err != nil {
		return claims.Orphans{}, fmt.Errorf("requeueing the orphans of %d shards: %w", len(terms), err)
	}
	return out, nil
}

// placeTerms splits terms into those whose shard the database holds and
// those it does not (moved: its placement row is not held, or it has none
// in a database of several), in shard order. In a database of several it
// locks the placement rows FOR SHARE until the caller's transaction ends:
// a move's leave step (which takes them FOR UPDATE NOWAIT) then waits for
// no raise, and no raise lands after a leave committed.
func placeTerms(ctx context.Context, tx pgx.Tx, terms []claims.ShardEpoch) (held, moved []claims.ShardEpoch, err error) {
	shards, _ := splitSorted(terms)
	rows, err := tx.Query(ctx, `/* shardrun.place_terms */
		SELECT o.shard, coalesce(pl.held, d.one)
		FROM unnest($1::int[]) WITH ORDINALITY AS o(shard, n)
		CROSS JOIN (SELECT coalesce((SELECT c.databases FROM shardrun_cluster c WHERE c.id = 1), 1) = 1 AS one) d
		LEFT JOIN LATERAL (
			SELECT p.state = 'held' AS held FROM shardrun_placement p WHERE p.shard = o.shard AND NOT d.one FOR SHARE
		) pl ON true
		ORDER BY o.n`, shards)
	if err != nil {
		return nil, nil, fmt.Errorf("reading the placement of %d shards: %w", len(shards), err)
	}
	here := make(map[int]bool, len(shards))
	var shard int32
	var ok bool
	if _, err := pgx.ForEachRow(rows, []any{&shard, &ok}, func() error {
		here[int(shard)] = ok
		return nil
	}); err != nil {
		return nil, nil, fmt.Errorf("reading the placement of %d shards: %w", len(shards), err)
	}
	for _, t := range terms {
		if here[t.Shard] {
			held = append(held, t)
		} else {
			moved = append(moved, t)
		}
	}
	return held, moved, nil
}

// orphanMessage is the history entry of a requeued orphan (k.msg).
const orphanMessage = `format('orphaned: shard %s moved from epoch %s to %s', k.shard, k.epoch,
					(SELECT m FROM epochs) ->> k.shard::text)`

// requeueOrphans requeues, in one statement, the claims of terms' shards
// made by earlier owners of group's units (epoch older than the term's),
// skipping those another transaction holds, and adds what it did to out;
// out.Pending gets the terms where some were skipped. checkFence: only
// where the fence still holds (owner, epoch), locked FOR SHARE meanwhile.
func requeueOrphans(ctx context.Context, q querier, owner, group string, terms []claims.ShardEpoch, checkFence bool, out *claims.Orphans) error {
	shards, epochs := splitSorted(terms)
	fenced := ""
	args := []any{shards, epochs, group}
	if checkFence {
		fenced = ` JOIN shard_fences f ON f.grp = $3 AND f.shard = o.shard AND f.epoch = o.epoch AND f.owner = $4`
		args = append(args, owner)
	}
	rows, err := q.Query(ctx, `/* shardrun.requeue_orphans */
		WITH o AS MATERIALIZED (
			SELECT o.shard, o.epoch FROM unnest($1::int[], $2::bigint[]) AS o(shard, epoch)`+fenced+`
			ORDER BY o.shard`+map[bool]string{true: ` FOR SHARE OF f`}[checkFence]+`
		), epochs AS (
			-- The new epochs by shard, for the message (see claimMatch:
			-- no join of the claims to a CTE).
			SELECT jsonb_object_agg(o.shard::text, o.epoch) AS m FROM o
		), orphans AS MATERIALIZED (
			SELECT c.id, c.shard FROM o JOIN task_claims c ON c.shard = o.shard AND c.epoch < o.epoch
			WHERE c.grp = $3
		), k AS (
			DELETE FROM task_claims k WHERE k.id = ANY (ARRAY(
				SELECT c.id FROM task_claims c WHERE c.id = ANY (ARRAY(SELECT id FROM orphans))
				ORDER BY c.id FOR UPDATE SKIP LOCKED))
			RETURNING k.*, `+orphanMessage+` AS msg
		)`+endClaimsOr(retryOrBury("now()", "k.msg"), interrupted("k.msg || ' before its handler started'"))+`
		SELECT `+filedOnce+`, count(*) FILTER (WHERE t.state = 'ready'), count(*) FILTER (WHERE t.state = 'dead'),
			count(*) FILTER (WHERE t.marked),
			ARRAY(SELECT DISTINCT p.shard FROM orphans p WHERE p.id <> ALL (ARRAY(SELECT id FROM k)) ORDER BY 1)
		FROM t`, args...)
	if err != nil {
		return err
	}
	var filed, requeued, dead, completed int64
	var pending []int32
	if _, err := pgx.ForEachRow(rows, []any{&filed, &requeued, &dead, &completed, &pending}, func() error { return nil }); err != nil {
		return fmt.Errorf("requeueing orphans: %w", err)
	}
	out.Requeued += requeued
	out.Dead += dead
	out.Completed += completed
	epochOf := make(map[int]int64, len(terms))
	for _, t := range terms {
		epochOf[t.Shard] = t.Epoch
	}
	for _, sh := range pending {
		out.Pending = append(out.Pending, claims.ShardEpoch{Shard: int(sh), Epoch: epochOf[int(sh)]})
	}
	return nil
}

// splitSorted returns the shards and epochs of owned ordered by shard, so
// that every statement locks fence rows in the same order.
func splitSorted(owned []claims.ShardEpoch) ([]int32, []int64) {
	sorted := slices.Clone(owned)
	slices.SortFunc(sorted, func(a, b claims.ShardEpoch) int { return a.Shard - b.Shard })
	shards := make([]int32, len(sorted))
	epochs := make([]int64, len(sorted))
	for i, se := range sorted {
		shards[i], epochs[i] = int32(se.Shard), se.Epoch
	}
	return shards, epochs
}

// ---- the leader's sweeps ----

// Backoff parameterises the SQL backoff (shardrun_backoff) of stale claims
// and failed attempts: the retry policy's Base and Cap.
type Backoff = claims.Backoff

// ErrNotLeader is returned by the sweeps when the coordinator fence holds
// another leadership epoch: the caller has been deposed.
var ErrNotLeader = errors.New("store: coordinator fence holds a newer leader")

// leaderFence is the CTE that locks the coordinator fence FOR SHARE when it
// holds epoch $1; sweeps apply only if it yields a row.
const leaderFence = `lf AS (SELECT epoch FROM coordinator_fence WHERE id = 1 AND epoch = $1 FOR SHARE)`

// SkipRunning as SweepDeadlines' runningGrace sweeps unclaimed tasks only.
const SkipRunning time.Duration = -1

// SweepDeadlines fails up to limit unfinished tasks whose deadline passed
// and returns how many, under the leadership epoch (ErrNotLeader if it is
// not the fence's): tasks in a lane or waiting in a sequence at once,
// running ones only runningGrace after their deadline. A running task's
// runner ends its handler at the deadline and records the outcome itself;
// the sweep is the backstop for a runner that is gone, and the grace lets
// the success of a handler that returned before its deadline land even
// when its write was delayed (a database outage). A task whose cancel was
// requested ends cancelled, as every other leader sweep ends it. Rows
// locked by a concurrent write are skipped for this pass. A negative
// runningGrace (SkipRunning) leaves running tasks alone: the sweeper's
// outage grace, when their runners' writes may still be on the way.
func (s *Store) SweepDeadlines(ctx context.Context, epoch int64, runningGrace time.Duration, limit int) (int64, error) {
	var fenced bool
	var unclaimed int64
	err := s.pool.QueryRow(ctx, `/* shardrun.sweep_deadlines_unclaimed */
		WITH `+leaderFence+`, due AS (
			(SELECT r.id, r.deadline FROM task_ready r WHERE r.deadline < now() ORDER BY r.deadline LIMIT $2)
			UNION ALL
			(SELECT w.id, w.deadline FROM task_waiting w WHERE w.deadline < now() ORDER BY w.deadline LIMIT $2)
		)
		SELECT EXISTS (SELECT 1 FROM lf),
			CASE WHEN EXISTS (SELECT 1 FROM lf)
			     THEN shardrun_expire(ARRAY(SELECT id FROM due ORDER BY deadline LIMIT $2), 'failed', 'deadline exceeded')
			     ELSE 0 END`, epoch, limit).Scan(&fenced, &unclaimed)
	if err != nil {
		return 0, fmt.Errorf("sweeping deadlines of unclaimed tasks: %w", err)
	}
	if !fenced {
		return 0, ErrNotLeader
	}
	if runningGrace < 0 || unclaimed >= int64(limit) {
		return unclaimed, nil
	}
	var running int64
	err = s.pool.QueryRow(ctx, `/* shardrun.sweep_deadlines_running */
		WITH `+leaderFence+`, k AS (
			DELETE FROM task_claims k WHERE k.id = ANY (ARRAY(
				SELECT c.id FROM task_claims c
				WHERE c.deadline < now() - $3 * interval '1 millisecond' AND EXISTS (SELECT 1 FROM lf)
				ORDER BY c.id LIMIT $2 FOR UPDATE SKIP LOCKED))
			RETURNING k.*
		)`+endClaims(`
			state = CASE WHEN t.cancel_requested_at IS NULL THEN 'failed' ELSE 'cancelled' END,
			finished_at = now(), `+claimEvidence+`,
			errors = t.errors || jsonb_build_array(jsonb_build_object(
				'attempt', t.attempt, 'at', now(), 'runner', k.owner, 'error',
				CASE WHEN t.cancel_requested_at IS NULL THEN 'deadline exceeded'
				     ELSE 'cancelled on request; its deadline passed while its runner was away' END))`)+`
		SELECT EXISTS (SELECT 1 FROM lf), `+filedOnce+`, count(*) FROM t`,
		epoch, limit-int(unclaimed), runningGrace.Milliseconds()).Scan(&fenced, nil, &running)
	if err != nil {
		return unclaimed, fmt.Errorf("sweeping deadlines of running tasks: %w", err)
	}
	if !fenced {
		return unclaimed, ErrNotLeader
	}
	return unclaimed + running, nil
}

// SweepStale requeues up to limit running tasks whose last sign of life —
// the last heartbeat, or the claim when there was none — is older than
// threshold: to ready with attempt+1 after a backoff, or to dead when the
// attempts are used up; a task claimed ahead whose handler never started
// goes back with its attempt, and one whose handler recorded its
// completion (CompleteTx) is completed. Tasks past their deadline are left to SweepDeadlines
// (deadline wins over staleness). It applies under the leadership epoch only
// (ErrNotLeader otherwise). It reads task_claims, one row per running task
// (bounded by the runners' workers), until it has limit stale ones, in id
// order: each pass takes them all in batches.
func (s *Store) SweepStale(ctx context.Context, epoch int64, threshold time.Duration, limit int, b Backoff) (requeued, dead int64, err error) {
	var fenced bool
	err = s.pool.QueryRow(ctx, `/* shardrun.sweep_stale */
		WITH `+leaderFence+`, k AS (
			DELETE FROM task_claims k WHERE k.id = ANY (ARRAY(
				SELECT c.id FROM task_claims c
				WHERE c.claimed_at < now() - $2 * interval '1 millisecond'
				  AND coalesce(c.heartbeat_at, c.claimed_at) < now() - $2 * interval '1 millisecond'
				  AND (c.deadline IS NULL OR c.deadline >= now())
				  AND EXISTS (SELECT 1 FROM lf)
				ORDER BY c.id LIMIT $3 FOR UPDATE SKIP LOCKED))
			RETURNING k.*, format('stale claim: no sign of life since %s', coalesce(k.heartbeat_at, k.claimed_at)) AS msg
		)`+endClaimsOr(retryOrBury("now() + shardrun_backoff("+budgetAttempt+", $4, $5)", "k.msg"),
		interrupted("k.msg || ' before its handler started'"))+`
		SELECT EXISTS (SELECT 1 FROM lf), `+filedOnce+`,
		       count(*) FILTER (WHERE t.state = 'ready'), count(*) FILTER (WHERE t.state = 'dead')
		FROM t`,
		epoch, threshold.Milliseconds(), limit, b.Base.Milliseconds(), b.Cap.Milliseconds()).Scan(&fenced, nil, &requeued, &dead)
	if err != nil {
		return 0, 0, fmt.Errorf("sweeping stale claims: %w", err)
	}
	if !fenced {
		return 0, 0, ErrNotLeader
	}
	return requeued, dead, nil
}

// FailUnrunnable fails up to limit ready tasks of class c (a queue and a
// kind no attached runner can run) that have been due (run_after) for
// longer than dueFor, in each lane's order, recording reason as the
// attempt's error, and returns how many. It applies under the leadership
// epoch only (ErrNotLeader otherwise).
func (s *Store) FailUnrunnable(ctx context.Context, epoch int64, c tasks.Class, dueFor time.Duration, limit int, reason string) (int64, error) {
	var fenced bool
	var n int64
	err := s.pool.QueryRow(ctx, `/* shardrun.fail_unrunnable */
		WITH RECURSIVE `+leaderFence+`, `+readyLanes+`, due AS (
			SELECT x.id FROM lane l CROSS JOIN LATERAL (
				SELECT r.id FROM task_ready r
				WHERE r.shard = l.shard AND r.queue = l.queue AND r.kind = l.kind
				  AND r.run_after < now() - $4 * interval '1 millisecond'
				ORDER BY r.priority, r.run_after, r.id LIMIT $5) x
			WHERE l.queue = $2 AND l.kind = $3 AND EXISTS (SELECT 1 FROM lf)
			LIMIT $5
		)
		SELECT EXISTS (SELECT 1 FROM lf),
			CASE WHEN EXISTS (SELECT 1 FROM lf) THEN shardrun_expire(ARRAY(SELECT id FROM due), 'failed', $6::text) ELSE 0 END`,
		epoch, c.Queue, c.Kind, dueFor.Milliseconds(), limit, reason).Scan(&fenced, &n)
	if err != nil {
		return 0, fmt.Errorf("failing ready tasks of queue %q and kind %q, which no attached runner runs: %w", c.Queue, c.Kind, err)
	}
	if !fenced {
		return 0, ErrNotLeader
	}
	return n, nil
}

// ---- retention: finished -> deleted ----

// DeleteFinished deletes up to limit tasks in the given final state whose
// finished_at is older than olderThan (by the database clock), oldest
// first, and returns how many. It walks task_finished by (state,
// finished_at) from the oldest row of that state, so rows of other states
// kept longer are never visited. A dead or failed task that blocks its
// sequence, or will when its turn comes (it failed while it waited), is
// kept, whatever its age: the sequence waits on it until an operator
// retries or cancels it. Rows locked by a concurrent statement
// (an operator's retry) are skipped for this batch. It applies under the
// leadership epoch only (ErrNotLeader otherwise).
func (s *Store) DeleteFinished(ctx context.Context, epoch int64, state string, olderThan time.Duration, limit int) (int64, error) {
	var fenced bool
	var n int64
	err := s.pool.QueryRow(ctx, `/* shardrun.delete_finished */
		WITH `+leaderFence+`, doomed AS (
			SELECT id FROM task_finished
			WHERE state = $2 AND finished_at < now() - $3 * interval '1 millisecond'
			  AND EXISTS (SELECT 1 FROM lf)
			ORDER BY finished_at
			LIMIT $4
		), locked AS (
			SELECT t.id FROM tasks t
			WHERE t.id = ANY (ARRAY(SELECT id FROM doomed)) AND t.state = $2
			  AND t.finished_at < now() - $3 * interval '1 millisecond'
			  AND NOT EXISTS (SELECT 1 FROM task_sequences s WHERE s.key = t.sequence_key AND s.head_id = t.id)
			  AND NOT EXISTS (SELECT 1 FROM task_waiting w WHERE w.id = t.id)
			ORDER BY t.id
			FOR UPDATE SKIP LOCKED
		), del AS (
			DELETE FROM tasks t WHERE t.id = ANY (ARRAY(SELECT id FROM locked))
			RETURNING t.id
		), gone AS (
			DELETE FROM task_finished f WHERE f.state = $2 AND f.id = ANY (ARRAY(SELECT id FROM del))
		)
		SELECT EXISTS (SELECT 1 FROM lf), (SELECT count(*) FROM del)`,
		epoch, state, olderThan.Milliseconds(), limit).Scan(&fenced, &n)
	if err != nil {
		return 0, fmt.Errorf("deleting %s tasks finished over %s ago: %w", state, olderThan, err)
	}
	if !fenced {
		return 0, ErrNotLeader
	}
	return n, nil
}

// ---- operators: cancel and retry ----

// CancelTask cancels task id (shardrun_cancel): a task in a lane or
// waiting in its sequence at once (state cancelled), a dead or failed one
// that blocks its sequence too (the sequence moves on), a running one by
// recording the request that its runner's next heartbeat picks up; the
// task is returned as it is after the move (cancelled, or running with
// CancelRequestedAt set). Either way the task no longer holds its unique
// key: a producer may enqueue the key again at once. Cancelling a running
// task twice is harmless. A finished task gives a *tasks.ConflictError
// naming its state, a missing one a *tasks.NotFoundError.
func (s *Store) CancelTask(ctx context.Context, id int64) (tasks.Task, error) {
	t, outcome, err := s.operate(ctx, id, `/* shardrun.cancel */ SELECT outcome FROM shardrun_cancel(ARRAY[$1::bigint], false)`,
		"cancelled", "requested")
	switch {
	case err != nil:
		return tasks.Task{}, fmt.Errorf("cancelling task %d: %w", id, err)
	case outcome == "missing":
		return tasks.Task{}, fmt.Errorf("cancelling task %d: %w", id, &tasks.NotFoundError{ID: id})
	case outcome == "finished":
		return tasks.Task{}, s.refusal(ctx, id, "cancel", "it is finished (only a dead or failed task that blocks its sequence can be cancelled)")
	}
	return t, nil
}

// RetryTask puts a dead, failed or cancelled task back to ready
// (shardrun_retry: the attempt budget, its lane or its sequence's turn)
// and wakes the runners of its shard. A task in another state, or whose
// unique key another unfinished task holds now, gives a
// *tasks.ConflictError; a missing one a *tasks.NotFoundError.
func (s *Store) RetryTask(ctx context.Context, id int64) (tasks.Task, error) {
	t, outcome, err := s.operate(ctx, id, `/* shardrun.retry */ SELECT outcome FROM shardrun_retry(ARRAY[$1::bigint], false)`, "retried")
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe) && pe.Code == "23505" && pe.ConstraintName == "task_unique_keys_pkey":
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
	case outcome == "missing":
		return tasks.Task{}, fmt.Errorf("retrying task %d: %w", id, &tasks.NotFoundError{ID: id})
	case outcome != "retried":
		return tasks.Task{}, s.refusal(ctx, id, "retry", "only dead, failed and cancelled tasks can be retried")
	}
	return t, nil
}

// operate runs an operator's move of task id (a statement of one outcome,
// with the id as $1) in a transaction, and reads the task as the move
// left it when the outcome is one of moved.
func (s *Store) operate(ctx context.Context, id int64, stmt string, moved ...string) (tasks.Task, string, error) {
	var t tasks.Task
	var outcome string
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, stmt, id).Scan(&outcome); err != nil {
			return err
		}
		if !slices.Contains(moved, outcome) {
			return nil
		}
		var err error
		t, err = scanTask(tx.QueryRow(ctx, `/* shardrun.get */ SELECT `+taskColumns+` FROM task_view t WHERE t.id = $1`, id))
		return err
	})
	return t, outcome, err
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

// cancelPass cancels one batch of a bulk cancel (shardrun_cancel, skipping
// tasks another statement holds: a locked row makes the pass run again).
// Running tasks already asked to cancel are not asked again, so that a
// pass run again counts each task once.
func cancelPass(ctx context.Context, tx pgx.Tx, b *sqlBuilder, _ tasks.Filter, candidates, rest string) (bulkPass, error) {
	var p bulkPass
	err := tx.QueryRow(ctx, `/* shardrun.cancel_matching */
		WITH c AS MATERIALIZED (`+candidates+`),
		elig AS MATERIALIZED (
			SELECT t.id FROM (`+byID("SELECT id FROM c", "")+`) t
			WHERE `+rest+` AND t.cancel_requested_at IS NULL
		),
		done AS MATERIALIZED (SELECT * FROM shardrun_cancel(ARRAY(SELECT id FROM elig), true))
		SELECT (SELECT count(*) FROM c), (SELECT coalesce(max(id), 0) FROM c),
		       (SELECT count(*) FROM done WHERE outcome = 'locked'),
		       (SELECT count(*) FROM done WHERE outcome = 'cancelled'),
		       (SELECT count(*) FROM done WHERE outcome = 'requested')`, b.args...).Scan(
		&p.candidates, &p.last, &p.locked, &p.res.Cancelled, &p.res.CancelRequested)
	return p, err
}

// retryPass retries every candidate without a unique key, and each
// candidate with one that is the newest matching task of its key (wherever
// the newer ones fall among the batches) and whose key no unfinished task
// holds (shardrun_retry, skipping tasks another statement holds).
func retryPass(ctx context.Context, tx pgx.Tx, b *sqlBuilder, f tasks.Filter, candidates, rest string) (bulkPass, error) {
	var p bulkPass
	newer := b.matches(f, "o")
	err := tx.QueryRow(ctx, `/* shardrun.retry_matching */
		WITH c AS MATERIALIZED (`+candidates+`),
		elig AS MATERIALIZED (
			SELECT t.id, t.unique_key FROM (`+byID("SELECT id FROM c", "")+`) t
			WHERE `+rest+`
		),
		pick AS MATERIALIZED (
			SELECT id FROM elig WHERE unique_key IS NULL
			UNION ALL
			SELECT e.id FROM elig e
			WHERE e.unique_key IS NOT NULL
			  AND NOT EXISTS (
				SELECT 1 FROM tasks n JOIN LATERAL (SELECT * FROM task_view v WHERE v.id = n.id) o ON true
				WHERE n.unique_key = e.unique_key AND n.id > e.id AND `+newer+`)
			  AND NOT EXISTS (SELECT 1 FROM task_unique_keys h WHERE h.unique_key = e.unique_key)
		),
		done AS MATERIALIZED (SELECT * FROM shardrun_retry(ARRAY(SELECT id FROM pick), true))
		SELECT (SELECT count(*) FROM c), (SELECT coalesce(max(id), 0) FROM c),
		       (SELECT count(*) FROM done WHERE outcome = 'locked'),
		       (SELECT count(*) FROM elig) - (SELECT count(*) FROM pick),
		       (SELECT count(*) FROM done WHERE outcome = 'retried')`, b.args...).Scan(
		&p.candidates, &p.last, &p.locked, &p.res.Skipped, &p.res.Retried)
	return p, err
}
