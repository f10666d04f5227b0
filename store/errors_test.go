package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestClassifyBySQLState(t *testing.T) {
	for code, want := range map[string]error{
		"08006": store.ErrUnavailable, "08001": store.ErrUnavailable, "57P01": store.ErrUnavailable,
		"57P03": store.ErrUnavailable, "57014": store.ErrUnavailable, "40001": store.ErrUnavailable,
		"40P01": store.ErrUnavailable, "53300": store.ErrUnavailable, "25006": store.ErrUnavailable,
		"28P01": store.ErrUnavailable, "3D000": store.ErrUnavailable, "58030": store.ErrUnavailable,
		"22021": store.ErrInvalidInput, "22P05": store.ErrInvalidInput, "22003": store.ErrInvalidInput,
		"23514": store.ErrInvalidInput, "23502": store.ErrInvalidInput, "54001": store.ErrInvalidInput,
		"23505": store.ErrConflict,
		"42P01": store.ErrInternal, "42601": store.ErrInternal, "XX000": store.ErrInternal,
	} {
		err := store.Classify(fmt.Errorf("doing it: %w", &pgconn.PgError{Code: code, Message: "m"}))
		var se *store.Error
		if !errors.Is(err, want) || !errors.As(err, &se) || se.Code != code {
			t.Errorf("SQLSTATE %s: %v, want %v", code, err, want)
		}
	}
	if store.Classify(nil) != nil || store.Classify(store.ErrNotFound) != store.ErrNotFound {
		t.Error("nil and not-found must pass unchanged")
	}
	if err := store.Classify(context.DeadlineExceeded); !errors.Is(err, store.ErrUnavailable) {
		t.Errorf("timeout: %v", err)
	}
	if err := store.Classify(errors.New("something odd")); !errors.Is(err, store.ErrInternal) {
		t.Errorf("unknown error: %v", err)
	}
	twice := store.Classify(store.Classify(&pgconn.PgError{Code: "22021"}))
	if !errors.Is(twice, store.ErrInvalidInput) || errors.Is(twice, store.ErrInternal) {
		t.Errorf("classifying twice: %v", twice)
	}
}

// What PostgreSQL itself refuses, sent past the task vocabulary's checks,
// is invalid input, and a database that is gone is unavailable.
func TestClassifyRealErrors(t *testing.T) {
	ctx := context.Background()
	st, dsn := pgtest.NewStore(t, store.Options{})
	bad := func(mut func(*store.Insert)) store.Insert {
		in := store.Insert{NewTask: tasks.NewTask{Kind: "k", Payload: json.RawMessage(`{}`), Options: tasks.Options{Key: "key", MaxAttempts: 1}.WithDefaults(0)}}
		mut(&in)
		return in
	}
	for name, in := range map[string]store.Insert{
		"NUL in kind":          bad(func(in *store.Insert) { in.Kind = "a\x00b" }),
		"invalid UTF-8 in key": bad(func(in *store.Insert) { in.Key = "a\xffb" }),
		"\\u0000 in payload":   bad(func(in *store.Insert) { in.Payload = json.RawMessage(`{"a": "\u0000"}`) }),
		"lone surrogate":       bad(func(in *store.Insert) { in.Payload = json.RawMessage(`{"a": "\ud800"}`) }),
		"numeric overflow":     bad(func(in *store.Insert) { in.Payload = json.RawMessage(`{"a": 1e200000}`) }),
		"empty kind":           bad(func(in *store.Insert) { in.Kind = "" }),
	} {
		_, err := st.Enqueue(ctx, in)
		if err = store.Classify(err); !errors.Is(err, store.ErrInvalidInput) {
			t.Errorf("%s, one: %v, want invalid input", name, err)
		}
		_, err = st.EnqueueBatch(ctx, []store.Insert{bad(func(*store.Insert) {}), in})
		if err = store.Classify(err); !errors.Is(err, store.ErrInvalidInput) {
			t.Errorf("%s, batch: %v, want invalid input", name, err)
		}
	}

	closed, err := store.Open(ctx, dsn, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	if _, err := closed.Get(ctx, 1); !errors.Is(store.Classify(err), store.ErrUnavailable) {
		t.Errorf("closed pool: %v", store.Classify(err))
	}
	past, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	if _, err := st.Get(past, 1); !errors.Is(store.Classify(err), store.ErrUnavailable) {
		t.Errorf("deadline passed: %v", store.Classify(err))
	}
	// A server that ends our sessions (a restart, a failover).
	victim, err := store.Open(ctx, dsn, store.Options{ApplicationName: "victim"})
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()
	if _, err := victim.Get(ctx, 1); !errors.Is(err, store.ErrNotFound) {
		t.Fatal(err)
	}
	if _, err := st.Pool().Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'victim'`); err != nil {
		t.Fatal(err)
	}
	if _, err := victim.Get(ctx, 1); !errors.Is(store.Classify(err), store.ErrUnavailable) {
		t.Errorf("terminated session: %v", store.Classify(err))
	}
	if _, err := store.Open(ctx, "postgres://nobody@127.0.0.1:1/none?connect_timeout=1", store.Options{}); !errors.Is(store.Classify(err), store.ErrUnavailable) {
		t.Errorf("nothing listening: %v", store.Classify(err))
	}
}

func TestOptionsAndDSNChecks(t *testing.T) {
	for n, ok := range map[int]bool{0: false, 1: false, 2: true, 8: true, 1000: true, 1001: false, 1 << 32: false} {
		if err := (store.Options{MaxConns: n}).Validate(); (err == nil) != ok || (err != nil && !strings.Contains(err.Error(), "--db-max-conns")) {
			t.Errorf("MaxConns %d: %v", n, err)
		}
	}
	for _, dsn := range []string{
		"postgres://u:hunter2@h:nope/db", "postgres://u:hunter2@h/db?sslmode=bogus", "host=h password=hunter2 port=nope",
		"host=h password='hunter2' sslmode=bogus", "postgres://u:hun%74er2@h:nope/db", "postgres://u:hunter2@@h:x/db",
		"postgres://h:x/db?password=hunter2", "postgresql://u:hunter2@[::1:5432/db",
	} {
		err := store.CheckDSN(dsn)
		if err == nil || strings.Contains(err.Error(), "hunter2") || strings.Contains(err.Error(), "hunt") {
			t.Errorf("%q: %v", dsn, err)
		}
		if _, err := store.Open(context.Background(), dsn, store.Options{}); err == nil || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("Open(%q): %v", dsn, err)
		}
	}
	if !store.HasPassword("postgres://u:pw@h/db") || store.HasPassword("postgres://u@h/db") || !store.HasPassword("host=h password=x") {
		t.Error("HasPassword")
	}
}

// A handler's error that PostgreSQL could not store as it is (NUL, invalid
// UTF-8) is recorded cleaned, rather than refused and retried forever.
func TestFailureMessagesAreStorable(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	id := enqueue(t, s, insert("k", 3, 2))
	raise(t, s, "r1", 3, 10)
	task := claim(t, s, "r1", 3, 10, 1)[0]
	res := one(t)(s.Fail(ctx, "r1", []claims.Failure{{Ref: claims.RefOf(task), Error: "bad\x00news\xff" + strings.Repeat("x", store.MaxMessage)}}))
	if res.Outcome != claims.Applied {
		t.Fatalf("failure not recorded: %+v", res)
	}
	got := get(t, s, id).Errors[0].Error
	if !strings.HasPrefix(got, `bad\x00news`+"\uFFFD") || !strings.HasSuffix(got, "…(truncated)") || len(got) > store.MaxMessage+100 {
		t.Fatalf("stored error %q…", got[:40])
	}
	if store.StorableText("fine ✓") != "fine ✓" {
		t.Fatal("a clean message must stay as it is")
	}
}
