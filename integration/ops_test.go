package integration

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

// Operators cancel and retry through the coordinator's API while real
// runner processes run the tasks: running ten-minute sleeps end cancelled
// (that the first heartbeat after the request ends a handler is checked
// in internal/executor), a dead task retried completes, and every task
// ends as the operator's actions say.
func TestCancelAndRetryThroughTheAPI(t *testing.T) {
	c, coord, names := base(t, 2)
	api := "http://" + coord.addr + "/api/tasks"
	c.enqueue(coord, 20, "sleep", `{"ms": 600000}`, 5, tasks.Cancelled)
	c.enqueue(coord, 3, "fail", `{"times": 1}`, 1, tasks.Completed) // dead first, then retried
	c.waitFor(10*time.Second, "the sleeps running", func() bool {
		var running float64
		for _, n := range names {
			running += c.metric(c.proc(n), "shardrun_tasks_in_flight")
		}
		return running == 20
	})
	if code := httpCode(t, "GET", api+"?kind=sleep", ""); code != 401 {
		t.Fatalf("listing without the token: %d", code)
	}
	code, body := testutil.HTTP(t, "POST", api+"/cancel?kind=sleep", apiToken, "")
	var res tasks.BulkResult
	if code != 200 || json.Unmarshal([]byte(body), &res) != nil || res.CancelRequested != 20 || !res.Done {
		t.Fatalf("bulk cancel: %d %s", code, body)
	}
	took := c.waitFor(10*time.Second, "the sleeps cancelled", func() bool { return c.counts()[tasks.Cancelled] == 20 })
	t.Logf("20 running sleeps cancelled %s after the request (heartbeat interval 1s)", took)

	c.waitFor(10*time.Second, "the failing tasks dead", func() bool { return c.counts()[tasks.Dead] == 3 })
	code, body = testutil.HTTP(t, "POST", api+"/retry?state=dead&kind=fail", apiToken, "")
	if code != 200 || json.Unmarshal([]byte(body), &res) != nil || res.Retried != 3 {
		t.Fatalf("bulk retry: %d %s", code, body)
	}
	var page tasks.Page
	c.waitFor(10*time.Second, "the retried tasks completed", func() bool {
		code, body = testutil.HTTP(t, "GET", api+"?kind=fail&state=completed", apiToken, "")
		return code == 200 && json.Unmarshal([]byte(body), &page) == nil && len(page.Tasks) == 3
	})
	for _, task := range page.Tasks {
		if task.Attempt != 2 || task.LastError == "" {
			t.Errorf("retried task %+v: want attempt 2 with the first failure kept", task)
		}
	}
	s := c.finish(30 * time.Second)
	c.report("cancel and retry through the API", s, fmt.Sprintf("20 running sleeps cancelled %s after one bulk request", took.Round(time.Millisecond)))
}
