package tasks

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the executor's metrics.
type Metrics struct {
	Claimed         prometheus.Counter
	Finished        *prometheus.CounterVec
	Duration        prometheus.Histogram
	InFlight        prometheus.Gauge
	FenceRejections prometheus.Counter
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Claimed: prometheus.NewCounter(prometheus.CounterOpts{Name: "shardrun_tasks_claimed_total",
			Help: "Tasks claimed by this runner."}),
		Finished: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shardrun_tasks_finished_total",
			Help: "Attempts whose outcome was recorded, by kind and outcome (completed, retried, dead)."}, []string{"kind", "outcome"}),
		Duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "shardrun_task_duration_seconds",
			Help: "Handler run time of recorded attempts.", Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10)}),
		InFlight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "shardrun_tasks_in_flight",
			Help: "Tasks running now."}),
		FenceRejections: prometheus.NewCounter(prometheus.CounterOpts{Name: "shardrun_fence_rejections_total",
			Help: "Writes refused because the shard's fence had moved to a newer owner."}),
	}
	if reg != nil {
		reg.MustRegister(m.Claimed, m.Finished, m.Duration, m.InFlight, m.FenceRejections)
	}
	return m
}
