package tasks

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/shardrun/shardrun/internal/jsonbody"
)

// Request is a task to enqueue as JSON gives it: the body of POST
// /api/tasks, and what NewTask.UnmarshalJSON decodes. It exists because
// NewTask is Go's vocabulary, in which a zero field means "left out"
// (Queue "" is the default queue, Priority 0 the default priority), while
// in JSON a field left out is absent: one given empty, zero or null must
// be valid or refused, never read as left out (docs/reference.md, one rule for
// optional values). So every optional field here is a pointer, nil only
// when the field is absent (jsonbody refuses null for them), and NewTask
// refuses the values the Go vocabulary would read as "not set".
type Request struct {
	Kind        string          `json:"kind"`
	Key         *string         `json:"key,omitempty"`
	Payload     json.RawMessage `json:"payload,omitempty"`
	MaxAttempts *int            `json:"max_attempts,omitempty"`
	RunAfter    *time.Time      `json:"run_after,omitempty"`
	Deadline    *time.Time      `json:"deadline,omitempty"`
	UniqueKey   *string         `json:"unique_key,omitempty"`
	Queue       *string         `json:"queue,omitempty"`
	// Priority: 1 (most urgent) to 5; left out, the default 3.
	Priority         *int    `json:"priority,omitempty"`
	SequenceKey      *string `json:"sequence_key,omitempty"`
	SequenceContinue bool    `json:"sequence_continue,omitempty"`
}

// NewTask turns the request into the task vocabulary, refusing a field
// given with the value that means "not set" there (a *FieldError naming
// it). The rest is NewTask.Check's, when the task is enqueued.
func (r Request) NewTask() (NewTask, error) {
	n := NewTask{Kind: r.Kind, Payload: r.Payload, SequenceContinue: r.SequenceContinue}
	var err error
	for _, f := range []struct {
		name  string
		p     *string
		to    *string
		unset string
	}{
		{"key", r.Key, &n.Key, "a random key"},
		{"unique_key", r.UniqueKey, &n.UniqueKey, "no unique key"},
		{"queue", r.Queue, &n.Queue, "the queue " + DefaultQueue},
		{"sequence_key", r.SequenceKey, &n.SequenceKey, "no sequence"},
	} {
		if *f.to, err = GivenText(f.name, f.p, f.unset); err != nil {
			return n, err
		}
	}
	if r.Priority != nil {
		if err := CheckPriority(*r.Priority); err != nil {
			return n, err
		}
		n.Priority = *r.Priority
	}
	if n.MaxAttempts, err = GivenMaxAttempts(r.MaxAttempts); err != nil {
		return n, err
	}
	if n.RunAfter, err = GivenTime("run_after", r.RunAfter, "none"); err != nil {
		return n, err
	}
	n.Deadline, err = GivenTime("deadline", r.Deadline, "none")
	return n, err
}

// UnmarshalJSON decodes a task as POST /api/tasks does (Request): strictly
// (exact field names, no unknown fields, no duplicate keys), and refusing a field given with the value the Go
// vocabulary reads as "not set" ("queue": "", "priority": 0, the zero
// time), which would otherwise silently take the default.
func (n *NewTask) UnmarshalJSON(data []byte) error {
	var r Request
	if err := jsonbody.Decode(data, &r); err != nil {
		return err
	}
	t, err := r.NewTask()
	if err != nil {
		return err
	}
	*n = t
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

// GivenMaxAttempts reads an optional max_attempts of JSON input. A field
// that is given must mean something: 0, which the Go vocabulary reads as
// "not set", is refused rather than silently taken as the default.
func GivenMaxAttempts(p *int) (int, error) {
	if p == nil {
		return 0, nil
	}
	if *p < 1 {
		return 0, &FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be 1 to %d, got %d (leave it out for the default)", MaxAttemptsLimit, *p)}
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
