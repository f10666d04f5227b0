-- An operator's cancel of tasks ids (moves.go: cancel). After the locks
-- (shardrun_lock_tasks), each task is where it is, and:
--
--   in a lane or waiting, or inserted by this transaction -> cancelled now
--   dead or failed, blocking its sequence (its head, or     -> cancelled now,
--   ended while it waited its turn)                          the sequence moves on
--   claimed (running)                                     -> its cancel is
--       requested: the runner's next heartbeat carries it (store: Heartbeat),
--       and the runner's own fenced write ends the attempt
--   finished otherwise                                    -> refused
--
-- Either way the task no longer holds its unique key. Outcomes, per id:
-- cancelled, requested, finished (refused), locked (skip_locked, another
-- statement held the task: try again), missing.
CREATE OR REPLACE FUNCTION shardrun_cancel(ids bigint[], skip_locked boolean)
RETURNS TABLE (task_id bigint, outcome text)
LANGUAGE plpgsql AS $$
DECLARE
    locked  bigint[];
    ending  bigint[];
    blocked bigint[];
    asked   bigint[];
    placed  shardrun_place[];
BEGIN
    locked := shardrun_lock_tasks(ids, skip_locked);
    blocked := ARRAY(SELECT t.id FROM tasks t JOIN task_sequences s ON s.key = t.sequence_key AND s.head_id = t.id
                     WHERE t.id = ANY (locked) AND t.state IN ('dead', 'failed')
                     UNION ALL
                     SELECT w.id FROM task_waiting w WHERE w.id = ANY (locked) AND w.ended);
    ending := shardrun_unplace(ARRAY(SELECT id FROM tasks WHERE id = ANY (locked) AND state = 'ready'));
    asked := ARRAY(SELECT t.id FROM tasks t WHERE t.id = ANY (locked) AND t.state = 'ready' AND NOT (t.id = ANY (ending)));
    DELETE FROM task_finished f USING tasks t WHERE t.id = ANY (blocked) AND f.state = t.state AND f.id = t.id;
    WITH c AS (
        UPDATE tasks t SET state = 'cancelled', finished_at = now(),
            cancel_requested_at = coalesce(t.cancel_requested_at, now())
        WHERE t.id = ANY (ending || blocked)
        RETURNING t.*
    )
    SELECT array_agg(row(c.id, c.shard, c.queue, c.kind, c.priority, c.run_after, c.deadline, c.state,
                         c.unique_key, c.finished_at, c.sequence_key)::shardrun_place) INTO placed FROM c;
    PERFORM shardrun_file(placed, true);
    WITH r AS (
        UPDATE tasks t SET cancel_requested_at = now()
        WHERE t.id = ANY (asked) AND t.cancel_requested_at IS NULL
        RETURNING t.id, t.unique_key
    )
    DELETE FROM task_unique_keys k USING r WHERE r.unique_key IS NOT NULL AND k.unique_key = r.unique_key AND k.id = r.id;
    PERFORM shardrun_settle(locked);
    RETURN QUERY
    SELECT i, CASE WHEN i = ANY (ending) OR i = ANY (blocked) THEN 'cancelled'
                   WHEN i = ANY (asked) THEN 'requested'
                   WHEN i = ANY (locked) THEN 'finished'
                   WHEN EXISTS (SELECT 1 FROM tasks t WHERE t.id = i) THEN 'locked'
                   ELSE 'missing' END
    FROM unnest(ids) i;
END
$$;
