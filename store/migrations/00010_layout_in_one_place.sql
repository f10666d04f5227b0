-- The task layout in one place (issue 32).
--
-- From this version on, every function, trigger function and view of the
-- layout has one current body, in store/sql/ (one file each), which the
-- store applies after the migrations whenever the files changed
-- (internal/store/code.go); migrations hold tables, indexes, types and triggers.
--
-- Tasks waiting their turn in a sequence get a place of their own,
-- task_waiting, in the order their transactions committed (pos): a
-- task's place is then exactly one of its lane, its claim or its
-- sequence's waiting line, until it finishes. Sequences are settled by one
-- function (shardrun_settle), under their rows' locks taken in key order:
-- at the commit of a producer's transaction (the trigger tasks_settle),
-- and in every statement that moves a task of a sequence.
--
-- One transaction. Stop the runners and coordinators first
-- (docs/upgrading.md).

-- +goose Up
-- What shardrun_file needs to file a task: the columns of its lane, its
-- finished entry, its unique key and its sequence.
CREATE TYPE shardrun_place AS (
    id           bigint,
    shard        integer,
    queue        text,
    kind         text,
    priority     smallint,
    run_after    timestamptz,
    deadline     timestamptz,
    state        text,
    unique_key   text,
    finished_at  timestamptz,
    sequence_key text
);

CREATE TABLE task_waiting (
    id           bigint      PRIMARY KEY,
    sequence_key text        NOT NULL,
    pos          bigint      GENERATED ALWAYS AS IDENTITY,
    queue        text        NOT NULL,
    deadline     timestamptz,
    -- ended: the task failed (or died) while it waited, in a sequence it
    -- blocks; it keeps its place so that the sequence stops there when
    -- its turn comes (shardrun_expire, shardrun_settle).
    ended        boolean     NOT NULL DEFAULT false,
    UNIQUE (sequence_key, pos)
);
-- The deadline sweep's waiting half, and the queues' counts.
CREATE INDEX task_waiting_deadline_idx ON task_waiting (deadline) WHERE deadline IS NOT NULL;
CREATE INDEX task_waiting_queue_idx ON task_waiting (queue);
ALTER TABLE task_waiting SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 10000, autovacuum_vacuum_cost_delay = 0);
ALTER TABLE task_sequences ALTER COLUMN head_id DROP NOT NULL;

-- The tasks that waited in no place (sequenced, ready, neither in a lane
-- nor claimed nor the head) wait in task_waiting, in id order.
INSERT INTO task_waiting (id, sequence_key, queue, deadline)
SELECT t.id, t.sequence_key, t.queue, t.deadline FROM tasks t
WHERE t.sequence_key IS NOT NULL AND t.state = 'ready'
  AND NOT EXISTS (SELECT 1 FROM task_sequences s WHERE s.key = t.sequence_key AND s.head_id = t.id)
  AND NOT EXISTS (SELECT 1 FROM task_claims c WHERE c.id = t.id)
  AND NOT EXISTS (SELECT 1 FROM task_ready r WHERE (r.shard, r.queue, r.kind, r.priority, r.run_after, r.id)
                                                 = (t.shard, t.queue, t.kind, t.priority, t.run_after, t.id))
ORDER BY t.sequence_key, t.id;
-- Sequences the defects of the earlier layout left stuck: a head that is
-- missing (retention deleted it), cancelled, or finished without blocking
-- releases its sequence; sequences with waiting tasks and no row get one;
-- an idle sequence's first waiting task becomes its head.
UPDATE task_sequences s SET head_id = NULL, blocked_at = NULL
WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = s.head_id
                  AND (t.state = 'ready' OR (t.state IN ('dead', 'failed') AND t.sequence_blocks)));
INSERT INTO task_sequences (key, head_id)
SELECT DISTINCT w.sequence_key, NULL::bigint FROM task_waiting w ON CONFLICT (key) DO NOTHING;
WITH nxt AS (
    SELECT w.id, w.sequence_key FROM task_sequences s
    CROSS JOIN LATERAL (SELECT w.id, w.sequence_key FROM task_waiting w WHERE w.sequence_key = s.key ORDER BY w.pos LIMIT 1) w
    WHERE s.head_id IS NULL
), promoted AS (
    DELETE FROM task_waiting w WHERE w.id IN (SELECT id FROM nxt) RETURNING w.id, w.sequence_key
), headed AS (
    UPDATE task_sequences s SET head_id = p.id, since = now() FROM promoted p WHERE s.key = p.sequence_key
)
INSERT INTO task_ready (shard, queue, kind, priority, run_after, id, deadline)
SELECT t.shard, t.queue, t.kind, t.priority, t.run_after, t.id, t.deadline FROM tasks t JOIN promoted p ON p.id = t.id;
DELETE FROM task_sequences WHERE head_id IS NULL;

-- The deferred trigger of 00008 settled sequences one task at a time, in
-- id order, at every commit (and deadlocked with producers, which locked
-- in key order): replaced by shardrun_settle.
DROP TRIGGER tasks_sequence ON tasks;
DROP FUNCTION shardrun_sequence_moved();
DROP FUNCTION shardrun_notify_due(bigint);
-- The producer's sequences are settled at its commit; the function's body
-- is internal/store/sql/shardrun_settle_at_commit.sql, applied after the migrations.
-- +goose StatementBegin
CREATE FUNCTION shardrun_settle_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
-- +goose StatementEnd
CREATE CONSTRAINT TRIGGER tasks_settle AFTER INSERT ON tasks
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.sequence_key IS NOT NULL)
    EXECUTE FUNCTION shardrun_settle_at_commit();

-- A queue's name follows the API's rule (tasks.CheckQueue: 1 to 100
-- letters, digits and ._-) in the database too, so that a producer
-- inserting with SQL cannot store a queue the API refuses. NOT VALID:
-- existing rows are not checked (docs/upgrading.md says how to find and
-- fix them).
ALTER TABLE tasks DROP CONSTRAINT tasks_queue_check,
    ADD CONSTRAINT tasks_queue_check CHECK (queue ~ '^[A-Za-z0-9._-]{1,100}$') NOT VALID;
ALTER TABLE queues ADD CONSTRAINT queues_name_rule CHECK (name ~ '^[A-Za-z0-9._-]{1,100}$') NOT VALID;

-- Mixed fleets (issue 31): the unit of ownership is a shard of a
-- capability group (the runners that serve the same queues and handle the
-- same kinds: shard.GroupOf). Each unit has its fence, and a claim records
-- the unit it was made under, so that the unit's next owner requeues
-- exactly its claims. Rows of the earlier layout belong to the group ''
-- (no runner's): their claims are requeued by the stale sweep.
ALTER TABLE shard_fences ADD COLUMN grp text NOT NULL DEFAULT '';
ALTER TABLE shard_fences DROP CONSTRAINT shard_fences_pkey, ADD PRIMARY KEY (grp, shard);
-- A runner's claims and writes name a unit by (shard, epoch): an epoch is
-- an etcd revision, so it names one group's unit.
CREATE INDEX shard_fences_unit_idx ON shard_fences (shard, epoch);
ALTER TABLE task_claims ADD COLUMN grp text NOT NULL DEFAULT '';

-- +goose Down
-- +goose StatementBegin
DO $$ BEGIN
    RAISE EXCEPTION 'migration 10 (the layout in one place) cannot be undone: restore the database from a backup taken before it';
END $$;
-- +goose StatementEnd
