package main

import (
	"cmp"
	"context"
	"fmt"
	"slices"

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

// bigQueue is the batch processor's queue of the "on, big queue" arm.
const bigQueue = 262_144

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
	// Arms are off, on (the SDK's defaults) and on with a big queue.
	Arms   []tracingArm `json:"arms"`
	Trials []burnDown   `json:"trials"`
}

// tracingArm is one arm's figures over the trials.
type tracingArm struct {
	Name      string    `json:"name"`
	Env       []string  `json:"runner_env,omitempty"`
	TasksPerS []float64 `json:"tasks_per_s"`
	// Ratios are each trial's tasks/s ÷ the off arm's of the same round.
	Ratios      []float64 `json:"ratios_over_off"`
	MedianTasks float64   `json:"median_tasks_per_s"`
	MedianRatio float64   `json:"median_ratio_over_off"`
	// CPUWorkers is the runners' CPU seconds per 10,000 tasks (median).
	CPUWorkers float64 `json:"cpu_s_per_10k_tasks_workers"`
	cpu        []float64
	// SpansPerTask and BytesPerTask are what the receiver got per task
	// (producer and runners); fewer spans than made when the batch
	// processor's queue overflowed and dropped some.
	SpansPerTask   []float64 `json:"spans_received_per_task,omitempty"`
	BytesPerTask   []float64 `json:"otlp_bytes_per_task,omitempty"`
	ExportRequests []int     `json:"export_requests,omitempty"`
}

// tracingSection runs trials rounds of three noop burn-downs of n tasks at
// tracingFlags.procs runner processes: tracing off, on, and on with a big
// queue.
func (e *env) tracingSection(ctx context.Context, rep *Report, trials, n int) error {
	procs := tracingFlags.procs
	tc := &tracingCost{Tasks: n, Processes: procs, MaxWorkers: cmp.Or(tuning.shardrunWorkers[procs], 512),
		What: fmt.Sprintf("noop burn-down of %d tasks at %d processes, tracing off, on, and on with a big queue; %d rounds of the three, rotating which runs first; "+
			"on: the tasks enqueued by a traced client (an enqueue_batch span per %d tasks, whose trace every task joins), the runners with OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "+
			"and the SDK's defaults otherwise (all sampled; batch processor queue 2048, which overflows and drops spans at these rates); on, big queue: also OTEL_BSP_MAX_QUEUE_SIZE=%d; "+
			"exporting to an OTLP/HTTP receiver in the bench process that counts and discards; tasks/s from the first claim to the last completion; ratios over the off trial of the same round",
			n, procs, trials, insertBatch, bigQueue)}
	rep.Tracing = tc
	rcv := tracingtest.Start(true)
	defer rcv.Close()
	producer, err := tracing.New(ctx, "bench-producer", otlptracehttp.WithEndpointURL(rcv.URL()))
	if err != nil {
		return err
	}
	defer producer.Close(hclog.NewNullLogger())
	traced := &tracedTrial{producer: producer, env: []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=" + rcv.URL()}}
	big := &tracedTrial{producer: producer, env: append(slices.Clone(traced.env), fmt.Sprintf("OTEL_BSP_MAX_QUEUE_SIZE=%d", bigQueue))}
	tc.Arms = []tracingArm{{Name: "off"}, {Name: "on", Env: traced.env}, {Name: "on, big queue", Env: big.env}}
	arms := []*tracedTrial{nil, traced, big}
	for trial := range trials {
		// Rotate which arm runs first.
		order := []int{0, 1, 2}
		for range trial % 3 {
			order = append(order[1:], order[0])
		}
		runs := make([]burnDown, 3)
		for _, a := range order {
			o := trialOpts{label: fmt.Sprintf("tr%d", a), trial: trial, processes: procs, n: n, maxWorkers: tc.MaxWorkers, traced: arms[a]}
			reqs0, bytes0, spans0 := rcv.Received()
			var err error
			if runs[a], err = e.shardrunBurnDown(ctx, o); err != nil {
				return fmt.Errorf("tracing %s: %w", tc.Arms[a].Name, err)
			}
			if arms[a] == nil {
				continue
			}
			if err := producer.ForceFlush(ctx); err != nil {
				return fmt.Errorf("flushing the producer's spans: %w", err)
			}
			reqs, bytes, spans := rcv.Received()
			arm := &tc.Arms[a]
			arm.ExportRequests = append(arm.ExportRequests, reqs-reqs0)
			arm.SpansPerTask = append(arm.SpansPerTask, float64(spans-spans0)/float64(n))
			arm.BytesPerTask = append(arm.BytesPerTask, float64(bytes-bytes0)/float64(n))
		}
		line := fmt.Sprintf("  tracing, round %d:", trial+1)
		for a := range tc.Arms {
			arm := &tc.Arms[a]
			arm.TasksPerS = append(arm.TasksPerS, runs[a].TasksPerS)
			arm.Ratios = append(arm.Ratios, runs[a].TasksPerS/runs[0].TasksPerS)
			arm.cpu = append(arm.cpu, runs[a].CPUWorkersPer10k)
			line += fmt.Sprintf(" %s %.0f tasks/s (%.3f)", arm.Name, runs[a].TasksPerS, runs[a].TasksPerS/runs[0].TasksPerS)
			if len(arm.SpansPerTask) > 0 {
				line += fmt.Sprintf(" %.2f spans/task", arm.SpansPerTask[len(arm.SpansPerTask)-1])
			}
			line += ";"
		}
		tc.Trials = append(tc.Trials, runs...)
		fmt.Fprintln(e.log, line)
	}
	for a := range tc.Arms {
		arm := &tc.Arms[a]
		arm.MedianTasks, arm.MedianRatio, arm.CPUWorkers = median(arm.TasksPerS), median(arm.Ratios), median(arm.cpu)
	}
	return nil
}
