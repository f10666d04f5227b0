-- Where a task is: the one rule, for every task whose record was just
-- written (inserted, or moved by a statement of moves.go) and that is in
-- no place yet.
--
--   unfinished, in no sequence  -> its lane (task_ready)
--   in a sequence               -> the sequence decides (shardrun_settle):
--                                  its head goes into its lane, the others
--                                  wait their turn (task_waiting); a finished
--                                  head hands the sequence on or blocks it
--   finished                    -> task_finished, and its unique key is free
--
-- A claim row (task_claims) is made by the claim alone, never here.
-- settle_now: settle the sequences now (every move) or at the commit of the
-- transaction (inserts: a producer's open transaction must not hold the
-- sequences' locks; shardrun_settle_at_commit).
--
-- Locks, in the one order of moves.go: the sequences first (shardrun_settle
-- locks them in key order), then the new lane and finished entries and the
-- unique keys.
CREATE OR REPLACE FUNCTION shardrun_file(p shardrun_place[], settle_now boolean) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    seq bigint[];
    lanes boolean;
    finished boolean;
    keys boolean;
BEGIN
    -- One pass says which of the statements below have rows to write: a
    -- producer's insert files into lanes only, a completion into
    -- task_finished only, and each statement skipped is one less to run
    -- (a single-row insert's statement took 0.44 ms with all of them
    -- running, 0.30 ms with this, pgbench on an idle server).
    SELECT array_agg(x.id) FILTER (WHERE x.sequence_key IS NOT NULL),
           bool_or(x.state = 'ready' AND x.sequence_key IS NULL),
           bool_or(x.state <> 'ready'),
           bool_or(x.state <> 'ready' AND x.unique_key IS NOT NULL)
    INTO seq, lanes, finished, keys
    FROM unnest(p) x;
    IF seq IS NOT NULL THEN
        IF settle_now THEN
            PERFORM shardrun_settle(seq);
        ELSE
            PERFORM set_config('shardrun.settle',
                coalesce(nullif(current_setting('shardrun.settle', true), '') || ',', '') || array_to_string(seq, ','), true);
        END IF;
    END IF;
    IF lanes THEN
        INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
        SELECT x.shard, x.queue, x.kind, x.priority, x.run_after, x.id, x.deadline
        FROM unnest(p) x WHERE x.state = 'ready' AND x.sequence_key IS NULL;
    END IF;
    IF finished THEN
        INSERT INTO task_finished (state, id, finished_at, queue)
        SELECT x.state, x.id, coalesce(x.finished_at, now()), x.queue FROM unnest(p) x WHERE x.state <> 'ready';
    END IF;
    IF keys THEN
        DELETE FROM task_unique_keys u USING unnest(p) x
        WHERE x.state <> 'ready' AND x.unique_key IS NOT NULL AND u.unique_key = x.unique_key AND u.id = x.id;
    END IF;
END
$$;
