package store

import (
	"slices"
	"testing"

	"github.com/shardrun/shardrun/tasks"
)

// TestMergePagesKeepsTheTaskAtTheHorizon: a database's full page ends at
// its cursor, and the merged page holds that task, in either order. The
// descending merge once put an id before itself and dropped it: the next
// page began after it, so a paged listing lost one task per horizon.
func TestMergePagesKeepsTheTaskAtTheHorizon(t *testing.T) {
	page := func(next int64, ids ...int64) tasks.Page {
		p := tasks.Page{Next: next}
		for _, id := range ids {
			p.Tasks = append(p.Tasks, tasks.Summary{ID: id})
		}
		return p
	}
	ids := func(p tasks.Page) []int64 {
		var out []int64
		for _, s := range p.Tasks {
			out = append(out, s.ID)
		}
		return out
	}
	for _, tc := range []struct {
		name    string
		desc    bool
		pages   []tasks.Page
		want    []int64
		wantNxt int64
	}{
		{"descending", true, []tasks.Page{page(80, 100, 90, 80), page(0)}, []int64{100, 90, 80}, 80},
		{"descending, the other short", true, []tasks.Page{page(0, 95), page(80, 100, 90, 80)}, []int64{100, 95, 90}, 90},
		{"ascending", false, []tasks.Page{page(80, 60, 70, 80), page(0)}, []int64{60, 70, 80}, 80},
		{"descending, both stopped early", true, []tasks.Page{page(85, 100), page(70, 90)}, []int64{100, 90}, 85},
	} {
		got := mergePages(tc.pages, 3, tc.desc)
		if !slices.Equal(ids(got), tc.want) || got.Next != tc.wantNxt {
			t.Errorf("%s: %v next %d, want %v next %d", tc.name, ids(got), got.Next, tc.want, tc.wantNxt)
		}
	}
}
