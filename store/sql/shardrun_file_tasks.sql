-- The insert trigger of tasks (statement level): every insert, by any
-- producer (the store, a producer's own transaction, raw SQL, COPY),
-- files its tasks (shardrun_file; a sequence's tasks at the commit),
-- registers their unique keys (unless the store registered them first, to
-- insert idempotently; a key another task holds makes the insert fail)
-- and their queues (shardrun_register_queues), and
-- notifies the runners of the shards that got tasks
-- claimable now, unless the transaction is quiet (shardrun.notify off: the
-- store's own inserts, notified after their commit). A move's copy
-- (shardrun.move_copy on: store.CopyShard) inserts every table of the
-- shard as it was, so its tasks are not filed again.
CREATE OR REPLACE FUNCTION shardrun_file_tasks() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shards integer[];
    urgent boolean[];
BEGIN
    IF current_setting('shardrun.move_copy', true) = 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM shardrun_file(ARRAY(
        SELECT row(n.id, n.shard, n.queue, n.kind, n.priority, n.run_after, n.deadline, n.state,
                   n.unique_key, n.finished_at, n.sequence_key)::shardrun_place
        FROM new_rows n), false);
    INSERT INTO task_unique_keys (unique_key, id)
    SELECT n.unique_key, n.id FROM new_rows n
    WHERE n.unique_key IS NOT NULL AND n.state = 'ready'
      AND NOT EXISTS (SELECT 1 FROM task_unique_keys k WHERE k.unique_key = n.unique_key AND k.id = n.id);
    PERFORM shardrun_register_queues(ARRAY(SELECT DISTINCT queue FROM new_rows));
    IF current_setting('shardrun.notify', true) = 'off' THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(shard), array_agg(shardrun_urgent(priority)) INTO shards, urgent
    FROM new_rows WHERE state = 'ready' AND sequence_key IS NULL AND run_after <= now();
    IF shards IS NOT NULL THEN
        PERFORM shardrun_notify(shards, urgent);
    END IF;
    RETURN NULL;
END
$$;
