package coordinator

// POST /api/tasks: one task (a JSON object) or a batch (an array),
// decoded by tasks.DecodeTasks into the task vocabulary (a field given
// empty, zero or null refused naming it, with the index in a batch), the
// Idempotency-Key header, the enqueue through the task operations
// (internal/client), and the answer with its warnings.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/shardrun/shardrun/internal/httpjson"
	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/tasks"
)

// Limits of POST /api/tasks.
const (
	MaxRequestBody = 8 << 20
	MaxBatch       = 10000
)

// handleEnqueue accepts one task (a JSON object) or a batch (an array).
// With tracing on it runs in a server span that joins the request's
// traceparent (traceEnqueue).
func (c *Coordinator) handleEnqueue(w http.ResponseWriter, r *http.Request) {
	if c.tracer != nil {
		var end func()
		w, r, end = c.traceEnqueue(w, r)
		defer end()
	}
	body, ok := httpjson.ReadBody(w, r, MaxRequestBody)
	if !ok {
		return
	}
	ns, batch, err := tasks.DecodeTasks(body)
	if err != nil {
		c.enqueueError(w, r, "decoding tasks", err, batch)
		return
	}
	if len(ns) == 0 || len(ns) > MaxBatch {
		writeJSON(w, http.StatusBadRequest, apiError{Error: fmt.Sprintf("a batch holds 1 to %d tasks, got %d", MaxBatch, len(ns))})
		return
	}
	if err := idempotencyKey(r, ns, batch); err != nil {
		writeJSON(w, http.StatusBadRequest, apiError{Error: err.Error(), Field: "unique_key"})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	c.enqueue(ctx, w, r, ns, batch)
}

// enqueueError answers a refused or failed enqueue: 400 naming the field
// (and the index in a batch) for a malformed body or an invalid task, a
// database error by its class (failed).
func (c *Coordinator) enqueueError(w http.ResponseWriter, r *http.Request, what string, err error, batch bool) {
	var be *tasks.BatchError
	var je *jsonbody.Error
	switch {
	case errors.As(err, &be):
		badRequest(w, be.Err, true, be.Index)
	case errors.As(err, &je):
		badRequest(w, err, batch, -1)
	default:
		c.failed(w, r, what, err)
	}
}

// idempotencyKey applies the Idempotency-Key header of a single-task POST:
// it is the task's unique key, and must agree with one given in the body.
// A header given empty or more than once is refused, as a body field given
// empty is: it would otherwise read as no key, and the enqueue would not
// be idempotent.
func idempotencyKey(r *http.Request, ns []tasks.NewTask, batch bool) error {
	keys := r.Header.Values("Idempotency-Key")
	switch {
	case len(keys) == 0:
		return nil
	case len(keys) > 1:
		return errors.New("the Idempotency-Key header is given more than once")
	case keys[0] == "":
		return errors.New("the Idempotency-Key header is given empty (leave it out for no unique key)")
	case batch:
		return errors.New("the Idempotency-Key header applies to a single task; give each task of a batch its unique_key")
	case ns[0].UniqueKey != "" && ns[0].UniqueKey != keys[0]:
		return fmt.Errorf("the Idempotency-Key header %q and unique_key %q differ", keys[0], ns[0].UniqueKey)
	}
	ns[0].UniqueKey = keys[0]
	return nil
}

// enqueue validates and inserts tasks through the task operations and
// answers: 201 with the id (or the count) when tasks were created; 200
// with "duplicate": true and the existing task's id when a unique key was
// held. A batch with unique keys answers every task's id and duplicate
// flag in "tasks".
func (c *Coordinator) enqueue(ctx context.Context, w http.ResponseWriter, r *http.Request, ns []tasks.NewTask, batch bool) {
	if !batch {
		e, err := c.client.Enqueue(ctx, ns[0])
		if err != nil {
			c.enqueueError(w, r, "enqueueing a task", err, batch)
			return
		}
		if e.Duplicate {
			writeJSON(w, http.StatusOK, map[string]any{"id": e.ID, "duplicate": true})
			return
		}
		resp := map[string]any{"id": e.ID, "shard": e.Shard, "key": e.Key}
		c.warnUnrunnable(ctx, resp, ns)
		writeJSON(w, http.StatusCreated, resp)
		return
	}
	res, err := c.client.EnqueueBatch(ctx, ns)
	if err != nil {
		c.enqueueError(w, r, "enqueueing a batch", err, batch)
		return
	}
	resp := map[string]any{"enqueued": res.Inserted}
	if res.Tasks != nil {
		resp["duplicates"], resp["tasks"] = res.Duplicates, res.Tasks
	}
	c.warnUnrunnable(ctx, resp, ns)
	code := http.StatusCreated
	if res.Inserted == 0 {
		code = http.StatusOK
	}
	writeJSON(w, code, resp)
}

// warnUnrunnable adds "warnings" to an enqueue answer when no attached
// runner can run some of the tasks just enqueued (unrunnableWarnings).
func (c *Coordinator) warnUnrunnable(ctx context.Context, resp map[string]any, ns []tasks.NewTask) {
	classes := make([]tasks.Class, len(ns))
	for i, n := range ns {
		classes[i] = n.Class()
	}
	if warnings := c.unrunnableWarnings(ctx, classes...); len(warnings) > 0 {
		resp["warnings"] = warnings
	}
}
