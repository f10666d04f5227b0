-- An operator's removal of queue queue_name (store.DeleteQueue): its row of
-- queues is deleted when the queue holds no unfinished task — none in its
-- lanes, none waiting in a sequence's line, none claimed. Outcomes:
-- removed (with the row as it was), work (the counts, each up to cap),
-- enqueueing (a transaction that enqueues into the queue, or retries one
-- of its tasks, is open: or into a queue that shares its removal lock,
-- shardrun_queue_lock), missing, default (never removed: the insert
-- trigger files no row for it).
-- Locks: the row first, FOR UPDATE (claims under way hold it FOR KEY
-- SHARE: they commit first), holding nothing else; then the queue's
-- removal lock (shardrun_register_queues), exclusively, without waiting:
-- a removal never waits while it holds the lock that producers and retries
-- wait for, so it closes no cycle of waits. The counts are read after
-- both, each with a snapshot of its own: whatever enqueued into the queue
-- before has committed, and whatever does so after waits for this
-- transaction and files the row again.
CREATE OR REPLACE FUNCTION shardrun_remove_queue(queue_name text, cap integer)
RETURNS TABLE (outcome text, ready bigint, waiting bigint, running bigint, was_created timestamptz, was_paused timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    q queues;
    r bigint;
    w bigint;
    c bigint;
BEGIN
    IF queue_name = 'default' THEN
        RETURN QUERY SELECT 'default', 0::bigint, 0::bigint, 0::bigint, NULL::timestamptz, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT * INTO q FROM queues WHERE name = queue_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'missing', 0::bigint, 0::bigint, 0::bigint, NULL::timestamptz, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(1936879217, shardrun_queue_lock(queue_name)) THEN
        RETURN QUERY SELECT 'enqueueing', 0::bigint, 0::bigint, 0::bigint, q.created_at, q.paused_at;
        RETURN;
    END IF;
    -- The queue's lanes in every shard that has tasks: a loose scan of the
    -- shards of task_ready's primary key, then the queue's range in each.
    WITH RECURSIVE s(shard) AS (
        (SELECT t.shard FROM task_ready t ORDER BY t.shard LIMIT 1)
        UNION ALL
        SELECT (SELECT t.shard FROM task_ready t WHERE t.shard > s.shard ORDER BY t.shard LIMIT 1)
        FROM s WHERE s.shard IS NOT NULL
    )
    SELECT count(*) INTO r FROM (
        SELECT 1 FROM s CROSS JOIN LATERAL (
            SELECT 1 FROM task_ready t WHERE t.shard = s.shard AND t.queue = queue_name LIMIT cap) x
        LIMIT cap) y;
    SELECT count(*) INTO w FROM (SELECT 1 FROM task_waiting t WHERE t.queue = queue_name LIMIT cap) y;
    SELECT count(*) INTO c FROM (SELECT 1 FROM task_claims t WHERE t.queue = queue_name LIMIT cap) y;
    IF r + w + c > 0 THEN
        RETURN QUERY SELECT 'work', r, w, c, q.created_at, q.paused_at;
        RETURN;
    END IF;
    DELETE FROM queues WHERE name = queue_name;
    RETURN QUERY SELECT 'removed', 0::bigint, 0::bigint, 0::bigint, q.created_at, q.paused_at;
END
$$;
