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

// The store's own inserts are notified once: by the trigger in their own
// transaction (the one holding the commit slot) or by the store's
// notifier after their commit, never both. A LISTENer sees each shard
// exactly once — for a single insert, one with a unique key, a COPY batch
// and a batch with unique keys. A shard that got a task more urgent than the default
// priority is marked '!', as the trigger marks it, so that its runner
// claims there first.
func TestStoreEnqueueNotifiesOnce(t *testing.T) {
	t.Parallel()
	s, dsn, ctx, conn := listeningStore(t)
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

// An idle store's inserts, one at a time, each notify in their own
// transaction, delivered at the commit: none waits for the notifier's
// statement after it (issue 41, the wake-up path), and the listener has
// the notification by the time the enqueue returns or right after.
func TestAnIdleStoresInsertsNotifyAtTheirCommit(t *testing.T) {
	t.Parallel()
	s, _, ctx, conn := listeningStore(t)
	for i, shard := range []int{3, 4} {
		in := insert("k", shard, 3)
		if i == 0 {
			if _, err := s.Enqueue(ctx, in); err != nil {
				t.Fatal(err)
			}
		} else if _, err := s.EnqueueBatch(ctx, []store.Insert{in, in}); err != nil {
			t.Fatal(err)
		}
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n.Payload != strconv.Itoa(shard) {
			t.Fatalf("notification %q, want %d", n.Payload, shard)
		}
	}
	if sent := store.NotifierSent(s); sent != 0 {
		t.Fatalf("the notifier sent %d notifications for inserts that notified at their commit", sent)
	}
}

// listeningStore is a store of t's own and a connection LISTENing for its
// notifications, with a context of 30 s for the test.
func listeningStore(t *testing.T) (*store.Store, string, context.Context, *pgx.Conn) {
	s, dsn := pgtest.NewStore(t, store.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return s, dsn, ctx, listenConn(ctx, t, dsn)
}
