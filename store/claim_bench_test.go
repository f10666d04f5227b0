package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// BenchmarkClaimPastUnclaimable measures claims of 512 plus their
// completion by a runner owning a third of 256 shards and handling three
// kinds, with and without 300,000 older ready tasks of a kind nobody
// handles (issue 14: they used to be scanned by every claim). Reported as
// tasks/s and the claim statement's mean time.
func BenchmarkClaimPastUnclaimable(b *testing.B) {
	for _, unhandled := range []int{0, 300_000} {
		b.Run(fmt.Sprintf("unhandled=%d", unhandled), func(b *testing.B) {
			s := setup(b)
			ctx := context.Background()
			var owned []claims.ShardEpoch
			for sh := 0; sh < 256; sh += 3 {
				owned = append(owned, claims.ShardEpoch{Shard: sh, Epoch: 1})
			}
			if _, _, _, err := raiseFences(s, ctx, "r", "", owned); err != nil {
				b.Fatal(err)
			}
			if unhandled > 0 {
				exec(b, s, `INSERT INTO tasks (kind, shard, key, run_after)
					SELECT 'nobody', g % 256, g::text, now() - interval '1 hour' FROM generate_series(1, $1) g`, unhandled)
			}
			exec(b, s, `INSERT INTO tasks (kind, shard, key)
				SELECT 'noop', g % 256, g::text FROM generate_series(1, 600000) g`)
			exec(b, s, "VACUUM ANALYZE tasks")
			kinds := []string{"noop", "sleep", "fail"}
			b.ResetTimer()
			start := time.Now()
			var claimTime time.Duration
			n, rounds := 0, 0
			for b.Loop() {
				t0 := time.Now()
				got, err := s.Claim(ctx, "r", owned, tasks.DefaultQueue, kinds, 512, 512)
				claimTime += time.Since(t0)
				rounds++
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
			b.ReportMetric(float64(claimTime.Microseconds())/1000/float64(rounds), "ms/claim")
		})
	}
}
