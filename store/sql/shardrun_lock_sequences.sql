-- Locks the sequences of keys, in key order, creating those that have no
-- row yet (a sequence has a row while it has a head or waiting tasks). The
-- one way every statement locks sequences: keys sorted, each row locked for
-- update, so that no two transactions wait on each other's sequences.
CREATE OR REPLACE FUNCTION shardrun_lock_sequences(keys text[]) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO task_sequences AS s (key)
    SELECT DISTINCT k FROM unnest(keys) k WHERE k IS NOT NULL ORDER BY k
    ON CONFLICT (key) DO UPDATE SET since = s.since
$$;
