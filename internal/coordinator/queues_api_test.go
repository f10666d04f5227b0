package coordinator

import (
	"strings"
	"testing"

	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
)

// An operator removes a queue that has no unfinished task: the listing says
// which queues are idle (and lists only them, or only the others, on
// request); a queue with work is refused with its counts, one that does not
// exist is not found, the default queue is refused; all behind the token.
func TestQueueRemovalAPI(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.start("coord", nil, func(c *Config) { c.APIToken = "tok" })
	base := "http://" + c.Addr()
	for _, body := range []string{`{"kind": "mail", "queue": "busy"}`, `{"kind": "mail", "queue": "done"}`} {
		if code, body := testutil.HTTP(t, "POST", base+"/api/tasks", "tok", body); code != 201 {
			t.Fatalf("enqueue: %d %s", code, body)
		}
	}
	if code, body := testutil.HTTP(t, "POST", base+"/api/tasks/cancel?queue=done", "tok", ""); code != 200 {
		t.Fatalf("cancelling the task of queue done: %d %s", code, body)
	}
	if code, body := testutil.HTTP(t, "POST", base+"/api/queues/ahead/pause", "tok", ""); code != 200 {
		t.Fatalf("pausing a queue ahead: %d %s", code, body)
	}
	list := func(query string) map[string]store.QueueStats {
		t.Helper()
		code, body := testutil.HTTP(t, "GET", base+"/api/queues"+query, "tok", "")
		if code != 200 {
			t.Fatalf("GET /api/queues%s: %d %s", query, code, body)
		}
		out := map[string]store.QueueStats{}
		for _, q := range decode[QueuePage](t, body).Queues {
			out[q.Name] = q
		}
		return out
	}
	all := list("")
	if len(all) != 4 || all["busy"].Idle || !all["done"].Idle || !all["ahead"].Idle || !all["default"].Idle {
		t.Fatalf("queues %+v: want busy with work, done, ahead and default idle", all)
	}
	if idle := list("?idle=true"); len(idle) != 3 || idle["busy"].Name != "" {
		t.Errorf("idle=true listed %+v", idle)
	}
	if busy := list("?idle=false"); len(busy) != 1 || busy["busy"].Name != "busy" {
		t.Errorf("idle=false listed %+v", busy)
	}
	for _, q := range []string{"?idle=yes", "?idle=1", "?idle=true&idle=true", "?idle=", "?after=x"} {
		if code, body := testutil.HTTP(t, "GET", base+"/api/queues"+q, "tok", ""); code != 400 {
			t.Errorf("GET /api/queues%s: %d %s, want 400", q, code, body)
		}
	}

	code, body := testutil.HTTP(t, "DELETE", base+"/api/queues/busy", "tok", "")
	if got := decode[QueueConflict](t, body); code != 409 || got.Ready != 1 || got.Running != 0 || !strings.Contains(got.Error, "busy") {
		t.Errorf("removing a queue with a ready task: %d %s, want 409 with its counts", code, body)
	}
	code, body = testutil.HTTP(t, "DELETE", base+"/api/queues/done", "tok", "")
	removed := decode[struct{ Removed store.RemovedQueue }](t, body).Removed
	if code != 200 || removed.Name != "done" || removed.CreatedAt.IsZero() || removed.PausedAt != nil {
		t.Errorf("removing an idle queue: %d %s", code, body)
	}
	code, body = testutil.HTTP(t, "DELETE", base+"/api/queues/ahead", "tok", "")
	if removed := decode[struct{ Removed store.RemovedQueue }](t, body).Removed; code != 200 || removed.PausedAt == nil {
		t.Errorf("removing a queue paused ahead: %d %s, want 200 with its pause", code, body)
	}
	for path, want := range map[string]int{"/api/queues/done": 404, "/api/queues/never": 404, "/api/queues/default": 400,
		"/api/queues/a%00b": 400, "/api/queues/done?force=1": 400} {
		if code, body := testutil.HTTP(t, "DELETE", base+path, "tok", ""); code != want {
			t.Errorf("DELETE %s: %d %s, want %d", path, code, body, want)
		} else if path == "/api/queues/default" && !strings.Contains(body, "default") {
			t.Errorf("removing the default queue: %s, want the refusal to name it", body)
		}
	}
	// Resuming a queue that does not exist gives it no row.
	if code, body := testutil.HTTP(t, "POST", base+"/api/queues/never/resume", "tok", ""); code != 200 {
		t.Errorf("resuming a queue that does not exist: %d %s", code, body)
	}
	if all := list(""); len(all) != 2 || all["busy"].Name == "" || all["default"].Name == "" {
		t.Errorf("queues after the removals: %+v, want busy and default", all)
	}
	for _, token := range []string{"", "wrong"} {
		if code, body := testutil.HTTP(t, "DELETE", base+"/api/queues/busy", token, ""); code != 401 {
			t.Errorf("DELETE /api/queues/busy with token %q: %d %s, want 401", token, code, body)
		}
	}
}
