-- Locks the records of tasks ids in id order, skipping those another
-- statement holds when skip_locked, and returns the ids it locked: the
-- first step of every operator's and leader's move, in the one lock order
-- (moves.go). shardrun_lock_tasks goes on to the tasks' sequences; a retry
-- takes the tasks' unique keys before their sequences (shardrun_retry).
CREATE OR REPLACE FUNCTION shardrun_lock_records(ids bigint[], skip_locked boolean) RETURNS bigint[]
LANGUAGE plpgsql AS $$
BEGIN
    IF skip_locked THEN
        RETURN ARRAY(SELECT id FROM tasks WHERE id = ANY (ids) ORDER BY id FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN ARRAY(SELECT id FROM tasks WHERE id = ANY (ids) ORDER BY id FOR UPDATE);
END
$$;
