package integration

import (
	"os"
	"slices"
	"testing"

	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/tempdir"
)

// TestStrayDirectoriesAreNotTheSuites: the directories a demo killed with
// SIGKILL leaves in the machine's temporary directory (their owner gone)
// do not fail the leak check, while the same left under the suite's own
// temporary root still does.
func TestStrayDirectoriesAreNotTheSuites(t *testing.T) {
	outer := pgtest.OuterTempDir()
	if outer == "" || outer == os.TempDir() {
		t.Fatalf("the tests do not run under a temporary root of their own (TMPDIR %s)", os.TempDir())
	}
	me := tempdir.Self()
	gone := tempdir.Owner{Pid: me.Pid, Start: me.Start + 1, Boot: me.Boot} // our pid, reused: its owner is gone
	mk := func(parent, prefix string) string {
		d, err := tempdir.NewOwnedBy(parent, prefix, gone)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.RemoveAll(d) })
		return d
	}
	var strays []string
	for _, prefix := range ourPrefixes {
		strays = append(strays, mk(outer, prefix))
	}
	if left := leftBehind(); len(left) != 0 {
		t.Errorf("the leak check reports %v with strays %v outside the suite's root", left, strays)
	}
	leak := mk("", "shardrun-dev-")
	if left := leftBehind(); !slices.Equal(left, []string{leak}) {
		t.Errorf("the leak check reports %v, want the directory left under the suite's root %s", left, leak)
	}
}
