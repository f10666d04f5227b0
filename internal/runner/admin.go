package runner

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/httpauth"
	"github.com/shardrun/shardrun/internal/httpjson"
	"github.com/shardrun/shardrun/internal/jsonbody"
	"github.com/shardrun/shardrun/internal/placement"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/tasks"
)

// maxAdminBody bounds admin request bodies.
const maxAdminBody = 16 << 10

// Status is the JSON of GET /status.
type Status struct {
	RunnerID string `json:"runner_id"`
	Version  string `json:"version"`
	// State is attached, detached or draining.
	State         string     `json:"state"`
	DetachReason  string     `json:"detach_reason,omitempty"`
	DetachKind    string     `json:"detach_kind,omitempty"`
	DetachedSince *time.Time `json:"detached_since,omitempty"`
	// HealthySince is when the current recovery window started.
	HealthySince *time.Time `json:"healthy_since,omitempty"`
	// Sticky is true while a manual detach waits for POST /admin/attach.
	Sticky bool `json:"sticky,omitempty"`
	// LeaseTimeLeft is how long until the earliest possible expiry of the
	// lease, from keep-alive send times.
	LeaseTimeLeft float64             `json:"lease_time_left_seconds"`
	LeaseID       string              `json:"lease_id"`
	Assigned      []int               `json:"assigned"`
	Owned         []claims.ShardEpoch `json:"owned"`
	Releasing     []int               `json:"releasing,omitempty"`
	InFlight      int                 `json:"in_flight"`
	Kinds         []string            `json:"kinds"`
	// Stuck lists handlers that ignored their cancellation for longer
	// than the handoff timeout.
	Stuck []executor.Stuck `json:"stuck"`
	// Stalled says why the claim loop is not making progress, if it is not.
	Stalled string `json:"stalled,omitempty"`
	// Conflict names the key another live process holds under this
	// runner's id: the runner stands down, doing no work, until it leaves.
	Conflict string `json:"runner_id_conflict,omitempty"`
	// Databases are the cluster's databases in the map's order, each with
	// the shards the map places in it and its health as this runner last
	// probed it: the shards of one that is unavailable wait, the others'
	// work goes on.
	Databases []DatabaseStatus `json:"databases"`
}

// DatabaseStatus is one database in GET /status.
type DatabaseStatus struct {
	placement.DatabaseHealth
	// Shards are the shards the map places in it, as ranges ("0-31").
	Shards string `json:"shards"`
}

// Status returns what GET /status serves.
func (r *Runner) Status() Status {
	ms := r.mgr.Status()
	ds := r.machine.Status()
	st := Status{
		RunnerID: r.cfg.RunnerID, Version: r.cfg.Version, State: ms.State,
		Sticky: ds.Sticky, LeaseTimeLeft: ms.LeaseTimeLeft.Seconds(), LeaseID: fmt.Sprintf("%x", ms.LeaseID),
		Assigned: nonNil(ms.Assigned), Owned: ms.Owned, Releasing: ms.Releasing,
		InFlight: r.exec.InFlight(), Kinds: r.handlers.Kinds(), Stuck: r.exec.Stuck(), Conflict: ms.Conflict,
	}
	if st.Stuck == nil {
		st.Stuck = []executor.Stuck{}
	}
	if stalled, why := r.exec.Stalled(); stalled {
		st.Stalled = why
	}
	if st.Owned == nil {
		st.Owned = []claims.ShardEpoch{}
	}
	m := r.router.Map()
	for _, h := range r.health.All() {
		st.Databases = append(st.Databases, DatabaseStatus{DatabaseHealth: h, Shards: m.Ranges(h.Name)})
	}
	if ds.Detached {
		st.DetachReason, st.DetachKind = ds.Reason.String(), ds.Reason.Kind.String()
		since := ds.Since
		st.DetachedSince = &since
		if !ds.HealthySince.IsZero() {
			h := ds.HealthySince
			st.HealthySince = &h
		}
	}
	return st
}

func nonNil(s []int) []int {
	if s == nil {
		return []int{}
	}
	return s
}

func (r *Runner) adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		st := r.Status()
		if st.State != shard.StateAttached {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": st.State, "reason": st.DetachReason})
			return
		}
		if st.Stalled != "" {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "stalled", "reason": st.Stalled})
			return
		}
		// Ready while one of its databases serves: the shards of one that
		// is down wait, and restarting the runner would not bring it back.
		var down []string
		for _, d := range st.Databases {
			if d.Health == placement.HealthUnavailable {
				down = append(down, d.Name)
			}
		}
		if len(down) > 0 && len(down) == len(st.Databases) {
			writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "databases unavailable", "databases_down": down})
			return
		}
		body := map[string]any{"status": "ready"}
		if len(down) > 0 {
			body["databases_down"] = down
		}
		writeJSON(w, http.StatusOK, body)
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, r.Status())
	})
	mux.HandleFunc("POST /admin/detach", r.authorized(r.handleDetach))
	mux.HandleFunc("POST /admin/attach", r.authorized(r.handleAttach))
	mux.Handle("GET /metrics", promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{}))
	return httpjson.Errors(mux)
}

// authorized requires the admin token (internal/httpauth: "Authorization:
// Bearer <token>", scheme in any case, compared in constant time) when one
// is configured; it must be when the endpoint is not on loopback.
func (r *Runner) authorized(next http.HandlerFunc) http.HandlerFunc {
	return httpauth.Require(r.cfg.AdminToken, "shardrun-admin", next)
}

// MaxDetachReason bounds the reason of POST /admin/detach, which is logged
// and published in the runner's etcd key.
const MaxDetachReason = 1024

// detachRequest is the decoded body of POST /admin/detach; Reason is ""
// when left out.
type detachRequest struct {
	Reason string
}

// decodeDetach decodes the optional body of POST /admin/detach. Errors are
// the client's: a *jsonbody.Error or a *tasks.FieldError.
func decodeDetach(body []byte) (detachRequest, error) {
	var d detachRequest
	if jsonbody.IsEmpty(body) {
		return d, nil
	}
	// Given, the reason is not empty: "" would read as left out.
	var given struct {
		Reason *string `json:"reason"`
	}
	if err := jsonbody.Decode(body, &given); err != nil {
		return d, err
	}
	var err error
	if d.Reason, err = tasks.GivenText("reason", given.Reason, "the default reason"); err != nil {
		return d, err
	}
	switch {
	case len(d.Reason) > MaxDetachReason:
		return d, &tasks.FieldError{Field: "reason", Problem: fmt.Sprintf("longer than %d bytes", MaxDetachReason)}
	case strings.IndexFunc(d.Reason, unicode.IsControl) >= 0:
		// It goes into log lines: no forged lines.
		return d, &tasks.FieldError{Field: "reason", Problem: "must not contain control characters"}
	}
	return d, nil
}

// decodeAttach decodes the optional body of POST /admin/attach: nothing,
// or an empty object.
func decodeAttach(body []byte) error {
	if jsonbody.IsEmpty(body) {
		return nil
	}
	return jsonbody.Decode(body, &struct{}{})
}

func badAdminBody(w http.ResponseWriter, err error) {
	e := map[string]string{"error": err.Error()}
	var je *jsonbody.Error
	var fe *tasks.FieldError
	switch {
	case errors.As(err, &je):
		e["error"] = "malformed JSON body: " + je.Error()
		if f := je.Field(); f != "" {
			e["field"] = f
		}
	case errors.As(err, &fe):
		e["field"] = fe.Field
	}
	writeJSON(w, http.StatusBadRequest, e)
}

func (r *Runner) handleDetach(w http.ResponseWriter, req *http.Request) {
	raw, ok := httpjson.ReadBody(w, req, maxAdminBody)
	if !ok {
		return
	}
	body, err := decodeDetach(raw)
	if err != nil {
		badAdminBody(w, err)
		return
	}
	reason := body.Reason
	if reason == "" {
		reason = "requested through the admin endpoint"
	}
	r.log.Warn("manual detach requested", "reason", reason, "remote", req.RemoteAddr)
	r.machine.Detach(detach.Reason{Kind: detach.Manual, Detail: reason})
	writeJSON(w, http.StatusOK, r.Status())
}

func (r *Runner) handleAttach(w http.ResponseWriter, req *http.Request) {
	raw, ok := httpjson.ReadBody(w, req, maxAdminBody)
	if !ok {
		return
	}
	if err := decodeAttach(raw); err != nil {
		badAdminBody(w, err)
		return
	}
	r.log.Info("attach requested", "remote", req.RemoteAddr, "recovery_window", r.cfg.RecoveryWindow)
	r.machine.Attach()
	writeJSON(w, http.StatusOK, r.Status())
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
