package coordinator

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/httpauth"
	"github.com/shardrun/shardrun/internal/httpjson"
	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// The status page: the HTML, the cluster view's script and the tasks
// view's script, served from the binary (no asset comes from the network).
var (
	//go:embed page.html
	page []byte
	//go:embed status.js
	statusJS []byte
	//go:embed tasks.js
	tasksJS []byte
)

// pageCSP is the status page's Content-Security-Policy: scripts only from
// this coordinator's own files (no inline script, no handler attribute, no
// eval), requests only to its own API, nothing framed or submitted away.
// The page renders task data as text; this makes any mistake there inert.
const pageCSP = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; " +
	"base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// servePageFile answers one of the status page's embedded files.
func servePageFile(contentType string, body []byte) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", contentType)
		w.Header().Set("Cache-Control", "no-cache")
		w.Header().Set("Content-Security-Policy", pageCSP)
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Referrer-Policy", "no-referrer")
		_, _ = w.Write(body)
	}
}

// Handler serves the API, the status page, /metrics and /healthz.
func (c *Coordinator) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", servePageFile("text/html; charset=utf-8", page))
	mux.HandleFunc("GET /status.js", servePageFile("text/javascript; charset=utf-8", statusJS))
	mux.HandleFunc("GET /tasks.js", servePageFile("text/javascript; charset=utf-8", tasksJS))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "leader": c.IsLeader()})
	})
	mux.HandleFunc("GET /api/cluster", c.handleCluster)
	mux.HandleFunc("GET /api/databases", c.handleDatabases)
	// With a token, every call that reads task data or changes anything
	// needs it (the cluster view and the status page hold no task data).
	c.taskRoutes(mux)
	auth := func(h http.HandlerFunc) http.HandlerFunc { return httpauth.Require(c.cfg.APIToken, "shardrun-api", h) }
	mux.HandleFunc("POST /api/schedules", auth(c.handleCreateSchedule))
	mux.HandleFunc("GET /api/schedules", auth(c.handleListSchedules))
	mux.HandleFunc("PUT /api/schedules/{name}", auth(c.handlePutSchedule))
	mux.HandleFunc("DELETE /api/schedules/{name}", auth(c.handleDeleteSchedule))
	mux.HandleFunc("POST /api/shards/{n}/move", auth(c.handleMoveShard))
	c.queueRoutes(mux, auth)
	mux.Handle("GET /metrics", promhttp.HandlerFor(c.reg, promhttp.HandlerOpts{}))
	return httpjson.Errors(mux)
}

// RunnerView is one runner in GET /api/cluster.
type RunnerView struct {
	shard.RunnerInfo
	Assigned int `json:"assigned"`
	Owned    int `json:"owned"`
	// Health is ok, unresponsive (its keep-alives stopped arriving; it will
	// lose its shards when its lease runs out), left (drained and gone) or
	// lost (vanished without draining). See the Health constants.
	Health string `json:"health"`
	// LeaseLeft is how long etcd will keep the runner's lease without a
	// keep-alive, in whole seconds as etcd reports it.
	LeaseLeft *float64 `json:"lease_left_seconds,omitempty"`
	// LastSeen is when this coordinator last saw the runner's key.
	LastSeen time.Time `json:"last_seen"`
}

// ClusterView is the JSON of GET /api/cluster.
type ClusterView struct {
	Prefix      string       `json:"prefix"`
	ShardCount  int          `json:"shard_count"`
	Revision    int64        `json:"revision"`
	Leader      string       `json:"leader"`
	Coordinator string       `json:"coordinator"`
	GeneratedAt time.Time    `json:"generated_at"`
	Runners     []RunnerView `json:"runners"`
	// Gone lists runners this coordinator saw that left or were lost in the
	// last ten minutes, most recent first.
	Gone []RunnerView `json:"gone"`
	// Groups are the capability groups: the runners that serve the same
	// queues and handle the same kinds, each with its own shards, owners
	// and epochs (docs/architecture.md, "Mixed fleets").
	Groups []shard.Group         `json:"groups"`
	Tasks  map[tasks.State]int64 `json:"tasks"`
	// TasksEstimated lists the states with at least store.CountCap tasks:
	// their count is from the last full count, which runs about once a
	// minute (counting 10 million rows takes over a second).
	TasksEstimated []tasks.State `json:"tasks_estimated,omitempty"`
	// Attention lists the newest dead and failed tasks and the longest
	// running ones, without their data (GET /api/tasks/{id} has it).
	Attention Attention `json:"attention"`
	// Rates are the tasks finished per second over the last RateWindow, by
	// final state (completed, failed, dead, cancelled).
	Rates map[tasks.State]float64 `json:"rates"`
	// RateWindow is the window of Rates, in seconds.
	RateWindow float64 `json:"rate_window_seconds"`
	// Unrunnable are the ready tasks no attached runner can run — of a
	// queue none serves, or a kind none of those serving the queue
	// handles — by queue and kind; they wait until such a runner attaches
	// (or --unhandled-after fails them).
	Unrunnable []store.ClassCount `json:"unrunnable"`
	// Schedules with their next run, by name (at most MaxSchedulesListed).
	Schedules []ScheduleSummary `json:"schedules"`
	// Queues with their ready and running tasks, pause and completion rate
	// over RateWindow.
	Queues []store.QueueStats `json:"queues"`
	// Databases are the cluster's databases with their shards, health and
	// tasks by state (GET /api/databases has the same), and DatabasesRev
	// the map's revision.
	Databases    []DatabaseView `json:"databases"`
	DatabasesRev int64          `json:"databases_revision"`
}

// rateWindow is the window of ClusterView.Rates: long enough to smooth
// batches, short enough to show a stall within seconds.
const rateWindow = 10 * time.Second

// Cluster reads the view served by GET /api/cluster.
func (c *Coordinator) Cluster(ctx context.Context) (ClusterView, error) {
	cl, err := shard.ReadCluster(ctx, c.cfg.Client, c.cfg.Prefix, c.cfg.ShardCount)
	if err != nil {
		return ClusterView{}, err
	}
	tc, err := c.counter.View(ctx)
	if err != nil {
		return ClusterView{}, err
	}
	// A database that does not answer leaves the view without what only
	// it knows (said in the log), not without the rest.
	rates, err := c.router.FinishedRates(ctx, rateWindow)
	if err != nil {
		c.log.Warn("reading the completion rates failed", "error", err)
		rates = map[tasks.State]float64{}
	}
	unrunnable, err := c.unhandled.Unrunnable(ctx)
	if err != nil {
		c.log.Warn("reading the unrunnable tasks failed", "error", err)
		unrunnable = []store.ClassCount{}
	}
	page, err := c.schedules.List(ctx, schedule.ListRequest{Limit: MaxSchedulesListed})
	if err != nil {
		c.log.Warn("listing the schedules failed", "error", err)
	}
	scheds := page.Schedules
	now := c.clock.Now()
	v := ClusterView{Unrunnable: unrunnable, Schedules: make([]ScheduleSummary, len(scheds)),
		Prefix: c.cfg.Prefix, ShardCount: c.cfg.ShardCount, Revision: cl.Revision,
		Coordinator: c.cfg.ID, GeneratedAt: now.UTC(), Groups: cl.Groups, Tasks: tc.counts,
		TasksEstimated: tc.estimated, Attention: tc.attention, Queues: tc.queues,
		Runners: []RunnerView{}, Rates: rates, RateWindow: rateWindow.Seconds()}
	dv := c.databasesView(tc)
	v.Databases, v.DatabasesRev = dv.Databases, dv.Revision
	if v.Groups == nil {
		v.Groups = []shard.Group{}
	}
	for i, sc := range scheds {
		v.Schedules[i] = summarize(sc)
	}
	owned, assigned := map[string]int{}, map[string]int{}
	for _, g := range cl.Groups {
		for _, o := range g.Owners {
			owned[o]++
		}
		for id, shards := range g.Assigned {
			assigned[id] += len(shards)
		}
	}
	for _, r := range cl.Runners {
		rv := RunnerView{RunnerInfo: r, Assigned: assigned[r.ID], Owned: owned[r.ID], Health: HealthOK, LastSeen: now.UTC()}
		leaseHealth(ctx, c.cfg.Client, &rv, cl.Leases[r.ID])
		v.Runners = append(v.Runners, rv)
	}
	v.Gone = c.roster.Gone(DefaultGoneFor)
	resp, err := c.cfg.Client.Get(ctx, c.cfg.Prefix+"coordinator/leader/", clientv3.WithFirstCreate()...)
	if err == nil && len(resp.Kvs) == 1 {
		v.Leader = string(resp.Kvs[0].Value)
	}
	return v, nil
}

func (c *Coordinator) handleCluster(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	v, err := c.Cluster(ctx)
	if err != nil {
		// etcd or the database; their messages stay in the log.
		if r.Context().Err() == nil {
			c.log.Warn("reading the cluster view failed", "error", err)
		}
		w.Header().Set("Retry-After", retryAfter)
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: "cluster state unavailable; retry later"})
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// apiError is every error answer: the message, and what it is about when
// known — the field of the request (and its index in a batch), the state
// of the task a conflict is about.
type apiError struct {
	Error string      `json:"error"`
	Field string      `json:"field,omitempty"`
	Index *int        `json:"index,omitempty"`
	State tasks.State `json:"state,omitempty"`
	// Database names the database an unavailability is about, in a
	// cluster of several.
	Database string `json:"database,omitempty"`
}

// databaseName finds "database NAME" in a store error's message.
var databaseName = regexp.MustCompile(`\bdatabase ([a-z][a-z0-9_-]*)`)

// databaseIn names the cluster's database err is about ("" when it names
// none or the cluster has one): the router's errors name the database of
// each failed statement, and only its name (the cluster's map's) is
// repeated to the client.
func (c *Coordinator) databaseIn(err error) string {
	names := c.router.Names()
	if len(names) < 2 {
		return ""
	}
	for _, m := range databaseName.FindAllStringSubmatch(err.Error(), -1) {
		if slices.Contains(names, m[1]) {
			return m[1]
		}
	}
	return ""
}

// badRequest answers 400 for a malformed body or an invalid task, naming
// the field and, in a batch, the index.
func badRequest(w http.ResponseWriter, err error, batch bool, index int) {
	e := apiError{Error: err.Error()}
	var je *jsonbody.Error
	var fe *tasks.FieldError
	switch {
	case errors.As(err, &je):
		e.Error = "malformed JSON: " + je.Error()
		e.Field = je.Field()
		if i, ok := je.Index(); ok && batch {
			index = i
		}
	case errors.As(err, &fe):
		e.Field = fe.Field
	}
	if batch && index >= 0 {
		e.Index = &index
		if je == nil {
			e.Error = fmt.Sprintf("task %d: %s", index, e.Error)
		}
	}
	writeJSON(w, http.StatusBadRequest, e)
}

// retryAfter is the Retry-After (seconds) of a 503: about how long a
// database restart or failover takes.
const retryAfter = "2"

// storeError answers a failed database call by its class (store.Classify):
// 503 with Retry-After when the database is unavailable, 400 or 409 when it
// refused the request's values, 500 otherwise. The database's own message
// goes to the log only: it can quote SQL and values.
func (c *Coordinator) storeError(w http.ResponseWriter, r *http.Request, what string, err error) {
	c.storeErrorOn(w, r, what, 0, err)
}

// storeErrorOn is storeError for an operation on task id (0: none): a
// conflict then carries the task's state, like the operations' own 409.
func (c *Coordinator) storeErrorOn(w http.ResponseWriter, r *http.Request, what string, id int64, err error) {
	err = store.Classify(err)
	var se *store.Error
	errors.As(err, &se)
	code := ""
	if se != nil && se.Code != "" {
		code = " (SQLSTATE " + se.Code + ")"
	}
	switch {
	case errors.Is(err, store.ErrUnavailable):
		db := c.databaseIn(err)
		if r.Context().Err() == nil {
			c.log.Warn(what+" failed: database unavailable", "database", db, "error", err)
		}
		w.Header().Set("Retry-After", retryAfter)
		msg := "database unavailable; retry later"
		if db != "" {
			// The tasks of the other databases are served: say which one.
			msg = "database " + db + " unavailable; retry later"
		}
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: msg, Database: db})
	case errors.Is(err, store.ErrInvalidInput):
		// Validation should have refused this before the database did.
		c.log.Error(what+": the database refused a value that passed validation", "error", err)
		writeJSON(w, http.StatusBadRequest, apiError{Error: "the database refused a value" + code, Field: se.Column})
	case errors.Is(err, store.ErrConflict):
		c.log.Info(what+": conflict", "error", err)
		e := apiError{Error: "conflicts with an existing task" + code}
		if id > 0 {
			if t, gerr := c.router.Get(r.Context(), id); gerr == nil {
				e.State = t.State
			}
		}
		writeJSON(w, http.StatusConflict, e)
	default:
		c.log.Error(what+" failed", "error", err)
		writeJSON(w, http.StatusInternalServerError, apiError{Error: "internal error" + code + "; see the coordinator's log"})
	}
}

// ParseTaskID parses a task id in canonical form only: decimal digits, no
// sign, no leading zeros, 1 to 2^63-1. "+1" and "001" are not task 1: one
// task has one URL.
func ParseTaskID(s string) (int64, bool) {
	if s == "" || len(s) > 19 || s[0] < '1' || s[0] > '9' {
		return 0, false
	}
	for i := 1; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
	}
	id, err := strconv.ParseInt(s, 10, 64)
	return id, err == nil
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// unrunnableWarnings says which of classes no attached runner can run (none
// serves the queue with a handler of the kind): such tasks stay ready until
// a runner that can run them attaches. It is advice, so an etcd error says
// nothing.
func (c *Coordinator) unrunnableWarnings(ctx context.Context, classes ...tasks.Class) []string {
	runnable, err := c.runnableClasses(ctx)
	if err != nil {
		return nil
	}
	return client.Warnings(runnable, classes)
}

// runnableClasses returns the classes (queue, kind) the attached runners
// can run (shard.Capabilities: read from etcd at most once a second).
func (c *Coordinator) runnableClasses(ctx context.Context) (map[tasks.Class]bool, error) {
	return c.capabilities.Runnable(ctx)
}
