-- Puts the sequences of tasks ids in order: the one place where a task of a
-- sequence is filed, and where a sequence moves on.
--
-- A sequence (task_sequences) has one head, the one task of the sequence
-- that may run: in its lane, claimed, or finished dead or failed and
-- blocking the rest (blocked_at). Its other unfinished tasks wait their
-- turn in task_waiting, in the order they joined (pos: the order in which
-- their transactions settled, that is committed).
--
--   1. Lock the sequences, in key order (shardrun_lock_sequences). Every
--      later statement reads with a snapshot taken after the locks, so it
--      sees whatever moved the sequence before.
--   2. A head that finished: completed or cancelled, or dead or failed in a
--      sequence that goes on, releases the sequence; dead or failed in a
--      sequence that blocks, blocks it. A head ready again (a retried
--      blocked head) unblocks it.
--   3. Every other task of ids that is ready and in no place (just
--      inserted, or retried) waits, after those already waiting. A task
--      that ended while it waited (shardrun_expire: failed in a sequence
--      it blocks) keeps its place, ended; retried, it waits there again;
--      cancelled, it leaves.
--   4. A sequence without a head makes its first waiting task the head
--      (one that ended while it waited blocks the sequence at once); one
--      with nothing left ends (its row goes).
--   5. A head that is ready and in no place (promoted, retried, or
--      requeued from its claim) goes into its lane.
--
-- Promoted heads due now are notified (unless the transaction is quiet:
-- shardrun.notify off, the store's own inserts, notified after commit).
CREATE OR REPLACE FUNCTION shardrun_settle(ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    keys   text[];
    shards integer[];
    urgent boolean[];
BEGIN
    SELECT array_agg(DISTINCT sequence_key) INTO keys FROM tasks WHERE id = ANY (ids) AND sequence_key IS NOT NULL;
    IF keys IS NULL THEN
        RETURN;
    END IF;
    -- 1.
    PERFORM shardrun_lock_sequences(keys);
    -- 2.
    UPDATE task_sequences s SET
        head_id    = CASE WHEN h.state IS NULL OR h.state IN ('completed', 'cancelled')
                               OR (h.state IN ('dead', 'failed') AND NOT h.sequence_blocks) THEN NULL
                          ELSE s.head_id END,
        blocked_at = CASE WHEN h.state IN ('dead', 'failed') AND h.sequence_blocks THEN coalesce(s.blocked_at, now()) END
    FROM (SELECT q.key, t.state, t.sequence_blocks FROM task_sequences q LEFT JOIN tasks t ON t.id = q.head_id
          WHERE q.key = ANY (keys) AND q.head_id IS NOT NULL) h
    WHERE s.key = h.key;
    -- 3.
    UPDATE task_waiting w SET ended = false, deadline = t.deadline FROM tasks t
    WHERE w.id = ANY (ids) AND w.ended AND t.id = w.id AND t.state = 'ready';
    DELETE FROM task_waiting w USING tasks t
    WHERE w.id = ANY (ids) AND w.ended AND t.id = w.id AND t.state NOT IN ('ready', 'dead', 'failed');
    INSERT INTO task_waiting (id, sequence_key, queue, deadline)
    SELECT t.id, t.sequence_key, t.queue, t.deadline FROM tasks t
    WHERE t.id = ANY (ids) AND t.sequence_key IS NOT NULL AND t.state = 'ready'
      AND NOT EXISTS (SELECT 1 FROM task_sequences s WHERE s.key = t.sequence_key AND s.head_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM task_waiting w WHERE w.id = t.id)
      AND NOT EXISTS (SELECT 1 FROM task_claims c WHERE c.id = t.id)
      AND NOT EXISTS (SELECT 1 FROM task_ready r
                      WHERE (r.shard, r.queue, r.kind, r.priority, r.run_after, r.id)
                          = (t.shard, t.queue, t.kind, t.priority, t.run_after, t.id))
    ORDER BY t.sequence_key, t.id;
    -- 4.
    WITH nxt AS (
        SELECT w.id, w.sequence_key FROM task_sequences s
        CROSS JOIN LATERAL (SELECT w.id, w.sequence_key FROM task_waiting w
                            WHERE w.sequence_key = s.key ORDER BY w.pos LIMIT 1) w
        WHERE s.key = ANY (keys) AND s.head_id IS NULL
    ), promoted AS (
        DELETE FROM task_waiting w WHERE w.id = ANY (ARRAY(SELECT id FROM nxt)) RETURNING w.id, w.sequence_key, w.ended
    )
    UPDATE task_sequences s SET head_id = p.id, since = now(), blocked_at = CASE WHEN p.ended THEN now() END
    FROM promoted p WHERE s.key = p.sequence_key;
    DELETE FROM task_sequences s WHERE s.key = ANY (keys) AND s.head_id IS NULL;
    -- 5.
    WITH filed AS (
        INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
        SELECT t.shard, t.queue, t.kind, t.priority, t.run_after, t.id, t.deadline
        FROM task_sequences s JOIN tasks t ON t.id = s.head_id
        WHERE s.key = ANY (keys) AND t.state = 'ready'
          AND NOT EXISTS (SELECT 1 FROM task_claims c WHERE c.id = t.id)
          AND NOT EXISTS (SELECT 1 FROM task_ready r
                          WHERE (r.shard, r.queue, r.kind, r.priority, r.run_after, r.id)
                              = (t.shard, t.queue, t.kind, t.priority, t.run_after, t.id))
        RETURNING shard, priority, run_after
    )
    SELECT array_agg(shard), array_agg(shardrun_urgent(priority)) INTO shards, urgent
    FROM filed WHERE run_after <= now();
    IF shards IS NOT NULL AND coalesce(current_setting('shardrun.notify', true), '') <> 'off' THEN
        PERFORM shardrun_notify(shards, urgent);
    END IF;
END
$$;
