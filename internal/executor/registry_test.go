package executor

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/shardrun/shardrun/tasks"
)

func TestRegistry(t *testing.T) {
	r := NewRegistry()
	var got int64
	h := tasks.Handler(func(_ context.Context, t *tasks.Task) error { got = t.ID; return nil })
	if err := r.Register("resize", h); err != nil {
		t.Fatal(err)
	}
	if err := r.Register("resize", h); err == nil {
		t.Fatal("duplicate registration accepted")
	}
	if err := r.Register("", h); err == nil {
		t.Fatal("empty kind accepted")
	}
	if err := r.Register("a\x00", h); err == nil {
		t.Fatal("a kind with NUL accepted")
	}
	if err := r.Register("x", nil); err == nil {
		t.Fatal("nil handler accepted")
	}
	fn, ok := r.Lookup("resize")
	if !ok || strings.Join(r.Kinds(), ",") != "resize" {
		t.Fatal("lookup")
	}
	if err := fn(context.Background(), &tasks.Task{ID: 3}); err != nil || got != 3 {
		t.Fatalf("the handler looked up: %v %d", err, got)
	}
}

// TestRegistryOnly: a narrowed registry has the kinds asked for and no
// others; a kind without a handler is an error naming it.
func TestRegistryOnly(t *testing.T) {
	r := NewRegistry()
	for _, k := range []string{"a", "b", "c"} {
		if err := r.Register(k, func(context.Context, *tasks.Task) error { return nil }); err != nil {
			t.Fatal(err)
		}
	}
	only, err := r.Only([]string{"c", "a", "c"})
	if err != nil || !slices.Equal(only.Kinds(), []string{"a", "c"}) {
		t.Fatalf("Only(c, a, c): %v, %v", only.Kinds(), err)
	}
	if _, err := r.Only([]string{"a", "gpu"}); err == nil || !strings.Contains(err.Error(), `"gpu"`) {
		t.Errorf("Only(a, gpu): %v; want an error naming gpu", err)
	}
}
