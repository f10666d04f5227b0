package coordinator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// queueRateWindow is the window of a queue's completion rate.
const queueRateWindow = 10 * time.Second

// queueRoutes registers the queue and sequence endpoints, each behind the
// API token (auth): they read task data or change what runs.
func (c *Coordinator) queueRoutes(mux *http.ServeMux, auth func(http.HandlerFunc) http.HandlerFunc) {
	mux.HandleFunc("GET /api/queues", auth(c.handleListQueues))
	mux.HandleFunc("POST /api/queues/{name}/pause", auth(c.handlePauseQueue(true)))
	mux.HandleFunc("POST /api/queues/{name}/resume", auth(c.handlePauseQueue(false)))
	mux.HandleFunc("DELETE /api/queues/{name}", auth(c.handleDeleteQueue))
	mux.HandleFunc("GET /api/sequences/blocked", auth(c.handleBlockedSequences))
}

// QueuePage is the answer of GET /api/queues.
type QueuePage struct {
	Queues []store.QueueStats `json:"queues"`
}

// queueParams are the parameters of GET /api/queues.
var queueParams = []string{"idle"}

// parseQueueQuery reads the filter GET /api/queues asks for: idle=true
// lists only the queues without unfinished tasks (those an operator can
// remove, but the default queue), idle=false only those with some; left
// out, every queue (nil).
func parseQueueQuery(q url.Values) (idle *bool, err error) {
	switch v := q.Get("idle"); v {
	case "":
		return nil, nil
	case "true", "false":
		b := v == "true"
		return &b, nil
	default:
		return nil, &tasks.FieldError{Field: "idle", Problem: fmt.Sprintf("must be true or false, got %q", v)}
	}
}

func (c *Coordinator) handleListQueues(w http.ResponseWriter, r *http.Request) {
	answerQuery(c, w, r, "reading the queues", queueParams, parseQueueQuery, func(ctx context.Context, idle *bool) (any, error) {
		qs, err := c.router.Queues(ctx, queueRateWindow)
		if err != nil {
			return nil, err
		}
		if idle != nil {
			qs = slices.DeleteFunc(qs, func(s store.QueueStats) bool { return s.Idle != *idle })
		}
		if qs == nil {
			qs = []store.QueueStats{}
		}
		return QueuePage{Queues: qs}, nil
	})
}

// queueName reads the {name} of a queue's path, which takes no query
// parameters, answering 400 when it is not a queue's name.
func queueName(w http.ResponseWriter, r *http.Request) (string, bool) {
	name := r.PathValue("name")
	err := tasks.CheckQueue(name)
	if err == nil {
		_, err = query(r, nil)
	}
	if err != nil {
		badRequest(w, err, false, -1)
		return "", false
	}
	return name, true
}

// QueueConflict is the answer of DELETE /api/queues/{name} for a queue
// that has unfinished tasks (their counts, each up to store.QueueWorkCap)
// or that a producer's open transaction is enqueueing into (Enqueueing).
type QueueConflict struct {
	Error string `json:"error"`
	store.QueueWork
	Enqueueing bool `json:"enqueueing,omitempty"`
}

// handleDeleteQueue is DELETE /api/queues/{name}: it removes the queue's
// row — its pause, its line in the listing — when the queue has no
// unfinished task, and answers what it removed. Queues get a row from
// every enqueue of a new name and from a pause ahead; without this, each
// stayed forever (finding 7 of the hostile-input review). A queue with
// work is refused (409, with its counts); the default queue is never
// removed (400). A queue enqueued into again comes back.
func (c *Coordinator) handleDeleteQueue(w http.ResponseWriter, r *http.Request) {
	name, ok := queueName(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	removed, err := c.router.DeleteQueue(ctx, name)
	var inUse *store.QueueInUseError
	switch {
	case errors.Is(err, store.ErrDefaultQueue):
		writeJSON(w, http.StatusBadRequest, apiError{Error: err.Error(), Field: "queue"})
	case errors.Is(err, store.ErrNoSuchQueue):
		writeJSON(w, http.StatusNotFound, apiError{Error: fmt.Sprintf("no queue named %q", name)})
	case errors.As(err, &inUse):
		writeJSON(w, http.StatusConflict, QueueConflict{Error: inUse.Error(), QueueWork: inUse.Work, Enqueueing: inUse.Enqueueing})
	case err != nil:
		c.storeError(w, r, "removing a queue", err)
	default:
		c.log.Info("queue removed by an operator", "queue", name)
		writeJSON(w, http.StatusOK, map[string]any{"removed": removed})
	}
}

// handlePauseQueue is POST /api/queues/{name}/pause and …/resume: it
// answers the queue as it is now. Pausing is idempotent and survives
// coordinators and runners (it is a row of the database); a queue no task
// was enqueued in yet can be paused ahead.
func (c *Coordinator) handlePauseQueue(paused bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		name, ok := queueName(w, r)
		if !ok {
			return
		}
		at, err := c.router.SetQueuePaused(r.Context(), name, paused)
		if err != nil {
			c.storeError(w, r, "pausing or resuming a queue", err)
			return
		}
		view := map[string]any{"name": name, "paused": paused}
		if paused {
			view["paused_at"] = at
		}
		c.log.Info("queue paused or resumed by an operator", "queue", name, "paused", paused)
		writeJSON(w, http.StatusOK, view)
	}
}

// SequencePage is the answer of GET /api/sequences/blocked: blocked
// sequences in key order, each with the task that blocks it; Next is the
// cursor of the next page (the last key), empty at the end.
type SequencePage struct {
	Sequences []store.BlockedSequence `json:"sequences"`
	Next      string                  `json:"next,omitempty"`
}

// sequenceParams are the parameters of GET /api/sequences/blocked.
var sequenceParams = []string{"limit", "after"}

// parseSequenceQuery reads the page GET /api/sequences/blocked asks for:
// the cursor (a sequence key, checked as one before the database sees it)
// and the limit (the default when left out).
func parseSequenceQuery(q url.Values) (after string, limit int, err error) {
	if limit, err = parseLimit(q); err != nil {
		return "", 0, err
	}
	if after = q.Get("after"); after != "" {
		if err := tasks.CheckKey("after", after); err != nil {
			return "", 0, err
		}
	}
	return after, cmp.Or(limit, tasks.DefaultListLimit), nil
}

func (c *Coordinator) handleBlockedSequences(w http.ResponseWriter, r *http.Request) {
	q, err := query(r, sequenceParams)
	if err != nil {
		badRequest(w, err, false, -1)
		return
	}
	after, limit, err := parseSequenceQuery(q)
	if err != nil {
		badRequest(w, err, false, -1)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	seqs, err := c.router.BlockedSequences(ctx, after, limit)
	if err != nil {
		c.storeError(w, r, "listing blocked sequences", err)
		return
	}
	page := SequencePage{Sequences: seqs}
	if page.Sequences == nil {
		page.Sequences = []store.BlockedSequence{}
	}
	if len(seqs) == limit {
		page.Next = seqs[len(seqs)-1].Key
	}
	writeJSON(w, http.StatusOK, page)
}
