package runner

import (
	"context"
	"fmt"
	"time"

	"github.com/shardrun/shardrun/tasks"
)

// Builtins are the task kinds every shardrun runner binary handles, for
// demos, tests and benchmarks:
//
//	noop                  completes at once
//	sleep {"ms": N}       sleeps N milliseconds; honours cancellation
//	fail  {"times": N}    fails its first N attempts, then completes
func Builtins() map[string]tasks.Handler {
	return map[string]tasks.Handler{
		"noop": func(context.Context, *tasks.Task) error { return nil },
		"sleep": tasks.Typed(func(ctx context.Context, _ *tasks.Task, p struct {
			MS int `json:"ms"`
		}) error {
			if p.MS < 0 {
				return fmt.Errorf("sleep: ms must not be negative, got %d", p.MS)
			}
			t := time.NewTimer(time.Duration(p.MS) * time.Millisecond)
			defer t.Stop()
			select {
			case <-t.C:
				return nil
			case <-ctx.Done():
				return fmt.Errorf("sleep interrupted: %w", context.Cause(ctx))
			}
		}),
		"fail": tasks.Typed(func(_ context.Context, t *tasks.Task, p struct {
			Times int `json:"times"`
		}) error {
			if t.Attempt <= p.Times {
				return fmt.Errorf("fail: attempt %d of the first %d that fail", t.Attempt, p.Times)
			}
			return nil
		}),
	}
}

// HandleBuiltins registers Builtins on r.
func (r *Runner) HandleBuiltins() error {
	for kind, h := range Builtins() {
		if err := r.Handle(kind, h); err != nil {
			return err
		}
	}
	return nil
}
