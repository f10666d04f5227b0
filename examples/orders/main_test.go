package main

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
)

func TestMain(m *testing.M) {
	pgtest.Main(m, testutil.EtcdLeaks...)
}

func startEtcd(t *testing.T) *embedetcd.Server {
	t.Helper()
	etcd, err := embedetcd.Start(context.Background(), embedetcd.Config{Dir: t.TempDir(), Fast: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(etcd.Close)
	return etcd
}

// checkCharges checks that each order was charged exactly once and that
// each customer's orders were charged in the order they were placed.
func checkCharges(t *testing.T, dsn string, orders int) {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var rows, distinct int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT order_id) FROM charges`).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if rows != orders || distinct != orders {
		t.Fatalf("%d charge rows for %d orders, want exactly one for each of %d", rows, distinct, orders)
	}
	var late int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM (
		SELECT customer, substr(order_id, 7)::int AS o, lag(substr(order_id, 7)::int) OVER (PARTITION BY customer ORDER BY n) AS before
		FROM charges) x WHERE before > o`).Scan(&late); err != nil {
		t.Fatal(err)
	}
	if late != 0 {
		t.Fatalf("%d charges came before an order of their customer placed earlier", late)
	}
}

// The example end to end, in one process: every order charged once, in
// order per customer, with its receipt and, for the large ones, a fraud
// check.
func TestExampleEndToEnd(t *testing.T) {
	etcd := startEtcd(t)
	dsn := pgtest.NewDatabase(t)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := settings{dsn: dsn, role: "all", etcd: etcd.Endpoints(), orders: 12, customers: 3, leaseTTL: 2 * time.Second, chargeTime: time.Millisecond}
	if err := run(ctx, s, &out); err != nil {
		t.Fatal(err)
	}
	if got := out.String(); !strings.Contains(got, "charged 12 orders with 12 charges") {
		t.Fatalf("output:\n%s", got)
	}
	checkCharges(t, dsn, 12)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var receipts, checks, reports int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE kind = 'send-receipt'), count(*) FILTER (WHERE kind = 'fraud-check'),
		(SELECT count(*) FROM schedules WHERE name = 'charges-report') FROM tasks`).Scan(&receipts, &checks, &reports); err != nil {
		t.Fatal(err)
	}
	if receipts != 12 || checks != 2 || reports != 1 {
		t.Fatalf("%d receipts (want 12), %d fraud checks (want 2), %d report schedules (want 1)", receipts, checks, reports)
	}
}

// TestEachOrderChargedOnceThroughKillAndFreeze runs the shop against three
// worker processes of the example, freezes one past its lease (SIGSTOP)
// and kills another (SIGKILL) while they charge, and checks that every
// order was charged exactly once, in order per customer: the charges that
// the frozen and the killed workers had under way were run again
// elsewhere, and the frozen one's transactions, refused by the fence when
// it woke, committed nothing.
func TestEachOrderChargedOnceThroughKillAndFreeze(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "orders")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building the example: %v\n%s", err, out)
	}
	etcd := startEtcd(t)
	dsn := pgtest.NewDatabase(t)
	const lease = 2 * time.Second
	workers := map[string]*exec.Cmd{}
	for _, id := range []string{"w1", "w2", "w3"} {
		cmd := exec.Command(bin, "--role", "worker", "--runner-id", id, "--database-url", dsn,
			"--etcd-endpoints", strings.Join(etcd.Endpoints(), ","), "--lease-ttl", lease.String(), "--charge-time", "100ms")
		logs := &linewriter.Buffer{}
		cmd.Stdout, cmd.Stderr = logs, logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		workers[id] = cmd
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGCONT)
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			if t.Failed() {
				t.Logf("---- %s ----\n%s", id, linewriter.Tail(logs.String(), 40))
			}
		})
	}
	const orders = 600
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, settings{dsn: dsn, role: "shop", etcd: etcd.Endpoints(), orders: orders, customers: 20,
			leaseTTL: lease, chargeTime: time.Millisecond}, &out)
	}()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	charged := func() int {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n)
		return n
	}
	testutil.WaitFor(t, time.Minute, "a fifth of the orders charged", func() bool { return charged() >= orders/5 })
	if err := workers["w2"].Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(lease + time.Second) // the freeze itself, past the lease: what is being tested
	if err := workers["w2"].Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, time.Minute, "more orders charged", func() bool { return charged() >= orders/2 })
	if err := workers["w3"].Process.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the shop: %v\n%s", err, out.String())
		}
	case <-ctx.Done():
		t.Fatalf("the shop did not finish: %d of %d orders charged", charged(), orders)
	}
	checkCharges(t, dsn, orders)
	// The faults hit charges under way: some were taken over from the
	// frozen or the killed worker.
	var cut int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE kind = 'charge' AND errors::text ~ 'orphaned|interrupted|stale'`).Scan(&cut); err != nil {
		t.Fatal(err)
	}
	if cut == 0 {
		t.Fatal("no charge was cut short by the freeze or the kill: the test did not test the race")
	}
	t.Logf("%d orders charged once each; %d charges were taken over from a frozen or killed worker", orders, cut)
}
