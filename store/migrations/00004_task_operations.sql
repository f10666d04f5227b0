-- Task operations: cancel (the cancelled state and the cancel request a
-- heartbeat carries to the runner), retry (the budget a retry grants),
-- idempotent enqueue (unique keys) and inspection (indexes that keep
-- listing, counting and bulk operations bounded at tens of millions of
-- rows).
--
-- Outside a transaction so that the indexes are built CONCURRENTLY: on a
-- table of 10 million rows each build takes 10-40s, during which a plain
-- CREATE INDEX would block every claim and completion. Every statement is
-- idempotent, so a start that died half-way is completed by the next one
-- (under goose's advisory lock, one at a time); an index left invalid by a
-- failed concurrent build is dropped first and rebuilt.
-- +goose NO TRANSACTION

-- +goose Up
ALTER TABLE tasks
    ADD COLUMN IF NOT EXISTS cancel_requested_at timestamptz,
    ADD COLUMN IF NOT EXISTS unique_key          text,
    -- The attempts a retry grants: max_attempts as enqueued, recorded at
    -- the first retry (NULL until then, so enqueueing stays unchanged).
    ADD COLUMN IF NOT EXISTS attempt_budget      integer CHECK (attempt_budget >= 1);

-- The state constraint gains 'cancelled'. NOT VALID then VALIDATE: the
-- check of the existing rows takes a lock that lets claims and writes go on.
ALTER TABLE tasks DROP CONSTRAINT IF EXISTS tasks_state_check,
    ADD CONSTRAINT tasks_state_check
    CHECK (state IN ('ready', 'running', 'completed', 'failed', 'dead', 'cancelled')) NOT VALID;
ALTER TABLE tasks VALIDATE CONSTRAINT tasks_state_check;

-- +goose StatementBegin
DO $$
DECLARE
    idx text;
BEGIN
    FOR idx IN
        SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE NOT i.indisvalid AND c.relname IN
            ('tasks_state_id_idx', 'tasks_kind_state_id_idx', 'tasks_key_id_idx', 'tasks_unique_key_idx')
    LOOP
        EXECUTE format('DROP INDEX %I', idx);
    END LOOP;
END
$$;
-- +goose StatementEnd

-- Listing, counting and bulk operations by state, newest or oldest first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_state_id_idx ON tasks (state, id);
-- By kind and state; by kind alone as a merge of one range per state.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_kind_state_id_idx ON tasks (kind, state, id);
-- By key: everything that happened to one user's, one order's tasks.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_key_id_idx ON tasks (key, id);
-- Idempotent enqueue: one unfinished task per unique key. Inserts use
-- ON CONFLICT against it, so concurrent producers cannot both insert.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS tasks_unique_key_idx ON tasks (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('ready', 'running');

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS tasks_unique_key_idx;
DROP INDEX CONCURRENTLY IF EXISTS tasks_key_id_idx;
DROP INDEX CONCURRENTLY IF EXISTS tasks_kind_state_id_idx;
DROP INDEX CONCURRENTLY IF EXISTS tasks_state_id_idx;
-- Cancelled tasks become failed: the older schema has no other final state
-- that no runner takes.
UPDATE tasks SET state = 'failed' WHERE state = 'cancelled';
ALTER TABLE tasks DROP CONSTRAINT IF EXISTS tasks_state_check,
    ADD CONSTRAINT tasks_state_check CHECK (state IN ('ready', 'running', 'completed', 'failed', 'dead'));
ALTER TABLE tasks DROP COLUMN IF EXISTS attempt_budget,
    DROP COLUMN IF EXISTS unique_key,
    DROP COLUMN IF EXISTS cancel_requested_at;
