package store

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
)

// The classes of database errors, by what the caller should do about them.
// Classify wraps an error so that errors.Is matches exactly one of them.
var (
	// ErrUnavailable: the database could not serve the statement now — no
	// connection, the server is shutting down or starting, out of resources,
	// a serialization failure or deadlock, a timeout. The same request may
	// succeed later (HTTP 503 with Retry-After).
	ErrUnavailable = errors.New("store: database unavailable")
	// ErrInvalidInput: the database refused a value of the request (a data
	// exception such as an invalid byte sequence or a number out of range,
	// or a check or not-null constraint). The same request fails again
	// (HTTP 400). Validation before the database should make this rare.
	ErrInvalidInput = errors.New("store: value refused by the database")
	// ErrConflict: a unique constraint refused the row (HTTP 409).
	ErrConflict = errors.New("store: conflicts with an existing row")
	// ErrInternal: anything else — a statement that does not match the
	// schema, a broken invariant. Neither the request nor a retry is at
	// fault (HTTP 500).
	ErrInternal = errors.New("store: internal database error")
)

// Error is a database error with its class. Its message is the underlying
// error's: fit for the server's log, not for a client (it may quote SQL
// or values). Tell clients Class and Code instead.
type Error struct {
	// Class is ErrUnavailable, ErrInvalidInput, ErrConflict or ErrInternal.
	Class error
	// Code is the SQLSTATE when the server answered with an error.
	Code string
	// Column and Constraint name what the server blamed, when it said.
	Column, Constraint string
	Err                error
}

func (e *Error) Error() string { return e.Err.Error() }

// Unwrap makes errors.Is match both the class and the underlying error.
func (e *Error) Unwrap() []error { return []error{e.Class, e.Err} }

// Classify sorts an error returned by a Store method into one of the classes
// above. nil stays nil; the store's own answers (ErrNotFound, ErrNotLeader)
// and errors already classified are returned unchanged.
//
// By SQLSTATE (PostgreSQL's appendix A): class 08 (connection), 53
// (insufficient resources), 57P01-57P05 (shutdown, cannot connect now),
// 57014 (statement timeout), 40001 and 40P01 (serialization failure,
// deadlock), 55P03 (lock not available), 25006 (read-only transaction: a
// standby after failover), SR001 (an insert into a shard the database
// does not hold: the shard moved to another database), 58 (system I/O), 28 (authentication) and 3D
// (database missing) are unavailability; 22 (data exception), 23502 and
// 23514 (not-null and check constraints) and 54 (program limit exceeded:
// a value too large or too deep) are invalid input; 23505 is a conflict.
// Without a server answer, timeouts, cancellations and network or
// connection errors are unavailability.
func Classify(err error) error {
	if err == nil || errors.Is(err, ErrNotFound) || errors.Is(err, ErrNotLeader) {
		return err
	}
	var done *Error
	if errors.As(err, &done) {
		return err
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		e := &Error{Class: classOf(pe.Code), Code: pe.Code, Column: pe.ColumnName, Constraint: pe.ConstraintName, Err: err}
		return e
	}
	if unavailable(err) {
		return &Error{Class: ErrUnavailable, Err: err}
	}
	return &Error{Class: ErrInternal, Err: err}
}

// Unavailable reports whether err, from one of the store's methods, means
// that the database could not serve the statement now (Classify gives it
// ErrUnavailable): the executor retries only such writes.
func (s *Store) Unavailable(err error) bool { return errors.Is(Classify(err), ErrUnavailable) }

func classOf(code string) error {
	switch {
	case code == "23505":
		return ErrConflict
	case code == "23502" || code == "23514" || strings.HasPrefix(code, "22") || strings.HasPrefix(code, "54"):
		return ErrInvalidInput
	case strings.HasPrefix(code, "08"), strings.HasPrefix(code, "53"), strings.HasPrefix(code, "58"),
		strings.HasPrefix(code, "28"), strings.HasPrefix(code, "3D"),
		code >= "57P01" && code <= "57P05", code == "57014",
		code == "40001", code == "40P01", code == "55P03", code == "25006",
		code == CodeNotHeld: // the shard moved to another database: send it there
		return ErrUnavailable
	}
	return ErrInternal
}

// unavailable reports errors that mean the database was not reached or did
// not answer in time.
func unavailable(err error) bool {
	var ne net.Error
	var ce *pgconn.ConnectError
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		pgconn.Timeout(err) || pgconn.SafeToRetry(err) ||
		errors.As(err, &ce) || errors.As(err, &ne) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, pgconn.ErrConnClosed) || strings.Contains(err.Error(), "closed pool")
}

// MaxMessage bounds a stored message (a handler's error, an interruption's
// reason): each failed attempt appends one to the task's errors.
const MaxMessage = 64 << 10

// StorableText makes a diagnostic message storable in a text or jsonb
// value: PostgreSQL refuses NUL and invalid UTF-8, and an outcome write it
// refused would be retried forever, holding back every other outcome of its
// batch (and the release of their shards). NUL becomes the four characters
// \x00, invalid bytes U+FFFD, and a message beyond MaxMessage bytes is
// cut. The message is for people; the attempt's failure is recorded as it
// happened.
func StorableText(s string) string {
	s = strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", `\x00`)
	if len(s) > MaxMessage {
		cut := MaxMessage
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…(truncated)"
	}
	return s
}
