package coordinator

// GET /api/databases: the cluster's databases, each with the shards the
// map places in it, its health, its tasks by state and the moves under
// way; POST /api/shards/{n}/move asks for a shard's move. It shows names,
// never a URL, a host or a password: the page and the API are read by
// people who have no business with the databases' credentials.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/shardrun/shardrun/internal/httpjson"
	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/internal/leadership"
	"github.com/shardrun/shardrun/tasks"
)

// DatabaseView is one database in GET /api/databases and the cluster
// view.
type DatabaseView struct {
	Name string `json:"name"`
	// Slot is its index in the map: the order the cluster was created
	// with.
	Slot int `json:"slot"`
	// Shards are the shards the map places in it, as ranges ("0-127",
	// "0-63,96-127"); ShardCount how many.
	Shards     string `json:"shards"`
	ShardCount int    `json:"shard_count"`
	// Health is ok, unavailable (its shards wait; the other databases'
	// work goes on) or unknown (not probed yet), and Since when it
	// became so, as this coordinator probes it.
	Health string     `json:"health"`
	Since  *time.Time `json:"health_since,omitempty"`
	// Tasks are its tasks by state, as last counted; CountedAt says when
	// (older than a few seconds when the database did not answer since).
	Tasks          map[tasks.State]int64 `json:"tasks"`
	TasksEstimated []tasks.State         `json:"tasks_estimated,omitempty"`
	CountedAt      *time.Time            `json:"counted_at,omitempty"`
	// Moves are the moves of shards into or out of it under way.
	Moves []MoveView `json:"moves"`
}

// MoveView is a shard's move between two databases, as the map records
// it (docs/architecture.md, "Several databases").
type MoveView struct {
	Shard int    `json:"shard"`
	From  string `json:"from"`
	To    string `json:"to"`
	Phase string `json:"phase"`
}

// DatabasesView is the JSON of GET /api/databases.
type DatabasesView struct {
	// Revision is the map's (its etcd ModRevision; 0 for the implicit map
	// of a cluster created before the map existed).
	Revision  int64          `json:"revision"`
	Databases []DatabaseView `json:"databases"`
	// Moves are every move under way.
	Moves []MoveView `json:"moves"`
}

// Databases reads the view served by GET /api/databases: the map the
// router has, the health this coordinator probed and the counter's last
// counts.
func (c *Coordinator) Databases(ctx context.Context) (DatabasesView, error) {
	tc, err := c.counter.View(ctx)
	if err != nil {
		return DatabasesView{}, err
	}
	return c.databasesView(tc), nil
}

func (c *Coordinator) databasesView(tc taskCounts) DatabasesView {
	m := c.router.Map()
	v := DatabasesView{Revision: m.Rev, Databases: []DatabaseView{}, Moves: []MoveView{}}
	for _, mv := range m.Moves {
		v.Moves = append(v.Moves, MoveView{Shard: mv.Shard, From: mv.From, To: mv.To, Phase: mv.Phase})
	}
	counts := map[string]databaseCounts{}
	for _, d := range tc.databases {
		counts[d.name] = d
	}
	for slot, name := range m.Databases {
		h := c.health.Of(name)
		d := DatabaseView{Name: name, Slot: slot, Shards: m.Ranges(name), Health: h.Health, Since: h.Since,
			Tasks: map[tasks.State]int64{}, Moves: []MoveView{}}
		for _, db := range m.Shards {
			if db == name {
				d.ShardCount++
			}
		}
		if dc, ok := counts[name]; ok && dc.counts != nil {
			d.Tasks, d.TasksEstimated = dc.counts, dc.estimated
			at := dc.at.UTC()
			d.CountedAt = &at
		}
		for _, mv := range v.Moves {
			if mv.From == name || mv.To == name {
				d.Moves = append(d.Moves, mv)
			}
		}
		v.Databases = append(v.Databases, d)
	}
	return v
}

func (c *Coordinator) handleDatabases(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	v, err := c.Databases(ctx)
	if err != nil {
		if r.Context().Err() == nil {
			c.log.Warn("reading the databases view failed", "error", err)
		}
		w.Header().Set("Retry-After", retryAfter)
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: "no database answered; retry later"})
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// MoveRequest is the body of POST /api/shards/{n}/move: the database to
// move shard n to, by name.
type MoveRequest struct {
	To string `json:"to"`
}

// MoveAccepted is the answer (202 Accepted) to POST /api/shards/{n}/move:
// the move as the map records it, and the map's revision with it. The
// leader makes the move; GET /api/databases shows it until it is done.
type MoveAccepted struct {
	Move     MoveView `json:"move"`
	Revision int64    `json:"revision"`
}

// maxMoveBody bounds the body of a move request.
const maxMoveBody = 4 << 10

// handleMoveShard is POST /api/shards/{n}/move: record the intent to move
// shard n to another database (leadership.RequestMove), which the
// leader's move driver then makes online. 400 names a shard out of range
// or already moving, an unknown database, or one that holds the shard
// already.
func (c *Coordinator) handleMoveShard(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.Atoi(r.PathValue("n"))
	if err != nil {
		badRequest(w, &tasks.FieldError{Field: "shard", Problem: fmt.Sprintf("%q in the path is not a shard number", r.PathValue("n"))}, false, -1)
		return
	}
	body, ok := httpjson.ReadBody(w, r, maxMoveBody)
	if !ok {
		return
	}
	var req MoveRequest
	if err := jsonbody.Decode(body, &req); err != nil {
		badRequest(w, err, false, -1)
		return
	}
	if req.To == "" {
		badRequest(w, &tasks.FieldError{Field: "to", Problem: "the name of the database to move the shard to is required"}, false, -1)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	m, err := leadership.RequestMove(ctx, c.cfg.Client, c.cfg.Prefix, c.cfg.ShardCount, n, req.To)
	var fe *tasks.FieldError
	switch {
	case errors.As(err, &fe):
		badRequest(w, err, false, -1)
		return
	case err != nil:
		if r.Context().Err() == nil {
			c.log.Warn("recording a shard's move failed", "error", err)
		}
		w.Header().Set("Retry-After", retryAfter)
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: "could not record the move in etcd; retry later"})
		return
	}
	mv := m.Moves[len(m.Moves)-1]
	c.log.Info("a shard's move was asked", "shard", mv.Shard, "from", mv.From, "to", mv.To, "revision", m.Rev)
	writeJSON(w, http.StatusAccepted, MoveAccepted{Move: MoveView{Shard: mv.Shard, From: mv.From, To: mv.To, Phase: mv.Phase}, Revision: m.Rev})
}
