-- Gives each of the queues names that is not the default one its row of
-- queues, for tasks a transaction makes claimable in them: the insert
-- trigger's (shardrun_file_tasks) and an operator's retry (shardrun_retry).
-- First it takes each queue's removal lock shared, held to the commit: an
-- operator's removal of the queue (shardrun_remove_queue) takes it
-- exclusively, without waiting, before it looks for unfinished tasks. So a
-- removal either runs before this transaction takes the lock, and the
-- insert below files the row again once it has committed, or finds the
-- lock taken and removes nothing, or runs after this transaction
-- committed and sees its tasks: a queue that has unfinished tasks has its
-- row, and the listing shows it. Without the lock, an insert that found
-- the row (ON CONFLICT DO NOTHING takes no lock) could commit its tasks
-- after a removal that could not see them had committed.
-- The lock's key is (1936879217 ('srnq'), shardrun_queue_lock(name)): 64
-- locks in all, shared by the names that hash alike.
CREATE OR REPLACE FUNCTION shardrun_register_queues(names text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    wanted text[];
BEGIN
    wanted := ARRAY(SELECT DISTINCT n FROM unnest(names) n WHERE n IS NOT NULL AND n <> 'default' ORDER BY 1);
    IF cardinality(wanted) = 0 THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1936879217, k)
    FROM (SELECT DISTINCT shardrun_queue_lock(n) AS k FROM unnest(wanted) n ORDER BY 1) x;
    -- Only the rows this transaction cannot see: inserting one that
    -- another transaction is inserting waits for that transaction, and a
    -- producer's may stay open for long. The store files the rows of a
    -- producer's queues before its transaction inserts (registerQueues),
    -- so this inserts only after an operator removed the queue meanwhile.
    INSERT INTO queues (name) SELECT n FROM unnest(wanted) n
    WHERE NOT EXISTS (SELECT 1 FROM queues q WHERE q.name = n)
    ON CONFLICT (name) DO NOTHING;
END
$$;
