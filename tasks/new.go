package tasks

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// ErrInvalid is matched by every validation error (errors.Is).
var ErrInvalid = errors.New("invalid task")

// FieldError names the field of a task or of a configuration that is wrong.
type FieldError struct {
	Field   string
	Problem string
}

func (e *FieldError) Error() string { return fmt.Sprintf("invalid %s: %s", e.Field, e.Problem) }

// Is makes errors.Is(err, ErrInvalid) true for every FieldError.
func (e *FieldError) Is(target error) bool { return target == ErrInvalid }

// Limits on what a task may carry.
const (
	MaxKindLen    = 200
	MaxKeyLen     = 1024
	MaxPayloadLen = 1 << 20
)

// NewTask describes a task to enqueue.
type NewTask struct {
	// Kind selects the handler; required.
	Kind string `json:"kind"`
	// Key decides the shard (ShardOf). Tasks with the same key always run
	// on the same shard. Empty means a random key, spreading tasks evenly.
	Key string `json:"key,omitempty"`
	// Payload is the handler's input; it must be JSON. Empty means {}.
	Payload json.RawMessage `json:"payload,omitempty"`
	// MaxAttempts bounds the attempts; 0 means the client's default.
	MaxAttempts int `json:"max_attempts,omitempty"`
	// RunAfter delays the first attempt; zero means now.
	RunAfter time.Time `json:"run_after,omitzero"`
	// Deadline, when set, fails the task if it has not completed by then.
	Deadline time.Time `json:"deadline,omitzero"`
}

// Insert is a validated task with its shard computed, ready for the store.
type Insert struct {
	Kind        string
	Shard       int
	Key         string
	Payload     json.RawMessage
	MaxAttempts int
	RunAfter    *time.Time
	Deadline    *time.Time
}

// Prepare validates n against now and the shard count and fills defaults.
// Deadlines are checked against the caller's clock as a sanity check only;
// the sweeper enforces them with the database clock.
func (n NewTask) Prepare(now time.Time, shardCount, defaultMaxAttempts int) (Insert, error) {
	if shardCount < 1 {
		return Insert{}, &FieldError{Field: "shard_count", Problem: fmt.Sprintf("must be at least 1, got %d (unknown shard count)", shardCount)}
	}
	switch {
	case n.Kind == "":
		return Insert{}, &FieldError{Field: "kind", Problem: "must not be empty"}
	case len(n.Kind) > MaxKindLen:
		return Insert{}, &FieldError{Field: "kind", Problem: fmt.Sprintf("longer than %d bytes", MaxKindLen)}
	case len(n.Key) > MaxKeyLen:
		return Insert{}, &FieldError{Field: "key", Problem: fmt.Sprintf("longer than %d bytes", MaxKeyLen)}
	case len(n.Payload) > MaxPayloadLen:
		return Insert{}, &FieldError{Field: "payload", Problem: fmt.Sprintf("larger than %d bytes", MaxPayloadLen)}
	case len(n.Payload) > 0 && !json.Valid(n.Payload):
		return Insert{}, &FieldError{Field: "payload", Problem: "is not valid JSON"}
	case n.MaxAttempts < 0:
		return Insert{}, &FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be at least 1, got %d", n.MaxAttempts)}
	case !n.Deadline.IsZero() && !n.Deadline.After(now):
		return Insert{}, &FieldError{Field: "deadline", Problem: fmt.Sprintf("%s is in the past", n.Deadline.Format(time.RFC3339Nano))}
	case !n.Deadline.IsZero() && !n.RunAfter.IsZero() && !n.Deadline.After(n.RunAfter):
		return Insert{}, &FieldError{Field: "deadline", Problem: "is not after run_after"}
	}
	in := Insert{Kind: n.Kind, Key: n.Key, Payload: n.Payload, MaxAttempts: n.MaxAttempts}
	if in.Key == "" {
		in.Key = randomKey()
	}
	if len(in.Payload) == 0 {
		in.Payload = json.RawMessage("{}")
	}
	if in.MaxAttempts == 0 {
		in.MaxAttempts = defaultMaxAttempts
	}
	if in.MaxAttempts < 1 {
		return Insert{}, &FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be at least 1, got %d", in.MaxAttempts)}
	}
	if !n.RunAfter.IsZero() {
		t := n.RunAfter
		in.RunAfter = &t
	}
	if !n.Deadline.IsZero() {
		t := n.Deadline
		in.Deadline = &t
	}
	in.Shard = ShardOf(in.Key, shardCount)
	return in, nil
}

func randomKey() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
