package store

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5/pgconn"
)

// While one notification is on the wire, the shards that arrive go in the
// next one, together: one pg_notify per round trip however many producers.
func TestNotifierCoalescesWhileSending(t *testing.T) {
	sent := make(chan string)
	release := make(chan struct{})
	exec := func(_ context.Context, _ string, args ...any) (pgconn.CommandTag, error) {
		sent <- payloadOf(args)
		<-release
		return pgconn.CommandTag{}, nil
	}
	n := newNotifier(exec, hclog.NewNullLogger())
	n.gap = 0
	n.add(false, 4)
	if got := <-sent; got != "4" {
		t.Fatalf("first notification %q, want 4", got)
	}
	n.add(false, 9, 2)
	n.add(true, 2)
	n.add(false, 2)
	release <- struct{}{}
	if got := <-sent; got != "!2,9" {
		t.Fatalf("second notification %q, want the shards added meanwhile, once each, 2 marked urgent: !2,9", got)
	}
	release <- struct{}{}
	n.close()
}

// What is pending when the store closes is sent before close returns: a
// producer that enqueues and closes must not leave its tasks waiting for
// the runners' next poll. After close nothing more is sent.
func TestNotifierSendsPendingOnClose(t *testing.T) {
	sent := make(chan string, 10)
	release := make(chan struct{})
	exec := func(_ context.Context, _ string, args ...any) (pgconn.CommandTag, error) {
		sent <- payloadOf(args)
		<-release
		return pgconn.CommandTag{}, nil
	}
	n := newNotifier(exec, hclog.NewNullLogger())
	n.add(false, 4)
	if got := <-sent; got != "4" {
		t.Fatalf("first notification %q, want 4", got)
	}
	n.add(false, 7) // pending while the first is on the wire
	closed := make(chan struct{})
	go func() { n.close(); close(closed) }()
	release <- struct{}{}
	select {
	case got := <-sent:
		if got != "7" {
			t.Fatalf("notification at close %q, want the pending 7", got)
		}
	case <-closed:
		t.Fatal("close returned without sending the pending notification")
	}
	release <- struct{}{}
	<-closed
	close(release)
	n.add(false, 1)
	n.close() // waits for a sender the add might have started
	select {
	case got := <-sent:
		t.Fatalf("notification %q sent after close", got)
	default:
	}
}

// Close waits for the pending notifications at most closeTimeout: a
// database that does not answer cannot hold up a shutdown.
func TestNotifierCloseIsBounded(t *testing.T) {
	cancelled := make(chan error, 1)
	exec := func(ctx context.Context, _ string, _ ...any) (pgconn.CommandTag, error) {
		<-ctx.Done()
		cancelled <- ctx.Err()
		return pgconn.CommandTag{}, ctx.Err()
	}
	n := newNotifier(exec, hclog.NewNullLogger())
	n.closeTimeout = 20 * time.Millisecond
	n.add(false, 3)
	n.close()
	select {
	case err := <-cancelled:
		if err == nil {
			t.Fatal("the notification's context ended without an error")
		}
	default:
		t.Fatal("close returned without sending the pending notification, or before ending it")
	}
}

// payloadOf shows the arguments the notifier passes to shardrun_notify as
// the notification it sends: "!2,9" is shards 2 (urgent) and 9.
func payloadOf(args []any) string {
	ids, urgent := args[0].([]int32), args[1].([]bool)
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = strconv.Itoa(int(id))
		if urgent[i] {
			parts[i] = "!" + parts[i]
		}
	}
	return strings.Join(parts, ",")
}
