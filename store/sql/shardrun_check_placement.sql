-- The placement check of tasks (statement level, after insert): every
-- insert, by any producer (the store, a producer's own transaction, raw
-- SQL, COPY), into a database of a cluster of several databases must be
-- into shards the database holds. It locks the placement rows of the
-- shards inserted into FOR SHARE, held to the commit: a move's leave step
-- takes the row FOR UPDATE NOWAIT, so it never waits for a producer and no
-- producer commits into a shard once it is leaving. Under REPEATABLE READ
-- or SERIALIZABLE a row changed since the transaction's snapshot fails the
-- lock with a serialization failure (40001). A shard not held (leaving,
-- arriving, gone, or never this database's) raises SQLSTATE SR001; the
-- router re-reads the map and sends the task to the shard's database.
--
-- A move's copy into a shard arriving here (shardrun.move_copy on:
-- store.CopyShard, which locks the placement row itself) is let through.
--
-- The trigger (tasks_placement) exists only in a database registered with
-- more than one database in its cluster (store.Register creates it): a
-- cluster of one database runs no check, at no cost.
CREATE OR REPLACE FUNCTION shardrun_check_placement() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    bad_shard integer;
    bad_state text;
    bad_rev bigint;
    db text;
BEGIN
    IF current_setting('shardrun.move_copy', true) = 'on' THEN
        RETURN NULL;
    END IF;
    SELECT s.shard, coalesce(p.state, 'none'), coalesce(p.map_rev, 0) INTO bad_shard, bad_state, bad_rev
    FROM (SELECT DISTINCT shard FROM new_rows) s
    LEFT JOIN (
        SELECT l.shard, l.state, l.map_rev FROM shardrun_placement l
        WHERE l.shard = ANY (ARRAY(SELECT DISTINCT shard FROM new_rows))
        ORDER BY l.shard
        FOR SHARE
    ) p ON p.shard = s.shard
    WHERE p.state IS DISTINCT FROM 'held'
    ORDER BY s.shard
    LIMIT 1;
    IF bad_shard IS NOT NULL THEN
        SELECT c.db_name INTO db FROM shardrun_cluster c WHERE c.id = 1;
        RAISE EXCEPTION 'shard % is not held by database % (state %, map revision %)',
            bad_shard, coalesce(db, current_database()), bad_state, bad_rev
            USING ERRCODE = 'SR001',
                  HINT = 'the shard → database map changed: send the task to the database that holds its shard';
    END IF;
    RETURN NULL;
END
$$;
