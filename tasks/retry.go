package tasks

import (
	"fmt"
	"time"
)

// RetryPolicy decides how often a task is attempted and how long a failed
// attempt waits before the next one: the store waits min(Cap, Base *
// 2^(n-1)) scaled by a random factor in [0.5, 1) after the n-th failed
// attempt of the task's current budget (the SQL function
// shardrun_backoff, the one place of the formula).
type RetryPolicy struct {
	// MaxAttempts is the default number of attempts for tasks enqueued
	// without one. Default 5.
	MaxAttempts int
	// Base is the delay after the first failed attempt. Default 1s.
	Base time.Duration
	// Cap bounds the delay. Default 5m.
	Cap time.Duration
}

// Retry policy defaults.
const (
	DefaultMaxAttempts = 5
	DefaultRetryBase   = time.Second
	DefaultRetryCap    = 5 * time.Minute
)

// Retry policy bounds.
const (
	// MinRetryBase: the sweeper's SQL backoff (shardrun_backoff) counts
	// whole milliseconds, so a shorter base would be no backoff at all.
	MinRetryBase = time.Millisecond
	// MaxRetryCap: a task that should wait longer than a day between
	// attempts is better enqueued again with a run_after.
	MaxRetryCap = 24 * time.Hour
)

// DefaultRetryPolicy returns the policy used when none is configured.
func DefaultRetryPolicy() RetryPolicy {
	return RetryPolicy{MaxAttempts: DefaultMaxAttempts, Base: DefaultRetryBase, Cap: DefaultRetryCap}
}

// Validate reports the first bad field by its flag (--max-attempts,
// --retry-base, --retry-cap). It checks the policy as it is: zero fields are
// errors here (NewExecutor fills a zero policy with the defaults first).
func (p RetryPolicy) Validate() error {
	if err := ValidateMaxAttempts(p.MaxAttempts); err != nil {
		return err
	}
	return ValidateBackoff(p.Base, p.Cap)
}

// ValidateMaxAttempts checks a default number of attempts (--max-attempts).
func ValidateMaxAttempts(n int) error {
	if n < 1 || n > MaxAttemptsLimit {
		return fmt.Errorf("--max-attempts: must be 1 to %d (each failed attempt adds to the task's errors), got %d", MaxAttemptsLimit, n)
	}
	return nil
}

// ValidateBackoff checks --retry-base and --retry-cap, for the executor's
// policy and the sweeper's SQL backoff alike.
func ValidateBackoff(base, cap time.Duration) error {
	switch {
	case base < MinRetryBase || base > MaxRetryCap:
		return fmt.Errorf("--retry-base: must be %s to %s (the backoff counts whole milliseconds), got %s", MinRetryBase, MaxRetryCap, base)
	case cap < base || cap > MaxRetryCap:
		return fmt.Errorf("--retry-cap: must be at least --retry-base (%s) and at most %s (wait longer with a new task's run_after), got %s", base, MaxRetryCap, cap)
	}
	return nil
}
