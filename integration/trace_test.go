package integration

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/internal/tracing/tracingtest"
)

// TestTraceAcrossTheBinaries runs the real coordinator and runner binaries
// with only the standard OTEL_* variables set, pointing at a real OTLP/HTTP
// receiver, and the batch processor's delay set to a minute: the spans of a
// task enqueued with a traceparent reach the receiver only through the
// flush each binary does on its way out, and they form one trace from
// POST /api/tasks to the outcome, from both services.
func TestTraceAcrossTheBinaries(t *testing.T) {
	runnerBin, coordBin := binaries(t)
	rcv := tracingtest.New(t)
	dsn := pgtest.NewDatabase(t)
	etcdAddr, httpAddr, adminAddr := testutil.FreeAddr(t), testutil.FreeAddr(t), testutil.FreeAddr(t)
	env := append(os.Environ(), "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="+rcv.URL(), "OTEL_BSP_SCHEDULE_DELAY=60000")
	common := []string{"--cluster", "trace", "--shard-count", "16", "--database-url", dsn, "--log-level", "info"}
	stopCoord := startEnv(t, "coordinator", coordBin, env, append(common, "--embed-etcd", filepath.Join(t.TempDir(), "etcd"),
		"--embed-etcd-addr", etcdAddr, "--http-addr", httpAddr, "--election-ttl", "2s")...)
	testutil.WaitFor(t, 60*time.Second, "the coordinator serves", func() bool {
		return httpCode(t, "GET", "http://"+httpAddr+"/healthz", "") == 200
	})
	stopRunner := startEnv(t, "runner", runnerBin, env, append(common, "--etcd-endpoints", "http://"+etcdAddr,
		"--runner-id", "trace-1", "--admin-addr", adminAddr)...)
	testutil.WaitFor(t, 60*time.Second, "the runner is ready and owns every shard", func() bool {
		code, body := testutil.HTTP(t, http.MethodGet, "http://"+adminAddr+"/status", "", "")
		var st struct{ Owned []json.RawMessage }
		return code == 200 && json.Unmarshal([]byte(body), &st) == nil && len(st.Owned) == 16
	})
	const traceID, parent = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
	code, body := testutil.HTTP(t, http.MethodPost, "http://"+httpAddr+"/api/tasks", "", `{"kind": "noop"}`,
		"traceparent", "00-"+traceID+"-"+parent+"-01")
	if code != http.StatusCreated {
		t.Fatalf("POST /api/tasks: %d %s", code, body)
	}
	var task struct{ ID int64 }
	if err := json.Unmarshal([]byte(body), &task); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 30*time.Second, "the task completed", func() bool {
		code, body := testutil.HTTP(t, http.MethodGet, fmt.Sprintf("http://%s/api/tasks/%d", httpAddr, task.ID), "", "")
		var got struct{ State string }
		return code == 200 && json.Unmarshal([]byte(body), &got) == nil && got.State == "completed"
	})
	if n := len(rcv.Spans()); n != 0 {
		t.Fatalf("%d spans exported before shutdown with a minute's batch delay", n)
	}
	stopRunner()
	stopCoord()
	spans := rcv.Spans()
	out := tracingtest.Tree(spans, traceID)
	// The batches the task's claim and outcome spans link to, in traces of
	// the runner's own.
	for _, s := range spans {
		if s.TraceID == traceID {
			for _, l := range s.Links {
				out += tracingtest.Tree(spans, l.TraceID)
			}
		}
	}
	t.Logf("exported at shutdown:\n%s", out)
	want := []struct{ name, service, parentName string }{
		{"POST /api/tasks", "shardrun-coordinator", ""},
		{"shardrun.enqueue", "shardrun-coordinator", "POST /api/tasks"},
		{"shardrun.claim", "shardrun-runner", "shardrun.enqueue"},
		{"shardrun.run", "shardrun-runner", "shardrun.enqueue"},
		{"shardrun.outcome", "shardrun-runner", "shardrun.run"},
	}
	byName := map[string]tracingtest.Span{}
	for _, s := range spans {
		if s.TraceID == traceID {
			byName[s.Name] = s
		}
	}
	for _, w := range want {
		s, ok := byName[w.name]
		switch {
		case !ok:
			t.Errorf("no span %s in trace %s", w.name, traceID)
		case s.Service != w.service:
			t.Errorf("%s from %s, want %s", w.name, s.Service, w.service)
		case w.parentName == "" && s.ParentSpanID != parent:
			t.Errorf("%s's parent %s, want the caller's %s", w.name, s.ParentSpanID, parent)
		case w.parentName != "" && s.ParentSpanID != byName[w.parentName].SpanID:
			t.Errorf("%s's parent %s, want %s", w.name, s.ParentSpanID, w.parentName)
		case w.name != "POST /api/tasks" && s.Attrs["shardrun.task.id"] != task.ID:
			t.Errorf("%s: task id %v, want %d", w.name, s.Attrs["shardrun.task.id"], task.ID)
		}
	}
}

// startEnv starts a binary with env; the function it returns interrupts it
// and waits for it to exit (at most 20s, then kills it). It runs at the
// test's end too.
func startEnv(t *testing.T, name, bin string, env []string, args ...string) func() {
	t.Helper()
	logs := &linewriter.Buffer{}
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s:\n%s", name, logs.String())
		}
	}
	t.Cleanup(stop)
	return stop
}
