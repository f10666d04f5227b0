package tempdir

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// childEnv makes the test binary, started again by a test, create a
// directory with New and then wait to be killed.
const childEnv = "TEMPDIR_TEST_CHILD_PREFIX"

func TestMain(m *testing.M) {
	if prefix := os.Getenv(childEnv); prefix != "" {
		dir, err := New(prefix)
		if err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Stdout.WriteString(dir + "\n")
		_, _ = os.Stdin.Read(make([]byte, 1)) // until the test kills us
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestSIGKILLedOwner: a directory stays while its owner runs, even as a
// zombie is not mistaken for a live owner, and goes once the owner was
// killed with SIGKILL (no chance to clean up).
func TestSIGKILLedOwner(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	const prefix = "tempdir-test-"
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), childEnv+"="+prefix)
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		_ = child.Process.Kill()
		_ = child.Wait()
		t.Fatalf("the child made no directory: %v", err)
	}
	dir := strings.TrimSpace(line)
	if o, ok := OwnerOf(dir); !ok || o.Pid != child.Process.Pid || !o.Alive() {
		t.Errorf("marker of %s: %+v %v; want the running child %d", dir, o, ok, child.Process.Pid)
	}
	if removed := RemoveStale(prefix, nil); len(removed) != 0 {
		t.Fatalf("removed %v while its owner runs", removed)
	}
	if err := child.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Not reaped: the child is a zombie until Wait, and already gone. The
	// signal is delivered asynchronously, hence the polling.
	deadline := time.Now().Add(10 * time.Second)
	var removed []string
	for len(removed) == 0 && time.Now().Before(deadline) {
		removed = RemoveStale(prefix, nil)
		time.Sleep(time.Millisecond)
	}
	if !slices.Equal(removed, []string{dir}) {
		t.Errorf("after SIGKILL removed %v, want %s", removed, dir)
	}
	_ = child.Wait()
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s still exists: %v", dir, err)
	}
}

// TestWhatRemoveStaleLeaves: only a marker whose owner is gone counts;
// the name alone, a live owner, or a caller's in-use check keep the
// directory.
func TestWhatRemoveStaleLeaves(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	const prefix = "tempdir-test-"
	me := Self()
	if me.Start == 0 || me.Boot == "" {
		t.Fatalf("no start time or boot id for this process: %+v", me)
	}
	mk := func(o Owner) string {
		d, err := NewOwnedBy("", prefix, o)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	live := mk(me)
	reused := mk(Owner{Pid: me.Pid, Start: me.Start + 1, Boot: me.Boot}) // our pid, another process's start
	rebooted := mk(Owner{Pid: me.Pid, Start: me.Start, Boot: "another-boot"})
	oldFormat := filepath.Join(os.TempDir(), prefix+"old")
	if err := os.Mkdir(oldFormat, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(oldFormat, MarkerFile), []byte("1\n"), 0o644); err != nil { // init: alive
		t.Fatal(err)
	}
	noMarker := filepath.Join(os.TempDir(), prefix+"by-name-only")
	if err := os.Mkdir(noMarker, 0o755); err != nil {
		t.Fatal(err)
	}
	busy := mk(Owner{Pid: me.Pid, Start: me.Start + 2, Boot: me.Boot})

	removed := RemoveStale(prefix, func(dir string) bool { return dir == busy })
	slices.Sort(removed)
	want := []string{reused, rebooted}
	slices.Sort(want)
	if !slices.Equal(removed, want) {
		t.Errorf("removed %v, want %v", removed, want)
	}
	for _, d := range []string{live, oldFormat, noMarker, busy} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("%s should stay: %v", d, err)
		}
	}
	if hidden, _ := filepath.Glob(filepath.Join(os.TempDir(), "."+prefix+"*")); len(hidden) != 0 {
		t.Errorf("directories left under their creation name: %v", hidden)
	}
}
