package shard

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// Metrics are the runner's membership and ownership metrics.
type Metrics struct {
	Detached          prometheus.Gauge
	KeepaliveFailures prometheus.Counter
	KeepaliveStreak   prometheus.Gauge
	LeaseDeadline     prometheus.Gauge
	ShardsOwned       prometheus.Gauge
	ShardsAssigned    prometheus.Gauge
	Acquisitions      prometheus.Counter
	Releases          prometheus.Counter
	AcquireRetries    prometheus.Counter
	EtcdErrors        prometheus.Counter
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered, for tests that run many members in one process).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	f := promauto.With(reg) // With(nil) creates them without registering
	return &Metrics{
		Detached: f.NewGauge(prometheus.GaugeOpts{Name: "shardrun_detached",
			Help: "1 while the runner is detached from the cluster and runs no shard work."}),
		KeepaliveFailures: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_lease_keepalive_failures_total",
			Help: "Lease keep-alive attempts that failed or got no answer in time (each is retried at once)."}),
		KeepaliveStreak: f.NewGauge(prometheus.GaugeOpts{Name: "shardrun_lease_keepalive_failure_streak",
			Help: "Whole periods of TTL/3 since the newest successful keep-alive was sent."}),
		LeaseDeadline: f.NewGauge(prometheus.GaugeOpts{Name: "shardrun_lease_deadline_seconds",
			Help: "Seconds until the earliest time etcd may expire the runner's lease (from keep-alive send times)."}),
		ShardsOwned: f.NewGauge(prometheus.GaugeOpts{Name: "shardrun_shards_owned",
			Help: "Shards this runner owns and may work on."}),
		ShardsAssigned: f.NewGauge(prometheus.GaugeOpts{Name: "shardrun_shards_assigned",
			Help: "Shards the assignment gives this runner; alert when it differs from shards_owned for long."}),
		Acquisitions: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_shard_acquisitions_total",
			Help: "Shard keys acquired."}),
		Releases: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_shard_releases_total",
			Help: "Shard keys released after their work stopped."}),
		AcquireRetries: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_acquire_retry_attempts_total",
			Help: "Retries to acquire an assigned shard that was still held elsewhere."}),
		EtcdErrors: f.NewCounter(prometheus.CounterOpts{Name: "shardrun_etcd_errors_total",
			Help: "Failed etcd calls to acquire, release or publish (retried; the lease clock decides detaching)."}),
	}
}
