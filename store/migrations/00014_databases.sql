-- Several databases (issue 40, docs/architecture.md "Several databases"):
-- each database knows which shards it holds, and at which revision of the
-- shard → database map, so that a write for a shard it does not hold is
-- refused there, whoever sends it.
--
--   shardrun_placement  one row per shard the database holds or held:
--                       held      producers insert, runners claim
--                       leaving   a move copies it out: no insert, no claim
--                       arriving  a move's copy landed, not committed: inert
--                       gone      moved away to peer: every write refused
--   shardrun_cluster    the database's own name in the map (db_name), its
--                       slot (its index in the map: the residue of its
--                       task ids) and the cluster's database count
--   shard_fences        moving: the shard is being moved; no claim takes
--                       from a fence row that says so
--
-- Additive and defaulted: a catalog change only, no rewrite. A database
-- of a cluster created before this is its only database, "main", and
-- holds every shard of the count it recorded. A database without a
-- recorded count gets its placement rows where the count becomes known
-- (store.EnsureShardCount, store.Register).

-- +goose Up
CREATE TABLE shardrun_placement (
    shard   integer PRIMARY KEY CHECK (shard >= 0),
    state   text NOT NULL CHECK (state IN ('held', 'leaving', 'arriving', 'gone')),
    map_rev bigint NOT NULL DEFAULT 0,
    peer    text,
    changed_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE shardrun_cluster
    ADD COLUMN db_name text NOT NULL DEFAULT 'main',
    ADD COLUMN databases integer NOT NULL DEFAULT 1 CHECK (databases >= 1),
    ADD COLUMN slot integer NOT NULL DEFAULT 0 CHECK (slot >= 0),
    ADD COLUMN registered_at timestamptz;

ALTER TABLE shard_fences ADD COLUMN moving boolean NOT NULL DEFAULT false;

INSERT INTO shardrun_placement (shard, state)
SELECT s, 'held' FROM shardrun_cluster c CROSS JOIN LATERAL generate_series(0, c.shard_count - 1) AS s
ON CONFLICT (shard) DO NOTHING;

-- +goose Down
DROP TRIGGER IF EXISTS tasks_placement ON tasks;
ALTER TABLE shard_fences DROP COLUMN moving;
ALTER TABLE shardrun_cluster DROP COLUMN db_name, DROP COLUMN databases, DROP COLUMN slot, DROP COLUMN registered_at;
DROP TABLE shardrun_placement;
