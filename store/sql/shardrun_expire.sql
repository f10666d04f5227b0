-- The leader's end of tasks no runner holds (moves.go: deadline and
-- unhandled rules): tasks ids that are still in a lane or waiting, after
-- the locks (shardrun_lock_tasks, skipping tasks another statement holds),
-- end in state to_state with err recorded as their attempt's error. Claimed
-- ones are left to their runner. Returns how many it ended.
CREATE OR REPLACE FUNCTION shardrun_expire(ids bigint[], to_state text, err text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    locked bigint[];
    taken  bigint[];
    placed shardrun_place[];
BEGIN
    locked := shardrun_lock_tasks(ids, true);
    taken := shardrun_unplace(locked);
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
