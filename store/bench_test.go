package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/claims"
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
// statement for the batch, from 64 owned shards, reported as tasks/s; with
// the indexes of the task operations (state, kind and state, key) and, for
// comparison, without them: every state change updates every index.
func BenchmarkClaimComplete(b *testing.B) {
	for _, size := range []int{1, 10, 100} {
		for _, opsIndexes := range []bool{true, false} {
			b.Run(fmt.Sprintf("batch=%d/ops-indexes=%v", size, opsIndexes), func(b *testing.B) {
				benchClaimComplete(b, size, opsIndexes)
			})
		}
	}
}

func benchClaimComplete(b *testing.B, size int, opsIndexes bool) {
	s := setup(b)
	ctx := context.Background()
	if !opsIndexes {
		for _, idx := range []string{"tasks_state_id_idx", "tasks_kind_state_id_idx", "tasks_key_id_idx"} {
			if _, err := s.Pool().Exec(ctx, "DROP INDEX "+idx); err != nil {
				b.Fatal(err)
			}
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
	b.ResetTimer()
	start := time.Now()
	n := 0
	for b.Loop() {
		got, err := s.Claim(ctx, "r", owned, tasks.DefaultQueue, []string{"k"}, size, size)
		if err != nil {
			b.Fatal(err)
		}
		if len(got) == 0 {
			b.Fatal("ran out of tasks")
		}
		done := make([]claims.Completion, len(got))
		for i, t := range got {
			done[i] = claims.Completion{Ref: claims.RefOf(t)}
		}
		if _, err := s.Complete(ctx, "r", done); err != nil {
			b.Fatal(err)
		}
		n += len(got)
	}
	b.ReportMetric(float64(n)/time.Since(start).Seconds(), "tasks/s")
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
