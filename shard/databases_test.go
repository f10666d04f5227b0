package shard

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
)

// A new cluster gets its map in the shard count's transaction: the
// shards over the databases in contiguous ranges, in the order given,
// at the revision of the write; a process that comes later reads it
// whatever order it gives its databases, and one with another count is
// refused by the flag.
func TestEnsureClusterWritesTheMapWithTheCluster(t *testing.T) {
	_, cli := testutil.Etcd(t)
	ctx := context.Background()
	const prefix = "/shardrun/dbs/"
	m, created, err := EnsureCluster(ctx, cli, prefix, 8, []string{"main", "second"})
	if err != nil || !created {
		t.Fatalf("creating the cluster: %v, created %v", err, created)
	}
	if m.Ranges("main") != "0-3" || m.Ranges("second") != "4-7" || m.Rev == 0 {
		t.Fatalf("the new map: main %q, second %q, revision %d", m.Ranges("main"), m.Ranges("second"), m.Rev)
	}
	meta, err := cli.Get(ctx, prefix+"meta/shard-count")
	if err != nil || len(meta.Kvs) != 1 || meta.Kvs[0].ModRevision != m.Rev {
		t.Fatalf("meta/shard-count is not written with the map: %v %v", meta, err)
	}
	again, created, err := EnsureCluster(ctx, cli, prefix, 8, []string{"second", "main"})
	if err != nil || created || again.Rev != m.Rev || strings.Join(again.Databases, ",") != "main,second" {
		t.Fatalf("the cluster read again: %+v created %v %v", again, created, err)
	}
	read, err := ReadDatabases(ctx, cli, prefix, 8)
	if err != nil || read.Rev != m.Rev || read.Ranges("second") != "4-7" {
		t.Fatalf("ReadDatabases: %+v %v", read, err)
	}
	if _, _, err := EnsureCluster(ctx, cli, prefix, 16, []string{"main", "second"}); !errors.Is(err, ErrShardCountMismatch) ||
		!strings.HasPrefix(err.Error(), "--shard-count") {
		t.Fatalf("another shard count: %v", err)
	}
}

// A cluster created before the map existed has an implicit one: every
// shard in main, revision 0.
func TestAClusterWithoutAMapHasMain(t *testing.T) {
	_, cli := testutil.Etcd(t)
	ctx := context.Background()
	const prefix = "/shardrun/old/"
	if _, err := EnsureShardCount(ctx, cli, prefix, 4); err != nil {
		t.Fatal(err)
	}
	m, created, err := EnsureCluster(ctx, cli, prefix, 4, []string{"main", "second"})
	if err != nil || created || m.Rev != 0 || strings.Join(m.Databases, ",") != "main" || m.Ranges("main") != "0-3" {
		t.Fatalf("an old cluster's map: %+v created %v %v", m, created, err)
	}
	if err := CheckDatabases(m, []string{"main", "second"}); err == nil || !strings.Contains(err.Error(), "database second is not one of the cluster's") {
		t.Fatalf("a database the map does not name: %v", err)
	}
}

// A process given a database the map does not name, or missing one it
// names, is told in one line naming it; the order given does not matter.
func TestCheckDatabasesNamesTheDatabase(t *testing.T) {
	m := store.NewMap([]string{"main", "second"}, 8)
	if err := CheckDatabases(m, []string{"second", "main"}); err != nil {
		t.Fatalf("the map's databases in another order: %v", err)
	}
	for given, want := range map[string]string{
		"main":              "names the database second, which this process is not given",
		"main,second,third": "the database third is not one of the cluster's",
	} {
		err := CheckDatabases(m, strings.Split(given, ","))
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") || !strings.HasPrefix(err.Error(), "--database") {
			t.Errorf("given %s: %v, want one line with %q", given, err, want)
		}
	}
}

// A move's change of the map is written only over the revision it read
// (and the move driver's own compares), and every process watching the
// map gets it, in order.
func TestPutDatabasesIsConditionedAndWatched(t *testing.T) {
	_, cli := testutil.Etcd(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const prefix = "/shardrun/move/"
	m, _, err := EnsureCluster(ctx, cli, prefix, 4, []string{"main", "second"})
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan store.Map, 4)
	w := &MapWatch{Client: cli, Prefix: prefix, ShardCount: 4, Rev: m.Rev, OnChange: func(m store.Map) { got <- m }}
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	defer func() { cancel(); <-done }()

	next := m
	next.Moves = []store.Move{{Shard: 1, From: "main", To: "second", Phase: "leaving"}}
	rev, ok, err := PutDatabases(ctx, cli, prefix, next)
	if err != nil || !ok || rev <= m.Rev {
		t.Fatalf("writing the move's intent: rev %d ok %v %v", rev, ok, err)
	}
	if _, ok, err := PutDatabases(ctx, cli, prefix, next); err != nil || ok {
		t.Fatalf("a second write over the same revision: ok %v %v, want refused", ok, err)
	}
	select {
	case seen := <-got:
		if seen.Rev != rev || len(seen.Moves) != 1 || seen.Moves[0] != next.Moves[0] {
			t.Fatalf("the watch delivered %+v, want the move at revision %d", seen, rev)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the watch did not deliver the new map")
	}
	if _, _, err := PutDatabases(ctx, cli, prefix, store.Map{Rev: rev, Databases: []string{"main"}, Shards: []string{"main", "x", "main", "main"}}); err == nil {
		t.Fatal("a map placing a shard in a database it does not list was written")
	}
}
