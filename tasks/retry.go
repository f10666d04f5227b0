package tasks

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"
)

// RetryPolicy decides how often a task is attempted and how long a failed
// attempt waits before the next one.
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

// DefaultRetryPolicy returns the policy used when none is configured.
func DefaultRetryPolicy() RetryPolicy {
	return RetryPolicy{MaxAttempts: DefaultMaxAttempts, Base: DefaultRetryBase, Cap: DefaultRetryCap}
}

// Validate reports the first bad field.
func (p RetryPolicy) Validate() error {
	switch {
	case p.MaxAttempts < 1:
		return &FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be at least 1, got %d", p.MaxAttempts)}
	case p.Base <= 0:
		return &FieldError{Field: "retry_base", Problem: fmt.Sprintf("must be positive, got %s", p.Base)}
	case p.Cap < p.Base:
		return &FieldError{Field: "retry_cap", Problem: fmt.Sprintf("must be at least retry_base (%s), got %s", p.Base, p.Cap)}
	}
	return nil
}

// Backoff returns the delay after failed attempt number attempt (1-based):
// min(Cap, Base * 2^(attempt-1)) scaled by a uniform factor in [0.5, 1), the
// "equal jitter" that keeps retries of a burst of failures apart while
// bounding the wait. The SQL function shardrun_backoff computes the same for
// the sweeper. rnd returns values in [0, 1); nil uses math/rand/v2.
func (p RetryPolicy) Backoff(attempt int, rnd func() float64) time.Duration {
	if rnd == nil {
		rnd = rand.Float64
	}
	if attempt < 1 {
		attempt = 1
	}
	d := math.Min(float64(p.Cap), float64(p.Base)*math.Pow(2, float64(attempt-1)))
	return time.Duration(d * (0.5 + rnd()*0.5))
}
