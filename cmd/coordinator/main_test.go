package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/tempdir"
	"github.com/shardrun/shardrun/internal/testutil"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestHelpAndBadInput(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := run([]string{"--help"}, func(string) string { return "" }, &out, &errOut); code != 0 {
		t.Fatalf("--help: %d %s", code, errOut.String())
	}
	for _, want := range []string{"--dev", "--embed-etcd", "--election-ttl", "--stale-threshold", "--sweep-interval",
		"--http-addr", "--api-token", "SHARDRUN_API_TOKEN", "--database-url", "DATABASE_URL", "--shard-count",
		"--retain-completed", "SHARDRUN_RETAIN_COMPLETED", "--retain-failed", "--unhandled-after", "SHARDRUN_UNHANDLED_AFTER"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help lacks %s", want)
		}
	}
	env := map[string]string{}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "--database-url"},
		{[]string{"--database-url", "postgres://u@h/db", "--http-addr", "0.0.0.0:8080"}, "--api-token"},
		{[]string{"--database-url", "postgres://u@h/db", "--etcd-endpoints", "nope"}, "--etcd-endpoints"},
		{[]string{"--database-url", "postgres://u@h/db", "--sweep-interval", "soon"}, "--sweep-interval"},
		{[]string{"--dev", "--dev-runners", "0"}, "--dev-runners"},
		{[]string{"--database-url", "postgres://u@h/db", "--unhandled-after", "-1s"}, "--unhandled-after"},
		{[]string{"--database-url", "postgres://u@h/db", "--retention-batch", "0"}, "--retention-batch"},
	} {
		var out, errOut bytes.Buffer
		code := run(tc.args, func(k string) string { return env[k] }, &out, &errOut)
		msg := strings.TrimSpace(errOut.String())
		if code != 2 || !strings.Contains(msg, tc.want) || strings.Contains(msg, "\n") {
			t.Errorf("%v: exit %d %q; want exit 2 and one line naming %s", tc.args, code, msg, tc.want)
		}
	}
	// Tracing that shardrun cannot do stops it before it connects.
	for name, value := range map[string]string{"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"} {
		env = map[string]string{name: value, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
		var out, errOut bytes.Buffer
		code := run([]string{"--database-url", "postgres://u@h/db"}, func(k string) string { return env[k] }, &out, &errOut)
		if msg := strings.TrimSpace(errOut.String()); code != 2 || !strings.HasPrefix(msg, "coordinator: "+name+":") {
			t.Errorf("%s=%s: exit %d %q; want exit 2 and one line naming it", name, value, code, msg)
		}
	}
}

func TestEmbeddedEtcd(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(binaries(t), "coordinator")
	addr, etcdAddr := testutil.FreeAddr(t), testutil.FreeAddr(t)
	cmd := exec.Command(bin, "--embed-etcd", filepath.Join(t.TempDir(), "etcd"), "--embed-etcd-addr", etcdAddr,
		"--database-url", pgtest.NewDatabase(t), "--http-addr", addr)
	var logs linewriter.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if t.Failed() {
			t.Logf("coordinator log:\n%s", logs.String())
		}
	}()
	testutil.WaitFor(t, 30*time.Second, "the coordinator leads on its embedded etcd", func() bool {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		return strings.Contains(b.String(), `"leader":true`)
	})
	if c, err := net.Dial("tcp", etcdAddr); err != nil {
		t.Fatalf("embedded etcd not serving on %s: %v", etcdAddr, err)
	} else {
		c.Close()
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit on SIGTERM: %v", err)
	}
}

// TestMakeDemo does what a new user does with the working tree as it is,
// uncommitted changes included: run `make demo`, watch it make progress,
// press Ctrl-C (SIGINT to the whole foreground process group), and checks
// that it exits cleanly leaving no process and no temporary directory.
// Before that, a demo killed with SIGKILL leaves its directories behind,
// and `make demo` must remove those, and only those.
func TestMakeDemo(t *testing.T) {
	t.Parallel()
	bin := binaries(t)
	killed := killedDemo(t, bin)
	live, err := tempdir.NewOwnedBy("", "shardrun-dev-", tempdir.Self())
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(live)
	nameOnly := filepath.Join(os.TempDir(), "shardrun-pg-without-marker")
	if err := os.Mkdir(nameOnly, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(nameOnly)

	cmd := exec.Command("make", "demo", "BIN="+bin, "DEMO_FLAGS=--http-addr 127.0.0.1:0 --dev-rate 60")
	cmd.Dir = repoRoot
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // a terminal's foreground group
	d := startDemo(t, cmd)
	var last string
	deadline := time.After(4 * time.Minute) // includes building on a loaded machine
	for done := 0; done < 3; done++ {
		select {
		case l, ok := <-d.progress:
			if !ok {
				t.Fatal("make demo ended before showing progress")
			}
			last = l
		case <-deadline:
			t.Fatal("no progress lines from make demo")
		}
	}
	if !regexp.MustCompile(`completed [1-9]\d* \(`).MatchString(last) || !strings.Contains(last, "runner-1") {
		t.Fatalf("progress does not show work being done: %q", last)
	}
	// A mixed fleet: the last runner is an emails pool, with its own
	// share of the shards.
	if !strings.Contains(last, "runner-3 [emails] 256") {
		t.Errorf("progress does not show runner-3 as an emails pool owning all 256 shards of its group: %q", last)
	}
	out := d.output()
	url := regexp.MustCompile(`status page\s+(http://\S+)`).FindStringSubmatch(out)
	if url == nil {
		t.Fatalf("no status page URL printed:\n%s", out)
	}
	resp, err := http.Get(url[1] + "api/cluster")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("status API at %s: %v", url[1], err)
	}
	resp.Body.Close()
	http.DefaultClient.CloseIdleConnections()
	// What a user needs to attach a runner of their own.
	for _, want := range []string{"database     postgres://", "etcd         http://127.0.0.1:", "your runner  ./bin/runner --etcd-endpoints"} {
		if !strings.Contains(out, want) {
			t.Errorf("the banner lacks %q:\n%s", want, out)
		}
	}
	pids := regexp.MustCompile(`pid (\d+)`).FindAllStringSubmatch(out, -1)
	tmp := regexp.MustCompile(`temporary data \((\S+)\)`).FindStringSubmatch(out)
	if len(pids) != 3 || tmp == nil {
		t.Fatalf("banner lacks runner pids or the temporary directory:\n%s", out)
	}
	for _, dir := range killed {
		if !strings.Contains(out, "removed "+dir+", left by") {
			t.Errorf("make demo did not say it removed %s, left by the killed demo", dir)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("%s, left by the killed demo, is still there: %v", dir, err)
		}
	}
	for _, dir := range []string{live, nameOnly} {
		if _, err := os.Stat(dir); err != nil {
			t.Errorf("make demo removed %s, which has a live owner or no marker: %v", dir, err)
		}
	}

	if err := syscall.Kill(-cmd.Process.Pid, syscall.SIGINT); err != nil { // Ctrl-C
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		// make itself dies from the SIGINT once its child is done (GNU make
		// re-raises it); the coordinator's own clean exit is checked below.
		if err != nil && !strings.Contains(err.Error(), "interrupt") {
			t.Fatalf("make demo failed on Ctrl-C: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("make demo did not exit within 60s of Ctrl-C")
	}
	out = d.output()
	for _, want := range []string{"runner-1 drained and exited", "runner-2 drained and exited", "runner-3 drained and exited",
		"removed " + tmp[1], "shardrun demo stopped cleanly"} {
		if !strings.Contains(out, want) {
			t.Errorf("shutdown output lacks %q", want)
		}
	}
	for _, m := range pids {
		var pid int
		fmt.Sscan(m[1], &pid)
		if syscall.Kill(pid, 0) == nil {
			t.Errorf("runner pid %d is still alive after make demo exited", pid)
		}
	}
	if _, err := os.Stat(tmp[1]); !os.IsNotExist(err) {
		t.Errorf("temporary directory %s left behind", tmp[1])
	}
	if pg := regexp.MustCompile(`stopped PostgreSQL and removed (\S+)`).FindStringSubmatch(out); pg == nil {
		t.Errorf("no sign the throwaway PostgreSQL was removed")
	} else if _, err := os.Stat(pg[1]); !os.IsNotExist(err) {
		t.Errorf("PostgreSQL directory %s left behind", pg[1])
	}
	t.Logf("make demo, last progress line: %s", strings.TrimSpace(last))
}

// demo is a running --dev coordinator's output.
type demo struct {
	mu       sync.Mutex
	lines    []string
	progress chan string // the progress lines
}

// startDemo starts cmd and collects its output; when the test fails it
// kills cmd's process group and logs the output.
func startDemo(t *testing.T, cmd *exec.Cmd) *demo {
	t.Helper()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d := &demo{progress: make(chan string, 100)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			d.mu.Lock()
			d.lines = append(d.lines, sc.Text())
			d.mu.Unlock()
			if strings.Contains(sc.Text(), " completed ") {
				select {
				case d.progress <- sc.Text():
				default: // nobody reads progress any more
				}
			}
		}
		close(d.progress)
	}()
	t.Cleanup(func() {
		if t.Failed() {
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			t.Logf("%s output:\n%s", filepath.Base(cmd.Path), d.output())
		}
	})
	return d
}

func (d *demo) output() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return strings.Join(d.lines, "\n")
}

// killedDemo starts the coordinator in bin with --dev, kills it with
// SIGKILL once it serves, waits until its PostgreSQL has stopped, and
// returns the directories it left: its own (the embedded etcd's data is
// inside) and its PostgreSQL's. The test's end waits for its runners.
func killedDemo(t *testing.T, bin string) []string {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "coordinator"), "--dev", "--dev-rate", "0", "--http-addr", "127.0.0.1:0")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	d := startDemo(t, cmd)
	var tmp []string
	testutil.WaitFor(t, time.Minute, "the demo to be killed serves", func() bool {
		tmp = regexp.MustCompile(`temporary data \((\S+)\)`).FindStringSubmatch(d.output())
		return tmp != nil
	})
	var pg []string
	found, _ := filepath.Glob(filepath.Join(os.TempDir(), "shardrun-pg-*"))
	for _, dir := range found {
		if o, ok := tempdir.OwnerOf(dir); ok && o.Pid == cmd.Process.Pid {
			pg = append(pg, dir)
		}
	}
	if len(pg) != 1 {
		t.Fatalf("the demo's PostgreSQL directories: %v, want one", pg)
	}
	for _, m := range regexp.MustCompile(`pid (\d+)`).FindAllStringSubmatch(d.output(), -1) {
		pid, _ := strconv.Atoi(m[1])
		// Its runners get SIGTERM when it dies (Pdeathsig) and drain.
		t.Cleanup(func() {
			testutil.WaitFor(t, time.Minute, "the killed demo's runner "+m[1]+" exits", func() bool {
				return !(tempdir.Owner{Pid: pid}).Alive()
			})
		})
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	// Its PostgreSQL gets SIGINT when it dies (Pdeathsig): the directory
	// is removed only once the server is gone.
	testutil.WaitFor(t, 30*time.Second, "the killed demo's PostgreSQL stops", func() bool {
		_, err := os.Stat(filepath.Join(pg[0], "data", "postmaster.pid"))
		return os.IsNotExist(err)
	})
	left := []string{tmp[1], pg[0]}
	for _, dir := range left {
		if _, err := os.Stat(dir); err != nil {
			t.Fatalf("the killed demo left no %s: %v", dir, err)
		}
	}
	return left
}

// repoRoot is the working tree the tests build, as it is.
const repoRoot = "../.."

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// binaries builds the working tree's binaries once for the package's
// tests, with `make build` as a user would, into a directory of the
// tests' (so that a bin/ built earlier is not what runs), and returns it.
func binaries(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		if binDir, buildErr = os.MkdirTemp("", "coordinator-test-bin-"); buildErr != nil {
			return
		}
		pgtest.AtExit(func() { _ = os.RemoveAll(binDir) })
		if out, err := exec.Command("make", "-C", repoRoot, "build", "BIN="+binDir).CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("make build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

// TestDevHonoursGivenFlags: --dev brings short timings only for the flags
// the user did not give; given ones (command line or environment) stay.
func TestDevHonoursGivenFlags(t *testing.T) {
	o := options{staleThreshold: time.Second, heartbeatInterval: 5 * time.Second, electionTTL: time.Minute}
	o.devDefaults(func(name string) bool { return name == "stale-threshold" || name == "heartbeat-interval" })
	if o.staleThreshold != time.Second || o.heartbeatInterval != 5*time.Second {
		t.Errorf("given flags replaced: stale %s heartbeat %s", o.staleThreshold, o.heartbeatInterval)
	}
	if o.electionTTL != 5*time.Second || o.sweepInterval != 2*time.Second {
		t.Errorf("flags not given should take the demo's timings: election %s sweep %s", o.electionTTL, o.sweepInterval)
	}
	fs := cli.NewFlagSet("t", "")
	var d time.Duration
	fs.Duration(&d, "stale-threshold", "SHARDRUN_STALE_THRESHOLD", time.Minute, "")
	fs.Duration(&d, "heartbeat-interval", "SHARDRUN_HEARTBEAT_INTERVAL", time.Minute, "")
	env := map[string]string{"SHARDRUN_HEARTBEAT_INTERVAL": "3s"}
	if err := fs.Parse([]string{"--stale-threshold", "9s"}, func(k string) string { return env[k] }, io.Discard); err != nil {
		t.Fatal(err)
	}
	if !fs.Given("stale-threshold") || !fs.Given("heartbeat-interval") {
		t.Error("a flag set on the command line or by its variable must count as given")
	}
}
