-- A task as operators see it: its record, with state 'running' while a
-- claim holds it (a task's record says 'ready' from its insert until it
-- finishes), and that claim's owner and times. The one rule of the state
-- operators see; the counts by state count the places instead (store:
-- countsByPlace). LATERAL keeps the claim lookup a primary-key probe per
-- task, whatever the statistics of task_claims say.
CREATE OR REPLACE VIEW task_view AS
SELECT t.id, t.kind, t.shard, t.key, t.queue, t.priority, t.payload,
       CASE WHEN k.id IS NULL THEN t.state ELSE 'running' END AS state,
       t.attempt, t.max_attempts, t.run_after, t.deadline,
       coalesce(k.owner, t.claimed_by) AS claimed_by, coalesce(k.epoch, t.claim_epoch) AS claim_epoch,
       coalesce(k.claimed_at, t.claimed_at) AS claimed_at, coalesce(k.heartbeat_at, t.heartbeat_at) AS heartbeat_at,
       t.errors, t.result, t.created_at, t.finished_at, t.cancel_requested_at, t.unique_key, t.attempt_budget,
       t.schedule_id, t.schedule_tick, t.sequence_key, t.sequence_blocks
FROM tasks t
LEFT JOIN LATERAL (SELECT c.id, c.owner, c.epoch, c.claimed_at, c.heartbeat_at FROM task_claims c WHERE c.id = t.id) k ON true;
