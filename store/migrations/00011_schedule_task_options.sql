-- A schedule's task takes the options any task takes (issue 33): its
-- queue, priority and sequence. Nullable or defaulted columns: a catalog
-- change only, no rewrite of schedules. The previous build's scheduler
-- reads the columns it knows and enqueues ticks as before (default queue
-- and priority, no sequence).

-- +goose Up
ALTER TABLE schedules
    ADD COLUMN queue text NOT NULL DEFAULT 'default' CHECK (queue ~ '^[A-Za-z0-9._-]{1,100}$'),
    ADD COLUMN priority integer NOT NULL DEFAULT 3 CHECK (priority BETWEEN 1 AND 5),
    ADD COLUMN sequence_key text CHECK (sequence_key <> ''),
    ADD COLUMN sequence_blocks boolean NOT NULL DEFAULT true;

-- +goose Down
ALTER TABLE schedules DROP COLUMN queue, DROP COLUMN priority, DROP COLUMN sequence_key, DROP COLUMN sequence_blocks;
