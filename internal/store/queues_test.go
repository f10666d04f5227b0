package store_test

import (
	"context"
	"testing"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/store"
	"github.com/shardrun/shardrun/tasks"
)

func claimQueue(t *testing.T, s *store.Store, shard int, queue string) []tasks.Task {
	t.Helper()
	got, err := s.Claim(context.Background(), "a", []claims.ShardEpoch{{Shard: shard, Epoch: 1}}, queue, []string{"k"}, 10)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// A claim does not need its queue's row: a queue whose row is gone (deleted
// by hand) is not paused, and its tasks are claimed.
func TestClaimsDoNotNeedTheQueueRow(t *testing.T) {
	t.Parallel()
	s := setup(t)
	raise(t, s, "a", 6, 1)
	in := insert("k", 6, 1)
	in.Queue = "mail"
	id := enqueue(t, s, in)
	exec(t, s, `DELETE FROM queues WHERE name = 'mail'`)
	got := claimQueue(t, s, 6, "mail")
	if len(got) != 1 || got[0].ID != id {
		t.Fatalf("claimed %+v from a queue without its row, want task %d", got, id)
	}
	one(t)(s.Complete(context.Background(), "a", []claims.Completion{{Ref: claims.RefOf(got[0])}}))
}
