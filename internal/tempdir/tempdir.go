// Package tempdir makes temporary directories that record the process that
// owns them, so that directories left by a process that died without
// cleaning up (kill -9, a second Ctrl-C) are removed by the next one.
package tempdir

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

const ownerFile = "owner.pid"

// New creates a directory named prefix* in the system temporary directory
// and records this process as its owner, after removing the prefix*
// directories whose owner is gone.
func New(prefix string) (string, error) {
	RemoveStale(prefix)
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return "", fmt.Errorf("creating a temporary directory: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		_ = os.RemoveAll(dir)
		return "", fmt.Errorf("recording the owner of %s: %w", dir, err)
	}
	return dir, nil
}

// RemoveStale deletes prefix* directories whose owning process no longer
// exists.
func RemoveStale(prefix string) {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), prefix+"*"))
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, ownerFile))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid == os.Getpid() {
			continue
		}
		if syscall.Kill(pid, 0) == syscall.ESRCH {
			_ = os.RemoveAll(d)
		}
	}
}

// Owner returns the pid recorded in dir, or 0.
func Owner(dir string) int {
	b, err := os.ReadFile(filepath.Join(dir, ownerFile))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}
