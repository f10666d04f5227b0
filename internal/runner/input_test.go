package runner

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

func TestDecodeDetach(t *testing.T) {
	t.Parallel()
	for body, want := range map[string]string{
		"":                                 "",
		"  \n":                             "",
		`{}`:                               "",
		`{"reason": "maintenance"}`:        "maintenance",
		`{"reason": "naïve \ud83d\ude00"}`: "naïve 😀",
	} {
		if d, err := decodeDetach([]byte(body)); err != nil || d.Reason != want {
			t.Errorf("%q: %q %v, want %q", body, d.Reason, err, want)
		}
	}
	for _, body := range []string{
		`{"reason": "x"}}`, `{"reason": "x"} {}`, `{"REASON": "x"}`, `{"reason": "x", "reason": "y"}`,
		`{"why": "x"}`, `{"reason": "a\u0000b"}`, `{"reason": "line\nforged line"}`, `{"reason": "\ud800"}`,
		"{\"reason\": \"\xff\"}", `{"reason": "` + strings.Repeat("x", MaxDetachReason+1) + `"}`, `null`, `"x"`, `[]`,
		// Given, a reason is not empty or null (issue 34).
		`{"reason": ""}`, `{"reason": null}`,
	} {
		if _, err := decodeDetach([]byte(body)); !clientError(err) {
			t.Errorf("%q: %v, want a client error", body, err)
		}
	}
	if err := decodeAttach([]byte(`{}`)); err != nil {
		t.Errorf("attach {}: %v", err)
	}
	if err := decodeAttach([]byte(`{"force": true}`)); !clientError(err) {
		t.Errorf("attach with a field: %v", err)
	}
}

// clientError: what the admin endpoint answers with 400.
func clientError(err error) bool {
	var je *jsonbody.Error
	var fe *tasks.FieldError
	return errors.As(err, &je) || errors.As(err, &fe)
}

func TestBuiltinPayloads(t *testing.T) {
	t.Parallel()
	for payload, want := range map[string]time.Duration{
		``: 0, `{}`: 0, `{"ms": 0}`: 0, `{"ms": 250}`: 250 * time.Millisecond, `{"ms": 86400000}`: 24 * time.Hour,
	} {
		if d, _, err := decodeSleep(json.RawMessage(payload)); err != nil || d != want {
			t.Errorf("sleep %s: %s %v, want %s", payload, d, err, want)
		}
	}
	for _, payload := range []string{
		`{"ms": 9223372036854775807}`, `{"ms": 86400001}`, `{"ms": -1}`, `{"MS": 5}`, `{"ms": 5, "extra": 1}`,
		`{"ms": 1.5}`, `{"ms": "5"}`, `{"ms": 5}}`, `[]`, `{"ms": 99999999999999999999}`,
	} {
		if _, _, err := decodeSleep(json.RawMessage(payload)); !errors.Is(err, tasks.ErrPayload) {
			t.Errorf("sleep %s: %v, want an error wrapping tasks.ErrPayload", payload, err)
		}
	}
	for _, payload := range []string{`{"times": -1}`, `{"times": 1001}`, `{"Times": 1}`, `{"times": 1, "times": 2}`} {
		if _, err := decodeFail(json.RawMessage(payload)); !errors.Is(err, tasks.ErrPayload) {
			t.Errorf("fail %s: %v, want an error wrapping tasks.ErrPayload", payload, err)
		}
	}
	// The overflowing sleep of the issue returns at once with the error.
	sleep := Builtins(hclog.NewNullLogger())["sleep"]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := sleep(ctx, &tasks.Task{ID: 7, Payload: json.RawMessage(`{"ms": 9223372036854775807}`)}); !errors.Is(err, tasks.ErrPayload) ||
		!strings.Contains(err.Error(), "sleep task 7") || ctx.Err() != nil {
		t.Fatalf("huge sleep: %v", err)
	}
}

func FuzzAdminBody(f *testing.F) {
	for _, s := range []string{``, `{}`, `{"reason": "maintenance"}`, `{"reason": "x"}}`, `{"REASON": "x"}`,
		`{"reason": "a", "reason": "b"}`, `{"reason": "\u0000"}`, `{"reason": "\ud800"}`, `{"force": true}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		d, err := decodeDetach(body)
		if err != nil && !clientError(err) {
			t.Fatalf("detach %q: %v is not a client error", body, err)
		}
		if err == nil && (len(d.Reason) > MaxDetachReason || strings.ContainsRune(d.Reason, 0)) {
			t.Fatalf("detach %q: accepted reason %q", body, d.Reason)
		}
		if err := decodeAttach(body); err != nil && !clientError(err) {
			t.Fatalf("attach %q: %v is not a client error", body, err)
		}
	})
}

// FuzzBuiltinPayload runs every built-in handler on the fuzzer's payload:
// it returns nil or an error, never panics or sleeps past the bound, and a
// payload it cannot use is an error wrapping tasks.ErrPayload.
func FuzzBuiltinPayload(f *testing.F) {
	for _, s := range []string{`{}`, `{"ms": 5}`, `{"times": 2}`, `{"ms": 9223372036854775807}`, `{"ms": -1}`,
		`{"times": -1}`, `{"MS": 1}`, `{"ms": 1e3}`, `null`, `[1]`, `{"ms": 1, "ms": 2}`} {
		f.Add([]byte(s), uint8(1))
	}
	f.Fuzz(func(t *testing.T, payload []byte, attempt uint8) {
		if d, _, err := decodeSleep(payload); err != nil && !errors.Is(err, tasks.ErrPayload) {
			t.Fatalf("sleep %q: %v does not wrap ErrPayload", payload, err)
		} else if err == nil && (d < 0 || d > MaxSleepMS*time.Millisecond) {
			t.Fatalf("sleep %q: %s out of bounds", payload, d)
		}
		if n, err := decodeFail(payload); err != nil && !errors.Is(err, tasks.ErrPayload) {
			t.Fatalf("fail %q: %v does not wrap ErrPayload", payload, err)
		} else if err == nil && (n < 0 || n > MaxFailTimes) {
			t.Fatalf("fail %q: times %d out of bounds", payload, n)
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel() // a sleep that would run returns at once
		for kind, h := range Builtins(hclog.NewNullLogger()) {
			_ = h(ctx, &tasks.Task{ID: 1, Kind: kind, Attempt: int(attempt), Payload: payload})
		}
	})
}

// A handler's error with bytes PostgreSQL refuses (NUL, invalid UTF-8) is
// recorded, cleaned, and the outcome writer goes on: before, it retried the
// refused write forever and held back every other outcome of its batch.
func TestHandlerErrorPostgreSQLWouldRefuse(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start("a", withHandler("nul", func(context.Context, *tasks.Task) error { return errors.New("bad\x00news\xff") }))
	id := e.enqueue("nul", `{}`, 1)[0]
	ok := e.enqueue("noop", `{}`, 1)[0]
	testutil.Until(t, 10*time.Second, "the failure recorded and the other task completed", func() (bool, string) {
		tk := e.task(id)
		return len(tk.Errors) > 0 && e.task(ok).State == tasks.Completed, string(tk.State)
	})
	if got := e.task(id).Errors[0].Error; got != `bad\x00news`+"\uFFFD" {
		t.Fatalf("stored error %q", got)
	}
}
