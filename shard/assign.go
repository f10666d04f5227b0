package shard

import (
	"container/heap"
	"slices"
)

// Assign computes the owner every shard should have, from the attached
// members and the shards' current owners. It is a pure function: every
// member that sees the same members and owners computes the same map.
//
// current[s] is shard s's current owner ("" when free; an id that is not a
// member, such as a detached or dead runner, counts as "must move").
// The result has one member id per shard, or all "" when there are no
// members.
//
// The rules, for n members and S shards:
//
//  1. Quotas: q = S mod n members (the first q by a hash of their id) get
//     ⌈S/n⌉ shards, the others ⌊S/n⌋.
//  2. Keep: each member keeps up to its quota of the shards it owns now,
//     preferring those it ranks highest (rendezvous score).
//  3. Pool: every other shard. Members below quota take pool shards by a
//     greedy over all (shard, member) pairs in descending score order.
//
// Why this shape, rather than assigning from the membership alone:
//
//   - Balance is exact: the pool has exactly as many shards as the members
//     are short of their quotas.
//   - Movement is near-minimal and bounded: when member x joins a balanced
//     cluster, the shards that move are the excess the old members release,
//     which is x's quota plus at most one per old member whose quota rose
//     (⌈S/(n+1)⌉ can exceed ⌊S/n⌋ by one), so at most ⌈S/(n+1)⌉+n. When a
//     member leaves, its shards move plus at most one per remaining member.
//     Membership-only schemes (rendezvous filled greedily under a cap) move
//     up to ~20% more than that bound in simulation.
//   - Progress is stable: a member releases only its own excess (decided by
//     its own shards and the membership), and the pool greedy gives the same
//     answer after any of its assignments have been carried out, so the map
//     does not change while runners converge to it. Ownership views that lag
//     can disagree on who takes a free shard, but an acquisition applies
//     only if no owner key of the group changed since the revision up to
//     which its view is complete, so at most one wins and the map
//     converges.
func Assign(members []string, current []string) []string {
	target := make([]string, len(current))
	ms := slices.Clone(members)
	slices.Sort(ms)
	ms = slices.Compact(ms)
	if i := slices.Index(ms, ""); i >= 0 {
		ms = slices.Delete(ms, i, i+1)
	}
	n, S := len(ms), len(current)
	if n == 0 || S == 0 {
		return target
	}

	hashes := make([]uint64, n)
	index := make(map[string]int, n)
	for i, m := range ms {
		hashes[i] = memberHash(m)
		index[m] = i
	}
	quota := quotas(hashes, S)

	// Keep: each member's current shards, best-ranked first, up to quota.
	owned := make([][]int, n)
	for s, owner := range current {
		if i, ok := index[owner]; ok {
			owned[i] = append(owned[i], s)
		}
	}
	assigned := make([]int, S) // member index + 1; 0 = in the pool
	deficit := make([]int, n)
	for i, shards := range owned {
		if len(shards) > quota[i] {
			h := hashes[i]
			slices.SortFunc(shards, func(a, b int) int { return cmpScore(score(h, a), score(h, b), a, b) })
			shards = shards[:quota[i]]
		}
		for _, s := range shards {
			assigned[s] = i + 1
		}
		deficit[i] = quota[i] - len(shards)
	}

	fillPool(assigned, deficit, hashes)
	for s, a := range assigned {
		if a > 0 {
			target[s] = ms[a-1]
		}
	}
	return target
}

// fillPool gives the pool's shards (assigned 0) to the members short of
// their quota (deficit), by the greedy over (shard, member) pairs in
// descending score, computed lazily. Each pool shard sits in a max-heap
// under its best member that still had room when it was scored; a member
// only loses room, so a popped pair whose member is still short is the
// best pair left, and one whose member filled up is re-scored and pushed
// back.
func fillPool(assigned, deficit []int, hashes []uint64) {
	var short []int
	for i := range deficit {
		if deficit[i] > 0 {
			short = append(short, i)
		}
	}
	if len(short) == 0 {
		return
	}
	h := make(candidates, 0, len(assigned))
	for s := range assigned {
		if assigned[s] == 0 {
			if c, ok := best(s, short, deficit, hashes); ok {
				h = append(h, c)
			}
		}
	}
	heap.Init(&h)
	for h.Len() > 0 {
		c := h[0]
		if deficit[c.member] > 0 {
			heap.Pop(&h)
			assigned[c.shard] = c.member + 1
			deficit[c.member]--
			continue
		}
		if next, ok := best(c.shard, short, deficit, hashes); ok {
			h[0] = next
			heap.Fix(&h, 0)
		} else {
			heap.Pop(&h)
		}
	}
}

// candidate is a pool shard with the member it would go to.
type candidate struct {
	score  uint64
	shard  int
	member int
}

// candidates is a max-heap by score, ties to the lower shard.
type candidates []candidate

func (h candidates) Len() int { return len(h) }
func (h candidates) Less(i, j int) bool {
	return cmpScore(h[i].score, h[j].score, h[i].shard, h[j].shard) < 0
}
func (h candidates) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *candidates) Push(x any)   { *h = append(*h, x.(candidate)) }
func (h *candidates) Pop() any {
	old := *h
	c := old[len(old)-1]
	*h = old[:len(old)-1]
	return c
}

// best returns the highest-scoring member for shard among those still short
// (ties to the lower member index).
func best(shard int, short, deficit []int, hashes []uint64) (candidate, bool) {
	c, found := candidate{shard: shard}, false
	for _, i := range short {
		if deficit[i] == 0 {
			continue
		}
		if sc := score(hashes[i], shard); !found || sc > c.score {
			c.score, c.member, found = sc, i, true
		}
	}
	return c, found
}

// cmpScore orders by descending score, then ascending shard.
func cmpScore(sa, sb uint64, a, b int) int {
	switch {
	case sa > sb:
		return -1
	case sa < sb:
		return 1
	}
	return a - b
}

// quotas gives ⌈S/n⌉ to the S mod n members with the lowest id hash and
// ⌊S/n⌋ to the rest (indexed like hashes, ties by index). The choice depends
// on the membership only, so that a runner's quota — and so what it
// releases — never depends on how far the others have got.
func quotas(hashes []uint64, S int) []int {
	n := len(hashes)
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		switch {
		case hashes[a] < hashes[b]:
			return -1
		case hashes[a] > hashes[b]:
			return 1
		}
		return a - b
	})
	quota := make([]int, n)
	for rank, i := range order {
		quota[i] = S / n
		if rank < S%n {
			quota[i]++
		}
	}
	return quota
}

// memberHash is FNV-1a 64 of the member id.
func memberHash(id string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(id); i++ {
		h ^= uint64(id[i])
		h *= 1099511628211
	}
	return h
}

// score is the rendezvous weight of a shard for a member: a splitmix64
// finalisation of the member hash combined with the shard number.
func score(memberHash uint64, shard int) uint64 {
	z := memberHash ^ (uint64(shard)+1)*0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// assignMemo remembers one Assign: its members, the owners it was computed
// from, and its target. A manager reconciles after every batch of watch
// events, and while a fleet converges nearly every event is an owner key
// moving shards towards the target its members all computed; Assign is a
// fixed point of such moves (reuses), so the target is reused instead of
// computed again. Sixteen runners starting at once over 4,096 shards spent
// a quarter of their CPU on Assign during the acquisitions, in processes
// that share the cores with etcd and PostgreSQL.
type assignMemo struct {
	members []string
	current []string
	target  []string
}

// assign is Assign(members, current), reusing the last result when the
// members are the same and every shard whose owner changed since moved
// towards that result (reuses).
func (a *assignMemo) assign(members, current []string) []string {
	if a.target != nil && slices.Equal(a.members, members) && reuses(a.current, a.target, current) {
		a.current = current
		return a.target
	}
	a.members, a.current, a.target = slices.Clone(members), current, Assign(members, current)
	return a.target
}

// reuses reports whether Assign(members, current) is target =
// Assign(members, from) without computing it: every shard whose owner
// differs between from and current went to its target owner, or was let
// go (to "") by an owner target moves it away from. A member over its
// quota only releases and one under it only acquires, so each member
// keeps the same shards, and the pool's greedy over (shard, member)
// pairs gives the same pairs after any of them were carried out
// (TestAssignReusesPartialMoves).
func reuses(from, target, current []string) bool {
	if len(from) != len(current) || len(target) != len(current) {
		return false
	}
	for s, owner := range current {
		if owner != from[s] && owner != target[s] && (owner != "" || from[s] == target[s]) {
			return false
		}
	}
	return true
}
