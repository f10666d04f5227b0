-- An operator's retry of tasks ids (moves.go: retry): each dead, failed
-- or cancelled one, once its record is locked, is ready again
-- with its next attempt number (attempts only ever grow, so that a late
-- write of an earlier attempt can never match the new one) and as many
-- further attempts as it was enqueued with (attempt_budget records
-- max_attempts at the first retry). A deadline that has passed is dropped,
-- since it would fail the task again at once; the history (errors) is
-- kept. The task holds its unique key again (a key another unfinished task
-- holds fails the statement: unique violation on task_unique_keys_pkey),
-- its queue gets its row again if it was removed (shardrun_register_queues),
-- and it is filed (shardrun_file: its lane, or its sequence's turn); the
-- runners of the shards that got claimable tasks are woken.
-- Outcomes, per id: retried, unfinished (refused: not dead, failed or
-- cancelled), locked (skip_locked: try again), missing.
CREATE OR REPLACE FUNCTION shardrun_retry(ids bigint[], skip_locked boolean)
RETURNS TABLE (task_id bigint, outcome text)
LANGUAGE plpgsql AS $$
DECLARE
    locked  bigint[];
    retried bigint[];
    placed  shardrun_place[];
    shards  integer[];
    urgent  boolean[];
BEGIN
    -- The records only: a retry takes the tasks' unique keys before their
    -- sequences (shardrun_file settles them), the order a producer takes
    -- them in (a key at its insert, the sequence at its commit).
    locked := shardrun_lock_records(ids, skip_locked);
    DELETE FROM task_finished f USING tasks t
    WHERE t.id = ANY (locked) AND t.state IN ('failed', 'dead', 'cancelled') AND f.state = t.state AND f.id = t.id;
    WITH r AS (
        UPDATE tasks t SET
            state               = 'ready',
            attempt             = t.attempt + 1,
            attempt_budget      = coalesce(t.attempt_budget, t.max_attempts),
            max_attempts        = t.attempt + coalesce(t.attempt_budget, t.max_attempts),
            run_after           = now(),
            deadline            = CASE WHEN t.deadline <= now() THEN NULL ELSE t.deadline END,
            finished_at         = NULL,
            claimed_by          = NULL,
            claim_epoch         = NULL,
            claimed_at          = NULL,
            heartbeat_at        = NULL,
            cancel_requested_at = NULL,
            result              = NULL
        WHERE t.id = ANY (locked) AND t.state IN ('failed', 'dead', 'cancelled')
        RETURNING t.*
    ), held AS (
        INSERT INTO task_unique_keys (unique_key, id)
        SELECT unique_key, id FROM r WHERE unique_key IS NOT NULL ORDER BY id
    )
    SELECT array_agg(r.id), array_agg(row(r.id, r.shard, r.queue, r.kind, r.priority, r.run_after, r.deadline, r.state,
                                          r.unique_key, r.finished_at, r.sequence_key)::shardrun_place),
           array_agg(r.shard) FILTER (WHERE r.sequence_key IS NULL),
           array_agg(shardrun_urgent(r.priority)) FILTER (WHERE r.sequence_key IS NULL)
    INTO retried, placed, shards, urgent FROM r;
    -- Their queues may have been removed since they finished: after the
    -- keys, as a producer takes them.
    PERFORM shardrun_register_queues(ARRAY(SELECT x.queue FROM unnest(placed) x));
    -- The sequences of every locked task at once, in key order, before
    -- shardrun_file settles the retried ones and shardrun_settle all of
    -- them: locked in two rounds, a key of the second round sorting before
    -- one of the first would be taken out of order.
    PERFORM shardrun_lock_sequences(ARRAY(SELECT t.sequence_key FROM tasks t WHERE t.id = ANY (locked)));
    PERFORM shardrun_file(placed, true);
    IF shards IS NOT NULL THEN
        PERFORM shardrun_notify(shards, urgent);
    END IF;
    PERFORM shardrun_settle(locked);
    RETURN QUERY
    SELECT i, CASE WHEN i = ANY (coalesce(retried, '{}')) THEN 'retried'
                   WHEN i = ANY (locked) THEN 'unfinished'
                   WHEN EXISTS (SELECT 1 FROM tasks t WHERE t.id = i) THEN 'locked'
                   ELSE 'missing' END
    FROM unnest(ids) i;
END
$$;
