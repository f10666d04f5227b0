package shard

import (
	"fmt"
	"slices"
	"testing"
)

// BenchmarkAssign measures the pure assignment at 4,096 shards and 64
// members: cold (every shard free, the worst case), steady (everything
// already where it belongs, the common case) and memo (a reconcile that
// reuses the last target, assignMemo).
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
	// A manager's reconcile after one member acquired its share of a cold
	// start: the memo's check instead of Assign.
	half := slices.Clone(cold)
	for s, owner := range steady {
		if owner == members[0] {
			half[s] = owner
		}
	}
	b.Run("memo", func(b *testing.B) {
		var m assignMemo
		m.assign(members, cold)
		for b.Loop() {
			m.assign(members, half)
		}
	})
}
