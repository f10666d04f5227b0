package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) {
	pgtest.Main(m, testutil.EtcdLeaks...)
}

func TestHelpExplainsEveryFlag(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := run([]string{"--help"}, func(string) string { return "" }, &out, &errOut); code != 0 {
		t.Fatalf("--help exited %d: %s", code, errOut.String())
	}
	help := out.String()
	for _, want := range []string{
		"--etcd-endpoints", "SHARDRUN_ETCD_ENDPOINTS", "--etcd-prefix", "--cluster", "--shard-count",
		"--database-url", "DATABASE_URL", "--admin-addr", "--admin-token", "SHARDRUN_ADMIN_TOKEN", "--runner-id",
		"--lease-ttl", "--detach-margin", "--keepalive-failures", "--recovery-window", "--heartbeat-interval",
		"--poll-interval", "--max-workers", "--handoff-timeout", "--retry-base", "--retry-cap", "--log-level",
		"--log-format", "--db-max-conns", "noop", "sleep", "fail",
	} {
		if !strings.Contains(help, want) {
			t.Errorf("--help does not mention %s", want)
		}
	}
	for _, line := range strings.Split(help, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "--") && len(strings.Fields(line)) < 4 {
			t.Errorf("flag without an explanation: %q", line)
		}
	}
}

func TestBadInputIsOneLineNamingTheFlag(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--shard-count", "many"}, nil, "--shard-count"},
		{[]string{"--database-url", "postgres://u@h/db", "--log-format", "xml"}, nil, "--log-format"},
		{nil, nil, "--database-url"},
		{[]string{"--database-url", "postgres://u@h:nope/db"}, nil, "--database-url"},
		{nil, map[string]string{"DATABASE_URL": "postgres://u@h/db", "SHARDRUN_LEASE_TTL": "soon"}, "SHARDRUN_LEASE_TTL"},
		{[]string{"--database-url", "postgres://u@h/db", "--lease-ttl", "3s", "--detach-margin", "3s"}, nil, "--detach-margin"},
		{[]string{"--database-url", "postgres://u@h/db", "--admin-addr", "0.0.0.0:9090"}, nil, "--admin-token"},
		{[]string{"--database-url", "postgres://u@h/db", "--etcd-endpoints", "localhost:2379"}, nil, "--etcd-endpoints"},
		{[]string{"--database-url", "postgres://u@h/db", "--kinds", "noop,gpu"}, nil, "--kinds"},
		{[]string{"--database-url", "postgres://u@h/db", "--kinds", ""}, nil, "--kinds"},
		{nil, map[string]string{"DATABASE_URL": "postgres://u@h/db", "SHARDRUN_KINDS": "noop,,sleep"}, "--kinds"},
		// Tracing that shardrun cannot do stops it before it connects.
		{nil, map[string]string{"DATABASE_URL": "postgres://u@h/db", "OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"},
		{nil, map[string]string{"DATABASE_URL": "postgres://u@h/db", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
			"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"},
	} {
		env = tc.env
		var out, errOut bytes.Buffer
		code := run(tc.args, getenv, &out, &errOut)
		msg := strings.TrimRight(errOut.String(), "\n")
		if code != 2 || !strings.Contains(msg, tc.want) || strings.Contains(msg, "\n") {
			t.Errorf("%v %v: exit %d, %q; want exit 2 and one line naming %s", tc.args, tc.env, code, msg, tc.want)
		}
	}
}

// buildRunner compiles this command into a temporary directory.
func buildRunner(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "runner")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the runner: %v\n%s", err, out)
	}
	return bin
}

type process struct {
	cmd  *exec.Cmd
	logs *linewriter.Buffer
	done chan error
}

func startRunner(t *testing.T, bin string, args ...string) *process {
	t.Helper()
	p := &process{cmd: exec.Command(bin, args...), logs: &linewriter.Buffer{}, done: make(chan error, 1)}
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("runner %v log:\n%s", args, p.logs.String())
		}
	})
	return p
}

func httpStatus(url string) int {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestBinaryAsANewUserRunsIt starts two runner processes by hand against a
// throwaway PostgreSQL and an embedded etcd, runs tasks, then SIGTERMs one
// and checks the other owns every shard before the first one's lease could
// have expired: the drain released them.
func TestBinaryAsANewUserRunsIt(t *testing.T) {
	ctx := context.Background()
	bin := buildRunner(t)
	st, dsn := pgtest.NewStore(t, store.Options{})
	etcd, cli := testutil.Etcd(t)

	common := []string{"--etcd-endpoints", etcd.Endpoints()[0], "--database-url", dsn, "--shard-count", "32",
		"--lease-ttl", "2s", "--recovery-window", "500ms", "--handoff-timeout", "2s"}
	addrA, addrB := testutil.FreeAddr(t), testutil.FreeAddr(t)
	// alpha's lease (30s) outlives the wait for the handoff below, so a
	// handoff within it is alpha's release, never its lease's expiry.
	a := startRunner(t, bin, append(common, "--runner-id", "alpha", "--admin-addr", addrA, "--lease-ttl", "30s")...)
	b := startRunner(t, bin, append(common, "--runner-id", "beta", "--admin-addr", addrB, "--log-format", "json")...)
	for _, addr := range []string{addrA, addrB} {
		testutil.WaitFor(t, 30*time.Second, "readyz on "+addr, func() bool { return httpStatus("http://"+addr+"/readyz") == 200 })
	}

	c, err := client.New(st, client.Config{ShardCount: 32})
	if err != nil {
		t.Fatal(err)
	}
	batch := make([]tasks.NewTask, 100)
	for i := range batch {
		batch[i] = tasks.NewTask{Kind: "noop", Options: tasks.Options{Key: fmt.Sprint("user-", i)}}
	}
	if _, err := c.EnqueueBatch(ctx, batch); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 30*time.Second, "100 tasks completed", func() bool {
		c, err := st.CountByState(ctx)
		return err == nil && c[tasks.Completed] == 100
	})

	owners := func() map[string]int {
		cl, err := shard.ReadCluster(ctx, cli, "/shardrun/default/", 32)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]int{}
		for _, g := range cl.Groups {
			for _, o := range g.Owners {
				if o != "" {
					m[o]++
				}
			}
		}
		return m
	}
	testutil.WaitFor(t, 10*time.Second, "16 shards each", func() bool {
		o := owners()
		return o["alpha"] == 16 && o["beta"] == 16
	})
	if err := a.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	took := testutil.WaitFor(t, 15*time.Second, "beta owns every shard, before alpha's lease could expire", func() bool { return owners()["beta"] == 32 })
	t.Logf("SIGTERM: beta owned all 32 shards %s after alpha was signalled", took)
	select {
	case err := <-a.done:
		if err != nil {
			t.Fatalf("alpha did not exit cleanly on SIGTERM: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("alpha did not exit within 10s of SIGTERM")
	}
	if resp, _ := cli.Get(ctx, "/shardrun/default/runners/alpha"); len(resp.Kvs) != 0 {
		t.Fatal("alpha's registration outlived it: the lease was not revoked")
	}
	if !strings.Contains(a.logs.String(), "signal received") || !strings.Contains(b.logs.String(), `"@message":"runner started"`) {
		t.Fatalf("logs: alpha text %q..., beta JSON %q...", firstLine(a.logs.String()), firstLine(b.logs.String()))
	}
	if err := b.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := <-b.done; err != nil {
		t.Fatalf("beta exit: %v", err)
	}
	_ = os.Remove(bin)
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// TestKindsNarrowTheHandlers: --kinds keeps the named built-ins, once each,
// in the order given; left out, the runner handles all of them.
func TestKindsNarrowTheHandlers(t *testing.T) {
	getenv := func(string) string { return "" }
	s, err := parse([]string{"--database-url", "postgres://u@h/db", "--kinds", "sleep, noop,sleep"}, getenv, nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(s.cfg.Kinds, []string{"sleep", "noop"}) {
		t.Errorf("--kinds sleep,noop,sleep: %q", s.cfg.Kinds)
	}
	s, err = parse([]string{"--database-url", "postgres://u@h/db"}, getenv, nil, io.Discard)
	if err != nil || s.cfg.Kinds != nil {
		t.Errorf("no --kinds: %q, %v; want every kind", s.cfg.Kinds, err)
	}
}
