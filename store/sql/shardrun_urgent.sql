-- A task is urgent when it is more urgent than the default priority (3):
-- its shard's notification is marked so that runners claim there first.
-- Go's tasks.Urgent is checked against this function (TestRulesAgree).
CREATE OR REPLACE FUNCTION shardrun_urgent(priority smallint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT priority < 3 $$;
