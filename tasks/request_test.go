package tasks

import (
	"encoding/json"
	"errors"
	"testing"
	"time"
)

// JSON decoded into NewTask follows the API's rule, not Go's: a field
// given empty, zero or null is refused naming it (in Go, whose zero value
// cannot be told from a field not set, the zero value is "left out"). A
// NewTask written as JSON reads back the same.
func TestNewTaskFromJSONRefusesGivenEmptyFields(t *testing.T) {
	for _, tc := range []struct{ body, field string }{
		{`{"kind": "k", "queue": ""}`, "queue"},
		{`{"kind": "k", "key": ""}`, "key"},
		{`{"kind": "k", "unique_key": ""}`, "unique_key"},
		{`{"kind": "k", "sequence_key": ""}`, "sequence_key"},
		{`{"kind": "k", "priority": 0}`, "priority"},
		{`{"kind": "k", "max_attempts": 0}`, "max_attempts"},
		{`{"kind": "k", "run_after": "0001-01-01T00:00:00Z"}`, "run_after"},
		{`{"kind": "k", "deadline": "0001-01-01T00:00:00Z"}`, "deadline"},
		{`{"kind": "k", "queue": null}`, "queue"},
		{`{"kind": "k", "priority": null}`, "priority"},
	} {
		var n NewTask
		err := json.Unmarshal([]byte(tc.body), &n)
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != tc.field {
			// A null is the decoder's (a *jsonbody.Error naming the field).
			if err == nil || !containsField(err, tc.field) {
				t.Errorf("%s: %+v %v, want an error naming %s", tc.body, n, err, tc.field)
			}
		}
	}
	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	want := NewTask{Kind: "k", Payload: json.RawMessage(`{"a":1}`), Options: Options{Key: "user-1", MaxAttempts: 3, RunAfter: at,
		Deadline: at.Add(time.Hour), UniqueKey: "u", Queue: "q", Priority: 1, SequenceKey: "s", SequenceContinue: true}}
	for _, n := range []NewTask{want, {Kind: "k"}} {
		b, err := json.Marshal(n)
		if err != nil {
			t.Fatal(err)
		}
		var got NewTask
		if err := json.Unmarshal(b, &got); err != nil || !got.RunAfter.Equal(n.RunAfter) || got.Key != n.Key ||
			got.Queue != n.Queue || got.Priority != n.Priority || got.MaxAttempts != n.MaxAttempts || string(got.Payload) != string(n.Payload) {
			t.Errorf("%s read back as %+v (%v)", b, got, err)
		}
	}
}

func containsField(err error, field string) bool {
	var fe interface{ Field() string }
	return errors.As(err, &fe) && fe.Field() == field
}
