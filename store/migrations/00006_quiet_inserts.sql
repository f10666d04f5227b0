-- The insert trigger skips transactions that set shardrun.notify to 'off':
-- the store's own inserts outside a producer's transaction, which it
-- notifies after their commit, coalesced (store/notify.go). NOTIFY in the
-- inserting transaction serialises the commits of concurrent producers
-- (measured by the bench's notify section). Raw SQL and producers' own
-- transactions are notified by the trigger, as before.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION shardrun_notify_tasks() RETURNS trigger LANGUAGE plpgsql AS $$
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

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION shardrun_notify_tasks() RETURNS trigger LANGUAGE plpgsql AS $$
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
