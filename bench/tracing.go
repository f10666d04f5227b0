package main

import (
	"cmp"
	"context"
	"fmt"

	"github.com/hashicorp/go-hclog"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"

	"github.com/shardrun/shardrun/internal/tracing"
	"github.com/shardrun/shardrun/internal/tracing/tracingtest"
)

// The tracing section (issue 27): what OpenTelemetry traces cost a
// burn-down when they are on. Pairs of noop burn-downs, tracing off and
// on, alternating which runs first. On, the tasks are enqueued through a
// traced client (so each stores a trace context, as a traced producer's
// would) and the runners get OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, every
// other OTEL_* setting at the SDK's default (every span sampled, the batch
// processor's queue of 2,048 spans, batches of 512 every 5 s), and export
// to a receiver in the bench process that decodes each request, counts
// its spans and keeps nothing.

// tracingFlags are the section's flags.
var tracingFlags = struct{ procs int }{procs: 1}

// tracedTrial is what a traced trial needs: the producer's provider, and
// the runners' environment.
type tracedTrial struct {
	producer *tracing.Provider
	env      []string
}

// tracingCost is the section's result.
type tracingCost struct {
	What       string `json:"what"`
	Tasks      int    `json:"tasks"`
	Processes  int    `json:"processes"`
	MaxWorkers int    `json:"max_workers_per_process"`
	// OffTasksPerS and OnTasksPerS are each pair's throughputs; Ratios
	// each pair's on ÷ off.
	OffTasksPerS []float64 `json:"off_tasks_per_s"`
	OnTasksPerS  []float64 `json:"on_tasks_per_s"`
	Ratios       []float64 `json:"ratios_on_over_off"`
	MedianOff    float64   `json:"median_off_tasks_per_s"`
	MedianOn     float64   `json:"median_on_tasks_per_s"`
	MedianRatio  float64   `json:"median_ratio_on_over_off"`
	// CPU seconds per 10,000 tasks of the runners (median), off and on.
	CPUWorkersOff float64 `json:"cpu_s_per_10k_tasks_workers_off"`
	CPUWorkersOn  float64 `json:"cpu_s_per_10k_tasks_workers_on"`
	// SpansPerTask and BytesPerTask are what the receiver got per task of
	// the traced trials (producer and runners); fewer than the
	// spans made when the batch processor's queue overflowed and dropped
	// some.
	SpansPerTask   []float64  `json:"spans_received_per_task"`
	BytesPerTask   []float64  `json:"otlp_bytes_per_task"`
	ExportRequests []int      `json:"export_requests"`
	Trials         []burnDown `json:"trials"`
}

// tracingSection runs trials pairs of noop burn-downs of n tasks at
// tracingFlags.procs runner processes, tracing off and on.
func (e *env) tracingSection(ctx context.Context, rep *Report, trials, n int) error {
	procs := tracingFlags.procs
	tc := &tracingCost{Tasks: n, Processes: procs, MaxWorkers: cmp.Or(tuning.shardrunWorkers[procs], 512),
		What: fmt.Sprintf("noop burn-down of %d tasks at %d processes, tracing off against tracing on, %d pairs, the off trial first in the 1st, 3rd... pair; "+
			"on: the tasks enqueued by a traced client (an enqueue_batch span per %d tasks, whose trace every task joins), the runners with OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "+
			"and the SDK's defaults otherwise (all sampled; batch processor queue 2048), exporting to an OTLP/HTTP receiver in the bench process that counts and discards; "+
			"tasks/s from the first claim to the last completion", n, procs, trials, insertBatch)}
	rep.Tracing = tc
	rcv := tracingtest.Start(true)
	defer rcv.Close()
	producer, err := tracing.New(ctx, "bench-producer", otlptracehttp.WithEndpointURL(rcv.URL()))
	if err != nil {
		return err
	}
	defer producer.Close(hclog.NewNullLogger())
	traced := &tracedTrial{producer: producer, env: []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=" + rcv.URL()}}
	var cpuOff, cpuOn []float64
	for trial := range trials {
		off := trialOpts{label: "troff", trial: trial, processes: procs, n: n, maxWorkers: tc.MaxWorkers}
		on := off
		on.label, on.traced = "tron", traced
		var offRun, onRun burnDown
		arms := []struct {
			name string
			o    trialOpts
			into *burnDown
		}{{"tracing off", off, &offRun}, {"tracing on", on, &onRun}}
		if trial%2 == 1 {
			arms[0], arms[1] = arms[1], arms[0]
		}
		for _, a := range arms {
			reqs0, bytes0, spans0 := rcv.Received()
			var err error
			if *a.into, err = e.shardrunBurnDown(ctx, a.o); err != nil {
				return fmt.Errorf("%s: %w", a.name, err)
			}
			if a.o.traced == nil {
				continue
			}
			if err := producer.ForceFlush(ctx); err != nil {
				return fmt.Errorf("flushing the producer's spans: %w", err)
			}
			reqs, bytes, spans := rcv.Received()
			tc.ExportRequests = append(tc.ExportRequests, reqs-reqs0)
			tc.SpansPerTask = append(tc.SpansPerTask, float64(spans-spans0)/float64(n))
			tc.BytesPerTask = append(tc.BytesPerTask, float64(bytes-bytes0)/float64(n))
		}
		tc.OffTasksPerS, tc.OnTasksPerS = append(tc.OffTasksPerS, offRun.TasksPerS), append(tc.OnTasksPerS, onRun.TasksPerS)
		tc.Ratios = append(tc.Ratios, onRun.TasksPerS/offRun.TasksPerS)
		cpuOff, cpuOn = append(cpuOff, offRun.CPUWorkersPer10k), append(cpuOn, onRun.CPUWorkersPer10k)
		tc.Trials = append(tc.Trials, offRun, onRun)
		fmt.Fprintf(e.log, "  tracing, pair %d: off %.0f tasks/s, on %.0f tasks/s, ratio %.3f; %.2f spans and %.0f bytes exported per task\n",
			trial+1, offRun.TasksPerS, onRun.TasksPerS, onRun.TasksPerS/offRun.TasksPerS,
			tc.SpansPerTask[len(tc.SpansPerTask)-1], tc.BytesPerTask[len(tc.BytesPerTask)-1])
	}
	tc.MedianOff, tc.MedianOn, tc.MedianRatio = median(tc.OffTasksPerS), median(tc.OnTasksPerS), median(tc.Ratios)
	tc.CPUWorkersOff, tc.CPUWorkersOn = median(cpuOff), median(cpuOn)
	return nil
}
