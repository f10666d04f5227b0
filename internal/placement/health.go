package placement

import (
	"cmp"
	"context"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/store"
)

// Health of a database, as Health reports it.
const (
	// HealthOK: the database answered the last probe.
	HealthOK = "ok"
	// HealthUnavailable: it did not (no connection, a timeout, shutting
	// down): its shards wait, the other databases' work goes on.
	HealthUnavailable = "unavailable"
	// HealthUnknown: not probed yet.
	HealthUnknown = "unknown"
)

// DefaultHealthInterval is the time between two probes of a database.
const DefaultHealthInterval = 2 * time.Second

// DatabaseHealth is one database's health.
type DatabaseHealth struct {
	Name string `json:"name"`
	// Health is ok, unavailable or unknown.
	Health string `json:"health"`
	// Since is when the database entered its health (the first probe
	// that saw it so).
	Since *time.Time `json:"since,omitempty"`
	// Error is why the last probe failed: the driver's message, which
	// names the host and user but never a password.
	Error string `json:"error,omitempty"`
}

// Health probes each of a process's databases (a statement, bounded by
// its interval) and remembers what it saw: a runner's /status and
// /readyz and the coordinator's GET /api/databases read it without
// reaching the databases themselves.
type Health struct {
	Router   *store.Router
	Interval time.Duration
	Clock    clock.Clock
	Logger   hclog.Logger

	mu    sync.Mutex
	state map[string]DatabaseHealth
}

// Run probes until ctx ends.
func (h *Health) Run(ctx context.Context) {
	clk := cmp.Or(h.Clock, clock.Real())
	interval := cmp.Or(h.Interval, DefaultHealthInterval)
	log := cmp.Or(h.Logger, hclog.NewNullLogger())
	for {
		for _, name := range h.Router.Names() {
			h.probe(ctx, name, clk, interval, log)
		}
		if !clock.Sleep(clk, interval, ctx.Done()) {
			return
		}
	}
}

func (h *Health) probe(ctx context.Context, name string, clk clock.Clock, timeout time.Duration, log hclog.Logger) {
	st := h.Router.Store(name)
	if st == nil {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	err := st.Pool().Ping(pctx)
	cancel()
	if ctx.Err() != nil {
		return
	}
	now := clk.Now().UTC()
	next := DatabaseHealth{Name: name, Health: HealthOK}
	if err != nil {
		next.Health, next.Error = HealthUnavailable, err.Error()
	} else {
		// Before the health says so: once /api/databases or /readyz
		// shows the database available, statements are sent to it.
		h.Router.Reached(name)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.state == nil {
		h.state = map[string]DatabaseHealth{}
	}
	prev, seen := h.state[name]
	next.Since = &now
	if seen && prev.Health == next.Health {
		next.Since = prev.Since
	} else if seen || next.Health != HealthOK {
		switch next.Health {
		case HealthOK:
			log.Info("database available again", "database", name)
		default:
			log.Warn("database unavailable: its shards wait, the others' work goes on", "database", name, "error", err)
		}
	}
	h.state[name] = next
}

// Of is the health of the named database.
func (h *Health) Of(name string) DatabaseHealth {
	h.mu.Lock()
	defer h.mu.Unlock()
	if d, ok := h.state[name]; ok {
		return d
	}
	return DatabaseHealth{Name: name, Health: HealthUnknown}
}

// All is the health of every database, in the map's order.
func (h *Health) All() []DatabaseHealth {
	names := h.Router.Names()
	out := make([]DatabaseHealth, len(names))
	for i, name := range names {
		out[i] = h.Of(name)
	}
	return out
}
