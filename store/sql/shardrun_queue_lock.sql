-- The second key of queue queue_name's removal lock, an advisory lock
-- (1936879217 ('srnq'), this key): producers and retries take it shared
-- (shardrun_register_queues), a removal exclusively (shardrun_remove_queue).
-- Queue names share 64 locks, by hash: a transaction that enqueues into
-- thousands of queues (a batch, a COPY) takes at most 64 of them, where one
-- lock per name could fill the server's lock table, which every session's
-- locks share. What it costs: a removal is refused while a transaction
-- enqueueing into any queue of the same 64th is open.
CREATE OR REPLACE FUNCTION shardrun_queue_lock(queue_name text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtext(queue_name) & 63
$$;
