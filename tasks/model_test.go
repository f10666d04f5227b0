package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"hash/fnv"
	"strings"
	"testing"
	"time"
)

func TestMoves(t *testing.T) {
	legal := map[[2]State]bool{
		{Ready, Running}: true, {Ready, Failed}: true,
		{Running, Completed}: true, {Running, Ready}: true, {Running, Dead}: true, {Running, Failed}: true,
		{Ready, Cancelled}: true, {Running, Cancelled}: true,
		{Failed, Ready}: true, {Dead, Ready}: true, {Cancelled, Ready}: true,
	}
	for _, from := range States {
		for _, to := range States {
			if got := CanMove(from, to); got != legal[[2]State{from, to}] {
				t.Errorf("CanMove(%s, %s) = %v", from, to, got)
			}
		}
		if from.Terminal() != (from == Completed || from == Failed || from == Dead || from == Cancelled) {
			t.Errorf("%s.Terminal() wrong", from)
		}
		if from.Retryable() != CanMove(from, Ready) && from != Running {
			t.Errorf("%s.Retryable() disagrees with the moves", from)
		}
		if from.Cancellable() != CanMove(from, Cancelled) {
			t.Errorf("%s.Cancellable() disagrees with the moves", from)
		}
	}
	if State("paused").Valid() || !Ready.Valid() {
		t.Error("Valid")
	}
}

// The vectors in the README; computed independently (Python), so a change
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

func TestPrepareRejectsBadInputNamingTheField(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name   string
		task   NewTask
		shards int
		field  string
	}{
		{"empty kind", NewTask{}, 8, "kind"},
		{"long kind", NewTask{Kind: strings.Repeat("k", 201)}, 8, "kind"},
		{"payload not JSON", NewTask{Kind: "k", Payload: json.RawMessage(`{nope`)}, 8, "payload"},
		{"max attempts below one", NewTask{Kind: "k", MaxAttempts: -1}, 8, "max_attempts"},
		{"deadline in the past", NewTask{Kind: "k", Deadline: now.Add(-time.Second)}, 8, "deadline"},
		{"deadline before run_after", NewTask{Kind: "k", RunAfter: now.Add(time.Hour), Deadline: now.Add(time.Minute)}, 8, "deadline"},
		{"unknown shard count", NewTask{Kind: "k"}, 0, "shard_count"},
		{"long key", NewTask{Kind: "k", Key: strings.Repeat("x", 1025)}, 8, "key"},
		{"NUL in kind", NewTask{Kind: "a\x00b"}, 8, "kind"},
		{"NUL in key", NewTask{Kind: "k", Key: "a\x00b"}, 8, "key"},
		{"invalid UTF-8 in kind", NewTask{Kind: "a\xffb"}, 8, "kind"},
		{"invalid UTF-8 in key", NewTask{Kind: "k", Key: "caf\xe9"}, 8, "key"},
		{"control character in kind", NewTask{Kind: "a\nb"}, 8, "kind"},
		{"\\u0000 in payload", NewTask{Kind: "k", Payload: json.RawMessage(`{"a": "x\u0000"}`)}, 8, "payload"},
		{"lone surrogate in payload", NewTask{Kind: "k", Payload: json.RawMessage(`{"a": "\ud800"}`)}, 8, "payload"},
		{"invalid UTF-8 in payload", NewTask{Kind: "k", Payload: json.RawMessage("{\"a\": \"\xff\"}")}, 8, "payload"},
		{"duplicate key in payload", NewTask{Kind: "k", Payload: json.RawMessage(`{"a": 1, "a": 2}`)}, 8, "payload"},
		{"number beyond numeric", NewTask{Kind: "k", Payload: json.RawMessage(`{"a": 1e131072}`)}, 8, "payload"},
		{"trailing data in payload", NewTask{Kind: "k", Payload: json.RawMessage(`{} {}`)}, 8, "payload"},
		{"max attempts beyond int4", NewTask{Kind: "k", MaxAttempts: 1 << 31}, 8, "max_attempts"},
		{"max attempts beyond the limit", NewTask{Kind: "k", MaxAttempts: MaxAttemptsLimit + 1}, 8, "max_attempts"},
		{"run_after in year 10000", NewTask{Kind: "k", RunAfter: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}, 8, "run_after"},
		{"deadline in year 300000", NewTask{Kind: "k", Deadline: time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)}, 8, "deadline"},
		{"long unique key", NewTask{Kind: "k", UniqueKey: strings.Repeat("x", 1025)}, 8, "unique_key"},
		{"NUL in unique key", NewTask{Kind: "k", UniqueKey: "a\x00b"}, 8, "unique_key"},
	} {
		_, err := tc.task.Prepare(now, tc.shards, 5)
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != tc.field || !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: got %v, want a FieldError naming %s", tc.name, err, tc.field)
		}
	}
}

func TestPrepareAcceptsWhatPostgreSQLStores(t *testing.T) {
	now := time.Now()
	for _, n := range []NewTask{
		{Kind: "naïve-kind", Key: "naïve\n\tkey"},
		{Kind: "k", Payload: json.RawMessage(`{"emoji": "\ud83d\ude00", "n": 1e131, "deep": [[[[1]]]], "s": "\u0001"}`)},
		{Kind: "k", Payload: json.RawMessage(`"just a string"`), MaxAttempts: MaxAttemptsLimit},
		{Kind: "k", RunAfter: time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)},
	} {
		if _, err := n.Prepare(now, 8, 5); err != nil {
			t.Errorf("%+v: %v", n, err)
		}
	}
	if _, err := (NewTask{Kind: "k"}).Prepare(now, 8, MaxAttemptsLimit+1); err == nil {
		t.Error("a default max_attempts beyond the limit was accepted")
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

func TestPrepareDefaults(t *testing.T) {
	now := time.Now()
	in, err := NewTask{Kind: "k", Key: "user-42"}.Prepare(now, 256, 7)
	if err != nil {
		t.Fatal(err)
	}
	if in.Shard != 203 || string(in.Payload) != "{}" || in.MaxAttempts != 7 || in.RunAfter != nil || in.Deadline != nil {
		t.Fatalf("defaults: %+v", in)
	}
	a, _ := NewTask{Kind: "k"}.Prepare(now, 256, 7)
	b, _ := NewTask{Kind: "k"}.Prepare(now, 256, 7)
	if a.Key == "" || a.Key == b.Key {
		t.Fatalf("empty keys must become distinct random keys: %q %q", a.Key, b.Key)
	}
}

func TestBackoff(t *testing.T) {
	p := RetryPolicy{MaxAttempts: 5, Base: time.Second, Cap: 10 * time.Second}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	for attempt, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 5: 10 * time.Second, 60: 10 * time.Second} {
		lo, hi := p.Backoff(attempt, func() float64 { return 0 }), p.Backoff(attempt, func() float64 { return 0.999999 })
		if lo != want/2 || hi <= lo || hi > want {
			t.Errorf("attempt %d: range [%s, %s], want [%s, %s)", attempt, lo, hi, want/2, want)
		}
	}
	for _, bad := range []RetryPolicy{{MaxAttempts: 0, Base: 1, Cap: 1}, {MaxAttempts: 1, Base: 0, Cap: 1}, {MaxAttempts: 1, Base: 2, Cap: 1}} {
		if bad.Validate() == nil {
			t.Errorf("%+v validated", bad)
		}
	}
}

func TestRegistryAndTyped(t *testing.T) {
	r := NewRegistry()
	type payload struct{ N int }
	var got int
	h := Typed(func(_ context.Context, _ *Task, p payload) error { got = p.N; return nil })
	if err := r.Register("resize", h); err != nil {
		t.Fatal(err)
	}
	if err := r.Register("resize", h); err == nil {
		t.Fatal("duplicate registration accepted")
	}
	if err := r.Register("", h); err == nil {
		t.Fatal("empty kind accepted")
	}
	if err := r.Register("a\x00", h); err == nil {
		t.Fatal("a kind with NUL accepted")
	}
	if err := r.Register("x", nil); err == nil {
		t.Fatal("nil handler accepted")
	}
	fn, ok := r.Lookup("resize")
	if !ok || strings.Join(r.Kinds(), ",") != "resize" {
		t.Fatal("lookup")
	}
	if err := fn(context.Background(), &Task{Payload: json.RawMessage(`{"N": 3}`)}); err != nil || got != 3 {
		t.Fatalf("typed handler: %v %d", err, got)
	}
	err := fn(context.Background(), &Task{ID: 9, Kind: "resize", Payload: json.RawMessage(`{"N": "three"}`)})
	if !errors.Is(err, ErrPayload) || !strings.Contains(err.Error(), "task 9") {
		t.Fatalf("undecodable payload: %v", err)
	}
}

type fakeInserter struct{ got []Insert }

func (f *fakeInserter) Enqueue(_ context.Context, in Insert) (int64, error) {
	f.got = append(f.got, in)
	return int64(len(f.got)), nil
}

func (f *fakeInserter) EnqueueBatch(_ context.Context, ins []Insert) (int64, error) {
	f.got = append(f.got, ins...)
	return int64(len(ins)), nil
}

func TestClient(t *testing.T) {
	if _, err := NewClient(&fakeInserter{}, ClientConfig{}); err == nil || !strings.Contains(err.Error(), "shard_count") {
		t.Fatalf("client without a shard count: %v", err)
	}
	ins := &fakeInserter{}
	c, err := NewClient(ins, ClientConfig{ShardCount: 256})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.EnqueueBatch(context.Background(), []NewTask{{Kind: "a"}, {Kind: ""}})
	if err == nil || !strings.Contains(err.Error(), "task 1 of 2") || len(ins.got) != 0 {
		t.Fatalf("a bad task in a batch must reject the whole batch and name it: %v (%d inserted)", err, len(ins.got))
	}
	if _, err := c.Enqueue(context.Background(), NewTask{Kind: "a", Key: "user-42"}); err != nil || ins.got[0].Shard != 203 || ins.got[0].MaxAttempts != DefaultMaxAttempts {
		t.Fatalf("enqueue: %v %+v", err, ins.got)
	}
}
