package coordinator

import (
	"cmp"
	"context"
	"net/http"
	"net/url"
	"time"

	"github.com/shardrun/shardrun/internal/store"
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
	mux.HandleFunc("GET /api/sequences/blocked", auth(c.handleBlockedSequences))
}

// QueuePage is the answer of GET /api/queues.
type QueuePage struct {
	Queues []store.QueueStats `json:"queues"`
}

func (c *Coordinator) handleListQueues(w http.ResponseWriter, r *http.Request) {
	if _, err := query(r, nil); err != nil {
		badRequest(w, err, false, -1)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	qs, err := c.cfg.Store.Queues(ctx, queueRateWindow)
	if err != nil {
		c.storeError(w, r, "reading the queues", err)
		return
	}
	writeJSON(w, http.StatusOK, QueuePage{Queues: qs})
}

// handlePauseQueue is POST /api/queues/{name}/pause and …/resume: it
// answers the queue as it is now. Pausing is idempotent and survives
// coordinators and runners (it is a row of the database); a queue no task
// was enqueued in yet can be paused ahead.
func (c *Coordinator) handlePauseQueue(paused bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		if err := tasks.CheckQueue(name); err != nil {
			badRequest(w, err, false, -1)
			return
		}
		if _, err := query(r, nil); err != nil {
			badRequest(w, err, false, -1)
			return
		}
		at, err := c.cfg.Store.SetQueuePaused(r.Context(), name, paused)
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
	seqs, err := c.cfg.Store.BlockedSequences(ctx, after, limit)
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
