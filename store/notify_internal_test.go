package store

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5/pgconn"
)

// While one notification is on the wire, the shards that arrive go in the
// next one, together: one pg_notify per round trip however many producers.
func TestNotifierCoalescesWhileSending(t *testing.T) {
	sent := make(chan string)
	release := make(chan struct{})
	exec := func(_ context.Context, _ string, args ...any) (pgconn.CommandTag, error) {
		sent <- args[1].(string)
		<-release
		return pgconn.CommandTag{}, nil
	}
	n := newNotifier(exec, hclog.NewNullLogger())
	n.gap = 0
	n.add(4)
	if got := <-sent; got != "4" {
		t.Fatalf("first notification %q, want 4", got)
	}
	n.add(9, 2)
	n.add(2)
	release <- struct{}{}
	if got := <-sent; got != "2,9" {
		t.Fatalf("second notification %q, want the shards added meanwhile, once each: 2,9", got)
	}
	release <- struct{}{}
	n.close()
	n.add(1) // after close: nothing is sent (exec would block on sent)
}

func TestNotifyPayloadFallsBackToAll(t *testing.T) {
	var many []int
	for s := range 3000 {
		many = append(many, s)
	}
	if got := notifyPayload(many); got != "*" {
		t.Fatalf("payload of 3000 shards: %d bytes, want *", len(got))
	}
	if got := notifyPayload([]int{10, 3}); got != "3,10" {
		t.Fatalf("payload %q", got)
	}
	if p := notifyPayload(many[:1000]); len(p) > maxNotifyPayload || len(strings.Split(p, ",")) != 1000 || !strings.HasSuffix(p, strconv.Itoa(999)) {
		t.Fatalf("payload of 1000 shards: %d bytes", len(p))
	}
}
