-- The one encoder of the enqueue notification, sent on channel
-- shardrun_tasks when tasks become claimable: the sorted shards, comma
-- separated, each marked '!' when it got an urgent task; '*' (every
-- shard) when shards is NULL or the list is longer than a notification
-- may be. store/listen.go decodes it. NOTIFY is transactional: runners
-- hear it when the transaction commits.
CREATE OR REPLACE FUNCTION shardrun_notify(shards integer[], urgent boolean[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    payload text;
BEGIN
    IF shards IS NULL THEN
        payload := '*';
    ELSE
        SELECT string_agg(CASE WHEN u THEN '!' ELSE '' END || s::text, ',' ORDER BY s) INTO payload
        FROM (SELECT s, bool_or(coalesce(u, false)) AS u
              FROM unnest(shards, urgent) AS x(s, u) WHERE s IS NOT NULL GROUP BY s) y;
        IF payload IS NULL THEN
            RETURN;
        END IF;
        IF length(payload) > 7000 THEN
            payload := '*';
        END IF;
    END IF;
    PERFORM pg_notify('shardrun_tasks', payload);
END
$$;
