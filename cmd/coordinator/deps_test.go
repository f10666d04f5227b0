package main

import (
	"os/exec"
	"strings"
	"testing"
)

// The coordinator runs no tasks: it needs the claims protocol's defaults
// (the runners' heartbeat interval, to check --stale-threshold against),
// not the executor that runs them, nor the runner (issue 42).
func TestCoordinatorDoesNotImportTheExecutor(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		switch dep {
		case "github.com/shardrun/shardrun/internal/executor", "github.com/shardrun/shardrun/internal/runner":
			t.Errorf("cmd/coordinator imports %s", dep)
		}
	}
}
