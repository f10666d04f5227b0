package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"github.com/shardrun/shardrun/internal/httpjson"
	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Limits of the schedules API.
const (
	maxScheduleBody = 1<<20 + 4096
	// MaxSchedulesListed bounds the cluster view's schedules (the first by
	// name); GET /api/schedules pages.
	MaxSchedulesListed = tasks.MaxListLimit
)

// ScheduleRequest is the body of POST /api/schedules and PUT
// /api/schedules/{name}. Each tick's task takes a task's options
// (tasks.Options, in the same JSON as a task's body, with the same rule:
// one given empty, zero or null is refused), but for run_after, deadline
// and unique_key (each tick's task runs at its tick and is its own). The
// timing's optional fields are pointers, nil only when left out.
type ScheduleRequest struct {
	Name    string          `json:"name"`
	Kind    string          `json:"kind"`
	Payload json.RawMessage `json:"payload,omitempty"`
	tasks.Options
	// SkipWhileUnfinished skips a tick while the task of the last tick
	// enqueued is unfinished (schedule.Definition).
	SkipWhileUnfinished bool `json:"skip_while_unfinished,omitempty"`
	// Every is a Go duration ("90s", "5m", "1h"); or Cron with Timezone.
	Every    *string    `json:"every,omitempty"`
	Start    *time.Time `json:"start,omitempty"`
	Cron     *string    `json:"cron,omitempty"`
	Timezone *string    `json:"timezone,omitempty"`
}

// decodeSchedule reads the body of POST /api/schedules or PUT
// /api/schedules/{name} (name: the path's, "" for POST) as a definition,
// answering 400 naming the field when it is not one.
func decodeSchedule(w http.ResponseWriter, r *http.Request, name string) (schedule.Definition, bool) {
	body, ok := httpjson.ReadBody(w, r, maxScheduleBody)
	if !ok {
		return schedule.Definition{}, false
	}
	var req ScheduleRequest
	err := jsonbody.Decode(body, &req)
	if err == nil {
		err = req.CheckGiven(jsonbody.Given(body)[0])
	}
	if err == nil && name != "" {
		if req.Name != "" && req.Name != name {
			err = &tasks.FieldError{Field: "name", Problem: fmt.Sprintf("%q differs from the path's %q", req.Name, name)}
		}
		req.Name = name
	}
	var d schedule.Definition
	if err == nil {
		d, err = req.definition()
	}
	if err != nil {
		badRequest(w, err, false, -1)
		return d, false
	}
	return d, true
}

// definition turns the request into a schedule.Definition, refusing a
// timing field given with the value that means "not set" there.
func (req ScheduleRequest) definition() (schedule.Definition, error) {
	d := schedule.Definition{Name: req.Name, SkipWhileUnfinished: req.SkipWhileUnfinished,
		Task: tasks.NewTask{Kind: req.Kind, Payload: req.Payload, Options: req.Options}}
	var every string
	var err error
	for _, f := range []struct {
		name  string
		p     *string
		to    *string
		unset string
	}{
		{"every", req.Every, &every, "a cron schedule"},
		{"cron", req.Cron, &d.Cron, "an interval schedule"},
		{"timezone", req.Timezone, &d.Timezone, "UTC"},
	} {
		if *f.to, err = tasks.GivenText(f.name, f.p, f.unset); err != nil {
			return d, err
		}
	}
	if every != "" {
		if d.Every, err = time.ParseDuration(every); err != nil {
			return d, &tasks.FieldError{Field: "every", Problem: fmt.Sprintf("%q is not a duration such as 90s, 5m or 1h", every)}
		}
		if d.Every == 0 {
			return d, &tasks.FieldError{Field: "every", Problem: "must be at least 1s"}
		}
	}
	if req.Start != nil && d.Cron != "" {
		return d, &tasks.FieldError{Field: "start", Problem: "only an interval schedule (every) has a start"}
	}
	d.Start, err = tasks.GivenTime("start", req.Start, "one interval after the definition")
	return d, err
}

// ScheduleSummary is a schedule in GET /api/cluster (no payload).
type ScheduleSummary struct {
	Name       string     `json:"name"`
	Kind       string     `json:"kind"`
	Queue      string     `json:"queue"`
	Every      string     `json:"every,omitempty"`
	Cron       string     `json:"cron,omitempty"`
	Timezone   string     `json:"timezone"`
	NextRun    time.Time  `json:"next_run"`
	LastRun    *time.Time `json:"last_run,omitempty"`
	LastTaskID *int64     `json:"last_task_id,omitempty"`
	// Skipped counts the ticks not enqueued: missed while no leader ran,
	// or skipped while the last tick's task was unfinished.
	Skipped int64 `json:"skipped"`
}

// ScheduleView is a schedule in the schedules API.
type ScheduleView struct {
	ID int64 `json:"id"`
	ScheduleSummary
	Key              string          `json:"key,omitempty"`
	Payload          json.RawMessage `json:"payload"`
	MaxAttempts      int             `json:"max_attempts,omitempty"`
	Priority         int             `json:"priority"`
	SequenceKey      string          `json:"sequence_key,omitempty"`
	SequenceContinue bool            `json:"sequence_continue,omitempty"`
	// SkipWhileUnfinished: ticks are skipped while the last tick's task is
	// unfinished.
	SkipWhileUnfinished bool       `json:"skip_while_unfinished,omitempty"`
	Start               *time.Time `json:"start,omitempty"`
	CreatedAt           time.Time  `json:"created_at"`
}

// ScheduleCreated is the answer of POST /api/schedules and PUT
// /api/schedules/{name}: the schedule, and warnings when no attached
// runner can run its tasks. Changed (PUT only) says whether the stored
// schedule changed.
type ScheduleCreated struct {
	ScheduleView
	Changed  *bool    `json:"changed,omitempty"`
	Warnings []string `json:"warnings,omitempty"`
}

// SchedulePage is the answer of GET /api/schedules: one page by name, and
// the cursor of the next ("next", absent at the end).
type SchedulePage struct {
	Schedules []ScheduleView `json:"schedules"`
	Next      string         `json:"next,omitempty"`
}

func summarize(sc store.Schedule) ScheduleSummary {
	s := ScheduleSummary{Name: sc.Name, Kind: sc.Task.Kind, Queue: sc.Task.Queue, Cron: sc.Cron, Timezone: sc.Timezone,
		NextRun: sc.NextTick.UTC(), LastRun: sc.LastTick, LastTaskID: sc.LastTaskID, Skipped: sc.Skipped}
	if sc.Every > 0 {
		s.Every = sc.Every.String()
	}
	return s
}

func viewOf(sc store.Schedule) ScheduleView {
	t := sc.Task
	v := ScheduleView{ID: sc.ID, ScheduleSummary: summarize(sc), Key: t.Key, Payload: t.Payload,
		MaxAttempts: t.MaxAttempts, Priority: t.Priority, SequenceKey: t.SequenceKey, SequenceContinue: t.SequenceContinue,
		SkipWhileUnfinished: sc.SkipWhileUnfinished, CreatedAt: sc.CreatedAt.UTC()}
	if sc.Every > 0 {
		start := sc.Start.UTC()
		v.Start = &start
	}
	return v
}

// Schedules returns the schedules (the Go API of /api/schedules).
func (c *Coordinator) Schedules() *schedule.Catalog { return c.schedules }

func (c *Coordinator) handleCreateSchedule(w http.ResponseWriter, r *http.Request) {
	d, ok := decodeSchedule(w, r, "")
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	sc, err := c.schedules.Create(ctx, d)
	if errors.Is(err, store.ErrScheduleExists) {
		writeJSON(w, http.StatusConflict, apiError{Error: fmt.Sprintf("a schedule named %q exists; delete it first to redefine it", d.Name), Field: "name"})
		return
	}
	if c.failed(w, r, "creating a schedule", err) {
		return
	}
	c.scheduler.Notify()
	writeJSON(w, http.StatusCreated, ScheduleCreated{ScheduleView: viewOf(sc),
		Warnings: c.unrunnableWarnings(ctx, sc.Task.Class())})
}

// handlePutSchedule is PUT /api/schedules/{name}: define the schedule
// whether or not it exists (schedule.Catalog.Upsert), with the body of POST
// /api/schedules (its name, if given, must be the path's). 201 when it was
// created, 200 otherwise, with "changed".
func (c *Coordinator) handlePutSchedule(w http.ResponseWriter, r *http.Request) {
	d, ok := decodeSchedule(w, r, r.PathValue("name"))
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	sc, what, err := c.schedules.Upsert(ctx, d)
	if c.failed(w, r, "defining a schedule", err) {
		return
	}
	changed := what != store.ScheduleUnchanged
	if changed {
		c.scheduler.Notify()
	}
	code := http.StatusOK
	if what == store.ScheduleCreated {
		code = http.StatusCreated
	}
	writeJSON(w, code, ScheduleCreated{ScheduleView: viewOf(sc), Changed: &changed,
		Warnings: c.unrunnableWarnings(ctx, sc.Task.Class())})
}

// scheduleParams are the parameters of GET /api/schedules.
var scheduleParams = []string{"limit", "after"}

// parseScheduleQuery reads the page GET /api/schedules asks for, checked
// as the catalog checks it (schedule.ListRequest.Check).
func parseScheduleQuery(q url.Values) (schedule.ListRequest, error) {
	var req schedule.ListRequest
	var err error
	if req.Limit, err = parseLimit(q); err != nil {
		return req, err
	}
	req.After = q.Get("after")
	return req, req.Check()
}

// handleListSchedules is GET /api/schedules: one page by name, with limit
// and after (the cursor) checked like the task listing's.
func (c *Coordinator) handleListSchedules(w http.ResponseWriter, r *http.Request) {
	answerQuery(c, w, r, "listing schedules", scheduleParams, parseScheduleQuery, func(ctx context.Context, req schedule.ListRequest) (any, error) {
		page, err := c.schedules.List(ctx, req)
		if err != nil {
			return nil, err
		}
		resp := SchedulePage{Schedules: make([]ScheduleView, len(page.Schedules)), Next: page.Next}
		for i, sc := range page.Schedules {
			resp.Schedules[i] = viewOf(sc)
		}
		return resp, nil
	})
}

func (c *Coordinator) handleDeleteSchedule(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if _, err := query(r, nil); err != nil {
		badRequest(w, err, false, -1)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	ok, err := c.schedules.Delete(ctx, name)
	switch {
	case err != nil:
		c.failed(w, r, "deleting a schedule", err)
	case !ok:
		writeJSON(w, http.StatusNotFound, apiError{Error: fmt.Sprintf("no schedule named %q", name)})
	default:
		writeJSON(w, http.StatusOK, map[string]any{"deleted": name})
	}
}
