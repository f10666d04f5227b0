-- The leader's maintenance (issue 14): what retention, schedules and
-- claims that ignore unclaimable work need from the schema.
--

-- Outside a transaction, so that the indexes are built and dropped
-- CONCURRENTLY: in one transaction the DROP INDEX held an ACCESS EXCLUSIVE
-- lock on tasks while three indexes were built (10-40 s each at 10 million
-- rows), blocking every heartbeat for that long, after which the sweeper
-- would have taken every running claim for stale. Every statement is
-- idempotent, so a start that died half-way is completed by the next one
-- (under goose's advisory lock); an index left invalid by a failed
-- concurrent build is dropped first and rebuilt.
-- +goose NO TRANSACTION

-- +goose Up

-- +goose StatementBegin
DO $$
DECLARE
    idx text;
BEGIN
    FOR idx IN
        SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE NOT i.indisvalid AND c.relname IN
            ('tasks_ready_idx', 'tasks_finished_state_idx', 'tasks_schedule_tick_idx')
    LOOP
        EXECUTE format('DROP INDEX %I', idx);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- Claims walk the ready tasks of one kind at a time (one index range per
-- kind the runner handles), so ready tasks of kinds nobody handles are
-- never visited. The old index (run_after, id) made every claim scan them.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_ready_idx ON tasks (kind, run_after, id) WHERE state = 'ready';
DROP INDEX CONCURRENTLY IF EXISTS tasks_claim_idx;

-- Finished tasks by state and age: retention deletes one state's rows
-- older than its horizon from the oldest, without walking past rows of a
-- state kept longer; the completion rate counts one range per state. It
-- replaces tasks_finished_idx (finished_at) of an earlier build.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_finished_state_idx ON tasks (state, finished_at) WHERE finished_at IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS tasks_finished_idx;

-- Schedules: periodic tasks. next_tick is the next tick not yet enqueued;
-- the leader enqueues a tick and moves next_tick past it in one
-- transaction under the coordinator fence.
CREATE TABLE IF NOT EXISTS schedules (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         text        NOT NULL UNIQUE CHECK (name <> ''),
    kind         text        NOT NULL CHECK (kind <> ''),
    key          text        NOT NULL DEFAULT '',
    payload      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    max_attempts integer     CHECK (max_attempts >= 1),
    every_ms     bigint      CHECK (every_ms >= 1000),
    cron         text,
    timezone     text        NOT NULL DEFAULT 'UTC',
    start_at     timestamptz NOT NULL DEFAULT now(),
    next_tick    timestamptz NOT NULL,
    last_tick    timestamptz,
    last_task_id bigint,
    skipped      bigint      NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    CHECK ((every_ms IS NULL) <> (cron IS NULL))
);
CREATE INDEX IF NOT EXISTS schedules_next_tick_idx ON schedules (next_tick);

-- The task of each tick carries the schedule and the tick: at most one task
-- per (schedule, tick) while it exists, whoever inserts it. Adding nullable
-- columns without a default rewrites nothing.
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS schedule_id bigint, ADD COLUMN IF NOT EXISTS schedule_tick timestamptz;
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS tasks_schedule_tick_idx ON tasks (schedule_id, schedule_tick)
    WHERE schedule_id IS NOT NULL;

-- The cluster this database belongs to: its shard count, recorded by the
-- first runner or coordinator that starts (store.EnsureShardCount), which
-- also adds the CHECK constraint tasks_shard_in_range (shard < count).
CREATE TABLE IF NOT EXISTS shardrun_cluster (
    id          integer PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    shard_count integer NOT NULL CHECK (shard_count >= 1),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Autovacuum: PostgreSQL's defaults. A tighter setting (vacuum at 1%
-- dead rows, unthrottled) made no measurable difference to the table's size
-- under a steady churn with retention (docs/architecture.md, bench: churn).

-- +goose Down
DROP TABLE IF EXISTS shardrun_cluster;
ALTER TABLE tasks DROP CONSTRAINT IF EXISTS tasks_shard_in_range;
DROP INDEX CONCURRENTLY IF EXISTS tasks_schedule_tick_idx;
ALTER TABLE tasks DROP COLUMN IF EXISTS schedule_tick, DROP COLUMN IF EXISTS schedule_id;
DROP TABLE IF EXISTS schedules;
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_finished_idx ON tasks (finished_at) WHERE finished_at IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS tasks_finished_state_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_claim_idx ON tasks (run_after, id) WHERE state = 'ready';
DROP INDEX CONCURRENTLY IF EXISTS tasks_ready_idx;
