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
	counter := func(name, help string) prometheus.Counter {
		return f.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	gauge := func(name, help string) prometheus.Gauge {
		return f.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	}
	return &Metrics{
		Detached:          gauge("shardrun_detached", "1 while the runner is detached from the cluster and runs no shard work."),
		KeepaliveFailures: counter("shardrun_lease_keepalive_failures_total", "Lease keep-alive attempts that failed or got no answer in time (each is retried at once)."),
		KeepaliveStreak:   gauge("shardrun_lease_keepalive_failure_streak", "Whole periods of TTL/3 since the newest successful keep-alive was sent."),
		LeaseDeadline:     gauge("shardrun_lease_deadline_seconds", "Seconds until the earliest time etcd may expire the runner's lease (from keep-alive send times)."),
		ShardsOwned:       gauge("shardrun_shards_owned", "Shards this runner owns and may work on."),
		ShardsAssigned:    gauge("shardrun_shards_assigned", "Shards the assignment gives this runner; alert when it differs from shards_owned for long."),
		Acquisitions:      counter("shardrun_shard_acquisitions_total", "Shards acquired (added to the runner's owner key)."),
		Releases:          counter("shardrun_shard_releases_total", "Shards released (dropped from the runner's owner key) after their work stopped."),
		AcquireRetries:    counter("shardrun_acquire_retry_attempts_total", "Retries to acquire an assigned shard that was still held elsewhere."),
		EtcdErrors:        counter("shardrun_etcd_errors_total", "Failed etcd calls to acquire, release or publish (retried; the lease clock decides detaching)."),
	}
}
