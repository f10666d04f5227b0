package tasks

import (
	"encoding/json"
	"errors"
	"hash/fnv"
	"strings"
	"testing"
	"time"
)

func TestStates(t *testing.T) {
	for _, st := range States {
		final := st == Completed || st == Failed || st == Dead || st == Cancelled
		if st.Terminal() != final || st.Retryable() != (final && st != Completed) || st.Cancellable() != !final {
			t.Errorf("%s: Terminal %v, Retryable %v, Cancellable %v", st, st.Terminal(), st.Retryable(), st.Cancellable())
		}
	}
	if State("paused").Valid() || !Ready.Valid() {
		t.Error("Valid")
	}
}

// The vectors in docs/tasks.md; computed independently (Python), so a change
// to ShardOf that breaks other producers fails here.
func TestShardOfVectors(t *testing.T) {
	for _, v := range []struct {
		key                string
		s256, s4096, seven int
	}{
		{"", 37, 805, 2},
		{"a", 140, 3212, 5},
		{"user-42", 203, 2763, 2},
		{"order/2026/0001", 188, 3772, 0},
		{"naïve", 171, 683, 0},
	} {
		if got := ShardOf(v.key, 256); got != v.s256 {
			t.Errorf("ShardOf(%q, 256) = %d, want %d", v.key, got, v.s256)
		}
		if got := ShardOf(v.key, 4096); got != v.s4096 {
			t.Errorf("ShardOf(%q, 4096) = %d, want %d", v.key, got, v.s4096)
		}
		if got := ShardOf(v.key, 7); got != v.seven {
			t.Errorf("ShardOf(%q, 7) = %d, want %d", v.key, got, v.seven)
		}
		h := fnv.New64a()
		h.Write([]byte(v.key))
		if got, want := ShardOf(v.key, 1000003), int(h.Sum64()%1000003); got != want {
			t.Errorf("ShardOf(%q) disagrees with hash/fnv: %d vs %d", v.key, got, want)
		}
	}
}

func TestCheckRejectsBadInputNamingTheField(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name  string
		task  NewTask
		field string
	}{
		{"empty kind", NewTask{}, "kind"},
		{"long kind", NewTask{Kind: strings.Repeat("k", 201)}, "kind"},
		{"payload not JSON", NewTask{Kind: "k", Payload: json.RawMessage(`{nope`)}, "payload"},
		{"max attempts below one", NewTask{Kind: "k", Options: Options{MaxAttempts: -1}}, "max_attempts"},
		{"deadline in the past", NewTask{Kind: "k", Options: Options{Deadline: now.Add(-time.Second)}}, "deadline"},
		{"deadline before run_after", NewTask{Kind: "k", Options: Options{RunAfter: now.Add(time.Hour), Deadline: now.Add(time.Minute)}}, "deadline"},
		{"long key", NewTask{Kind: "k", Options: Options{Key: strings.Repeat("x", 1025)}}, "key"},
		{"NUL in kind", NewTask{Kind: "a\x00b"}, "kind"},
		{"NUL in key", NewTask{Kind: "k", Options: Options{Key: "a\x00b"}}, "key"},
		{"invalid UTF-8 in kind", NewTask{Kind: "a\xffb"}, "kind"},
		{"invalid UTF-8 in key", NewTask{Kind: "k", Options: Options{Key: "caf\xe9"}}, "key"},
		{"control character in kind", NewTask{Kind: "a\nb"}, "kind"},
		{"\\u0000 in payload", NewTask{Kind: "k", Payload: json.RawMessage(`{"a": "x\u0000"}`)}, "payload"},
		{"lone surrogate in payload", NewTask{Kind: "k", Payload: json.RawMessage(`{"a": "\ud800"}`)}, "payload"},
		{"invalid UTF-8 in payload", NewTask{Kind: "k", Payload: json.RawMessage("{\"a\": \"\xff\"}")}, "payload"},
		{"duplicate key in payload", NewTask{Kind: "k", Payload: json.RawMessage(`{"a": 1, "a": 2}`)}, "payload"},
		{"number beyond numeric", NewTask{Kind: "k", Payload: json.RawMessage(`{"a": 1e131072}`)}, "payload"},
		{"trailing data in payload", NewTask{Kind: "k", Payload: json.RawMessage(`{} {}`)}, "payload"},
		{"max attempts beyond int4", NewTask{Kind: "k", Options: Options{MaxAttempts: 1 << 31}}, "max_attempts"},
		{"max attempts beyond the limit", NewTask{Kind: "k", Options: Options{MaxAttempts: MaxAttemptsLimit + 1}}, "max_attempts"},
		{"run_after in year 10000", NewTask{Kind: "k", Options: Options{RunAfter: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}}, "run_after"},
		{"deadline in year 300000", NewTask{Kind: "k", Options: Options{Deadline: time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)}}, "deadline"},
		{"long unique key", NewTask{Kind: "k", Options: Options{UniqueKey: strings.Repeat("x", 1025)}}, "unique_key"},
		{"NUL in unique key", NewTask{Kind: "k", Options: Options{UniqueKey: "a\x00b"}}, "unique_key"},
	} {
		err := tc.task.Check(now)
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != tc.field || !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: got %v, want a FieldError naming %s", tc.name, err, tc.field)
		}
	}
}

func TestCheckAcceptsWhatPostgreSQLStores(t *testing.T) {
	now := time.Now()
	for _, n := range []NewTask{
		{Kind: "naïve-kind", Options: Options{Key: "naïve\n\tkey"}},
		{Kind: "k", Payload: json.RawMessage(`{"emoji": "\ud83d\ude00", "n": 1e131, "deep": [[[[1]]]], "s": "\u0001"}`)},
		{Kind: "k", Payload: json.RawMessage(`"just a string"`), Options: Options{MaxAttempts: MaxAttemptsLimit}},
		{Kind: "k", Options: Options{RunAfter: time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)}},
	} {
		if err := n.Check(now); err != nil {
			t.Errorf("%+v: %v", n, err)
		}
	}
}

func TestSetResultRefusesWhatJSONBCannotStore(t *testing.T) {
	task := &Task{ID: 1}
	if err := task.SetResult(map[string]string{"a": "x\x00y"}); err == nil || task.Result != nil {
		t.Fatalf("a NUL in a result was accepted: %v %s", err, task.Result)
	}
	if err := task.SetResult(map[string]int{"n": 1}); err != nil || string(task.Result) != `{"n":1}` {
		t.Fatalf("result: %v %s", err, task.Result)
	}
}

func TestRetryPolicyValidate(t *testing.T) {
	if err := (RetryPolicy{MaxAttempts: 5, Base: time.Second, Cap: 10 * time.Second}).Validate(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []RetryPolicy{{MaxAttempts: 0, Base: 1, Cap: 1}, {MaxAttempts: 1, Base: 0, Cap: 1}, {MaxAttempts: 1, Base: 2, Cap: 1}} {
		if bad.Validate() == nil {
			t.Errorf("%+v validated", bad)
		}
	}
}
