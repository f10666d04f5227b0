package tasks

import (
	"bytes"
	"fmt"
	"time"

	"github.com/shardrun/shardrun/internal/jsonbody"
)

// BatchError names the task of a batch that is invalid; nothing of the
// batch was enqueued.
type BatchError struct {
	Index, Len int
	Err        error
}

func (e *BatchError) Error() string { return fmt.Sprintf("task %d of %d: %v", e.Index, e.Len, e.Err) }

// Unwrap returns the task's error (a *FieldError).
func (e *BatchError) Unwrap() error { return e.Err }

// newTaskJSON is NewTask without its UnmarshalJSON: what DecodeTasks
// decodes into.
type newTaskJSON NewTask

// DecodeTasks decodes the body of POST /api/tasks: one task (a JSON
// object) or a batch (an array of them; batch says which). It decodes
// strictly (exact field names, no unknown or duplicate fields, no null, no
// trailing data, valid UTF-8), and refuses an option given with the value
// the Go vocabulary reads as "not set" ("queue": "", "priority": 0, the
// zero time; Options.CheckGiven), which would otherwise silently take the
// default. A malformed body's error names its place (the index of the
// batch's task, then the field); an option given empty is a *FieldError,
// wrapped in a *BatchError naming the task in a batch. The rest is
// NewTask.Check's, when the tasks are enqueued.
func DecodeTasks(data []byte) (ns []NewTask, batch bool, err error) {
	trimmed := bytes.TrimLeft(data, " \t\r\n")
	batch = len(trimmed) > 0 && trimmed[0] == '['
	var decoded []newTaskJSON
	if batch {
		err = jsonbody.Decode(data, &decoded)
	} else {
		decoded = make([]newTaskJSON, 1)
		err = jsonbody.Decode(data, &decoded[0])
	}
	if err != nil {
		return nil, batch, err
	}
	given := jsonbody.Given(data)
	ns = make([]NewTask, len(decoded))
	for i, n := range decoded {
		if err := n.CheckGiven(given[i]); err != nil {
			if batch {
				return nil, batch, &BatchError{Index: i, Len: len(decoded), Err: err}
			}
			return nil, batch, err
		}
		ns[i] = NewTask(n)
	}
	return ns, batch, nil
}

// UnmarshalJSON decodes one task as POST /api/tasks does (DecodeTasks):
// strictly, and refusing an option given with the value the Go
// vocabulary reads as "not set".
func (n *NewTask) UnmarshalJSON(data []byte) error {
	var one newTaskJSON
	if err := jsonbody.Decode(data, &one); err != nil {
		return err
	}
	if err := one.CheckGiven(jsonbody.Given(data)[0]); err != nil {
		return err
	}
	*n = NewTask(one)
	return nil
}

// GivenText reads an optional text field of JSON input: nil (left out) is
// "", and a field given empty, which the Go vocabulary reads as "not set",
// is refused. unset says what leaving it out means.
func GivenText(field string, p *string, unset string) (string, error) {
	switch {
	case p == nil:
		return "", nil
	case *p == "":
		return "", &FieldError{Field: field, Problem: "must not be empty (leave it out for " + unset + ")"}
	}
	return *p, nil
}

// GivenTime reads an optional time of JSON input; the zero time
// 0001-01-01T00:00:00Z, which the Go vocabulary reads as "not set", is
// refused. unset says what leaving the field out means.
func GivenTime(field string, p *time.Time, unset string) (time.Time, error) {
	if p == nil {
		return time.Time{}, nil
	}
	if p.IsZero() {
		return time.Time{}, &FieldError{Field: field, Problem: "must not be the zero time 0001-01-01T00:00:00Z (leave it out for " + unset + ")"}
	}
	return *p, nil
}
