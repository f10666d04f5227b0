-- The wait after failed attempt number attempt (within the task's current
-- budget): min(cap, base * 2^(attempt-1)), scaled by a random factor in
-- [0.5, 1) ("equal jitter"). The one backoff formula: the runners' failures
-- and the leader's stale sweep both use it.
CREATE OR REPLACE FUNCTION shardrun_backoff(attempt integer, base_ms bigint, cap_ms bigint)
RETURNS interval LANGUAGE sql VOLATILE AS $$
    SELECT (least(cap_ms::double precision,
                  base_ms::double precision * power(2, greatest(attempt, 1) - 1))
            * (0.5 + random() * 0.5)) * interval '1 millisecond'
$$;
