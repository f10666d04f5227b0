package integration

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/tasks"
)

// txLeaseTTL is the txworkers' lease TTL, which also bounds a handler's
// transaction after CompleteTx: long enough that the other tasks of the
// scenario complete while the held transaction is still open.
const txLeaseTTL = 10 * time.Second

// startTxWorker starts a txworker (internal/cmd/txworker: a runner on
// package shardrun whose handler writes an effect row and completes its
// task in one transaction) and registers what it runs.
func (c *cluster) startTxWorker(name string) *proc {
	c.t.Helper()
	c.mu.Lock()
	c.caps[name] = capabilities{queues: []string{tasks.DefaultQueue}, kinds: []string{"effect"}}
	c.mu.Unlock()
	return c.launch(name, "txworker", filepath.Join(binDir, "txworker"), "", nil,
		"--database-url", c.dsn+"&pool_max_conns=32", "--etcd-endpoints", strings.Join(c.endpoints, ","),
		"--cluster", "it", "--runner-id", name, "--lease-ttl", txLeaseTTL.String(), "--handoff-timeout", "2s")
}

var holding = regexp.MustCompile(`holding (\d+) (\d+)`)

// TestAnOpenHandlerTransactionStallsNothingElse: one runner's handler
// holds its transaction open after CompleteTx (for 60 s, deaf to its
// context) while a second runner of its group joins, and the first is then
// frozen past its lease. Every other task completes, the ones enqueued
// while the transaction is open before it ends; the held task is retried
// once PostgreSQL ended its transaction, and completes once, with its
// effect row committed once.
func TestAnOpenHandlerTransactionStallsNothingElse(t *testing.T) {
	t.Parallel()
	c := newCluster(t)
	coord := c.startCoordinator("coordinator-1")
	a := c.startTxWorker("tx-1")
	c.waitFor(30*time.Second, "tx-1 owning every shard", func() bool { return c.balanced("tx-1") })

	c.enqueue(coord, 1, "effect", `{"hold_ms": 60000, "hold_attempts": 1}`, 3, tasks.Completed)
	var held int64
	c.waitFor(30*time.Second, "the handler holding its transaction", func() bool {
		m := holding.FindStringSubmatch(a.logs.String())
		if m == nil {
			return false
		}
		held, _ = strconv.ParseInt(m[1], 10, 64)
		return true
	})
	open := func() bool {
		var n int
		err := c.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND state LIKE 'idle in transaction%' AND query LIKE '%shardrun.complete_tx%'`).Scan(&n)
		return err == nil && n > 0
	}
	if !open() {
		t.Fatal("no open transaction after CompleteTx: the scenario holds nothing")
	}
	effects := func(where string, args ...any) int {
		var n int
		if err := c.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM effects WHERE `+where, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// Work enqueued while the transaction is open completes while it is
	// still open: nothing of the runner waits for it.
	c.enqueue(coord, 200, "effect", "", 3, tasks.Completed)
	var stillOpen bool
	c.waitFor(60*time.Second, "the other tasks completed", func() bool {
		if effects("task_id <> $1", held) < 200 {
			return false
		}
		stillOpen = open()
		return true
	})
	if !stillOpen {
		t.Fatalf("the held transaction ended before the other tasks completed: they waited for it, or the bound (%s) is shorter than the test thought", txLeaseTTL)
	}

	// A second runner joins the group; the shard of the held task moves
	// once its handoff times out.
	c.startTxWorker("tx-2")
	c.waitFor(60*time.Second, "tx-1 and tx-2 balanced", func() bool { return c.balanced("tx-1", "tx-2") })
	c.enqueue(coord, 200, "effect", "", 3, tasks.Completed)

	// The first runner freezes past its lease, its transaction still open
	// or already ended by PostgreSQL: the second takes every shard and
	// the held task once its transaction is gone.
	a.signal(t, syscall.SIGSTOP)
	time.Sleep(txLeaseTTL + 2*time.Second) // the freeze itself: nothing to poll while it lasts
	c.enqueue(coord, 200, "effect", "", 3, tasks.Completed)
	c.waitFor(90*time.Second, "every task completed", func() bool {
		counts := c.counts()
		return counts[tasks.Ready] == 0 && counts[tasks.Running] == 0
	})
	a.signal(t, syscall.SIGKILL)
	<-a.done

	task, err := c.store.Get(context.Background(), held)
	if err != nil {
		t.Fatal(err)
	}
	if task.State != tasks.Completed || task.Attempt < 2 {
		t.Fatalf("the held task: %s at attempt %d, want completed by a later attempt", task.State, task.Attempt)
	}
	if n := effects("task_id = $1", held); n != 1 {
		t.Fatalf("the held task's effect rows: %d, want 1 (the held transaction's rolled back)", n)
	}
	if n := effects("true"); n != 601 {
		t.Fatalf("%d effect rows for 601 tasks, want one each", n)
	}
	s := c.finish(60 * time.Second)
	c.report("open handler transaction", s, fmt.Sprintf("held task %d completed at attempt %d; 600 other tasks each completed once", held, task.Attempt))
}
