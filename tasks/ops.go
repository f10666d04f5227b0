package tasks

// The vocabulary of task operations: what an enqueue did, the filters and
// pages of listing, what bulk cancels and retries did, and the typed errors
// operators get.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// ErrCancelled is the cause (context.Cause) of a handler's context ending
// because an operator cancelled its task. A handler that then returns an
// error has its attempt recorded as cancelled (not retried); one that
// returns nil has done its work, and the attempt is recorded as completed,
// with its result.
var ErrCancelled = errors.New("task cancelled on request")

// CancelRequested reports whether ctx, a handler's context, ended because
// an operator asked to cancel the task: its cause is ErrCancelled. A
// handler whose side effects are done can still return nil (the task
// completes); one that stops short returns an error (the task is
// cancelled).
func CancelRequested(ctx context.Context) bool {
	return errors.Is(context.Cause(ctx), ErrCancelled)
}

// ErrNotFound is matched (errors.Is) by every NotFoundError.
var ErrNotFound = errors.New("task not found")

// ErrConflict is matched (errors.Is) by every ConflictError.
var ErrConflict = errors.New("task is not in a state that allows this")

// NotFoundError says that no task has this id (it never existed or
// retention deleted it).
type NotFoundError struct {
	ID int64
}

func (e *NotFoundError) Error() string { return fmt.Sprintf("task %d not found", e.ID) }

// Is makes errors.Is(err, ErrNotFound) true.
func (e *NotFoundError) Is(target error) bool { return target == ErrNotFound }

// ConflictError says that an operation does not apply to the task as it is
// now: cancelling a finished task, retrying one that is not dead, failed or
// cancelled, or retrying one whose unique key another unfinished task holds.
type ConflictError struct {
	ID int64
	// Op is the operation refused: "cancel" or "retry".
	Op string
	// State is the task's state when it was refused.
	State State
	// Reason explains the refusal.
	Reason string
}

func (e *ConflictError) Error() string {
	return fmt.Sprintf("cannot %s task %d (%s): %s", e.Op, e.ID, e.State, e.Reason)
}

// Is makes errors.Is(err, ErrConflict) true.
func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

// Enqueued is what enqueueing one task did: the id of the task created, or,
// with a unique key an unfinished task already held, that task's id and
// Duplicate set.
type Enqueued struct {
	ID        int64 `json:"id"`
	Duplicate bool  `json:"duplicate,omitempty"`
	// Shard and Key say where a created task went (its key is random when
	// none was given); zero for a duplicate, whose task may have another.
	// The API's batch answer lists ids only, so they are not in its JSON.
	Shard int    `json:"-"`
	Key   string `json:"-"`
}

// BatchEnqueued is what enqueueing a batch did. Tasks holds one entry per
// task of the batch, in order, when any task of the batch had a unique key;
// a batch without unique keys is inserted by COPY, which does not return
// ids, and Tasks is nil.
type BatchEnqueued struct {
	Inserted   int64      `json:"enqueued"`
	Duplicates int64      `json:"duplicates,omitempty"`
	Tasks      []Enqueued `json:"tasks,omitempty"`
}

// Filter selects tasks for listing and for bulk cancel and retry. Empty
// fields do not filter. Tasks match when they match every field given.
type Filter struct {
	// States: any of these (none: any state).
	States []State
	Kind   string
	Shard  *int
	Key    string
	Queue  string
	// Priority: 0 for any.
	Priority    int
	SequenceKey string
	// CreatedBefore: created strictly before this time.
	CreatedBefore time.Time
	// CreatedSince: created at or after this time. With CreatedBefore it
	// selects the half-open window [CreatedSince, CreatedBefore), so that
	// consecutive windows an operator steps through neither overlap nor
	// leave a gap.
	CreatedSince time.Time
}

// Empty reports whether f selects every task.
func (f Filter) Empty() bool {
	return len(f.States) == 0 && f.Kind == "" && f.Shard == nil && f.Key == "" && f.Queue == "" && f.Priority == 0 &&
		f.SequenceKey == "" && f.CreatedBefore.IsZero() && f.CreatedSince.IsZero()
}

// Check validates the fields f gives with the rules of a task's fields
// (NewTask.Check): text PostgreSQL can store, a shard of a cluster of
// shardCount shards, a time before the year 10000. The *FieldError names
// the field.
func (f Filter) Check(shardCount int) error {
	for _, st := range f.States {
		if !st.Valid() {
			return &FieldError{Field: "state", Problem: fmt.Sprintf("%q is not a state (%s)", st, joinStates(States))}
		}
	}
	if f.Kind != "" {
		if err := CheckKind(f.Kind); err != nil {
			return err
		}
	}
	if err := checkPlacement(f.Key, f.SequenceKey, f.Queue, f.Priority); err != nil {
		return err
	}
	if f.Shard != nil && (*f.Shard < 0 || *f.Shard >= shardCount) {
		return &FieldError{Field: "shard", Problem: fmt.Sprintf("must be 0 to %d (the cluster has %d shards), got %d", shardCount-1, shardCount, *f.Shard)}
	}
	if !f.CreatedBefore.Before(latestTime) {
		return &FieldError{Field: "created_before", Problem: "must be before the year 10000"}
	}
	if !f.CreatedSince.Before(latestTime) {
		return &FieldError{Field: "created_since", Problem: "must be before the year 10000"}
	}
	if !f.CreatedSince.IsZero() && !f.CreatedBefore.IsZero() && !f.CreatedSince.Before(f.CreatedBefore) {
		return &FieldError{Field: "created_since", Problem: fmt.Sprintf("must be before created_before (%s), got %s: no task is created in that window",
			f.CreatedBefore.Format(time.RFC3339Nano), f.CreatedSince.Format(time.RFC3339Nano))}
	}
	return nil
}

func joinStates(states []State) string {
	s := make([]string, len(states))
	for i, st := range states {
		s[i] = string(st)
	}
	return strings.Join(s, ", ")
}

// Listing bounds.
const (
	// DefaultListLimit is the page size when none is asked for.
	DefaultListLimit = 100
	// MaxListLimit bounds a page.
	MaxListLimit = 1000
)

// ListRequest asks for one page of tasks in id order.
type ListRequest struct {
	Filter
	// After is the cursor: the Next of the previous page (0: from the
	// start).
	After int64
	// Limit bounds the page (DefaultListLimit when 0, at most
	// MaxListLimit).
	Limit int
	// Desc lists newest first (descending id); the cursor then continues
	// below After.
	Desc bool
}

// Page is one page of a listing. Next, when not 0, is the cursor of the
// next page; a listing is complete once a page comes without one. A page
// may hold fewer than Limit tasks and still have a Next: each page examines
// a bounded number of candidate rows, so that a filter matching few of
// them cannot make one request scan the whole table.
type Page struct {
	Tasks []Summary `json:"tasks"`
	Next  int64     `json:"next,omitempty"`
}

// Summary is a task in a listing: everything but its payload, result and
// history (GET /api/tasks/{id} has those), and the text of its last error.
type Summary struct {
	ID                int64      `json:"id"`
	Kind              string     `json:"kind"`
	Shard             int        `json:"shard"`
	Key               string     `json:"key"`
	Queue             string     `json:"queue"`
	Priority          int        `json:"priority"`
	SequenceKey       string     `json:"sequence_key,omitempty"`
	UniqueKey         string     `json:"unique_key,omitempty"`
	State             State      `json:"state"`
	Attempt           int        `json:"attempt"`
	MaxAttempts       int        `json:"max_attempts"`
	RunAfter          time.Time  `json:"run_after"`
	Deadline          *time.Time `json:"deadline,omitempty"`
	ClaimedBy         string     `json:"claimed_by,omitempty"`
	ClaimedAt         *time.Time `json:"claimed_at,omitempty"`
	HeartbeatAt       *time.Time `json:"heartbeat_at,omitempty"`
	CancelRequestedAt *time.Time `json:"cancel_requested_at,omitempty"`
	LastError         string     `json:"last_error,omitempty"`
	CreatedAt         time.Time  `json:"created_at"`
	FinishedAt        *time.Time `json:"finished_at,omitempty"`
}

// BulkResult is what a bulk cancel or retry did. Done is false when it
// stopped before the end (a time bound per request); Next is then the
// cursor to continue from.
type BulkResult struct {
	// Cancelled: ready tasks cancelled at once.
	Cancelled int64 `json:"cancelled,omitempty"`
	// CancelRequested: running tasks whose runner was asked to cancel them.
	CancelRequested int64 `json:"cancel_requested,omitempty"`
	// Retried: tasks put back to ready.
	Retried int64 `json:"retried,omitempty"`
	// Skipped: tasks not retried because another unfinished task holds
	// their unique key (or another task of the same request did).
	Skipped int64 `json:"skipped,omitempty"`
	Done    bool  `json:"done"`
	Next    int64 `json:"next,omitempty"`
}

// Add accumulates r into b (counts only).
func (b *BulkResult) Add(r BulkResult) {
	b.Cancelled += r.Cancelled
	b.CancelRequested += r.CancelRequested
	b.Retried += r.Retried
	b.Skipped += r.Skipped
}
