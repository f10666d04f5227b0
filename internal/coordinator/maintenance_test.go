package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/leader"
	"github.com/shardrun/shardrun/internal/maintenance"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// A schedule ticking every second across a leader kill: no tick is
// enqueued twice, and the only ticks missing are ticks that came due
// before the new leader's term began, of which the latest was enqueued.
func TestScheduleAcrossALeaderKill(t *testing.T) {
	e := newEnv(t)
	sig := newSignals()
	ticks := func(id string) func() []schedule.Result {
		return func() []schedule.Result {
			var out []schedule.Result
			for _, ev := range sig.of(id, "schedule") {
				if ev.Err == nil {
					out = append(out, ev.Detail.(schedule.Result))
				}
			}
			return out
		}
	}
	firstPass := func(id string) (schedule.Result, bool) {
		ev, ok := sig.passes[id].Wait(10*time.Second, func(ev leader.Event) bool { return ev.Service == "schedule" && ev.Err == nil })
		if !ok {
			return schedule.Result{}, false
		}
		return ev.Detail.(schedule.Result), true
	}
	a := e.start("coord-a", sig)
	testutil.WaitFor(t, 10*time.Second, "a leads", a.IsLeader)
	b := e.start("coord-b", sig)
	ctx := context.Background()
	start := time.Now().Add(time.Second).Truncate(time.Second)
	if _, err := a.Schedules().Create(ctx, schedule.Definition{Name: "every-second", Task: tasks.NewTask{Kind: "noop"}, Every: time.Second, Start: start}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "a enqueued 3 ticks", func() bool { return len(pgtest.ScheduleTicks(t, e.store, "every-second")) >= 3 })

	sess := a.leader.Session()
	if _, err := e.admin.Revoke(ctx, sess.Lease()); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "b leads", b.IsLeader)
	// b's term starts when it raised the fence (its first pass says when);
	// then three more ticks.
	first, ok := firstPass("coord-b")
	if !ok {
		t.Fatal("b ran no scheduler pass")
	}
	termStart := first.TermStart
	testutil.WaitFor(t, 10*time.Second, "b enqueued 3 ticks of its term", func() bool {
		n := 0
		for _, at := range pgtest.ScheduleTicks(t, e.store, "every-second") {
			if !at.Before(termStart) {
				n++
			}
		}
		return n >= 3
	})
	checkTicks(t, e.store, start, termStart, ticks("coord-b"))

	// No leader at all for 2.5s: a is stopped, b is stopped, and c starts
	// after a fixed gap (the fault being simulated, not a wait for a
	// condition). c enqueues the latest tick missed in the gap, once.
	a.stop()
	b.stop()
	time.Sleep(2500 * time.Millisecond)
	c := e.start("coord-c", sig)
	testutil.WaitFor(t, 10*time.Second, "c leads", c.IsLeader)
	first, ok = firstPass("coord-c")
	if !ok {
		t.Fatal("c ran no scheduler pass")
	}
	if first.Skipped < 1 || first.Enqueued < 1 {
		t.Fatalf("c's first pass after a 2.5s gap: %+v; want the missed ticks skipped but the latest enqueued", first)
	}
	checkTicks(t, e.store, start, first.TermStart, ticks("coord-c"), ticks("coord-b"))
}

// checkTicks checks the schedule's ticks: on the grid, none twice, every
// tick from termStart on present, the latest before it present, and the
// missing ones exactly the skipped ones the schedulers counted.
func checkTicks(t *testing.T, st *store.Store, start, termStart time.Time, passes ...func() []schedule.Result) {
	t.Helper()
	got := pgtest.ScheduleTicks(t, st, "every-second")
	present := map[time.Time]bool{}
	for _, at := range got {
		if present[at] {
			t.Fatalf("tick %s enqueued twice", at)
		}
		present[at] = true
		if at.Sub(start)%time.Second != 0 {
			t.Fatalf("tick %s is not on the schedule's grid", at)
		}
	}
	var missing []time.Time
	var latestBeforeTerm time.Time
	for at := got[0]; !at.After(got[len(got)-1]); at = at.Add(time.Second) {
		if at.Before(termStart) {
			latestBeforeTerm = at
		}
		if !present[at] {
			missing = append(missing, at)
			if !at.Before(termStart) {
				t.Errorf("tick %s came due in b's term (from %s) and was not enqueued", at, termStart)
			}
		}
	}
	if !present[latestBeforeTerm] {
		t.Errorf("the latest tick before b's term (%s) was not enqueued", latestBeforeTerm)
	}
	var skipped int
	for _, p := range passes {
		for _, r := range p() {
			skipped += r.Skipped
		}
	}
	if skipped != len(missing) {
		t.Errorf("b counted %d skipped ticks, %d are missing: %v", skipped, len(missing), missing)
	}
	t.Logf("%d ticks enqueued, %d missed while no leader ran and skipped (policy: the latest missed once); the term began %s after the last tick before it",
		len(got), len(missing), termStart.Sub(lastBefore(got, termStart)))
}

func lastBefore(ticks []time.Time, t time.Time) time.Time {
	var last time.Time
	for _, at := range ticks {
		if at.Before(t) {
			last = at
		}
	}
	return last
}

func TestSchedulesAPI(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.start("coord", nil, func(c *Config) { c.APIToken = "tok" })
	base := "http://" + c.Addr() + "/api/schedules"
	code, body := testutil.HTTP(t, "POST", base, "tok", `{"name": "digest", "kind": "noop", "cron": "0 9 * * 1-5", "timezone": "Europe/Berlin", "payload": {"to": "ops"}}`)
	created := decode[struct {
		ScheduleView
		Warnings []string
	}](t, body)
	if code != 201 || created.Name != "digest" || created.NextRun.IsZero() || len(created.Warnings) != 1 {
		t.Fatalf("create (the schedule itself, with warnings): %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "POST", base, "tok", `{"name": "tick", "kind": "noop", "every": "90s"}`)
	if code != 201 {
		t.Fatalf("create interval: %d %s", code, body)
	}
	for _, tc := range []struct {
		name, token, body string
		code              int
		want              string
	}{
		{"no token", "", `{"name": "x", "kind": "noop", "every": "1m"}`, 401, "bearer"},
		{"taken name", "tok", `{"name": "tick", "kind": "noop", "every": "1m"}`, 409, `"field":"name"`},
		{"bad cron", "tok", `{"name": "x", "kind": "noop", "cron": "99 * * * *"}`, 400, `"field":"cron"`},
		{"bad zone", "tok", `{"name": "x", "kind": "noop", "cron": "0 9 * * *", "timezone": "Mars/Base"}`, 400, `"field":"timezone"`},
		{"bad every", "tok", `{"name": "x", "kind": "noop", "every": "often"}`, 400, `"field":"every"`},
		{"short every", "tok", `{"name": "x", "kind": "noop", "every": "10ms"}`, 400, `"field":"every"`},
		{"both", "tok", `{"name": "x", "kind": "noop", "every": "1m", "cron": "* * * * *"}`, 400, "not both"},
		{"bad name", "tok", `{"name": "a b", "kind": "noop", "every": "1m"}`, 400, `"field":"name"`},
		{"no kind", "tok", `{"name": "x", "every": "1m"}`, 400, `"field":"kind"`},
		{"unknown field", "tok", `{"name": "x", "kind": "noop", "every": "1m", "jitter": 1}`, 400, "unknown field"},
		{"max_attempts 0", "tok", `{"name": "x", "kind": "noop", "every": "1m", "max_attempts": 0}`, 400, `"field":"max_attempts"`},
		{"zero start", "tok", `{"name": "x", "kind": "noop", "every": "1m", "start": "0001-01-01T00:00:00Z"}`, 400, `"field":"start"`},
		// Given empty or null is not left out (issue 34).
		{"empty key", "tok", `{"name": "x", "kind": "noop", "every": "1m", "key": ""}`, 400, `"field":"key"`},
		{"empty every", "tok", `{"name": "x", "kind": "noop", "every": "", "cron": "* * * * *"}`, 400, `"field":"every"`},
		{"empty cron", "tok", `{"name": "x", "kind": "noop", "every": "1m", "cron": ""}`, 400, `"field":"cron"`},
		{"empty timezone", "tok", `{"name": "x", "kind": "noop", "cron": "* * * * *", "timezone": ""}`, 400, `"field":"timezone"`},
		{"null key", "tok", `{"name": "x", "kind": "noop", "every": "1m", "key": null}`, 400, `"field":"key"`},
		{"null timezone", "tok", `{"name": "x", "kind": "noop", "cron": "* * * * *", "timezone": null}`, 400, `"field":"timezone"`},
		{"null start", "tok", `{"name": "x", "kind": "noop", "every": "1m", "start": null}`, 400, `"field":"start"`},
		{"null max_attempts", "tok", `{"name": "x", "kind": "noop", "every": "1m", "max_attempts": null}`, 400, `"field":"max_attempts"`},
		{"empty queue", "tok", `{"name": "x", "kind": "noop", "every": "1m", "queue": ""}`, 400, `"field":"queue"`},
		{"priority 0", "tok", `{"name": "x", "kind": "noop", "every": "1m", "priority": 0}`, 400, `"field":"priority"`},
		// The options a tick's task does not take, as the Go API refuses them.
		{"run_after", "tok", `{"name": "x", "kind": "noop", "every": "1m", "run_after": "2030-01-01T00:00:00Z"}`, 400, `"field":"run_after"`},
		{"deadline", "tok", `{"name": "x", "kind": "noop", "every": "1m", "deadline": "2030-01-01T00:00:00Z"}`, 400, `"field":"deadline"`},
		{"unique_key", "tok", `{"name": "x", "kind": "noop", "every": "1m", "unique_key": "u"}`, 400, `"field":"unique_key"`},
	} {
		code, body := testutil.HTTP(t, "POST", base, tc.token, tc.body)
		if code != tc.code || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %s, want %d with %q", tc.name, code, body, tc.code, tc.want)
		}
	}
	if code, _ := testutil.HTTP(t, "GET", base, "", ""); code != 401 {
		t.Errorf("list without token: %d", code)
	}
	code, body = testutil.HTTP(t, "GET", base, "tok", "")
	var list struct{ Schedules []ScheduleView }
	if err := json.Unmarshal([]byte(body), &list); err != nil || code != 200 || len(list.Schedules) != 2 {
		t.Fatalf("list: %d %s", code, body)
	}
	digest := list.Schedules[0]
	berlin, _ := time.LoadLocation("Europe/Berlin")
	if digest.Name != "digest" || digest.Timezone != "Europe/Berlin" || digest.NextRun.In(berlin).Hour() != 9 ||
		digest.NextRun.In(berlin).Weekday() == time.Saturday || string(digest.Payload) != `{"to":"ops"}` {
		t.Fatalf("digest: %+v", digest)
	}
	if list.Schedules[1].Every != "1m30s" {
		t.Fatalf("tick: %+v", list.Schedules[1])
	}
	// Pages by name, with a cursor, like GET /api/tasks.
	code, body = testutil.HTTP(t, "GET", base+"?limit=1", "tok", "")
	page := decode[struct {
		Schedules []ScheduleView
		Next      string
	}](t, body)
	if code != 200 || len(page.Schedules) != 1 || page.Schedules[0].Name != "digest" || page.Next != "digest" {
		t.Fatalf("first page: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "GET", base+"?limit=1&after="+page.Next, "tok", "")
	if code != 200 || !strings.Contains(body, `"name":"tick"`) || strings.Contains(body, `"next"`) {
		t.Fatalf("last page: %d %s", code, body)
	}
	for _, q := range []string{"limit=0", "limit=1001", "limit=", "after=", "after=a%00b", "after=%FF", "colour=red", "limit=1&limit=2"} {
		if code, body := testutil.HTTP(t, "GET", base+"?"+q, "tok", ""); code != 400 || !strings.Contains(body, `"field"`) {
			t.Errorf("GET /api/schedules?%s: %d %s, want 400 naming the field", q, code, body)
		}
	}
	if code, body := testutil.HTTP(t, "DELETE", base+"/digest", "tok", ""); code != 200 {
		t.Fatalf("delete: %d %s", code, body)
	}
	if code, _ := testutil.HTTP(t, "DELETE", base+"/digest", "tok", ""); code != 404 {
		t.Fatalf("delete twice: %d", code)
	}
	v, err := c.Cluster(context.Background())
	if err != nil || len(v.Schedules) != 1 || v.Schedules[0].Name != "tick" || v.Schedules[0].NextRun.IsZero() {
		t.Fatalf("cluster view schedules: %+v %v", v.Schedules, err)
	}

	// PUT defines a schedule whether or not it exists (a deployment that
	// declares its schedules at every start), with a tick task's options.
	report := `{"kind": "report", "every": "1h", "queue": "reports", "priority": 1, "sequence_key": "reports"}`
	for i, want := range []struct {
		code    int
		changed bool
	}{{201, true}, {200, false}} {
		code, body := testutil.HTTP(t, "PUT", base+"/report", "tok", report)
		got := decode[ScheduleCreated](t, body)
		if code != want.code || got.Changed == nil || *got.Changed != want.changed || got.Queue != "reports" || got.Priority != 1 ||
			got.SequenceKey != "reports" || !strings.Contains(body, `no attached runner serves queue \"reports\"`) {
			t.Fatalf("PUT #%d: %d %s; want %d, changed %v, the options, and a warning", i+1, code, body, want.code, want.changed)
		}
	}
	if code, body := testutil.HTTP(t, "PUT", base+"/report", "tok", strings.Replace(report, `"priority": 1`, `"priority": 2`, 1)); code != 200 ||
		!strings.Contains(body, `"changed":true`) || !strings.Contains(body, `"priority":2`) {
		t.Fatalf("PUT with a new priority: %d %s", code, body)
	}
	// skip_while_unfinished is a schedule's, stored and shown; a change of
	// it alone changes the schedule.
	if code, body := testutil.HTTP(t, "PUT", base+"/report", "tok", strings.Replace(report, `"priority": 1`, `"priority": 2, "skip_while_unfinished": true`, 1)); code != 200 ||
		!strings.Contains(body, `"changed":true`) || !strings.Contains(body, `"skip_while_unfinished":true`) {
		t.Fatalf("PUT with skip_while_unfinished: %d %s", code, body)
	}
	if code, body := testutil.HTTP(t, "GET", base, "tok", ""); code != 200 || !strings.Contains(body, `"skip_while_unfinished":true`) {
		t.Fatalf("the listing of a schedule that skips ticks while unfinished: %d %s", code, body)
	}
	for _, tc := range []struct{ body, field string }{
		{`{"name": "other", "kind": "report", "every": "1h"}`, "name"},
		{`{"kind": "report", "every": "1h", "skip_while_unfinished": null}`, "skip_while_unfinished"},
		{`{"kind": "report", "every": "1h", "priority": 0}`, "priority"},
		{`{"kind": "report", "every": "1h", "queue": ""}`, "queue"},
		{`{"kind": "report", "every": "1h", "queue": "a b"}`, "queue"},
		{`{"kind": "report", "every": "1h", "sequence_key": ""}`, "sequence_key"},
	} {
		if code, body := testutil.HTTP(t, "PUT", base+"/report", "tok", tc.body); code != 400 || !strings.Contains(body, `"field":"`+tc.field+`"`) {
			t.Errorf("PUT %s: %d %s, want 400 naming %s", tc.body, code, body, tc.field)
		}
	}
}

// Ready tasks of a kind no attached runner handles show in /api/cluster
// and as shardrun_unhandled_tasks{kind}; --unhandled-after fails them.
func TestUnhandledKindsVisibleAndFailed(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	sig := newSignals()
	c := e.start("coord", sig, func(c *Config) {
		c.Unhandled = maintenance.ReaperConfig{After: 2 * time.Second, Interval: 100 * time.Millisecond}
	})
	ctx := context.Background()
	// A runner serving the default queue with noop and sleep is attached;
	// one handling report is detached; nobody serves the queue "mail".
	for id, r := range map[string]shard.RunnerInfo{
		"r1": {ID: "r1", State: shard.StateAttached, Queues: []string{"default"}, Kinds: []string{"noop", "sleep"}},
		"r2": {ID: "r2", State: shard.StateDetached, Queues: []string{"default"}, Kinds: []string{"report"}},
	} {
		lease, err := e.admin.Grant(ctx, 60)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(r)
		if _, err := e.admin.Put(ctx, prefix+"runners/"+id, string(b), clientv3.WithLease(lease.ID)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.store.Pool().Exec(ctx, `INSERT INTO tasks (kind, shard, key, run_after, queue)
		SELECT (ARRAY['noop', 'report', 'mystery', 'noop'])[g % 4 + 1], g % 16, g::text, now() - interval '1 hour',
		       CASE WHEN g % 4 = 3 THEN 'mail' ELSE 'default' END
		FROM generate_series(1, 40) g`); err != nil {
		t.Fatal(err)
	}
	var v ClusterView
	testutil.Until(t, 10*time.Second, "the cluster view lists the unrunnable work", func() (bool, string) {
		var err error
		v, err = c.Cluster(ctx)
		return err == nil && len(v.Unrunnable) == 3, fmt.Sprintf("%+v %v", v.Unrunnable, err)
	})
	if v.Unrunnable[0].Class != (tasks.Class{Queue: "default", Kind: "mystery"}) || v.Unrunnable[0].Ready != 10 ||
		v.Unrunnable[1].Class != (tasks.Class{Queue: "default", Kind: "report"}) || v.Unrunnable[1].Ready != 10 ||
		v.Unrunnable[2].Class != (tasks.Class{Queue: "mail", Kind: "noop"}) || v.Unrunnable[2].Ready != 10 {
		t.Fatalf("unrunnable %+v, want default/mystery 10, default/report 10 and mail/noop 10", v.Unrunnable)
	}
	_, body := testutil.HTTP(t, "GET", "http://"+c.Addr()+"/metrics", "", "")
	for _, want := range []string{`shardrun_unrunnable_tasks{kind="mystery",queue="default"} 10`,
		`shardrun_unrunnable_tasks{kind="report",queue="default"} 10`, `shardrun_unrunnable_tasks{kind="noop",queue="mail"} 10`,
		`shardrun_retention_deleted_total{database="main",state="completed"} 0`, `shardrun_schedule_ticks_skipped_total{database="main",reason="missed"} 0`,
		`shardrun_schedule_ticks_skipped_total{database="main",reason="unfinished"} 0`} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(body, `shardrun_unrunnable_tasks{kind="noop",queue="default"}`) {
		t.Error("work an attached runner can run is listed as unrunnable")
	}
	// The enqueue answer warns of it.
	code, resp := testutil.HTTP(t, "POST", "http://"+c.Addr()+"/api/tasks", "", `[{"kind": "noop", "queue": "mail"}, {"kind": "noop"}]`)
	if code != 201 || !strings.Contains(resp, `no attached runner serves queue \"mail\" with a handler of kind \"noop\"`) ||
		strings.Contains(resp, `queue \"default\"`) {
		t.Fatalf("enqueue of unrunnable work: %d %s", code, resp)
	}
	// After 2s unrunnable, the leader fails them with a clear error.
	if _, ok := sig.passes["coord"].Wait(15*time.Second, func(ev leader.Event) bool {
		r, ok := ev.Detail.(maintenance.ReaperResult)
		return ok && r.Failed[tasks.Class{Queue: "default", Kind: "mystery"}] == 10
	}); !ok {
		t.Fatalf("--unhandled-after did not fail the mystery tasks: %+v", sig.of("coord", "unhandled"))
	}
}

// A coordinator configured with another shard count than the database's
// stops at start, naming the flag, and writes nothing to etcd.
func TestCoordinatorRefusesAnotherShardCountThanTheDatabases(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	if _, err := e.store.EnsureShardCount(context.Background(), 64); err != nil {
		t.Fatal(err)
	}
	c, err := New(Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: e.store, HTTPAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	err = c.Run(context.Background())
	if !errors.Is(err, store.ErrShardCountMismatch) || !strings.Contains(err.Error(), "--shard-count") || !strings.Contains(err.Error(), "64 shards") {
		t.Fatalf("coordinator with 16 shards on a 64-shard database: %v", err)
	}
	if resp, _ := e.admin.Get(context.Background(), prefix+"meta/shard-count"); len(resp.Kvs) != 0 {
		t.Fatal("the refused coordinator created the cluster in etcd")
	}
}
