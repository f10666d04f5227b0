package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat's utime and stime.
// It is 100 on every Linux architecture Go supports (the kernel's ABI
// fixes it, whatever CONFIG_HZ is), and golang.org/x/sys/unix has no
// sysconf(_SC_CLK_TCK) to ask.
const clockTicks = 100

// processCPU is the user plus system CPU seconds of an exited process.
func processCPU(ps *os.ProcessState) float64 {
	if ps == nil {
		return 0
	}
	return (ps.UserTime() + ps.SystemTime()).Seconds()
}

// procStat is what the bench needs of /proc/<pid>/stat.
type procStat struct {
	ppid  int
	start uint64  // starttime, in clock ticks after boot
	cpu   float64 // utime + stime, seconds
}

func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return procStat{}, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	// f[0] is field 3 (state): ppid is field 4, utime 14, stime 15, starttime 22.
	var st procStat
	st.ppid, _ = strconv.Atoi(f[1])
	ut, _ := strconv.ParseUint(f[11], 10, 64)
	stime, _ := strconv.ParseUint(f[12], 10, 64)
	st.start, _ = strconv.ParseUint(f[19], 10, 64)
	st.cpu = float64(ut+stime) / clockTicks
	return st, nil
}

// postmasterPID is the pid of the bench server's postmaster: the parent of
// a backend (pgtmp does not expose it, and its data directory may belong to
// another user).
func (e *env) postmasterPID(ctx context.Context) (int, error) {
	return postmasterOf(ctx, e.pg.DSN("postgres"))
}

// procKey is a process's identity: pids are reused.
type procKey struct {
	pid   int
	start uint64
}

// pgCPU measures the CPU seconds the PostgreSQL server spends from start to
// stop: the postmaster and all its children (backends, autovacuum, WAL
// writer, checkpointer...).
//
// Method: a process's CPU can only be read while it exists, and backends
// exit when their client disconnects (the workers' backends when the
// workers stop). So pgCPU samples /proc every 100ms and keeps, per process
// (pid and start time), its first and latest reading; processes already
// there at start count from their reading then, those born later from 0.
// The total is the sum of latest minus first. The caller stops it right
// after the work is done, while the workers are still connected, so their
// backends are read to the end. What is lost: a process born and gone
// between two samples (a short autovacuum worker), and the last <100ms of
// one that exited. The bench's own connections (its completion polls) are
// backends too and are counted, for both systems alike.
type pgCPU struct {
	postmaster int
	mu         sync.Mutex
	first      map[procKey]float64
	last       map[procKey]float64
	quit       chan struct{}
	wg         sync.WaitGroup
}

func startPGCPU(postmaster int) *pgCPU {
	m := &pgCPU{postmaster: postmaster, first: map[procKey]float64{}, last: map[procKey]float64{}, quit: make(chan struct{})}
	m.sample(true)
	m.wg.Go(func() {
		for {
			select {
			case <-m.quit:
				return
			case <-time.After(100 * time.Millisecond):
			}
			m.sample(false)
		}
	})
	return m
}

func (m *pgCPU) sample(initial bool) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		st, err := readProcStat(pid)
		if err != nil || (pid != m.postmaster && st.ppid != m.postmaster) {
			continue
		}
		key := procKey{pid: pid, start: st.start}
		if _, seen := m.first[key]; !seen {
			if initial {
				m.first[key] = st.cpu
			} else {
				m.first[key] = 0
			}
		}
		m.last[key] = st.cpu
	}
}

// stop takes a last sample and returns the CPU seconds since start.
func (m *pgCPU) stop() float64 {
	close(m.quit)
	m.wg.Wait()
	m.sample(false)
	m.mu.Lock()
	defer m.mu.Unlock()
	var sum float64
	for k, v := range m.last {
		sum += v - m.first[k]
	}
	return sum
}
