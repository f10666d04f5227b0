package coordinator

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/runner"
	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/tasks"
)

// chromium finds Debian's chromium. Without it the browser test fails,
// unless SHARDRUN_SKIP_BROWSER=1 opts out knowingly outside CI.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	const why = "chromium not found: install it (apt-get install chromium) to check the status page in a real browser"
	if os.Getenv("SHARDRUN_SKIP_BROWSER") == "1" {
		testutil.MissingTool(t, why+"; SHARDRUN_SKIP_BROWSER=1 opted out")
	}
	t.Fatal(why + ", or set SHARDRUN_SKIP_BROWSER=1 to skip this test knowingly")
	return ""
}

func headless(t *testing.T, browser string, args ...string) string {
	t.Helper()
	base := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
		"--user-data-dir=" + t.TempDir(), "--virtual-time-budget=5000"}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, browser, append(base, args...)...).Output()
	if err != nil {
		t.Fatalf("chromium %v: %v", args, err)
	}
	return string(out)
}

// TestStatusPageInABrowser renders the page in headless Chromium against a
// coordinator and four real runners, one of them detached by hand and one
// stopped, and checks the grid (one cell per shard, every cell coloured by
// an attached owner, filling its card), the detached runner marked, the
// stopped one still listed as gone, the completion rate, the legend and
// the databases with their shards and health.
// The screenshot is kept in artifacts/status-page.png (not in git).
func TestStatusPageInABrowser(t *testing.T) {
	browser := chromium(t)
	e := newEnv(t)
	c := e.start("coord", nil, func(c *Config) { c.ShardCount = 64 })
	var rs []*runner.Runner
	var stops []func()
	for i := range 4 {
		cfg := runner.DefaultConfig()
		cfg.EtcdEndpoints, cfg.EtcdPrefix, cfg.Cluster = e.etcd.Endpoints(), "/shardrun/", "test"
		cfg.ShardCount, cfg.DatabaseURL, cfg.AdminAddr = 64, e.dsn, "127.0.0.1:0"
		cfg.RunnerID, cfg.LeaseTTL, cfg.RecoveryWindow = fmt.Sprintf("runner-%d", i+1), 2*time.Second, 200*time.Millisecond
		cfg.Logger = hclog.NewNullLogger()
		r, err := runner.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		_ = r.HandleBuiltins()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		stop := sync.OnceFunc(func() { cancel(); <-done })
		t.Cleanup(stop)
		<-r.Started()
		rs, stops = append(rs, r), append(stops, stop)
	}
	testutil.WaitFor(t, 15*time.Second, "the coordinator sees runner-4", func() bool {
		v, err := c.Cluster(context.Background())
		return err == nil && len(v.Runners) == 4
	})
	stops[3]() // drains and leaves: listed as gone
	detachRunner(t, rs[2])
	testutil.WaitFor(t, 15*time.Second, "runner-3 detached and the others own all 64 shards", func() bool {
		v, err := c.Cluster(context.Background())
		if err != nil {
			return false
		}
		owners := map[string]int{}
		for _, g := range v.Groups {
			for _, o := range g.Owners {
				owners[o]++
			}
		}
		return owners["runner-1"] == 32 && owners["runner-2"] == 32
	})

	// Tasks that need attention, listed with links to them.
	var dead, failed int64
	if err := e.store.Pool().QueryRow(context.Background(), `
		WITH d AS (INSERT INTO tasks (kind, shard, key, state, finished_at) VALUES ('ghost', 1, 'x', 'dead', now()) RETURNING id),
		     f AS (INSERT INTO tasks (kind, shard, key, state, finished_at) VALUES ('ghost', 2, 'y', 'failed', now()) RETURNING id)
		SELECT (SELECT id FROM d), (SELECT id FROM f)`).Scan(&dead, &failed); err != nil {
		t.Fatal(err)
	}
	// A schedule with its next run, and ready tasks of a kind nobody handles.
	if _, err := c.Schedules().Create(context.Background(), schedule.Definition{Name: "nightly-report", Task: tasks.NewTask{Kind: "noop"}, Cron: "0 3 * * *", Timezone: "Europe/Berlin"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.Pool().Exec(context.Background(), `INSERT INTO tasks (kind, shard, key)
		SELECT 'mystery', g % 64, g::text FROM generate_series(1, 7) g`); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the dead and failed tasks listed for attention, and the mystery kind unhandled", func() bool {
		v, err := c.Cluster(context.Background())
		return err == nil && len(v.Attention.Dead) == 1 && len(v.Attention.Failed) == 1 && len(v.Unrunnable) == 1
	})

	url := "http://" + c.Addr() + "/"
	dom := headless(t, browser, "--dump-dom", url)
	if !strings.Contains(dom, `data-rendered="true"`) {
		t.Fatalf("the page did not render from /api/cluster:\n%.2000s", dom)
	}
	cells := regexp.MustCompile(`<div class="shard[^"]*" data-shard="\d+" data-owner="([^"]*)"`).FindAllStringSubmatch(dom, -1)
	if len(cells) != 64 {
		t.Fatalf("%d shard cells in the grid, want 64", len(cells))
	}
	owners := map[string]int{}
	for _, m := range cells {
		owners[m[1]]++
	}
	if owners["runner-1"] != 32 || owners["runner-2"] != 32 {
		t.Fatalf("grid owners %v, want 32 each for runner-1 and runner-2", owners)
	}
	for _, want := range []string{
		`data-runner="runner-3"`, `<span class="badge detached">detached</span>`,
		`<span class="badge attached">attached</span>`, `data-state="completed"`, "leader coord",
		`<tr class="gone" data-runner="runner-4" data-health="left">`, `id="rate" data-completed-per-second=`,
		"tasks/s completed", "minmax(0px, 1fr)", `data-state="cancelled"`,
		fmt.Sprintf(`<tr data-task="%d"><td><a href="#task/%d">#%d</a></td><td>ghost</td>`, dead, dead, dead),
		fmt.Sprintf(`<a href="#task/%d">#%d</a>`, failed, failed),
		`<tr data-schedule="nightly-report" data-next-run="`, "0 3 * * * (Europe/Berlin)",
		`<tr data-queue="default" data-kind="mystery" data-ready="7">`,
		"no attached runner serves queue default with a handler of kind mystery",
		`<tr data-database="main" data-health="ok"><td>main</td><td>0-63</td>`,
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("rendered page lacks %s", want)
		}
	}

	dir, err := filepath.Abs(filepath.Join("..", "..", "artifacts"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	png := filepath.Join(dir, "status-page.png")
	headless(t, browser, "--screenshot="+png, "--window-size=1280,820", url)
	info, err := os.Stat(png)
	if err != nil || info.Size() < 10_000 {
		t.Fatalf("screenshot %s: %v (size %d)", png, err, sizeOf(info))
	}
	t.Logf("status page screenshot: %s (%d bytes)", png, info.Size())
}

func detachRunner(t *testing.T, r *runner.Runner) {
	t.Helper()
	code, body := testutil.HTTP(t, "POST", "http://"+r.AdminAddr()+"/admin/detach", "", `{"reason": "browser test"}`)
	if code != 200 {
		t.Fatalf("detach: %d %s", code, body)
	}
}

func sizeOf(info os.FileInfo) int64 {
	if info == nil {
		return 0
	}
	return info.Size()
}
