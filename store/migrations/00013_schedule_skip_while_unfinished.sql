-- A schedule may skip a tick while the task of its last enqueued tick is
-- unfinished (issue 42): a periodic task of a kind no runner handles, or
-- one slower than its interval, would otherwise pile up a ready task per
-- tick. A defaulted column: a catalog change only, no rewrite of
-- schedules. The previous build's scheduler does not read it and enqueues
-- every tick, as before.

-- +goose Up
ALTER TABLE schedules ADD COLUMN skip_while_unfinished boolean NOT NULL DEFAULT false;

-- +goose Down
ALTER TABLE schedules DROP COLUMN skip_while_unfinished;
