package client_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestClient(t *testing.T) {
	ctx := context.Background()
	st, _ := pgtest.NewStore(t, store.Options{})
	c, err := client.New(st, client.Config{ShardCount: 16})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, tasks.NewTask{}); !errors.Is(err, tasks.ErrInvalid) {
		t.Fatalf("an invalid task: %v", err)
	}
	first, err := c.Enqueue(ctx, tasks.NewTask{Kind: "mail", Options: tasks.Options{Key: "user-42", UniqueKey: "welcome/user-42"}})
	if err != nil || first.Duplicate {
		t.Fatal(first, err)
	}
	again, err := c.Enqueue(ctx, tasks.NewTask{Kind: "mail", Options: tasks.Options{Key: "user-42", UniqueKey: "welcome/user-42"}})
	if err != nil || !again.Duplicate || again.ID != first.ID {
		t.Fatalf("the same unique key: %+v %v", again, err)
	}
	batch, err := c.EnqueueBatch(ctx, []tasks.NewTask{{Kind: "mail", Options: tasks.Options{UniqueKey: "welcome/user-42"}}, {Kind: "mail"}})
	if err != nil || batch.Inserted != 1 || batch.Duplicates != 1 || batch.Tasks[0].ID != first.ID {
		t.Fatalf("batch: %+v %v", batch, err)
	}
	if _, err := c.EnqueueBatch(ctx, []tasks.NewTask{{Kind: "a"}, {}}); err == nil {
		t.Fatal("a batch with an invalid task was accepted")
	}

	// A rolled-back transaction leaves no task.
	rollback := errors.New("roll back")
	err = pgx.BeginFunc(ctx, st.Pool(), func(tx pgx.Tx) error {
		if _, err := c.EnqueueTx(ctx, tx, tasks.NewTask{Kind: "mail", Options: tasks.Options{Key: "tx"}}); err != nil {
			return err
		}
		return rollback
	})
	if !errors.Is(err, rollback) {
		t.Fatal(err)
	}
	if page, err := c.List(ctx, tasks.ListRequest{Filter: tasks.Filter{Key: "tx"}}); err != nil || len(page.Tasks) != 0 {
		t.Fatalf("a rolled-back enqueue left %+v %v", page, err)
	}

	if _, err := c.Get(ctx, 12345); !errors.Is(err, tasks.ErrNotFound) {
		t.Fatalf("get of a missing task: %v", err)
	}
	if got, err := c.Cancel(ctx, first.ID); err != nil || got.State != tasks.Cancelled {
		t.Fatalf("cancel: %+v %v", got, err)
	}
	var ce *tasks.ConflictError
	if _, err := c.Cancel(ctx, first.ID); !errors.As(err, &ce) || ce.State != tasks.Cancelled || ce.Op != "cancel" {
		t.Fatalf("cancel of a cancelled task: %v", err)
	}
	if got, err := c.Retry(ctx, first.ID); err != nil || got.State != tasks.Ready {
		t.Fatalf("retry: %+v %v", got, err)
	}
	if _, err := c.Retry(ctx, first.ID); !errors.As(err, &ce) || ce.State != tasks.Ready {
		t.Fatalf("retry of a ready task: %v", err)
	}
	res, err := c.CancelMatching(ctx, tasks.Filter{Kind: "mail"})
	if err != nil || !res.Done || res.Cancelled != 2 {
		t.Fatalf("cancel by kind: %+v %v", res, err)
	}
	res, err = c.RetryMatching(ctx, tasks.Filter{Kind: "mail", States: []tasks.State{tasks.Cancelled}})
	if err != nil || !res.Done || res.Retried != 2 {
		t.Fatalf("retry by kind: %+v %v", res, err)
	}
	if _, err := c.List(ctx, tasks.ListRequest{Limit: tasks.MaxListLimit + 1}); err == nil {
		t.Fatal("a page over the limit was accepted")
	}
}

// Filters are checked like the fields of a task, before the database sees
// them: text PostgreSQL refuses, a shard outside the cluster, the zero
// time (which would silently mean "no bound").
func TestFiltersAreChecked(t *testing.T) {
	ctx := context.Background()
	st, _ := pgtest.NewStore(t, store.Options{})
	c, err := client.New(st, client.Config{ShardCount: 16})
	if err != nil {
		t.Fatal(err)
	}
	sixteen, minus := 16, -1
	for _, tc := range []struct {
		f     tasks.Filter
		field string
	}{
		{tasks.Filter{Kind: "a\x00b"}, "kind"},
		{tasks.Filter{Kind: "\xff"}, "kind"},
		{tasks.Filter{Key: "k\x00"}, "key"},
		{tasks.Filter{Key: "\xc3"}, "key"},
		{tasks.Filter{Shard: &sixteen}, "shard"},
		{tasks.Filter{Shard: &minus}, "shard"},
		{tasks.Filter{States: []tasks.State{"paused"}}, "state"},
	} {
		_, err := c.List(ctx, tasks.ListRequest{Filter: tc.f})
		var fe *tasks.FieldError
		if !errors.As(err, &fe) || fe.Field != tc.field {
			t.Errorf("List with %+v: %v, want an invalid %s", tc.f, err, tc.field)
		}
		_, err = c.CancelMatching(ctx, tc.f)
		if !errors.As(err, &fe) || fe.Field != tc.field {
			t.Errorf("CancelMatching with %+v: %v, want an invalid %s", tc.f, err, tc.field)
		}
		_, err = c.RetryMatching(ctx, tc.f)
		if !errors.As(err, &fe) || fe.Field != tc.field {
			t.Errorf("RetryMatching with %+v: %v, want an invalid %s", tc.f, err, tc.field)
		}
	}
}

func TestPrepareFillsDefaults(t *testing.T) {
	cfg := client.Config{ShardCount: 256, MaxAttempts: 7}.WithDefaults()
	now := time.Now()
	in, err := cfg.Prepare(tasks.NewTask{Kind: "k", Options: tasks.Options{Key: "user-42"}}, now)
	if err != nil {
		t.Fatal(err)
	}
	if in.Shard != 203 || string(in.Payload) != "{}" || in.MaxAttempts != 7 || !in.RunAfter.IsZero() || !in.Deadline.IsZero() {
		t.Fatalf("defaults: %+v", in)
	}
	a, _ := cfg.Prepare(tasks.NewTask{Kind: "k"}, now)
	b, _ := cfg.Prepare(tasks.NewTask{Kind: "k"}, now)
	if a.Key == "" || a.Key == b.Key {
		t.Fatalf("empty keys must become distinct random keys: %q %q", a.Key, b.Key)
	}
	if err := (client.Config{ShardCount: 8, MaxAttempts: tasks.MaxAttemptsLimit + 1}).Validate(); err == nil {
		t.Error("a default max_attempts beyond the limit was accepted")
	}
	if err := (client.Config{}).WithDefaults().Validate(); err == nil || !strings.Contains(err.Error(), "shard_count") {
		t.Errorf("a client without a shard count: %v", err)
	}
}
