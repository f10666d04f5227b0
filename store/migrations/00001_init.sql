-- The task table, the shard fences and the enqueue notification.
-- Every time comparison in the system uses this database's now().

-- +goose Up
CREATE TABLE tasks (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind         text        NOT NULL CHECK (kind <> ''),
    shard        integer     NOT NULL CHECK (shard >= 0),
    key          text        NOT NULL,
    payload      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    state        text        NOT NULL DEFAULT 'ready'
                 CHECK (state IN ('ready', 'running', 'completed', 'failed', 'dead')),
    attempt      integer     NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    max_attempts integer     NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    run_after    timestamptz NOT NULL DEFAULT now(),
    deadline     timestamptz,
    claimed_by   text,
    claim_epoch  bigint,
    claimed_at   timestamptz,
    heartbeat_at timestamptz,
    errors       jsonb       NOT NULL DEFAULT '[]'::jsonb,
    result       jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);

-- Claim: ready tasks in run_after order; the shard filter is applied to the
-- rows this scan yields.
CREATE INDEX tasks_claim_idx ON tasks (run_after, id) WHERE state = 'ready';
-- Stale sweep: running tasks by their last sign of life.
CREATE INDEX tasks_stale_idx ON tasks ((coalesce(heartbeat_at, claimed_at))) WHERE state = 'running';
-- Deadline sweep: only unfinished tasks that have a deadline.
CREATE INDEX tasks_deadline_idx ON tasks (deadline)
    WHERE deadline IS NOT NULL AND state IN ('ready', 'running');
-- Orphan requeue on shard acquisition: running tasks of one shard by epoch.
CREATE INDEX tasks_orphan_idx ON tasks (shard, claim_epoch) WHERE state = 'running';

-- One row per shard: the newest ownership epoch (the etcd CreateRevision of
-- the shard key) and the runner holding it. Every task write checks it.
CREATE TABLE shard_fences (
    shard      integer PRIMARY KEY CHECK (shard >= 0),
    epoch      bigint  NOT NULL CHECK (epoch > 0),
    owner      text    NOT NULL,
    raised_at  timestamptz NOT NULL DEFAULT now()
);

-- Exponential backoff with equal jitter: min(cap, base * 2^(attempt-1)),
-- scaled by a random factor in [0.5, 1). The Go retry policy computes the same.
-- +goose StatementBegin
CREATE FUNCTION shardrun_backoff(attempt integer, base_ms bigint, cap_ms bigint)
RETURNS interval LANGUAGE sql VOLATILE AS $$
    SELECT (least(cap_ms::double precision,
                  base_ms::double precision * power(2, greatest(attempt, 1) - 1))
            * (0.5 + random() * 0.5)) * interval '1 millisecond'
$$;
-- +goose StatementEnd

-- Wake idle runners when tasks are inserted, by any producer. The payload is
-- the comma-separated shards that got ready tasks, or '*' when too long for
-- a notification.
-- +goose StatementBegin
CREATE FUNCTION shardrun_notify_tasks() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    payload text;
BEGIN
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

-- +goose Down
DROP TRIGGER tasks_notify ON tasks;
DROP FUNCTION shardrun_notify_tasks();
DROP FUNCTION shardrun_backoff(integer, bigint, bigint);
DROP TABLE shard_fences;
DROP TABLE tasks;
