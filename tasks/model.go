// Package tasks is shardrun's vocabulary of work, what producers,
// handlers and operators use beside the client (package shardrun): the
// task and its states, the task to enqueue and its checks
// (NewTask.Check), the shard of a key, filters and pages of listings, and
// typed errors.
package tasks

import (
	"encoding/json"
	"time"
)

// State is where a task is in its life. The only legal moves are:
//
//	ready   --claim-->                          running
//	running --unclaim (handler never started)-> ready (same attempt)
//	running --complete-->                       completed
//	running --error, attempts left-->           ready (attempt+1, run_after = backoff)
//	running --error, none left-->               dead
//	ready|running --deadline passed (sweeper)-> failed
//	ready   --kind unhandled past --unhandled-after (leader)--> failed
//	running --stale claim (sweeper or owner)--> ready (attempt+1) | dead
//	running --interrupted (runner lost the shard)--> ready (same attempt)
//	ready   --cancel (operator)-->              cancelled
//	running --cancel (operator, then runner)--> cancelled
//	dead|failed blocking its sequence --cancel (operator)--> cancelled
//	dead|failed|cancelled --retry (operator)--> ready (attempt+1, fresh budget)
//
// Each move is one statement of the database, conditional on the state
// it expects.
//
// Completed is final. A move back to ready after a handler failed or its
// claim went stale increments attempt. Two moves back to ready spend no
// attempt: unclaim returns a claim whose handler never started (its shard
// began to move in between), and interrupt returns an attempt cut short
// because its runner lost the shard — not the handler's failure, so it is
// recorded in the history but not counted against max_attempts. The next
// claim of either is under a newer epoch, so the claim (id, attempt, epoch)
// is never reused. Every write
// in the store re-checks the state and attempt it expects, so a write that
// finds the row elsewhere changes nothing.
//
// Cancelling a running task is a request (cancel_requested_at): the runner
// that runs it learns of it from its next heartbeat and cancels the
// handler's context with ErrCancelled; the attempt is recorded as cancelled
// when the handler returns an error, and as completed when it returns nil
// (its work is done). Every other move that would put a task whose cancel
// was requested back in line (a failure with attempts left, a stale or
// orphaned claim, an unclaim, an interruption) cancels it instead. Retry is the only way out
// of dead, failed and cancelled, and only by an operator: it grants the
// task as many further attempts as it was enqueued with (max_attempts
// becomes attempt + that budget), keeps its history and drops a deadline
// that has passed.
type State string

// The task states.
const (
	Ready     State = "ready"
	Running   State = "running"
	Completed State = "completed"
	Failed    State = "failed"
	Dead      State = "dead"
	Cancelled State = "cancelled"
)

// States lists every state in display order.
var States = []State{Ready, Running, Completed, Failed, Dead, Cancelled}

// FinalStates are the states a task ends in.
var FinalStates = []State{Completed, Failed, Dead, Cancelled}

// Terminal reports whether the task is finished: no runner will take it
// again. Failed, dead and cancelled tasks leave only by an operator's retry.
func (s State) Terminal() bool {
	return s == Completed || s == Failed || s == Dead || s == Cancelled
}

// Retryable reports whether an operator may retry a task in state s.
func (s State) Retryable() bool { return s == Failed || s == Dead || s == Cancelled }

// Cancellable reports whether an operator may cancel a task in state s.
func (s State) Cancellable() bool { return s == Ready || s == Running }

// Valid reports whether s is one of the states.
func (s State) Valid() bool {
	for _, x := range States {
		if s == x {
			return true
		}
	}
	return false
}

// Task is one row of the tasks table as handlers and the API see it.
type Task struct {
	ID       int64  `json:"id"`
	Kind     string `json:"kind"`
	Shard    int    `json:"shard"`
	Key      string `json:"key"`
	Queue    string `json:"queue"`
	Priority int    `json:"priority"`
	// SequenceKey names the task's sequence, if any (see
	// NewTask.SequenceKey); SequenceBlocks says that the task, dead or
	// failed, holds the rest of the sequence back.
	SequenceKey    string          `json:"sequence_key,omitempty"`
	SequenceBlocks bool            `json:"sequence_blocks,omitempty"`
	Payload        json.RawMessage `json:"payload"`
	State          State           `json:"state"`
	Attempt        int             `json:"attempt"`
	MaxAttempts    int             `json:"max_attempts"`
	// AttemptBudget is the number of attempts each operator's retry grants
	// (the task's max_attempts as enqueued), set at its first retry: the
	// attempts since the last retry are the last AttemptBudget up to
	// MaxAttempts. 0 when the task was never retried.
	AttemptBudget int        `json:"attempt_budget,omitempty"`
	RunAfter      time.Time  `json:"run_after"`
	Deadline      *time.Time `json:"deadline,omitempty"`
	ClaimedBy     string     `json:"claimed_by,omitempty"`
	// Epoch is the claim's fencing token: the etcd revision at which the
	// claiming runner acquired the shard. Pass it to downstream systems that
	// accept a fencing token so a late write from an old owner is refused.
	Epoch       int64      `json:"claim_epoch,omitempty"`
	ClaimedAt   *time.Time `json:"claimed_at,omitempty"`
	HeartbeatAt *time.Time `json:"heartbeat_at,omitempty"`
	// CancelRequestedAt is when an operator asked to cancel the task while
	// it was running; the runner running it cancels the attempt.
	CancelRequestedAt *time.Time `json:"cancel_requested_at,omitempty"`
	// UniqueKey, when set, makes enqueueing idempotent while the task is
	// unfinished (see NewTask.UniqueKey).
	UniqueKey  string          `json:"unique_key,omitempty"`
	Errors     []AttemptError  `json:"errors"`
	Result     json.RawMessage `json:"result,omitempty"`
	CreatedAt  time.Time       `json:"created_at"`
	FinishedAt *time.Time      `json:"finished_at,omitempty"`
	// TraceContext is the W3C trace context (traceparent, tracestate) of
	// the span that enqueued the task, as stored with it; the runner's
	// spans of the task join that trace. Set on claimed tasks only, and
	// empty when the task was enqueued with tracing off. Not part of the
	// API's JSON: a handler that wants the trace uses its context's span.
	TraceContext string `json:"-"`
}

// Class is a task's queue and kind: what decides which runners can run it
// (a runner serves queues and handles kinds).
type Class struct {
	Queue string `json:"queue"`
	Kind  string `json:"kind"`
}

// AttemptError records why one attempt did not complete.
type AttemptError struct {
	Attempt int       `json:"attempt"`
	At      time.Time `json:"at"`
	Runner  string    `json:"runner,omitempty"`
	Error   string    `json:"error"`
	// Interrupted: the attempt was cut short because its runner lost the
	// shard (detach, handoff, shutdown); it did not spend the attempt.
	Interrupted bool `json:"interrupted,omitempty"`
}
