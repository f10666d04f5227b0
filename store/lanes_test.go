package store_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/shardrun/shardrun/store"
)

// ReadyQueues finds exactly the (queue, shard) pairs of the held shards,
// served queues and handled kinds that have tasks, due or not, whatever
// else the lanes hold: other shards, other queues, other kinds.
func TestReadyQueuesFindsTheServedLanesWithTasks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := setup(t)
	put := func(shard int, queue, kind string, n int, runAfter string) {
		t.Helper()
		exec(t, s, `INSERT INTO tasks (kind, shard, key, queue, run_after)
			SELECT $1, $2, g::text, $3, now() + $5::interval FROM generate_series(1, $4) g`, kind, shard, queue, n, runAfter)
	}
	put(0, "a", "k", 3, "0s")       // held, served, handled
	put(0, "b", "k", 2, "0s")       // held, not served
	put(0, "c", "other", 2, "0s")   // held, served, kind not handled
	put(1, "c", "k", 1, "1h")       // held, served, not due: found (a claim decides)
	put(2, "a", "k", 5, "0s")       // not held
	put(3, "zz", "k", 1, "0s")      // held, not served, last queue of its shard
	put(3, "c", "other", 1, "0s")   // held, kind not handled
	put(4, "default", "k", 1, "0s") // held, served
	put(7, "a", "k", 1, "0s")       // beyond the last held shard
	served := []string{"a", "c", "default"}
	got, truncated, err := s.ReadyQueues(ctx, []int{4, 0, 1, 3, 5}, served, []string{"k"})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]int{"a": {0}, "c": {1}, "default": {4}}
	if !maps.EqualFunc(got, want, slices.Equal) || truncated != -1 {
		t.Fatalf("ReadyQueues = %v (truncated from %d), want %v (-1)", got, truncated, want)
	}
	if got, truncated, err := s.ReadyQueues(ctx, []int{2}, []string{"nothing"}, []string{"k"}); err != nil || len(got) != 0 || truncated != -1 {
		t.Fatalf("a queue with no task: %v %d %v", got, truncated, err)
	}
}

// The probe reads lanes, not tasks: one index descent per lane it visits.
// An idle database costs a page or two whatever the queues served; 100,000
// tasks in a lane of a served queue and 100,000 in one of a queue not served
// cost about what one task in each does, far from the hundreds of pages of
// the index they fill.
func TestReadyQueuesReadsLanesNotTasks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := setup(t)
	queues := make([]string, 2000)
	for i := range queues {
		queues[i] = fmt.Sprintf("q%04d", i)
	}
	shards := make([]int, 256)
	for i := range shards {
		shards[i] = i
	}
	pages := func() int64 {
		t.Helper()
		var plan []struct {
			Plan struct {
				Hit  int64 `json:"Shared Hit Blocks"`
				Read int64 `json:"Shared Read Blocks"`
			}
		}
		if err := s.Pool().QueryRow(ctx, `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) `+store.ReadyQueuesSQL,
			store.ReadyQueuesArgs(shards, queues, []string{"k"})...).Scan(&plan); err != nil {
			t.Fatal(err)
		}
		return plan[0].Plan.Hit + plan[0].Plan.Read
	}
	empty := pages()
	if empty > 2 {
		t.Errorf("the probe of an empty database read %d pages, want at most 2", empty)
	}
	exec(t, s, `INSERT INTO tasks (kind, shard, key, queue) VALUES ('k', 9, 'a', 'q1999'), ('k', 9, 'b', 'unserved')`)
	few := pages()
	exec(t, s, `INSERT INTO tasks (kind, shard, key, queue) SELECT 'k', 9, g::text, q
		FROM generate_series(1, 50000) g, (VALUES ('q1999'), ('unserved')) v(q)`)
	exec(t, s, `VACUUM ANALYZE task_ready`)
	var index int64
	if err := s.Pool().QueryRow(ctx, `SELECT pg_relation_size('task_ready_pkey') / 8192`).Scan(&index); err != nil {
		t.Fatal(err)
	}
	many := pages()
	t.Logf("pages: %d with no task, %d over one task in each of two lanes, %d over 50,000 in each; the index has %d", empty, few, many, index)
	if many > 20 || many*10 > index {
		t.Errorf("the probe read %d pages over 100,000 tasks in two lanes (%d over one task in each); the index has %d", many, few, index)
	}
	got, truncated, err := s.ReadyQueues(ctx, shards, queues, []string{"k"})
	if err != nil || truncated != -1 || !maps.EqualFunc(got, map[string][]int{"q1999": {9}}, slices.Equal) {
		t.Fatalf("ReadyQueues = %v (truncated from %d), %v; want q1999 in shard 9", got, truncated, err)
	}
}

// Past LaneProbeCap lanes the probe stops and says in which shard.
func TestReadyQueuesStopsAtItsCap(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := setup(t)
	exec(t, s, `INSERT INTO tasks (kind, shard, key, queue) SELECT 'k', g % 4, g::text, 'q' || (g / 4)
		FROM generate_series(0, $1::int * 4 / 3) g`, store.LaneProbeCap)
	queues := make([]string, store.LaneProbeCap/3+2)
	for i := range queues {
		queues[i] = fmt.Sprint("q", i)
	}
	got, truncated, err := s.ReadyQueues(ctx, []int{0, 1, 2, 3}, queues, []string{"k"})
	if err != nil {
		t.Fatal(err)
	}
	if truncated != 2 {
		t.Fatalf("truncated from %d, want 2 (3,334 lanes in each of shards 0 and 1, the cap reached in shard 2)", truncated)
	}
	n := 0
	for _, shards := range got {
		n += len(shards)
	}
	if n != store.LaneProbeCap {
		t.Fatalf("found %d lanes, want the cap, %d", n, store.LaneProbeCap)
	}
}
