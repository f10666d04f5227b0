-- The task layout: the record apart from the work queues.
--
-- tasks is the record of every task, and now only that: its indexes cover
-- columns no state change writes (id, key, kind, the schedule tick), so
-- that claims, completions and failures update it in place (HOT: no new
-- index entry) where its page has room, which fillfactor keeps. Where a
-- task is in its life lives in narrow tables keyed for the statement that
-- reads them:
--
--   task_ready     ready tasks, keyed by lane (shard, queue, kind) and then
--                  (priority, run_after, id): a claim reads only the lanes
--                  of the shards it owns and the kinds it handles, in order
--   task_claims    running tasks, one row per claim: the fenced writes of
--                  its runner, the stale sweep and the next owner's orphan
--                  requeue all match this row
--   task_finished  finished tasks by state: listing, counts, retention
--   task_unique_keys  the unique keys unfinished tasks hold
--   queues         every queue a task was enqueued in
--
-- tasks.state is 'ready' for every unfinished task: a task is running
-- while a task_claims row holds it, and the operator-facing state says so.
-- A CHECK refuses 'running' in tasks, so a runner of an earlier build that
-- was not stopped before this migration cannot claim (it would write
-- nothing but errors).
--
-- One transaction: the tables are filled from tasks as it stands, and the
-- old indexes dropped and the new one built, all or nothing. It takes an
-- exclusive lock on tasks for its duration (docs/upgrading.md: stop the
-- runners, migrate, start the new build).

-- +goose Up
ALTER TABLE tasks
    ADD COLUMN IF NOT EXISTS queue    text     NOT NULL DEFAULT 'default',
    ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 3;
ALTER TABLE tasks
    ADD CONSTRAINT tasks_queue_check CHECK (queue <> '' AND length(queue) <= 100),
    ADD CONSTRAINT tasks_priority_check CHECK (priority BETWEEN 1 AND 5);

CREATE TABLE queues (
    name       text PRIMARY KEY CHECK (name <> ''),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO queues (name) VALUES ('default');

CREATE TABLE task_ready (
    shard     integer     NOT NULL,
    queue     text        NOT NULL,
    kind      text        NOT NULL,
    priority  smallint    NOT NULL,
    run_after timestamptz NOT NULL,
    id        bigint      NOT NULL,
    deadline  timestamptz,
    PRIMARY KEY (shard, queue, kind, priority, run_after, id)
);
-- The deadline sweep's ready half: only tasks that have a deadline.
CREATE INDEX task_ready_deadline_idx ON task_ready (deadline) WHERE deadline IS NOT NULL;

CREATE TABLE task_claims (
    id           bigint      PRIMARY KEY,
    shard        integer     NOT NULL,
    queue        text        NOT NULL,
    epoch        bigint      NOT NULL,
    owner        text        NOT NULL,
    attempt      integer     NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz,
    deadline     timestamptz
);
-- No index but the primary key: every claim would write one more entry,
-- and the sweeps that read claims by time (stale, deadline) read the whole
-- table, which holds one row per running task (and what vacuum has not
-- removed yet), every few seconds on the leader alone.

CREATE TABLE task_finished (
    state       text        NOT NULL,
    id          bigint      NOT NULL,
    finished_at timestamptz NOT NULL,
    queue       text        NOT NULL,
    PRIMARY KEY (state, id)
);
-- Retention (oldest first per state) and the completion rate.
CREATE INDEX task_finished_at_idx ON task_finished (state, finished_at);

CREATE TABLE task_unique_keys (
    unique_key text   PRIMARY KEY,
    id         bigint NOT NULL
);

-- The queue tables churn by a row per task: vacuum them at once rather
-- than at 20% dead rows of a table that is small when vacuum looks.
ALTER TABLE task_ready SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 10000, autovacuum_vacuum_cost_delay = 0);
ALTER TABLE task_claims SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 10000, autovacuum_vacuum_cost_delay = 0);
-- Room on each page for the finishing update's new version, so that it
-- stays on the page (HOT) and writes no index entry.
ALTER TABLE tasks SET (fillfactor = 80);

-- Fill the new tables from the tasks as they stand. Running tasks keep
-- their claims (owner, epoch, attempt, times): the next owner of the shard
-- requeues them as orphans, or the stale sweep does, as before.
INSERT INTO task_claims (id, shard, queue, epoch, owner, attempt, claimed_at, heartbeat_at, deadline)
SELECT id, shard, queue, coalesce(claim_epoch, 0), coalesce(claimed_by, ''), attempt, coalesce(claimed_at, now()), heartbeat_at, deadline
FROM tasks WHERE state = 'running';
UPDATE tasks SET state = 'ready', claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL, heartbeat_at = NULL
WHERE state = 'running';
INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
SELECT t.shard, t.queue, t.kind, t.priority, t.run_after, t.id, t.deadline FROM tasks t
WHERE t.state = 'ready' AND NOT EXISTS (SELECT 1 FROM task_claims c WHERE c.id = t.id);
INSERT INTO task_finished (state, id, finished_at, queue)
SELECT state, id, coalesce(finished_at, created_at), queue FROM tasks WHERE state <> 'ready';
-- A task whose cancel was requested no longer holds its key.
INSERT INTO task_unique_keys (unique_key, id)
SELECT unique_key, id FROM tasks WHERE unique_key IS NOT NULL AND state = 'ready' AND cancel_requested_at IS NULL;

ALTER TABLE tasks DROP CONSTRAINT IF EXISTS tasks_state_check,
    ADD CONSTRAINT tasks_state_check CHECK (state IN ('ready', 'completed', 'failed', 'dead', 'cancelled'));

-- Every index whose key or predicate holds a column a state change writes.
DROP INDEX IF EXISTS tasks_ready_idx;
DROP INDEX IF EXISTS tasks_stale_idx;
DROP INDEX IF EXISTS tasks_orphan_idx;
DROP INDEX IF EXISTS tasks_deadline_idx;
DROP INDEX IF EXISTS tasks_state_id_idx;
DROP INDEX IF EXISTS tasks_kind_state_id_idx;
DROP INDEX IF EXISTS tasks_finished_state_idx;
DROP INDEX IF EXISTS tasks_unique_key_idx;
-- Listing by kind (the state comes from the tables above).
CREATE INDEX tasks_kind_id_idx ON tasks (kind, id);
-- Every task of a unique key, finished or not: a bulk retry retries only
-- the newest.
CREATE INDEX tasks_unique_key_id_idx ON tasks (unique_key, id) WHERE unique_key IS NOT NULL;

-- A task as operators see it: running while a claim holds it, with that
-- claim's owner and times. LATERAL keeps the claim lookup a primary-key
-- probe per task, whatever the statistics of task_claims say.
CREATE VIEW task_view AS
SELECT t.id, t.kind, t.shard, t.key, t.queue, t.priority, t.payload,
       CASE WHEN k.id IS NULL THEN t.state ELSE 'running' END AS state,
       t.attempt, t.max_attempts, t.run_after, t.deadline,
       coalesce(k.owner, t.claimed_by) AS claimed_by, coalesce(k.epoch, t.claim_epoch) AS claim_epoch,
       coalesce(k.claimed_at, t.claimed_at) AS claimed_at, coalesce(k.heartbeat_at, t.heartbeat_at) AS heartbeat_at,
       t.errors, t.result, t.created_at, t.finished_at, t.cancel_requested_at, t.unique_key, t.attempt_budget,
       t.schedule_id, t.schedule_tick
FROM tasks t
LEFT JOIN LATERAL (SELECT c.id, c.owner, c.epoch, c.claimed_at, c.heartbeat_at FROM task_claims c WHERE c.id = t.id) k ON true;

-- Every insert into tasks, by any producer (the store, a producer's own
-- transaction, raw SQL, COPY), files its ready tasks into their lanes,
-- registers their unique keys and queues, and notifies the runners of the
-- shards that got ready tasks, unless the transaction set shardrun.notify
-- to 'off' (the store's own inserts, notified after their commit). A
-- unique key the store registered before inserting (to insert idempotently)
-- is not registered again; one another task holds makes the insert fail.
-- +goose StatementBegin
CREATE FUNCTION shardrun_file_tasks() RETURNS trigger LANGUAGE plpgsql AS $$
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

DROP TRIGGER tasks_notify ON tasks;
DROP FUNCTION shardrun_notify_tasks();
CREATE TRIGGER tasks_file AFTER INSERT ON tasks
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION shardrun_file_tasks();

-- +goose Down
DROP VIEW task_view;
DROP TRIGGER tasks_file ON tasks;
DROP FUNCTION shardrun_file_tasks();
-- +goose StatementBegin
CREATE FUNCTION shardrun_notify_tasks() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    payload text;
BEGIN
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
CREATE TRIGGER tasks_notify AFTER INSERT ON tasks
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION shardrun_notify_tasks();
ALTER TABLE tasks DROP CONSTRAINT IF EXISTS tasks_state_check,
    ADD CONSTRAINT tasks_state_check
    CHECK (state IN ('ready', 'running', 'completed', 'failed', 'dead', 'cancelled'));
UPDATE tasks t SET state = 'running', claimed_by = c.owner, claim_epoch = c.epoch, claimed_at = c.claimed_at,
    heartbeat_at = c.heartbeat_at
FROM task_claims c WHERE c.id = t.id;
DROP INDEX IF EXISTS tasks_kind_id_idx;
DROP INDEX IF EXISTS tasks_unique_key_id_idx;
CREATE INDEX tasks_ready_idx ON tasks (kind, run_after, id) WHERE state = 'ready';
CREATE INDEX tasks_stale_idx ON tasks ((coalesce(heartbeat_at, claimed_at))) WHERE state = 'running';
CREATE INDEX tasks_orphan_idx ON tasks (shard, claim_epoch) WHERE state = 'running';
CREATE INDEX tasks_deadline_idx ON tasks (deadline) WHERE deadline IS NOT NULL AND state IN ('ready', 'running');
CREATE INDEX tasks_state_id_idx ON tasks (state, id);
CREATE INDEX tasks_kind_state_id_idx ON tasks (kind, state, id);
CREATE INDEX tasks_finished_state_idx ON tasks (state, finished_at) WHERE finished_at IS NOT NULL;
CREATE UNIQUE INDEX tasks_unique_key_idx ON tasks (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('ready', 'running');
ALTER TABLE tasks RESET (fillfactor);
DROP TABLE task_unique_keys, task_finished, task_claims, task_ready, queues;
ALTER TABLE tasks DROP CONSTRAINT IF EXISTS tasks_priority_check, DROP CONSTRAINT IF EXISTS tasks_queue_check;
ALTER TABLE tasks DROP COLUMN IF EXISTS priority, DROP COLUMN IF EXISTS queue;
