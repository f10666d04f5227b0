package store

// Which of a runner's lanes hold tasks: the probe a runner that serves many
// queues sends instead of one claim per queue (executor/claimer.go).

import (
	"context"
	"fmt"
	"slices"
)

// LaneProbeCap bounds the lanes one ReadyQueues visits: past it, the probe
// stops and says where, and the runner treats every served queue as having
// work in the shards it did not reach, as it did before the probe existed.
const LaneProbeCap = 10_000

// readyQueuesSQL walks task_ready's primary key (shard, queue, kind, ...)
// lane by lane, in key order, one LIMIT 1 descent per step: from a lane of
// a held shard ($1, sorted) and a served queue ($2) to the next lane; from
// a lane of a queue not served past the rest of that queue in the shard;
// from a shard not held to the next held shard. The branches not taken are
// one-time filters, never run. It answers the (shard, queue) pairs found
// with a handled kind ($3), the lanes visited (at most $4) and the last
// shard visited.
const readyQueuesSQL = `/* shardrun.ready_queues */
	WITH RECURSIVE walk(shard, queue, kind, held, served) AS (
		SELECT n.shard, n.queue, n.kind, n.shard = ANY ($1::int[]), n.queue = ANY ($2::text[]) FROM (
			SELECT r.shard, r.queue, r.kind FROM task_ready r WHERE r.shard >= ($1::int[])[1]
			ORDER BY r.shard, r.queue, r.kind LIMIT 1) n
		UNION ALL
		SELECT n.shard, n.queue, n.kind, n.shard = ANY ($1), n.queue = ANY ($2)
		FROM walk w CROSS JOIN LATERAL (
			(SELECT r.shard, r.queue, r.kind FROM task_ready r
			 WHERE w.held AND w.served AND (r.shard, r.queue, r.kind) > (w.shard, w.queue, w.kind)
			 ORDER BY r.shard, r.queue, r.kind LIMIT 1)
			UNION ALL
			(SELECT r.shard, r.queue, r.kind FROM task_ready r
			 WHERE w.held AND NOT w.served AND (r.shard, r.queue) > (w.shard, w.queue)
			 ORDER BY r.shard, r.queue, r.kind LIMIT 1)
			UNION ALL
			(SELECT r.shard, r.queue, r.kind FROM task_ready r
			 WHERE NOT w.held AND r.shard >= (SELECT min(h) FROM unnest($1::int[]) h WHERE h > w.shard)
			 ORDER BY r.shard, r.queue, r.kind LIMIT 1)
		) n
	), seen AS (
		SELECT * FROM walk LIMIT $4::int
	)
	SELECT coalesce(array_agg(v.shard) FILTER (WHERE v.ok), '{}'), coalesce(array_agg(v.queue) FILTER (WHERE v.ok), '{}'),
		(SELECT count(*) FROM seen), (SELECT max(shard) FROM seen)
	FROM (SELECT DISTINCT shard, queue, held AND served AND kind = ANY ($3::text[]) AS ok FROM seen) v`

func readyQueuesArgs(shards []int, queues, kinds []string) []any {
	held := make([]int32, len(shards))
	for i, sh := range shards {
		held[i] = int32(sh)
	}
	slices.Sort(held)
	return []any{held, queues, kinds, LaneProbeCap}
}

// ReadyQueues returns which of queues have tasks of one of kinds in the
// lanes of shards (due or not), each with those shards in order, by a loose scan of task_ready's primary
// key: one index descent per lane (shard, queue, kind) of a served queue
// in those shards, one per other queue with tasks in them, and one per
// other shard with tasks, whatever the number of tasks or of queues
// served; an idle database costs one descent. So a runner serving many
// queues learns in one statement which queues to claim from, where one
// claim per queue over every shard cost queues × shards descents each poll
// (finding 5 of the hostile-input review).
//
// It is a hint, read without locks: the claims decide. When the walk
// reaches LaneProbeCap lanes it stops; truncatedFrom is then the shard it
// stopped in (the lanes from there on were not all read), else -1.
func (s *Store) ReadyQueues(ctx context.Context, shards []int, queues, kinds []string) (found map[string][]int, truncatedFrom int, err error) {
	if len(shards) == 0 || len(queues) == 0 || len(kinds) == 0 {
		return nil, -1, nil
	}
	var shardsFound []int32
	var queuesFound []string
	var visited int64
	var last *int32
	err = s.pool.QueryRow(ctx, readyQueuesSQL, append([]any{claimExecMode}, readyQueuesArgs(shards, queues, kinds)...)...).
		Scan(&shardsFound, &queuesFound, &visited, &last)
	if err != nil {
		return nil, -1, fmt.Errorf("probing the lanes of %d shards for %d queues: %w", len(shards), len(queues), err)
	}
	found = make(map[string][]int)
	for i := range shardsFound {
		found[queuesFound[i]] = append(found[queuesFound[i]], int(shardsFound[i]))
	}
	for _, shards := range found {
		slices.Sort(shards)
	}
	truncatedFrom = -1
	if visited >= LaneProbeCap && last != nil {
		truncatedFrom = int(*last)
	}
	return found, truncatedFrom, nil
}
