package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

// run is one attempt of a task as its handler saw it: from the "sleep
// started" and "sleep ended" lines the sleep built-in logs by its own
// clock (or, for a handler whose process was killed, until the kill).
type run struct {
	key        string
	task       int64
	start, end time.Time
	runner     string
}

// TestSequencesHoldOrderThroughKillsAndPauses runs many sequences on three
// runners while one is killed with SIGKILL and another paused with
// SIGSTOP, and checks from the handlers' own start and end times that no
// two tasks of a sequence ever ran at once, and that they ran in the order
// they were enqueued; and that every task completed.
func TestSequencesHoldOrderThroughKillsAndPauses(t *testing.T) {
	c, coord, _ := base(t, 3)
	const sequences, each = 40, 8
	order := map[string][]int64{} // per sequence, its task ids in enqueue order
	var batch []map[string]any
	for i := range each {
		for s := range sequences {
			batch = append(batch, map[string]any{"kind": "sleep", "sequence_key": fmt.Sprintf("seq-%d", s), "max_attempts": 10,
				"key": fmt.Sprintf("seq-%d-%d", s, i), "payload": json.RawMessage(fmt.Sprintf(`{"ms": %d, "log": true}`, 20+rand.IntN(60)))})
		}
	}
	body, _ := json.Marshal(batch)
	if code, resp := testutil.HTTP(t, "POST", "http://"+coord.addr+"/api/tasks", apiToken, string(body)); code != 201 {
		t.Fatalf("enqueue: %d %s", code, resp)
	}
	rows, err := c.store.Pool().Query(context.Background(), `SELECT id, sequence_key FROM tasks WHERE kind = 'sleep' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var key string
		if err := rows.Scan(&id, &key); err != nil {
			t.Fatal(err)
		}
		order[key] = append(order[key], id)
		c.mu.Lock()
		c.enqueued[id] = tasks.Completed
		c.mu.Unlock()
	}
	rows.Close()

	r2, r3 := c.proc("runner-2"), c.proc("runner-3")
	c.waitFor(20*time.Second, "a third of the tasks done", func() bool {
		return c.counts()[tasks.Completed] >= sequences*each/3
	})
	r2.signal(t, syscall.SIGKILL)
	killed := time.Now()
	r3.signal(t, syscall.SIGSTOP)
	time.Sleep(1500 * time.Millisecond) // the pause itself: what is being tested
	r3.signal(t, syscall.SIGCONT)
	s := c.finish(90 * time.Second)

	runs := map[string][]run{}
	for _, name := range []string{"runner-1", "runner-2", "runner-3"} {
		p := c.proc(name)
		open := map[string]run{}
		for _, e := range p.logEvents("sleep ") {
			key := fmt.Sprint(e.kv["sequence_key"])
			id := int64(e.kv["task"].(float64))
			start, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(e.kv["start"]))
			attemptKey := fmt.Sprintf("%s/%d/%v/%s", key, id, e.kv["attempt"], start)
			switch e.msg {
			case "sleep started":
				open[attemptKey] = run{key: key, task: id, start: start, runner: name}
			case "sleep ended":
				end, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(e.kv["end"]))
				runs[key] = append(runs[key], run{key: key, task: id, start: start, end: end, runner: name})
				delete(open, attemptKey)
			}
		}
		// A handler that never logged its end ran until its process was
		// killed (no other process stops mid-handler here).
		for k, r := range open {
			if name != "runner-2" {
				t.Fatalf("%s: a handler started and never ended: %s", name, k)
			}
			r.end = killed
			runs[r.key] = append(runs[r.key], r)
		}
	}
	checked := 0
	for key, ids := range order {
		rs := runs[key]
		slices.SortFunc(rs, func(a, b run) int { return a.start.Compare(b.start) })
		pos := map[int64]int{}
		for i, id := range ids {
			pos[id] = i
		}
		for i := 1; i < len(rs); i++ {
			prev, cur := rs[i-1], rs[i]
			if cur.task == prev.task {
				continue // the same task again (a retry, or a run cut short by the kill)
			}
			if pos[cur.task] < pos[prev.task] {
				t.Errorf("sequence %s: task %d started (on %s) after task %d, enqueued after it", key, cur.task, cur.runner, prev.task)
			}
			for _, earlier := range rs[:i] {
				if earlier.task != cur.task && cur.start.Before(earlier.end) {
					t.Errorf("sequence %s: task %d started on %s at %s while task %d ran on %s until %s",
						key, cur.task, cur.runner, cur.start.Format(time.StampMicro), earlier.task, earlier.runner, earlier.end.Format(time.StampMicro))
				}
			}
			checked++
		}
	}
	if checked < sequences*(each-1) {
		t.Fatalf("only %d successive runs checked; the handlers' logs are missing runs", checked)
	}
	c.report("sequences through SIGKILL and SIGSTOP 1.5s", s, fmt.Sprintf("%d sequences of %d: no overlap, enqueue order kept (%d successive runs checked)", sequences, each, checked))
}
