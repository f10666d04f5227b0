package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/shardrun/shardrun/internal/jsonbody"
)

// Handler runs one attempt of a task. ctx is cancelled when the runner loses
// the task's shard, detaches or shuts down, and when an operator cancels
// the task (its cause is then ErrCancelled: CancelRequested(ctx)); a
// handler must return promptly then. A nil error completes the task, also
// after a cancel request: the handler says its work is done, and its result
// is kept. Any other error fails the attempt (retried with backoff while
// attempts are left), or, after a cancel request, ends the task cancelled.
type Handler func(ctx context.Context, t *Task) error

// ErrPayload wraps payload decoding errors from Typed handlers.
// A payload error is permanent: the same payload will not decode on the
// next attempt either.
var ErrPayload = fmt.Errorf("decoding payload (%w)", ErrPermanent)

// Typed adapts a handler that takes a decoded payload of type P. A payload
// that does not decode into P fails the task at once with the decode
// error, which wraps ErrPayload and so ErrPermanent: no retry would decode
// it either.
func Typed[P any](fn func(ctx context.Context, t *Task, payload P) error) Handler {
	return func(ctx context.Context, t *Task) error {
		var p P
		if err := json.Unmarshal(t.Payload, &p); err != nil {
			return fmt.Errorf("%w of %s task %d: %w", ErrPayload, t.Kind, t.ID, err)
		}
		return fn(ctx, t, p)
	}
}

// SetResult stores v, as JSON, as the task's result when the attempt
// completes. A result PostgreSQL's jsonb cannot store (a string holding
// NUL, which encoding/json writes as \u0000; nesting deeper than
// jsonbody.MaxDepth) is refused here, where the handler can still do
// something about it, rather than when the completion is written.
func (t *Task) SetResult(v any) error {
	b, err := json.Marshal(v)
	if err == nil {
		err = jsonbody.Check(b)
	}
	if err != nil {
		return fmt.Errorf("encoding result of task %d: %w", t.ID, err)
	}
	t.Result = b
	return nil
}

// Registry maps task kinds to handlers. A runner claims only the kinds it
// has handlers for, so tasks of other kinds wait for a runner that has one.
type Registry struct {
	mu       sync.RWMutex
	handlers map[string]Handler
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{handlers: map[string]Handler{}} }

// Register adds the handler for kind.
func (r *Registry) Register(kind string, h Handler) error {
	if err := CheckKind(kind); err != nil {
		return err
	}
	if h == nil {
		return &FieldError{Field: "handler", Problem: fmt.Sprintf("nil handler for kind %q", kind)}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.handlers[kind]; dup {
		return &FieldError{Field: "kind", Problem: fmt.Sprintf("a handler for %q is already registered", kind)}
	}
	r.handlers[kind] = h
	return nil
}

// Lookup returns the handler for kind.
func (r *Registry) Lookup(kind string) (Handler, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	h, ok := r.handlers[kind]
	return h, ok
}

// Kinds returns the registered kinds, sorted.
func (r *Registry) Kinds() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	kinds := make([]string, 0, len(r.handlers))
	for k := range r.handlers {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	return kinds
}

// Only returns a registry of the handlers of kinds, or an error naming the
// first kind r has no handler for.
func (r *Registry) Only(kinds []string) (*Registry, error) {
	out := NewRegistry()
	for _, kind := range kinds {
		h, ok := r.Lookup(kind)
		if !ok {
			return nil, fmt.Errorf("no handler for kind %q (this runner has %s)", kind, strings.Join(r.Kinds(), ", "))
		}
		if _, dup := out.Lookup(kind); !dup {
			out.handlers[kind] = h
		}
	}
	return out, nil
}
