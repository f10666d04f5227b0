package tasks

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/shardrun/shardrun/internal/jsonbody"
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
	// MaxAttemptsLimit bounds max_attempts (the column is a 32-bit
	// integer). Every failed attempt appends an entry to the task's errors,
	// so the row grows with its attempts; 1,000 attempts at the default
	// 5-minute retry cap keep a task retrying for three and a half days.
	MaxAttemptsLimit = 1000
)

// Queues, priorities and sequences.
const (
	// DefaultQueue is the queue of a task enqueued without one.
	DefaultQueue = "default"
	// MaxQueueLen bounds a queue's name.
	MaxQueueLen = 100
	// MostUrgent and LeastUrgent bound a task's priority: within a queue
	// and a shard, a more urgent task (a lower number) is claimed first.
	MostUrgent  = 1
	LeastUrgent = 5
	// DefaultPriority is the priority of a task enqueued without one: the
	// middle of the range, so a producer can both raise and lower a task's
	// urgency.
	DefaultPriority = 3
)

// Urgent reports whether priority p is more urgent than the default: an
// urgent task's shard is marked in its notification, and runners claim
// such tasks first. The database's function shardrun_urgent says the same.
func Urgent(p int) bool { return p < DefaultPriority }

// latestTime bounds run_after and deadline: RFC 3339 and the API have
// four-digit years, and PostgreSQL's timestamptz and pgx's encoding of it
// end (at year 294,276) long before Go's time.Time does.
var latestTime = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)

// NewTask describes a task to enqueue: its kind, its payload and its
// options. In Go a zero field is "left out" and takes its default; JSON
// decoded into a NewTask (UnmarshalJSON, DecodeTasks) refuses an option
// given empty, zero or null, as POST /api/tasks does (Options).
type NewTask struct {
	// Kind selects the handler; required.
	Kind string `json:"kind"`
	// Payload is the handler's input; it must be JSON. Empty means {}.
	Payload json.RawMessage `json:"payload,omitempty"`
	Options
}

// Check validates n against now: it refuses everything PostgreSQL would
// refuse, so that every producer (the HTTP API, the Go client) gets a
// FieldError naming the field instead of a database error: text must be
// valid UTF-8 without NUL, the payload strict JSON (no duplicate keys, no
// \u0000 or lone surrogate escapes, bounded numbers and nesting), the
// options valid (Options.Check).
func (n NewTask) Check(now time.Time) error {
	if err := CheckKind(n.Kind); err != nil {
		return err
	}
	if err := n.Options.Check(now); err != nil {
		return err
	}
	if len(n.Payload) > MaxPayloadLen {
		return &FieldError{Field: "payload", Problem: fmt.Sprintf("larger than %d bytes", MaxPayloadLen)}
	}
	if len(n.Payload) > 0 {
		if err := jsonbody.Check(n.Payload); err != nil {
			return &FieldError{Field: "payload", Problem: payloadProblem(err)}
		}
	}
	return nil
}

// Class is the class (queue, kind) of the task n enqueues.
func (n NewTask) Class() Class { return Class{Queue: n.WithDefaults(0).Queue, Kind: n.Kind} }

// CheckQueue reports whether name can name a queue: 1 to MaxQueueLen
// bytes of letters, digits and "._-" (queues show up in metric labels,
// URLs and flags).
func CheckQueue(name string) error {
	if name == "" {
		return &FieldError{Field: "queue", Problem: "must not be empty"}
	}
	if len(name) > MaxQueueLen {
		return &FieldError{Field: "queue", Problem: fmt.Sprintf("longer than %d bytes", MaxQueueLen)}
	}
	for i, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') || r > unicode.MaxASCII {
			return &FieldError{Field: "queue", Problem: fmt.Sprintf("%q at byte %d: use letters, digits and ._-", r, i)}
		}
	}
	return nil
}

// CheckPriority reports whether p is a priority.
func CheckPriority(p int) error {
	if p < MostUrgent || p > LeastUrgent {
		return &FieldError{Field: "priority", Problem: fmt.Sprintf("must be %d (most urgent) to %d (least), got %d", MostUrgent, LeastUrgent, p)}
	}
	return nil
}

// RandomKey is the key of a task enqueued without one: 24 hex digits,
// which spread such tasks evenly over the shards.
func RandomKey() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// CheckKind reports whether kind can name a task kind: 1 to MaxKindLen
// bytes of valid UTF-8 without control characters (kinds show up in logs,
// metric labels and the status page).
func CheckKind(kind string) error {
	if kind == "" {
		return &FieldError{Field: "kind", Problem: "must not be empty"}
	}
	if err := checkText("kind", kind, MaxKindLen); err != nil {
		return err
	}
	if i := strings.IndexFunc(kind, unicode.IsControl); i >= 0 {
		r, _ := utf8.DecodeRuneInString(kind[i:])
		return &FieldError{Field: "kind", Problem: fmt.Sprintf("control character %q at byte %d", r, i)}
	}
	return nil
}

// CheckKey reports whether s can be a key, a unique key or a sequence key:
// text PostgreSQL can store, at most MaxKeyLen bytes. field names it in
// the *FieldError: a listing's cursor that is a sequence key is checked as
// one before the database sees it.
func CheckKey(field, s string) error { return checkText(field, s, MaxKeyLen) }

// checkText refuses what PostgreSQL's text refuses (invalid UTF-8, NUL)
// and text longer than max bytes. Invalid UTF-8 is refused rather than
// repaired: a key's shard is computed on its bytes, and a producer hashing
// the bytes it sent must get the same shard.
func checkText(field, s string, max int) error {
	if len(s) > max {
		return &FieldError{Field: field, Problem: fmt.Sprintf("longer than %d bytes", max)}
	}
	if !utf8.ValidString(s) {
		i := 0
		for i < len(s) {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && size == 1 {
				break
			}
			i += size
		}
		return &FieldError{Field: field, Problem: fmt.Sprintf("invalid UTF-8 at byte %d", i)}
	}
	if i := strings.IndexByte(s, 0); i >= 0 {
		return &FieldError{Field: field, Problem: fmt.Sprintf("NUL character at byte %d", i)}
	}
	return nil
}

// payloadProblem words a jsonbody error about a payload, with its place
// inside the payload.
func payloadProblem(err error) string {
	var je *jsonbody.Error
	if errors.As(err, &je) {
		if p := je.PathString(); p != "" {
			return fmt.Sprintf("is not valid: at %s: %s", p, je.Problem)
		}
		return "is not valid: " + je.Problem
	}
	return "is not valid: " + err.Error()
}

// checkPlacement checks the fields a task and a filter share: key and
// sequence key as text PostgreSQL can store, the queue's name and the
// priority's range where given (empty and 0 mean the default, or any).
func checkPlacement(key, sequenceKey, queue string, priority int) error {
	if err := checkText("key", key, MaxKeyLen); err != nil {
		return err
	}
	if err := checkText("sequence_key", sequenceKey, MaxKeyLen); err != nil {
		return err
	}
	if queue != "" {
		if err := CheckQueue(queue); err != nil {
			return err
		}
	}
	if priority != 0 {
		return CheckPriority(priority)
	}
	return nil
}
