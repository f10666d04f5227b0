package executor

import (
	"context"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/tasks"
)

// heartbeater is the heartbeat loop: every interval it records, in one
// statement, that all running attempts are alive. An attempt whose fence
// moved loses its shard; an attempt a sweep took back is cancelled; an
// attempt whose task an operator cancelled is cancelled with cause
// tasks.ErrCancelled, so its outcome is recorded as cancelled unless its
// handler returns success. The tasks waiting ahead are beaten too.
//
// A claim another transaction holds (a handler's, after CompleteTx) is
// skipped by the statement and answered claims.Busy: it is neither beaten
// nor taken back, and the others are beaten as usual. The sweeps skip it
// while it is held; once the transaction ends, a sweep may find it stale
// (its heartbeat was not refreshed), and then completes it with the
// handler's mark, or requeues it when the transaction rolled back.
type heartbeater struct {
	store    Store
	owner    string
	own      Ownership
	pool     *pool
	ahead    *ahead
	interval time.Duration
	clock    clock.Clock
	log      hclog.Logger
	m        *Metrics
}

// Run beats every interval until ctx ends.
func (h *heartbeater) Run(ctx context.Context) {
	t := h.clock.NewTimer(h.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		}
		t.Reset(h.interval)
		h.beat(ctx)
		for _, st := range h.pool.findStuck(h.clock.Now()) {
			h.log.Error("handler ignores its cancellation: still running", "task", st.TaskID, "kind", st.Kind,
				"shard", st.Shard, "cancelled_for", h.clock.Now().Sub(st.CancelledAt).Round(time.Millisecond))
		}
	}
}

// beat heartbeats the running attempts once. The statement's deadline is
// one interval: a beat that cannot land by then is superseded by the next.
func (h *heartbeater) beat(ctx context.Context) {
	cutoff := h.clock.Now().Add(-h.interval)
	running, waiting := h.pool.beatable(cutoff), h.ahead.beatable(cutoff)
	refs := make([]claims.Ref, 0, len(running)+len(waiting))
	for ref := range running {
		refs = append(refs, ref)
	}
	for ref := range waiting {
		refs = append(refs, ref)
	}
	if len(refs) == 0 {
		return
	}
	// The answer is about the attempts beaten: one given back and claimed
	// again under the same ref meanwhile is another, and is left alone.
	cancel := func(ref claims.Ref, cause error) bool {
		if found, cancelled := h.pool.cancelExact(ref, running[ref], cause); found {
			return cancelled
		}
		return h.ahead.cancelExact(ref, waiting[ref], cause)
	}
	cctx, stop := context.WithTimeout(ctx, h.interval)
	res, err := h.store.Heartbeat(cctx, h.owner, refs)
	stop()
	if err != nil {
		if ctx.Err() == nil {
			h.log.Warn("heartbeat failed", "tasks", len(refs), "error", err)
		}
		return
	}
	h.recordStarts(ctx)
	for _, r := range res {
		switch r.Outcome {
		case claims.Applied:
			if r.CancelRequested && cancel(r.Ref, tasks.ErrCancelled) {
				h.log.Info("cancelled a running task on request", "task", r.Ref.ID)
			}
		case claims.FenceLost:
			h.m.FenceRejections.Inc()
			h.own.FenceLost(r.Ref.Shard, r.Ref.Epoch)
		case claims.TaskMoved, claims.TaskGone:
			if cancel(r.Ref, errTakenBack) {
				h.log.Warn("running task was taken back (stale claim swept); cancelled it", "task", r.Ref.ID, "outcome", r.Outcome.String())
			}
		case claims.Busy:
			h.log.Debug("claim held by another transaction; not beaten this time", "task", r.Ref.ID, "attempt", r.Ref.Attempt)
		}
	}
}

// recordStarts records the start of the handlers started from the ahead
// buffer since the last beat (Store.Started), in one statement beside the
// beat: a start is recorded within a heartbeat interval, not by a write of
// its own on the hot path. Until then, a crash of the runner leaves that
// attempt unspent (the claim says its handler never started): it errs
// towards running a task once more, never towards burying it unrun.
func (h *heartbeater) recordStarts(ctx context.Context) {
	refs := h.pool.unrecorded()
	if len(refs) == 0 {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, h.interval)
	res, err := h.store.Started(cctx, h.owner, refs)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			h.log.Debug("recording starts failed; the next beat tries again", "tasks", len(refs), "error", err)
		}
		return
	}
	var done []claims.Ref
	for _, r := range res {
		if r.Outcome != claims.Busy {
			done = append(done, r.Ref)
		}
	}
	h.pool.recorded(done)
}
