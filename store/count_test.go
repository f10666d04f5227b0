package store_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// CountMatching agrees with a count of task_view for every kind of filter
// (states alone, a driving index alone, a driving index and the rest),
// and says "at least" when it stops at the cap.
func TestCountMatching(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	seedMix(t, s, 700)
	three := 3
	cutoff := time.Now().Add(-300 * time.Second)
	for _, tc := range []struct {
		name  string
		f     tasks.Filter
		where string
	}{
		{"everything", tasks.Filter{}, "true"},
		{"ready", tasks.Filter{States: []tasks.State{tasks.Ready}}, "state = 'ready'"},
		{"running", tasks.Filter{States: []tasks.State{tasks.Running}}, "state = 'running'"},
		{"dead", tasks.Filter{States: []tasks.State{tasks.Dead}}, "state = 'dead'"},
		{"ready, dead and dead again", tasks.Filter{States: []tasks.State{tasks.Ready, tasks.Dead, tasks.Dead}}, "state IN ('ready', 'dead')"},
		{"kind", tasks.Filter{Kind: "b"}, "kind = 'b'"},
		{"kind and state", tasks.Filter{Kind: "b", States: []tasks.State{tasks.Ready}}, "kind = 'b' AND state = 'ready'"},
		{"key, kind and state", tasks.Filter{Key: "k4", Kind: "a", States: []tasks.State{tasks.Completed}}, "key = 'k4' AND kind = 'a' AND state = 'completed'"},
		{"shard and state", tasks.Filter{Shard: &three, States: []tasks.State{tasks.Cancelled}}, "shard = 3 AND state = 'cancelled'"},
		{"queue and priority", tasks.Filter{Queue: "default", Priority: 3}, "queue = 'default' AND priority = 3"},
		{"created window", tasks.Filter{CreatedSince: cutoff.Add(-100 * time.Second), CreatedBefore: cutoff},
			"created_at >= '" + cutoff.Add(-100*time.Second).Format(time.RFC3339Nano) + "' AND created_at < '" + cutoff.Format(time.RFC3339Nano) + "'"},
		{"nothing matches", tasks.Filter{Kind: "zzz"}, "false"},
	} {
		var want int64
		if err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM task_view WHERE `+tc.where).Scan(&want); err != nil {
			t.Fatal(err)
		}
		got, err := s.CountMatching(ctx, tc.f)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got != (store.MatchCount{Count: want}) {
			t.Errorf("%s: got %+v, want exactly %d", tc.name, got, want)
		}
	}

	// Past the cap: at least the cap, whichever way the filter is counted.
	exec(t, s, `INSERT INTO tasks (kind, shard, key, state, finished_at)
		SELECT 'many', g % 8, 'm' || g, 'dead', now() FROM generate_series(1, $1) g`, store.MatchCountCap+5)
	for _, f := range []tasks.Filter{
		{States: []tasks.State{tasks.Dead}},
		{Kind: "many"},
		{Kind: "many", States: []tasks.State{tasks.Dead}},
		{Queue: "default"},
	} {
		got, err := s.CountMatching(ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		if got != (store.MatchCount{Count: store.MatchCountCap, AtLeast: true}) {
			t.Errorf("%+v: got %+v, want at least the cap %d", f, got, store.MatchCountCap)
		}
	}
}

// A count whose filter matches few of more candidates than it may examine
// stops there and says how many it examined: its cost is bounded whatever
// the table holds.
func TestCountMatchingStopsAtItsScan(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	// The oldest tasks of kind "x" are the dead ones: the newest
	// MatchCountScan candidates, examined first, hold only two of them.
	exec(t, s, `INSERT INTO tasks (kind, shard, key, state, finished_at)
		SELECT 'x', g % 8, 'k' || g, CASE WHEN g <= 3 THEN 'dead' ELSE 'completed' END, now()
		FROM generate_series(1, $1) g`, store.MatchCountScan+1)
	exec(t, s, `INSERT INTO tasks (kind, shard, key, state, finished_at) VALUES ('x', 1, 'late', 'dead', now())`)
	got, err := s.CountMatching(ctx, tasks.Filter{Kind: "x", States: []tasks.State{tasks.Dead}})
	if err != nil {
		t.Fatal(err)
	}
	// The newest candidate (dead) and the newest MatchCountScan-1 of the
	// first insert, of which task 3 is dead: 2 found.
	if want := (store.MatchCount{Count: 2, AtLeast: true, Examined: store.MatchCountScan}); got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	sql, args := store.CountQuery(tasks.Filter{Kind: "x", States: []tasks.State{tasks.Dead}})
	plan := planOf(t, s, sql, args, true)
	if !strings.Contains(plan, "tasks_kind_id_idx") || seqScan.MatchString(plan) || sortOfScan.MatchString(plan) {
		t.Errorf("the count must walk tasks_kind_id_idx without a scan or a sort of the table:\n%s", plan)
	}
}
