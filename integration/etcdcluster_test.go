package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/testutil"
)

// Timings of the multi-member etcd cluster: those of the issue that found
// runners detaching on every leader change (heartbeat 50ms, election
// timeout 500ms).
const (
	etcdHeartbeat = 50 * time.Millisecond
	etcdElection  = 500 * time.Millisecond
)

// etcdMember is one etcd server process of a multi-member cluster.
type etcdMember struct {
	name      string
	dir       string
	clientURL string
	peerURL   string
	args      []string
	cmd       *exec.Cmd
	logs      *linewriter.Buffer
	done      chan error
}

// etcdCluster is a cluster of separate etcd processes whose members can be
// killed with SIGKILL and restarted on their data.
type etcdCluster struct {
	t       *testing.T
	bin     string
	members []*etcdMember
}

// startEtcdCluster starts n members and waits until they have a leader.
func startEtcdCluster(t *testing.T, n int) *etcdCluster {
	t.Helper()
	ec := &etcdCluster{t: t, bin: etcdBinary(t)}
	var initial []string
	for i := range n {
		m := &etcdMember{name: fmt.Sprintf("etcd-%d", i+1), dir: filepath.Join(t.TempDir(), "data"),
			clientURL: "http://" + testutil.FreeAddr(t), peerURL: "http://" + testutil.FreeAddr(t)}
		initial = append(initial, m.name+"="+m.peerURL)
		ec.members = append(ec.members, m)
	}
	for _, m := range ec.members {
		m.args = []string{"--name", m.name, "--data-dir", m.dir,
			"--listen-client-urls", m.clientURL, "--advertise-client-urls", m.clientURL,
			"--listen-peer-urls", m.peerURL, "--initial-advertise-peer-urls", m.peerURL,
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-token", "it",
			"--initial-cluster-state", "new",
			"--heartbeat-interval", fmt.Sprint(etcdHeartbeat.Milliseconds()),
			"--election-timeout", fmt.Sprint(etcdElection.Milliseconds()),
			"--log-level", "warn"}
		ec.launch(m)
	}
	t.Cleanup(func() {
		for _, m := range ec.members {
			if m.cmd != nil {
				_ = m.cmd.Process.Kill()
				<-m.done
			}
			if t.Failed() {
				t.Logf("---- log of %s ----\n%s", m.name, linewriter.Tail(m.logs.String(), 60))
			}
		}
	})
	testutil.WaitFor(t, 30*time.Second, "the etcd cluster has a leader", func() bool { return ec.leader() != nil })
	return ec
}

func (ec *etcdCluster) launch(m *etcdMember) {
	ec.t.Helper()
	m.logs = &linewriter.Buffer{}
	m.done = make(chan error, 1)
	m.cmd = exec.Command(ec.bin, m.args...)
	m.cmd.Stdout, m.cmd.Stderr = m.logs, m.logs
	if err := m.cmd.Start(); err != nil {
		ec.t.Fatalf("starting %s: %v", m.name, err)
	}
	go func() { m.done <- m.cmd.Wait() }()
}

// endpoints are every member's client URL.
func (ec *etcdCluster) endpoints() []string {
	out := make([]string, len(ec.members))
	for i, m := range ec.members {
		out[i] = m.clientURL
	}
	return out
}

// leader is the member that says it leads, or nil.
func (ec *etcdCluster) leader() *etcdMember {
	for _, m := range ec.members {
		if m.cmd == nil {
			continue
		}
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{m.clientURL}, DialTimeout: time.Second})
		if err != nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := cli.Status(ctx, m.clientURL)
		cancel()
		cli.Close()
		if err == nil && st.Leader != 0 && st.Leader == st.Header.MemberId {
			return m
		}
	}
	return nil
}

// healthy reports whether m runs and answers as a member with a leader.
func (ec *etcdCluster) healthy(m *etcdMember) bool {
	if m.cmd == nil {
		return false
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{m.clientURL}, DialTimeout: time.Second})
	if err != nil {
		return false
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	st, err := cli.Status(ctx, m.clientURL)
	return err == nil && st.Leader != 0
}

// kill stops a member with SIGKILL, as a crash would.
func (ec *etcdCluster) kill(m *etcdMember) {
	ec.t.Helper()
	_ = m.cmd.Process.Signal(syscall.SIGKILL)
	<-m.done
	m.cmd = nil
}

// restart starts a killed member again on its data; it rejoins the cluster.
func (ec *etcdCluster) restart(m *etcdMember) {
	ec.t.Helper()
	args := make([]string, 0, len(m.args))
	for i := 0; i < len(m.args); i++ {
		if m.args[i] == "--initial-cluster-state" {
			args = append(args, m.args[i], "existing")
			i++
			continue
		}
		args = append(args, m.args[i])
	}
	m.args = args
	ec.launch(m)
}

// etcdBinary builds etcd's own server at the go.mod version once per test
// binary, next to the shardrun binaries.
func etcdBinary(t *testing.T) string {
	t.Helper()
	binaries(t)
	etcdBuildOnce.Do(func() {
		out, err := exec.Command("go", "build", "-o", filepath.Join(binDir, "etcd"), "../internal/cmd/etcd").CombinedOutput()
		if err != nil {
			etcdBuildErr = fmt.Errorf("building etcd: %v\n%s", err, out)
		}
	})
	if etcdBuildErr != nil {
		t.Fatal(etcdBuildErr)
	}
	bin := filepath.Join(binDir, "etcd")
	if _, err := os.Stat(bin); err != nil {
		t.Fatal(err)
	}
	return bin
}
