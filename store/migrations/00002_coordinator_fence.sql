-- The leader coordinator's fence: sweeps apply only under the newest
-- leadership epoch (the etcd CreateRevision of the leader's election key),
-- so a coordinator that lost its leadership but has not noticed yet sweeps
-- nothing once the new leader has raised the fence.

-- +goose Up
CREATE TABLE coordinator_fence (
    id        integer PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    epoch     bigint  NOT NULL CHECK (epoch > 0),
    leader    text    NOT NULL,
    raised_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE coordinator_fence;
