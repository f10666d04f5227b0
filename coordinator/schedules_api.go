package coordinator

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/shardrun/shardrun/schedule"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Limits of the schedules API.
const (
	maxScheduleBody = 1<<20 + 4096
	// MaxSchedulesListed bounds GET /api/schedules and the cluster view.
	MaxSchedulesListed = 1000
)

// ScheduleRequest is the body of POST /api/schedules.
type ScheduleRequest struct {
	Name        string          `json:"name"`
	Kind        string          `json:"kind"`
	Key         string          `json:"key,omitempty"`
	Payload     json.RawMessage `json:"payload,omitempty"`
	MaxAttempts int             `json:"max_attempts,omitempty"`
	// Every is a Go duration ("90s", "5m", "1h"); or Cron with Timezone.
	Every    string     `json:"every,omitempty"`
	Start    *time.Time `json:"start,omitempty"`
	Cron     string     `json:"cron,omitempty"`
	Timezone string     `json:"timezone,omitempty"`
}

// ScheduleSummary is a schedule in GET /api/cluster (no payload).
type ScheduleSummary struct {
	Name       string     `json:"name"`
	Kind       string     `json:"kind"`
	Every      string     `json:"every,omitempty"`
	Cron       string     `json:"cron,omitempty"`
	Timezone   string     `json:"timezone"`
	NextRun    time.Time  `json:"next_run"`
	LastRun    *time.Time `json:"last_run,omitempty"`
	LastTaskID *int64     `json:"last_task_id,omitempty"`
	// Skipped counts ticks missed while no leader ran and not enqueued.
	Skipped int64 `json:"skipped"`
}

// ScheduleView is a schedule in the schedules API.
type ScheduleView struct {
	ID int64 `json:"id"`
	ScheduleSummary
	Key         string          `json:"key,omitempty"`
	Payload     json.RawMessage `json:"payload"`
	MaxAttempts int             `json:"max_attempts,omitempty"`
	Start       *time.Time      `json:"start,omitempty"`
	CreatedAt   time.Time       `json:"created_at"`
}

func summarize(sc store.Schedule) ScheduleSummary {
	s := ScheduleSummary{Name: sc.Name, Kind: sc.Kind, Cron: sc.Cron, Timezone: sc.Timezone,
		NextRun: sc.NextTick.UTC(), LastRun: sc.LastTick, LastTaskID: sc.LastTaskID, Skipped: sc.Skipped}
	if sc.Every > 0 {
		s.Every = sc.Every.String()
	}
	return s
}

func viewOf(sc store.Schedule) ScheduleView {
	v := ScheduleView{ID: sc.ID, ScheduleSummary: summarize(sc), Key: sc.Key, Payload: sc.Payload,
		MaxAttempts: sc.MaxAttempts, CreatedAt: sc.CreatedAt.UTC()}
	if sc.Every > 0 {
		start := sc.Start.UTC()
		v.Start = &start
	}
	return v
}

// Schedules returns the schedules client (the Go API of /api/schedules).
func (c *Coordinator) Schedules() *schedule.Client { return c.schedules }

// authorized checks the bearer token when one is configured, answering
// 401 itself when it is missing or wrong.
func (c *Coordinator) authorized(w http.ResponseWriter, r *http.Request) bool {
	if c.cfg.APIToken == "" {
		return true
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if ok && subtle.ConstantTimeCompare([]byte(got), []byte(c.cfg.APIToken)) == 1 {
		return true
	}
	w.Header().Set("WWW-Authenticate", `Bearer realm="shardrun-api"`)
	writeJSON(w, http.StatusUnauthorized, apiError{Error: "missing or wrong bearer token"})
	return false
}

func (c *Coordinator) handleCreateSchedule(w http.ResponseWriter, r *http.Request) {
	if !c.authorized(w, r) {
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxScheduleBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeJSON(w, http.StatusRequestEntityTooLarge, apiError{Error: fmt.Sprintf("request body larger than %d bytes", tooBig.Limit)})
			return
		}
		writeJSON(w, http.StatusBadRequest, apiError{Error: "reading request body: " + err.Error()})
		return
	}
	var req ScheduleRequest
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	if err = dec.Decode(&req); err == nil && dec.More() {
		err = errors.New("unexpected data after the JSON value")
	}
	if err != nil {
		writeJSON(w, http.StatusBadRequest, apiError{Error: "malformed JSON: " + err.Error()})
		return
	}
	d := schedule.Definition{Name: req.Name, Kind: req.Kind, Key: req.Key, Payload: req.Payload,
		MaxAttempts: req.MaxAttempts, Cron: req.Cron, Timezone: req.Timezone}
	if req.Every != "" {
		d.Every, err = time.ParseDuration(req.Every)
		if err != nil {
			writeJSON(w, http.StatusBadRequest, apiError{Error: fmt.Sprintf("invalid every: %q is not a duration such as 90s, 5m or 1h", req.Every), Field: "every"})
			return
		}
		if d.Every == 0 {
			writeJSON(w, http.StatusBadRequest, apiError{Error: "invalid every: must be at least 1s", Field: "every"})
			return
		}
	}
	if req.Start != nil {
		if req.Cron != "" {
			writeJSON(w, http.StatusBadRequest, apiError{Error: "invalid start: only an interval schedule (every) has a start", Field: "start"})
			return
		}
		d.Start = *req.Start
	}
	if req.MaxAttempts < 0 {
		writeJSON(w, http.StatusBadRequest, apiError{Error: fmt.Sprintf("invalid max_attempts: must be at least 1, got %d", req.MaxAttempts), Field: "max_attempts"})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	sc, err := c.schedules.Create(ctx, d)
	var fe *tasks.FieldError
	switch {
	case errors.As(err, &fe):
		writeJSON(w, http.StatusBadRequest, apiError{Error: err.Error(), Field: fe.Field})
		return
	case errors.Is(err, store.ErrScheduleExists):
		writeJSON(w, http.StatusConflict, apiError{Error: fmt.Sprintf("a schedule named %q exists; delete it first to redefine it", req.Name), Field: "name"})
		return
	case err != nil:
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: err.Error()})
		return
	}
	c.schedWake.Notify()
	resp := map[string]any{"schedule": viewOf(sc)}
	c.warnUnhandled(ctx, resp, []tasks.Insert{{Kind: sc.Kind}})
	writeJSON(w, http.StatusCreated, resp)
}

func (c *Coordinator) handleListSchedules(w http.ResponseWriter, r *http.Request) {
	if !c.authorized(w, r) {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	list, err := c.schedules.List(ctx, MaxSchedulesListed)
	if err != nil {
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: err.Error()})
		return
	}
	views := make([]ScheduleView, len(list))
	for i, sc := range list {
		views[i] = viewOf(sc)
	}
	writeJSON(w, http.StatusOK, map[string]any{"schedules": views})
}

func (c *Coordinator) handleDeleteSchedule(w http.ResponseWriter, r *http.Request) {
	if !c.authorized(w, r) {
		return
	}
	name := r.PathValue("name")
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	ok, err := c.schedules.Delete(ctx, name)
	switch {
	case err != nil:
		writeJSON(w, http.StatusServiceUnavailable, apiError{Error: err.Error()})
	case !ok:
		writeJSON(w, http.StatusNotFound, apiError{Error: fmt.Sprintf("no schedule named %q", name)})
	default:
		writeJSON(w, http.StatusOK, map[string]any{"deleted": name})
	}
}
