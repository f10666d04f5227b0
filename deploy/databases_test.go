//go:build deploy

package deploy

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestDeployOnTwoDatabases runs docker-compose.yml with its databases
// profile: the cluster's shards split over two PostgreSQL servers
// (SHARDRUN_DATABASES names the second to every process). Under the load
// it moves one shard from the second to the first (POST
// /api/shards/{n}/move), restarts the second server and checks that the first's tasks kept
// completing meanwhile and the second's resumed; then that every task
// enqueued reached its end exactly once, across both databases.
func TestDeployOnTwoDatabases(t *testing.T) {
	requireDocker(t)
	started := time.Now()
	d := newDeployment(t, 2)
	steps := []struct {
		name string
		run  func(*testing.T)
	}{
		{"up", d.up},
		{"databases", d.checkDatabases},
		{"load", d.startLoad},
		{"move_shard", d.moveShard},
		{"restart_second_database", d.restartSecondDatabase},
		{"tasks_exactly_once", d.checkTasks},
		{"down", d.downAndCheck},
	}
	for _, s := range steps {
		if !t.Run(s.name, s.run) {
			t.FailNow()
		}
	}
	d.figure("the deploy test on two databases took %s in all", secs(time.Since(started)))
	t.Log("figures:\n" + strings.Join(d.figures, "\n"))
}

// databasesView is the part of GET /api/databases the test reads.
type databasesView struct {
	Databases []struct {
		Name   string `json:"name"`
		Shards string `json:"shards"`
		Health string `json:"health"`
	} `json:"databases"`
	Moves []struct {
		Shard int    `json:"shard"`
		Phase string `json:"phase"`
	} `json:"moves"`
}

// moveShard moves the last shard, the second database's, to main under
// the load: the move ends, the map places the shard in main, and its
// tasks complete there afterwards (the final check finds every task once,
// across both databases).
func (d *deployment) moveShard(t *testing.T) {
	n := d.shards - 1
	var accepted map[string]any
	start := time.Now()
	if err := d.postFor(fmt.Sprintf("%s/api/shards/%d/move", d.coordinators[0], n), []byte(`{"to": "main"}`), 202, &accepted); err != nil {
		t.Fatal(err)
	}
	half := d.shards / 2
	wantMain := fmt.Sprintf("0-%d,%d", half-1, n)
	var v databasesView
	done := until(t, 2*time.Minute, 100*time.Millisecond, "the move of shard "+fmt.Sprint(n)+" done", func() (bool, string) {
		if err := d.getJSON(d.coordinators[1]+"/api/databases", d.apiToken, &v); err != nil {
			return false, err.Error()
		}
		return len(v.Moves) == 0 && len(v.Databases) == 2 && v.Databases[0].Shards == wantMain, fmt.Sprintf("%+v", v)
	})
	var after int
	until(t, time.Minute, 200*time.Millisecond, "a task of the moved shard completed in main", func() (bool, string) {
		d.queryOn(t, d.pgContainer, `SELECT count(*)::int FROM tasks WHERE shard = $1 AND state = 'completed' AND finished_at > $2`, []any{n, done}, &after)
		return after > 0, "none yet"
	})
	var left int
	d.queryOn(t, d.pgContainers[1], `SELECT count(*)::int FROM tasks WHERE shard = $1`, []any{n}, &left)
	if left != 0 {
		t.Errorf("%d tasks of shard %d left in the second database after its move", left, n)
	}
	d.figure("POST /api/shards/%d/move {\"to\": \"main\"} under load: done %s after the request; main holds %s; the shard's tasks complete in main after it",
		n, secs(done.Sub(start)), wantMain)
}

// checkDatabases reads GET /api/databases: main and second, each holding
// half of the shards, both healthy, and no URL or password shown.
func (d *deployment) checkDatabases(t *testing.T) {
	var v databasesView
	until(t, time.Minute, 500*time.Millisecond, "both databases healthy in GET /api/databases", func() (bool, string) {
		if err := d.getJSON(d.coordinators[0]+"/api/databases", d.apiToken, &v); err != nil {
			return false, err.Error()
		}
		ok := len(v.Databases) == 2
		for _, db := range v.Databases {
			ok = ok && db.Health == "ok"
		}
		return ok, fmt.Sprintf("%+v", v.Databases)
	})
	half := d.shards / 2
	want := []string{fmt.Sprintf("main 0-%d", half-1), fmt.Sprintf("second %d-%d", half, d.shards-1)}
	for i, db := range v.Databases {
		if got := db.Name + " " + db.Shards; got != want[i] {
			t.Errorf("database %d is %q, want %q", i, got, want[i])
		}
	}
	var raw map[string]any
	if err := d.getJSON(d.coordinators[1]+"/api/databases", d.apiToken, &raw); err != nil {
		t.Fatal(err)
	}
	if s := fmt.Sprint(raw); strings.Contains(s, "postgres://") || strings.Contains(s, d.pgPassword) {
		t.Errorf("GET /api/databases shows a URL or the password: %s", s)
	}
	d.figure("two databases: %s and %s, both healthy", want[0], want[1])
}

// restartSecondDatabase restarts the second PostgreSQL under the load:
// the first database's tasks go on completing while it is down, and the
// second's complete again once it is back.
func (d *deployment) restartSecondDatabase(t *testing.T) {
	second := d.pgContainers[1]
	start := time.Now()
	d.docker(t, 2*time.Minute, "restart", second)
	took := time.Since(start)
	ready := until(t, time.Minute, 100*time.Millisecond, "the second PostgreSQL accepting connections again", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		conn, err := d.pgOf(ctx, second)
		if err != nil {
			return false, err.Error()
		}
		defer conn.Close(ctx)
		return conn.Ping(ctx) == nil, "ping failed"
	})
	var during int
	d.queryOn(t, d.pgContainer, `SELECT count(*)::int FROM tasks WHERE state = 'completed' AND finished_at BETWEEN $1 AND $2`,
		[]any{start, ready}, &during)
	if during == 0 {
		t.Errorf("no task of the first database completed while the second restarted (%s)", secs(ready.Sub(start)))
	}
	var first time.Time
	until(t, time.Minute, 100*time.Millisecond, "a task of the second database completed after it came back", func() (bool, string) {
		var at *time.Time
		d.queryOn(t, second, `SELECT min(finished_at) FROM tasks WHERE finished_at > $1 AND state = 'completed'`, []any{ready}, &at)
		if at != nil {
			first = *at
		}
		return at != nil, "none yet"
	})
	d.figure("docker restart of the second PostgreSQL under load: the command took %s; %d tasks of the first database completed in the %s until the second accepted connections; the second's first task completed %s after that",
		secs(took), during, secs(ready.Sub(start)), secs(first.Sub(ready)))
}
