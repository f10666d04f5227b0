package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
)

func TestMain(m *testing.M) {
	pgtest.Main(m, testutil.EtcdLeaks...)
}

// The example runs end to end against a real PostgreSQL and etcd.
func TestExampleEndToEnd(t *testing.T) {
	etcd, err := embedetcd.Start(context.Background(), embedetcd.Config{Dir: t.TempDir(), Fast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()
	var out bytes.Buffer
	if err := run(context.Background(), pgtest.NewDatabase(t), etcd.Endpoints(), 5, &out); err != nil {
		t.Fatal(err)
	}
	if got := strings.Count(out.String(), `"path": "thumbs/128/photo-`); got != 5 {
		t.Fatalf("want 5 thumbnails, got:\n%s", out.String())
	}
	t.Logf("example output:\n%s", out.String())
}
