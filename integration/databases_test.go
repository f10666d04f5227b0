package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shardrun/shardrun"
	"github.com/shardrun/shardrun/internal/coordinator"
	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// The scenarios here run a cluster on two databases (issue 40): the
// shards split between them, every statement routed by its task's
// shard, the reads merged, and one database's outage pausing only its
// own shards.

// databases reads GET /api/databases.
func (c *cluster) databases(coord *proc) (coordinator.DatabasesView, string) {
	c.t.Helper()
	code, body := testutil.HTTP(c.t, "GET", "http://"+coord.addr+"/api/databases", "", "")
	var v coordinator.DatabasesView
	if code != 200 || json.Unmarshal([]byte(body), &v) != nil {
		c.t.Fatalf("GET /api/databases: %d %s", code, body)
	}
	return v, body
}

// healthOf is the health GET /api/databases gives database name.
func (c *cluster) healthOf(coord *proc, name string) string {
	v, _ := c.databases(coord)
	for _, d := range v.Databases {
		if d.Name == name {
			return d.Health
		}
	}
	return ""
}

// keysIn returns n task keys whose shards the map places in db (main
// holds the first half of the shards, second the rest).
func keysIn(db string, n int) []string {
	m := store.NewMap([]string{"main", "second"}, shards)
	var out []string
	for i := 0; len(out) < n; i++ {
		k := fmt.Sprintf("%s-%d-%d", db, time.Now().UnixNano(), i)
		if m.Shards[tasks.ShardOf(k, shards)] == db {
			out = append(out, k)
		}
	}
	return out
}

// enqueueKeys posts a noop task for each key and remembers each must
// complete.
func (c *cluster) enqueueKeys(coord *proc, keys []string) {
	c.t.Helper()
	batch := make([]map[string]any, len(keys))
	for i, k := range keys {
		batch[i] = map[string]any{"kind": "noop", "key": k}
	}
	c.enqueueBatch(coord, batch, tasks.Completed)
}

// completedIn counts the completed tasks with the given keys in db.
func (c *cluster) completedIn(db string, keys []string) int {
	c.t.Helper()
	var n int
	if err := c.db(db).store.Pool().QueryRow(context.Background(),
		`SELECT count(*) FROM task_view WHERE key = ANY ($1) AND state = 'completed'`, keys).Scan(&n); err != nil {
		return -1
	}
	return n
}

// listAll pages through GET /api/tasks with query and limit, and returns
// the ids in the order served and the pages taken.
func (c *cluster) listAll(coord *proc, query string, limit int) ([]int64, int) {
	c.t.Helper()
	var ids []int64
	after, pages := "", 0
	for {
		url := fmt.Sprintf("http://%s/api/tasks?%s&limit=%d%s", coord.addr, query, limit, after)
		code, body := testutil.HTTP(c.t, "GET", url, apiToken, "")
		var page tasks.Page
		if code != 200 || json.Unmarshal([]byte(body), &page) != nil {
			c.t.Fatalf("GET %s: %d %s", url, code, body)
		}
		pages++
		for _, task := range page.Tasks {
			ids = append(ids, task.ID)
		}
		if page.Next == 0 {
			return ids, pages
		}
		after = "&after=" + strconv.FormatInt(page.Next, 10)
	}
}

// TestTwoDatabases runs the real binaries on two databases: the map
// splits the shards in two ranges; tasks of both complete, each in its
// shard's database; GET /api/databases names both with their shards,
// health and counts and no URL; the listing pages through both in one id
// order; a producer's transaction on the wrong database is refused
// naming both; and a process given a database the map does not name, or
// missing one it names, exits with one line naming it.
func TestTwoDatabases(t *testing.T) {
	t.Parallel()
	c := newClusterOnDatabases(t, clusterDB{name: "second", dsn: pgtest.NewDatabase(t)})
	coord := c.startCoordinator("coord-1")
	names := []string{"runner-1", "runner-2"}
	for _, n := range names {
		c.startRunner(n, false)
	}
	c.waitFor(20*time.Second, "balanced", func() bool { return c.balanced(names...) })
	c.waitFor(10*time.Second, "both databases healthy", func() bool {
		return c.healthOf(coord, "main") == placement.HealthOK && c.healthOf(coord, "second") == placement.HealthOK
	})
	v, body := c.databases(coord)
	if len(v.Databases) != 2 || v.Revision == 0 ||
		v.Databases[0].Name != "main" || v.Databases[0].Shards != "0-31" || v.Databases[0].ShardCount != 32 ||
		v.Databases[1].Name != "second" || v.Databases[1].Shards != "32-63" || v.Databases[1].Slot != 1 {
		t.Fatalf("GET /api/databases: %s", body)
	}
	if strings.Contains(body, "postgres") || strings.Contains(body, "127.0.0.1") {
		t.Fatalf("GET /api/databases shows a URL or a host: %s", body)
	}

	c.enqueue(coord, 200, "noop", "", 3, tasks.Completed)
	c.enqueue(coord, 20, "fail", `{"times": 1}`, 2, tasks.Completed)
	c.waitDrained(60 * time.Second)
	for _, d := range c.dbs {
		var n int
		var outside bool
		if err := d.store.Pool().QueryRow(context.Background(), `SELECT count(*), coalesce(bool_or(shard NOT BETWEEN $1 AND $2), false) FROM task_view`,
			map[string]int{"main": 0, "second": 32}[d.name], map[string]int{"main": 31, "second": 63}[d.name]).Scan(&n, &outside); err != nil {
			t.Fatal(err)
		}
		if n == 0 || outside {
			t.Errorf("database %s holds %d tasks, some outside its shards: %v", d.name, n, outside)
		}
	}

	// The listing: every filter and page merged from both, in one id
	// order, each task once; the count the same.
	asc, pages := c.listAll(coord, "kind=noop&state=completed", 7)
	desc, _ := c.listAll(coord, "kind=noop&order=desc", 13)
	if len(asc) != 200 || !slices.IsSorted(asc) || len(slices.Compact(slices.Clone(asc))) != 200 {
		t.Errorf("the listing in id order: %d ids over %d pages, sorted %v", len(asc), pages, slices.IsSorted(asc))
	}
	slices.Reverse(desc)
	if !slices.Equal(asc, desc) {
		t.Errorf("the listing in descending order is not the ascending one reversed (%d and %d ids): only ascending %v, only descending %v",
			len(asc), len(desc), onlyIn(asc, desc), onlyIn(desc, asc))
	}
	code, body := testutil.HTTP(t, "GET", "http://"+coord.addr+"/api/tasks/count?kind=noop", apiToken, "")
	if code != 200 || !strings.Contains(body, `"count":200`) {
		t.Errorf("GET /api/tasks/count?kind=noop: %d %s, want 200", code, body)
	}
	c.waitFor(10*time.Second, "GET /api/databases counting each database's completed tasks", func() bool {
		v, _ = c.databases(coord)
		main, second := v.Databases[0].Tasks[tasks.Completed], v.Databases[1].Tasks[tasks.Completed]
		return main > 0 && second > 0 && main+second == 220
	})

	c.checkWrongDatabaseRefused()
	c.checkDatabasesNotTheMaps()

	s := c.finish(30 * time.Second)
	c.report("two databases", s, fmt.Sprintf("main %d, second %d completed; listing in %d pages of 7",
		v.Databases[0].Tasks[tasks.Completed], v.Databases[1].Tasks[tasks.Completed], pages))
}

// checkWrongDatabaseRefused: a producer's transaction on the database
// that does not hold the task's shard is refused naming both, and
// nothing is committed; one on the right database commits. Raw SQL into
// the wrong database is refused by the database itself.
func (c *cluster) checkWrongDatabaseRefused() {
	t := c.t
	ctx := context.Background()
	pools := map[string]*pgxpool.Pool{}
	for _, d := range c.dbs {
		pool, err := pgxpool.New(ctx, d.dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		pools[d.name] = pool
	}
	producer, err := shardrun.NewClient(ctx, pools["main"], c.cli, shardrun.Config{Cluster: "it", EtcdPrefix: "/shardrun/",
		ShardCount: shards, Databases: []shardrun.Database{{Name: "second", Pool: pools["second"]}}, Logger: hclog.NewNullLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close()
	key := keysIn("second", 1)[0]
	if got := producer.DatabaseOf(key); got != "second" {
		t.Fatalf("DatabaseOf(%q) = %q, want second", key, got)
	}
	task := tasks.NewTask{Kind: "noop", Options: tasks.Options{Key: key}}
	err = pgx.BeginFunc(ctx, pools["main"], func(tx pgx.Tx) error {
		_, err := producer.EnqueueTaskTx(ctx, tx, task)
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "main") || !strings.Contains(err.Error(), "second") || !errors.Is(err, store.ErrWrongDatabase) {
		t.Fatalf("an enqueue in a transaction on main for a shard of second: %v, want refused naming both", err)
	}
	if n := c.countKey("main", key) + c.countKey("second", key); n != 0 {
		t.Fatalf("the refused enqueue left %d tasks", n)
	}
	var e shardrun.Enqueued
	if err := pgx.BeginFunc(ctx, pools[producer.DatabaseOf(key)], func(tx pgx.Tx) (err error) {
		e, err = producer.EnqueueTaskTx(ctx, tx, task)
		return err
	}); err != nil {
		t.Fatalf("the same enqueue on the task's database: %v", err)
	}
	c.mu.Lock()
	c.enqueued[e.ID] = tasks.Completed
	c.mu.Unlock()
	_, err = pools["main"].Exec(ctx, `INSERT INTO tasks (kind, shard, key) VALUES ('noop', $1, 'raw')`, tasks.ShardOf(key, shards))
	if err == nil || !store.NotHeld(err) {
		t.Fatalf("a raw insert into main for a shard of second: %v, want SQLSTATE %s", err, store.CodeNotHeld)
	}
}

func (c *cluster) countKey(db, key string) int {
	var n int
	_ = c.db(db).store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM task_view WHERE key = $1`, key).Scan(&n)
	return n
}

// checkDatabasesNotTheMaps: a runner given a database the map does not
// name, or missing one it names, exits with status 2 and one line naming
// the database, before it joins.
func (c *cluster) checkDatabasesNotTheMaps() {
	t := c.t
	third := pgtest.NewDatabase(t)
	for _, tc := range []struct {
		dbs  []string
		want string
	}{
		{[]string{"main=" + c.dsn, "second=" + c.db("second").dsn, "third=" + third}, "database third"},
		{[]string{"main=" + c.dsn}, "database second"},
	} {
		args := []string{"--etcd-endpoints", strings.Join(c.endpoints, ","), "--etcd-prefix", "/shardrun/", "--cluster", "it",
			"--shard-count", strconv.Itoa(shards), "--runner-id", "misconfigured", "--admin-addr", "127.0.0.1:0"}
		for _, d := range tc.dbs {
			args = append(args, "--database", d)
		}
		cmd := exec.Command(c.runner, args...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		var exit *exec.ExitError
		var failures []string // the error's line; the others are the log's
		for _, line := range strings.Split(stderr.String(), "\n") {
			if strings.HasPrefix(line, "runner: ") {
				failures = append(failures, line)
			}
		}
		if !errors.As(err, &exit) || exit.ExitCode() != 2 || len(failures) != 1 || !strings.Contains(failures[0], tc.want) ||
			strings.Contains(stderr.String(), "postgres://") || strings.Contains(stderr.String(), "applied migration") {
			t.Errorf("a runner given %d databases: %v, stderr %q; want exit 2 and one line naming %s, before it migrates anything",
				len(tc.dbs), err, stderr.String(), tc.want)
		}
	}
}

// TestADatabaseDownPausesOnlyItsShards stops the server of one of two
// databases: the other's tasks keep completing (their rate measured
// before and during the outage), a producer of a key whose shard lives
// on the stopped one gets an error naming it, and once it is back its
// tasks complete too.
func TestADatabaseDownPausesOnlyItsShards(t *testing.T) {
	t.Parallel()
	srv := pgtest.NewServer(t)
	c := newClusterOnDatabases(t, clusterDB{name: "second", dsn: pgtest.NewDatabaseOn(t, srv)})
	coord := c.startCoordinator("coord-1")
	names := []string{"runner-1", "runner-2"}
	for _, n := range names {
		c.startRunner(n, false)
	}
	c.waitFor(20*time.Second, "balanced", func() bool { return c.balanced(names...) })
	const n = 300
	rate := func(what string) float64 {
		keys := keysIn("main", n)
		start := time.Now()
		c.enqueueKeys(coord, keys)
		c.waitFor(60*time.Second, what, func() bool { return c.completedIn("main", keys) == n })
		return float64(n) / time.Since(start).Seconds()
	}
	before := rate("main's tasks completed with both databases up")

	if err := srv.Halt(); err != nil {
		t.Fatal(err)
	}
	halted := time.Now()
	c.waitFor(20*time.Second, "second reported unavailable", func() bool {
		return c.healthOf(coord, "second") == placement.HealthUnavailable
	})
	during := rate("main's tasks completed with second down")
	body, _ := json.Marshal([]map[string]any{{"kind": "noop", "key": keysIn("second", 1)[0]}})
	code, resp := testutil.HTTP(t, "POST", "http://"+coord.addr+"/api/tasks", apiToken, string(body))
	if code != 503 || !strings.Contains(resp, "second") || strings.Contains(resp, "postgres://") {
		t.Errorf("an enqueue for a shard of the stopped database: %d %s, want 503 naming second", code, resp)
	}
	if h := c.healthOf(coord, "main"); h != placement.HealthOK {
		t.Errorf("main is %s while only second is down", h)
	}
	for _, n := range names {
		c.waitFor(10*time.Second, n+" ready, naming second as down", func() bool {
			code, body := testutil.HTTP(t, "GET", "http://"+c.proc(n).addr+"/readyz", "", "")
			return code == 200 && strings.Contains(body, `"databases_down": [`) && strings.Contains(body, "second")
		})
	}

	if err := srv.Resume(context.Background()); err != nil {
		t.Fatal(err)
	}
	down := time.Since(halted)
	c.waitFor(30*time.Second, "second healthy again", func() bool { return c.healthOf(coord, "second") == placement.HealthOK })
	keys := keysIn("second", 50)
	c.enqueueKeys(coord, keys)
	c.waitFor(30*time.Second, "second's tasks completed after its return", func() bool { return c.completedIn("second", keys) == 50 })

	s := c.finish(30 * time.Second)
	c.report("one database down", s, fmt.Sprintf("main's tasks %.0f/s with both up, %.0f/s with second down (%s)",
		before, during, down.Round(100*time.Millisecond)))
	t.Logf("FIGURE main's completion rate with second down: %.0f/s, against %.0f/s with both up (%d tasks each)", during, before, n)
}

// onlyIn lists the ids of a that b lacks.
func onlyIn(a, b []int64) []int64 {
	var out []int64
	for _, id := range a {
		if !slices.Contains(b, id) {
			out = append(out, id)
		}
	}
	return out
}
