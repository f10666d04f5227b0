package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/shardrun/shardrun/internal/faultproxy"
	"github.com/shardrun/shardrun/internal/freeport"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/shard"
)

// cluster is one trial's set of runner processes under a fresh etcd prefix.
type cluster struct {
	env     *env
	name    string // cluster name, fresh per trial
	dsn     string
	shards  int
	runners []*runnerProc
}

type runnerProc struct {
	id    string
	admin string
	cmd   *exec.Cmd
	logs  *linewriter.Buffer
	proxy *faultproxy.Proxy
	done  chan error
}

type runnerOpts struct {
	leaseTTL   time.Duration
	maxWorkers int
	// dbMaxConns is --db-max-conns when maxWorkers is set; 0 means 8. Many
	// runners on one server need fewer each (max_connections is 300).
	dbMaxConns int
	// queues is --queues (name=limit,...); empty: the runner's default.
	queues string
	proxy  bool
	// env is added to the runner's environment (the tracing section's
	// OTEL_* variables).
	env []string
	// kindCount, when set, runs the runner as a child of the bench binary
	// (runnerChildFlag) instead of bin/runner: with kinds k00, k01...
	// (kindCount of them) beside the built-ins, handling kinds (all of
	// them when empty).
	kindCount int
	kinds     []string
	// databases, when set, are the runner's --database NAME=URL flags, in
	// order, instead of --database-url with the cluster's dsn (bin/runner
	// only).
	databases []string
}

func (e *env) newCluster(name, dsn string, shards int) *cluster {
	return &cluster{env: e, name: name, dsn: dsn, shards: shards}
}

func (c *cluster) prefix() string { return "/shardrun/" + c.name + "/" }

// start starts a runner and waits until it is ready.
func (c *cluster) start(id string, o runnerOpts) (*runnerProc, error) {
	r, err := c.spawn(id, o)
	if err != nil {
		return nil, err
	}
	return r, r.waitReady()
}

// spawn starts a runner without waiting for it, so that many can start at
// once; waitReady then waits for each.
func (c *cluster) spawn(id string, o runnerOpts) (*runnerProc, error) {
	if o.kindCount > 0 && len(o.databases) > 0 {
		return nil, fmt.Errorf("runner %s: a runner child of the bench binary takes one database", id)
	}
	endpoint := c.env.etcd.Endpoints()[0]
	r := &runnerProc{id: id, logs: &linewriter.Buffer{}, done: make(chan error, 1)}
	if o.proxy {
		p, err := faultproxy.New(c.env.etcd.Addr())
		if err != nil {
			return nil, err
		}
		r.proxy = p
		endpoint = "http://" + p.Addr()
	}
	port, err := freeport.Port()
	if err != nil {
		return nil, err
	}
	r.admin = fmt.Sprintf("127.0.0.1:%d", port)
	if o.kindCount > 0 {
		if err := c.spawnChild(r, endpoint, o); err != nil {
			return nil, err
		}
		return r, nil
	}
	args := []string{"--etcd-endpoints", endpoint, "--cluster", c.name, "--shard-count", strconv.Itoa(c.shards)}
	if len(o.databases) == 0 {
		args = append(args, "--database-url", c.dsn)
	}
	for _, d := range o.databases {
		args = append(args, "--database", d)
	}
	args = append(args, "--runner-id", id, "--admin-addr", r.admin, "--log-format", "json",
		"--lease-ttl", o.leaseTTL.String(), "--recovery-window", "1s", "--handoff-timeout", "2s")
	if o.maxWorkers > 0 {
		args = append(args, "--max-workers", strconv.Itoa(o.maxWorkers), "--db-max-conns", strconv.Itoa(cmp.Or(o.dbMaxConns, 8)))
	}
	if o.queues != "" {
		args = append(args, "--queues", o.queues)
	}
	r.cmd = exec.Command(c.env.runnerBin, args...)
	if len(o.env) > 0 {
		r.cmd.Env = append(os.Environ(), o.env...)
	}
	r.cmd.Stdout, r.cmd.Stderr = r.logs, r.logs
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { r.done <- r.cmd.Wait() }()
	c.runners = append(c.runners, r)
	return r, nil
}

// spawnChild starts r as a runner child of the bench binary (see
// runnerOpts.kindCount), with the settings spawn gives bin/runner.
func (c *cluster) spawnChild(r *runnerProc, endpoint string, o runnerOpts) error {
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("finding the bench binary to run runner %s in: %w", r.id, err)
	}
	cfg := runnerChildConfig{EtcdEndpoints: []string{endpoint}, Cluster: c.name, ShardCount: c.shards,
		DatabaseURL: c.dsn, RunnerID: r.id, AdminAddr: r.admin, LeaseTTL: o.leaseTTL, RecoveryWindow: time.Second,
		HandoffTimeout: 2 * time.Second, KindCount: o.kindCount, Kinds: o.kinds}
	if o.maxWorkers > 0 {
		cfg.MaxWorkers, cfg.DBMaxConns = o.maxWorkers, cmp.Or(o.dbMaxConns, 8)
	}
	if o.queues != "" {
		if cfg.Queues, err = runner.ParseQueues(o.queues); err != nil {
			return fmt.Errorf("runner %s: %w", r.id, err)
		}
	}
	spec, err := json.Marshal(cfg)
	if err != nil {
		return fmt.Errorf("runner %s's config: %w", r.id, err)
	}
	r.cmd = exec.Command(self, runnerChildFlag, string(spec))
	if len(o.env) > 0 {
		r.cmd.Env = append(os.Environ(), o.env...)
	}
	r.cmd.Stdout, r.cmd.Stderr = r.logs, r.logs
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		return fmt.Errorf("starting runner child %s: %w", r.id, err)
	}
	go func() { r.done <- r.cmd.Wait() }()
	c.runners = append(c.runners, r)
	return nil
}

// startAll spawns n runners (runner-1, runner-2...) at once, so that 16
// start about as fast as one, and returns them once each is ready.
func (c *cluster) startAll(n int, o runnerOpts) ([]*runnerProc, error) {
	var rps []*runnerProc
	for i := range n {
		rp, err := c.spawn(fmt.Sprintf("runner-%d", i+1), o)
		if err != nil {
			return nil, err
		}
		rps = append(rps, rp)
	}
	for _, rp := range rps {
		if err := rp.waitReady(); err != nil {
			return nil, err
		}
	}
	return rps, nil
}

// waitReady waits until the runner's /readyz answers 200.
func (r *runnerProc) waitReady() error {
	if err := waitUntil(60*time.Second, func() bool { return httpStatus("http://"+r.admin+"/readyz") == 200 }); err != nil {
		return fmt.Errorf("runner %s not ready: %w\n%s", r.id, err, linewriter.Tail(r.logs.String(), 20))
	}
	return nil
}

// stop terminates every runner still running (SIGTERM, then SIGKILL).
func (c *cluster) stop() {
	for _, r := range c.runners {
		if r.cmd.ProcessState == nil {
			_ = r.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for _, r := range c.runners {
		select {
		case <-r.done:
		case <-time.After(30 * time.Second):
			_ = r.cmd.Process.Kill()
			<-r.done
		}
		if r.proxy != nil {
			r.proxy.Close()
		}
	}
	c.runners = nil
}

// owners reads who owns each shard (of every capability group: the
// runners of a section are of one group unless it says otherwise).
func (c *cluster) owners(ctx context.Context) (map[int]string, error) {
	cl, err := shard.ReadCluster(ctx, c.env.cli, c.prefix(), c.shards)
	if err != nil {
		return nil, err
	}
	out := map[int]string{}
	for _, g := range cl.Groups {
		for s, o := range g.Owners {
			if o != "" {
				out[s] = o
			}
		}
	}
	return out, nil
}

func (c *cluster) balanced(ctx context.Context, ids ...string) bool {
	o, err := c.owners(ctx)
	if err != nil || len(o) != c.shards {
		return false
	}
	count := map[string]int{}
	for _, id := range o {
		count[id]++
	}
	lo, hi := c.shards/len(ids), (c.shards+len(ids)-1)/len(ids)
	for _, id := range ids {
		if count[id] < lo || count[id] > hi {
			return false
		}
	}
	return len(count) == len(ids)
}

func (c *cluster) shardsOf(ctx context.Context, id string) map[int]bool {
	o, _ := c.owners(ctx)
	out := map[int]bool{}
	for s, owner := range o {
		if owner == id {
			out[s] = true
		}
	}
	return out
}

// running is the cluster's runners that have not exited.
func (c *cluster) running() []*runnerProc {
	var out []*runnerProc
	for _, r := range c.runners {
		if r.cmd.ProcessState == nil {
			out = append(out, r)
		}
	}
	return out
}

// metricWith reads a metric of a runner's /metrics, summed over the
// series whose labels contain every one of labels (as name="value").
func (r *runnerProc) metricWith(name string, labels ...string) (float64, error) {
	resp, err := http.Get("http://" + r.admin + "/metrics")
	if err != nil {
		return 0, fmt.Errorf("reading %s's metrics: %w", r.id, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("reading %s's metrics: %s %v", r.id, resp.Status, err)
	}
	var sum float64
	for _, line := range strings.Split(string(b), "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		i := strings.LastIndexByte(rest, ' ')
		if i < 0 || !allIn(rest[:i], labels) {
			continue
		}
		value := rest[i+1:]
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			return 0, fmt.Errorf("%s's metric %s: %w", r.id, line, err)
		}
		sum += v
	}
	return sum, nil
}

func allIn(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// metric reads a metric of a runner's /metrics, summed over labels; -1
// when it cannot be read.
func (r *runnerProc) metric(name string) float64 {
	v, err := r.metricWith(name)
	if err != nil {
		return -1
	}
	return v
}

// logTime is the time of the first JSON log line whose message contains
// msg, after t; with it the line's fields.
func (r *runnerProc) logTime(msg string, after time.Time) (time.Time, map[string]any, bool) {
	for _, line := range strings.Split(r.logs.String(), "\n") {
		if !strings.Contains(line, msg) {
			continue
		}
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) != nil {
			continue
		}
		at, err := time.Parse("2006-01-02T15:04:05.000000Z07:00", fmt.Sprint(m["@timestamp"]))
		if err == nil && at.After(after) {
			return at, m, true
		}
	}
	return time.Time{}, nil, false
}

func httpStatus(url string) int {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func waitUntil(timeout time.Duration, cond func() bool) error {
	return waitEvery(timeout, 5*time.Millisecond, cond)
}

// waitEvery is waitUntil checking cond every interval.
func waitEvery(timeout, interval time.Duration, cond func() bool) error {
	start := time.Now()
	for !cond() {
		if time.Since(start) > timeout {
			return fmt.Errorf("not within %s", timeout)
		}
		time.Sleep(interval)
	}
	return nil
}

// coordinatorProc is a coordinator process of the cluster: the sweeper,
// retention, the task counts and the unhandled-kind report a deployment
// runs beside its runners, and the HTTP API producers enqueue through.
type coordinatorProc struct {
	addr string
	cmd  *exec.Cmd
	logs *linewriter.Buffer
	done chan error
}

// startCoordinator starts bin/coordinator on the cluster's etcd prefix and
// database and returns once its /healthz answers. Given databases
// (NAME=URL), it is given them as --database flags instead of the
// cluster's one database.
func (c *cluster) startCoordinator(databases ...string) (*coordinatorProc, error) {
	if c.env.coordinatorBin == "" {
		return nil, fmt.Errorf("no coordinator binary: give -coordinator")
	}
	port, err := freeport.Port()
	if err != nil {
		return nil, err
	}
	p := &coordinatorProc{addr: fmt.Sprintf("127.0.0.1:%d", port), logs: &linewriter.Buffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(c.env.coordinatorBin, "--etcd-endpoints", c.env.etcd.Endpoints()[0], "--cluster", c.name,
		"--shard-count", strconv.Itoa(c.shards), "--http-addr", p.addr, "--log-format", "json", "--coordinator-id", "bench")
	p.cmd.Env = os.Environ()
	for _, d := range databases {
		p.cmd.Args = append(p.cmd.Args, "--database", d)
	}
	if len(databases) == 0 {
		// The database URL by environment, as a deployment gives it.
		p.cmd.Env = append(p.cmd.Env, "DATABASE_URL="+c.dsn)
	}
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the coordinator: %w", err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	if err := waitUntil(60*time.Second, func() bool { return httpStatus("http://"+p.addr+"/healthz") == 200 }); err != nil {
		p.stop()
		return nil, fmt.Errorf("coordinator not serving: %w\n%s", err, linewriter.Tail(p.logs.String(), 20))
	}
	return p, nil
}

// stop ends the coordinator (SIGTERM: it resigns; SIGKILL after 30s).
func (p *coordinatorProc) stop() {
	if p.cmd.ProcessState == nil {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// enqueue posts tasks to the coordinator's API as one JSON array.
func (p *coordinatorProc) enqueue(ctx context.Context, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+p.addr+"/api/tasks", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("enqueueing through the API: %w", err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("enqueueing through the API: %s: %s", resp.Status, msg)
	}
	return nil
}
