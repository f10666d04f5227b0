package executor

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// Metrics are the executor's metrics.
type Metrics struct {
	Claimed, FenceRejections, StuckTotal, WriteRefused prometheus.Counter
	InFlight, Stuck                                    prometheus.Gauge
	Finished                                           *prometheus.CounterVec
	Duration                                           prometheus.Histogram
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	f := promauto.With(reg) // With(nil) creates them without registering
	return &Metrics{
		Claimed: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_tasks_claimed_total",
			Help: "Tasks claimed by this runner."}),
		Finished: f.NewCounterVec(prometheus.CounterOpts{Name: "shardrun_tasks_finished_total",
			Help: "Attempts whose outcome was recorded, by kind and outcome (completed, retried, dead, failed, interrupted, cancelled)."}, []string{"kind", "outcome"}),
		Duration: f.NewHistogram(prometheus.HistogramOpts{Name: "shardrun_task_duration_seconds",
			Help: "Handler run time of recorded attempts.", Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10)}),
		InFlight: f.NewGauge(prometheus.GaugeOpts{Name: "shardrun_tasks_in_flight",
			Help: "Tasks running now."}),
		FenceRejections: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_fence_rejections_total",
			Help: "Writes refused because the shard's fence had moved to a newer owner."}),
		Stuck: f.NewGauge(prometheus.GaugeOpts{Name: "shardrun_handlers_stuck",
			Help: "Handlers still running longer than the handoff timeout after their context ended."}),
		StuckTotal: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_handlers_stuck_total",
			Help: "Handlers that ignored their cancellation for longer than the handoff timeout."}),
		WriteRefused: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_outcome_writes_refused_total",
			Help: "Writes about a claim (outcomes, give-backs, starts) the database refused to store (not for being unavailable); the stale sweep takes the claim back."}),
	}
}
