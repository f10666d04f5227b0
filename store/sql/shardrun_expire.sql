-- The leader's end of tasks no runner holds (moves.go: deadline and
-- unhandled rules): tasks ids that are still in a lane or waiting, after
-- the locks (shardrun_lock_tasks, skipping tasks another statement holds),
-- end in state to_state with err recorded as their attempt's error. Claimed
-- ones are left to their runner. A task waiting its turn in a sequence it
-- blocks keeps its place, ended: the sequence stops there when its turn
-- comes (shardrun_settle), as it stops at a head that failed, so the tasks
-- behind it never run past it. Returns how many it ended.
CREATE OR REPLACE FUNCTION shardrun_expire(ids bigint[], to_state text, err text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    locked bigint[];
    held   bigint[];
    taken  bigint[];
    placed shardrun_place[];
BEGIN
    locked := shardrun_lock_tasks(ids, true);
    IF to_state IN ('dead', 'failed') THEN
        WITH h AS (
            UPDATE task_waiting w SET ended = true, deadline = NULL FROM tasks t
            WHERE w.id = ANY (locked) AND t.id = w.id AND t.state = 'ready' AND t.sequence_blocks
              AND t.cancel_requested_at IS NULL
            RETURNING w.id
        ) SELECT array_agg(id) INTO held FROM h;
    END IF;
    taken := shardrun_unplace(ARRAY(SELECT unnest(locked) EXCEPT SELECT unnest(coalesce(held, '{}'))))
             || coalesce(held, '{}');
    WITH e AS (
        UPDATE tasks t SET state = CASE WHEN t.cancel_requested_at IS NULL THEN to_state ELSE 'cancelled' END,
            finished_at = now(),
            errors = t.errors || jsonb_build_array(jsonb_build_object('attempt', t.attempt, 'at', now(), 'error', err))
        WHERE t.id = ANY (taken)
        RETURNING t.*
    )
    SELECT array_agg(row(e.id, e.shard, e.queue, e.kind, e.priority, e.run_after, e.deadline, e.state,
                         e.unique_key, e.finished_at, e.sequence_key)::shardrun_place) INTO placed FROM e;
    PERFORM shardrun_file(placed, true);
    PERFORM shardrun_settle(locked);
    RETURN cardinality(taken);
END
$$;
