package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// updateScreenshots, set to 1, makes TestTasksViewInABrowser write its
// screenshots over the ones committed in docs/ (otherwise they go to a
// temporary directory): SHARDRUN_UPDATE_SCREENSHOTS=1 go test ./coordinator -run TestTasksViewInABrowser
const updateScreenshots = "SHARDRUN_UPDATE_SCREENSHOTS"

// browserView drives one headless Chromium tab through the status page.
type browserView struct {
	t   *testing.T
	ctx context.Context
	dir string // where screenshots go
}

// do runs steps with a deadline: every wait in them is a WaitVisible or a
// Poll, which return as soon as their condition holds.
func (b *browserView) do(what string, steps ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 20*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		b.t.Fatalf("%s: %v; the page: %s", what, err, b.state())
	}
}

// state describes what the page shows, for a failure's message.
func (b *browserView) state() string {
	ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`JSON.stringify({hash: location.hash, view: document.body.dataset.tasksView,
		message: document.getElementById("tasks-msg").textContent, signin: document.getElementById("signin-error").textContent,
		errors: window.__errors || [], token: document.getElementById("token").value, stored: sessionStorage.getItem("shardrun.apiToken"), text: document.body.innerText.slice(0, 600)})`))
	if err != nil {
		return err.Error()
	}
	return s
}

// until polls a JavaScript condition in the page until it is true.
func (b *browserView) until(what, cond string) {
	b.t.Helper()
	b.do(what, chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		_, err := chromedp.Poll[chromedp.Void](cond, chromedp.WithPollingTimeout(15*time.Second), chromedp.WithPollingInterval(50*time.Millisecond))(ctx, tg)
		if err != nil {
			// Say what the page showed instead.
			msg, _ := chromedp.Evaluate[string](`document.getElementById("tasks-msg").textContent + " | " + document.body.dataset.tasksView`)(ctx, tg)
			return fmt.Errorf("%w (page message and view: %q)", err, msg)
		}
		return nil
	}))
}

// eval evaluates a JavaScript expression in the page.
func eval[T any](b *browserView, what, expr string) T {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr))
	if err != nil {
		b.t.Fatalf("%s: %v", what, err)
	}
	return v
}

// screenshot saves the viewport as name (a PNG).
func (b *browserView) screenshot(name string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 20*time.Second)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
	if err != nil {
		b.t.Fatalf("screenshot %s: %v", name, err)
	}
	path := filepath.Join(b.dir, name)
	if err := os.WriteFile(path, png, 0o644); err != nil {
		b.t.Fatalf("writing the screenshot: %v", err)
	}
	if len(png) < 10_000 {
		b.t.Fatalf("screenshot %s is only %d bytes: the page did not render", path, len(png))
	}
	b.t.Logf("screenshot: %s (%d bytes)", path, len(png))
}

// filter fills the filter form (after Clear) and applies it: states are
// ticked, fields typed.
func (b *browserView) filter(states []string, fields map[string]string) {
	b.t.Helper()
	steps := []chromedp.Action[chromedp.Void]{chromedp.Click(chromedp.ID("nav-tasks")), chromedp.WaitVisible(chromedp.ID("clear")), chromedp.Click(chromedp.ID("clear"))}
	steps = append(steps, chromedp.Poll[chromedp.Void](`!document.querySelector('#filters input[name="state"]:checked') && document.querySelector('#filters [name="kind"]').value === ""`))
	for _, st := range states {
		steps = append(steps, chromedp.Click(chromedp.CSS(`#filters input[name="state"][value="`+st+`"]`)))
	}
	for name, v := range fields {
		sel := chromedp.CSS(`#filters [name="` + name + `"]`)
		if name == "limit" || name == "order" || name == "priority" || strings.HasPrefix(name, "created_") {
			steps = append(steps, chromedp.SetValue(sel, v))
		} else {
			steps = append(steps, chromedp.SendKeys(sel, v))
		}
	}
	steps = append(steps, chromedp.Click(chromedp.ID("apply")))
	b.do(fmt.Sprintf("filtering by %v %v", states, fields), steps...)
}

// confirm waits for the confirmation dialog, checks the count it shows,
// optionally takes its screenshot, and confirms.
func (b *browserView) confirm(wantCount, shot string) {
	b.t.Helper()
	b.do("the confirmation opens", chromedp.WaitVisible(chromedp.ID("confirm-yes")))
	if got := eval[string](b, "the confirmation's count", `document.getElementById("confirm-count").textContent`); got != wantCount {
		b.t.Fatalf("the confirmation says %q, want %q", got, wantCount)
	}
	if shot != "" {
		b.screenshot(shot)
	}
	b.do("confirming", chromedp.Click(chromedp.ID("confirm-yes")), chromedp.WaitNotVisible(chromedp.ID("confirm")))
}

// TestTasksViewInABrowser drives the tasks view of the status page in
// headless Chromium against a coordinator with an API token and a real
// runner: the sign-in (a wrong token, then the right one; without it the
// page shows no task data), filters, one task with its errors and payload,
// cancelling a running task, retrying a dead one, retrying by filter (a
// bulk of 2,500 tasks that takes three requests, the page continuing from
// each answer's cursor), a bulk action the filter's states forbid, hostile
// task data shown as text, and signing out. Every action's effect is
// checked through the API. Screenshots of the list, of one task and of a
// confirmation go to a temporary directory, or with
// SHARDRUN_UPDATE_SCREENSHOTS=1 to docs/.
func TestTasksViewInABrowser(t *testing.T) {
	browser := chromium(t)
	e := newEnv(t)
	const token = "view-token-7f3a9c"
	c := e.start("coord", nil, func(c *Config) { c.APIToken = token })
	// Each bulk request does one batch of store.BulkBatch and answers done
	// false: the page must continue from "next".
	c.bulkBudget.Store(0)
	base := "http://" + c.Addr()
	ctx := context.Background()

	// Dead tasks of a kind no runner handles, older than the rest.
	e.exec(`INSERT INTO tasks (kind, shard, key, state, finished_at, created_at)
		SELECT 'ghost', g % 16, 'ghost-' || g, 'dead', now(), now() - interval '1 hour' FROM generate_series(1, 2500) g`)

	cfg := runner.DefaultConfig()
	cfg.EtcdEndpoints, cfg.EtcdPrefix, cfg.Cluster = e.etcd.Endpoints(), "/shardrun/", "test"
	cfg.ShardCount, cfg.DatabaseURL, cfg.AdminAddr = 16, e.dsn, "127.0.0.1:0"
	cfg.RunnerID, cfg.LeaseTTL, cfg.RecoveryWindow = "runner-1", 2*time.Second, 200*time.Millisecond
	cfg.HeartbeatInterval, cfg.PollInterval, cfg.RetryBase = 100*time.Millisecond, 50*time.Millisecond, 10*time.Millisecond
	cfg.Logger = hclog.NewNullLogger()
	r, err := runner.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.HandleBuiltins(); err != nil {
		t.Fatal(err)
	}
	rctx, stopRunner := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(sync.OnceFunc(func() { stopRunner(); <-done }))
	<-r.Started()

	enqueue := func(body string) int64 {
		t.Helper()
		code, resp := testutil.HTTP(t, "POST", base+"/api/tasks", token, body)
		if code != 201 {
			t.Fatalf("enqueue %s: %d %s", body, code, resp)
		}
		return decode[struct{ ID int64 }](t, resp).ID
	}
	get := func(id int64) tasks.Task {
		t.Helper()
		code, body := testutil.HTTP(t, "GET", fmt.Sprintf("%s/api/tasks/%d", base, id), token, "")
		if code != 200 {
			t.Fatalf("GET task %d: %d %s", id, code, body)
		}
		return decode[tasks.Task](t, body)
	}
	count := func(query string) store.MatchCount {
		t.Helper()
		code, body := testutil.HTTP(t, "GET", base+"/api/tasks/count?"+query, token, "")
		if code != 200 {
			t.Fatalf("count %s: %d %s", query, code, body)
		}
		return decode[store.MatchCount](t, body)
	}
	for i := range 12 {
		enqueue(fmt.Sprintf(`{"kind": "noop", "key": "order-%d", "queue": "default"}`, 1000+i))
	}
	var bulk []int64
	for range 3 {
		bulk = append(bulk, enqueue(`{"kind": "fail", "key": "nightly-export", "payload": {"times": 1}, "max_attempts": 1}`))
	}
	dead := enqueue(`{"kind": "fail", "key": "invoice-4711", "payload": {"times": 2}, "max_attempts": 2, "priority": 2}`)
	running := enqueue(`{"kind": "sleep", "key": "report-2026-11", "payload": {"ms": 600000}}`)
	hostileKind := `<img src=x onerror="window.pwned=1">`
	hostile := enqueue(`{"kind": ` + jsonString(hostileKind) + `, "key": "</td><script>window.pwned=2</script>",
		"payload": {"html": "<b>bold</b><script>window.pwned=3</script>"}}`)
	testutil.Until(t, 20*time.Second, "the runner ran the tasks: the fail tasks dead, the sleep running", func() (bool, string) {
		d, s := get(dead), get(running)
		n := count("state=dead&key=nightly-export")
		return d.State == tasks.Dead && len(d.Errors) == 2 && s.State == tasks.Running && n.Count == 3,
			fmt.Sprintf("task %d %s with %d errors, task %d %s, %d bulk tasks dead", dead, d.State, len(d.Errors), running, s.State, n.Count)
	})

	var dir string
	if os.Getenv(updateScreenshots) == "1" {
		if dir, err = filepath.Abs(filepath.Join("..", "..", "docs")); err != nil {
			t.Fatal(err)
		}
	} else {
		dir = t.TempDir()
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1280, 900), chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-component-update", true))
	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	// The first action starts the browser, which lives as long as the
	// context of that action: bctx, not one of the steps' deadlines.
	if err := chromedp.Do(bctx, chromedp.EmulateViewport(1280, 960), chromedp.Navigate("about:blank")); err != nil {
		t.Fatalf("starting %s: %v", browser, err)
	}
	b := &browserView{t: t, ctx: bctx, dir: dir}

	// Without the token the API answers 401: the page asks for it and
	// shows no task data, and a wrong one is refused.
	b.do("opening the tasks view", chromedp.Navigate(base+"/#tasks"),
		chromedp.Evaluate[chromedp.Void](`window.__errors = []; window.addEventListener("error", (e) => window.__errors.push(String(e.message)))`), chromedp.WaitVisible(chromedp.ID("token")))
	if n := eval[int](b, "rows before signing in", `document.querySelectorAll("#task-rows tr").length`); n != 0 {
		t.Fatalf("%d task rows shown before signing in", n)
	}
	b.do("typing a wrong token", chromedp.SendKeys(chromedp.ID("token"), "not-the-token"))
	b.do("signing in with it", chromedp.Click(chromedp.ID("signin-button")))
	b.do("the wrong token refused", chromedp.WaitVisible(chromedp.ID("signin-error")))
	if msg := eval[string](b, "the sign-in error", `document.getElementById("signin-error").textContent`); !strings.Contains(msg, "refused") {
		t.Fatalf("sign-in error %q", msg)
	}
	b.do("signing in", chromedp.SendKeys(chromedp.ID("token"), token), chromedp.Click(chromedp.ID("signin-button")),
		chromedp.WaitVisible(chromedp.CSS("#task-rows tr.row")))
	if href := eval[string](b, "the URL", `location.href`); strings.Contains(href, token) {
		t.Fatalf("the token is in the URL %s", href)
	}
	if got := eval[string](b, "the stored token", `sessionStorage.getItem("shardrun.apiToken")`); got != token {
		t.Fatalf("sessionStorage holds %q", got)
	}

	// The list filtered by state, newest first, with its count.
	b.filter([]string{"dead", "failed"}, map[string]string{"limit": "25"})
	b.until("the dead and failed tasks listed with their count",
		fmt.Sprintf(`document.getElementById("match-count").dataset.count === "2504" && document.querySelectorAll("#task-rows tr.row").length === 25 &&
			document.querySelector("#task-rows tr.row").dataset.task === "%d" && location.hash.includes("state=failed%%2Cdead")`, dead))
	b.screenshot("tasks-view-list.png")

	// One task: its attempts with their errors, and its payload.
	b.do("opening the dead task", chromedp.Click(chromedp.CSS(fmt.Sprintf(`#task-rows tr[data-task="%d"] a`, dead))))
	b.until("the dead task shown", fmt.Sprintf(`document.getElementById("task-detail").dataset.task === "%d" && document.querySelectorAll("#d-errors tr").length === 2`, dead))
	detail := eval[string](b, "the task's text", `document.getElementById("task-detail").innerText`)
	for _, want := range []string{"invoice-4711", "fail: attempt 1 of the first 2 that fail", "fail: attempt 2 of the first 2 that fail", `"times": 2`, "runner-1", "2 of 2"} {
		if !strings.Contains(detail, want) {
			t.Errorf("the task's view lacks %q:\n%s", want, detail)
		}
	}
	b.screenshot("tasks-view-task.png")

	// Retry it: the confirmation names one task; the API shows it ready
	// again, and the runner completes it (its payload fails two attempts).
	b.do("retrying the dead task", chromedp.Click(chromedp.ID("d-retry")))
	b.confirm("1 task", "")
	b.until("the retry reported", `document.getElementById("tasks-msg").textContent.includes("is ready again")`)
	testutil.Until(t, 15*time.Second, "the retried task completed", func() (bool, string) {
		got := get(dead)
		return got.State == tasks.Completed && got.Attempt == 3, fmt.Sprintf("%s attempt %d", got.State, got.Attempt)
	})

	// Cancel the running task, found by filtering on running.
	b.filter([]string{"running"}, nil)
	b.until("the running task listed", fmt.Sprintf(`document.querySelectorAll("#task-rows tr.row").length === 1 &&
		document.querySelector("#task-rows tr.row").dataset.task === "%d"`, running))
	b.do("opening the running task", chromedp.Click(chromedp.CSS(fmt.Sprintf(`#task-rows tr[data-task="%d"] td:nth-child(3)`, running))))
	b.until("the running task shown", fmt.Sprintf(`document.getElementById("task-detail").dataset.state === "running" && document.getElementById("task-detail").dataset.task === "%d"`, running))
	b.do("cancelling it", chromedp.Click(chromedp.ID("d-cancel")))
	if what := eval[string](b, "the confirmation", `document.getElementById("confirm-what").textContent`); !strings.Contains(what, "running on runner-1") {
		t.Errorf("the confirmation of a running task's cancel says %q", what)
	}
	b.confirm("1 task", "")
	b.until("the cancel request reported", `document.getElementById("tasks-msg").textContent.includes("its runner was asked to cancel it")`)
	testutil.Until(t, 15*time.Second, "the running task cancelled by its runner", func() (bool, string) {
		got := get(running)
		return got.State == tasks.Cancelled, string(got.State)
	})
	// The page reads a running task again until it settles.
	b.until("the page shows it cancelled", `document.getElementById("task-detail").dataset.state === "cancelled"`)

	// Retry by filter: the three dead tasks of one key.
	b.filter([]string{"dead"}, map[string]string{"key": "nightly-export"})
	b.until("the three dead tasks listed", `document.querySelectorAll("#task-rows tr.row").length === 3 && document.getElementById("match-count").dataset.count === "3"`)
	b.do("retrying them by filter", chromedp.Click(chromedp.ID("bulk-retry")))
	b.confirm("3 tasks", "")
	b.until("the bulk retry reported", `document.getElementById("tasks-msg").textContent === "Done: retried 3 tasks."`)
	if n := count("state=dead&key=nightly-export"); n.Count != 0 {
		t.Fatalf("%d tasks of the key still dead after the bulk retry", n.Count)
	}
	for _, id := range bulk {
		if got := get(id); got.State == tasks.Dead || got.Attempt != 2 {
			t.Errorf("task %d after the bulk retry: %s attempt %d", id, got.State, got.Attempt)
		}
	}

	// A bulk retry of 2,500 tasks: three requests, each continuing from
	// the last one's cursor.
	// A window of creation times, typed in local time (the browser's and
	// this process's): the ghost tasks are an hour old. Whole minutes,
	// typed without seconds: a datetime-local input drops ":00" seconds
	// from its value, and chromedp.SetValue fails when the value it reads
	// back differs from the one it set (one run in 60 failed so).
	half := time.Now().Add(-30 * time.Minute).Truncate(time.Minute)
	const minutes = "2006-01-02T15:04"
	b.filter([]string{"dead"}, map[string]string{"kind": "ghost", "created_since": half.Format(minutes)})
	b.until("no ghost task created in the last half hour", fmt.Sprintf(`document.getElementById("match-count").dataset.count === "0" &&
		location.hash.includes("created_since=%s")`, url.QueryEscape(half.UTC().Format("2006-01-02T15:04:05.000Z"))))
	b.filter([]string{"dead"}, map[string]string{"kind": "ghost", "created_before": half.Format(minutes)})
	b.until("the ghost tasks counted", `document.getElementById("match-count").dataset.count === "2500"`)
	// Keyset pages: Next follows the cursor, Previous comes back.
	first := eval[string](b, "the first page", `document.querySelector("#task-rows tr.row").dataset.task + " " + document.querySelector("#task-rows tr.row:last-child").dataset.task`)
	b.do("the next page", chromedp.Click(chromedp.ID("next")))
	b.until("the second page", fmt.Sprintf(`document.getElementById("pageno").textContent === "page 2" &&
		Number(document.querySelector("#task-rows tr.row").dataset.task) < %s`, strings.Fields(first)[1]))
	b.do("the previous page", chromedp.Click(chromedp.ID("prev")))
	b.until("the first page again", fmt.Sprintf(`document.getElementById("pageno").textContent === "page 1" &&
		document.querySelector("#task-rows tr.row").dataset.task === "%s"`, strings.Fields(first)[0]))
	b.do("retrying them by filter", chromedp.Click(chromedp.ID("bulk-retry")))
	b.confirm("2,500 tasks", "tasks-view-confirm.png")
	b.until("the bulk retry done", `document.getElementById("tasks-msg").textContent === "Done: retried 2,500 tasks."`)
	if got := eval[string](b, "requests sent", `document.getElementById("tasks-msg").dataset.requests`); got != "3" {
		t.Errorf("the bulk retry took %s requests, want 3 (done false twice)", got)
	}
	if n := count("kind=ghost&state=ready"); n.Count != 2500 || n.AtLeast {
		t.Fatalf("ready ghost tasks after the bulk retry: %+v", n)
	}

	// A bulk action the chosen states do not allow is refused before any
	// request.
	b.filter([]string{"completed"}, map[string]string{"kind": "noop"})
	b.until("the completed tasks listed", `document.getElementById("match-count").dataset.count === "12"`)
	b.do("cancelling completed tasks", chromedp.Click(chromedp.ID("bulk-cancel")))
	b.until("the refusal", `document.getElementById("tasks-msg").textContent.includes("remove completed from the state filter")`)
	if open := eval[bool](b, "the dialog", `document.getElementById("confirm").open`); open {
		t.Fatal("a confirmation opened for a bulk cancel of completed tasks")
	}

	// Hostile task data is text: no element, no script.
	b.filter(nil, map[string]string{"kind": hostileKind})
	b.until("the hostile task listed", fmt.Sprintf(`document.querySelectorAll("#task-rows tr.row").length === 1 &&
		document.querySelector("#task-rows tr.row td:nth-child(3)").textContent === %s`, jsonString(hostileKind)))
	b.do("opening it", chromedp.Click(chromedp.CSS(fmt.Sprintf(`#task-rows tr[data-task="%d"] a`, hostile))))
	b.until("the hostile task shown", `document.getElementById("d-payload").textContent.includes("<script>window.pwned=3</script>")`)
	if got := eval[string](b, "injected elements", `String(window.pwned) + " " + document.querySelectorAll("img, script:not([src]), #tasksview b").length`); got != "undefined 0" {
		t.Fatalf("task data became markup: pwned and elements %s", got)
	}

	// A token that stops working: the next answer, 401, brings the
	// sign-in back and takes the data away.
	b.do("back to the list", chromedp.Click(chromedp.ID("back")), chromedp.WaitVisible(chromedp.CSS("#task-rows tr.row")))
	b.do("the token replaced", chromedp.Evaluate[chromedp.Void](`sessionStorage.setItem("shardrun.apiToken", "revoked")`),
		chromedp.Click(chromedp.ID("refresh")), chromedp.WaitVisible(chromedp.ID("token")))
	if n := eval[int](b, "rows after a 401", `document.querySelectorAll("#task-rows tr").length + document.querySelectorAll("#d-fields tr").length`); n != 0 {
		t.Fatalf("%d rows of task data shown after a 401", n)
	}
	b.do("signing in again and out", chromedp.SendKeys(chromedp.ID("token"), token), chromedp.Click(chromedp.ID("signin-button")),
		chromedp.WaitVisible(chromedp.CSS("#task-rows tr.row")), chromedp.Click(chromedp.ID("signout")), chromedp.WaitVisible(chromedp.ID("token")))
	if got := eval[string](b, "the token after signing out", `String(sessionStorage.getItem("shardrun.apiToken")) + " " + document.querySelectorAll("#task-rows tr").length`); got != "null 0" {
		t.Fatalf("after signing out: token and rows %s", got)
	}

	// The cluster view links its tasks that need attention to the tasks view.
	b.do("the cluster view", chromedp.Click(chromedp.ID("nav-cluster")), chromedp.WaitVisible(chromedp.CSS("#groups .grid")))
	if err := chromedp.Cancel(bctx); err != nil {
		t.Errorf("closing the browser: %v", err)
	}
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// exec runs a statement on the test's database.
func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.store.Pool().Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

// The status page's files are served by the coordinator itself, without a
// token (they hold no task data), under a Content-Security-Policy that
// allows scripts from the coordinator's own files only; no file loads
// anything from elsewhere, and no script writes markup.
func TestStatusPageFiles(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c, err := New(Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: e.store, APIToken: "tok"})
	if err != nil {
		t.Fatal(err)
	}
	h := c.Handler()
	for path, ctype := range map[string]string{"/": "text/html", "/status.js": "text/javascript", "/tasks.js": "text/javascript"} {
		w := serveOnce(h, "GET", path, "")
		body := w.Body.String()
		if w.Code != 200 || !strings.HasPrefix(w.Header().Get("Content-Type"), ctype) || len(body) < 1000 {
			t.Fatalf("GET %s: %d %s, %d bytes", path, w.Code, w.Header().Get("Content-Type"), len(body))
		}
		if csp := w.Header().Get("Content-Security-Policy"); !strings.Contains(csp, "script-src 'self';") || !strings.Contains(csp, "connect-src 'self'") {
			t.Errorf("GET %s: Content-Security-Policy %q", path, csp)
		}
		for _, bad := range []string{"http://", "https://", "innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("} {
			if strings.Contains(body, bad) {
				t.Errorf("%s holds %q", path, bad)
			}
		}
	}
	page := serveOnce(h, "GET", "/", "").Body.String()
	if strings.Count(page, "<script") != 2 || !strings.Contains(page, `<script src="/status.js"></script>`) || !strings.Contains(page, `<script src="/tasks.js"></script>`) {
		t.Errorf("the page's scripts are not exactly its two files")
	}
}
