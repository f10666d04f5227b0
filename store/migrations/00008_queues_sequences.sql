-- Queues that operators can pause, urgent tasks that wake their runners
-- first, and sequences: tasks of one sequence key run one at a time, in
-- enqueue order.
--
-- A sequence is a row of task_sequences while it has a head: the one task
-- of the sequence that may run (in task_ready or task_claims, or dead or
-- failed and blocking the rest). Its other unfinished tasks wait: their
-- state is ready, but they are in no lane, so no claim can see them. When
-- the head finishes the sequence moves on to its oldest waiting task, at
-- the commit of the transaction that finished it (a deferred trigger,
-- whose statements each see what committed before them: the head is
-- locked first, so an enqueue of the same key that raced it is seen), or
-- ends when none waits. A head that ends dead or failed keeps the
-- sequence blocked unless its task said sequence_blocks = false; an
-- operator's retry runs it again, an operator's cancel moves the sequence
-- on.

-- +goose Up
ALTER TABLE tasks
    ADD COLUMN sequence_key    text,
    ADD COLUMN sequence_blocks boolean,
    ADD CONSTRAINT tasks_sequence_check CHECK ((sequence_key IS NULL) = (sequence_blocks IS NULL));
-- A sequence's tasks in enqueue order; immutable columns, so the finishing
-- update stays in place.
CREATE INDEX tasks_sequence_id_idx ON tasks (sequence_key, id) WHERE sequence_key IS NOT NULL;

CREATE TABLE task_sequences (
    key        text        PRIMARY KEY,
    head_id    bigint      NOT NULL,
    since      timestamptz NOT NULL DEFAULT now(),
    -- set while the head, dead or failed, holds the sequence back
    blocked_at timestamptz
);
CREATE INDEX task_sequences_blocked_idx ON task_sequences (key) WHERE blocked_at IS NOT NULL;

-- A paused queue's tasks are claimed by nobody; running ones finish.
ALTER TABLE queues ADD COLUMN paused_at timestamptz;

CREATE OR REPLACE VIEW task_view AS
SELECT t.id, t.kind, t.shard, t.key, t.queue, t.priority, t.payload,
       CASE WHEN k.id IS NULL THEN t.state ELSE 'running' END AS state,
       t.attempt, t.max_attempts, t.run_after, t.deadline,
       coalesce(k.owner, t.claimed_by) AS claimed_by, coalesce(k.epoch, t.claim_epoch) AS claim_epoch,
       coalesce(k.claimed_at, t.claimed_at) AS claimed_at, coalesce(k.heartbeat_at, t.heartbeat_at) AS heartbeat_at,
       t.errors, t.result, t.created_at, t.finished_at, t.cancel_requested_at, t.unique_key, t.attempt_budget,
       t.schedule_id, t.schedule_tick, t.sequence_key, t.sequence_blocks
FROM tasks t
LEFT JOIN LATERAL (SELECT c.id, c.owner, c.epoch, c.claimed_at, c.heartbeat_at FROM task_claims c WHERE c.id = t.id) k ON true;

-- The insert trigger of 00007, and: the oldest new task of each sequence
-- key joins its sequence and heads it when the sequence has none (only a
-- head goes into its lane; the rest wait); the notification marks shards
-- that got an urgent task (priority below the default) with a '!', so
-- that their runners claim there first.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION shardrun_file_tasks() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    payload text;
BEGIN
    WITH firsts AS (
        SELECT DISTINCT ON (sequence_key) sequence_key, id FROM new_rows
        WHERE sequence_key IS NOT NULL AND state = 'ready'
        ORDER BY sequence_key, id
    ), joined AS (
        INSERT INTO task_sequences (key, head_id)
        SELECT sequence_key, id FROM firsts ORDER BY sequence_key
        ON CONFLICT (key) DO UPDATE SET head_id = task_sequences.head_id
        RETURNING head_id
    )
    INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
    SELECT shard, queue, kind, priority, run_after, id, deadline FROM new_rows
    WHERE state = 'ready' AND (sequence_key IS NULL OR id IN (SELECT head_id FROM joined));
    INSERT INTO task_finished (state, id, finished_at, queue)
    SELECT state, id, coalesce(finished_at, now()), queue FROM new_rows WHERE state <> 'ready';
    INSERT INTO task_unique_keys (unique_key, id)
    SELECT n.unique_key, n.id FROM new_rows n
    WHERE n.unique_key IS NOT NULL AND n.state = 'ready'
      AND NOT EXISTS (SELECT 1 FROM task_unique_keys k WHERE k.unique_key = n.unique_key AND k.id = n.id);
    INSERT INTO queues (name) SELECT DISTINCT queue FROM new_rows WHERE queue <> 'default'
    ON CONFLICT (name) DO NOTHING;
    IF current_setting('shardrun.notify', true) = 'off' THEN
        RETURN NULL;
    END IF;
    SELECT string_agg(CASE WHEN urgent THEN '!' ELSE '' END || shard::text, ',') INTO payload
    FROM (SELECT shard, bool_or(priority < 3) AS urgent FROM new_rows WHERE state = 'ready' GROUP BY shard) s;
    IF payload IS NULL THEN
        RETURN NULL;
    END IF;
    IF length(payload) > 7000 THEN
        payload := '*';
    END IF;
    PERFORM pg_notify('shardrun_tasks', payload);
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- A task a sequence released (its next head, or a retried head) is due
-- now: notify its shard as an insert would, marked urgent by its priority,
-- so that the sequence's next step waits for no poll. One notification per
-- shard and transaction (PostgreSQL drops a repeated payload).
-- +goose StatementBegin
CREATE FUNCTION shardrun_notify_due(task bigint) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    payload text;
BEGIN
    SELECT CASE WHEN priority < 3 THEN '!' ELSE '' END || shard::text INTO payload
    FROM tasks WHERE id = task AND run_after <= now();
    IF payload IS NOT NULL THEN
        PERFORM pg_notify('shardrun_tasks', payload);
    END IF;
END
$$;
-- +goose StatementEnd

-- A sequenced task changed state (at the commit of the transaction that
-- changed it). Retried (back to ready): it joins its sequence, and heads it
-- and goes into its lane when the sequence has no head. Finished while
-- heading its sequence: the sequence moves on to its oldest waiting task,
-- or ends; unless it ended dead or failed and blocks.
-- +goose StatementBegin
CREATE FUNCTION shardrun_sequence_moved() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    head bigint;
    nxt  bigint;
BEGIN
    SELECT state INTO NEW.state FROM tasks WHERE id = NEW.id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NEW.state = 'ready' THEN
        INSERT INTO task_sequences AS s (key, head_id) VALUES (NEW.sequence_key, NEW.id)
        ON CONFLICT (key) DO UPDATE SET head_id = s.head_id,
            blocked_at = CASE WHEN s.head_id = excluded.head_id THEN NULL ELSE s.blocked_at END
        RETURNING head_id INTO head;
        IF head = NEW.id THEN
            INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
            SELECT shard, queue, kind, priority, run_after, id, deadline FROM tasks
            WHERE id = NEW.id AND state = 'ready'
              AND NOT EXISTS (SELECT 1 FROM task_ready r
                              WHERE (r.shard, r.queue, r.kind, r.priority, r.run_after, r.id)
                                  = (tasks.shard, tasks.queue, tasks.kind, tasks.priority, tasks.run_after, tasks.id))
              AND NOT EXISTS (SELECT 1 FROM task_claims c WHERE c.id = NEW.id);
            PERFORM shardrun_notify_due(NEW.id);
        END IF;
        RETURN NULL;
    END IF;
    SELECT head_id INTO head FROM task_sequences WHERE key = NEW.sequence_key;
    IF head IS DISTINCT FROM NEW.id THEN
        RETURN NULL;
    END IF;
    SELECT head_id INTO head FROM task_sequences WHERE key = NEW.sequence_key FOR UPDATE;
    IF head IS DISTINCT FROM NEW.id THEN
        RETURN NULL;
    END IF;
    IF NEW.state IN ('failed', 'dead') AND NEW.sequence_blocks THEN
        UPDATE task_sequences SET blocked_at = now() WHERE key = NEW.sequence_key;
        RETURN NULL;
    END IF;
    SELECT id INTO nxt FROM tasks
    WHERE sequence_key = NEW.sequence_key AND state = 'ready' AND id <> NEW.id
    ORDER BY id LIMIT 1;
    IF nxt IS NULL THEN
        DELETE FROM task_sequences WHERE key = NEW.sequence_key;
    ELSE
        UPDATE task_sequences SET head_id = nxt, since = now(), blocked_at = NULL WHERE key = NEW.sequence_key;
        INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
        SELECT shard, queue, kind, priority, run_after, id, deadline FROM tasks WHERE id = nxt;
        PERFORM shardrun_notify_due(nxt);
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE CONSTRAINT TRIGGER tasks_sequence AFTER UPDATE OF state ON tasks
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.sequence_key IS NOT NULL AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION shardrun_sequence_moved();

-- +goose Down
DROP TRIGGER tasks_sequence ON tasks;
DROP FUNCTION shardrun_sequence_moved();
DROP FUNCTION shardrun_notify_due(bigint);
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION shardrun_file_tasks() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    payload text;
BEGIN
    INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
    SELECT shard, queue, kind, priority, run_after, id, deadline FROM new_rows WHERE state = 'ready';
    INSERT INTO task_finished (state, id, finished_at, queue)
    SELECT state, id, coalesce(finished_at, now()), queue FROM new_rows WHERE state <> 'ready';
    INSERT INTO task_unique_keys (unique_key, id)
    SELECT n.unique_key, n.id FROM new_rows n
    WHERE n.unique_key IS NOT NULL AND n.state = 'ready'
      AND NOT EXISTS (SELECT 1 FROM task_unique_keys k WHERE k.unique_key = n.unique_key AND k.id = n.id);
    INSERT INTO queues (name) SELECT DISTINCT queue FROM new_rows WHERE queue <> 'default'
    ON CONFLICT (name) DO NOTHING;
    IF current_setting('shardrun.notify', true) = 'off' THEN
        RETURN NULL;
    END IF;
    SELECT string_agg(DISTINCT shard::text, ',') INTO payload FROM new_rows WHERE state = 'ready';
    IF payload IS NULL THEN
        RETURN NULL;
    END IF;
    IF length(payload) > 7000 THEN
        payload := '*';
    END IF;
    PERFORM pg_notify('shardrun_tasks', payload);
    RETURN NULL;
END
$$;
-- +goose StatementEnd
CREATE OR REPLACE VIEW task_view AS
SELECT t.id, t.kind, t.shard, t.key, t.queue, t.priority, t.payload,
       CASE WHEN k.id IS NULL THEN t.state ELSE 'running' END AS state,
       t.attempt, t.max_attempts, t.run_after, t.deadline,
       coalesce(k.owner, t.claimed_by) AS claimed_by, coalesce(k.epoch, t.claim_epoch) AS claim_epoch,
       coalesce(k.claimed_at, t.claimed_at) AS claimed_at, coalesce(k.heartbeat_at, t.heartbeat_at) AS heartbeat_at,
       t.errors, t.result, t.created_at, t.finished_at, t.cancel_requested_at, t.unique_key, t.attempt_budget,
       t.schedule_id, t.schedule_tick
FROM tasks t
LEFT JOIN LATERAL (SELECT c.id, c.owner, c.epoch, c.claimed_at, c.heartbeat_at FROM task_claims c WHERE c.id = t.id) k ON true;
ALTER TABLE queues DROP COLUMN paused_at;
DROP TABLE task_sequences;
DROP INDEX tasks_sequence_id_idx;
ALTER TABLE tasks DROP CONSTRAINT tasks_sequence_check, DROP COLUMN sequence_blocks, DROP COLUMN sequence_key;
