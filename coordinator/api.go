package coordinator

import (
	"bytes"
	"context"
	"crypto/subtle"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Limits of POST /api/tasks.
const (
	MaxRequestBody = 8 << 20
	MaxBatch       = 10000
)

//go:embed page.html
var page []byte

// Handler serves the API, the status page, /metrics and /healthz.
func (c *Coordinator) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Cache-Control", "no-cache")
		_, _ = w.Write(page)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "leader": c.IsLeader()})
	})
	mux.HandleFunc("GET /api/cluster", c.handleCluster)
	mux.HandleFunc("POST /api/tasks", c.handleEnqueue)
	mux.HandleFunc("GET /api/tasks/{id}", c.handleGetTask)
	mux.Handle("GET /metrics", promhttp.HandlerFor(c.reg, promhttp.HandlerOpts{}))
	return mux
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
	Gone   []RunnerView          `json:"gone"`
	Owners []string              `json:"owners"`
	Epochs []int64               `json:"epochs"`
	Tasks  map[tasks.State]int64 `json:"tasks"`
	// Rates are the tasks finished per second over the last RateWindow, by
	// final state (completed, failed, dead).
	Rates map[tasks.State]float64 `json:"rates"`
	// RateWindow is the window of Rates, in seconds.
	RateWindow float64 `json:"rate_window_seconds"`
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
	counts, err := c.Counts(ctx)
	if err != nil {
		return ClusterView{}, err
	}
	rates, err := c.cfg.Store.FinishedRates(ctx, rateWindow)
	if err != nil {
		return ClusterView{}, err
	}
	now := c.clock.Now()
	v := ClusterView{Prefix: c.cfg.Prefix, ShardCount: c.cfg.ShardCount, Revision: cl.Revision,
		Coordinator: c.cfg.ID, GeneratedAt: now.UTC(), Owners: cl.Owners, Epochs: cl.Epochs, Tasks: counts,
		Runners: []RunnerView{}, Rates: rates, RateWindow: rateWindow.Seconds()}
	owned := map[string]int{}
	for _, o := range cl.Owners {
		owned[o]++
	}
	for _, r := range cl.Runners {
		rv := RunnerView{RunnerInfo: r, Assigned: len(cl.Assigned[r.ID]), Owned: owned[r.ID], Health: HealthOK, LastSeen: now.UTC()}
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
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// TaskRequest is one task in POST /api/tasks.
type TaskRequest struct {
	Kind        string          `json:"kind"`
	Key         string          `json:"key,omitempty"`
	Payload     json.RawMessage `json:"payload,omitempty"`
	MaxAttempts *int            `json:"max_attempts,omitempty"`
	RunAfter    *time.Time      `json:"run_after,omitempty"`
	Deadline    *time.Time      `json:"deadline,omitempty"`
}

func (t TaskRequest) newTask() (tasks.NewTask, error) {
	n := tasks.NewTask{Kind: t.Kind, Key: t.Key, Payload: t.Payload}
	if t.MaxAttempts != nil {
		if *t.MaxAttempts < 1 {
			return n, &tasks.FieldError{Field: "max_attempts", Problem: fmt.Sprintf("must be at least 1, got %d", *t.MaxAttempts)}
		}
		n.MaxAttempts = *t.MaxAttempts
	}
	if t.RunAfter != nil {
		n.RunAfter = *t.RunAfter
	}
	if t.Deadline != nil {
		n.Deadline = *t.Deadline
	}
	return n, nil
}

type apiError struct {
	Error string `json:"error"`
	Field string `json:"field,omitempty"`
	Index *int   `json:"index,omitempty"`
}

// handleEnqueue accepts one task (a JSON object) or a batch (an array).
func (c *Coordinator) handleEnqueue(w http.ResponseWriter, r *http.Request) {
	if c.cfg.APIToken != "" {
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(c.cfg.APIToken)) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="shardrun-api"`)
			writeJSON(w, http.StatusUnauthorized, apiError{Error: "missing or wrong bearer token"})
			return
		}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeJSON(w, http.StatusRequestEntityTooLarge, apiError{Error: fmt.Sprintf("request body larger than %d bytes", tooBig.Limit)})
			return
		}
		writeJSON(w, http.StatusBadRequest, apiError{Error: "reading request body: " + err.Error()})
		return
	}
	trimmed := bytes.TrimSpace(body)
	batch := len(trimmed) > 0 && trimmed[0] == '['
	var reqs []TaskRequest
	dec := json.NewDecoder(bytes.NewReader(trimmed))
	dec.DisallowUnknownFields()
	if batch {
		err = dec.Decode(&reqs)
	} else {
		var one TaskRequest
		err = dec.Decode(&one)
		reqs = []TaskRequest{one}
	}
	if err == nil && dec.More() {
		err = errors.New("unexpected data after the JSON value")
	}
	if err != nil {
		writeJSON(w, http.StatusBadRequest, apiError{Error: "malformed JSON: " + err.Error()})
		return
	}
	if len(reqs) == 0 || len(reqs) > MaxBatch {
		writeJSON(w, http.StatusBadRequest, apiError{Error: fmt.Sprintf("a batch holds 1 to %d tasks, got %d", MaxBatch, len(reqs))})
		return
	}
	ins := make([]tasks.Insert, len(reqs))
	for i, req := range reqs {
		n, err := req.newTask()
		if err == nil {
			ins[i], err = c.client.Prepare(n)
		}
		if err != nil {
			e := apiError{Error: err.Error()}
			var fe *tasks.FieldError
			if errors.As(err, &fe) {
				e.Field = fe.Field
			}
			if batch {
				idx := i
				e.Index = &idx
				e.Error = fmt.Sprintf("task %d: %s", i, e.Error)
			}
			writeJSON(w, http.StatusBadRequest, e)
			return
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	if !batch {
		id, err := c.cfg.Store.Enqueue(ctx, ins[0])
		if err != nil {
			writeJSON(w, http.StatusServiceUnavailable, apiError{Error: err.Error()})
			return
		}
		resp := map[string]any{"id": id, "shard": ins[0].Shard, "key": ins[0].Key}
		c.warnUnhandled(ctx, resp, ins)
		writeJSON(w, http.StatusCreated, resp)
		return
	}
	n, err := c.cfg.Store.EnqueueBatch(ctx, ins)
	if err != nil {
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: err.Error()})
		return
	}
	resp := map[string]any{"enqueued": n}
	c.warnUnhandled(ctx, resp, ins)
	writeJSON(w, http.StatusCreated, resp)
}

func (c *Coordinator) handleGetTask(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id < 1 {
		writeJSON(w, http.StatusBadRequest, apiError{Error: fmt.Sprintf("task id must be a positive integer, got %q", r.PathValue("id"))})
		return
	}
	t, err := c.cfg.Store.Get(r.Context(), id)
	switch {
	case errors.Is(err, store.ErrNotFound):
		writeJSON(w, http.StatusNotFound, apiError{Error: fmt.Sprintf("no task %d", id)})
	case err != nil:
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: err.Error()})
	default:
		writeJSON(w, http.StatusOK, t)
	}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// warnUnhandled adds "warnings" to an enqueue answer when no attached
// runner handles one of the kinds just enqueued: such tasks stay ready until
// a runner that handles them attaches. It is advice, so an etcd error adds
// nothing.
func (c *Coordinator) warnUnhandled(ctx context.Context, resp map[string]any, ins []tasks.Insert) {
	handled, err := c.handledKinds(ctx)
	if err != nil {
		return
	}
	var warnings []string
	seen := map[string]bool{}
	for _, in := range ins {
		if handled[in.Kind] || seen[in.Kind] {
			continue
		}
		seen[in.Kind] = true
		warnings = append(warnings, fmt.Sprintf("no attached runner handles kind %q: its tasks stay ready until one does", in.Kind))
	}
	if len(warnings) > 0 {
		resp["warnings"] = warnings
	}
}

// handledKinds returns the kinds the attached runners publish, read from
// etcd at most once a second so that enqueue bursts cost one read.
func (c *Coordinator) handledKinds(ctx context.Context) (map[string]bool, error) {
	c.kindsMu.Lock()
	defer c.kindsMu.Unlock()
	if c.kinds != nil && c.clock.Now().Sub(c.kindsAt) < time.Second {
		return c.kinds, nil
	}
	resp, err := c.cfg.Client.Get(ctx, c.cfg.Prefix+"runners/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading the runners' kinds: %w", err)
	}
	kinds := map[string]bool{}
	for _, kv := range resp.Kvs {
		var info shard.RunnerInfo
		if json.Unmarshal(kv.Value, &info) == nil && info.State == shard.StateAttached {
			for _, k := range info.Kinds {
				kinds[k] = true
			}
		}
	}
	c.kinds, c.kindsAt = kinds, c.clock.Now()
	return kinds, nil
}
