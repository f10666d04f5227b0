package shardrun_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestPublicSurfaceIsSmall is the check of issue 33: a program imports
// package shardrun (the client) and package tasks (the records and their
// vocabulary), and go doc on them shows nothing of the protocol between
// runners, the store and etcd.
func TestPublicSurfaceIsSmall(t *testing.T) {
	out, err := exec.Command("go", "list", "./...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	var public []string
	for _, p := range strings.Fields(string(out)) {
		rel := strings.TrimPrefix(strings.TrimPrefix(p, "github.com/shardrun/shardrun"), "/")
		switch {
		case strings.HasPrefix(rel, "internal/"), strings.HasPrefix(rel, "cmd/"), strings.HasPrefix(rel, "examples/"),
			rel == "integration", rel == "deploy":
		default:
			public = append(public, rel)
		}
	}
	if want := []string{"", "tasks"}; !slices.Equal(public, want) {
		t.Errorf("public packages %q, want only the client and tasks", public)
	}
	for _, pkg := range []string{".", "./tasks"} {
		out, err := exec.Command("go", "doc", "-all", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go doc %s: %v\n%s", pkg, err, out)
		}
		doc := string(out)
		for _, protocol := range []string{"RaiseFences", "SweepStale", "Claim(", "Heartbeat(", "ShardEpoch", "Registry",
			"FailUnrunnable", "Fence", "internal/", "store.", "claims."} {
			if strings.Contains(doc, protocol) {
				t.Errorf("go doc %s shows %q", pkg, protocol)
			}
		}
	}
}
