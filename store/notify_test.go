package store_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
)

// The store's own inserts are quiet: the insert trigger does not notify
// them, the store's notifier does, once. A LISTENer sees each shard
// exactly once — for a single insert, one with a unique key, a COPY batch
// and a batch with unique keys — where the trigger's notification would
// make it twice. A shard that got a task more urgent than the default
// priority is marked '!', as the trigger marks it, so that its runner
// claims there first.
func TestStoreEnqueueSuppressesTheTriggersNotification(t *testing.T) {
	t.Parallel()
	s, dsn := pgtest.NewStore(t, store.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := listenConn(ctx, t, dsn)
	on := func(shard int, unique string) store.Insert {
		in := insert("k", shard, 3)
		in.Key, in.UniqueKey = "key-"+strconv.Itoa(shard)+unique, unique
		return in
	}
	if _, err := s.Enqueue(ctx, on(11, "")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Enqueue(ctx, on(12, "u12")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.EnqueueBatch(ctx, []store.Insert{on(13, ""), on(13, ""), on(14, "")}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.EnqueueBatch(ctx, []store.Insert{on(15, "u15"), on(16, "u16")}); err != nil {
		t.Fatal(err)
	}
	urgent := on(17, "")
	urgent.Priority = 1
	if _, err := s.EnqueueBatch(ctx, []store.Insert{urgent, on(18, "")}); err != nil {
		t.Fatal(err)
	}
	// Close sends what the notifier holds; a marker sent after it comes
	// after every notification of the inserts (they arrive in commit order).
	s.Close()
	marker, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = marker.Close(context.Background()) }()
	if _, err := marker.Exec(ctx, `SELECT pg_notify($1, 'marker')`, store.NotifyChannel); err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	var payloads []string
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			t.Fatalf("waiting for the marker after %v: %v", payloads, err)
		}
		if n.Payload == "marker" {
			break
		}
		payloads = append(payloads, n.Payload)
		for _, sh := range strings.Split(n.Payload, ",") {
			seen[sh]++
		}
	}
	if seen["!17"] != 1 || seen["17"] != 0 {
		t.Errorf("shard 17, which got a task of priority 1, notified %d times marked urgent and %d unmarked, want once marked (notifications %q)",
			seen["!17"], seen["17"], payloads)
	}
	for sh := 11; sh <= 18; sh++ {
		if sh == 17 {
			continue
		}
		if got := seen[strconv.Itoa(sh)]; got != 1 {
			t.Errorf("shard %d notified %d times, want once (notifications %q)", sh, got, payloads)
		}
	}
}
