package tasks

import (
	"cmp"
	"fmt"
	"time"
)

// Options are a task's options: where it runs (Key, Queue, Priority), how
// often it may be tried (MaxAttempts), when (RunAfter, Deadline), whether
// it may be enqueued twice (UniqueKey), and its sequence. They are the one
// shape of a task's options, as River's InsertOpts is: shardrun.EnqueueOpts
// is this type, a NewTask carries it, POST /api/tasks decodes its body
// into it, a schedule keeps it for each tick's task, and the store gets
// it with its defaults filled (WithDefaults). A new option is a field here
// and a column.
//
// In Go a zero field is "left out" and takes its default (Queue "" is the
// default queue, Priority 0 the default priority), since Go cannot tell a
// zero value from a field not set. JSON can: decoded from JSON (NewTask's
// UnmarshalJSON, DecodeTasks, the API's bodies), an option given empty,
// zero or null is refused rather than read as left out (CheckGiven).
type Options struct {
	// Key decides the shard (ShardOf). Tasks with the same key always run
	// on the same shard. Empty means a random key, spreading tasks evenly.
	Key string `json:"key,omitempty"`
	// UniqueKey, when set, makes the enqueue idempotent: while a task with
	// the same unique key is unfinished (ready or running), enqueueing
	// another returns that task instead of creating one. Unique keys are
	// global, across kinds; prefix them with the kind to scope them. Once
	// the task finished (completed, failed, dead or cancelled), or an
	// operator asked to cancel it, the key is free again.
	UniqueKey string `json:"unique_key,omitempty"`
	// Queue names the queue (default "default"): runners serve the queues
	// they are configured with, each with its own worker limit, and an
	// operator can pause a queue.
	Queue string `json:"queue,omitempty"`
	// Priority, 1 (most urgent) to 5 (least), default 3: within its queue
	// and shard, a more urgent task is claimed first; among equals, the
	// oldest. 0 means the default.
	Priority int `json:"priority,omitempty"`
	// MaxAttempts bounds the attempts; 0 means the enqueuing client's
	// default (DefaultMaxAttempts unless configured).
	MaxAttempts int `json:"max_attempts,omitempty"`
	// RunAfter delays the first attempt; zero means now.
	RunAfter time.Time `json:"run_after,omitzero"`
	// Deadline, when set, fails the task if it has not completed by then.
	Deadline time.Time `json:"deadline,omitzero"`
	// SequenceKey, when set, makes the task one of a sequence: the tasks of
	// one sequence key run one at a time, in enqueue order, each after the
	// one before it finished. The sequence key decides the shard (Key then
	// only names the task).
	SequenceKey string `json:"sequence_key,omitempty"`
	// SequenceContinue lets the sequence go on when this task ends dead or
	// failed; by default such a task blocks the rest of its sequence until
	// an operator retries or cancels it.
	SequenceContinue bool `json:"sequence_continue,omitempty"`
}

// WithDefaults returns o with the defaults in its zero fields: the queue
// DefaultQueue, the priority DefaultPriority and maxAttempts (the
// enqueuing client's default; 0 leaves MaxAttempts as it is). It is the
// one place those defaults are filled. A missing key is not a default:
// each task draws a random one when it is enqueued (RandomKey).
func (o Options) WithDefaults(maxAttempts int) Options {
	o.Queue = cmp.Or(o.Queue, DefaultQueue)
	o.Priority = cmp.Or(o.Priority, DefaultPriority)
	o.MaxAttempts = cmp.Or(o.MaxAttempts, maxAttempts)
	return o
}

// Check validates the options against now, refusing what PostgreSQL would
// refuse (a *FieldError naming the option): keys as text it can store,
// the queue's name and the priority's range where given, max_attempts
// and times within range. Deadlines are checked against the caller's
// clock as a sanity check only; the sweeper enforces them with the
// database clock.
func (o Options) Check(now time.Time) error {
	if err := checkText("unique_key", o.UniqueKey, MaxKeyLen); err != nil {
		return err
	}
	if err := checkPlacement(o.Key, o.SequenceKey, o.Queue, o.Priority); err != nil {
		return err
	}
	switch {
	case o.SequenceContinue && o.SequenceKey == "":
		return &FieldError{Field: "sequence_continue", Problem: "applies only to a task with a sequence_key"}
	case o.MaxAttempts < 0 || o.MaxAttempts > MaxAttemptsLimit:
		return &FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be 1 to %d, got %d", MaxAttemptsLimit, o.MaxAttempts)}
	case !o.RunAfter.Before(latestTime):
		return &FieldError{Field: "run_after", Problem: "must be before the year 10000"}
	case !o.Deadline.Before(latestTime):
		return &FieldError{Field: "deadline", Problem: "must be before the year 10000"}
	case !o.Deadline.IsZero() && !o.Deadline.After(now):
		return &FieldError{Field: "deadline", Problem: fmt.Sprintf("%s is in the past", o.Deadline.Format(time.RFC3339Nano))}
	case !o.Deadline.IsZero() && !o.RunAfter.IsZero() && !o.Deadline.After(o.RunAfter):
		return &FieldError{Field: "deadline", Problem: "is not after run_after"}
	}
	return nil
}

// CheckGiven applies JSON's rule for optional values (docs/reference.md):
// an option given is valid or refused, never read as left out. given
// holds the JSON members the options were decoded from; an option among
// them that holds the value Go reads as "left out" (empty text, priority
// or max_attempts 0, the zero time) is refused as a *FieldError naming it.
// sequence_continue given false means what leaving it out means.
func (o Options) CheckGiven(given map[string]bool) error {
	for _, f := range []struct {
		name, value, unset string
	}{
		{"key", o.Key, "a random key"},
		{"unique_key", o.UniqueKey, "no unique key"},
		{"queue", o.Queue, "the queue " + DefaultQueue},
		{"sequence_key", o.SequenceKey, "no sequence"},
	} {
		if given[f.name] && f.value == "" {
			return &FieldError{Field: f.name, Problem: "must not be empty (leave it out for " + f.unset + ")"}
		}
	}
	switch {
	case given["priority"] && o.Priority == 0:
		return CheckPriority(o.Priority)
	case given["max_attempts"] && o.MaxAttempts < 1:
		return &FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be 1 to %d, got %d (leave it out for the default)", MaxAttemptsLimit, o.MaxAttempts)}
	}
	if _, err := GivenTime("run_after", timeIf(given["run_after"], o.RunAfter), "none"); err != nil {
		return err
	}
	_, err := GivenTime("deadline", timeIf(given["deadline"], o.Deadline), "none")
	return err
}

// timeIf is &t when given, nil otherwise.
func timeIf(given bool, t time.Time) *time.Time {
	if !given {
		return nil
	}
	return &t
}
