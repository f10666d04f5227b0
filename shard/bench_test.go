package shard

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/embedetcd"
)

// BenchmarkCluster64 runs 64 members in this process against one embedded
// etcd (lease TTL 2s) and reports: the time to converge from a cold start,
// the time to re-converge after one member dies without leaving (its lease
// must expire), and the etcd messages per second each member causes at
// steady state, measured by the server. Run with -benchtime=1x.
func BenchmarkCluster64(b *testing.B) {
	for _, shards := range []int{256, 4096} {
		b.Run(fmt.Sprintf("shards=%d", shards), func(b *testing.B) {
			for b.Loop() {
				benchCluster(b, shards, 64)
			}
		})
	}
}

func benchCluster(b *testing.B, shards, members int) {
	c := newCluster(b, shards)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range members {
		wg.Go(func() { c.add(fmt.Sprintf("m%02d", i), false) })
	}
	wg.Wait()
	c.waitConverged(5 * time.Minute)
	cold := time.Since(start)

	const window = 10 * time.Second
	before, err := embedetcd.MessagesReceived()
	if err != nil {
		b.Fatal(err)
	}
	time.Sleep(window) // measuring a steady rate over a fixed window, not waiting for a condition
	after, _ := embedetcd.MessagesReceived()
	perMember := (after - before) / window.Seconds() / float64(members)
	if ok, why := c.converged(); !ok {
		b.Fatalf("not steady during the measurement: %s", why)
	}

	victim := c.live()[0]
	killed := time.Now()
	victim.crashStop()
	c.waitConverged(time.Minute)
	reconverge := time.Since(killed)
	c.checkNoDoubleOwnership()

	b.ReportMetric(cold.Seconds(), "cold_converge_s")
	b.ReportMetric(reconverge.Seconds(), "kill_reconverge_s")
	b.ReportMetric(perMember, "etcd_msgs/s/member")
	b.Logf("%d shards, %d members: cold converge %s, re-converge after kill -9 %s (TTL %s), %.2f etcd msgs/s per member at steady state",
		shards, members, cold.Round(time.Millisecond), reconverge.Round(time.Millisecond), c.ttl, perMember)
}
