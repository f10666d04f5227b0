package runner

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/executor"
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
	LeaseTimeLeft float64            `json:"lease_time_left_seconds"`
	LeaseID       string             `json:"lease_id"`
	Assigned      []int              `json:"assigned"`
	Owned         []tasks.ShardEpoch `json:"owned"`
	Releasing     []int              `json:"releasing,omitempty"`
	InFlight      int                `json:"in_flight"`
	Kinds         []string           `json:"kinds"`
	// Stuck lists handlers that ignored their cancellation for longer
	// than the handoff timeout.
	Stuck []executor.Stuck `json:"stuck"`
	// Stalled says why the claim loop is not making progress, if it is not.
	Stalled string `json:"stalled,omitempty"`
}

// Status returns what GET /status serves.
func (r *Runner) Status() Status {
	ms := r.mgr.Status()
	ds := r.machine.Status()
	st := Status{
		RunnerID: r.cfg.RunnerID, Version: r.cfg.Version, State: ms.State,
		Sticky: ds.Sticky, LeaseTimeLeft: ms.LeaseTimeLeft.Seconds(), LeaseID: fmt.Sprintf("%x", ms.LeaseID),
		Assigned: nonNil(ms.Assigned), Owned: ms.Owned, Releasing: ms.Releasing,
		InFlight: r.exec.InFlight(), Kinds: r.handlers.Kinds(), Stuck: r.exec.Stuck(),
	}
	if st.Stuck == nil {
		st.Stuck = []executor.Stuck{}
	}
	if stalled, why := r.exec.Stalled(); stalled {
		st.Stalled = why
	}
	if st.Owned == nil {
		st.Owned = []tasks.ShardEpoch{}
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
		writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, r.Status())
	})
	mux.HandleFunc("POST /admin/detach", r.authorized(r.handleDetach))
	mux.HandleFunc("POST /admin/attach", r.authorized(r.handleAttach))
	mux.Handle("GET /metrics", promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{}))
	return mux
}

// authorized requires "Authorization: Bearer <token>" when a token is
// configured (it must be when the endpoint is not on loopback), compared in
// constant time.
func (r *Runner) authorized(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		if r.cfg.AdminToken != "" {
			got, ok := strings.CutPrefix(req.Header.Get("Authorization"), "Bearer ")
			if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(r.cfg.AdminToken)) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="shardrun-admin"`)
				writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "missing or wrong bearer token"})
				return
			}
		}
		req.Body = http.MaxBytesReader(w, req.Body, maxAdminBody)
		next(w, req)
	}
}

type detachRequest struct {
	Reason string `json:"reason"`
}

func (r *Runner) handleDetach(w http.ResponseWriter, req *http.Request) {
	var body detachRequest
	if err := decodeOptional(req, &body); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
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
	if err := decodeOptional(req, &struct{}{}); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return
	}
	r.log.Info("attach requested", "remote", req.RemoteAddr, "recovery_window", r.cfg.RecoveryWindow)
	r.machine.Attach()
	writeJSON(w, http.StatusOK, r.Status())
}

// decodeOptional decodes a JSON body if there is one.
func decodeOptional(req *http.Request, v any) error {
	b, err := io.ReadAll(req.Body)
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return fmt.Errorf("request body larger than %d bytes", tooBig.Limit)
		}
		return fmt.Errorf("reading request body: %w", err)
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("malformed JSON body: %w", err)
	}
	return nil
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
