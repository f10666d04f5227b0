-- Locks tasks ids for an operator's or the leader's move, in the one order
-- (moves.go): their records in id order (shardrun_lock_records, skipping
-- those another statement holds when skip_locked), then the sequences they
-- belong to, in key order
-- (shardrun_lock_sequences, which creates the rows it locks; the caller
-- settles the locked tasks last, which ends the sequences left empty).
-- Returns the ids it locked. Statements that run after it see, with
-- snapshots of their own, where each locked task is: a move that needed
-- these locks has committed, and none can start.
CREATE OR REPLACE FUNCTION shardrun_lock_tasks(ids bigint[], skip_locked boolean) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    locked bigint[];
BEGIN
    locked := shardrun_lock_records(ids, skip_locked);
    PERFORM shardrun_lock_sequences(ARRAY(SELECT sequence_key FROM tasks WHERE id = ANY (locked) AND sequence_key IS NOT NULL));
    RETURN locked;
END
$$;
