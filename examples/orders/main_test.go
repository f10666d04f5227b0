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

// The example runs end to end against a real PostgreSQL and etcd: the
// declined order leaves no row and no task, the retried ones one task each.
func TestExampleEndToEnd(t *testing.T) {
	etcd, err := embedetcd.Start(context.Background(), embedetcd.Config{Dir: t.TempDir(), Fast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()
	var out bytes.Buffer
	if err := run(context.Background(), pgtest.NewDatabase(t), etcd.Endpoints(), &out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{
		"order-2: payment declined, rolled back: no order, no task",
		"duplicate true", "2 orders, 2 receipt tasks",
		`"sent": "receipt for order-1 (1999 cents)"`, `"sent": "receipt for order-3 (4500 cents)"`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
	t.Logf("example output:\n%s", got)
}
