package main

// CPU caps for the databases section: a cgroup v1 cpu quota per PostgreSQL
// server, and its CPU read from the cgroup's cpuacct.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// cgroupCPURoot and cgroupCPUAcctRoot are the cgroup v1 hierarchies of the
// cpu and cpuacct controllers (one hierarchy when both are mounted
// together: cpu is then a link to cpu,cpuacct).
const (
	cgroupCPURoot     = "/sys/fs/cgroup/cpu"
	cgroupCPUAcctRoot = "/sys/fs/cgroup/cpuacct"
)

// cpuCap is a cgroup v1 cpu group with a quota (cpu.cfs_quota_us over
// cpu.cfs_period_us) and, when the machine has the cpuacct controller, a
// cpuacct group holding the same processes, whose cpuacct.usage is their
// CPU.
type cpuCap struct {
	cpuDir  string
	acctDir string // empty: no cpuacct controller
	cores   float64
}

// checkCgroupV1 says why the cpu quota cannot be set here, or nil.
func checkCgroupV1() error {
	quota := filepath.Join(cgroupCPURoot, "cpu.cfs_quota_us")
	if _, err := os.Stat(quota); err != nil {
		return fmt.Errorf("no cgroup v1 cpu controller (%s: %v): the databases section caps each PostgreSQL server's CPU with a cgroup v1 cpu quota, which this machine does not offer (cgroup v2 only, or the cpu controller not mounted)", quota, err)
	}
	return nil
}

// newCPUCap makes the groups name under the cpu (and cpuacct) hierarchy
// and caps the cpu group at cores over period (cores 0: no quota), its
// cpu.shares set to shares when not 0 (the default is 1024: a group
// weighs against the other processes of the machine as one process).
func newCPUCap(name string, cores float64, period time.Duration, shares int) (*cpuCap, error) {
	if err := checkCgroupV1(); err != nil {
		return nil, err
	}
	c := &cpuCap{cpuDir: filepath.Join(cgroupCPURoot, name), cores: cores}
	if err := os.Mkdir(c.cpuDir, 0o755); err != nil {
		return nil, fmt.Errorf("making the cgroup %s (the cgroup v1 cpu hierarchy must be writable: run as root): %w", c.cpuDir, err)
	}
	var settings [][2]string
	if cores > 0 {
		periodUS := period.Microseconds()
		settings = append(settings, [2]string{"cpu.cfs_period_us", strconv.FormatInt(periodUS, 10)},
			[2]string{"cpu.cfs_quota_us", strconv.FormatInt(int64(cores*float64(periodUS)), 10)})
	}
	if shares > 0 {
		settings = append(settings, [2]string{"cpu.shares", strconv.Itoa(shares)})
	}
	for _, kv := range settings {
		if err := writeCgroup(c.cpuDir, kv[0], kv[1]); err != nil {
			_ = c.remove()
			return nil, err
		}
	}
	switch {
	case fileExists(filepath.Join(c.cpuDir, "cpuacct.usage")):
		c.acctDir = c.cpuDir // cpu,cpuacct mounted together
	case fileExists(filepath.Join(cgroupCPUAcctRoot, "cpuacct.usage")):
		dir := filepath.Join(cgroupCPUAcctRoot, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			_ = c.remove()
			return nil, fmt.Errorf("making the cgroup %s: %w", dir, err)
		}
		c.acctDir = dir
	}
	return c, nil
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func writeCgroup(dir, file, value string) error {
	if err := os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644); err != nil {
		return fmt.Errorf("writing %s to %s: %w", value, filepath.Join(dir, file), err)
	}
	return nil
}

// add moves a process into the groups; its children forked afterwards are
// born in them.
func (c *cpuCap) add(pid int) error {
	dirs := []string{c.cpuDir}
	if c.acctDir != "" && c.acctDir != c.cpuDir {
		dirs = append(dirs, c.acctDir)
	}
	for _, dir := range dirs {
		if err := writeCgroup(dir, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// usage is the CPU seconds of the group's processes so far (cpuacct);
// false without the cpuacct controller.
func (c *cpuCap) usage() (float64, bool) {
	if c.acctDir == "" {
		return 0, false
	}
	b, err := os.ReadFile(filepath.Join(c.acctDir, "cpuacct.usage"))
	if err != nil {
		return 0, false
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, false
	}
	return float64(ns) / 1e9, true
}

// throttling is the cpu group's cpu.stat: periods with runnable
// processes, and those in which the quota ran out.
type throttling struct{ periods, throttled int64 }

func (c *cpuCap) throttling() throttling {
	var t throttling
	b, err := os.ReadFile(filepath.Join(c.cpuDir, "cpu.stat"))
	if err != nil {
		return t
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) != 2 {
			continue
		}
		v, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "nr_periods":
			t.periods = v
		case "nr_throttled":
			t.throttled = v
		}
	}
	return t
}

// remove moves what is left in the groups to their parents and removes
// them.
func (c *cpuCap) remove() error {
	var errs []error
	for _, dir := range []string{c.acctDir, c.cpuDir} {
		if dir == "" || !fileExists(dir) {
			continue
		}
		if b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil {
			for _, pid := range strings.Fields(string(b)) {
				_ = writeCgroup(filepath.Dir(dir), "cgroup.procs", pid)
			}
		}
		if err := os.Remove(dir); err != nil {
			errs = append(errs, fmt.Errorf("removing the cgroup %s: %w", dir, err))
		}
	}
	return errors.Join(errs...)
}
