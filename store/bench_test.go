package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// BenchmarkEnqueueCopy measures bulk enqueue through COPY, 1,000 rows per
// batch, reported as rows/s.
func BenchmarkEnqueueCopy(b *testing.B) {
	s := setup(b)
	ctx := context.Background()
	batch := make([]store.Insert, 1000)
	for i := range batch {
		batch[i] = insert("k", i%256, 3)
	}
	b.ResetTimer()
	start := time.Now()
	for b.Loop() {
		if _, err := s.EnqueueBatch(ctx, batch); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*len(batch))/time.Since(start).Seconds(), "rows/s")
}

// BenchmarkEnqueueUnique measures bulk enqueue of tasks with unique keys
// (INSERT … SELECT FROM unnest … ON CONFLICT, ids drawn ahead), 1,000 rows
// per batch, every key new, reported as rows/s: compare with
// BenchmarkEnqueueCopy.
func BenchmarkEnqueueUnique(b *testing.B) {
	s := setup(b)
	ctx := context.Background()
	batch := make([]store.Insert, 1000)
	b.ResetTimer()
	start := time.Now()
	round := 0
	for b.Loop() {
		for i := range batch {
			batch[i] = insert("k", i%256, 3)
			batch[i].UniqueKey = fmt.Sprintf("u-%d-%d", round, i)
		}
		round++
		if _, err := s.EnqueueBatch(ctx, batch); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*len(batch))/time.Since(start).Seconds(), "rows/s")
}

// BenchmarkClaimComplete measures one claim of a batch plus one completion
// statement for the batch, from 64 owned shards, reported as tasks/s, with
// the layout's indexes and, to weigh them (issue 41 asks what fewer
// indexes on the hot path would save), without those a noop task's path
// writes beyond the primary keys: tasks' kind and key indexes (listing by
// kind, by key; written at insert) and task_finished's (state,
// finished_at) index (retention; written at completion). It reports the
// share of completions that updated the task's record in place (HOT),
// which writes no index entry.
func BenchmarkClaimComplete(b *testing.B) {
	for _, size := range []int{1, 100, 500} {
		for _, drop := range []struct {
			name    string
			indexes []string
		}{
			{"layout", nil},
			{"without-kind-key", []string{"tasks_kind_id_idx", "tasks_key_id_idx"}},
			{"without-finished-at", []string{"task_finished_at_idx"}},
		} {
			b.Run(fmt.Sprintf("batch=%d/indexes=%s", size, drop.name), func(b *testing.B) {
				benchClaimComplete(b, size, drop.indexes)
			})
		}
	}
}

func benchClaimComplete(b *testing.B, size int, drop []string) {
	s := setup(b)
	ctx := context.Background()
	for _, idx := range drop {
		if _, err := s.Pool().Exec(ctx, "DROP INDEX "+idx); err != nil {
			b.Fatalf("dropping index %s: %v", idx, err)
		}
	}
	owned := make([]claims.ShardEpoch, 64)
	for i := range owned {
		owned[i] = claims.ShardEpoch{Shard: i, Epoch: 1}
	}
	if _, _, _, err := raiseFences(s, ctx, "r", "", owned); err != nil {
		b.Fatal(err)
	}
	// Enough ready work for the loop, plus a backlog the claim
	// index has to skip past.
	ins := make([]store.Insert, 20000+size*2000)
	for i := range ins {
		ins[i] = insert("k", i%64, 3)
	}
	if _, err := s.EnqueueBatch(ctx, ins); err != nil {
		b.Fatal(err)
	}
	if _, err := s.Pool().Exec(ctx, "VACUUM ANALYZE tasks"); err != nil {
		b.Fatal(err)
	}
	upd0, hot0 := tasksUpdates(b, s)
	b.ResetTimer()
	start := time.Now()
	n := 0
	var claiming, completing time.Duration
	for b.Loop() {
		began := time.Now()
		got, err := s.Claim(ctx, "r", owned, tasks.DefaultQueue, []string{"k"}, size, size)
		if err != nil {
			b.Fatal(err)
		}
		if len(got) == 0 {
			b.Fatal("ran out of tasks")
		}
		claimed := time.Now()
		claiming += claimed.Sub(began)
		done := make([]claims.Completion, len(got))
		for i, t := range got {
			done[i] = claims.Completion{Ref: claims.RefOf(t)}
		}
		if _, err := s.Complete(ctx, "r", done); err != nil {
			b.Fatal(err)
		}
		completing += time.Since(claimed)
		n += len(got)
	}
	b.ReportMetric(float64(n)/time.Since(start).Seconds(), "tasks/s")
	b.ReportMetric(float64(claiming.Microseconds())/float64(n), "claim-µs/task")
	b.ReportMetric(float64(completing.Microseconds())/float64(n), "complete-µs/task")
	b.StopTimer()
	// The counters reach pg_stat_user_tables when each backend flushes
	// them (within seconds of its last transaction): wait for every
	// completion's update to be counted.
	var upd, hot int64
	testutil.Until(b, 30*time.Second, "counting the completions' updates of tasks", func() (bool, string) {
		upd, hot = tasksUpdates(b, s)
		return upd-upd0 >= int64(n), fmt.Sprintf("%d of %d counted", upd-upd0, n)
	})
	b.ReportMetric(float64(hot-hot0)/float64(upd-upd0), "hot-share")
}

// tasksUpdates reads the updates of tasks counted so far, all and HOT.
func tasksUpdates(b *testing.B, s *store.Store) (upd, hot int64) {
	b.Helper()
	if err := s.Pool().QueryRow(context.Background(), `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'tasks'::regclass`).Scan(&upd, &hot); err != nil {
		b.Fatalf("reading the updates of tasks: %v", err)
	}
	return upd, hot
}

// BenchmarkClaimOverManyShards is one claim by a runner that holds every
// shard of a 4,096-shard cluster, with a second capability group's fences
// beside its own (a mixed fleet): the claim must find its fences by the
// shards it takes from, whatever it holds.
func BenchmarkClaimOverManyShards(b *testing.B) {
	s := setup(b)
	ctx := context.Background()
	const shards = 4096
	owned := make([]claims.ShardEpoch, shards)
	other := make([]claims.ShardEpoch, shards)
	for i := range owned {
		owned[i], other[i] = claims.ShardEpoch{Shard: i, Epoch: 10}, claims.ShardEpoch{Shard: i, Epoch: 11}
	}
	if _, _, _, err := raiseFences(s, ctx, "r", "ga", owned); err != nil {
		b.Fatal(err)
	}
	if _, _, _, err := raiseFences(s, ctx, "q", "gb", other); err != nil {
		b.Fatal(err)
	}
	ins := make([]store.Insert, 50_000)
	for i := range ins {
		ins[i] = insert("k", i%shards, 3)
	}
	if _, err := s.EnqueueBatch(ctx, ins); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	n := 0
	for b.Loop() {
		got, err := s.Claim(ctx, "r", owned, tasks.DefaultQueue, []string{"k"}, 10, 10)
		if err != nil || len(got) == 0 {
			b.Fatal(len(got), err)
		}
		n += len(got)
	}
	b.ReportMetric(float64(n)/float64(b.N), "tasks/claim")
}

// BenchmarkCompleteBatch is one completion statement for a batch of 5,000
// claimed tasks, the largest the executor's writer sends.
func BenchmarkCompleteBatch(b *testing.B) {
	s := setup(b)
	ctx := context.Background()
	owned := make([]claims.ShardEpoch, 64)
	for i := range owned {
		owned[i] = claims.ShardEpoch{Shard: i, Epoch: 1}
	}
	if _, _, _, err := raiseFences(s, ctx, "r", "", owned); err != nil {
		b.Fatal(err)
	}
	const batch = 5000
	var spent time.Duration
	for b.Loop() {
		ins := make([]store.Insert, batch)
		for i := range ins {
			ins[i] = insert("k", i%64, 3)
		}
		if _, err := s.EnqueueBatch(ctx, ins); err != nil {
			b.Fatal(err)
		}
		var done []claims.Completion
		for len(done) < batch {
			got, err := s.Claim(ctx, "r", owned, tasks.DefaultQueue, []string{"k"}, 1000, 1000)
			if err != nil || len(got) == 0 {
				b.Fatal(len(got), err)
			}
			for _, t := range got {
				done = append(done, claims.Completion{Ref: claims.RefOf(t)})
			}
		}
		began := time.Now()
		res, err := s.Complete(ctx, "r", done)
		spent += time.Since(began)
		if err != nil || res[0].Outcome != claims.Applied {
			b.Fatal(err)
		}
	}
	// The loop's time includes the enqueue and the claims of each batch:
	// the figure is the completion's alone.
	b.ReportMetric(float64(spent.Milliseconds())/float64(b.N), "complete-ms/op")
}
