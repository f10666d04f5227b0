package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/tasks"
)

// Bounds of the built-in kinds' payloads.
const (
	// MaxSleepMS bounds sleep's ms (24 hours): a longer sleep holds a
	// worker and a heartbeat for longer than any demo or test needs, and
	// ms * 1e6 must not overflow a time.Duration.
	MaxSleepMS = 24 * 60 * 60 * 1000
	// MaxFailTimes bounds fail's times: a task never has more attempts.
	MaxFailTimes = tasks.MaxAttemptsLimit
)

// Builtins are the task kinds every shardrun runner binary handles, for
// demos, tests and benchmarks:
//
//	noop                  completes at once (any payload)
//	sleep {"ms": N}       sleeps N milliseconds, 0 <= N <= MaxSleepMS; honours cancellation;
//	  {"ms": N, "log": true} also logs when it starts and ends, by its own clock
//	  (what the sequence tests check ordering against)
//	fail  {"times": N}    fails its first N attempts, 0 <= N <= MaxFailTimes, then completes
//
// Payloads are decoded strictly (internal/jsonbody: exact field names, no
// unknown fields); {} means zero. A payload that does not decode or is out
// of bounds ends the task dead at its first attempt: the error wraps
// tasks.ErrPayload, which wraps tasks.ErrPermanent, since no retry would
// decode it either.
func Builtins(log hclog.Logger) map[string]tasks.Handler {
	return map[string]tasks.Handler{
		"noop": func(context.Context, *tasks.Task) error { return nil },
		"sleep": func(ctx context.Context, t *tasks.Task) error {
			d, logged, err := decodeSleep(t.Payload)
			if err != nil {
				return fmt.Errorf("sleep task %d: %w", t.ID, err)
			}
			start := time.Now()
			if logged {
				log.Info("sleep started", "task", t.ID, "attempt", t.Attempt, "sequence_key", t.SequenceKey,
					"start", start.Format(time.RFC3339Nano))
			}
			timer := time.NewTimer(d)
			defer timer.Stop()
			select {
			case <-timer.C:
				err = nil
			case <-ctx.Done():
				err = fmt.Errorf("sleep interrupted: %w", context.Cause(ctx))
			}
			if logged {
				log.Info("sleep ended", "task", t.ID, "attempt", t.Attempt, "sequence_key", t.SequenceKey,
					"start", start.Format(time.RFC3339Nano), "end", time.Now().Format(time.RFC3339Nano), "interrupted", err != nil)
			}
			return err
		},
		"fail": func(_ context.Context, t *tasks.Task) error {
			times, err := decodeFail(t.Payload)
			if err != nil {
				return fmt.Errorf("fail task %d: %w", t.ID, err)
			}
			if t.Attempt <= times {
				return fmt.Errorf("fail: attempt %d of the first %d that fail", t.Attempt, times)
			}
			return nil
		},
	}
}

// decodeBuiltin decodes a built-in's payload strictly; an empty payload is
// {}. Errors wrap tasks.ErrPayload.
func decodeBuiltin(payload json.RawMessage, v any) error {
	if len(payload) == 0 {
		return nil
	}
	if err := jsonbody.Decode(payload, v); err != nil {
		return fmt.Errorf("%w: %w", tasks.ErrPayload, err)
	}
	return nil
}

// decodeSleep returns how long a sleep task sleeps and whether it logs.
func decodeSleep(payload json.RawMessage) (time.Duration, bool, error) {
	var p struct {
		MS  int64 `json:"ms"`
		Log bool  `json:"log"`
	}
	ms, err := decodeBounded(payload, &p, &p.MS, "ms", MaxSleepMS, " (24h)")
	return time.Duration(ms) * time.Millisecond, p.Log, err
}

// decodeFail returns how many first attempts of a fail task fail.
func decodeFail(payload json.RawMessage) (int, error) {
	var p struct {
		Times int `json:"times"`
	}
	return decodeBounded(payload, &p, &p.Times, "times", MaxFailTimes, "")
}

// decodeBounded decodes a built-in's payload into p, a struct whose one
// field *n is named field, and checks 0 <= *n <= max (note adds to the
// bound in the message). Errors wrap tasks.ErrPayload.
func decodeBounded[N int | int64](payload json.RawMessage, p any, n *N, field string, max N, note string) (N, error) {
	if err := decodeBuiltin(payload, p); err != nil {
		return 0, err
	}
	if *n < 0 || *n > max {
		return 0, fmt.Errorf("%w: %s must be 0 to %d%s, got %d", tasks.ErrPayload, field, max, note, *n)
	}
	return *n, nil
}

// HandleBuiltins registers Builtins on r.
func (r *Runner) HandleBuiltins() error {
	for kind, h := range Builtins(r.log.Named("builtin")) {
		if err := r.Handle(kind, h); err != nil {
			return err
		}
	}
	return nil
}
