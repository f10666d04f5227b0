package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/coordinator"
	"github.com/shardrun/shardrun/internal/freeport"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtmp"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/internal/tempdir"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// devDirPrefix names the --dev temporary directories (the embedded etcd's
// data is inside), so that one left by a killed demo is found by the next,
// which removes it when its marker says its owner is gone.
const devDirPrefix = "shardrun-dev-"

// devDatabaseNames name the demo's databases (--dev-databases), in order:
// the first is main, --database-url's.
var devDatabaseNames = [maxDevDatabases]string{"main", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"}

// devLeaseTTL is the demo runners' lease TTL: short, so that a kill -9 or a
// SIGSTOP moves shards within seconds, long enough for a loaded laptop.
const devLeaseTTL = 5 * time.Second

// devDefaults are the timings --dev uses for the flags the user did not
// give: short, so that failures (kill -9, SIGSTOP, manual detach) show
// within seconds. Given flags are honoured (and validated as usual).
func (o *options) devDefaults(given func(name string) bool) {
	for _, d := range []struct {
		flag string
		p    *time.Duration
		v    time.Duration
	}{
		{"election-ttl", &o.electionTTL, 5 * time.Second},
		{"sweep-interval", &o.sweepInterval, 2 * time.Second},
		{"stale-threshold", &o.staleThreshold, 10 * time.Second},
		{"heartbeat-interval", &o.heartbeatInterval, 2 * time.Second},
		{"retry-base", &o.retryBase, 500 * time.Millisecond},
	} {
		if !given(d.flag) {
			*d.p = d.v
		}
	}
}

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
	// What an earlier demo killed with SIGKILL left: its etcd directory
	// (under its own temporary directory) and its PostgreSQL data, each
	// marked with its owner, which is gone.
	for _, d := range append(tempdir.RemoveStale(devDirPrefix, nil), pgtmp.RemoveStale()...) {
		fmt.Fprintf(out, "removed %s, left by an earlier run that was killed\n", d)
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

	if o.databaseURL == "" && len(o.databases) == 0 {
		fmt.Fprintln(out, "starting a throwaway PostgreSQL from the local binaries…")
		pg, err := pgtmp.Start(ctx, pgtmp.Options{})
		if err != nil {
			return fmt.Errorf("--dev needs PostgreSQL: %w", err)
		}
		defer func() {
			_ = pg.Stop()
			fmt.Fprintf(out, "stopped PostgreSQL and removed %s\n", pg.Dir())
		}()
		// The demo's databases, each a database of the throwaway server:
		// main, then second, third, … (--dev-databases).
		for i := range o.devDatabases {
			name := devDatabaseNames[i]
			url, err := pg.CreateDatabase(ctx, "shardrun_"+name)
			if err != nil {
				return err
			}
			if i == 0 {
				o.databaseURL = url
			} else {
				o.databases = append(o.databases, cli.Database{Name: name, URL: url, From: "--dev-databases"})
			}
		}
	}
	etcdPort, err := freeport.Port()
	if err != nil {
		return err
	}
	o.embedDir, o.embedAddr = filepath.Join(tmp, "etcd"), fmt.Sprintf("127.0.0.1:%d", etcdPort)
	o.endpoints = "http://" + o.embedAddr
	if o.embedCert != "" {
		o.endpoints = "https://" + o.embedAddr
	}

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

	printBanner(ctx, out, c, runners, o, tmp)
	return demoLoad(ctx, o, c, log, out)
}

// demoLoad enqueues the demo stream through the task client and prints
// the progress line until ctx ends.
func demoLoad(ctx context.Context, o options, c *coordinator.Coordinator, log hclog.Logger, out io.Writer) error {
	// A producer of its own, as a program would be: its databases routed
	// by the map the databases record (store.ReadMap), without etcd.
	dbs, err := cli.DatabaseList(o.databaseURL, o.databases)
	if err != nil {
		return err
	}
	stores, closeStores, err := placement.Open(ctx, dbs, store.Options{MaxConns: 2}, log.Named("demo"))
	if err != nil {
		return err
	}
	defer closeStores()
	m, err := store.ReadMap(ctx, stores)
	if err != nil {
		return err
	}
	router, err := store.NewRouter(stores, m, log.Named("demo"))
	if err != nil {
		return err
	}
	defer router.Close()
	// The demo's tasks are traced as any producer's when tracing is on.
	producer, err := client.New(router, client.Config{ShardCount: o.shardCount, TracerProvider: o.tracerProvider})
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	wg.Go(func() { produce(ctx, producer, o.devRate, log) })
	progress(ctx, c, out)
	wg.Wait()
	fmt.Fprintln(out, "\nstopping: draining the runners…")
	return nil
}

// printBanner says what the demo runs and what to try.
func printBanner(ctx context.Context, out io.Writer, c *coordinator.Coordinator, runners []*devRunner, o options, tmp string) {
	url := "http://" + c.Addr() + "/"
	fmt.Fprintf(out, "\nshardrun demo: an all-in-one cluster is running\n")
	fmt.Fprintf(out, "  status page  %s\n", url)
	fmt.Fprintf(out, "  cluster API  curl -s %sapi/cluster\n", url)
	fmt.Fprintf(out, "  enqueue      curl -s -X POST %sapi/tasks -d '{\"kind\": \"sleep\", \"payload\": {\"ms\": 500}}'\n", url)
	for _, r := range runners {
		fmt.Fprintf(out, "  %-12s pid %d, admin http://%s  (try: curl -X POST http://%s/admin/detach)\n", r.id, r.cmd.Process.Pid, r.admin, r.admin)
	}
	dbs, _ := cli.DatabaseList(o.databaseURL, o.databases)
	shards := map[string]string{}
	vctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	if v, err := c.Databases(vctx); err == nil {
		for _, d := range v.Databases {
			shards[d.Name] = "shards " + d.Shards
		}
	}
	cancel()
	flags := ""
	for i, d := range dbs {
		switch {
		case len(dbs) == 1:
			fmt.Fprintf(out, "  database     %s\n", store.MaskDSN(d.URL))
			flags = fmt.Sprintf("--database-url '%s'", store.MaskDSN(d.URL))
			continue
		case i == 0:
			fmt.Fprintf(out, "  databases    ")
		default:
			fmt.Fprintf(out, "               ")
		}
		fmt.Fprintf(out, "%-8s %-14s %s\n", d.Name, shards[d.Name], store.MaskDSN(d.URL))
		flags += fmt.Sprintf(" --database %s='%s'", d.Name, store.MaskDSN(d.URL))
	}
	if len(dbs) > 1 {
		fmt.Fprintf(out, "               GET %sapi/databases shows each with its shards, health and tasks\n", url)
	}
	fmt.Fprintf(out, "  etcd         %s (cluster %q under %s, %d shards)\n", o.endpoints, o.cluster, o.prefix, o.shardCount)
	fmt.Fprintf(out, "  your runner  ./bin/runner --etcd-endpoints %s --etcd-prefix %s --cluster %s --shard-count %d \\\n"+
		"                 %s --admin-addr 127.0.0.1:0\n", o.endpoints, o.prefix, o.cluster, o.shardCount, strings.TrimSpace(flags))
	fmt.Fprintf(out, "  faults       kill -STOP <pid> makes a zombie runner (kill -CONT it back); kill -9 <pid> a dead one:\n")
	fmt.Fprintf(out, "               its shards move within about %s (the demo's lease TTL); a manual detach moves them at once\n", devLeaseTTL)
	fmt.Fprintf(out, "  tasks        %d/s: 55%% sleep, 30%% noop, and on purpose 12%% that fail once then complete,\n", o.devRate)
	fmt.Fprintf(out, "               2%% that always fail (dead after 2 attempts) and 1%% that miss their deadline (failed):\n")
	fmt.Fprintf(out, "               failed and dead grow steadily by design\n")
	if pool := emailsPool(len(runners)); pool > 0 {
		fmt.Fprintf(out, "  a mixed fleet %d runners serve the default queue; %s is an emails pool (--queues emails=4),\n", len(runners)-1, runners[pool-1].id)
		fmt.Fprintf(out, "               which runs the %d%% of tasks sent to the emails queue: kill it and they wait, shown\n", emailsShare)
		fmt.Fprintf(out, "               as unrunnable on the status page until it is back\n")
	}
	fmt.Fprintf(out, "  timings      stale threshold %s, task heartbeat %s, election TTL %s (flags you give override them)\n",
		o.staleThreshold, o.heartbeatInterval, o.electionTTL)
	fmt.Fprintf(out, "  Ctrl-C stops everything and removes the temporary data (%s)\n\n", tmp)

}

// produce enqueues a mix of demo tasks at rate per second until ctx ends.
func produce(ctx context.Context, c *client.Tasks, rate int, log hclog.Logger) {
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
		if _, err := c.EnqueueBatch(ctx, batch); err != nil && ctx.Err() == nil {
			log.Warn("enqueueing demo tasks failed", "error", err)
		}
	}
}

// emailsShare is the percentage of demo tasks sent to the emails queue
// when the demo runs an emails pool.
const emailsShare = 20

// emailsPool is the number (1-based) of the demo runner that serves the
// emails queue alone, or 0: with three runners or more the last is an
// emails pool, so that the demo shows a mixed fleet; with fewer every
// runner serves both queues.
func emailsPool(runners int) int {
	if runners >= 3 {
		return runners
	}
	return 0
}

// demoTask draws one task: mostly short sleeps and no-ops, some that fail
// once then succeed, a few that never succeed (dead) and a few that miss
// their deadline (failed); emailsShare percent of them in the emails
// queue.
func demoTask() tasks.NewTask {
	t := demoKind()
	if rand.IntN(100) < emailsShare {
		t.Queue = "emails"
	}
	return t
}

func demoKind() tasks.NewTask {
	switch p := rand.IntN(100); {
	case p < 55:
		return tasks.NewTask{Kind: "sleep", Payload: fmt.Appendf(nil, `{"ms": %d}`, 20+rand.IntN(400))}
	case p < 85:
		return tasks.NewTask{Kind: "noop"}
	case p < 97:
		return tasks.NewTask{Kind: "fail", Payload: []byte(`{"times": 1}`)}
	case p < 99:
		return tasks.NewTask{Kind: "fail", Payload: []byte(`{"times": 99}`), Options: tasks.Options{MaxAttempts: 2}}
	default:
		return tasks.NewTask{Kind: "sleep", Payload: []byte(`{"ms": 5000}`), Options: tasks.Options{Deadline: time.Now().Add(1500 * time.Millisecond)}}
	}
}

// progress prints a line every few seconds until ctx ends: tasks done,
// rate, counts by state, and shards per runner with any runner that is not
// healthy marked (unresponsive, lost).
func progress(ctx context.Context, c *coordinator.Coordinator, out io.Writer) {
	start := time.Now()
	tick := time.NewTicker(3 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		v, err := c.Cluster(qctx)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				fmt.Fprintf(out, "%5.0fs  (progress unavailable: %s)\n", time.Since(start).Seconds(), cli.OneLine(err))
			}
			continue
		}
		fmt.Fprintf(out, "%5.0fs  completed %d (%.0f/s)  ready %d  running %d  failed %d  dead %d  |  shards: %s%s\n",
			time.Since(start).Seconds(), v.Tasks[tasks.Completed], v.Rates[tasks.Completed], v.Tasks[tasks.Ready],
			v.Tasks[tasks.Running], v.Tasks[tasks.Failed], v.Tasks[tasks.Dead], shardsLine(v), databasesLine(v))
	}
}

// shardsLine is "runner-1 85, runner-2 86 (detached), runner-3 85 (unresponsive)",
// then runners lost in the last minute and unowned shards (of every
// capability group).
func shardsLine(v coordinator.ClusterView) string {
	owners := map[string]int{}
	for _, g := range v.Groups {
		for _, id := range g.Owners {
			owners[id]++
		}
	}
	var parts []string
	for _, r := range v.Runners {
		var marks []string
		if r.State != shard.StateAttached {
			marks = append(marks, r.State)
		}
		if r.Health != coordinator.HealthOK {
			marks = append(marks, r.Health)
		}
		mark := ""
		if len(marks) > 0 {
			mark = " (" + strings.Join(marks, ", ") + ")"
		}
		pool := ""
		if !slices.Equal(r.Queues, []string{tasks.DefaultQueue}) {
			pool = " [" + strings.Join(r.Queues, ",") + "]"
		}
		parts = append(parts, fmt.Sprintf("%s%s %d%s", r.ID, pool, owners[r.ID], mark))
	}
	for _, r := range v.Gone {
		if r.Health == coordinator.HealthLost && time.Since(r.LastSeen) < time.Minute {
			parts = append(parts, r.ID+" lost")
		}
	}
	if owners[""] > 0 {
		parts = append(parts, fmt.Sprintf("unowned %d", owners[""]))
	}
	return strings.Join(parts, ", ")
}

// databasesLine is "  |  main 812 completed, second 799 completed
// (unavailable)" for a demo of several databases, "" for one.
func databasesLine(v coordinator.ClusterView) string {
	if len(v.Databases) < 2 {
		return ""
	}
	parts := make([]string, len(v.Databases))
	for i, d := range v.Databases {
		parts[i] = fmt.Sprintf("%s %d completed", d.Name, d.Tasks[tasks.Completed])
		if d.Health != placement.HealthOK {
			parts[i] += " (" + d.Health + ")"
		}
	}
	return "  |  " + strings.Join(parts, ", ")
}

type devRunner struct {
	id       string
	admin    string
	cmd      *exec.Cmd
	done     chan error
	stopping atomic.Bool // set before the demo stops it, so its exit is expected
}

func startDevRunner(n int, bin string, o options, out io.Writer) (*devRunner, error) {
	port, err := freeport.Port()
	if err != nil {
		return nil, err
	}
	r := &devRunner{id: fmt.Sprintf("runner-%d", n), admin: fmt.Sprintf("127.0.0.1:%d", port), done: make(chan error, 1)}
	queues := "default"
	switch emailsPool(o.devRunners) {
	case 0:
		queues = "default,emails"
	case n:
		queues = "emails=4"
	}
	r.cmd = exec.Command(bin,
		"--etcd-endpoints", o.endpoints, "--etcd-prefix", o.prefix, "--cluster", o.cluster,
		"--shard-count", strconv.Itoa(o.shardCount), "--queues", queues,
		"--runner-id", r.id, "--admin-addr", r.admin, "--lease-ttl", devLeaseTTL.String(), "--recovery-window", "2s",
		"--heartbeat-interval", o.heartbeatInterval.String(), "--handoff-timeout", "5s",
		"--retry-base", o.retryBase.String(), "--retry-cap", o.retryCap.String(), "--log-level", "warn")
	// Its own process group, so a terminal's Ctrl-C reaches only this
	// process, which then drains the runner with exactly one SIGTERM (a
	// second signal would make it exit at once); and SIGTERM if this
	// process dies without stopping it.
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	// The database URL goes by environment, not on the command line, where
	// every local user could read its password. The rest of this process's
	// environment passes on: OTEL_* among it, so the runners trace as this
	// coordinator does (service.name shardrun-runner unless
	// OTEL_SERVICE_NAME says otherwise).
	r.cmd.Env = append(withoutEnv(os.Environ(), "DATABASE_URL", "DATABASE_URL_FILE", cli.DatabasesEnv, cli.DatabasesFileEnv), "DATABASE_URL="+o.databaseURL)
	if len(o.databases) > 0 {
		var list []string
		for _, d := range o.databases {
			list = append(list, d.Name+"="+d.URL)
		}
		r.cmd.Env = append(r.cmd.Env, cli.DatabasesEnv+"="+strings.Join(list, " "))
	}
	// The etcd client's TLS, as this coordinator's: by environment too (the
	// key is a secret).
	for name, v := range map[string]string{"SHARDRUN_ETCD_CA": o.etcdCA, "SHARDRUN_ETCD_CERT": o.etcdCert, "SHARDRUN_ETCD_KEY": o.etcdKey} {
		if v != "" {
			r.cmd.Env = append(withoutEnv(r.cmd.Env, name, name+"_FILE"), name+"="+v)
		}
	}
	w := linewriter.New(func(line string) { fmt.Fprintf(out, "%s | %s\n", r.id, line) })
	r.cmd.Stdout, r.cmd.Stderr = w, w
	if err := r.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s from %s: %w", r.id, bin, err)
	}
	go func() {
		err := r.cmd.Wait()
		if !r.stopping.Load() {
			// Killed or crashed while the demo runs: say so where the user
			// is looking, with what happens next.
			fmt.Fprintf(out, "!! %s (pid %d) exited: %v — it will not be restarted; its lease expires within %s and the other runners take its shards\n",
				r.id, r.cmd.Process.Pid, exitText(err), devLeaseTTL)
		}
		r.done <- err
	}()
	return r, nil
}

// stopRunners drains every runner (SIGTERM) and kills those still running
// after 20s.
func stopRunners(rs []*devRunner, out io.Writer) {
	for _, r := range rs {
		if r != nil {
			r.stopping.Store(true)
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

// withoutEnv drops the named variables from env.
func withoutEnv(env []string, names ...string) []string {
	var out []string
	for _, kv := range env {
		name, _, _ := strings.Cut(kv, "=")
		if !slices.Contains(names, name) {
			out = append(out, kv)
		}
	}
	return out
}

func exitText(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
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
