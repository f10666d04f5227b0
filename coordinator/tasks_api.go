package coordinator

// The task operations of the API: enqueue answers (duplicates of a unique
// key), listing, cancel and retry of one task or by filter, and who may
// call what.
//
// Auth: with an API token configured, every call that changes something
// (enqueue, cancel, retry) and every call that reads task data (the
// listing and one task, with payloads, results and errors) needs it.
// /api/cluster, /healthz, /metrics and the status page stay open and carry
// no task data beyond ids, kinds, states and counts.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/shardrun/shardrun/internal/httpauth"
	"github.com/shardrun/shardrun/tasks"
)

// bulkBudget bounds one bulk request: it answers done false and the cursor
// to continue from when its batches took this long, within the server's
// 30s write timeout.
const bulkBudget = 15 * time.Second

// taskRoutes registers the task endpoints.
func (c *Coordinator) taskRoutes(mux *http.ServeMux) {
	auth := func(h http.HandlerFunc) http.HandlerFunc { return httpauth.Require(c.cfg.APIToken, "shardrun-api", h) }
	mux.HandleFunc("POST /api/tasks", auth(c.handleEnqueue))
	mux.HandleFunc("GET /api/tasks", auth(c.handleListTasks))
	mux.HandleFunc("GET /api/tasks/{id}", auth(c.handleGetTask))
	mux.HandleFunc("POST /api/tasks/{id}/cancel", auth(c.handleCancelTask))
	mux.HandleFunc("POST /api/tasks/{id}/retry", auth(c.handleRetryTask))
	mux.HandleFunc("POST /api/tasks/cancel", auth(c.handleBulk("cancel", c.cfg.Store.CancelMatching)))
	mux.HandleFunc("POST /api/tasks/retry", auth(c.handleBulk("retry", c.cfg.Store.RetryMatching)))
}

// idempotencyKey applies the Idempotency-Key header of a single-task POST:
// it is the task's unique key, and must agree with one given in the body.
func idempotencyKey(r *http.Request, reqs []TaskRequest, batch bool) error {
	key := r.Header.Get("Idempotency-Key")
	switch {
	case key == "":
		return nil
	case batch:
		return errors.New("the Idempotency-Key header applies to a single task; give each task of a batch its unique_key")
	case reqs[0].UniqueKey != "" && reqs[0].UniqueKey != key:
		return fmt.Errorf("the Idempotency-Key header %q and unique_key %q differ", key, reqs[0].UniqueKey)
	}
	reqs[0].UniqueKey = key
	return nil
}

// enqueue inserts validated tasks and answers: 201 with the id (or the
// count) when tasks were created; 200 with "duplicate": true and the
// existing task's id when a unique key was held. A batch with unique keys
// answers every task's id and duplicate flag in "tasks".
func (c *Coordinator) enqueue(ctx context.Context, w http.ResponseWriter, r *http.Request, ins []tasks.Insert, batch bool) {
	if !batch {
		e, err := c.cfg.Store.EnqueueIn(ctx, nil, ins[0])
		if err != nil {
			c.storeError(w, r, "enqueueing a task", err)
			return
		}
		if e.Duplicate {
			writeJSON(w, http.StatusOK, map[string]any{"id": e.ID, "duplicate": true})
			return
		}
		resp := map[string]any{"id": e.ID, "shard": ins[0].Shard, "key": ins[0].Key}
		c.warnUnhandled(ctx, resp, ins)
		writeJSON(w, http.StatusCreated, resp)
		return
	}
	res, err := c.cfg.Store.EnqueueBatchIn(ctx, nil, ins)
	if err != nil {
		c.storeError(w, r, "enqueueing a batch", err)
		return
	}
	resp := map[string]any{"enqueued": res.Inserted}
	if res.Tasks != nil {
		resp["duplicates"], resp["tasks"] = res.Duplicates, res.Tasks
	}
	c.warnUnhandled(ctx, resp, ins)
	code := http.StatusCreated
	if res.Inserted == 0 {
		code = http.StatusOK
	}
	writeJSON(w, code, resp)
}

// taskID reads the {id} of the path (ParseTaskID), answering 400 when it
// is not one.
func taskID(w http.ResponseWriter, r *http.Request) (int64, bool) {
	raw := r.PathValue("id")
	id, ok := ParseTaskID(raw)
	if !ok {
		if len(raw) > 32 {
			raw = raw[:32] + "…"
		}
		writeJSON(w, http.StatusBadRequest, apiError{Error: fmt.Sprintf("task id must be a decimal integer from 1 to %d without sign or leading zeros, got %q", int64(math.MaxInt64), raw)})
		return 0, false
	}
	return id, true
}

// taskError answers an error about task id (0: tasks in general): 404 when
// it does not exist, 409 with its state when the operation does not apply
// to it, 400 for a bad field, and a database error by its class
// (storeErrorOn).
func (c *Coordinator) taskError(w http.ResponseWriter, r *http.Request, what string, id int64, err error) {
	var ce *tasks.ConflictError
	var fe *tasks.FieldError
	switch {
	case errors.As(err, &ce):
		writeJSON(w, http.StatusConflict, apiError{Error: ce.Error(), State: ce.State})
	case errors.Is(err, tasks.ErrNotFound):
		var nf *tasks.NotFoundError
		msg := "no such task"
		if errors.As(err, &nf) {
			msg = fmt.Sprintf("no task %d", nf.ID)
		}
		writeJSON(w, http.StatusNotFound, apiError{Error: msg})
	case errors.As(err, &fe):
		writeJSON(w, http.StatusBadRequest, apiError{Error: fe.Error(), Field: fe.Field})
	default:
		c.storeErrorOn(w, r, what, id, err)
	}
}

// handleCancelTask: 200 with the task when it was ready and is cancelled;
// 202 with the task when it runs and its runner was asked to cancel it.
func (c *Coordinator) handleCancelTask(w http.ResponseWriter, r *http.Request) {
	id, ok := taskID(w, r)
	if !ok {
		return
	}
	t, err := c.cfg.Store.CancelTask(r.Context(), id)
	if err != nil {
		c.taskError(w, r, "cancelling a task", id, err)
		return
	}
	code := http.StatusOK
	if t.State == tasks.Running {
		code = http.StatusAccepted
	}
	writeJSON(w, code, t)
}

func (c *Coordinator) handleRetryTask(w http.ResponseWriter, r *http.Request) {
	id, ok := taskID(w, r)
	if !ok {
		return
	}
	t, err := c.cfg.Store.RetryTask(r.Context(), id)
	if err != nil {
		c.taskError(w, r, "retrying a task", id, err)
		return
	}
	writeJSON(w, http.StatusOK, t)
}

// The query parameters of the listing and of the bulk operations.
var (
	filterParams = []string{"state", "kind", "shard", "key", "queue", "priority", "sequence_key", "created_before", "after"}
	listParams   = append([]string{"limit", "order"}, filterParams...)
)

// parseFilter reads the filter and the cursor from q. It refuses
// parameters not in allowed, given twice or given empty, and values a
// task's field could not hold (tasks.Filter.Check: text PostgreSQL would
// refuse, a shard outside the cluster's shardCount), naming the parameter.
func parseFilter(q url.Values, allowed []string, shardCount int) (tasks.Filter, int64, error) {
	var f tasks.Filter
	if err := checkParams(q, allowed); err != nil {
		return f, 0, err
	}
	if v := q.Get("state"); v != "" {
		for _, s := range strings.Split(v, ",") {
			st := tasks.State(strings.TrimSpace(s))
			if !st.Valid() {
				return f, 0, &tasks.FieldError{Field: "state", Problem: fmt.Sprintf("%q is not a state", s)}
			}
			f.States = append(f.States, st)
		}
	}
	f.Kind, f.Key, f.Queue, f.SequenceKey = q.Get("kind"), q.Get("key"), q.Get("queue"), q.Get("sequence_key")
	if v := q.Get("priority"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return f, 0, &tasks.FieldError{Field: "priority", Problem: fmt.Sprintf("must be %d to %d, got %q", tasks.MostUrgent, tasks.LeastUrgent, v)}
		}
		f.Priority = n
	}
	if v := q.Get("shard"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return f, 0, &tasks.FieldError{Field: "shard", Problem: fmt.Sprintf("must be a shard number, 0 to %d, got %q", shardCount-1, v)}
		}
		f.Shard = &n
	}
	if v := q.Get("created_before"); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		switch {
		case err != nil:
			return f, 0, &tasks.FieldError{Field: "created_before", Problem: fmt.Sprintf("must be an RFC 3339 time, got %q", v)}
		case t.IsZero():
			// The filter's zero value means "no bound".
			return f, 0, &tasks.FieldError{Field: "created_before", Problem: "must not be the zero time 0001-01-01T00:00:00Z (leave it out for no bound)"}
		}
		f.CreatedBefore = t
	}
	var after int64
	if v := q.Get("after"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return f, 0, &tasks.FieldError{Field: "after", Problem: fmt.Sprintf("must be a cursor (a task id), got %q", v)}
		}
		after = n
	}
	return f, after, f.Check(shardCount)
}

// checkParams refuses query parameters not in allowed, given twice or given
// empty.
func checkParams(q url.Values, allowed []string) error {
	for _, name := range slices.Sorted(maps.Keys(q)) {
		switch {
		case !slices.Contains(allowed, name):
			return &tasks.FieldError{Field: name, Problem: "is not a parameter here (" + strings.Join(allowed, ", ") + ")"}
		case len(q[name]) > 1:
			return &tasks.FieldError{Field: name, Problem: "is given more than once"}
		case q[name][0] == "":
			return &tasks.FieldError{Field: name, Problem: "is given empty (leave it out instead)"}
		}
	}
	return nil
}

// parseLimit reads a listing's limit: 1 to tasks.MaxListLimit when given,
// 0 (the default) when left out.
func parseLimit(q url.Values) (int, error) {
	v := q.Get("limit")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > tasks.MaxListLimit {
		return 0, &tasks.FieldError{Field: "limit", Problem: fmt.Sprintf("must be 1 to %d (leave it out for %d), got %q", tasks.MaxListLimit, tasks.DefaultListLimit, v)}
	}
	return n, nil
}

// handleListTasks is GET /api/tasks: one page of task summaries in id
// order and the cursor of the next page ("next", absent at the end).
func (c *Coordinator) handleListTasks(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, after, err := parseFilter(q, listParams, c.cfg.ShardCount)
	if err != nil {
		c.taskError(w, r, "listing tasks", 0, err)
		return
	}
	req := tasks.ListRequest{Filter: f, After: after}
	if req.Limit, err = parseLimit(q); err != nil {
		c.taskError(w, r, "listing tasks", 0, err)
		return
	}
	switch q.Get("order") {
	case "", "asc":
	case "desc":
		req.Desc = true
	default:
		c.taskError(w, r, "listing tasks", 0, &tasks.FieldError{Field: "order", Problem: fmt.Sprintf("must be asc or desc, got %q", q.Get("order"))})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	page, err := c.cfg.Store.List(ctx, req)
	if err != nil {
		c.taskError(w, r, "listing tasks", 0, err)
		return
	}
	writeJSON(w, http.StatusOK, page)
}

// handleBulk is POST /api/tasks/cancel and /api/tasks/retry: the filter in
// the query, as for the listing (at least one), and the counts in the
// answer; "done": false with "next" when the request's time ran out, to be
// sent again with after=next.
func (c *Coordinator) handleBulk(op string, run func(context.Context, tasks.Filter, int64, time.Duration) (tasks.BulkResult, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		f, after, err := parseFilter(r.URL.Query(), filterParams, c.cfg.ShardCount)
		if err != nil {
			c.taskError(w, r, "bulk "+op, 0, err)
			return
		}
		res, err := run(r.Context(), f, after, bulkBudget)
		if err != nil {
			// What was done before the error stays done; the caller sends
			// the request again.
			c.taskError(w, r, "bulk "+op, 0, err)
			return
		}
		resp := map[string]any{"done": res.Done}
		if op == "cancel" {
			resp["cancelled"], resp["cancel_requested"] = res.Cancelled, res.CancelRequested
		} else {
			resp["retried"], resp["skipped"] = res.Retried, res.Skipped
		}
		if !res.Done {
			resp["next"] = res.Next
		}
		writeJSON(w, http.StatusOK, resp)
	}
}
