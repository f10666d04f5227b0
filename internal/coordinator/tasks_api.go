package coordinator

// The task operations of the API: enqueue answers (duplicates of a unique
// key), listing, the capped count of a filter, cancel and retry of one
// task or by filter, and who may call what.
//
// Auth: with an API token configured, every call that changes something
// (enqueue, cancel, retry) and every call that reads task data (the
// listing, the count and one task, with payloads, results and errors)
// needs it.
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

// defaultBulkBudget bounds one bulk request: it answers done false and
// the cursor to continue from when its batches took this long, within the
// server's 30s write timeout.
const defaultBulkBudget = 15 * time.Second

// taskRoutes registers the task endpoints.
func (c *Coordinator) taskRoutes(mux *http.ServeMux) {
	auth := func(h http.HandlerFunc) http.HandlerFunc { return httpauth.Require(c.cfg.APIToken, "shardrun-api", h) }
	mux.HandleFunc("POST /api/tasks", auth(c.handleEnqueue))
	mux.HandleFunc("GET /api/tasks", auth(c.handleListTasks))
	mux.HandleFunc("GET /api/tasks/count", auth(c.handleCountTasks))
	mux.HandleFunc("GET /api/tasks/{id}", auth(c.handleTask("reading a task", c.client.Get, statusOK)))
	mux.HandleFunc("POST /api/tasks/{id}/cancel", auth(c.handleTask("cancelling a task", c.client.Cancel, cancelled)))
	mux.HandleFunc("POST /api/tasks/{id}/retry", auth(c.handleTask("retrying a task", c.client.Retry, statusOK)))
	mux.HandleFunc("POST /api/tasks/cancel", auth(c.handleBulk("cancel", c.router.CancelMatching)))
	mux.HandleFunc("POST /api/tasks/retry", auth(c.handleBulk("retry", c.router.RetryMatching)))
}

// failed answers err when there is one: 400 naming the field of a
// *tasks.FieldError, a database error by its class (storeError). It
// reports whether it answered.
func (c *Coordinator) failed(w http.ResponseWriter, r *http.Request, what string, err error) bool {
	var fe *tasks.FieldError
	switch {
	case err == nil:
		return false
	case errors.As(err, &fe):
		badRequest(w, err, false, -1)
	default:
		c.storeError(w, r, what, err)
	}
	return true
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

// handleTask answers one operation on the task of the path's {id}
// through the client: the task, with the status code the task's state
// calls for, or the error (taskError).
func (c *Coordinator) handleTask(what string, op func(context.Context, int64) (tasks.Task, error), code func(tasks.Task) int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, ok := taskID(w, r)
		if !ok {
			return
		}
		t, err := op(r.Context(), id)
		if err != nil {
			c.taskError(w, r, what, id, err)
			return
		}
		writeJSON(w, code(t), t)
	}
}

// statusOK is 200 whatever the task.
func statusOK(tasks.Task) int { return http.StatusOK }

// cancelled is 200 when the task was ready and is cancelled, 202 when it
// runs and its runner was asked to cancel it.
func cancelled(t tasks.Task) int {
	if t.State == tasks.Running {
		return http.StatusAccepted
	}
	return http.StatusOK
}

// The query parameters of the listing, of the bulk operations and of the
// count (the filter without a cursor).
var (
	filterParams = []string{"state", "kind", "shard", "key", "queue", "priority", "sequence_key", "created_before", "created_since", "after"}
	listParams   = append([]string{"limit", "order"}, filterParams...)
	countParams  = slices.DeleteFunc(slices.Clone(filterParams), func(p string) bool { return p == "after" })
)

// parseFilter reads the filter and the cursor from q, which query read
// (and checkParams checked against the endpoint's parameters). It refuses
// values a task's field could not hold (tasks.Filter.Check: text
// PostgreSQL would refuse, a shard outside the cluster's shardCount),
// naming the parameter. Every parameter given ends up set in the filter
// (or the cursor): none parses to the zero value, which means "any".
func parseFilter(q url.Values, shardCount int) (tasks.Filter, int64, error) {
	var f tasks.Filter
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
		// Checked here, not left to Filter.Check: the filter's zero
		// priority means "any", so priority=0 (or 00, +0) parsed into it
		// would widen a bulk cancel to every priority.
		n, err := strconv.Atoi(v)
		if err != nil || tasks.CheckPriority(n) != nil {
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
	var err error
	if f.CreatedBefore, err = parseTimeParam(q, "created_before"); err != nil {
		return f, 0, err
	}
	if f.CreatedSince, err = parseTimeParam(q, "created_since"); err != nil {
		return f, 0, err
	}
	var after int64
	if v := q.Get("after"); v != "" {
		// 0 is not a task id: it would read as no cursor.
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 {
			return f, 0, &tasks.FieldError{Field: "after", Problem: fmt.Sprintf("must be a cursor (a task id, 1 or more; leave it out to start at the first), got %q", v)}
		}
		after = n
	}
	return f, after, f.Check(shardCount)
}

// parseTimeParam reads the optional time parameter name of q: an RFC 3339
// time, not the zero time (the filter's zero value means "no bound").
func parseTimeParam(q url.Values, name string) (time.Time, error) {
	v := q.Get(name)
	if v == "" {
		return time.Time{}, nil
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	switch {
	case err != nil:
		return time.Time{}, &tasks.FieldError{Field: name, Problem: fmt.Sprintf("must be an RFC 3339 time such as 2026-11-25T18:00:00Z, got %q", v)}
	case t.IsZero():
		return time.Time{}, &tasks.FieldError{Field: name, Problem: "must not be the zero time 0001-01-01T00:00:00Z (leave it out for no bound)"}
	}
	return t, nil
}

// query reads r's query string for an endpoint that takes the parameters
// allowed (none: nil): strictly (parseQuery), and refusing a parameter not
// in allowed, given twice or given empty (checkParams). Every endpoint
// that takes a query reads it through here.
func query(r *http.Request, allowed []string) (url.Values, error) {
	q, err := parseQuery(r.URL.RawQuery)
	if err != nil {
		return nil, err
	}
	return q, checkParams(q, allowed)
}

// parseQuery parses a raw query string as url.ParseQuery does, but refuses
// what ParseQuery drops with an error (and r.URL.Query silently): a pair
// with a malformed %-escape or a ';' (once a separator). Dropping a pair
// widens a filter: ?state=ready&priority=%G2 would cancel every ready task
// of any priority. The error names the parameter; a pair without a name
// (=x) is named by what it says.
func parseQuery(raw string) (url.Values, error) {
	q := url.Values{}
	for pair := range strings.SplitSeq(raw, "&") {
		if pair == "" {
			continue // a stray &: no parameter
		}
		rawName, rawValue, _ := strings.Cut(pair, "=")
		name, err := url.QueryUnescape(rawName)
		if err != nil {
			return nil, &tasks.FieldError{Field: shortParam(rawName), Problem: "is not a parameter name: " + err.Error()}
		}
		switch {
		case name == "":
			return nil, &tasks.FieldError{Field: shortParam(pair), Problem: "is a value without a parameter name"}
		case strings.Contains(pair, ";"):
			return nil, &tasks.FieldError{Field: shortParam(name), Problem: "holds ';', which is not a separator here (use &, or %3B for the character)"}
		}
		value, err := url.QueryUnescape(rawValue)
		if err != nil {
			return nil, &tasks.FieldError{Field: shortParam(name), Problem: "has a malformed value: " + err.Error()}
		}
		q[name] = append(q[name], value)
	}
	return q, nil
}

// shortParam bounds a parameter name quoted back in an answer.
func shortParam(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// checkParams refuses query parameters not in allowed, given twice or given
// empty.
func checkParams(q url.Values, allowed []string) error {
	for _, name := range slices.Sorted(maps.Keys(q)) {
		switch {
		case !slices.Contains(allowed, name) && len(allowed) == 0:
			return &tasks.FieldError{Field: shortParam(name), Problem: "is not a parameter here (this endpoint takes none)"}
		case !slices.Contains(allowed, name):
			return &tasks.FieldError{Field: shortParam(name), Problem: "is not a parameter here (" + strings.Join(allowed, ", ") + ")"}
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
	answerQuery(c, w, r, "listing tasks", listParams,
		func(q url.Values) (tasks.ListRequest, error) { return parseListQuery(q, c.cfg.ShardCount) },
		func(ctx context.Context, req tasks.ListRequest) (any, error) { return c.router.List(ctx, req) })
}

// answerQuery serves a GET of one JSON answer: the query string's
// parameters (params, each at most once) read by parse, the answer
// computed by run within 10s. A bad parameter is a 400 naming it, a
// failed run answered by its class (failed).
func answerQuery[Req any](c *Coordinator, w http.ResponseWriter, r *http.Request, what string, params []string,
	parse func(url.Values) (Req, error), run func(context.Context, Req) (any, error)) {
	q, err := query(r, params)
	var req Req
	if err == nil {
		req, err = parse(q)
	}
	if err != nil {
		badRequest(w, err, false, -1)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	resp, err := run(ctx, req)
	if c.failed(w, r, what, err) {
		return
	}
	writeJSON(w, http.StatusOK, resp)
}

// parseListQuery reads the page GET /api/tasks asks for: the filter and
// cursor (parseFilter), the limit and the order.
func parseListQuery(q url.Values, shardCount int) (tasks.ListRequest, error) {
	f, after, err := parseFilter(q, shardCount)
	if err != nil {
		return tasks.ListRequest{}, err
	}
	req := tasks.ListRequest{Filter: f, After: after}
	if req.Limit, err = parseLimit(q); err != nil {
		return req, err
	}
	switch q.Get("order") {
	case "", "asc":
	case "desc":
		req.Desc = true
	default:
		return req, &tasks.FieldError{Field: "order", Problem: fmt.Sprintf("must be asc or desc, got %q", q.Get("order"))}
	}
	return req, nil
}

// handleCountTasks is GET /api/tasks/count: how many tasks match the
// filter (the listing's, without a cursor; none counts every task), up to
// store.MatchCountCap, so that an operator sees how many tasks a bulk
// cancel or retry will touch before sending it. {"count": n} is exact;
// with "at_least": true at least n match (the cap was reached, or the
// count examined store.MatchCountScan candidates, then given as
// "examined", without reaching the end).
func (c *Coordinator) handleCountTasks(w http.ResponseWriter, r *http.Request) {
	answerQuery(c, w, r, "counting tasks", countParams,
		func(q url.Values) (tasks.Filter, error) {
			f, _, err := parseFilter(q, c.cfg.ShardCount)
			return f, err
		},
		func(ctx context.Context, f tasks.Filter) (any, error) { return c.router.CountMatching(ctx, f) })
}

// handleBulk is POST /api/tasks/cancel and /api/tasks/retry: the filter in
// the query, as for the listing (at least one), and the counts in the
// answer; "done": false with "next" when the request's time ran out, to be
// sent again with after=next.
func (c *Coordinator) handleBulk(op string, run func(context.Context, tasks.Filter, int64, time.Duration) (tasks.BulkResult, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		q, err := query(r, filterParams)
		if err != nil {
			c.taskError(w, r, "bulk "+op, 0, err)
			return
		}
		f, after, err := parseFilter(q, c.cfg.ShardCount)
		if err != nil {
			c.taskError(w, r, "bulk "+op, 0, err)
			return
		}
		res, err := run(r.Context(), f, after, time.Duration(c.bulkBudget.Load()))
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
