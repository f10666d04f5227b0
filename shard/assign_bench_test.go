package shard

import (
	"fmt"
	"testing"
)

// BenchmarkAssign measures the pure assignment at 4,096 shards and 64
// members: cold (every shard free, the worst case) and steady (everything
// already where it belongs, the common case).
func BenchmarkAssign(b *testing.B) {
	members := make([]string, 64)
	for i := range members {
		members[i] = fmt.Sprintf("runner-%02d", i)
	}
	cold := make([]string, 4096)
	steady := Assign(members, cold)
	b.Run("cold", func(b *testing.B) {
		for b.Loop() {
			Assign(members, cold)
		}
	})
	b.Run("steady", func(b *testing.B) {
		for b.Loop() {
			Assign(members, steady)
		}
	})
}
