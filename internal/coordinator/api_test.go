package coordinator

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// serveOnce runs one request through the coordinator's handler.
func serveOnce(h http.Handler, method, path, body string) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(method, path, strings.NewReader(body)))
	return w
}

// A database that is down is a 503 with Retry-After that does not echo the
// driver's error; a value the database refuses is a 400; a bug is a 500.
func TestStoreErrorsAreClassified(t *testing.T) {
	e := newEnv(t)
	down, err := store.Open(context.Background(), e.dsn, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	down.Close()
	c, err := New(Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: down})
	if err != nil {
		t.Fatal(err)
	}
	h := c.Handler()
	for _, path := range []string{"/api/tasks", "/api/tasks/1"} {
		method, body := "POST", `{"kind": "noop"}`
		if path != "/api/tasks" {
			method, body = "GET", ""
		}
		w := serveOnce(h, method, path, body)
		if w.Code != 503 || w.Header().Get("Retry-After") == "" || strings.Contains(w.Body.String(), "pool") {
			t.Errorf("%s %s with the database down: %d %q %s", method, path, w.Code, w.Header().Get("Retry-After"), w.Body)
		}
	}
	w := serveOnce(h, "POST", "/api/tasks", `[{"kind": "noop"}, {"kind": "noop"}]`)
	if w.Code != 503 || w.Header().Get("Retry-After") == "" {
		t.Errorf("batch with the database down: %d %s", w.Code, w.Body)
	}

	for _, tc := range []struct {
		err  error
		code int
		want string
	}{
		{&pgconn.PgError{Code: "22021", Message: `invalid byte sequence for encoding "UTF8": 0x00`, ColumnName: "kind"}, 400, `"field":"kind"`},
		{&pgconn.PgError{Code: "23505", Message: "duplicate key value violates unique constraint"}, 409, "23505"},
		{&pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}, 503, "retry later"},
		{&pgconn.PgError{Code: "42P01", Message: `relation "tasks" does not exist`}, 500, "internal error"},
	} {
		w := httptest.NewRecorder()
		c.storeError(w, httptest.NewRequest("GET", "/", nil), "testing", tc.err)
		if w.Code != tc.code || !strings.Contains(w.Body.String(), tc.want) || strings.Contains(w.Body.String(), tc.err.(*pgconn.PgError).Message) {
			t.Errorf("%v: %d %s, want %d with %q and without the server's message", tc.err, w.Code, w.Body, tc.code, tc.want)
		}
	}
}

// fuzzEnqueue runs the fuzzer's bodies through POST /api/tasks against a
// real database: every answer is 201 or a 4xx with a JSON error, never a
// 5xx, and what was accepted is stored byte for byte, on the shard its key
// hashes to.
func fuzzEnqueue(f *testing.F, seeds []string) {
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	st, _ := pgtest.NewStore(f, store.Options{})
	_, client := testutil.Etcd(f)
	c, err := New(Config{ID: "fuzz", Client: client, Prefix: prefix, ShardCount: 16, Store: st})
	if err != nil {
		f.Fatal(err)
	}
	h := c.Handler()
	f.Fuzz(func(t *testing.T, body []byte) {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("POST", "/api/tasks", bytes.NewReader(body)))
		var answer struct {
			Error    string
			ID       int64
			Enqueued int
		}
		if err := json.Unmarshal(w.Body.Bytes(), &answer); err != nil {
			t.Fatalf("%q: answer is not JSON: %d %s", body, w.Code, w.Body)
		}
		switch {
		case w.Code >= 400 && w.Code < 500:
			if answer.Error == "" {
				t.Fatalf("%q: %d without an error message", body, w.Code)
			}
			return
		case w.Code != 201:
			t.Fatalf("%q: %d %s, want 201 or a 4xx", body, w.Code, w.Body)
		}
		ns, batch, err := tasks.DecodeTasks(body)
		if answer.Enqueued > 0 {
			if err != nil || !batch || len(ns) != answer.Enqueued {
				t.Fatalf("%q: enqueued %d, decoded %d (%v)", body, answer.Enqueued, len(ns), err)
			}
			return
		}
		if err != nil || batch {
			t.Fatalf("%q accepted, but it does not decode strictly as one task: %v", body, err)
		}
		req := ns[0]
		got, err := st.Get(context.Background(), answer.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.Kind != req.Kind || (req.Key != "" && got.Key != req.Key) || got.Shard != tasks.ShardOf(got.Key, 16) {
			t.Fatalf("%q stored as kind %q key %q shard %d", body, got.Kind, got.Key, got.Shard)
		}
	})
}

func FuzzEnqueueOne(f *testing.F) {
	fuzzEnqueue(f, []string{
		`{"kind": "noop"}`, `{"kind": "sleep", "key": "user-42", "payload": {"ms": 5}, "max_attempts": 3}`,
		`{"kind": "k", "run_after": "2030-01-01T00:00:00Z", "deadline": "2031-01-01T00:00:00+02:00"}`,
		`{"kind":"noop"}}`, `{"KIND": "noop"}`, `{"kind": "a", "kind": "b"}`, `{"kind": "a\u0000"}`,
		`{"kind": "k", "payload": {"s": "\ud800"}}`, `{"kind": "k", "max_attempts": 2147483648}`,
		`{"kind": "k", "deadline": "0001-01-01T00:00:00Z"}`, "{\"kind\": \"caf\xe9\"}", `{"kind": "k", "payload": 1e131072}`,
	})
}

func FuzzEnqueueBatch(f *testing.F) {
	fuzzEnqueue(f, []string{
		`[{"kind": "noop"}, {"kind": "fail", "payload": {"times": 1}, "key": "naïve"}]`,
		`[{"kind":"noop"}]]`, `[]`, `[{"kind": "a"}, {"kind": ""}]`, `[{"kind": "a", "payload": {"x": 1, "x": 2}}]`,
		`[{"kind": "a", "key": "\u0000"}]`, `[null]`, `[{"kind": "a"}, 1]`,
	})
}

// Unknown routes and methods answer like every other error: JSON
// {"error": …}, 404 and 405 (with Allow).
func TestUnknownRoutesAndMethodsAnswerJSON(t *testing.T) {
	e := newEnv(t)
	c, err := New(Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	h := c.Handler()
	for _, tc := range []struct {
		method, path string
		code         int
		allow        string
	}{
		{"GET", "/nope", 404, ""},
		{"GET", "/api/tasks/1/nope", 404, ""},
		{"DELETE", "/api/tasks", 405, "GET, HEAD, POST"},
		{"PUT", "/api/schedules", 405, "GET, HEAD, POST"},
		{"POST", "/api/tasks/1", 405, "GET, HEAD"},
		{"GET", "/api/schedules/x", 405, "DELETE, PUT"},
	} {
		w := serveOnce(h, tc.method, tc.path, "")
		var body map[string]string
		jerr := json.Unmarshal(w.Body.Bytes(), &body)
		if w.Code != tc.code || w.Header().Get("Allow") != tc.allow || jerr != nil || body["error"] == "" ||
			w.Header().Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %d Allow %q %q %s, want %d Allow %q with a JSON error", tc.method, tc.path, w.Code,
				w.Header().Get("Allow"), w.Header().Get("Content-Type"), w.Body, tc.code, tc.allow)
		}
	}
}

// A conflict the database reports (a unique constraint) on a task
// operation answers 409 with the task's state, as the operations' own 409
// does.
func TestGenericConflictCarriesTheState(t *testing.T) {
	e := newEnv(t)
	c, err := New(Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	id, err := e.store.Enqueue(ctx, store.Insert{NewTask: tasks.NewTask{Kind: "k", Payload: []byte("{}"), Options: tasks.Options{Key: "k", MaxAttempts: 1}.WithDefaults(0)}})
	if err != nil {
		t.Fatal(err)
	}
	w := httptest.NewRecorder()
	c.taskError(w, httptest.NewRequest("POST", "/", nil), "retrying a task", id,
		&pgconn.PgError{Code: "23505", Message: "duplicate key value violates unique constraint"})
	var got apiError
	if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil || w.Code != 409 || got.State != tasks.Ready {
		t.Fatalf("generic conflict on task %d: %d %s, want 409 with state ready", id, w.Code, w.Body)
	}
}

// A field of an enqueue body that is given must be valid: given empty,
// zero or null it is refused naming the field, alone and in a batch (with
// the index), never read as left out. Issue 34: "queue": "" answered 201
// and stored the task in the default queue.
func TestGivenEmptyFieldsAreRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c, err := New(Config{ID: "c", Client: e.admin, Prefix: prefix, ShardCount: 16, Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	h := c.Handler()
	for _, tc := range []struct{ field, value string }{
		{"queue", `""`}, {"key", `""`}, {"unique_key", `""`}, {"sequence_key", `""`},
		{"priority", `0`}, {"max_attempts", `0`},
		{"run_after", `"0001-01-01T00:00:00Z"`}, {"deadline", `"0001-01-01T00:00:00Z"`},
		{"kind", `null`}, {"queue", `null`}, {"key", `null`}, {"unique_key", `null`}, {"sequence_key", `null`},
		{"priority", `null`}, {"max_attempts", `null`}, {"run_after", `null`}, {"deadline", `null`},
		{"sequence_continue", `null`},
	} {
		task := fmt.Sprintf(`{"kind": "noop", "%s": %s}`, tc.field, tc.value)
		if tc.field == "kind" {
			task = `{"kind": null}`
		}
		w := serveOnce(h, "POST", "/api/tasks", task)
		got := decode[apiError](t, w.Body.String())
		if w.Code != 400 || got.Field != tc.field {
			t.Errorf("%s: %d %s, want 400 naming %s", task, w.Code, w.Body, tc.field)
		}
		w = serveOnce(h, "POST", "/api/tasks", `[{"kind": "noop"}, `+task+`]`)
		got = decode[apiError](t, w.Body.String())
		if w.Code != 400 || got.Field != tc.field || got.Index == nil || *got.Index != 1 {
			t.Errorf("a batch with %s: %d %s, want 400 naming %s at index 1", task, w.Code, w.Body, tc.field)
		}
	}
	for _, header := range [][]string{{""}, {"a", "b"}, {"a", ""}} {
		r := httptest.NewRequest("POST", "/api/tasks", strings.NewReader(`{"kind": "noop"}`))
		r.Header["Idempotency-Key"] = header
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if got := decode[apiError](t, w.Body.String()); w.Code != 400 || got.Field != "unique_key" {
			t.Errorf("Idempotency-Key %q: %d %s, want 400 naming unique_key", header, w.Code, w.Body)
		}
	}
	if counts, _ := e.store.CountByState(context.Background()); counts[tasks.Ready] != 0 {
		t.Fatalf("refused requests enqueued something: %v", counts)
	}
	// Given with a value, each is taken; a null payload is a JSON value.
	w := serveOnce(h, "POST", "/api/tasks", `{"kind": "noop", "queue": "q", "key": "k", "unique_key": "u", "sequence_key": "s",
		"sequence_continue": true, "priority": 1, "max_attempts": 1, "payload": null}`)
	if w.Code != 201 {
		t.Fatalf("a task with every field: %d %s", w.Code, w.Body)
	}
	got, err := e.store.Get(context.Background(), decode[struct{ ID int64 }](t, w.Body.String()).ID)
	if err != nil || got.Queue != "q" || got.Key != "k" || got.UniqueKey != "u" || got.SequenceKey != "s" || got.Priority != 1 ||
		got.MaxAttempts != 1 || string(got.Payload) != "null" {
		t.Fatalf("stored %+v %v", got, err)
	}
}
