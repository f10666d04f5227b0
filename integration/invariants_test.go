package integration

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/shardrun/shardrun/internal/tempdir"
	"github.com/shardrun/shardrun/tasks"
)

// summary is what a scenario prints.
type summary struct {
	tasks           int
	duration        time.Duration
	fenceRejections float64
	acquisitions    int
}

// finish drains the work, stops every live process with SIGTERM (each must
// exit cleanly), and checks the invariants:
//
//  1. every enqueued task reached its expected terminal state (noop and
//     sleep completed, fail beyond its attempts dead), none ready or running,
//     and every completed task ran on a runner that serves its queue and
//     handles its kind;
//  2. no recorded outcome came from a stale epoch: every completed task was
//     claimed by the runner that held its shard's key at exactly that epoch,
//     as etcd's history shows;
//  3. no unit (a shard of a group) was owned twice at once: in the owner
//     keys' history (owners/<group>/<runner>) a unit is acquired only while
//     no runner holds it, with an epoch that grows (checkEtcdHistory);
//  4. no temporary directory of ours is left behind.
func (c *cluster) finish(drain time.Duration) summary {
	c.t.Helper()
	c.waitDrained(drain)
	s := summary{duration: time.Since(c.start)}
	for _, p := range c.all() {
		if p.kind == "runner" && !p.exited && !p.killed {
			s.fenceRejections += c.metric(p, "shardrun_fence_rejections_total")
		}
	}
	for _, p := range c.all() {
		if !p.exited && !p.killed {
			p.terminate(c.t, 30*time.Second)
		}
	}
	c.checkOutcomes()
	s.acquisitions = c.checkEtcdHistory()
	c.checkTempDirs()
	c.mu.Lock()
	s.tasks = len(c.enqueued)
	c.mu.Unlock()
	return s
}

func (c *cluster) checkOutcomes() {
	c.t.Helper()
	owner := c.ownersByEpoch()
	c.mu.Lock()
	expected := maps.Clone(c.enqueued)
	caps := maps.Clone(c.caps)
	c.mu.Unlock()
	seen := 0
	for _, d := range c.dbs {
		seen += c.checkOutcomesIn(d, expected, caps, owner)
	}
	if seen != len(expected) {
		c.t.Errorf("%d enqueued tasks, %d found", len(expected), seen)
	}
}

// checkOutcomesIn checks the tasks of one database and returns how many
// of the expected ones it holds.
func (c *cluster) checkOutcomesIn(d clusterDB, expected map[int64]tasks.State, caps map[string]capabilities, owner map[string]string) int {
	c.t.Helper()
	rows, err := d.store.Pool().Query(context.Background(), `SELECT id, kind, queue, shard, state, coalesce(claimed_by, ''), coalesce(claim_epoch, 0), attempt FROM task_view`)
	if err != nil {
		c.t.Fatal(err)
	}
	defer rows.Close()
	seen := 0
	for rows.Next() {
		var id, epoch int64
		var kind, queue, state, claimedBy string
		var shard, attempt int
		if err := rows.Scan(&id, &kind, &queue, &shard, &state, &claimedBy, &epoch, &attempt); err != nil {
			c.t.Fatal(err)
		}
		want, ok := expected[id]
		if !ok {
			continue // seeded directly, not through the API
		}
		seen++
		if tasks.State(state) != want {
			c.t.Errorf("task %d (%s) ended %s, want %s", id, kind, state, want)
		}
		if tasks.State(state) == tasks.Completed {
			key := fmt.Sprintf("%d/%d", shard, epoch)
			if got, ok := owner[key]; !ok || got != claimedBy {
				c.t.Errorf("task %d completed by %s at epoch %d of shard %d, but etcd shows %q holding that epoch",
					id, claimedBy, epoch, shard, got)
			}
			if cp, ok := caps[claimedBy]; !ok || !cp.can(queue, kind) {
				c.t.Errorf("task %d (%s in queue %s) completed by %s, which serves %v and handles %v",
					id, kind, queue, claimedBy, cp.queues, cp.kinds)
			}
		}
	}
	return seen
}

// ownersByEpoch maps "shard/epoch" to the runner whose owner key started
// that term, from the recorded etcd history (an epoch is a revision: it
// names one unit, whatever its group).
func (c *cluster) ownersByEpoch() map[string]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]string{}
	for _, e := range c.events {
		if e.put {
			out[fmt.Sprintf("%d/%d", e.shard, e.created)] = e.value
		}
	}
	return out
}

// checkEtcdHistory verifies that each unit (a shard of a group) is
// acquired only while no runner holds it, with an epoch that grows, and
// returns the number of acquisitions.
func (c *cluster) checkEtcdHistory() int {
	c.t.Helper()
	c.mu.Lock()
	events := append([]etcdEvent(nil), c.events...)
	c.mu.Unlock()
	sort.SliceStable(events, func(i, j int) bool { return events[i].rev < events[j].rev })
	held := map[string]string{}
	last := map[string]int64{}
	acquisitions := 0
	for _, e := range events {
		unit := fmt.Sprintf("%s/%d", e.group, e.shard)
		if e.put {
			if held[unit] != "" || e.created <= last[unit] {
				c.t.Errorf("unit %s: %s acquired it at epoch %d while %q held it (last epoch %d)", unit, e.value, e.created, held[unit], last[unit])
			}
			held[unit], last[unit] = e.value, e.created
			acquisitions++
		} else if held[unit] == e.value {
			held[unit] = ""
		}
	}
	return acquisitions
}

// checkTempDirs: the runners and coordinators create no temporary data.
func (c *cluster) checkTempDirs() {
	c.t.Helper()
	for _, d := range leftBehind() {
		c.t.Errorf("temporary directory left behind: %s", d)
	}
}

// ourPrefixes name the temporary directories shardrun's programs make.
var ourPrefixes = []string{"shardrun-pg-", "shardrun-dev-", binDirPrefix}

// leftBehind lists our temporary directories that this test binary did
// not make itself. Its own (its servers, the second servers of the
// several-database tests, the built binaries) are removed by their own
// cleanups and may be made at any moment by a test running in parallel;
// the directory's marker names its maker from the moment the directory
// exists (tempdir.NewOwnedBy). The test binary runs under a temporary root
// of its own (pgtest.Main), so all it can find was made by this binary or
// by a process it started: what other programs left in the machine's
// temporary directory is not looked at.
func leftBehind() []string {
	var left []string
	me := tempdir.Self()
	for _, prefix := range ourPrefixes {
		found, _ := filepath.Glob(filepath.Join(os.TempDir(), prefix+"*"))
		for _, d := range found {
			o, ok := tempdir.OwnerOf(d)
			if ok && o == me {
				continue
			}
			if _, err := os.Stat(d); !ok && errors.Is(err, fs.ErrNotExist) {
				continue // removed by its own cleanup since the Glob
			}
			left = append(left, d)
		}
	}
	return left
}

func (c *cluster) report(name string, s summary, details string) {
	c.t.Logf("SCENARIO %-26s tasks %4d  duration %6.1fs  acquisitions %4d  fence rejections %3.0f  %s",
		name, s.tasks, s.duration.Seconds(), s.acquisitions, s.fenceRejections, details)
}
