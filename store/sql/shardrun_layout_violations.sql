-- Every violation of the task layout's invariants, one row each: the
-- check every store and integration test runs at its end (pgtest), and the
-- stress test after its random mixes of moves. An empty answer is a
-- consistent layout.
--
--   place     an unfinished task is in exactly one of: its lane, a claim,
--             its sequence's waiting line; a finished one in none of them
--             (but a dead or failed one that blocks its sequence may keep
--             its place in the waiting line, ended) and in task_finished
--             once, under its state; every entry of those tables has its
--             task, and a lane or waiting entry matches it
--   cancel    no task whose cancel was requested is claimable
--   key       a unique key is held by its unfinished task, one that no
--             cancel was requested for; every such task holds its key
--   sequence  a sequence with an unfinished task has a row; its head is an
--             unfinished task of it, or a dead or failed one that blocks
--             it (blocked_at); the rest wait; at most one of its tasks is
--             claimable or running; a row has a head and something to do
--   queue     a queue other than the default one that has a task in a
--             lane, a claim or a waiting line has a row (the listing
--             shows it, and its removal is refused)
--   placement no task of a shard the database gave away (gone: a move
--             committed deletes every row of the shard with the state)
CREATE OR REPLACE FUNCTION shardrun_layout_violations()
RETURNS TABLE (task_id bigint, sequence_key text, problem text)
LANGUAGE sql STABLE AS $$
WITH lane AS (SELECT id, count(*) AS n FROM task_ready GROUP BY id),
claim AS (SELECT id, count(*) AS n FROM task_claims GROUP BY id),
wait AS (SELECT id, count(*) FILTER (WHERE NOT ended) AS n, count(*) FILTER (WHERE ended) AS e FROM task_waiting GROUP BY id),
fin AS (SELECT id, count(*) AS n, count(*) FILTER (WHERE f.state = t.state) AS own
        FROM task_finished f LEFT JOIN tasks t USING (id) GROUP BY id),
place AS (
    SELECT t.id, t.state, t.sequence_key, t.unique_key, t.cancel_requested_at,
           t.sequence_blocks, coalesce(l.n, 0) AS lanes, coalesce(c.n, 0) AS claims, coalesce(w.n, 0) AS waits,
           coalesce(w.e, 0) AS ended,
           coalesce(f.n, 0) AS finished, coalesce(f.own, 0) AS own_finished
    FROM tasks t LEFT JOIN lane l USING (id) LEFT JOIN claim c USING (id) LEFT JOIN wait w USING (id) LEFT JOIN fin f USING (id)
)
SELECT id, sequence_key, format('unfinished task in %s places (lane %s, claim %s, waiting %s)', lanes + claims + waits, lanes, claims, waits)
FROM place WHERE state = 'ready' AND lanes + claims + waits <> 1
UNION ALL
SELECT id, sequence_key, format('unfinished task with %s task_finished entries', finished)
FROM place WHERE state = 'ready' AND finished > 0
UNION ALL
SELECT id, sequence_key, format('%s task with an ended waiting entry', CASE WHEN state = 'ready' THEN 'unfinished'
                                                                             ELSE state || ', not blocking,' END)
FROM place WHERE ended > 0 AND (state NOT IN ('dead', 'failed') OR NOT sequence_blocks)
UNION ALL
SELECT id, sequence_key, format('%s ended waiting entries', ended) FROM place WHERE ended > 1
UNION ALL
SELECT id, sequence_key, format('%s task in a lane, a claim or waiting (lane %s, claim %s, waiting %s)', state, lanes, claims, waits)
FROM place WHERE state <> 'ready' AND lanes + claims + waits > 0
UNION ALL
SELECT id, sequence_key, format('%s task with %s task_finished entries, %s of them %s', state, finished, own_finished, state)
FROM place WHERE state <> 'ready' AND (finished <> 1 OR own_finished <> 1)
UNION ALL
SELECT r.id, NULL, 'lane entry without its task' FROM task_ready r WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = r.id)
UNION ALL
SELECT c.id, NULL, 'claim without its task' FROM task_claims c WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = c.id)
UNION ALL
SELECT w.id, w.sequence_key, 'waiting entry without its task' FROM task_waiting w WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = w.id)
UNION ALL
SELECT f.id, NULL, 'task_finished entry without its task' FROM task_finished f WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = f.id)
UNION ALL
SELECT r.id, t.sequence_key, 'lane entry does not match its task' FROM task_ready r JOIN tasks t ON t.id = r.id
WHERE (r.shard, r.queue, r.kind, r.priority, r.run_after) IS DISTINCT FROM (t.shard, t.queue, t.kind, t.priority, t.run_after)
   OR r.deadline IS DISTINCT FROM t.deadline
UNION ALL
SELECT w.id, w.sequence_key, 'waiting entry does not match its task' FROM task_waiting w JOIN tasks t ON t.id = w.id
WHERE w.sequence_key IS DISTINCT FROM t.sequence_key OR w.queue <> t.queue
   OR (NOT w.ended AND w.deadline IS DISTINCT FROM t.deadline) OR (w.ended AND w.deadline IS NOT NULL)
UNION ALL
SELECT id, sequence_key, 'cancel requested, but claimable' FROM place WHERE cancel_requested_at IS NOT NULL AND lanes + waits > 0
UNION ALL
SELECT k.id, NULL, format('unique key %s held by a task that is missing, finished or being cancelled', k.unique_key)
FROM task_unique_keys k LEFT JOIN tasks t ON t.id = k.id
WHERE t.id IS NULL OR t.state <> 'ready' OR t.cancel_requested_at IS NOT NULL OR t.unique_key IS DISTINCT FROM k.unique_key
UNION ALL
SELECT id, sequence_key, format('unique key %s not held by its unfinished task', unique_key)
FROM place p WHERE state = 'ready' AND unique_key IS NOT NULL AND cancel_requested_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM task_unique_keys k WHERE k.unique_key = p.unique_key AND k.id = p.id)
UNION ALL
SELECT NULL, p.sequence_key, 'sequence with unfinished tasks has no row'
FROM (SELECT DISTINCT sequence_key FROM place WHERE state = 'ready' AND sequence_key IS NOT NULL) p
WHERE NOT EXISTS (SELECT 1 FROM task_sequences s WHERE s.key = p.sequence_key)
UNION ALL
SELECT s.head_id, s.key, CASE
        WHEN s.head_id IS NULL THEN 'sequence without a head'
        WHEN t.id IS NULL THEN 'sequence head missing'
        WHEN t.sequence_key IS DISTINCT FROM s.key THEN 'sequence head of another sequence'
        WHEN t.state = 'ready' AND s.blocked_at IS NOT NULL THEN 'sequence blocked by an unfinished head'
        WHEN t.state = 'ready' AND p.waits > 0 THEN 'sequence head waiting'
        WHEN t.state IN ('dead', 'failed') AND t.sequence_blocks AND s.blocked_at IS NULL THEN 'blocking head not marked blocked'
        WHEN t.state <> 'ready' AND NOT (t.state IN ('dead', 'failed') AND t.sequence_blocks) THEN format('sequence head %s', t.state)
    END
FROM task_sequences s LEFT JOIN tasks t ON t.id = s.head_id LEFT JOIN place p ON p.id = t.id
WHERE s.head_id IS NULL OR t.id IS NULL OR t.sequence_key IS DISTINCT FROM s.key
   OR (t.state = 'ready' AND (s.blocked_at IS NOT NULL OR p.waits > 0))
   OR (t.state IN ('dead', 'failed') AND t.sequence_blocks AND s.blocked_at IS NULL)
   OR (t.state <> 'ready' AND NOT (t.state IN ('dead', 'failed') AND t.sequence_blocks))
UNION ALL
SELECT p.id, p.sequence_key, 'task of a sequence claimable or running but not its head'
FROM place p WHERE p.state = 'ready' AND p.sequence_key IS NOT NULL AND p.lanes + p.claims > 0
  AND NOT EXISTS (SELECT 1 FROM task_sequences s WHERE s.key = p.sequence_key AND s.head_id = p.id)
UNION ALL
SELECT w.id, w.sequence_key, 'waiting entry of a sequence without a row' FROM task_waiting w
WHERE NOT EXISTS (SELECT 1 FROM task_sequences s WHERE s.key = w.sequence_key)
UNION ALL
SELECT w.id, w.sequence_key, 'waiting task is its sequence''s head' FROM task_waiting w
JOIN task_sequences s ON s.key = w.sequence_key AND s.head_id = w.id
UNION ALL
SELECT NULL, sequence_key, format('%s tasks of one sequence claimable or running', n)
FROM (SELECT sequence_key, count(*) AS n FROM place WHERE state = 'ready' AND sequence_key IS NOT NULL AND lanes + claims > 0
      GROUP BY sequence_key) x WHERE n > 1
UNION ALL
SELECT min(x.id), NULL, format('%s tasks of queue %s, which has no row', count(*), x.queue)
FROM (SELECT id, queue FROM task_ready UNION ALL SELECT id, queue FROM task_claims UNION ALL SELECT id, queue FROM task_waiting) x
WHERE x.queue <> 'default' AND NOT EXISTS (SELECT 1 FROM queues q WHERE q.name = x.queue)
GROUP BY x.queue
UNION ALL
SELECT min(t.id), NULL, format('%s tasks of shard %s, which moved to database %s', count(*), t.shard, min(p.peer))
FROM tasks t JOIN shardrun_placement p ON p.shard = t.shard AND p.state = 'gone'
GROUP BY t.shard
$$;
