-- Takes unfinished tasks ids, locked by shardrun_lock_tasks, out of their
-- lanes and out of their sequences' waiting lines, and returns those it
-- took: the ones no claim holds, which the caller now ends. A claim that
-- took a task's lane entry first makes the delete wait for its commit and
-- then find the entry gone: that task runs, and is not returned. A task
-- in no place at all is one its own transaction inserted and will settle
-- at its commit; it is returned too.
CREATE OR REPLACE FUNCTION shardrun_unplace(ids bigint[]) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    lane    bigint[];
    waiting bigint[];
    pending bigint[];
BEGIN
    -- By their ctids, as a claim deletes them: a TID scan visits the
    -- entries in ctid order, so a claim and this delete lock the entries
    -- they share in the same order and never wait on each other in a
    -- cycle (a delete through a join locks them in the join's order).
    WITH d AS (
        DELETE FROM task_ready r
        WHERE r.ctid = ANY (ARRAY(
            SELECT e.ctid FROM tasks t JOIN task_ready e
              ON (e.shard, e.queue, e.kind, e.priority, e.run_after, e.id) = (t.shard, t.queue, t.kind, t.priority, t.run_after, t.id)
            WHERE t.id = ANY (ids) AND t.state = 'ready'))
        RETURNING r.id
    ) SELECT array_agg(id) INTO lane FROM d;
    WITH d AS (
        DELETE FROM task_waiting w USING tasks t WHERE t.id = ANY (ids) AND t.state = 'ready' AND w.id = t.id RETURNING w.id
    ) SELECT array_agg(id) INTO waiting FROM d;
    SELECT array_agg(t.id) INTO pending FROM tasks t
    WHERE t.id = ANY (ids) AND t.state = 'ready' AND NOT (t.id = ANY (coalesce(lane, '{}') || coalesce(waiting, '{}')))
      AND NOT EXISTS (SELECT 1 FROM task_claims c WHERE c.id = t.id);
    RETURN coalesce(lane, '{}') || coalesce(waiting, '{}') || coalesce(pending, '{}');
END
$$;
