//go:build deploy

package deploy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
)

// The deploy test runs docker-compose.yml on a Docker engine through the
// faults an operator meets, checks that every task enqueued through the
// API reaches a terminal state exactly once, and logs the figures the
// deploy test's section of docs/development.md quotes (lines starting with FIGURE). `make
// deploy-test` builds the images it needs first (deploy/standins/build.sh).

const (
	composeFile = "../docker-compose.yml"
	// leaseTTL is the runners' lease TTL: docker-compose.yml keeps the
	// default.
	leaseTTL = 10 * time.Second
	// batchSize tasks are enqueued every loadInterval while the load runs.
	batchSize    = 20
	loadInterval = 100 * time.Millisecond
)

func TestDeploy(t *testing.T) {
	requireDocker(t)
	started := time.Now()
	d := newDeployment(t, 1)
	steps := []struct {
		name string
		run  func(*testing.T)
	}{
		{"up", d.up},
		{"load", d.startLoad},
		{"scale", d.scale},
		{"pool", d.pool},
		{"stop_runner", d.stopRunner},
		{"disconnect_runner", d.disconnectRunner},
		{"stop_etcd_leader", d.stopEtcdLeader},
		{"restart_postgres", d.restartPostgres},
		{"tasks_exactly_once", d.checkTasks},
		{"down", d.downAndCheck},
	}
	for _, s := range steps {
		if !t.Run(s.name, s.run) {
			t.FailNow()
		}
	}
	d.figure("the deploy test took %s in all", secs(time.Since(started)))
	t.Log("figures:\n" + strings.Join(d.figures, "\n"))
}

// requireDocker stops the test, as a missing tool, when docker,
// docker-compose or the engine is not there.
func requireDocker(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"docker", "docker-compose"} {
		if _, err := exec.LookPath(tool); err != nil {
			testutil.MissingTool(t, tool+" is not installed: the deploy test runs docker-compose.yml on a Docker engine")
		}
	}
	if out, err := exec.Command("docker", "version", "--format", "{{.Server.Version}}").CombinedOutput(); err != nil {
		testutil.MissingTool(t, fmt.Sprintf("no Docker engine answers: docker version: %v: %s", err, bytes.TrimSpace(out)))
	}
}

// deployment is one compose project of the test, with what the steps share.
type deployment struct {
	t          *testing.T // the whole test's, for what outlives one step
	project    string
	env        []string
	adminToken string
	apiToken   string
	pgPassword string
	transport  *http.Transport
	client     *http.Client

	prefix       string
	shards       int
	coordinators [2]string // base URLs of the published APIs
	pgContainer  string    // main's
	// databases is 1, or 2 for a cluster on the compose file's two
	// PostgreSQL servers (the databases profile; TestDeployOnTwoDatabases),
	// and pgContainers their containers, main's first.
	databases    int
	pgContainers []string
	etcd         *clientv3.Client
	view         *etcdView
	stopView     func()
	load         *load
	cutOff       string // the runner the test disconnected from the network
	down         bool
	figures      []string
}

func newDeployment(t *testing.T, databases int) *deployment {
	d := &deployment{
		t:          t,
		databases:  databases,
		project:    "shardrun-deploytest-" + randomHex(4),
		adminToken: randomHex(16),
		apiToken:   randomHex(16),
		pgPassword: randomHex(8),
		transport:  &http.Transport{},
	}
	d.client = &http.Client{Timeout: 10 * time.Second, Transport: d.transport}
	// The compose file reads these; the caller's own settings must not
	// reach the test's project.
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "SHARDRUN_") || strings.HasPrefix(name, "COMPOSE_") || name == "POSTGRES_PASSWORD" {
			continue
		}
		d.env = append(d.env, kv)
	}
	d.env = append(d.env,
		"SHARDRUN_ADMIN_TOKEN="+d.adminToken, "SHARDRUN_API_TOKEN="+d.apiToken, "POSTGRES_PASSWORD="+d.pgPassword,
		// Free host ports: the default 8080 and 8081 may be taken here.
		"SHARDRUN_COORDINATOR1_PORT=0", "SHARDRUN_COORDINATOR2_PORT=0")
	if databases == 2 {
		d.env = append(d.env, "SHARDRUN_DATABASES=second=postgres://shardrun:"+d.pgPassword+"@postgres2:5432/shardrun?sslmode=disable")
	}
	t.Logf("compose project %s", d.project)
	t.Cleanup(func() { d.cleanup(t) })
	return d
}

// cleanup runs when the test ends: it stops the load, and when the test
// failed before `down`, shows the last logs and removes the project's
// containers, networks and volumes.
func (d *deployment) cleanup(t *testing.T) {
	if d.load != nil {
		d.load.stop()
	}
	d.transport.CloseIdleConnections()
	if d.down {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if t.Failed() {
		out, _ := d.run(ctx, "docker-compose", d.composeArgs("logs", "--no-color", "--tail=40")...)
		t.Logf("last logs of %s:\n%s", d.project, out)
	}
	if out, err := d.run(ctx, "docker-compose", d.composeArgs("down", "-v", "--remove-orphans", "-t", "5")...); err != nil {
		t.Errorf("removing the project after a failure: %v\n%s", err, out)
	}
}

// --- running docker and docker-compose -----------------------------------------

func (d *deployment) run(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = d.env
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, lastLines(out, 40))
	}
	return string(out), nil
}

func (d *deployment) composeArgs(args ...string) []string {
	base := []string{"-f", composeFile, "-p", d.project}
	if d.databases == 2 {
		base = append(base, "--profile", "databases")
	}
	return append(base, args...)
}

// compose runs a docker-compose command on the project; failing, it fails
// the test.
func (d *deployment) compose(t testing.TB, timeout time.Duration, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := d.run(ctx, "docker-compose", d.composeArgs(args...)...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// docker runs a docker command; failing, it fails the test.
func (d *deployment) docker(t testing.TB, timeout time.Duration, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := d.run(ctx, "docker", args...)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// dockerOut runs a docker command that may fail (an inspection).
func (d *deployment) dockerOut(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := d.run(ctx, "docker", args...)
	return strings.TrimSpace(out), err
}

func (d *deployment) projectFilter() string {
	return "label=com.docker.compose.project=" + d.project
}

// container names the container of a service's replica n (1-based).
func (d *deployment) container(t testing.TB, service string, n int) string {
	t.Helper()
	out := d.docker(t, time.Minute, "ps", "-a", "--filter", d.projectFilter(),
		"--filter", "label=com.docker.compose.service="+service,
		"--filter", fmt.Sprintf("label=com.docker.compose.container-number=%d", n), "--format", "{{.Names}}")
	if out == "" || strings.Contains(out, "\n") {
		t.Fatalf("no single container for %s #%d: %q", service, n, out)
	}
	return out
}

// running lists the running containers of a service.
func (d *deployment) running(service string) []string {
	out, err := d.dockerOut("ps", "--filter", d.projectFilter(), "--filter", "label=com.docker.compose.service="+service, "--format", "{{.Names}}")
	if err != nil || out == "" {
		return nil
	}
	names := strings.Fields(out)
	sort.Strings(names)
	return names
}

// hostAddr is the published host address of a container's port, or "".
// It is read each time: Docker moves a published port when the network
// that carried it is disconnected, and a restarted container may get a new
// one.
func (d *deployment) hostAddr(container, port string) string {
	out, err := d.dockerOut("port", container, port+"/tcp")
	if err != nil || out == "" {
		return ""
	}
	return strings.Fields(out)[0]
}

// imageID is the id of the image name, or "" when there is none.
func (d *deployment) imageID(name string) string {
	id, err := d.dockerOut("image", "inspect", "-f", "{{.Id}}", name)
	if err != nil {
		return ""
	}
	return id
}

// --- the cluster through its published endpoints -----------------------------

// clusterView is the part of the coordinator's GET /api/cluster the test
// reads.
type clusterView struct {
	Prefix     string `json:"prefix"`
	ShardCount int    `json:"shard_count"`
	Leader     string `json:"leader"`
	Runners    []struct {
		ID       string `json:"id"`
		State    string `json:"state"`
		Assigned int    `json:"assigned"`
		Owned    int    `json:"owned"`
	} `json:"runners"`
	Owners []string         `json:"owners"`
	Tasks  map[string]int64 `json:"tasks"`
}

// runnerStatus is the part of a runner's GET /status the test reads.
type runnerStatus struct {
	RunnerID      string     `json:"runner_id"`
	State         string     `json:"state"`
	DetachReason  string     `json:"detach_reason"`
	DetachedSince *time.Time `json:"detached_since"`
	LeaseTimeLeft float64    `json:"lease_time_left_seconds"`
	Owned         []struct {
		Shard int   `json:"shard"`
		Epoch int64 `json:"epoch"`
	} `json:"owned"`
}

func (s runnerStatus) ownedShards() []int {
	out := make([]int, 0, len(s.Owned))
	for _, o := range s.Owned {
		out = append(out, o.Shard)
	}
	return out
}

func (d *deployment) getJSON(url, token string, v any) error {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("building GET %s: %w", url, err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := d.client.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("reading GET %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, bytes.TrimSpace(body))
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("decoding GET %s: %w", url, err)
	}
	return nil
}

// postJSON posts body to url with the API token and decodes the created
// (201) answer into v.
func (d *deployment) postJSON(url string, body []byte, v any) error {
	return d.postFor(url, body, http.StatusCreated, v)
}

// postFor posts body to url with the API token and decodes the answer,
// which must have status want, into v.
func (d *deployment) postFor(url string, body []byte, want int, v any) error {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("building POST %s: %w", url, err)
	}
	req.Header.Set("Authorization", "Bearer "+d.apiToken)
	req.Header.Set("Content-Type", "application/json")
	resp, err := d.client.Do(req)
	if err != nil {
		return fmt.Errorf("POST %s: %w", url, err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("reading POST %s: %w", url, err)
	}
	if resp.StatusCode != want {
		return fmt.Errorf("POST %s: %s: %s", url, resp.Status, bytes.TrimSpace(answer))
	}
	if err := json.Unmarshal(answer, v); err != nil {
		return fmt.Errorf("decoding POST %s: %w", url, err)
	}
	return nil
}

func (d *deployment) cluster() (clusterView, error) {
	var v clusterView
	err := d.getJSON(d.coordinators[0]+"/api/cluster", d.apiToken, &v)
	return v, err
}

// status reads a runner's GET /status through its published admin port.
func (d *deployment) status(container string) (runnerStatus, error) {
	var s runnerStatus
	addr := d.hostAddr(container, "9090")
	if addr == "" {
		return s, fmt.Errorf("%s publishes no admin port", container)
	}
	err := d.getJSON("http://"+addr+"/status", d.adminToken, &s)
	return s, err
}

func (d *deployment) mustStatus(t testing.TB, container string) runnerStatus {
	t.Helper()
	s, err := d.status(container)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// keepaliveFailures sums shardrun_lease_keepalive_failures_total over the
// running runners.
func (d *deployment) keepaliveFailures() float64 {
	var sum float64
	for _, c := range d.running("runner") {
		addr := d.hostAddr(c, "9090")
		if addr == "" {
			continue
		}
		resp, err := d.client.Get("http://" + addr + "/metrics")
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "shardrun_lease_keepalive_failures_total "); ok {
				f, _ := strconv.ParseFloat(v, 64)
				sum += f
			}
		}
		resp.Body.Close()
	}
	return sum
}

// pg connects to main's published PostgreSQL port (read anew each time:
// a restarted container may publish another one).
func (d *deployment) pg(ctx context.Context) (*pgx.Conn, error) {
	return d.pgOf(ctx, d.pgContainer)
}

// pgOf connects to the published PostgreSQL port of one of the
// databases' containers.
func (d *deployment) pgOf(ctx context.Context, container string) (*pgx.Conn, error) {
	addr := d.hostAddr(container, "5432")
	if addr == "" {
		return nil, fmt.Errorf("%s publishes no port", container)
	}
	return pgx.Connect(ctx, fmt.Sprintf("postgres://shardrun:%s@%s/shardrun?sslmode=disable&connect_timeout=3", d.pgPassword, addr))
}

// count sums one statement's count over every database of the cluster.
func (d *deployment) count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	var sum int
	for _, c := range d.pgContainers {
		var n int
		d.queryOn(t, c, sql, args, &n)
		sum += n
	}
	return sum
}

// network names one of the project's networks (default, admin).
func (d *deployment) network(t testing.TB, name string) string {
	t.Helper()
	out := d.docker(t, time.Minute, "network", "ls", "--filter", d.projectFilter(),
		"--filter", "label=com.docker.compose.network="+name, "--format", "{{.Name}}")
	if out == "" || strings.Contains(out, "\n") {
		t.Fatalf("no single network %s: %q", name, out)
	}
	return out
}

// query runs one statement on a fresh connection to main.
func (d *deployment) query(t testing.TB, sql string, args []any, dest ...any) {
	t.Helper()
	d.queryOn(t, d.pgContainer, sql, args, dest...)
}

// queryOn runs one statement on a fresh connection to one database's
// container.
func (d *deployment) queryOn(t testing.TB, container, sql string, args []any, dest ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := d.pgOf(ctx, container)
	if err != nil {
		t.Fatalf("connecting to PostgreSQL: %v", err)
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, sql, args...).Scan(dest...); err != nil {
		t.Fatalf("querying PostgreSQL (%s): %v", sql, err)
	}
}

// --- the steps -------------------------------------------------------------------

func (d *deployment) up(t *testing.T) {
	// The image is built first on its own, so that the build and the start
	// are timed apart; `up --build` then finds every layer cached.
	oldImage := d.imageID("shardrun:latest")
	start := time.Now()
	out := d.compose(t, 15*time.Minute, "build")
	buildTook := time.Since(start)
	d.tidyImages(t, oldImage, d.imageID("shardrun:latest"))
	compiled := "the Go build cached"
	if goBuildRan(out) {
		compiled = "the Go build ran"
	}

	start = time.Now()
	d.compose(t, 5*time.Minute, "up", "-d", "--build")
	upTook := time.Since(start)

	var containers int
	healthy := until(t, 3*time.Minute, 500*time.Millisecond, "every container healthy", func() (bool, string) {
		out, err := d.dockerOut("ps", "-a", "--filter", d.projectFilter(), "--format", "{{.Names}}: {{.Status}}")
		if err != nil {
			return false, err.Error()
		}
		lines := strings.Split(out, "\n")
		containers = len(lines)
		var waiting []string
		for _, l := range lines {
			if !strings.Contains(l, "(healthy)") {
				waiting = append(waiting, l)
			}
		}
		return len(lines) == 8+d.databases && len(waiting) == 0, fmt.Sprintf("%d containers, not healthy: %v", len(lines), waiting)
	})

	for i := range d.coordinators {
		addr := d.hostAddr(d.container(t, fmt.Sprintf("coordinator%d", i+1), 1), "8080")
		d.coordinators[i] = "http://" + addr
	}
	cl, err := d.cluster()
	if err != nil {
		t.Fatal(err)
	}
	d.prefix, d.shards = cl.Prefix, cl.ShardCount
	d.pgContainer = d.container(t, "postgres", 1)
	d.pgContainers = []string{d.pgContainer}
	if d.databases == 2 {
		d.pgContainers = append(d.pgContainers, d.container(t, "postgres2", 1))
	}
	// The client and the watch outlive this step: the test's cleanups
	// stop the watch first (registered last), then close the client.
	d.etcd = etcdClient(d.t, d.etcdEndpoints(t)...)
	d.view = &etcdView{prefix: d.prefix, owners: map[int]string{}, runners: map[string]string{}, other: map[string]int{},
		units: shard.NewHistory(d.prefix, d.shards)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.view.run(ctx, d.etcd)
	}()
	d.stopView = sync.OnceFunc(func() {
		cancel()
		<-done
	})
	d.t.Cleanup(d.stopView)
	balanced, spread := d.waitBalanced(t, 3, time.Minute)
	d.figure("docker-compose build: %s (%s)", secs(buildTook), compiled)
	d.figure("up -d --build: %s; all %d containers healthy %s after the command started; 3 runners balanced (%s) by %s",
		secs(upTook), containers, secs(healthy.Sub(start)), spread, secs(balanced.Sub(start)))
	d.figure("coordinators published at %s and %s; leader %s", d.coordinators[0], d.coordinators[1], cl.Leader)
}

// tidyImages removes what a build leaves untagged: the shardrun image it
// replaced, and the build stages of earlier builds. The newest build stage
// is kept under a tag, shardrun:build-cache, so that the next build reuses
// its layers without it being a dangling image. Build stages are found by
// the label they inherit from the golang stand-in, which a replaced golang
// stand-in carries too: it is removed once no build stage uses it.
func (d *deployment) tidyImages(t *testing.T, oldImage, image string) {
	if oldImage != "" && oldImage != image {
		if out, err := d.dockerOut("rmi", oldImage); err != nil {
			t.Logf("the replaced shardrun image %s is still in use: %s", oldImage, out)
		}
	}
	dangling := func() []string {
		out, err := d.dockerOut("images", "-q", "--no-trunc", "--filter", "dangling=true",
			"--filter", "label=org.shardrun.standin="+buildBase(t))
		if err != nil {
			return nil
		}
		return strings.Fields(out) // newest first
	}
	if stages := dangling(); len(stages) > 0 {
		d.docker(t, time.Minute, "tag", stages[0], "shardrun:build-cache")
	}
	// Removing an image can leave its parent dangling: repeat while that
	// frees something.
	for {
		removed := 0
		for _, id := range dangling() {
			if _, err := d.dockerOut("rmi", id); err == nil {
				removed++
			}
		}
		if removed == 0 {
			return
		}
	}
}

// goBuildRan says whether the output of docker-compose build shows the
// Dockerfile's go build step running rather than taken from the cache.
func goBuildRan(out string) bool {
	lines := strings.Split(out, "\n")
	for i, l := range lines {
		if !strings.Contains(l, "RUN CGO_ENABLED=0 go build") {
			continue
		}
		for _, next := range lines[i+1:] {
			if strings.Contains(next, "--->") {
				return !strings.Contains(next, "Using cache")
			}
		}
	}
	return false
}

// buildBase is the image the Dockerfile's build stage starts from.
func buildBase(t *testing.T) string {
	b, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 4 && strings.EqualFold(f[0], "FROM") && strings.EqualFold(f[2], "AS") && f[3] == "build" {
			return f[1]
		}
	}
	t.Fatal("the Dockerfile has no FROM ... AS build")
	return ""
}

// certsDir holds the deployment's certificates (docker-compose.yml mounts
// it): deploy/standins/build.sh makes them with internal/cmd/certgen.
const certsDir = "certs"

// etcdClient talks to the members through their published ports, with
// the deployment's client certificate: etcd requires one.
func etcdClient(t testing.TB, endpoints ...string) *clientv3.Client {
	t.Helper()
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(certsDir, name))
		if err != nil {
			t.Fatalf("the deployment's certificates (run deploy/standins/build.sh, or go run ./internal/cmd/certgen -out deploy/certs): %v", err)
		}
		return string(b)
	}
	tlsConfig, err := cli.TLS{Flag: "--etcd", CA: read("ca.crt"), Cert: read("client.crt"), Key: read("client.key")}.Client()
	if err != nil {
		t.Fatal(err)
	}
	c, err := clientv3.New(clientv3.Config{Endpoints: endpoints, TLS: tlsConfig, Logger: zap.NewNop(),
		DialTimeout: 2 * time.Second, DialKeepAliveTime: 500 * time.Millisecond, DialKeepAliveTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func (d *deployment) etcdEndpoints(t testing.TB) []string {
	var eps []string
	for i := 1; i <= 3; i++ {
		if addr := d.hostAddr(d.container(t, fmt.Sprintf("etcd%d", i), 1), "2379"); addr != "" {
			eps = append(eps, "https://"+addr)
		}
	}
	return eps
}

// waitBalanced waits until n runners are attached and each owns its share
// of the shards (⌊S/n⌋ or ⌈S/n⌉, every shard owned), as etcd shows it and
// as the coordinator reports it (assigned = owned for each runner). It
// returns when etcd first showed the balance, and the shares.
func (d *deployment) waitBalanced(t testing.TB, n int, timeout time.Duration) (time.Time, string) {
	t.Helper()
	var at time.Time
	var spread string
	until(t, timeout, 20*time.Millisecond, fmt.Sprintf("%d runners balanced in etcd", n), func() (bool, string) {
		ok, why, when := d.view.balanced(n, d.shards)
		at, spread = when, why
		return ok, why
	})
	until(t, timeout, 200*time.Millisecond, fmt.Sprintf("%d runners balanced at the coordinator", n), func() (bool, string) {
		cl, err := d.cluster()
		if err != nil {
			return false, err.Error()
		}
		attached := 0
		for _, r := range cl.Runners {
			if r.State == "attached" {
				attached++
				if r.Assigned != r.Owned {
					return false, fmt.Sprintf("runner %s: assigned %d, owned %d", r.ID, r.Assigned, r.Owned)
				}
			}
		}
		if got := len(d.running("runner")); got != n || attached != n {
			return false, fmt.Sprintf("%d runner containers running, %d attached", got, attached)
		}
		return true, ""
	})
	return at, spread
}

func (d *deployment) scale(t *testing.T) {
	for _, n := range []int{6, 3} {
		start := time.Now()
		d.compose(t, 5*time.Minute, "up", "-d", "--scale", fmt.Sprintf("runner=%d", n))
		took := time.Since(start)
		balanced, spread := d.waitBalanced(t, n, 2*time.Minute)
		d.figure("scale runner=%d: the command took %s; %d runners balanced (%s) %s after it started",
			n, secs(took), n, spread, secs(balanced.Sub(start)))
	}
}

// pool enqueues tasks of a queue the runner service does not serve (the
// answer warns that nothing runs them), starts the compose file's emails
// pool, and checks that the pool runs every one of them while the runner
// service's shards stay where they are; then it removes the pool.
func (d *deployment) pool(t *testing.T) {
	const n = 50
	type task struct {
		Kind  string `json:"kind"`
		Key   string `json:"key"`
		Queue string `json:"queue"`
	}
	ts := make([]task, n)
	for i := range ts {
		ts[i] = task{Kind: "noop", Key: fmt.Sprintf("pool-%02d", i), Queue: "emails"}
	}
	body, _ := json.Marshal(ts)
	var answer struct {
		Enqueued int      `json:"enqueued"`
		Warnings []string `json:"warnings"`
	}
	if err := d.postJSON(d.coordinators[0]+"/api/tasks", body, &answer); err != nil {
		t.Fatal(err)
	}
	if answer.Enqueued != n || len(answer.Warnings) == 0 || !strings.Contains(answer.Warnings[0], `queue "emails"`) {
		t.Fatalf("enqueueing %d emails tasks before the pool exists: %+v, want them enqueued with a warning that no runner serves emails", n, answer)
	}
	before := d.view.revision()
	start := time.Now()
	d.compose(t, 5*time.Minute, "--profile", "pools", "up", "-d", "runner-emails")
	var done int
	until(t, 2*time.Minute, 200*time.Millisecond, "the emails pool runs the emails tasks", func() (bool, string) {
		d.query(t, `SELECT count(*) FILTER (WHERE state = 'completed')::int FROM tasks WHERE queue = 'emails'`, nil, &done)
		return done == n, fmt.Sprintf("%d of %d completed", done, n)
	})
	took := time.Since(start)
	var elsewhere int
	d.query(t, `SELECT count(*)::int FROM tasks WHERE queue = 'emails' AND claimed_by = ANY ($1)`, []any{d.runnerServiceIDs()}, &elsewhere)
	if elsewhere != 0 {
		t.Errorf("%d emails tasks ran on the runner service, which does not serve emails", elsewhere)
	}
	moved := d.view.movedSince(before)
	if moved != 0 {
		t.Errorf("the pool's start moved %d shards of the runner service", moved)
	}
	d.compose(t, 2*time.Minute, "--profile", "pools", "rm", "--stop", "--force", "runner-emails")
	balanced, spread := d.waitBalanced(t, 3, time.Minute)
	d.figure("an emails pool (docker-compose --profile pools up -d): %d emails tasks enqueued before it with a warning; all completed on the pool %s after the command started; %d shards of the runner service moved; after its removal the 3 runners balanced (%s) by %s",
		n, secs(took), moved, spread, secs(balanced.Sub(start)))
}

// runnerServiceIDs are the runner ids of the runner service's containers.
func (d *deployment) runnerServiceIDs() []string {
	var ids []string
	for _, c := range d.running("runner") {
		if st, err := d.status(c); err == nil {
			ids = append(ids, st.RunnerID)
		}
	}
	return ids
}

func (d *deployment) stopRunner(t *testing.T) {
	c := d.container(t, "runner", 2)
	st := d.mustStatus(t, c)
	grace := d.docker(t, time.Minute, "inspect", "-f", "{{.Config.StopTimeout}}", c)
	start := time.Now()
	// docker stop waits the container's stop timeout, which compose set
	// from stop_grace_period.
	d.docker(t, 2*time.Minute, "stop", c)
	took := time.Since(start)
	if code := d.docker(t, time.Minute, "inspect", "-f", "{{.State.ExitCode}} {{.State.OOMKilled}}", c); code != "0 false" {
		t.Errorf("the stopped runner exited with %q, want 0 (drained, not killed)", code)
	}
	first, last := d.waitTakenOver(t, st, start, time.Minute)
	balanced, spread := d.waitBalanced(t, 2, time.Minute)
	d.figure("docker stop of 1 of 3 runners (grace %ss): drained and exited 0 in %s; the first of its %d shards owned by another runner %s after the stop began, the last %s; 2 runners balanced (%s) by %s",
		grace, secs(took), len(st.Owned), secs(first.Sub(start)), secs(last.Sub(start)), spread, secs(balanced.Sub(start)))

	start = time.Now()
	d.compose(t, 2*time.Minute, "start", "runner")
	balanced, spread = d.waitBalanced(t, 3, time.Minute)
	d.figure("docker-compose start runner: 3 runners balanced (%s) again %s after the command started", spread, secs(balanced.Sub(start)))
}

// waitTakenOver waits until other runners own every shard the runner with
// status st owned, and returns when the first and the last of them were
// acquired after since.
func (d *deployment) waitTakenOver(t testing.TB, st runnerStatus, since time.Time, timeout time.Duration) (first, last time.Time) {
	t.Helper()
	shards := st.ownedShards()
	until(t, timeout, 20*time.Millisecond, fmt.Sprintf("the %d shards of %s owned by other runners", len(shards), st.RunnerID), func() (bool, string) {
		var n int
		first, last, n = d.view.takeovers(shards, st.RunnerID, since)
		return n == len(shards), fmt.Sprintf("%d of %d taken", n, len(shards))
	})
	return first, last
}

func (d *deployment) disconnectRunner(t *testing.T) {
	c := d.container(t, "runner", 3)
	network := d.network(t, "default")
	st := d.mustStatus(t, c)
	d.cutOff = st.RunnerID
	start := time.Now()
	d.docker(t, time.Minute, "network", "disconnect", network, c)
	var detached runnerStatus
	until(t, 2*leaseTTL, 50*time.Millisecond, "the runner cut off from etcd and PostgreSQL detaches", func() (bool, string) {
		s, err := d.status(c)
		if err != nil {
			return false, err.Error()
		}
		detached = s
		return s.State == "detached" && s.DetachedSince != nil, s.State
	})
	first, last := d.waitTakenOver(t, st, start, 3*leaseTTL)
	detachedAt := *detached.DetachedSince
	if !detachedAt.Before(first) {
		t.Errorf("the cut-off runner detached at %s, not before another runner took one of its shards at %s",
			detachedAt.Format(time.RFC3339Nano), first.Format(time.RFC3339Nano))
	}
	d.figure("docker network disconnect of a runner: it detached %s after the cut (%q); the first of its %d shards was taken by another runner %s after the cut, %s after it had detached; the last %s after the cut",
		secs(detachedAt.Sub(start)), detached.DetachReason, len(st.Owned), secs(first.Sub(start)), secs(first.Sub(detachedAt)), secs(last.Sub(start)))

	start = time.Now()
	d.docker(t, time.Minute, "network", "connect", "--alias", "runner", network, c)
	attached := until(t, 3*leaseTTL, 50*time.Millisecond, "the reconnected runner re-attaches", func() (bool, string) {
		s, err := d.status(c)
		if err != nil {
			return false, err.Error()
		}
		return s.State == "attached", s.State + " " + s.DetachReason
	})
	balanced, spread := d.waitBalanced(t, 3, time.Minute)
	d.figure("reconnected: attached again %s after docker network connect; 3 runners balanced (%s) by %s",
		secs(attached.Sub(start)), spread, secs(balanced.Sub(start)))
}

// etcdLeader finds the leader among the members through their published
// ports, by name (the compose service's).
func (d *deployment) etcdLeader(t testing.TB) (name string, id uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	members, err := d.etcd.MemberList(ctx)
	if err != nil {
		t.Fatalf("listing etcd members: %v", err)
	}
	for _, ep := range d.etcdEndpoints(t) {
		st, err := d.etcd.Status(ctx, ep)
		if err != nil {
			continue
		}
		for _, m := range members.Members {
			if m.ID == st.Leader {
				return m.Name, m.ID
			}
		}
	}
	t.Fatal("no etcd member names a leader")
	return "", 0
}

func (d *deployment) stopEtcdLeader(t *testing.T) {
	name, id := d.etcdLeader(t)
	c := d.container(t, name, 1)
	failuresBefore := d.keepaliveFailures()
	start := time.Now()
	d.docker(t, 2*time.Minute, "stop", c)
	took := time.Since(start)
	remaining := d.etcdEndpoints(t)
	newLeader := until(t, 30*time.Second, 50*time.Millisecond, "a new etcd leader", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		for _, ep := range remaining {
			if st, err := d.etcd.Status(ctx, ep); err == nil && st.Leader != 0 && st.Leader != id {
				return true, ""
			}
		}
		return false, "no member names a new leader"
	})
	// Every runner keeps its lease through the remaining members: each has
	// had a keep-alive sent after the stop answered (its lease deadline
	// lies more than a TTL after the stop).
	until(t, 3*leaseTTL, 200*time.Millisecond, "every runner renewed its lease after the etcd leader stopped", func() (bool, string) {
		for _, c := range d.running("runner") {
			s, err := d.status(c)
			if err != nil {
				return false, err.Error()
			}
			deadline := time.Now().Add(time.Duration(s.LeaseTimeLeft * float64(time.Second)))
			if s.State != "attached" || !deadline.After(start.Add(leaseTTL)) {
				return false, fmt.Sprintf("%s: %s, lease deadline %s after the stop", c, s.State, secs(deadline.Sub(start)))
			}
		}
		return true, ""
	})
	renewed := time.Now()
	failures := d.keepaliveFailures() - failuresBefore
	detaches := d.view.detachesBetween(start, renewed)
	pause, completions := d.longestPause(t, start, renewed)
	d.figure("docker stop of the etcd leader (%s) under load: the command took %s; a new leader %s after it began; runners detached: %d, keep-alives failed: %.0f; %d tasks completed in the %s until every lease was renewed, the longest pause between two completions %s",
		name, secs(took), secs(newLeader.Sub(start)), detaches, failures, completions, secs(renewed.Sub(start)), secs(pause))

	start = time.Now()
	d.docker(t, time.Minute, "start", c)
	healthy := until(t, time.Minute, 200*time.Millisecond, "the restarted etcd member healthy", func() (bool, string) {
		h, _ := d.dockerOut("inspect", "-f", "{{.State.Health.Status}}", c)
		return h == "healthy", h
	})
	d.etcd.SetEndpoints(d.etcdEndpoints(t)...)
	d.figure("docker start of that member: healthy (in the quorum again) %s after", secs(healthy.Sub(start)))
}

// longestPause is the longest time between two task completions in
// [from, to], and how many there were.
func (d *deployment) longestPause(t testing.TB, from, to time.Time) (time.Duration, int) {
	t.Helper()
	var gap float64
	var n int
	d.query(t, `SELECT coalesce(extract(epoch FROM max(gap)), 0)::float8, count(*)::int FROM (
		SELECT finished_at - lag(finished_at, 1, $1::timestamptz) OVER (ORDER BY finished_at) AS gap
		FROM tasks WHERE finished_at BETWEEN $1 AND $2) g`, []any{from, to}, &gap, &n)
	return time.Duration(gap * float64(time.Second)), n
}

func (d *deployment) restartPostgres(t *testing.T) {
	c := d.container(t, "postgres", 1)
	start := time.Now()
	d.docker(t, 2*time.Minute, "restart", c)
	took := time.Since(start)
	ready := until(t, time.Minute, 100*time.Millisecond, "PostgreSQL accepting connections again", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		conn, err := d.pg(ctx)
		if err != nil {
			return false, err.Error()
		}
		defer conn.Close(ctx)
		return conn.Ping(ctx) == nil, "ping failed"
	})
	var first time.Time
	until(t, time.Minute, 100*time.Millisecond, "a task completed after PostgreSQL came back", func() (bool, string) {
		var at *time.Time
		d.query(t, `SELECT min(finished_at) FROM tasks WHERE finished_at > $1 AND state = 'completed'`, []any{ready}, &at)
		if at != nil {
			first = *at
		}
		return at != nil, "none yet"
	})
	for _, c := range d.running("runner") {
		if s := d.mustStatus(t, c); s.State != "attached" {
			t.Errorf("runner %s is %s after the PostgreSQL restart", s.RunnerID, s.State)
		}
	}
	d.figure("docker restart of PostgreSQL under load: the command took %s; accepting connections %s after it began; the first task completed %s after that; runners detached: %d",
		secs(took), secs(ready.Sub(start)), secs(first.Sub(ready)), d.view.detachesBetween(start, time.Now()))
}

// --- the load, and what became of every task ------------------------------------

// load enqueues a batch of tasks every loadInterval through the two
// coordinators' APIs in turn, recording which batches the API confirmed
// and which it answered with an error (they may or may not be stored).
type load struct {
	stopOnce  sync.Once
	stopc     chan struct{}
	done      chan struct{}
	mu        sync.Mutex
	confirmed map[int]bool // batch -> confirmed (true) or unanswered (false)
	lastErr   string
	started   time.Time
	stopped   time.Time
}

func (l *load) stop() {
	l.stopOnce.Do(func() {
		close(l.stopc)
		<-l.done
		l.stopped = time.Now()
	})
}

// batch is the body of batch b: 60% sleep (50–299ms), 20% noop, 10% fail
// once (then succeed), keyed dt-<batch>-<i>.
func batch(b int) []byte {
	type task struct {
		Kind        string          `json:"kind"`
		Key         string          `json:"key"`
		Payload     json.RawMessage `json:"payload,omitempty"`
		MaxAttempts int             `json:"max_attempts,omitempty"`
	}
	ts := make([]task, batchSize)
	for i := range ts {
		ts[i] = task{Kind: "sleep", Key: fmt.Sprintf("dt-%06d-%02d", b, i),
			Payload: json.RawMessage(fmt.Sprintf(`{"ms": %d}`, 50+(b*7+i*37)%250))}
		switch i % 10 {
		case 0:
			ts[i].Kind, ts[i].Payload, ts[i].MaxAttempts = "fail", json.RawMessage(`{"times": 1}`), 3
		case 1, 2:
			ts[i].Kind, ts[i].Payload = "noop", nil
		}
	}
	body, _ := json.Marshal(ts)
	return body
}

func (d *deployment) startLoad(t *testing.T) {
	l := &load{stopc: make(chan struct{}), done: make(chan struct{}), confirmed: map[int]bool{}, started: time.Now()}
	d.load = l
	go func() {
		defer close(l.done)
		tick := time.NewTicker(loadInterval)
		defer tick.Stop()
		for b := 0; ; b++ {
			select {
			case <-l.stopc:
				return
			case <-tick.C:
			}
			ok, err := d.enqueue(d.coordinators[b%2], batch(b))
			l.mu.Lock()
			l.confirmed[b] = ok
			if err != nil {
				l.lastErr = err.Error()
			}
			l.mu.Unlock()
		}
	}()
	var completed int64
	until(t, time.Minute, 500*time.Millisecond, "tasks completing under the load", func() (bool, string) {
		cl, err := d.cluster()
		if err != nil {
			return false, err.Error()
		}
		completed = cl.Tasks["completed"]
		return completed >= 1000, fmt.Sprintf("%d completed", completed)
	})
	d.figure("load: %d tasks every %s through both coordinators (60%% sleep 50–299ms, 20%% noop, 10%% fail once); %d completed %s after it started",
		batchSize, loadInterval, completed, secs(time.Since(l.started)))
}

// enqueue posts one batch and says whether the API confirmed it.
func (d *deployment) enqueue(base string, body []byte) (bool, error) {
	var r struct {
		Enqueued int `json:"enqueued"`
	}
	if err := d.postJSON(base+"/api/tasks", body, &r); err != nil {
		return false, fmt.Errorf("enqueueing a batch: %w", err)
	}
	if r.Enqueued != batchSize {
		return false, fmt.Errorf("enqueueing a batch: %d enqueued, want %d", r.Enqueued, batchSize)
	}
	return true, nil
}

// errorEntry is one element of a task's errors: one per attempt that
// ended without success, written by the statement that ended it.
type errorEntry struct {
	Attempt int    `json:"attempt"`
	Runner  string `json:"runner"`
	Error   string `json:"error"`
}

func (d *deployment) checkTasks(t *testing.T) {
	d.load.stop()
	l := d.load
	// The load has stopped: its fields are no longer written.
	confirmed, lastErr := maps.Clone(l.confirmed), l.lastErr
	if len(lastErr) > 160 {
		lastErr = lastErr[:160] + "…"
	}
	drained := until(t, 3*time.Minute, time.Second, "every task finished", func() (bool, string) {
		open := d.count(t, `SELECT count(*)::int FROM tasks WHERE key LIKE 'dt-%' AND state IN ('ready', 'running')`)
		return open == 0, fmt.Sprintf("%d ready or running", open)
	})

	// etcd's history of the owner keys, complete up to now.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	now, err := d.etcd.Get(ctx, d.prefix+"meta/")
	if err != nil {
		t.Fatalf("reading etcd's revision: %v", err)
	}
	until(t, 30*time.Second, 20*time.Millisecond, "the etcd watch caught up", func() (bool, string) {
		rev := d.view.revision()
		return rev >= now.Header.Revision || d.view.quietSince(time.Second), fmt.Sprintf("at revision %d of %d", rev, now.Header.Revision)
	})
	owners, acquisitions, problems := d.view.history()
	for _, p := range problems {
		t.Error(p)
	}

	perBatch := map[int]int{}
	seen := map[string]bool{}
	var total, completed, retried, orphaned, orphanedCutOff, failedOnce int
	var bad []string
	complain := func(format string, args ...any) {
		if len(bad) < 10 {
			bad = append(bad, fmt.Sprintf(format, args...))
		}
	}
	for _, row := range d.storedTasks(t) {
		key, kind, state, claimedBy, errText := row.key, row.kind, row.state, row.claimedBy, row.errText
		attempt, shard, epoch := row.attempt, row.shard, row.epoch
		total++
		if seen[key] {
			complain("task %s stored twice", key)
		}
		seen[key] = true
		var b, i int
		if _, err := fmt.Sscanf(key, "dt-%06d-%02d", &b, &i); err != nil {
			complain("task key %q is not one the load made", key)
			continue
		}
		perBatch[b]++
		var entries []errorEntry
		if err := json.Unmarshal([]byte(errText), &entries); err != nil {
			complain("task %s: errors %s: %v", key, errText, err)
		}
		// Every attempt that ended without success left one entry, in
		// order, and the last attempt succeeded: each attempt's outcome
		// was recorded exactly once.
		for n, e := range entries {
			if e.Attempt != n+1 {
				complain("task %s: error entry %d is for attempt %d: %s", key, n, e.Attempt, errText)
			}
			switch {
			case strings.HasPrefix(e.Error, "orphaned:"):
				orphaned++
				if e.Runner == d.cutOff {
					orphanedCutOff++
				}
			case kind == "fail" && e.Attempt == 1 && strings.HasPrefix(e.Error, "fail: attempt 1 "):
				failedOnce++
			default:
				complain("task %s (%s): attempt %d failed: %s", key, kind, e.Attempt, e.Error)
			}
		}
		if len(entries) > 0 {
			retried++
		}
		if state != "completed" || attempt != len(entries)+1 {
			complain("task %s (%s) ended %s at attempt %d with %d error entries: %s", key, kind, state, attempt, len(entries), errText)
			continue
		}
		if kind == "fail" && attempt < 2 {
			complain("task %s failed no attempt but is meant to fail its first", key)
		}
		completed++
		// The outcome was written under the epoch of the runner that held
		// the shard's key then, as etcd's history shows.
		if got := owners[fmt.Sprintf("%d/%d", shard, epoch)]; got != claimedBy {
			complain("task %s completed by %q at epoch %d of shard %d, but etcd shows %q holding that epoch", key, claimedBy, epoch, shard, got)
		}
	}
	var sent, lost, unanswered, stored int
	for b, ok := range confirmed {
		sent += batchSize
		switch n := perBatch[b]; {
		case ok && n != batchSize:
			lost += batchSize - n
			complain("batch %d: confirmed by the API, %d of %d tasks stored", b, n, batchSize)
		case !ok && n != 0 && n != batchSize && d.databases == 1:
			// With several databases a batch is one transaction per
			// database: a batch refused by one may be stored in the others.
			complain("batch %d: answered with an error and partly stored (%d of %d)", b, n, batchSize)
		case !ok:
			unanswered++
			stored += n
		}
	}
	for b := range perBatch {
		if _, ok := confirmed[b]; !ok {
			complain("batch %d stored but never sent", b)
		}
	}
	for _, p := range bad {
		t.Error(p)
	}
	d.figure("tasks: %d sent in %d batches over %s; %d batches answered with an error (%s), of which %d tasks were stored all the same; %d tasks stored, every one completed exactly once (%d after a failed or orphaned attempt: %d failed once by design, %d orphaned by a runner that lost its shard, %d of them by the one cut off the network); the last finished %s after the load stopped",
		sent, len(confirmed), secs(l.stopped.Sub(l.started)), unanswered, lastErr, stored, total, retried, failedOnce, orphaned, orphanedCutOff, secs(drained.Sub(l.stopped)))
	d.figure("etcd history: %d shard acquisitions, each key created only while free; every completed task was written under its shard's epoch by the runner etcd shows holding it", acquisitions)
	if lost > 0 || completed != total {
		t.Errorf("%d tasks lost, %d of %d completed", lost, completed, total)
	}
}

// storedTask is one row of a task the load enqueued.
type storedTask struct {
	key, kind, state, claimedBy, errText string
	attempt, shard                       int
	epoch                                int64
}

// storedTasks reads every task the load enqueued, from every database.
func (d *deployment) storedTasks(t *testing.T) []storedTask {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out []storedTask
	for _, c := range d.pgContainers {
		conn, err := d.pgOf(ctx, c)
		if err != nil {
			t.Fatalf("connecting to PostgreSQL: %v", err)
		}
		rows, err := conn.Query(ctx, `SELECT key, kind, state, attempt, shard, coalesce(claimed_by, ''), coalesce(claim_epoch, 0), errors::text
			FROM tasks WHERE key LIKE 'dt-%'`)
		if err != nil {
			t.Fatalf("reading the tasks of %s: %v", c, err)
		}
		for rows.Next() {
			var r storedTask
			if err := rows.Scan(&r.key, &r.kind, &r.state, &r.attempt, &r.shard, &r.claimedBy, &r.epoch, &r.errText); err != nil {
				t.Fatalf("reading the tasks of %s: %v", c, err)
			}
			out = append(out, r)
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("reading the tasks of %s: %v", c, err)
		}
		conn.Close(ctx)
	}
	return out
}

func (d *deployment) downAndCheck(t *testing.T) {
	// The watch would only see errors from here on.
	d.stopView()
	start := time.Now()
	d.compose(t, 5*time.Minute, "down", "-v", "--remove-orphans")
	took := time.Since(start)
	d.down = true
	for _, kind := range []string{"container", "network", "volume"} {
		args := []string{kind, "ls", "-q", "--filter", d.projectFilter()}
		if kind == "container" {
			args = []string{"ps", "-a", "-q", "--filter", d.projectFilter()}
		}
		if out := d.docker(t, time.Minute, args...); out != "" {
			t.Errorf("docker-compose down -v left %ss behind: %s", kind, out)
		}
		// Compose names them after the project: look by name too.
		if kind != "container" {
			if out := d.docker(t, time.Minute, kind, "ls", "-q", "--filter", "name="+d.project); out != "" {
				t.Errorf("docker-compose down -v left %ss named after the project behind: %s", kind, out)
			}
		}
	}
	d.figure("down -v: %s; no container, network or volume of the project left", secs(took))
}

// --- the etcd view ---------------------------------------------------------------

// etcdView follows the cluster's runners/ and owners/ keys with a watch
// from revision 1 through the published etcd ports: the current owners and
// runner states, and every change of hands (shard.History) with the time
// it arrived. The owners, the balance and the takeovers are those of the
// runner service's capability group (the first to acquire a shard); the
// pool step's runners form a group of their own, counted in other.
type etcdView struct {
	prefix       string
	units        *shard.History
	group        string         // the runner service's capability group
	other        map[string]int // shards each runner of another group holds
	mu           sync.Mutex
	rev          int64
	lastAt       time.Time
	owners       map[int]string
	runners      map[string]string // runner id -> state
	shardEvents  []shardEvent
	runnerEvents []runnerEvent
	watchErrors  []string
}

type shardEvent struct {
	group   string
	shard   int
	put     bool
	owner   string // the value written, or the one deleted
	rev     int64
	created int64
	at      time.Time
}

type runnerEvent struct {
	id    string
	state string // "gone" when the key was deleted
	at    time.Time
}

// run watches until ctx ends, resuming after errors (a stopped member, a
// lost leader) from the last revision it applied.
func (v *etcdView) run(ctx context.Context, cli *clientv3.Client) {
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for resp := range cli.Watch(wctx, v.prefix, clientv3.WithPrefix(), clientv3.WithRev(v.revision()+1), clientv3.WithPrevKV()) {
			if err := resp.Err(); err != nil {
				v.mu.Lock()
				v.watchErrors = append(v.watchErrors, err.Error())
				v.mu.Unlock()
				break
			}
			v.apply(resp.Events, time.Now())
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond): // before watching again
		}
	}
}

func (v *etcdView) apply(events []*clientv3.Event, at time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, ev := range events {
		rel := strings.TrimPrefix(string(ev.Kv.Key), v.prefix)
		put := ev.Type == clientv3.EventTypePut
		if units := v.units.Apply(ev); len(units) > 0 {
			for _, u := range units {
				if v.group == "" {
					v.group = u.Group
				}
				e := shardEvent{group: u.Group, shard: u.Shard, put: u.Acquired, owner: u.Runner, rev: u.Rev, created: u.Epoch, at: at}
				v.shardEvents = append(v.shardEvents, e)
				if u.Group != v.group {
					if u.Acquired {
						v.other[u.Runner]++
					} else if v.other[u.Runner]--; v.other[u.Runner] == 0 {
						delete(v.other, u.Runner)
					}
					continue
				}
				if u.Acquired {
					v.owners[u.Shard] = u.Runner
				} else if v.owners[u.Shard] == u.Runner {
					delete(v.owners, u.Shard)
				}
			}
		} else if id, ok := strings.CutPrefix(rel, "runners/"); ok {
			state := "gone"
			if put {
				var info struct {
					State string `json:"state"`
				}
				_ = json.Unmarshal(ev.Kv.Value, &info)
				state = info.State
			}
			if v.runners[id] != state {
				v.runnerEvents = append(v.runnerEvents, runnerEvent{id: id, state: state, at: at})
			}
			if put {
				v.runners[id] = state
			} else {
				delete(v.runners, id)
			}
		}
		v.rev = ev.Kv.ModRevision
		v.lastAt = at
	}
}

// movedSince counts the runner service's shard acquisitions after
// revision rev.
func (v *etcdView) movedSince(rev int64) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	n := 0
	for _, e := range v.shardEvents {
		if e.group == v.group && e.put && e.rev > rev {
			n++
		}
	}
	return n
}

func (v *etcdView) revision() int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.rev
}

// quietSince says whether no event arrived for d (the watch is current
// when nothing changes).
func (v *etcdView) quietSince(d time.Duration) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return time.Since(v.lastAt) > d
}

// balanced says whether exactly n runners are attached and own every shard
// in equal shares, why not, and when the last event that led here arrived.
func (v *etcdView) balanced(n, shards int) (bool, string, time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	attached := map[string]int{}
	for id, st := range v.runners {
		if _, pool := v.other[id]; st == "attached" && !pool {
			attached[id] = 0
		}
	}
	if len(attached) != n {
		return false, fmt.Sprintf("%d runners attached", len(attached)), v.lastAt
	}
	for s := 0; s < shards; s++ {
		o, ok := v.owners[s]
		if !ok {
			return false, fmt.Sprintf("shard %d has no owner", s), v.lastAt
		}
		if _, ok := attached[o]; !ok {
			return false, fmt.Sprintf("shard %d is owned by %s, which is not attached", s, o), v.lastAt
		}
		attached[o]++
	}
	lo, hi := shards/n, (shards+n-1)/n
	var counts []int
	for id, c := range attached {
		if c < lo || c > hi {
			return false, fmt.Sprintf("%s owns %d shards, not %d–%d", id, c, lo, hi), v.lastAt
		}
		counts = append(counts, c)
	}
	sort.Ints(counts)
	if counts[0] == counts[len(counts)-1] {
		return true, fmt.Sprintf("%d shards each", counts[0]), v.lastAt
	}
	return true, fmt.Sprintf("%d–%d shards each", counts[0], counts[len(counts)-1]), v.lastAt
}

// takeovers reports, for the given shards, when after since another runner
// than from first and last acquired one, and how many were acquired.
func (v *etcdView) takeovers(shards []int, from string, since time.Time) (first, last time.Time, n int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	want := map[int]bool{}
	for _, s := range shards {
		want[s] = true
	}
	for _, e := range v.shardEvents {
		if e.group != v.group || !e.put || !want[e.shard] || e.owner == from || !e.at.After(since) {
			continue
		}
		delete(want, e.shard)
		n++
		if first.IsZero() {
			first = e.at
		}
		last = e.at
	}
	return first, last, n
}

// detachesBetween counts runners that published a state other than
// attached in [from, to].
func (v *etcdView) detachesBetween(from, to time.Time) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	ids := map[string]bool{}
	for _, e := range v.runnerEvents {
		if e.at.After(from) && e.at.Before(to) && e.state == "detached" {
			ids[e.id] = true
		}
	}
	return len(ids)
}

// history checks that no unit (a group's shard) was acquired while
// another runner held it, and returns the runner holding each shard/epoch
// (an epoch is a revision: one unit's) and the number of acquisitions.
func (v *etcdView) history() (owners map[string]string, acquisitions int, problems []string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	problems = append(problems, v.watchErrorsLocked()...)
	events := slices.Clone(v.shardEvents)
	sort.SliceStable(events, func(i, j int) bool { return events[i].rev < events[j].rev })
	owners = map[string]string{}
	type unit struct {
		group string
		shard int
	}
	held := map[unit]string{}
	for _, e := range events {
		u := unit{e.group, e.shard}
		if e.put {
			if held[u] != "" {
				problems = append(problems, fmt.Sprintf("shard %d of group %s: %s acquired it at revision %d while %s held it", e.shard, e.group, e.owner, e.rev, held[u]))
			}
			held[u] = e.owner
			owners[fmt.Sprintf("%d/%d", e.shard, e.created)] = e.owner
			acquisitions++
		} else if held[u] == e.owner {
			held[u] = ""
		}
	}
	return owners, acquisitions, problems
}

// watchErrorsLocked reports watch errors other than the expected ones (a
// member stopped or without a leader, after which the watch resumed).
func (v *etcdView) watchErrorsLocked() []string {
	var out []string
	for _, e := range v.watchErrors {
		if strings.Contains(e, "compacted") {
			out = append(out, "the etcd watch lost history: "+e)
		}
	}
	return out
}

// --- small helpers ---------------------------------------------------------------

// until polls cond every interval until it holds, and returns when it
// first did; when timeout passes first it fails the test with what it
// waited for and the last reason. (testutil.Until polls every 5ms, too
// often for conditions read through docker or the cluster's API.)
func until(t testing.TB, timeout, interval time.Duration, what string, cond func() (bool, string)) time.Time {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, why := cond()
		if ok {
			return time.Now()
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s: %s", what, timeout, why)
		}
		time.Sleep(interval)
	}
}

func (d *deployment) figure(format string, args ...any) {
	d.figures = append(d.figures, "FIGURE "+fmt.Sprintf(format, args...))
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2fs", d.Seconds()) }

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
