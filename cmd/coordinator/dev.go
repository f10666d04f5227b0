package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/coordinator"
	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/freeport"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtmp"
	"github.com/shardrun/shardrun/internal/tempdir"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// devDirPrefix names the --dev temporary directories, so that one left by a
// killed demo is removed by the next.
const devDirPrefix = "shardrun-dev-"

// runDev runs a whole cluster on this machine until ctx ends: a throwaway
// PostgreSQL (or DATABASE_URL), an embedded etcd, this coordinator, runner
// processes of the real binary and a stream of demo tasks, with a progress
// line every few seconds. On the way out it drains the runners, stops
// everything and removes its temporary data.
func runDev(ctx context.Context, o options, log hclog.Logger, out io.Writer) (err error) {
	runnerBin, err := findRunner(o.runnerBin)
	if err != nil {
		return err
	}
	tmp, err := tempdir.New(devDirPrefix)
	if err != nil {
		return err
	}
	defer func() {
		if rerr := os.RemoveAll(tmp); rerr == nil {
			fmt.Fprintf(out, "removed %s\n", tmp)
		}
	}()

	if o.databaseURL == "" {
		fmt.Fprintln(out, "starting a throwaway PostgreSQL from the local binaries…")
		pg, err := pgtmp.Start(ctx, pgtmp.Options{})
		if err != nil {
			return fmt.Errorf("--dev needs PostgreSQL: %w", err)
		}
		defer func() {
			_ = pg.Stop()
			fmt.Fprintf(out, "stopped PostgreSQL and removed %s\n", pg.Dir())
		}()
		if o.databaseURL, err = pg.CreateDatabase(ctx, "shardrun"); err != nil {
			return err
		}
	}
	etcdPort, err := freeport.Port()
	if err != nil {
		return err
	}
	o.embedDir, o.embedAddr = filepath.Join(tmp, "etcd"), fmt.Sprintf("127.0.0.1:%d", etcdPort)
	o.endpoints = "http://" + o.embedAddr
	// Short timings so that failures (kill -9, SIGSTOP, manual detach) show
	// within seconds.
	o.electionTTL, o.sweepInterval, o.staleThreshold, o.heartbeatInterval = 5*time.Second, 2*time.Second, 10*time.Second, 2*time.Second

	coordCtx, stopCoord := context.WithCancel(context.WithoutCancel(ctx))
	defer stopCoord()
	ready := make(chan *coordinator.Coordinator, 1)
	coordDone := make(chan error, 1)
	go func() { coordDone <- serve(coordCtx, o, log, ready) }()
	var c *coordinator.Coordinator
	select {
	case c = <-ready:
	case err := <-coordDone:
		return err
	case <-ctx.Done():
		stopCoord()
		return <-coordDone
	}
	defer func() {
		stopCoord()
		if cerr := <-coordDone; cerr != nil && err == nil {
			err = cerr
		}
		fmt.Fprintln(out, "stopped the coordinator and the embedded etcd")
	}()

	runners := make([]*devRunner, o.devRunners)
	for i := range runners {
		if runners[i], err = startDevRunner(i+1, runnerBin, o, out); err != nil {
			stopRunners(runners, out)
			return err
		}
	}
	defer stopRunners(runners, out)

	st, err := store.Open(ctx, o.databaseURL, store.Options{MaxConns: 2})
	if err != nil {
		return err
	}
	defer st.Close()
	etcd, err := cli.NewEtcdClient([]string{o.endpoints})
	if err != nil {
		return err
	}
	defer etcd.Close()

	url := "http://" + c.Addr() + "/"
	fmt.Fprintf(out, "\nshardrun demo: an all-in-one cluster is running\n")
	fmt.Fprintf(out, "  status page  %s\n", url)
	fmt.Fprintf(out, "  cluster API  curl -s %sapi/cluster\n", url)
	fmt.Fprintf(out, "  enqueue      curl -s -X POST %sapi/tasks -d '{\"kind\": \"sleep\", \"payload\": {\"ms\": 500}}'\n", url)
	for _, r := range runners {
		fmt.Fprintf(out, "  %-12s pid %d, admin http://%s  (try: curl -X POST http://%s/admin/detach)\n", r.id, r.cmd.Process.Pid, r.admin, r.admin)
	}
	fmt.Fprintf(out, "  faults       kill -STOP <pid> makes a zombie runner (kill -CONT it back); kill -9 <pid> a dead one\n")
	fmt.Fprintf(out, "  Ctrl-C stops everything and removes the temporary data (%s)\n\n", tmp)

	client, err := tasks.NewClient(st, tasks.ClientConfig{ShardCount: o.shardCount})
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	wg.Go(func() { produce(ctx, client, o.devRate, log) })
	progress(ctx, st, etcd, o, out)
	wg.Wait()
	fmt.Fprintln(out, "\nstopping: draining the runners…")
	return nil
}

// produce enqueues a mix of demo tasks at rate per second until ctx ends.
func produce(ctx context.Context, client *tasks.Client, rate int, log hclog.Logger) {
	if rate == 0 {
		return
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	carry := 0.0
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		carry += float64(rate) / 10
		n := int(carry)
		carry -= float64(n)
		if n == 0 {
			continue
		}
		batch := make([]tasks.NewTask, n)
		for i := range batch {
			batch[i] = demoTask()
		}
		if _, err := client.EnqueueBatch(ctx, batch); err != nil && ctx.Err() == nil {
			log.Warn("enqueueing demo tasks failed", "error", err)
		}
	}
}

// demoTask draws one task: mostly short sleeps and no-ops, some that fail
// once then succeed, a few that never succeed (dead) and a few that miss
// their deadline (failed).
func demoTask() tasks.NewTask {
	switch p := rand.IntN(100); {
	case p < 55:
		return tasks.NewTask{Kind: "sleep", Payload: fmt.Appendf(nil, `{"ms": %d}`, 20+rand.IntN(400))}
	case p < 85:
		return tasks.NewTask{Kind: "noop"}
	case p < 97:
		return tasks.NewTask{Kind: "fail", Payload: []byte(`{"times": 1}`)}
	case p < 99:
		return tasks.NewTask{Kind: "fail", Payload: []byte(`{"times": 99}`), MaxAttempts: 2}
	default:
		return tasks.NewTask{Kind: "sleep", Payload: []byte(`{"ms": 5000}`), Deadline: time.Now().Add(1500 * time.Millisecond)}
	}
}

// progress prints a line every few seconds until ctx ends: tasks done,
// rate, counts by state and shards per runner.
func progress(ctx context.Context, st *store.Store, etcd *clientv3.Client, o options, out io.Writer) {
	start := time.Now()
	tick := time.NewTicker(3 * time.Second)
	defer tick.Stop()
	var last int64
	lastAt := start
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		counts, err := st.CountByState(qctx)
		cl, cerr := shard.ReadCluster(qctx, etcd, o.prefix+o.cluster+"/", o.shardCount)
		cancel()
		if err != nil || cerr != nil {
			if ctx.Err() == nil {
				fmt.Fprintf(out, "%5.0fs  (progress unavailable: %v %v)\n", time.Since(start).Seconds(), err, cerr)
			}
			continue
		}
		now := time.Now()
		done := counts[tasks.Completed]
		rate := float64(done-last) / now.Sub(lastAt).Seconds()
		last, lastAt = done, now
		owners := map[string]int{}
		for _, id := range cl.Owners {
			owners[id]++
		}
		var parts []string
		for _, r := range cl.Runners {
			mark := ""
			if r.State != shard.StateAttached {
				mark = " (" + r.State + ")"
			}
			parts = append(parts, fmt.Sprintf("%s %d%s", r.ID, owners[r.ID], mark))
		}
		if owners[""] > 0 {
			parts = append(parts, fmt.Sprintf("unowned %d", owners[""]))
		}
		fmt.Fprintf(out, "%5.0fs  completed %d (%.0f/s)  ready %d  running %d  failed %d  dead %d  |  shards: %s\n",
			now.Sub(start).Seconds(), done, rate, counts[tasks.Ready], counts[tasks.Running],
			counts[tasks.Failed], counts[tasks.Dead], strings.Join(parts, ", "))
	}
}

type devRunner struct {
	id    string
	admin string
	cmd   *exec.Cmd
	done  chan error
}

func startDevRunner(n int, bin string, o options, out io.Writer) (*devRunner, error) {
	port, err := freeport.Port()
	if err != nil {
		return nil, err
	}
	r := &devRunner{id: fmt.Sprintf("runner-%d", n), admin: fmt.Sprintf("127.0.0.1:%d", port), done: make(chan error, 1)}
	r.cmd = exec.Command(bin,
		"--etcd-endpoints", o.endpoints, "--etcd-prefix", o.prefix, "--cluster", o.cluster,
		"--shard-count", strconv.Itoa(o.shardCount), "--database-url", o.databaseURL,
		"--runner-id", r.id, "--admin-addr", r.admin, "--lease-ttl", "5s", "--recovery-window", "2s",
		"--heartbeat-interval", "2s", "--handoff-timeout", "5s", "--retry-base", "500ms", "--log-level", "warn")
	// Its own process group, so a terminal's Ctrl-C reaches only this
	// process, which then drains the runner with exactly one SIGTERM (a
	// second signal would make it exit at once); and SIGTERM if this
	// process dies without stopping it.
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	w := linewriter.New(func(line string) { fmt.Fprintf(out, "%s | %s\n", r.id, line) })
	r.cmd.Stdout, r.cmd.Stderr = w, w
	if err := r.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s from %s: %w", r.id, bin, err)
	}
	go func() { r.done <- r.cmd.Wait() }()
	return r, nil
}

// stopRunners drains every runner (SIGTERM) and kills those still running
// after 20s.
func stopRunners(rs []*devRunner, out io.Writer) {
	for _, r := range rs {
		if r != nil {
			_ = r.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	deadline := time.After(20 * time.Second)
	for _, r := range rs {
		if r == nil {
			continue
		}
		select {
		case err := <-r.done:
			if err != nil {
				fmt.Fprintf(out, "%s exited: %v\n", r.id, err)
			} else {
				fmt.Fprintf(out, "%s drained and exited\n", r.id)
			}
		case <-deadline:
			_ = r.cmd.Process.Kill()
			<-r.done
			fmt.Fprintf(out, "%s did not exit within 20s; killed it\n", r.id)
		}
	}
}

func findRunner(flagValue string) (string, error) {
	bin := flagValue
	if bin == "" {
		self, err := os.Executable()
		if err != nil {
			return "", fmt.Errorf("--runner-bin: cannot locate this executable: %w", err)
		}
		bin = filepath.Join(filepath.Dir(self), "runner")
	}
	if info, err := os.Stat(bin); err != nil || info.IsDir() {
		return "", fmt.Errorf("--runner-bin: no runner binary at %s; build it with `make build` or pass --runner-bin", bin)
	}
	return bin, nil
}
