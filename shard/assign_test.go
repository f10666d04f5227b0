package shard

import (
	"fmt"
	"slices"
	"testing"

	"pgregory.net/rapid"
)

// genCluster draws a shard count, a member set and an arbitrary current
// ownership (free, a member, or a runner that is no longer a member).
func genCluster(t *rapid.T) (members []string, current []string) {
	S := rapid.IntRange(1, 300).Draw(t, "shards")
	n := rapid.IntRange(1, 12).Draw(t, "members")
	seen := map[string]bool{}
	for len(members) < n {
		id := fmt.Sprintf("r-%d", rapid.IntRange(0, 1_000_000).Draw(t, "id"))
		if !seen[id] {
			seen[id] = true
			members = append(members, id)
		}
	}
	current = make([]string, S)
	for s := range current {
		switch rapid.IntRange(0, 3).Draw(t, "owner kind") {
		case 0:
			current[s] = ""
		case 1:
			current[s] = "gone"
		default:
			current[s] = members[rapid.IntRange(0, n-1).Draw(t, "owner")]
		}
	}
	return members, current
}

func counts(target []string) map[string]int {
	c := map[string]int{}
	for _, m := range target {
		c[m]++
	}
	return c
}

func checkBalanced(t *rapid.T, members, target []string) {
	S, n := len(target), len(members)
	c := counts(target)
	for _, m := range members {
		if c[m] < S/n || c[m] > (S+n-1)/n {
			t.Fatalf("member %s owns %d of %d shards with %d members", m, c[m], S, n)
		}
	}
	if c[""] != 0 {
		t.Fatalf("%d shards unassigned", c[""])
	}
}

func TestAssignBalanced(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		members, current := genCluster(t)
		checkBalanced(t, members, Assign(members, current))
	})
}

func TestAssignDeterministic(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		members, current := genCluster(t)
		want := Assign(members, current)
		shuffled := rapid.Permutation(append(slices.Clone(members), members[0])).Draw(t, "order")
		if got := Assign(shuffled, current); !slices.Equal(got, want) {
			t.Fatalf("member order or duplicates changed the map")
		}
	})
}

func TestAssignIsAFixedPoint(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		members, current := genCluster(t)
		target := Assign(members, current)
		if again := Assign(members, target); !slices.Equal(again, target) {
			t.Fatalf("a converged map is not stable: %d shards would move", Moved(target, again))
		}
	})
}

// A member releases exactly its excess over quota and nothing else.
func TestAssignKeepsOwnedShardsUpToQuota(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		members, current := genCluster(t)
		target := Assign(members, current)
		tc := counts(target)
		for _, m := range members {
			have, lost := 0, 0
			for s := range current {
				if current[s] == m {
					have++
					if target[s] != m {
						lost++
					}
				}
			}
			if want := max(0, have-tc[m]); lost != want {
				t.Fatalf("%s owned %d, quota %d, lost %d (want %d)", m, have, tc[m], lost, want)
			}
		}
	})
}

func TestAssignJoinMovesAtMostTheBound(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		members, current := genCluster(t)
		before := Assign(members, current)
		joiner := fmt.Sprintf("new-%d", rapid.IntRange(0, 1000).Draw(t, "joiner"))
		after := Assign(append(slices.Clone(members), joiner), before)
		S, n := len(before), len(members)
		if moved, bound := Moved(before, after), (S+n)/(n+1)+n; moved > bound {
			t.Fatalf("join of a %d-member, %d-shard cluster moved %d shards, bound %d", n, S, moved, bound)
		}
	})
}

func TestAssignLeaveMovesOnlyTheLeaversShardsPlusQuotaSlack(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		members, current := genCluster(t)
		if len(members) < 2 {
			return
		}
		before := Assign(members, current)
		i := rapid.IntRange(0, len(members)-1).Draw(t, "leaver")
		leaver := members[i]
		rest := slices.Delete(slices.Clone(members), i, i+1)
		after := Assign(rest, before)
		own := counts(before)[leaver]
		if moved, bound := Moved(before, after), own+len(rest); moved > bound {
			t.Fatalf("leave moved %d shards; the leaver had %d, bound %d", moved, own, bound)
		}
	})
}

// Carrying out any part of the plan (releasing excess, acquiring freed
// shards) leaves the plan unchanged, so runners converge without flapping.
func TestAssignStableUnderPartialProgress(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		members, current := genCluster(t)
		target := Assign(members, current)
		state := slices.Clone(current)
		steps := rapid.IntRange(1, 4).Draw(t, "steps")
		for step := 0; step <= steps; step++ {
			for s := range state {
				if state[s] == target[s] {
					continue
				}
				progress := rapid.IntRange(0, 2).Draw(t, "progress")
				if step == steps {
					progress = 1 + (step+s)%2 // finish: release, then acquire
				}
				switch progress {
				case 1: // released (or its dead owner's lease expired)
					state[s] = ""
				case 2: // acquired by its target once free
					if state[s] == "" {
						state[s] = target[s]
					}
				}
			}
			if again := Assign(members, state); !slices.Equal(again, target) {
				t.Fatalf("the plan changed after partial progress at step %d (%d shards differ)", step, Moved(again, target))
			}
		}
	})
}

func TestAssignEdges(t *testing.T) {
	if got := Assign(nil, make([]string, 4)); !slices.Equal(got, []string{"", "", "", ""}) {
		t.Fatalf("no members: %v", got)
	}
	got := Assign([]string{"a", "b", "c"}, make([]string, 2))
	if c := counts(got); c[""] != 0 || len(c) != 2 {
		t.Fatalf("fewer shards than members: %v", got)
	}
	if got := Assign([]string{"a", ""}, make([]string, 3)); !slices.Equal(got, []string{"a", "a", "a"}) {
		t.Fatalf("empty member id must be ignored: %v", got)
	}
}

// Moved counts the shards whose owner differs between two maps.
func Moved(a, b []string) int {
	n := 0
	for i := range a {
		if a[i] != b[i] {
			n++
		}
	}
	return n
}

// Any mix of the moves towards a target (acquisitions by the target owner,
// releases by an owner it moves away from) leaves the target as it is:
// what lets a manager reuse it (assignMemo).
func TestAssignReusesPartialMoves(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		members, current := genCluster(t)
		target := Assign(members, current)
		moved := slices.Clone(current)
		for s := range moved {
			switch rapid.IntRange(0, 2).Draw(t, "move") {
			case 1:
				moved[s] = target[s]
			case 2:
				if current[s] != target[s] {
					moved[s] = ""
				}
			}
		}
		if !reuses(current, target, moved) {
			t.Fatalf("reuses refused moves towards the target")
		}
		if again := Assign(members, moved); !slices.Equal(again, target) {
			t.Fatalf("after moves towards the target, %d shards would go elsewhere", Moved(target, again))
		}
	})
}
