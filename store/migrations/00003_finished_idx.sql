-- Finished tasks by when they finished: the status page's completion rate
-- (tasks finished in the last seconds) and, later, retention (finished
-- tasks older than a horizon) walk this index instead of the table.

-- +goose Up
CREATE INDEX tasks_finished_idx ON tasks (finished_at) WHERE finished_at IS NOT NULL;

-- +goose Down
DROP INDEX tasks_finished_idx;
