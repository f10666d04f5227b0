package executor

import (
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/shardrun/shardrun/tasks"
)

// Registry maps task kinds to handlers. A runner claims only the kinds it
// has handlers for, so tasks of other kinds wait for a runner that has one.
type Registry struct {
	mu       sync.RWMutex
	handlers map[string]tasks.Handler
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{handlers: map[string]tasks.Handler{}} }

// Register adds the handler for kind.
func (r *Registry) Register(kind string, h tasks.Handler) error {
	if err := tasks.CheckKind(kind); err != nil {
		return err
	}
	if h == nil {
		return &tasks.FieldError{Field: "handler", Problem: fmt.Sprintf("nil handler for kind %q", kind)}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.handlers[kind]; dup {
		return &tasks.FieldError{Field: "kind", Problem: fmt.Sprintf("a handler for %q is already registered", kind)}
	}
	r.handlers[kind] = h
	return nil
}

// Lookup returns the handler for kind.
func (r *Registry) Lookup(kind string) (tasks.Handler, bool) {
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
