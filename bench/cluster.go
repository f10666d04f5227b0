package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/faultproxy"
	"github.com/shardrun/shardrun/internal/freeport"
	"github.com/shardrun/shardrun/internal/linewriter"
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
	proxy      bool
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
	args := []string{"--etcd-endpoints", endpoint, "--cluster", c.name, "--shard-count", strconv.Itoa(c.shards),
		"--database-url", c.dsn, "--runner-id", id, "--admin-addr", r.admin, "--log-format", "json",
		"--lease-ttl", o.leaseTTL.String(), "--recovery-window", "1s", "--handoff-timeout", "2s"}
	if o.maxWorkers > 0 {
		args = append(args, "--max-workers", strconv.Itoa(o.maxWorkers), "--db-max-conns", strconv.Itoa(cmp.Or(o.dbMaxConns, 8)))
	}
	r.cmd = exec.Command(c.env.runnerBin, args...)
	r.cmd.Stdout, r.cmd.Stderr = r.logs, r.logs
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { r.done <- r.cmd.Wait() }()
	c.runners = append(c.runners, r)
	return r, nil
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

// owners reads the shard keys.
func (c *cluster) owners(ctx context.Context) (map[int]string, error) {
	resp, err := c.env.cli.Get(ctx, c.prefix()+"shards/", clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := map[int]string{}
	for _, kv := range resp.Kvs {
		s, _ := strconv.Atoi(strings.TrimPrefix(string(kv.Key), c.prefix()+"shards/"))
		out[s] = string(kv.Value)
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

// metric reads a metric of a runner's /metrics, summed over labels.
func (r *runnerProc) metric(name string) float64 {
	resp, err := http.Get("http://" + r.admin + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var sum float64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, name+" ") || strings.HasPrefix(line, name+"{") {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			sum += v
		}
	}
	return sum
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
