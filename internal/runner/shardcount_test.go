package runner

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/store"
)

// A runner configured with another shard count than the database's
// stops at start, naming the flag and the database's count, before it
// joins the cluster.
func TestRunnerRefusesAnotherShardCountThanTheDatabases(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	if _, err := e.store.EnsureShardCount(context.Background(), 2*testShards); err != nil {
		t.Fatal(err)
	}
	cfg := e.config("runner-odd")
	cfg.Logger = hclog.NewNullLogger()
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.HandleBuiltins(); err != nil {
		t.Fatal(err)
	}
	err = r.Run(context.Background())
	if !errors.Is(err, store.ErrShardCountMismatch) || !strings.Contains(err.Error(), "--shard-count") ||
		!strings.Contains(err.Error(), "32 shards") {
		t.Fatalf("runner with 16 shards on a 32-shard database: %v", err)
	}
	if resp, _ := e.admin.Get(context.Background(), "/shardrun/test/runners/runner-odd"); len(resp.Kvs) != 0 {
		t.Fatal("the refused runner registered in etcd")
	}
}
