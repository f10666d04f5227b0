package shardrun_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestPublicSurfaceIsSmall: a program imports package shardrun (the
// client), package tasks (the records and their vocabulary) and, in its
// tests, shardruntest; go doc on them shows nothing of the protocol
// between runners, the store and etcd. The protocol packages (shard,
// detach, sweeper, store) stand at the top level, where the design brief
// puts them, and each says in its package doc that it is protocol, under
// no compatibility promise to library users; everything else is internal.
func TestPublicSurfaceIsSmall(t *testing.T) {
	out, err := exec.Command("go", "list", "./...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	library := []string{"", "shardruntest", "tasks"}
	protocol := []string{"detach", "shard", "store", "sweeper"}
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
	want := slices.Sorted(slices.Values(append(slices.Clone(library), protocol...)))
	if slices.Sort(public); !slices.Equal(public, want) {
		t.Errorf("public packages %q, want the library %q and the protocol %q", public, library, protocol)
	}
	for _, pkg := range protocol {
		out, err := exec.Command("go", "doc", "./"+pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go doc %s: %v\n%s", pkg, err, out)
		}
		if !strings.Contains(strings.Join(strings.Fields(string(out)), " "), "one of the cluster's protocol packages") {
			t.Errorf("package %s's doc does not say it is a protocol package, under no compatibility promise", pkg)
		}
	}
	for _, pkg := range []string{".", "./tasks", "./shardruntest"} {
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
