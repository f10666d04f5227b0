-- A claim says what no transaction other than its runner's may wait for
-- (docs/architecture.md, "Slow parts"):
--
--   ahead         the task was claimed ahead of need and its handler has
--                 not started: giving it back, an orphan requeue or a
--                 stale sweep returns it to its lane with the same attempt
--                 (no handler ran, so no attempt was spent)
--   completed_at  the handler recorded its completion in its own
--   completed_result  transaction (CompleteTx), which commits the handler's
--                 writes with this mark. The mark is the only row that
--                 transaction locks: every statement that ends the claim
--                 afterwards (the runner's own writes, the next owner's
--                 orphan requeue, the sweeps) completes the task with it,
--                 and none of them waits for that transaction while it is
--                 open (they skip locked claims and come back to them).
--
-- Defaulted or nullable columns: a catalog change only, no rewrite of
-- task_claims. Claims made by the previous build are neither ahead nor
-- marked, as they were.

-- +goose Up
ALTER TABLE task_claims
    ADD COLUMN ahead boolean NOT NULL DEFAULT false,
    ADD COLUMN completed_at timestamptz,
    ADD COLUMN completed_result jsonb;

-- +goose Down
ALTER TABLE task_claims DROP COLUMN ahead, DROP COLUMN completed_at, DROP COLUMN completed_result;
