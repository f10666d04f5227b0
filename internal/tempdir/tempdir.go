// Package tempdir makes temporary directories that record the process that
// owns them, so that directories left by a process that died without
// cleaning up (kill -9, a second Ctrl-C) are removed by the next one.
//
// A directory is recognised by the marker file written into it when it is
// made, never by its name alone: a directory of a matching name without a
// marker is left alone. The marker names the owner by pid, the start time of
// that pid's process and the boot it ran in, so that a pid the kernel has
// since given to another process does not keep a dead owner's directory
// alive, and a reboot ends every owner.
package tempdir

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// MarkerFile is the name of the marker written into each directory.
const MarkerFile = "owner.pid"

// Owner identifies a process across pid reuse and reboots.
type Owner struct {
	// Pid is the owner's process id; 0 means no owner was recorded.
	Pid int
	// Start is the process's start time in clock ticks since boot
	// (/proc/<pid>/stat, field 22); 0 when unknown.
	Start uint64
	// Boot is the kernel's boot id; empty when unknown.
	Boot string
}

// Self is the calling process as an Owner.
func Self() Owner {
	return Owner{Pid: os.Getpid(), Start: startTime(os.Getpid()), Boot: bootID()}
}

// Alive reports whether the process o names still runs; a zombie (killed,
// not yet reaped by its parent) does not. Without the start time (a marker
// of the first format) any process of that pid counts, and without /proc
// any pid that exists.
func (o Owner) Alive() bool {
	if o.Pid <= 0 {
		return false
	}
	if o.Boot != "" && o.Boot != bootID() {
		return false
	}
	if _, err := os.Stat("/proc/self/stat"); err == nil {
		start, running := procStat(o.Pid)
		return running && (o.Start == 0 || start == o.Start)
	}
	return syscall.Kill(o.Pid, 0) != syscall.ESRCH
}

func (o Owner) String() string {
	return fmt.Sprintf("%d %d %s\n", o.Pid, o.Start, o.Boot)
}

// parseOwner reads a marker: "pid start boot", or only "pid" as the first
// version of the marker wrote it.
func parseOwner(b []byte) (Owner, error) {
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return Owner{}, fmt.Errorf("empty marker")
	}
	pid, err := strconv.Atoi(f[0])
	if err != nil || pid <= 0 {
		return Owner{}, fmt.Errorf("marker pid %q is not a process id", f[0])
	}
	o := Owner{Pid: pid}
	if len(f) >= 2 {
		if o.Start, err = strconv.ParseUint(f[1], 10, 64); err != nil {
			return Owner{}, fmt.Errorf("marker start time %q is not a number", f[1])
		}
	}
	if len(f) >= 3 {
		o.Boot = f[2]
	}
	return o, nil
}

// New creates a directory named prefix* in the system temporary directory
// and records this process as its owner, after removing the prefix*
// directories whose owner is gone.
func New(prefix string) (string, error) {
	RemoveStale(prefix, nil)
	return NewOwnedBy("", prefix, Self())
}

// NewOwnedBy creates a directory named prefix* in parent (the system
// temporary directory when empty) with owner recorded in its marker,
// without removing anything: for callers that remove stale directories
// their own way, and for tests that need another process's directory.
func NewOwnedBy(parent, prefix string, owner Owner) (string, error) {
	// The directory appears under its final name only with its marker in
	// it (a rename), so that no one who looks for prefix* directories
	// meanwhile sees one without an owner.
	hidden, err := os.MkdirTemp(parent, "."+prefix)
	if err != nil {
		return "", fmt.Errorf("creating a temporary directory: %w", err)
	}
	if err := os.WriteFile(filepath.Join(hidden, MarkerFile), []byte(owner.String()), 0o644); err != nil {
		_ = os.RemoveAll(hidden)
		return "", fmt.Errorf("recording the owner of %s: %w", hidden, err)
	}
	dir := filepath.Join(filepath.Dir(hidden), strings.TrimPrefix(filepath.Base(hidden), "."))
	if err := os.Rename(hidden, dir); err != nil {
		_ = os.RemoveAll(hidden)
		return "", fmt.Errorf("naming the temporary directory %s: %w", dir, err)
	}
	return dir, nil
}

// RemoveStale deletes the prefix* directories in the system temporary
// directory that carry a marker whose owner is gone, unless inUse says a
// process still uses the directory (nil: nothing else does). It returns
// the directories it removed.
func RemoveStale(prefix string, inUse func(dir string) bool) []string {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), prefix+"*"))
	var removed []string
	for _, d := range dirs {
		o, ok := OwnerOf(d)
		if !ok || o.Alive() {
			continue
		}
		if inUse != nil && inUse(d) {
			continue
		}
		if os.RemoveAll(d) == nil {
			removed = append(removed, d)
		}
	}
	return removed
}

// OwnerOf returns the owner recorded in dir's marker, and false when dir
// has no readable marker.
func OwnerOf(dir string) (Owner, bool) {
	b, err := os.ReadFile(filepath.Join(dir, MarkerFile))
	if err != nil {
		return Owner{}, false
	}
	o, err := parseOwner(b)
	return o, err == nil
}

// startTime is pid's start time in clock ticks since boot, or 0.
func startTime(pid int) uint64 {
	start, _ := procStat(pid)
	return start
}

// procStat reads pid's start time from /proc and whether it still runs: a
// zombie (killed, not yet reaped by its parent) has stopped for good.
func procStat(pid int) (start uint64, running bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	// The command name (field 2) is in parentheses and may itself hold
	// spaces and parentheses: the fields after it start past the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return 0, false
	}
	start, err = strconv.ParseUint(f[19], 10, 64) // field 22
	if err != nil {
		return 0, false
	}
	return start, f[0] != "Z" && f[0] != "X"
}

func bootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
