// Package integration runs the real runner and coordinator binaries as
// processes against an embedded etcd and a real PostgreSQL, injects the
// faults that happen in production (kill -9, SIGSTOP, a partitioned etcd
// link, SIGTERM, a database restart, a dead leader) and checks the
// system's invariants at the end of every scenario.
//
// The scenarios that bound no timing from above call t.Parallel: they run
// two at a time, after the others, which each run alone (beside other
// packages' tests) so that a second cluster's load does not stretch the
// times they measure.
package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/faultproxy"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/pgtmp"
	"github.com/shardrun/shardrun/internal/tempdir"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

func TestMain(m *testing.M) {
	pgtest.Main(m, testutil.EtcdLeaks...)
}

// Timings shared by every scenario: short, so that failures resolve in
// seconds.
const (
	shards         = 64
	leaseTTL       = 2 * time.Second
	recoveryWindow = time.Second
	electionTTL    = 2 * time.Second
	staleThreshold = 5 * time.Second
	adminToken     = "integration-admin"
	apiToken       = "integration-api"
	prefix         = "/shardrun/it/"
)

// binDirPrefix names the directory of the binaries built for the tests.
const binDirPrefix = "shardrun-it-bin-"

var (
	buildOnce     sync.Once
	etcdBuildOnce sync.Once
	etcdBuildErr  error
	binDir        string
	buildErr      error
)

// binaries builds cmd/runner, cmd/coordinator and internal/cmd/txworker
// (a runner on package shardrun) once per test binary.
func binaries(t *testing.T) (runner, coordinator string) {
	t.Helper()
	buildOnce.Do(func() {
		// tempdir records this process as the owner, so a directory left by
		// a killed test binary is removed by the next run.
		binDir, buildErr = tempdir.New(binDirPrefix)
		if buildErr != nil {
			return
		}
		pgtest.AtExit(func() { _ = os.RemoveAll(binDir) })
		args := []string{"build", "-o", binDir + "/"}
		if os.Getenv("SHARDRUN_RACE_BINARIES") == "1" {
			args = append(args, "-race")
		}
		out, err := exec.Command("go", append(args, "../cmd/runner", "../cmd/coordinator", "../internal/cmd/txworker")...).CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("building the binaries: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(binDir, "runner"), filepath.Join(binDir, "coordinator")
}

// cluster is one scenario's world.
type cluster struct {
	t         *testing.T
	start     time.Time
	endpoints []string
	cli       *clientv3.Client
	dsn       string
	store     *store.Store
	// dbs are the cluster's databases, in the map's order: main (dsn,
	// store) alone, or with others (newClusterOnDatabases).
	dbs    []clusterDB
	runner string
	coord  string

	mu       sync.Mutex
	procs    map[string]*proc
	events   []etcdEvent
	enqueued map[int64]tasks.State // expected terminal state per task
	// caps[name] is what each runner ever started serves: the queues it
	// claims from and the kinds it handles.
	caps     map[string]capabilities
	watchEnd func()
}

// clusterDB is one of the cluster's databases.
type clusterDB struct {
	name, dsn string
	store     *store.Store
}

// capabilities are a runner's --queues and --kinds.
type capabilities struct{ queues, kinds []string }

// builtinKinds are the runner binary's handlers, what it handles without
// --kinds.
var builtinKinds = []string{"fail", "noop", "sleep"}

// can reports whether a runner with these capabilities may run a task of
// kind in queue.
func (cp capabilities) can(queue, kind string) bool {
	return slices.Contains(cp.queues, queue) && slices.Contains(cp.kinds, kind)
}

// etcdEvent is one change of hands of a unit (a shard of a capability
// group), as etcd's history of the owner keys shows it (shard.History).
type etcdEvent struct {
	at    time.Time
	put   bool // acquired; released when false
	group string
	shard int
	value string // the runner
	// created is the epoch of the term (the revision that started it).
	created int64
	rev     int64
}

// proc is one runner or coordinator process.
type proc struct {
	name   string
	kind   string // runner or coordinator
	addr   string // admin or HTTP address
	cmd    *exec.Cmd
	logs   *linewriter.Buffer
	proxy  *faultproxy.Proxy
	done   chan error
	exited bool
	err    error
	killed bool
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	srv, cli := testutil.Etcd(t)
	return newClusterOn(t, srv.Endpoints(), cli)
}

// newClusterOn is a scenario's world on the given etcd endpoints (an
// embedded etcd, or a cluster of etcd processes).
func newClusterOn(t *testing.T, endpoints []string, cli *clientv3.Client) *cluster {
	t.Helper()
	runnerBin, coordBin := binaries(t)
	st, dsn := pgtest.NewStore(t, store.Options{MaxConns: 4})
	c := &cluster{t: t, start: time.Now(), endpoints: endpoints, cli: cli, dsn: dsn, store: st, runner: runnerBin, coord: coordBin,
		procs: map[string]*proc{}, enqueued: map[int64]tasks.State{}, caps: map[string]capabilities{},
		dbs: []clusterDB{{name: "main", dsn: dsn, store: st}}}
	c.watch()
	t.Cleanup(func() {
		for _, p := range c.all() {
			if !p.exited {
				_ = p.cmd.Process.Kill()
				<-p.done
			}
			if p.proxy != nil {
				p.proxy.Close()
			}
		}
		if t.Failed() {
			for _, p := range c.all() {
				t.Logf("---- log of %s (%s) ----\n%s", p.name, p.kind, linewriter.Tail(p.logs.String(), 150))
			}
		}
		c.watchEnd()
		http.DefaultClient.CloseIdleConnections()
	})
	return c
}

// newClusterOnDatabases is a scenario's world on an embedded etcd and
// several databases: main (the test binary's server) and one more for
// each of dsns, by name, in order (the map's order).
func newClusterOnDatabases(t *testing.T, others ...clusterDB) *cluster {
	t.Helper()
	c := newCluster(t)
	for _, d := range others {
		st, err := store.Open(context.Background(), d.dsn, store.Options{MaxConns: 4})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(st.Close)
		if err := st.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		d.store = st
		c.dbs = append(c.dbs, d)
	}
	return c
}

// databaseArgs are the flags that give a process the cluster's
// databases: --database-url for main alone, --database NAME=URL for each
// of several.
func (c *cluster) databaseArgs() []string {
	if len(c.dbs) == 1 {
		return []string{"--database-url", c.dsn}
	}
	var args []string
	for _, d := range c.dbs {
		args = append(args, "--database", d.name+"="+d.dsn)
	}
	return args
}

// db is the named database of the cluster.
func (c *cluster) db(name string) clusterDB {
	c.t.Helper()
	for _, d := range c.dbs {
		if d.name == name {
			return d
		}
	}
	c.t.Fatalf("no database %s", name)
	return clusterDB{}
}

// watch records every etcd event of the cluster from the start.
func (c *cluster) watch() {
	ctx, cancel := context.WithCancel(context.Background())
	ch := c.cli.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(1))
	done := make(chan struct{})
	history := shard.NewHistory(prefix, shards)
	go func() {
		defer close(done)
		for resp := range ch {
			now := time.Now()
			c.mu.Lock()
			for _, ev := range resp.Events {
				for _, u := range history.Apply(ev) {
					c.events = append(c.events, etcdEvent{at: now, put: u.Acquired, group: u.Group, shard: u.Shard,
						value: u.Runner, created: u.Epoch, rev: u.Rev})
				}
			}
			c.mu.Unlock()
		}
	}()
	c.watchEnd = func() { cancel(); <-done }
}

func (c *cluster) all() []*proc {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*proc, 0, len(c.procs))
	for _, p := range c.procs {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

func (c *cluster) proc(name string) *proc {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.procs[name]
}

func (c *cluster) launch(name, kind, bin, addr string, proxy *faultproxy.Proxy, args ...string) *proc {
	c.t.Helper()
	p := &proc{name: name, kind: kind, addr: addr, proxy: proxy, logs: &linewriter.Buffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	if err := p.cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	go func() {
		err := p.cmd.Wait()
		c.mu.Lock()
		p.exited, p.err = true, err
		c.mu.Unlock()
		p.done <- err
	}()
	c.mu.Lock()
	c.procs[name] = p
	c.mu.Unlock()
	return p
}

// startRunner starts a runner process of the default queue that handles
// every built-in kind; withProxy puts a fault proxy between it and etcd.
func (c *cluster) startRunner(name string, withProxy bool) *proc {
	c.t.Helper()
	return c.startRunnerServing(name, withProxy, []string{tasks.DefaultQueue}, builtinKinds)
}

// startRunnerServing starts a runner that claims from queues and handles
// kinds.
func (c *cluster) startRunnerServing(name string, withProxy bool, queues, kinds []string) *proc {
	c.t.Helper()
	c.mu.Lock()
	c.caps[name] = capabilities{queues: queues, kinds: kinds}
	c.mu.Unlock()
	endpoint := strings.Join(c.endpoints, ",")
	var proxy *faultproxy.Proxy
	if withProxy {
		var err error
		if proxy, err = faultproxy.New(strings.TrimPrefix(c.endpoints[0], "http://")); err != nil {
			c.t.Fatal(err)
		}
		endpoint = "http://" + proxy.Addr()
	}
	return c.serve(name, "runner", c.runner, proxy, "/readyz", func(addr string) []string {
		return append([]string{"--etcd-endpoints", endpoint, "--etcd-prefix", "/shardrun/", "--cluster", "it", "--shard-count", strconv.Itoa(shards),
			"--runner-id", name, "--admin-addr", addr, "--admin-token", adminToken,
			"--lease-ttl", leaseTTL.String(), "--recovery-window", recoveryWindow.String(), "--heartbeat-interval", "1s",
			"--poll-interval", "500ms", "--handoff-timeout", "2s", "--retry-base", "100ms", "--retry-cap", "500ms",
			"--log-format", "json", "--log-level", "info",
			"--queues", strings.Join(queues, ","), "--kinds", strings.Join(kinds, ",")}, c.databaseArgs()...)
	})
}

func (c *cluster) startCoordinator(name string) *proc {
	c.t.Helper()
	return c.serve(name, "coordinator", c.coord, nil, "/healthz", func(addr string) []string {
		return append([]string{"--etcd-endpoints", strings.Join(c.endpoints, ","), "--etcd-prefix", "/shardrun/", "--cluster", "it",
			"--shard-count", strconv.Itoa(shards), "--coordinator-id", name, "--http-addr", addr,
			"--api-token", apiToken, "--election-ttl", electionTTL.String(), "--sweep-interval", "1s",
			"--stale-threshold", staleThreshold.String(), "--heartbeat-interval", "1s", "--retry-base", "100ms",
			"--retry-cap", "500ms", "--log-format", "json"}, c.databaseArgs()...)
	})
}

// serve launches a process listening on a free loopback address and waits
// until health answers 200. The address is probed free and bound by the
// process a moment later; if another process took it in between, the
// process exits saying so and serve tries a new address.
func (c *cluster) serve(name, kind, bin string, proxy *faultproxy.Proxy, health string, args func(addr string) []string) *proc {
	c.t.Helper()
	for attempt := 0; ; attempt++ {
		addr := testutil.FreeAddr(c.t)
		p := c.launch(name, kind, bin, addr, proxy, args(addr)...)
		var exited bool
		c.waitFor(30*time.Second, name+" serving", func() bool {
			select {
			case err := <-p.done:
				p.done <- err // leave it for whoever waits on the process
				exited = true
				return true
			default:
			}
			return httpCode(c.t, "GET", "http://"+addr+health, "") == 200
		})
		if !exited {
			return p
		}
		if attempt >= 3 || !strings.Contains(p.logs.String(), "address already in use") {
			c.t.Fatalf("%s exited while starting:\n%s", name, p.logs.String())
		}
	}
}

func (c *cluster) waitFor(timeout time.Duration, what string, cond func() bool) time.Duration {
	c.t.Helper()
	return testutil.WaitFor(c.t, timeout, what, cond)
}

// signal sends sig to a process.
func (p *proc) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signalling %s with %v: %v", p.name, sig, err)
	}
	if sig == syscall.SIGKILL {
		p.killed = true
	}
}

// terminate sends SIGTERM and requires a clean exit within bound.
func (p *proc) terminate(t *testing.T, bound time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	p.signal(t, syscall.SIGTERM)
	select {
	case err := <-p.done:
		p.done <- err
		if err != nil {
			t.Fatalf("%s did not exit cleanly on SIGTERM: %v", p.name, err)
		}
	case <-time.After(bound):
		t.Fatalf("%s did not exit within %s of SIGTERM", p.name, bound)
	}
	return time.Since(start)
}

// pgServer is the throwaway PostgreSQL, for the scenario that restarts it.
func (c *cluster) pgServer() *pgtmp.Server {
	c.t.Helper()
	srv := pgtest.Server()
	if srv == nil {
		c.t.Fatal("restarting PostgreSQL needs the throwaway server: unset TEST_DATABASE_URL")
	}
	return srv
}

// owners reads who owns each shard now, in every capability group (the
// runners of a scenario are of one group unless it says otherwise).
func (c *cluster) owners() map[int]string {
	c.t.Helper()
	cl, err := shard.ReadCluster(context.Background(), c.cli, prefix, shards)
	if err != nil {
		c.t.Fatal(err)
	}
	out := map[int]string{}
	for _, g := range cl.Groups {
		for s, o := range g.Owners {
			if o != "" {
				out[s] = o
			}
		}
	}
	return out
}

func (c *cluster) shardsOf(runner string) map[int]bool {
	out := map[int]bool{}
	for s, o := range c.owners() {
		if o == runner {
			out[s] = true
		}
	}
	return out
}

// ownedElsewhere reports whether every one of the shards is owned by a
// runner other than from.
func (c *cluster) ownedElsewhere(set map[int]bool, from string) bool {
	o := c.owners()
	for s := range set {
		if o[s] == "" || o[s] == from {
			return false
		}
	}
	return true
}

// balanced reports whether every shard is owned and each of the given
// runners owns its fair share.
func (c *cluster) balanced(runners ...string) bool {
	o := c.owners()
	if len(o) != shards {
		return false
	}
	count := map[string]int{}
	for _, id := range o {
		count[id]++
	}
	lo, hi := shards/len(runners), (shards+len(runners)-1)/len(runners)
	for _, id := range runners {
		if count[id] < lo || count[id] > hi {
			return false
		}
	}
	return len(count) == len(runners)
}

// enqueue posts tasks through the coordinator API and remembers what each
// one must end as.
func (c *cluster) enqueue(coord *proc, n int, kind, payload string, maxAttempts int, expect tasks.State) {
	c.t.Helper()
	c.enqueueWith(coord, n, kind, payload, map[string]any{"max_attempts": maxAttempts}, expect)
}

// enqueueWith is enqueue with the given fields set on every task.
func (c *cluster) enqueueWith(coord *proc, n int, kind, payload string, fields map[string]any, expect tasks.State) {
	c.t.Helper()
	var batch []map[string]any
	for i := range n {
		task := map[string]any{"kind": kind, "key": fmt.Sprintf("%s-%d-%d", kind, time.Now().UnixNano(), i)}
		for k, v := range fields {
			task[k] = v
		}
		if payload != "" {
			task["payload"] = json.RawMessage(payload)
		}
		batch = append(batch, task)
	}
	c.enqueueBatch(coord, batch, expect)
}

// enqueueBatch posts a batch of tasks, each with its key, through the
// coordinator API and remembers what each must end as.
func (c *cluster) enqueueBatch(coord *proc, batch []map[string]any, expect tasks.State) {
	c.t.Helper()
	body, _ := json.Marshal(batch)
	code, resp := testutil.HTTP(c.t, "POST", "http://"+coord.addr+"/api/tasks", apiToken, string(body))
	if code != 201 {
		c.t.Fatalf("enqueue through the API: %d %s", code, resp)
	}
	// Read back the ids of what was just inserted, by their keys, in
	keys := make([]string, len(batch))
	for i, task := range batch {
		keys[i] = fmt.Sprint(task["key"])
	}
	c.expectKeys(keys, expect)
}

// expectKeys records every task of keys, in whichever database it is, as
// one that must end in state expect, and returns how many it found. It
// reads the databases in order until all are found (a database that is
// down holds none of them: the API refused the batch otherwise).
func (c *cluster) expectKeys(keys []string, expect tasks.State) int {
	c.t.Helper()
	found := 0
	for _, d := range c.dbs {
		if found == len(keys) {
			break
		}
		rows, err := d.store.Pool().Query(context.Background(), `SELECT id FROM task_view WHERE key = ANY ($1)`, keys)
		if err != nil {
			c.t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			c.t.Fatal(err)
		}
		c.mu.Lock()
		for _, id := range ids {
			c.enqueued[id] = expect
		}
		c.mu.Unlock()
		found += len(ids)
	}
	return found
}

// counts are the tasks by state, summed over the databases.
func (c *cluster) counts() map[tasks.State]int64 {
	c.t.Helper()
	sum := map[tasks.State]int64{}
	for _, d := range c.dbs {
		counts, err := d.store.CountByState(context.Background())
		if err != nil {
			c.t.Fatal(err)
		}
		for st, n := range counts {
			sum[st] += n
		}
	}
	return sum
}

// waitDrained waits until no task is ready or running in any database.
func (c *cluster) waitDrained(timeout time.Duration) time.Duration {
	c.t.Helper()
	return c.waitFor(timeout, "all tasks finished", func() bool {
		for _, d := range c.dbs {
			counts, err := d.store.CountByState(context.Background())
			if err != nil || counts[tasks.Ready] != 0 || counts[tasks.Running] != 0 {
				return false
			}
		}
		return true
	})
}

// metric reads one metric (summed over labels) from a process's /metrics.
func (c *cluster) metric(p *proc, name string) float64 {
	c.t.Helper()
	_, body := testutil.HTTP(c.t, "GET", "http://"+p.addr+"/metrics", "", "")
	var sum float64
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, name+" ") || strings.HasPrefix(line, name+"{") {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			sum += v
		}
	}
	return sum
}

// logEvent is one line of a process's JSON log.
type logEvent struct {
	at  time.Time
	msg string
	kv  map[string]any
}

// logEvents parses a process's JSON log lines whose message contains msg.
func (p *proc) logEvents(msg string) []logEvent {
	var out []logEvent
	for _, line := range strings.Split(p.logs.String(), "\n") {
		if !strings.HasPrefix(line, "{") || !strings.Contains(line, msg) {
			continue
		}
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) != nil {
			continue
		}
		at, err := time.Parse("2006-01-02T15:04:05.000000Z07:00", fmt.Sprint(m["@timestamp"]))
		if err != nil {
			continue
		}
		out = append(out, logEvent{at: at, msg: fmt.Sprint(m["@message"]), kv: m})
	}
	return out
}

// firstEventAfter is the time of p's first log event msg after t, or zero.
func (p *proc) firstEventAfter(msg string, t time.Time) time.Time {
	for _, e := range p.logEvents(msg) {
		if e.at.After(t) {
			return e.at
		}
	}
	return time.Time{}
}

// firstAcquisitionAfter is the first acquisition of one of shards by
// someone other than not, after t.
func (c *cluster) firstAcquisitionAfter(t time.Time, shardSet map[int]bool, not string) (etcdEvent, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.events {
		if e.put && e.at.After(t) && shardSet[e.shard] && e.value != not {
			return e, true
		}
	}
	return etcdEvent{}, false
}

func httpCode(t *testing.T, method, url, token string) int {
	code, _ := testutil.HTTP(t, method, url, token, "")
	return code
}
