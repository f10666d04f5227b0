package pgtest

// Clusters of several databases (issue 40): each database is a test
// database of NewDatabase's, so its layout is checked when the test ends
// as every test database's is.

import (
	"context"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/store"
)

// NewStores opens a store on a fresh database (NewDatabase) for each of
// names, with the schema migrated, each closed when t ends, and returns
// them by name with their URLs.
func NewStores(t testing.TB, opts store.Options, names ...string) (map[string]*store.Store, map[string]string) {
	t.Helper()
	stores := make(map[string]*store.Store, len(names))
	dsns := make(map[string]string, len(names))
	for _, name := range names {
		stores[name], dsns[name] = NewStore(t, opts)
	}
	return stores, dsns
}

// NewCluster is NewStores made a cluster of the databases of m (in its
// order) with len(m.Shards) shards placed as m places them: each database
// records the shard count and its place (store.Register), and the router
// over them, closed when t ends, routes by m. store.NewMap spreads shards
// over databases in ranges.
func NewCluster(t testing.TB, opts store.Options, m store.Map) (*store.Router, map[string]*store.Store) {
	t.Helper()
	ctx := context.Background()
	stores, _ := NewStores(t, opts, m.Databases...)
	for _, st := range stores {
		if _, err := st.EnsureShardCount(ctx, len(m.Shards)); err != nil {
			t.Fatal(err)
		}
	}
	r, err := store.NewRouter(stores, m, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	if err := r.Register(ctx); err != nil {
		t.Fatal(err)
	}
	return r, stores
}
