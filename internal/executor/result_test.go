package executor

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/tasks"
)

// A result the database could not store fails the attempt instead of
// wedging the outcome writer.
func TestUnstorableResultFailsTheAttempt(t *testing.T) {
	t.Parallel()
	for result, ok := range map[string]bool{`{"n": 1}`: true, `{"s": "\u0000"}`: false, `{"a": 1, "a": 2}`: false, `{nope`: false} {
		task := &tasks.Task{ID: 1}
		err := call(context.Background(), func(_ context.Context, t *tasks.Task) error {
			t.Result = json.RawMessage(result)
			return nil
		}, task)
		if ok != (err == nil) || (!ok && (!errors.Is(err, jsonbody.ErrInvalid) || task.Result != nil)) {
			t.Errorf("result %s: %v (result kept: %s)", result, err, task.Result)
		}
	}
}
