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
    WITH d AS (
        DELETE FROM task_ready r USING tasks t
        WHERE t.id = ANY (ids) AND t.state = 'ready'
          AND (r.shard, r.queue, r.kind, r.priority, r.run_after, r.id) = (t.shard, t.queue, t.kind, t.priority, t.run_after, t.id)
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
