-- The deferred trigger that settles, at the commit of a producer's
-- transaction, the sequenced tasks it inserted (shardrun_file registered
-- them in the transaction's setting shardrun.settle). It fires once per
-- such task; the first firing settles them all, sorted by sequence, and
-- clears the setting, so the sequences are locked in key order and only
-- for the moment of the commit.
CREATE OR REPLACE FUNCTION shardrun_settle_at_commit() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    pending text;
BEGIN
    pending := nullif(current_setting('shardrun.settle', true), '');
    IF pending IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('shardrun.settle', '', true);
    PERFORM shardrun_settle(string_to_array(pending, ',')::bigint[]);
    RETURN NULL;
END
$$;
