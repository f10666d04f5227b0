package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func decode[T any](t *testing.T, body string) T {
	t.Helper()
	var v T
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("decoding %s: %v", body, err)
	}
	return v
}

func TestTaskOperationsAPI(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.start("coord", nil, func(c *Config) {
		c.APIToken = "tok"
		// The running task below has no runner beating for it: the sweeper
		// must not requeue it as stale (after the environment's 1s) before
		// the test has looked at it, however slow a loaded machine is.
		c.Sweep.StaleThreshold = time.Hour
	})
	base := "http://" + c.Addr()
	ctx := context.Background()

	// Idempotent enqueue: the header, then the same key in the body.
	code, body := testutil.HTTP(t, "POST", base+"/api/tasks", "tok", `{"kind": "mail", "key": "user-1"}`, "Idempotency-Key", "welcome/user-1")
	if code != 201 {
		t.Fatalf("enqueue: %d %s", code, body)
	}
	first := decode[struct{ ID int64 }](t, body)
	code, body = testutil.HTTP(t, "POST", base+"/api/tasks", "tok", `{"kind": "mail", "key": "user-1", "unique_key": "welcome/user-1"}`)
	dup := decode[struct {
		ID        int64
		Duplicate bool
	}](t, body)
	if code != 200 || !dup.Duplicate || dup.ID != first.ID {
		t.Fatalf("a second enqueue of the key: %d %s", code, body)
	}
	if code, body := testutil.HTTP(t, "POST", base+"/api/tasks", "tok", `{"kind": "mail", "unique_key": "a"}`, "Idempotency-Key", "b"); code != 400 || !strings.Contains(body, "differ") {
		t.Errorf("header and body keys that differ: %d %s", code, body)
	}
	if code, body := testutil.HTTP(t, "POST", base+"/api/tasks", "tok", `[{"kind": "mail"}]`, "Idempotency-Key", "b"); code != 400 {
		t.Errorf("the header on a batch: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "POST", base+"/api/tasks", "tok", `[{"kind": "mail", "unique_key": "welcome/user-1"}, {"kind": "mail", "unique_key": "welcome/user-2"}, {"kind": "other"}]`)
	batch := decode[tasks.BatchEnqueued](t, body)
	if code != 201 || batch.Inserted != 2 || batch.Duplicates != 1 || len(batch.Tasks) != 3 || batch.Tasks[0].ID != first.ID || !batch.Tasks[0].Duplicate {
		t.Fatalf("batch with unique keys: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "POST", base+"/api/tasks", "tok", `[{"kind": "mail", "unique_key": "welcome/user-1"}]`)
	if code != 200 || !strings.Contains(body, `"enqueued":0`) {
		t.Fatalf("a batch of duplicates only: %d %s", code, body)
	}

	// A running task, claimed as a runner would.
	other := batch.Tasks[2].ID
	otherTask, err := e.store.Get(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.RaiseFences(ctx, "r", "", []claims.ShardEpoch{{Shard: otherTask.Shard, Epoch: 3}}); err != nil {
		t.Fatal(err)
	}
	if got, err := e.store.Claim(ctx, "r", []claims.ShardEpoch{{Shard: otherTask.Shard, Epoch: 3}}, tasks.DefaultQueue, []string{"other"}, 1, 1); err != nil || len(got) != 1 {
		t.Fatalf("claim: %v %v", got, err)
	}

	// Listing, filtered and paged.
	code, body = testutil.HTTP(t, "GET", base+"/api/tasks?kind=mail&limit=1", "tok", "")
	page := decode[tasks.Page](t, body)
	if code != 200 || len(page.Tasks) != 1 || page.Tasks[0].ID != first.ID || page.Next != first.ID {
		t.Fatalf("first page: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "GET", fmt.Sprintf("%s/api/tasks?kind=mail&limit=1&after=%d", base, page.Next), "tok", "")
	page = decode[tasks.Page](t, body)
	if code != 200 || len(page.Tasks) != 1 || page.Tasks[0].UniqueKey != "welcome/user-2" {
		t.Fatalf("second page: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "GET", base+"/api/tasks?state=running&order=desc", "tok", "")
	page = decode[tasks.Page](t, body)
	if code != 200 || len(page.Tasks) != 1 || page.Tasks[0].ID != other || page.Next != 0 || strings.Contains(body, "payload") {
		t.Fatalf("running tasks: %d %s", code, body)
	}
	for _, q := range []string{"state=paused", "shard=-1", "limit=0", "limit=1001", "order=sideways", "created_before=yesterday", "after=x", "colour=red", "kind=a&kind=b"} {
		if code, body := testutil.HTTP(t, "GET", base+"/api/tasks?"+q, "tok", ""); code != 400 {
			t.Errorf("GET /api/tasks?%s: %d %s, want 400", q, code, body)
		}
	}

	// Counts, as a confirmation shows them before a bulk operation.
	for _, tc := range []struct {
		query string
		want  int64
	}{
		{"", 3}, {"kind=mail", 2}, {"state=running", 1}, {"state=ready,running", 3}, {"kind=mail&state=running", 0},
		{"created_since=2000-01-01T00:00:00Z&created_before=2100-01-01T00:00:00Z", 3},
		{"created_since=2100-01-01T00:00:00Z", 0},
	} {
		code, body := testutil.HTTP(t, "GET", base+"/api/tasks/count?"+tc.query, "tok", "")
		if got := decode[store.MatchCount](t, body); code != 200 || got != (store.MatchCount{Count: tc.want}) || strings.Contains(body, "at_least") {
			t.Errorf("GET /api/tasks/count?%s: %d %s, want exactly %d", tc.query, code, body, tc.want)
		}
	}
	for _, q := range []string{"after=1", "limit=5", "order=desc", "state=paused", "created_since=yesterday",
		"created_since=2026-01-02T00:00:00Z&created_before=2026-01-01T00:00:00Z"} {
		if code, body := testutil.HTTP(t, "GET", base+"/api/tasks/count?"+q, "tok", ""); code != 400 || !strings.Contains(body, `"field"`) {
			t.Errorf("GET /api/tasks/count?%s: %d %s, want 400 naming the parameter", q, code, body)
		}
	}

	// Cancel: ready at once, running by request, finished refused.
	code, body = testutil.HTTP(t, "POST", fmt.Sprintf("%s/api/tasks/%d/cancel", base, first.ID), "tok", "")
	if code != 200 || decode[tasks.Task](t, body).State != tasks.Cancelled {
		t.Fatalf("cancel of a ready task: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "POST", fmt.Sprintf("%s/api/tasks/%d/cancel", base, other), "tok", "")
	if got := decode[tasks.Task](t, body); code != 202 || got.State != tasks.Running || got.CancelRequestedAt == nil {
		t.Fatalf("cancel of a running task: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "POST", fmt.Sprintf("%s/api/tasks/%d/cancel", base, first.ID), "tok", "")
	if code != 409 || decode[apiError](t, body).State != tasks.Cancelled {
		t.Fatalf("cancel of a cancelled task: %d %s", code, body)
	}
	if code, body := testutil.HTTP(t, "POST", base+"/api/tasks/424242/cancel", "tok", ""); code != 404 {
		t.Fatalf("cancel of a missing task: %d %s", code, body)
	}

	// Retry.
	code, body = testutil.HTTP(t, "POST", fmt.Sprintf("%s/api/tasks/%d/retry", base, first.ID), "tok", "")
	if got := decode[tasks.Task](t, body); code != 200 || got.State != tasks.Ready || got.Attempt != 2 {
		t.Fatalf("retry of a cancelled task: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "POST", fmt.Sprintf("%s/api/tasks/%d/retry", base, first.ID), "tok", "")
	if code != 409 || decode[apiError](t, body).State != tasks.Ready {
		t.Fatalf("retry of a ready task: %d %s", code, body)
	}

	// By filter.
	if code, body := testutil.HTTP(t, "POST", base+"/api/tasks/cancel", "tok", ""); code != 400 {
		t.Fatalf("bulk cancel without a filter: %d %s", code, body)
	}
	if code, body := testutil.HTTP(t, "POST", base+"/api/tasks/cancel?state=dead", "tok", ""); code != 400 {
		t.Fatalf("bulk cancel of dead tasks: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "POST", base+"/api/tasks/cancel?kind=mail", "tok", "")
	if res := decode[tasks.BulkResult](t, body); code != 200 || !res.Done || res.Cancelled != 2 {
		t.Fatalf("bulk cancel: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "POST", base+"/api/tasks/retry?kind=mail&state=cancelled", "tok", "")
	if res := decode[tasks.BulkResult](t, body); code != 200 || !res.Done || res.Retried != 2 {
		t.Fatalf("bulk retry: %d %s", code, body)
	}

	// Without the token: nothing that reads task data or changes anything.
	for _, ep := range []struct{ method, path string }{
		{"POST", "/api/tasks"}, {"GET", "/api/tasks"}, {"GET", fmt.Sprintf("/api/tasks/%d", first.ID)},
		{"POST", fmt.Sprintf("/api/tasks/%d/cancel", first.ID)}, {"POST", fmt.Sprintf("/api/tasks/%d/retry", first.ID)},
		{"POST", "/api/tasks/cancel?kind=mail"}, {"POST", "/api/tasks/retry?kind=mail"}, {"GET", "/api/tasks/count?kind=mail"},
	} {
		for _, token := range []string{"", "wrong"} {
			if code, body := testutil.HTTP(t, ep.method, base+ep.path, token, `{"kind": "mail"}`); code != 401 {
				t.Errorf("%s %s with token %q: %d %s, want 401", ep.method, ep.path, token, code, body)
			}
		}
	}
	// The open endpoints carry no task data; the status page's lists of
	// tasks that need attention (refreshed within a second) ids and kinds.
	testutil.Until(t, 5*time.Second, "the running task listed for attention", func() (bool, string) {
		code, body = testutil.HTTP(t, "GET", base+"/api/cluster", "", "")
		if code != 200 {
			return false, body
		}
		v := decode[ClusterView](t, body)
		r := v.Attention.LongRunning
		return len(r) == 1 && r[0].ID == other && r[0].ClaimedBy == "r" && r[0].Kind == "other", fmt.Sprintf("%+v", v.Attention)
	})
	if strings.Contains(body, "payload") || strings.Contains(body, "user-1") || !strings.Contains(body, `"cancelled":`) {
		t.Fatalf("/api/cluster: %s", body)
	}
}

// Without a token (a loopback-only coordinator) the reads are open.
func TestTaskReadsOpenWithoutAToken(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.start("coord", nil)
	base := "http://" + c.Addr()
	code, body := testutil.HTTP(t, "POST", base+"/api/tasks", "", `{"kind": "mail"}`)
	if code != 201 {
		t.Fatalf("enqueue: %d %s", code, body)
	}
	id := decode[struct{ ID int64 }](t, body).ID
	if code, body := testutil.HTTP(t, "GET", fmt.Sprintf("%s/api/tasks/%d", base, id), "", ""); code != 200 {
		t.Fatalf("get: %d %s", code, body)
	}
	if code, body := testutil.HTTP(t, "GET", base+"/api/tasks", "", ""); code != 200 || !strings.Contains(body, fmt.Sprintf(`"id":%d`, id)) {
		t.Fatalf("list: %d %s", code, body)
	}
}

// Query parameters are checked with the rules of body fields, and the
// error names the parameter: nothing PostgreSQL would refuse reaches it,
// and a shard outside the cluster is refused like a negative one.
func TestQueryParametersAreCheckedLikeBodies(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c, err := New(Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	h := c.Handler()
	for _, tc := range []struct{ query, field string }{
		{"kind=a%00b", "kind"},
		{"kind=%FF", "kind"},
		{"kind=", "kind"},
		{"key=%00", "key"},
		{"key=%C3", "key"},
		{"key=", "key"},
		{"shard=16", "shard"},
		{"shard=1000000000", "shard"},
		{"shard=-1", "shard"},
		{"state=", "state"},
		{"state=ready,", "state"},
		{"state=,ready", "state"},
		// The filter's zero priority means "any": a priority that parses
		// to it must not widen the filter (issue 34: priority=0 cancelled
		// every priority of a queue).
		{"priority=0", "priority"},
		{"priority=00", "priority"},
		{"priority=%2B0", "priority"},
		{"priority=-0", "priority"},
		{"priority=6", "priority"},
		{"priority=", "priority"},
		{"queue=", "queue"},
		{"queue=%00", "queue"},
		{"sequence_key=", "sequence_key"},
		{"sequence_key=%FF", "sequence_key"},
		{"created_before=0001-01-01T00:00:00Z", "created_before"},
		{"created_before=", "created_before"},
		{"created_since=0001-01-01T00:00:00Z", "created_since"},
		{"created_since=", "created_since"},
		{"created_since=10000-01-01T00:00:00Z", "created_since"},
		{"limit=", "limit"},
		{"order=", "order"},
		{"after=", "after"},
		// A cursor of 0 reads as no cursor (issue 34).
		{"after=0", "after"},
		{"after=00", "after"},
		// A pair url.Values drops (a malformed escape, a ';') would
		// widen the filter: it is refused, naming the parameter.
		{"state=ready&priority=%G2", "priority"},
		{"state=ready&kind=a%", "kind"},
		{"state=ready&queue=q;priority=2", "queue"},
		{"state=ready&%zz=1", "%zz"},
		{"state=ready&=x", "=x"},
		{"state=ready&state=dead", "state"},
		{"colour=red", "colour"},
	} {
		for _, target := range []string{"GET /api/tasks", "POST /api/tasks/cancel", "POST /api/tasks/retry", "GET /api/tasks/count"} {
			method, path, _ := strings.Cut(target, " ")
			if (method == "POST" || path == "/api/tasks/count") && (tc.field == "limit" || tc.field == "order") ||
				path == "/api/tasks/count" && tc.field == "after" {
				continue
			}
			w := serveOnce(h, method, path+"?"+tc.query, "")
			got := decode[apiError](t, w.Body.String())
			if w.Code != 400 || got.Field != tc.field || strings.Contains(got.Error, "SQLSTATE") {
				t.Errorf("%s?%s: %d %s, want 400 naming %s", target, tc.query, w.Code, w.Body, tc.field)
			}
		}
	}
	if w := serveOnce(h, "GET", "/api/tasks?shard=15&kind=noop&key=k&created_before=2020-01-01T00:00:00Z", ""); w.Code != 200 {
		t.Fatalf("a valid filter: %d %s", w.Code, w.Body)
	}
}

// TestABulkCancelNeverWidensItsFilter: a bulk operation acts on no more
// than its filter says. priority=0 once meant "any priority" and cancelled
// every task of the queue.
func TestABulkCancelNeverWidensItsFilter(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.start("coord", nil)
	base := "http://" + c.Addr()
	for p := 1; p <= 3; p++ {
		if code, body := testutil.HTTP(t, "POST", base+"/api/tasks", "", fmt.Sprintf(`{"kind": "noop", "queue": "q34", "priority": %d}`, p)); code != 201 {
			t.Fatalf("enqueue: %d %s", code, body)
		}
	}
	// A priority url.Values drops (a malformed escape, a ';') left the
	// queue alone in the filter (issue 34).
	for _, p := range []string{"0", "00", "-0", "%G2", "2;", "2%"} {
		if code, body := testutil.HTTP(t, "POST", base+"/api/tasks/cancel?queue=q34&priority="+p, "", ""); code != 400 {
			t.Errorf("cancel with priority=%s: %d %s, want 400", p, code, body)
		}
		if code, body := testutil.HTTP(t, "GET", base+"/api/tasks/count?queue=q34&priority="+p, "", ""); code != 400 {
			t.Errorf("count with priority=%s: %d %s, want 400", p, code, body)
		}
	}
	code, body := testutil.HTTP(t, "POST", base+"/api/tasks/cancel?queue=q34&priority=2", "", "")
	if got := decode[tasks.BulkResult](t, body); code != 200 || got.Cancelled != 1 || !got.Done {
		t.Fatalf("cancel of priority 2: %d %s, want one cancelled", code, body)
	}
	code, body = testutil.HTTP(t, "GET", base+"/api/tasks/count?queue=q34&state=ready", "", "")
	if got := decode[store.MatchCount](t, body); code != 200 || got.Count != 2 {
		t.Fatalf("ready after the cancel: %d %s, want 2", code, body)
	}
}

// Every listing checks every parameter before the database sees it, by
// the task listing's rule: a cursor or text PostgreSQL would refuse, a
// parameter unknown, given twice, given empty or malformed is a 400 naming
// it (issue 34: GET /api/sequences/blocked?after=%00 reached PostgreSQL and
// answered SQLSTATE 22021 without a field).
func TestEveryListingChecksItsParameters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c, err := New(Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	h := c.Handler()
	for _, tc := range []struct{ target, query, field string }{
		{"GET /api/sequences/blocked", "after=%00", "after"},
		{"GET /api/sequences/blocked", "after=%FF%FE", "after"},
		{"GET /api/sequences/blocked", "after=a%00b", "after"},
		{"GET /api/sequences/blocked", "after=" + strings.Repeat("k", tasks.MaxKeyLen+1), "after"},
		{"GET /api/sequences/blocked", "after=", "after"},
		{"GET /api/sequences/blocked", "after=a&after=b", "after"},
		{"GET /api/sequences/blocked", "after=%G0", "after"},
		{"GET /api/sequences/blocked", "limit=0", "limit"},
		{"GET /api/sequences/blocked", "limit=1;after=a", "limit"},
		{"GET /api/sequences/blocked", "colour=red", "colour"},
		{"GET /api/sequences/blocked", "=x", "=x"},
		{"GET /api/schedules", "after=%00", "after"},
		{"GET /api/schedules", "after=%FF%FE", "after"},
		{"GET /api/schedules", "after=", "after"},
		{"GET /api/schedules", "after=%G0", "after"},
		{"GET /api/schedules", "limit=1&limit=1", "limit"},
		{"GET /api/schedules", "colour=red", "colour"},
		{"GET /api/queues", "after=x", "after"},
		{"GET /api/queues", "=x", "=x"},
		{"POST /api/queues/q/pause", "force=1", "force"},
		{"DELETE /api/schedules/x", "force=1", "force"},
		{"DELETE /api/schedules/a%00b", "", "name"},
		{"DELETE /api/schedules/%FF", "", "name"},
	} {
		method, path, _ := strings.Cut(tc.target, " ")
		w := serveOnce(h, method, path+"?"+tc.query, "")
		got := decode[apiError](t, w.Body.String())
		if w.Code != 400 || got.Field != tc.field || strings.Contains(got.Error, "SQLSTATE") {
			t.Errorf("%s?%s: %d %s, want 400 naming %s", tc.target, tc.query, w.Code, w.Body, tc.field)
		}
	}
	for _, target := range []string{"GET /api/sequences/blocked?after=k&limit=5", "GET /api/schedules?after=x&limit=5", "GET /api/queues"} {
		method, path, _ := strings.Cut(target, " ")
		if w := serveOnce(h, method, path, ""); w.Code != 200 {
			t.Errorf("%s: %d %s", target, w.Code, w.Body)
		}
	}
}
